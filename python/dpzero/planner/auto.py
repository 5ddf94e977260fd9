"""``make_private(..., policy="auto")``: profile the model, rank the policies, take the best that
fits. The ranks profile copies of the model together (Note [planner profile]); rank 0's choice
is broadcast, so all ranks shard alike.
The policies change only where tensors live and when they are computed, never the private step
(tests/python/test_checkpointing.py, test_zero.py's offload test), so choosing one changes no
result."""

from __future__ import annotations

import copy
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .. import _C
from ..private.config import PrivateConfig
from ..zero import default_units
from .model import Prediction, plan
from .profile import profile


def default_budget(device: torch.device, local_ranks: int) -> float:
    """Bytes one rank may use: the GPU's memory, or on CPU the available RAM over the ranks on
    this machine."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    return psutil.virtual_memory().available / max(1, local_ranks)


def first_batch(dataset, size: int, collate_fn):
    """The first ``size`` examples as one batch (what the planner profiles)."""
    rows = [dataset[i] for i in range(min(size, len(dataset)))]
    if collate_fn is None:
        collate_fn = torch.utils.data.default_collate
    return collate_fn(rows)


def choose(model: nn.Module, batch, plan_step: Callable, batch_size: int, *,
           unit_names: Sequence[str], clipping: str, mixed_precision, optimizer: str,
           optimizer_kwargs: dict, group, memory_budget: Optional[float], bands: int = 1
           ) -> Tuple[Prediction, List[Prediction]]:
    """(the chosen prediction, every prediction ranked) for this model on ``group``'s ranks."""
    device = next(model.parameters()).device
    world = group.size() if group is not None else 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    threads = max(1, (os.cpu_count() or 1) // local) if device.type == "cpu" else None
    prof = profile(lambda: copy.deepcopy(model), lambda m: plan_step(m, batch), batch_size,
                   units=unit_names, clipping=clipping, mixed_precision=mixed_precision,
                   optimizer=optimizer, optimizer_kwargs=optimizer_kwargs, device=str(device),
                   threads=threads, group=group)
    budget = memory_budget if memory_budget is not None else default_budget(device, local)
    ranked = plan(prof, world, budget, accelerator=device.type == "cuda", bands=bands)
    best = ranked[0]
    if best.peak_bytes > budget:
        smallest = min(ranked, key=lambda r: r.peak_bytes)
        raise ValueError(
            f"policy='auto': no memory policy fits memory_budget={budget / 2**30:.2f} GiB per "
            f"rank; the smallest predicted peak is {smallest.peak_bytes / 2**30:.2f} GiB "
            f"({smallest.policy.label(len(prof.units))}). Use more ranks, a smaller "
            "max_physical_batch_size, or a larger budget")
    if world > 1:  # every rank takes rank 0's choice
        # In C++, not torch.distributed: see python/csrc/comm_bindings.cpp.
        index = _C.comm.broadcast(group if group is not None else dist.group.WORLD,
                                  [ranked.index(best)], 0)
        best = ranked[index[0]]
    return best, ranked


def auto_policy(model: nn.Module, config: PrivateConfig, plan_step: Callable,
                memory_budget: Optional[float]) -> Tuple[PrivateConfig, Dict[str, Any]]:
    """policy='auto': ``config`` with the chosen zero_stage, activation_checkpointing and
    offload_optimizer, and what ``PrivacyEngine.memory_plan`` reports (the choice, the ranking, the
    units)."""
    c = config
    unit_names = list(c.units) if c.units is not None else default_units(model)
    micro = int(c.max_physical_batch_size or
                max(1, round(c.sample_rate * c.dataset_size / c.bands)))  # the expected batch
    group = c.process_group if c.process_group is not None else (
        dist.distributed_c10d._get_default_group()
        if dist.is_available() and dist.is_initialized() else None)
    best, ranked = choose(
        model, first_batch(c.dataset, micro, c.collate_fn), plan_step, micro,
        unit_names=unit_names, clipping=c.clipping, mixed_precision=c.mixed_precision,
        optimizer=c.optimizer, optimizer_kwargs=c.optimizer_options, group=group,
        memory_budget=memory_budget, bands=c.bands)
    chosen = best.policy.make_private_kwargs(unit_names)
    options = dict(c.optimizer_options)
    if chosen.get("offload_optimizer"):
        options["offload_optimizer"] = True
    config = c.replace(zero_stage=chosen["zero_stage"],
                       activation_checkpointing=chosen.get("activation_checkpointing"),
                       optimizer_options=options)
    return config, dict(chosen=best, ranked=ranked, units=unit_names)
