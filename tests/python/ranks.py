"""The one way tests start ranks (design.md §6 "Multi-rank"): real processes over a real Gloo
process group on loopback, or a script under torch's own launcher.

``spawn(fn, world_size, tmp_path, *args)`` runs ``fn(rank, world_size, *args)`` on each of
``world_size`` processes inside an initialised Gloo group and returns each rank's result, in rank
order. ``fn`` must be a module-level function (the processes import it by name). ``gloo_group``
is the group itself, for tests that start processes their own way (a rank killed on purpose).
``torchrun`` runs a script under ``torch.distributed.run --standalone``.

The group meets over a file store in the test's own tmp_path, not a TCP port: no port to choose
that another process on the machine could take first.

The ranks are forked from a forkserver that has imported torch and dpzero once for the whole
test session, rather than started fresh (each fresh rank would import them again, and W ranks
share the machine's cores while they do). The forkserver is a clean process
that runs nothing but those imports, so each rank still starts from no state of the test's; it
gets the test's environment as it is at the spawn (a forkserver child would otherwise keep the
server's), and multiprocessing gives it the test's working directory and sys.path.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import multiprocessing
import os
import subprocess
import sys
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_runs = itertools.count()
# Before the forkserver's first start (it then lives as long as this process).
multiprocessing.set_forkserver_preload(["torch", "dpzero"])


@contextlib.contextmanager
def gloo_group(rank: int, world_size: int, store: str, timeout_s: float = 300.0):
    """torch.distributed's default group over Gloo for this rank, destroyed on the way out. One
    intra-op thread per rank: the ranks share the machine's cores."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rank(rank: int, fn: Callable, world_size: int, store: str, out: str, timeout_s: float,
          env: dict, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    with gloo_group(rank, world_size, store, timeout_s):
        result = fn(rank, world_size, *args)
    torch.save(result, f"{out}.{rank}")


def spawn(fn: Callable, world_size: int, tmp_path, *args, timeout_s: float = 300.0) -> List[Any]:
    """[fn(rank, world_size, *args) for each rank], each computed in its own process."""
    run = next(_runs)
    store, out = tmp_path / f"ranks_store_{run}", tmp_path / f"ranks_result_{run}"
    mp.start_processes(_rank, args=(fn, world_size, str(store), str(out), timeout_s,
                                    dict(os.environ), args),
                       nprocs=world_size, join=True, start_method="forkserver")
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world_size)]


def torchrun(script_and_args: Sequence[str], nproc: int, *, env: Optional[dict] = None,
             timeout: float = 300.0, cwd=None) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node=nproc`` on a script, with
    one intra-op thread per rank unless ``env`` says otherwise; the completed process (stdout and
    stderr captured as text)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", *map(str, script_and_args)],
                          env=full_env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
