"""A short profile of the real model: what the memory and time model (``model.py``) is fed.

Note [planner profile]
~~~~~~~~~~~~~~~~~~~~~~
The profile runs the user's model on one micro-batch of the planned size, under the user's
clipping mode, precision and optimizer — with no activation checkpointing and with every unit
checkpointed — on the planned run's ranks at ZeRO stage 2 (on one rank: stage 0), so that what
depends on the ranks (communication buffers, the gradient shard, the reductions' waiting
buffers) is in what it measures (``measure.tracked``; the largest over the ranks). On several
ranks, probes at stages 1 and 3 (again with and without checkpointing) measure their transients
too, for memory only: each stage's step peaks at its own moment with its own buffers (stage 1
holds no gradient shards during the backward — its gradients are in the persistent buffer —
stage 3 holds gathered units), and predicting one stage's transient from another's was off by up
to 19% on the CPU grid:

  between    live tensor bytes between two steps (model state + what stays allocated);
  workspace  between minus the model state by ZeRO's formulas at the probes' stage: what stays
             allocated across steps besides it (the CPU ghost kernels' per-thread scratch,
             Note [cpu scratch] in kernels/cpu/ghost_norm.cpp; cached communication buffers).
             The scratch is allocated once per process, so the profile must run in a process
             that has not trained yet;
  transient  peak live bytes during a step above ``between``: activations, the DP book's stored
             A and G, per-sample norms, the loss's temporaries, gathered parameters;
  backward_end  live bytes above ``between`` when the backward has returned (before the
             optimizer step): what is left of the step then;
  transient_at  the same at stages 1 and 3; stage 3's includes the units gathered at the peak
             (the root unit, which encloses the forward, the running unit and the prefetched
             one; Note [early release] in src/dp/book.h) and their gathers' buffers;
  times      forward + backward and optimizer step, median over a few steps.

Per unit (a ZeRO unit, in forward order) it also counts the bytes autograd saves inside the unit
and the bytes of the unit's inputs (saved-tensor hooks, each storage once), and times the unit's
forward: checkpointing unit u frees (saved_u - input_u) and costs one more forward of u.
The model state of other stages is the model's to predict (formulas), not measured; collective
bandwidth comes from ``measure_collectives`` on the real process group (or a spawned one of the
planned size; ``profile`` measures it on the ranks it runs on).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..private.config import resolve
from ..private.engine import make_private_from_config
from ..zero import default_units
from .measure import tracked
from .state import state_between


@dataclass
class UnitProfile:
    name: str
    params: int          # trainable parameters
    saved_bytes: int     # bytes autograd saves inside the unit's forward (the micro-batch)
    input_bytes: int     # bytes of its tensor inputs (what a checkpoint keeps)
    forward_s: float


@dataclass
class Profile:
    micro_batch: int
    device: str
    threads: int
    clipping: str
    param_bytes: int               # bytes per parameter in the compute dtype
    optimizer_bytes: int           # optimizer state bytes per parameter (fp32 master included)
    params: int                    # trainable parameters of the model
    units: List[UnitProfile]
    between: Dict[str, int]        # "none" / "all": live bytes between steps at stage 0, W = 1
    workspace: int                 # persistent bytes of the private path (see the Note)
    transient: Dict[str, int]      # "none" / "all": peak above between during a step
    backward_end: Dict[str, int]   # "none" / "all": live above between when the backward ends
    compute_s: Dict[str, float]    # "none" / "all": forward + backward of one micro-batch
    optimizer_s: float             # the optimizer step over all parameters (stage 0)
    bandwidth: Dict[int, Tuple[float, float]] = field(default_factory=dict)
    # world size -> (bytes/s, seconds per collective) for all-gather / reduce-scatter
    terms: Dict[str, int] = field(default_factory=dict)  # a shape profile's estimate parts
    world: int = 1                 # ranks the probes ran on
    stage: int = 0                 # the probes' ZeRO stage (0 on one rank, 2 on several)
    # stage -> "none" / "all": the transient profiled at other stages (on several ranks: 1 and 3)
    transient_at: Dict[int, Dict[str, int]] = field(default_factory=dict)
    gathered: int = 0              # a shape profile's stage-3 gathered units (Note [shape profile])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        d = dict(d)
        d["units"] = [UnitProfile(**u) for u in d["units"]]
        d["bandwidth"] = {int(k): tuple(v) for k, v in d.get("bandwidth", {}).items()}
        d["transient_at"] = {int(k): dict(v) for k, v in d.get("transient_at", {}).items()}
        return cls(**d)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def storage_key(t: torch.Tensor):
    """One key per storage while it lives (its StorageImpl; data pointers coincide on the meta
    device and for empty storages)."""
    try:
        return t.untyped_storage()._cdata
    except RuntimeError:  # tensors without storage (wrapper subclasses)
        return id(t)


def storage_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except RuntimeError:
        return t.numel() * t.element_size()


def unit_profiles(model: nn.Module, unit_names: Sequence[str], run: Callable[[], torch.Tensor],
                  device: torch.device) -> List[UnitProfile]:
    """Per unit: saved bytes, input bytes, forward time of one plain forward (no DP, no
    sharding: what a unit's own computation saves). ``run`` does forward and loss."""
    modules = {name: model.get_submodule(name) for name in unit_names}
    stack: List[str] = []
    saved: Dict[str, int] = {n: 0 for n in unit_names}
    inputs: Dict[str, int] = {n: 0 for n in unit_names}
    times: Dict[str, float] = {n: 0.0 for n in unit_names}
    started: Dict[str, float] = {}
    # parameters (and views of them, e.g. a transposed weight) are model state, not activations
    seen = {storage_key(p) for p in model.parameters()}

    def pre(name, _module, args):
        stack.append(name)
        inputs[name] += sum(storage_bytes(a) for a in args if isinstance(a, torch.Tensor))
        _sync(device)
        started[name] = time.perf_counter()

    def post(name, _module, _args, _out):
        _sync(device)
        times[name] += time.perf_counter() - started[name]
        stack.pop()

    def pack(t):
        if stack:
            key = storage_key(t)
            if key not in seen:
                seen.add(key)
                saved[stack[-1]] += storage_bytes(t)
        return t

    handles = []
    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: pre(n, m, a)))
        handles.append(module.register_forward_hook(lambda m, a, o, n=name: post(n, m, a, o)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = run()
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    out = []
    for name, module in modules.items():
        n = sum(p.numel() for p in module.parameters() if p.requires_grad)
        out.append(UnitProfile(name, n, saved[name], inputs[name], times[name]))
    return out


def _local_group():
    """A one-rank process group for the probes when this process is part of a job (the probes
    must not talk to the other ranks)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    import os
    import tempfile

    from ..zero import new_process_group

    path = os.path.join(tempfile.mkdtemp(prefix="dpzero-plan-"), "store")
    return new_process_group("gloo", f"file://{path}", 0, 1)


class _OwnBatches(nn.Module):
    """The private model as ``forward_loss`` sees it in a probe: each call's inputs are handed
    in through ``own_batch`` (Note [batch provenance]; the probes' steps are the planner's own,
    on a throwaway engine), ``logical`` examples per step over all ranks. Attributes not found
    here are the model's."""

    def __init__(self, private, logical: int) -> None:
        super().__init__()
        self.__dict__["_private"], self.__dict__["_logical"] = private, logical

    def forward(self, *args, **kwargs):
        args, kwargs = self._private.privacy_engine.own_batch(
            (args, kwargs), logical_batch_size=self._logical)
        return self._private.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.__dict__["_private"].model, name)


def profile(make_model: Callable[[], nn.Module], forward_loss: Callable[[nn.Module], torch.Tensor],
            batch_size: int, *, units: Optional[Sequence[str]] = None, clipping: str = "flat",
            mixed_precision=None, optimizer: str = "adamw", optimizer_kwargs: Optional[dict] = None,
            device: str = "cpu", threads: Optional[int] = None, steps: int = 3,
            group=None, private_kwargs: Optional[dict] = None) -> Profile:
    """Note [planner profile]. ``make_model()`` builds a fresh model on ``device`` each call;
    ``forward_loss(model)`` runs one micro-batch of ``batch_size`` examples through it and
    returns the loss. ``threads``: torch threads during the probes (the per-rank share of the
    cores the planned run will have). ``group``: the planned run's process group (every rank
    calls ``profile``); the probes then run on it at stage 2, else on one rank at stage 0."""
    dev = torch.device(device)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        model = make_model()
        unit_names = list(units) if units is not None else default_units(model)
        model.train()
        per_unit = unit_profiles(model, unit_names, lambda: forward_loss(model), dev)
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        del model
        world = dist.get_world_size(group) if group is not None else 1
        if world == 1:
            group = _local_group()
        stage = 2 if world > 1 else 0
        b = int(batch_size)
        dataset = torch.utils.data.TensorDataset(torch.zeros(b * world, 1))
        values = {}  # name -> float, reduced (max) over ranks at the end
        opt_times = []
        # (label, checkpointed units, stage): the timed probes at the profile's stage first, then
        # on several ranks the memory-only probes of stages 1 and 3
        probes = [("none", None, stage), ("all", list(unit_names), stage)]
        if world > 1:
            probes += [(f"{c}@{s}", u, s) for s in (1, 3)
                       for c, u in (("none", None), ("all", list(unit_names)))]
        for label, ckpt, probe_stage in probes:
            # The previous probe's engine sits in reference cycles (hooks): collected now, not
            # at some moment inside this probe's measured step, where its frees would make the
            # live bytes before the step (``between``) too high and the transient too low.
            gc.collect()
            with tracked(device) as t:
                model = make_model()
                config = resolve(
                    accountant="prv", dataset=dataset, sample_rate=1.0, noise_multiplier=1.0,
                    max_grad_norm=1.0, clipping=clipping, zero_stage=probe_stage,
                    units=unit_names,
                    mixed_precision=mixed_precision, optimizer=optimizer, seed=0,
                    activation_checkpointing=ckpt, process_group=group,
                    **(optimizer_kwargs or {}), **(private_kwargs or {}))
                p = make_private_from_config(model, config)

                own = _OwnBatches(p, b * world)

                def step(mark=None):
                    p.optimizer.zero_grad()
                    _sync(dev)
                    t0 = time.perf_counter()
                    forward_loss(own).backward()
                    _sync(dev)
                    t1 = time.perf_counter()
                    if mark is not None:
                        mark()
                    p.optimizer.step()
                    _sync(dev)
                    return t1 - t0, time.perf_counter() - t1

                for _ in range(2):
                    step()
                ends = []
                if dev.type == "cpu":
                    t.mark("steps")
                    step(lambda: t.mark("backward_end"))
                else:
                    start = torch.cuda.memory_allocated(dev)
                    torch.cuda.reset_peak_memory_stats(dev)
                    step(lambda: ends.append(torch.cuda.memory_allocated(dev)))
                    peak = torch.cuda.max_memory_allocated(dev) - start
            sharded = p.privacy_engine.sharded
            if dev.type == "cpu":
                between = t.live_at("steps")
                values[f"transient.{label}"] = t.peak_since("steps") - between
                values[f"backward_end.{label}"] = t.live_at("backward_end") - between
            else:
                between = start
                values[f"transient.{label}"] = peak
                values[f"backward_end.{label}"] = ends[0] - start
            values[f"between.{label}"] = between
            if probe_stage == stage:  # the stage-3 probe is for its memory only
                timings = [step() for _ in range(steps)]
                values[f"compute.{label}"] = statistics.median(f for f, _ in timings)
                opt_times += [o for _, o in timings]
                elt = torch.empty((), dtype=sharded.param_dtype).element_size()
                opt_bytes = sharded.optimizer_bytes_per_param
            del p, model
        values["optimizer"] = statistics.median(opt_times)
        if world > 1:  # the slowest rank, the largest memory
            keys = sorted(values)
            packed = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
            if dist.get_backend(group) == "nccl":
                packed = packed.cuda()
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
            values = dict(zip(keys, packed.cpu().tolist()))
        # The state the probes' engine held between steps, by the formulas (model.py), is what
        # the workspace is measured against.
        state = state_between(params, elt, opt_bytes, stage, world)
        workspace = max(0, int(values["between.none"]) - sum(state.values()))
        pick = lambda name: {k: values[f"{name}.{k}"] for k in ("none", "all")}  # noqa: E731
        bandwidth = {world: measure_collectives(group, device)} if world > 1 else {}
        return Profile(micro_batch=b, device=str(dev), threads=torch.get_num_threads(),
                       clipping=clipping, param_bytes=elt, optimizer_bytes=opt_bytes,
                       params=params, units=per_unit,
                       between={k: int(v) for k, v in pick("between").items()},
                       workspace=workspace,
                       transient={k: int(v) for k, v in pick("transient").items()},
                       backward_end={k: int(v) for k, v in pick("backward_end").items()},
                       compute_s=pick("compute"), optimizer_s=values["optimizer"],
                       world=world, stage=stage, bandwidth=bandwidth,
                       transient_at={s: {k: int(values[f"transient.{k}@{s}"])
                                         for k in ("none", "all")}
                                     for s in (1, 3) if f"transient.none@{s}" in values})
    finally:
        torch.set_num_threads(old_threads)


def measure_collectives(group=None, device: str = "cpu", nbytes: int = 8 << 20,
                        repeats: int = 5) -> Tuple[float, float]:
    """(bytes/s, seconds of latency) of all-gather on ``group`` (all ranks call it): timed at
    ``nbytes`` and at 4 KiB per rank, the line through the two points."""
    world = dist.get_world_size(group)
    dev = torch.device(device)

    def timed(n):
        shard = torch.ones(max(1, n // 4 // world), device=dev)
        out = torch.empty(shard.numel() * world, device=dev)
        dist.all_gather_into_tensor(out, shard, group=group)
        times = []
        for _ in range(repeats):
            dist.barrier(group=group)
            _sync(dev)
            t0 = time.perf_counter()
            dist.all_gather_into_tensor(out, shard, group=group)
            _sync(dev)
            times.append(time.perf_counter() - t0)
        # every rank agrees on the slowest (a collective ends when its last rank does)
        value = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return float(value), out.numel() * 4 * (world - 1) / world

    small_t, small_b = timed(4096 * world)
    big_t, big_b = timed(nbytes)
    slope = max((big_t - small_t) / max(big_b - small_b, 1), 1e-12)
    latency = max(small_t - slope * small_b, 0.0)
    return 1.0 / slope, latency
