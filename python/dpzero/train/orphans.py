"""Processes of a training job that must not outlive it.

Note [orphan ranks]
~~~~~~~~~~~~~~~~~~~
torchrun starts each rank in a session of its own, so a ``kill -9`` of the launcher or of
torchrun used to leave the ranks running as orphans: still training, still appending to the
ledger and writing checkpoints, racing the run a user resumes in the same directory. So every
process below ``dpzero train`` asks Linux to SIGKILL it when its parent dies
(``PR_SET_PDEATHSIG``; it survives ``exec``): torchrun through ``preexec_fn`` in ``launch.py``,
each rank at the start of ``worker.main``. The launcher also holds a lock on the run directory
for the whole job, so a second job there (a ``--resume`` while the first still runs) is refused.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> None:
    """SIGKILL this process when its parent exits (Linux; a no-op elsewhere). Safe to call
    between fork and exec (``subprocess``'s ``preexec_fn``)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the request: nobody would kill us
        os.kill(os.getpid(), signal.SIGKILL)
