"""The agreements Python makes across ranks: rank 0's seed, settings and ledger state, a probe or refusal
of the root forward, being between steps. The step's own agreement is in its transaction
(src/dp/private_step.h, Note [one agreement per step]).

The values cross ranks through the C++ collectives of ``python/csrc/comm_bindings.cpp``
(not ``torch.distributed`` from Python: Note [work references] there). A failure of the process group
(c10d raises a RuntimeError: a timeout, a closed connection) becomes a :class:`CollectiveError`
that names this rank, the step and what was being agreed. With one rank (or no process group) nothing is sent.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Callable, Dict, List

from .. import _C
from ..noise import as_int64
from .errors import BudgetExhausted, CollectiveError, PrivacyViolation



class RankAgreements:
    """The agreements of one run on ``group`` (None: one process). ``step_of()``: the step the
    run is at, for the errors."""

    def __init__(self, group, step_of: Callable[[], int]) -> None:
        self.group = group
        self.rank = group.rank() if group is not None else 0
        self.world_size = group.size() if group is not None else 1
        self._step_of = step_of

    def collective(self, what: str, fn, *args, **kwargs):
        """fn(*args, **kwargs), a collective made before any step is charged (the step's own are
        in its transaction), its failure a CollectiveError."""
        try:
            return fn(*args, **kwargs)
        except (PrivacyViolation, BudgetExhausted, CollectiveError):
            raise
        except RuntimeError as e:
            first = (str(e).strip().splitlines() or [""])[0]
            error = CollectiveError(_C.dp.collective_error_text(
                self.rank, self.world_size, self._step_of(), what, False,
                f"{type(e).__name__}: {first}"))
            error.charged = False
            raise error from e

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any."""
        return bool(self.all_reduce([int(bool(flag))])[0])

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` (an integer of 64 bits) on every rank."""
        if self.group is None or self.world_size == 1:
            return value
        return _C.comm.broadcast(self.group, [as_int64(value)], 0)[0] & ((1 << 64) - 1)

    def same_everywhere(self, settings: Dict[str, Any]) -> None:
        """Raises ValueError on every rank unless every rank has rank 0's ``settings`` (name ->
        a number, a string, a bool or None), naming the first that differs on this rank."""
        if self.group is None or self.world_size == 1:
            return
        mine = [_setting_bits(v) for v in settings.values()]
        first = _C.comm.broadcast(self.group, mine, 0)
        differs = [name for name, a, b in zip(settings, mine, first) if a != b]
        if self.any_rank(bool(differs)):
            if differs:
                raise ValueError(f"{differs[0]}={settings[differs[0]]!r} on rank {self.rank} "
                                 "differs from rank 0's; every rank must make the model private "
                                 "with the same settings")
            raise ValueError("another rank's privacy settings differ from rank 0's; every rank "
                             "must make the model private with the same settings")

    def all_reduce(self, values: List[int]) -> List[int]:
        """The elementwise sum of ``values`` over the ranks."""
        if self.group is None or self.world_size == 1:
            return values
        return _C.comm.all_reduce_sum(self.group, values)


def _setting_bits(value) -> int:
    """A setting as 64 bits: a float's IEEE bits, an integer's value, a string's CRC-32."""
    if value is None:
        return -1
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return as_int64(value)
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return zlib.crc32(str(value).encode())
