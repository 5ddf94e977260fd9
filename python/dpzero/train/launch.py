"""Starting a training job's ranks: in this process for one rank, else torchrun-style.

For W > 1 ranks, ``launch`` runs ``python -m torch.distributed.run --standalone
--nproc-per-node W -m dpzero.train.worker CONFIG`` (torch's own elastic launcher: a rendezvous on
a free local port, one process per rank, every rank killed if one fails) and waits for it. Each
worker joins the default process group — Gloo on CPU, NCCL when CUDA is available — and runs
``runner.run_job``. The CPU cores are split between the ranks (OMP_NUM_THREADS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict

from .config import RunConfig, load
from .runner import run_job


def launch(config_path: str, cfg: RunConfig = None) -> Dict:
    cfg = cfg or load(config_path)
    world = cfg.training.world_size
    if world == 1:
        return run_job(cfg)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", "-m", "dpzero.train.worker", config_path]
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the {world} training ranks failed (exit status {proc.returncode}); "
                           "the ranks' errors are printed above")
    with open(os.path.join(cfg.output.dir, "result.json")) as f:
        return json.load(f)
