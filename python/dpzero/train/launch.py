"""Starting a training job's ranks: in this process for one rank, else torchrun-style.

For W > 1 ranks, ``launch`` runs ``python -m torch.distributed.run --standalone
--nproc-per-node W -m dpzero.train.worker CONFIG`` (torch's own elastic launcher: a rendezvous on
a free local port, one process per rank, every rank killed if one fails) and waits for it. Each
worker joins the default process group — NCCL when the ranks train on GPUs (``[training]
device``, task.device_kind), else Gloo — and runs ``runner.run_job``. The CPU cores are split
between the ranks (OMP_NUM_THREADS).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from typing import Dict

from ..files import write_atomically
from .config import ConfigError, RunConfig, load
from .orphans import die_with_parent
from .report import PRIVATE_DIR
from .runner import check_run_dir, run_job
from .task import device_kind, ranks_here, unused_gpus


@contextmanager
def directory_lock(run_dir: str, job: str = "dpzero train job"):
    """Note [orphan ranks] (orphans.py): one job at a time per run directory (``job`` names the
    kind in the refusal). The lock is the kernel's (flock), so it goes when its holder dies,
    kill -9 included."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise ConfigError(f"the directory {run_dir!r} is in use by another {job} (pid "
                              f"{holder}); wait for it to end or stop it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def launch(config_path: str, cfg: RunConfig = None, resume: bool = False) -> Dict:
    """Run the job of ``config_path`` (``cfg``: its parsed form, possibly overridden);
    ``resume`` continues a killed run in the same directory (Note [resuming a run])."""
    cfg = cfg or load(config_path)
    with directory_lock(cfg.output.dir):
        # Before any rank starts: a clear error, not W failed ranks.
        check_run_dir(cfg, resume)
        ranks = ranks_here(cfg)
        device_kind(cfg.training.device, ranks)
        notice = unused_gpus(cfg.training.device, ranks)
        if notice:
            print(notice, file=sys.stderr)
        return _launch(config_path, cfg, resume)


def launch_config(cfg: RunConfig, resume: bool = False) -> Dict:
    """Run ``cfg`` (a config changed after loading: overrides from the command line, a sweep's
    values). The ranks read it from a copy, ``config.toml`` in the run directory."""
    check_run_dir(cfg, resume)
    os.makedirs(cfg.output.dir, exist_ok=True)
    path = os.path.join(cfg.output.dir, "config.toml")
    write_atomically(path, lambda f: f.write(to_toml(cfg.to_dict())), binary=False)
    return launch(path, cfg, resume)


def to_toml(d: dict) -> str:
    """A config's dict (RunConfig.to_dict) as TOML; JSON scalars and lists are valid TOML."""
    lines = []
    for section, values in d.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                continue
            lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    return "\n".join(lines)


def _launch(config_path: str, cfg: RunConfig, resume: bool) -> Dict:
    world = cfg.training.world_size
    if world == 1:
        return run_job(cfg, resume)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", "-m", "dpzero.train.worker", config_path]
    if resume:
        cmd.append("--resume")
    proc = subprocess.run(cmd, env=env, preexec_fn=die_with_parent)  # Note [orphan ranks]
    if proc.returncode != 0:
        raise RuntimeError(f"the {world} training ranks failed (exit status {proc.returncode}); "
                           "the ranks' errors are printed above")
    with open(os.path.join(cfg.output.dir, "result.json")) as f:
        results = json.load(f)
    baseline = os.path.join(cfg.output.dir, PRIVATE_DIR, "baseline.json")
    if cfg.training.baseline and os.path.exists(baseline):  # as run_job returns it
        with open(baseline) as f:
            results["baseline"] = json.load(f)
    return results
