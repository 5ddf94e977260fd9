"""What dpzero holds until the interpreter exits, and how it lets go there.

Note [ending a script]
~~~~~~~~~~~~~~~~~~~~~~
A sharded model and a private engine hold C++ state (the ZeRO state, the clipping book, the
step) that holds the run's process group. An ordinary script ends without freeing any of it, and
torch.distributed's process groups are then destroyed during interpreter finalization, if at
all. A Gloo group destroyed there can abort the process ("terminate called without an active
exception"): its worker threads still hold finished work whose tensors need the interpreter
that is being torn down. So a script that trained correctly could exit non-zero on one rank.

The first object ``track`` registers installs one ``atexit`` handler (atexit runs while the
interpreter is whole, and handlers run last-registered first, so this one runs after the user's
handlers registered later). It
1. retires every live engine and sharded model (the function each handed ``track``: drop the
   references to the C++ state; the engine's optimizer and loader refuse to run afterwards, as
   after ``detach``),
2. collects the garbage, so the C++ objects and their references to the group go now,
3. destroys torch.distributed's process groups, if any are initialised, and collects again.
None of this is a collective: no rank waits for another, so a rank whose peer already exited
ends too. Nothing is released to anyone (no state dict, no checkpoint), so nothing is verified.

A script that is ending because of an uncaught exception is left alone: its collectives may be
mid-flight, and destroying a group waits for queued work, so a release could hang on a peer
instead of letting the launcher end the job. Groups made by ``dpzero.zero.new_process_group``
belong to the caller's variables, which the interpreter frees in its own time.
"""

from __future__ import annotations

import atexit
import gc
import sys
import weakref
from typing import Any, Callable

import torch.distributed as dist

# The live objects, each with the function that retires it (its class's own, handed over by the
# class's module).
_live: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_installed = False


def track(obj, release: Callable[[Any], None]) -> None:
    """Calls ``release(obj)`` at interpreter exit, if ``obj`` still lives."""
    global _installed
    _live[obj] = release
    if not _installed:
        atexit.register(release_all)
        _installed = True


def release_all() -> None:
    """The atexit handler of Note [ending a script]."""
    if getattr(sys, "last_value", None) is not None:  # ending on an uncaught exception
        return
    for obj, release in list(_live.items()):
        release(obj)
    _live.clear()
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
