"""Every agreement the private step makes across ranks, in one place: a refusal on any rank, the
logical batch's figures, rank 0's seed and ledger state, the noisy update's completion.

The values cross ranks through the C++ collectives of ``python/csrc/comm_bindings.cpp`` (not
``torch.distributed`` from Python: Note [work references] there). A failure of the process group
(c10d raises a RuntimeError: a timeout, a closed connection) becomes a :class:`CollectiveError`
that names this rank, the step, what was being agreed and whether the step was already charged
to the ledger. With one rank (or no process group) nothing is sent.
"""

from __future__ import annotations

from typing import Callable, List

import torch.distributed as dist

from .. import _C
from ..noise import _as_int64
from .book import PrivacyViolation


class BudgetExhausted(RuntimeError):
    """The next step would spend more than the run's ε budget; nothing was charged or applied."""


class CollectiveError(RuntimeError):
    """A collective of the private step failed on this rank: a peer rank died, hung past the
    process group's timeout (``torch.distributed.init_process_group(timeout=...)``), or lost its
    connection. The message says whether the step had been charged to the ledger."""


class RankAgreements:
    """The agreements of one run on ``group`` (None: one process). ``step_of()``: the step the
    run is at, for the errors."""

    def __init__(self, group, step_of: Callable[[], int]) -> None:
        self.group = group
        self.rank = group.rank() if group is not None else 0
        self.world_size = group.size() if group is not None else 1
        self._step_of = step_of

    def collective(self, what: str, fn, *args, charged: bool = False, **kwargs):
        """fn(*args, **kwargs), a collective of the step, its failure a CollectiveError."""
        try:
            return fn(*args, **kwargs)
        except (PrivacyViolation, BudgetExhausted, CollectiveError):
            raise
        except RuntimeError as e:
            rank = dist.get_rank(self.group) if self.group is not None else 0
            state = ("the step was charged to the privacy ledger and was not applied on this "
                     "rank" if charged else "nothing was charged or applied on this rank")
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise CollectiveError(
                f"rank {rank} of {self.world_size}, step {self._step_of()}: {what} failed: a "
                f"peer rank died, hung past the process group's timeout, or lost its "
                f"connection; {state} ({type(e).__name__}: {first})") from e

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any."""
        return bool(self.all_reduce([int(bool(flag))])[0])

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` (an integer of 64 bits) on every rank."""
        if self.group is None or self.world_size == 1:
            return value
        return _C.comm.broadcast(self.group, [_as_int64(value)], 0)[0] & ((1 << 64) - 1)

    def all_reduce(self, values: List[int]) -> List[int]:
        """The elementwise sum of ``values`` over the ranks."""
        if self.group is None or self.world_size == 1:
            return values
        return _C.comm.all_reduce_sum(self.group, values)
