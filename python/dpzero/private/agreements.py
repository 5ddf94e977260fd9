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
        except (PrivacyViolation, BudgetExhausted, CollectiveError, _C.accounting.LedgerError):
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

    def same_everywhere(self, settings: Dict[str, Any]) -> None:
        """Raises ValueError on every rank unless every rank has rank 0's ``settings`` (name ->
        a number, a string, a bool or None), naming the first that differs on this rank
        (``agree_settings`` in src/dp/run.h)."""
        if self.group is None or self.world_size == 1:
            return
        _C.dp.agree_settings(as_agreed(settings), None, self.group)

    def start_run(self, settings: "_C.dp.RunSettings", own: Dict[str, Any], accountant):
        """The run's start on every rank (Note [one set of rules] in src/dp/run.h): the settings
        and ``own`` (this front door's, as for same_everywhere) agreed, the randomness, the
        ledger and the budget; a ``_C.dp.RunStart``."""
        return _C.dp.start_run(settings, as_agreed(own), accountant, self.group)

    def all_reduce(self, values: List[int]) -> List[int]:
        """The elementwise sum of ``values`` over the ranks."""
        if self.group is None or self.world_size == 1:
            return values
        return _C.comm.all_reduce_sum(self.group, values)


def as_agreed(settings: Dict[str, Any]) -> List[tuple]:
    """``settings`` as agree_settings takes them: (name, 64 bits, the value as shown)."""
    return [(name, _setting_bits(value), repr(value)) for name, value in settings.items()]


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
