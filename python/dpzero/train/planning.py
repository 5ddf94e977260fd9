"""``dpzero plan CONFIG``: the memory policies of a training job, predicted and ranked
(dpzero.planner), from the same model, data and settings ``dpzero train`` would use.

The profile runs on one micro-batch of the training set per rank with the per-rank share of the
cores: in this process for one rank, else on W spawned Gloo (CPU) or NCCL (GPU) processes of
this machine, which also measure the collectives' bandwidth.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
from typing import List, Optional, Tuple

import torch

from ..planner import Policy, Prediction, Profile, plan, profile
from ..planner.auto import default_budget
from .config import FIXED_FEATURE_KINDS, RunConfig


def _profile_rank(rank, world, store, kind, cfg, out):
    import torch.distributed as dist

    if kind == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", init_method=f"file://{store}",
                            rank=rank, world_size=world)
    try:
        prof = _profile(cfg, world, rank, dist.group.WORLD, kind)  # measures the bandwidth too
        if rank == 0:
            torch.save(prof.to_dict(), out)
        import gc

        gc.collect()
    finally:
        dist.destroy_process_group()


def _profile(cfg: RunConfig, world: int, rank: int, group, kind: str) -> Profile:
    """The profile on rank ``rank`` of ``world``, on its GPU when ``kind`` is "cuda"
    (task.device_kind), else on the CPU."""
    from .task import autocast, build, loss, on_device

    # One micro-batch per rank is all the profile reads, so the job is built on that many
    # training examples and one test example. A head on fixed features sees rows of one shape
    # whatever the example, so one example per rank, repeated to fill the micro-batch, costs the
    # same memory and time as any other, and the features (a transformer's or ScatterNet's
    # forward per example) are computed for those alone.
    d, cap = cfg.data, cfg.training.max_physical_batch_size
    fixed = cfg.model.kind in FIXED_FEATURE_KINDS
    need = world * (1 if fixed else cap)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(
        d, limit=min(d.limit, need) if d.limit else need, test_limit=1))
    model, train, _, unpack = build(cfg)
    device = torch.device("cuda", rank) if kind == "cuda" else torch.device("cpu")
    model.to(device)
    m = min(cap, d.limit or cap) if fixed else min(cap, len(train))
    rows = torch.arange(rank * m, (rank + 1) * m) % len(train)
    batch = on_device(unpack, device)(train[rows])
    threads = max(1, (os.cpu_count() or 1) // world) if device.type == "cpu" else None
    t = cfg.training
    return profile(lambda: copy.deepcopy(model),
                   lambda mod: loss(mod, batch, lambda: autocast(cfg, device)), m,
                   clipping=cfg.privacy.clipping, optimizer=t.optimizer,
                   optimizer_kwargs=dict(lr=t.lr, weight_decay=t.weight_decay,
                                         **({"momentum": t.momentum} if t.optimizer == "sgd"
                                            else {})),
                   device=str(device), threads=threads, group=group)


def job_plan(cfg: RunConfig, world: int, budget_bytes: Optional[float] = None
             ) -> Tuple[Profile, List[Prediction], float]:
    """(profile, ranked predictions, budget) for ``cfg``'s private run on ``world`` ranks: the
    profile runs on ``world`` fresh processes of this machine (Gloo on CPU, NCCL on GPUs)."""
    from .task import device_kind

    kind = device_kind(cfg.training.device, world)
    if world == 1:
        prof = _profile(cfg, 1, 0, None, kind)
    else:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "profile.pt")
            mp.spawn(_profile_rank, args=(world, os.path.join(tmp, "store"), kind, cfg, out),
                     nprocs=world, join=True)
            prof = Profile.from_dict(torch.load(out))
    device = torch.device(prof.device)
    budget = budget_bytes if budget_bytes is not None else default_budget(device, world)
    ranked = plan(prof, world, budget, accelerator=device.type == "cuda",
                  bands=cfg.privacy.bands)
    return prof, ranked, budget


def format_plan(prof: Profile, ranked: List[Prediction], budget: float, world: int,
                configured: Optional[Policy] = None) -> str:
    """The ranked table; ``configured``: the config's own policy, marked and compared."""
    # MiB, or KiB for a model whose every policy peaks below one MiB (a linear head).
    scale, unit = (2.0**20, "MiB") if max(r.peak_bytes for r in ranked) >= 2.0**20 \
        else (2.0**10, "KiB")
    units = len(prof.units)
    lines = [f"memory policies for W = {world} rank(s), micro-batch {prof.micro_batch}, "
             f"{prof.clipping} clipping, budget {budget / 2.0**20:,.0f} MiB per rank "
             f"(profiled on {prof.device}, {prof.threads} thread(s)):", "",
             f"{'policy':<22}{'peak ' + unit:>10}{'fits':>6}{'step ms':>10}{'samples/s':>11}   "
             f"peak = parameters + gradients + optimizer + workspace + transient + gathered "
             + ("+ noise history " if any("noise_history" in r.memory for r in ranked) else "")
             + f"({unit})"]
    for i, r in enumerate(ranked):
        fits = r.peak_bytes <= budget
        parts = " + ".join(f"{r.memory[k] / scale:.1f}" for k in
                           ("parameters", "gradients", "optimizer", "workspace", "transient",
                            "gathered", "noise_history") if k in r.memory)
        mark = "  <- best" if i == 0 and fits else ""
        if r.policy == configured:
            mark += "  <- the config's"
        lines.append(f"{r.policy.label(units):<22}{r.peak_bytes / scale:>10.1f}"
                     f"{'yes' if fits else 'no':>6}{1e3 * r.step_s:>10.1f}"
                     f"{prof.micro_batch / r.step_s:>11.1f}   {parts}{mark}")
    mine = [i for i, r in enumerate(ranked) if r.policy == configured]
    if mine and mine[0] > 0 and ranked[0].peak_bytes <= budget:
        best, own = ranked[0], ranked[mine[0]]
        lines += ["", f"the config's policy ({own.policy.label(units)}) is ranked {mine[0] + 1} "
                  f"of {len(ranked)}: {best.policy.label(units)} is predicted to take "
                  f"{1e3 * best.step_s:.1f} ms a step against {1e3 * own.step_s:.1f} ms, and "
                  "fits the budget (set [training] zero_stage, or policy = \"auto\" to let "
                  "dpzero train choose)"]
    return "\n".join(lines)
