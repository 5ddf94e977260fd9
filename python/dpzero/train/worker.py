"""One rank started by ``launch.py`` (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""

from __future__ import annotations

import datetime
import gc
import sys

import torch
import torch.distributed as dist

from .config import load
from .runner import run_job


def main(argv) -> int:
    if len(argv) != 1:
        print("usage: python -m dpzero.train.worker CONFIG", file=sys.stderr)
        return 2
    cfg = load(argv[0])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        import os

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # A dead or hung rank fails the others' collectives after this long (not never).
    dist.init_process_group(backend,
                            timeout=datetime.timedelta(seconds=cfg.training.timeout_s))
    try:
        run_job(cfg)
    finally:
        # Engines hold the group: free them first (docs/architecture.md, "Known limitations").
        gc.collect()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
