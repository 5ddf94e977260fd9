"""One rank started by ``launch.py`` (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT).

Each rank dies with its parent (Note [orphan ranks] in ``orphans.py``).
"""

from __future__ import annotations

import datetime
import gc
import os
import sys

import torch
import torch.distributed as dist

from .config import load
from .orphans import die_with_parent
from .runner import run_job
from .task import rank_device


def main(argv) -> int:
    die_with_parent()
    resume = "--resume" in argv
    args = [a for a in argv if a != "--resume"]
    if len(args) != 1:
        print("usage: python -m dpzero.train.worker CONFIG [--resume]", file=sys.stderr)
        return 2
    cfg = load(args[0])
    # [training] device: NCCL between GPUs, Gloo between CPU ranks.
    device = rank_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
    # A dead or hung rank fails the others' collectives after this long (not never).
    dist.init_process_group(backend,
                            timeout=datetime.timedelta(seconds=cfg.training.timeout_s))
    try:
        run_job(cfg, resume)
    finally:
        # Engines hold the group: free them first (docs/architecture.md, "Known limitations").
        gc.collect()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
