"""Failpoints: named places in a private step where a test can kill this process outright.

Note [failpoints]
~~~~~~~~~~~~~~~~~
Crash safety is a claim about what survives a ``kill -9`` at the worst moment: after the ledger
record of a step and before its update, say. Killing a process from outside at a chosen moment is
a race, so the engine names its moments and, when the environment variable ``DPZERO_FAILPOINT``
names one, sends itself SIGKILL there (no Python cleanup, no flush: the real thing). The value is
a comma-separated list of ``POINT@CHARGE`` or ``POINT@CHARGE@RANK``: CHARGE is the 0-based index
of the step's ledger charge (Note [noise index]), RANK the process group rank (any rank when
omitted). Points:

    before_ledger   the step was agreed on; nothing is recorded or applied yet
    after_ledger    the ledger holds the step (durably) and every rank knows; no update yet
    after_update    the noisy update is applied on this rank

Unset (the normal case) a failpoint costs one dictionary lookup per step.
"""

from __future__ import annotations

import os
import signal
from typing import Dict, Optional, Set, Tuple

ENV = "DPZERO_FAILPOINT"
POINTS = ("before_ledger", "after_ledger", "after_update")

_parsed: Optional[Tuple[str, Dict[Tuple[str, int], Set[Optional[int]]]]] = None


def _spec() -> Dict[Tuple[str, int], Set[Optional[int]]]:
    """{(point, charge): ranks (None = any)} for the current value of ``DPZERO_FAILPOINT``."""
    global _parsed
    raw = os.environ.get(ENV, "")
    if _parsed is not None and _parsed[0] == raw:
        return _parsed[1]
    spec: Dict[Tuple[str, int], Set[Optional[int]]] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        fields = item.split("@")
        if len(fields) not in (2, 3) or fields[0] not in POINTS:
            raise ValueError(f"{ENV}: {item!r} is not POINT@CHARGE[@RANK] with POINT one of "
                             f"{list(POINTS)}")
        try:
            charge = int(fields[1])
            rank = int(fields[2]) if len(fields) == 3 else None
        except ValueError:
            raise ValueError(f"{ENV}: {item!r}: CHARGE and RANK must be integers") from None
        spec.setdefault((fields[0], charge), set()).add(rank)
    _parsed = (raw, spec)
    return spec


def hit(point: str, charge: int, rank: int) -> None:
    """SIGKILL this process if ``DPZERO_FAILPOINT`` names (point, charge) for this rank."""
    spec = _spec()
    if not spec:
        return
    ranks = spec.get((point, charge))
    if ranks is not None and (None in ranks or rank in ranks):
        os.kill(os.getpid(), signal.SIGKILL)
