"""The experiments harness: a grid of training configurations, each system timed and measured on
the same model and batches, written as a results table (markdown + CSV + plots).

Rows. A row is one system on one model shape and world size:
  zero{s}[-bf16]          dpzero.shard, stage s, non-private (AdamW)
  dp{s}-{flat|layer}[-bf16]  dpzero.make_private on stage s (sigma 1, C 1, AdamW)
  fsdp2                   PyTorch FSDP2 (fully_shard per block + root), non-private
  opacus-hooks / opacus-ghost   Opacus 1.6 DP-SGD on one process (W = 1)
  opacus-ghost_fsdp       Opacus 1.6 fast gradient clipping on FSDP2 (W = 2)
"-bf16" rows compute in bfloat16 with fp32 master weights (dpzero's mixed_precision); "-ckpt"
rows (DP only) checkpoint every block (make_private's activation_checkpointing), "-ckpthalf"
rows the first half of them.

Model. GPT-2-style decoder (experiments/zero_bench.py's blocks: pre-LayerNorm, fused qkv Linear,
causal SDPA, GELU MLP 4d, tied LM head), with batched position ids so that every DP system sees
per-sample rows; mean token cross-entropy per sample, averaged over the batch (Opacus's and
dpzero's loss_reduction="mean"). Every system starts from the same weights (torch.manual_seed(0))
and is fed the same batches (fixed random token ids): rank r of W takes rows [r m, (r + 1) m) of
each global batch of W m sequences (m = micro-batch).

Measured, per row:
  step time    median over --repeats steps, all systems of one (shape, world) stepped
               interleaved round by round (order rotated) after --warmup rounds; a step's time is
               the max over ranks. Step 0's global mean loss must agree across systems (1e-5).
  throughput   samples/s = W m / step time; tokens/s = samples/s x T; model TFLOP/s =
               (6 N + 12 L d T) x tokens/s (PaLM, Chowdhery et al. 2022, App. B: N = parameters
               without embeddings, L layers, width d, sequence T) — the same useful work for DP
               and non-DP rows.
  peak memory  per rank, max over ranks. CPU: peak RSS minus RSS before the system was built
               (VmHWM after a reset, 2 warm steps then --memory-steps steps), each system alone in
               fresh processes with MALLOC_MMAP_THRESHOLD_=131072 (as experiments/zero_bench.py);
               CUDA: torch.cuda.max_memory_allocated over the same steps.
  model state  parameters + gradients + optimizer state held per rank (dpzero: memory(), peak
               gradients; torch: tensor storage), and the prediction of ZeRO's formulas
               (src/zero/memory.h; dpzero rows: ShardedModule.predicted_memory(); FSDP2: stage 3 in
               fp32; Opacus: stage 0 in fp32, per-sample gradients not included).
  DP / non-DP  the DP row's throughput and memory over the non-private dpzero row of the same
               stage and precision.

Grids: --grid cpu (two GPT-2-style shapes scaled to 2 cores, about 10 minutes), --grid gpu (the
key rows on one GPU: GPT-2 small on E2E-length sequences, within one 10-minute call), and
--paper (no training: the DP-ZeRO paper's configurations with our model-state predictions beside
the published figures; experiments/results/paper.md).

Usage: .venv/bin/python experiments/run.py [--grid cpu|gpu] [--shapes NAME,...] [--out DIR]
       .venv/bin/python experiments/run.py --paper
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzero
from dpzero import _C
from bench_common import (dpzero_version, require_baseline, proc_status_bytes, reset_peak_rss, write_csv,
                          write_marked_section)
import zero_bench
from paper_configs import write_paper_table

warnings.filterwarnings("ignore", module=r"opacus(\.|$)")
warnings.filterwarnings("ignore", message=".*(secure|Secure) (RNG|mode).*")

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 2.0**20
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SIGMA, CLIP = 1.0, 1.0
LOSS_RTOL = 1e-5

# (layers, width, heads, sequence, vocab, micro-batch per rank)
SHAPES = {
    "gpt-4x256": dict(layers=4, dim=256, heads=4, seq=128, vocab=8192, micro_batch=4),
    "gpt-6x512": dict(layers=6, dim=512, heads=8, seq=128, vocab=8192, micro_batch=4),
    # GPT-2 small (Radford et al. 2019) on E2E-length sequences (100 tokens): the GPU grid.
    "gpt2-small-e2e": dict(layers=12, dim=768, heads=12, seq=100, vocab=50257, micro_batch=32),
}
GRIDS = {
    "cpu": dict(shapes=["gpt-4x256", "gpt-6x512"], device="cpu", groups={
        1: ["zero0", "dp0-flat", "opacus-hooks", "opacus-ghost"],
        2: ["zero1", "zero2", "zero3", "dp1-flat", "dp2-flat", "dp3-flat", "dp3-layer", "fsdp2",
            "opacus-ghost_fsdp", "zero3-bf16", "dp3-flat-bf16"]}),
    "gpu": dict(shapes=["gpt2-small-e2e"], device="cuda", groups={
        1: ["zero0", "dp0-flat", "dp0-layer", "zero0-bf16", "dp0-flat-bf16", "opacus-hooks",
            "opacus-ghost"]}),
}


# ---- model and loss ------------------------------------------------------------------------------


class GPT(nn.Module):
    """zero_bench's GPT-2-style blocks; returns logits [B, T, V]; position ids batched."""

    def __init__(self, vocab, seq, dim, heads, layers):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(zero_bench.Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx):  # idx [B, T] int64
        b, t = idx.shape
        pos = torch.arange(t, device=idx.device).repeat(b, 1)  # [B, T], one row per sample
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class SequenceLoss(nn.Module):
    """Per-sample mean token cross-entropy, reduced over the batch by ``reduction`` (Opacus's
    fast gradient clipping sets it to "none" to get the per-sample losses)."""

    def __init__(self):
        super().__init__()
        self.reduction = "mean"

    def forward(self, logits, targets):  # [B, T, V], [B, T] -> scalar or [B]
        per_sample = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)
        if self.reduction == "none":
            return per_sample
        return per_sample.sum() if self.reduction == "sum" else per_sample.mean()


def make_model(shape: dict, device: str) -> GPT:
    torch.manual_seed(0)
    return GPT(shape["vocab"], shape["seq"], shape["dim"], shape["heads"],
               shape["layers"]).to(device)


def count_params(shape: dict) -> tuple[int, int]:
    """(all trainable parameters, parameters without embeddings)."""
    m = GPT(shape["vocab"], shape["seq"], shape["dim"], shape["heads"], shape["layers"])
    total = sum(p.numel() for p in m.parameters())
    return total, total - m.wte.weight.numel() - m.wpe.weight.numel()


def batches(shape: dict, world: int, n: int = 4, seed: int = 1234):
    g = torch.Generator().manual_seed(seed)
    rows = world * shape["micro_batch"]
    ids = torch.randint(shape["vocab"], (n * rows, shape["seq"] + 1), generator=g)
    return [(ids[k * rows:(k + 1) * rows, :-1].contiguous(),
             ids[k * rows:(k + 1) * rows, 1:].contiguous()) for k in range(n)]


def local(batch, rank: int, micro: int, device: str):
    idx, tgt = batch
    return idx[rank * micro:(rank + 1) * micro].to(device), tgt[rank * micro:(rank + 1) * micro].to(device)


# ---- systems -------------------------------------------------------------------------------------


def parse(name: str) -> dict:
    """'dp3-flat-bf16' -> {impl: dpzero, dp: True, stage: 3, clipping: flat, bf16: True}."""
    parts = name.split("-")
    # "ckpt": every block checkpointed; "ckpthalf": the first half of the blocks
    ckpt = "half" if "ckpthalf" in parts[1:] else "ckpt" in parts[1:]
    spec = dict(name=name, bf16="bf16" in parts[1:], ckpt=ckpt, stage=None,
                clipping=None, mode=None)
    if parts[0].startswith("zero"):
        spec.update(impl="dpzero", dp=False, stage=int(parts[0][4:]))
    elif parts[0].startswith("dp"):
        spec.update(impl="dpzero", dp=True, stage=int(parts[0][2:]), clipping=parts[1])
    elif parts[0] == "fsdp2":
        spec.update(impl="fsdp2", dp=False, stage=3)
    elif parts[0] == "opacus":
        spec.update(impl="opacus", dp=True, mode=parts[1], stage=3 if "fsdp" in parts[1] else 0,
                    clipping="flat")
    else:
        raise ValueError(f"unknown system {name!r}")
    return spec


class System:
    """One row's training setup on this rank: step(idx, targets) -> loss; state() -> bytes."""

    def __init__(self, spec: dict, shape: dict, world: int, device: str, dataset):
        self.spec, self.loss_fn = spec, SequenceLoss()
        model = make_model(shape, device)
        units = [f"blocks.{i}" for i in range(shape["layers"])]
        precision = "bf16" if spec["bf16"] else None
        global_batch = self.global_batch = world * shape["micro_batch"]
        self.model, self.sharded, self.private, self.opt = model, None, None, None
        if spec["impl"] == "dpzero" and not spec["dp"]:
            # bf16: compute and reduce in bf16 with fp32 masters (ZeRO's mixed precision).
            low = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if spec["bf16"] \
                else {}
            self.sharded = dpzero.shard(model, stage=spec["stage"], optimizer="adamw", units=units,
                                        **low, **ADAMW)
        elif spec["impl"] == "dpzero":
            self.private = dpzero.make_private(
                model, dataset=dataset, batch_size=global_batch, noise_multiplier=SIGMA,
                max_grad_norm=CLIP, clipping=spec["clipping"], zero_stage=spec["stage"],
                units=units, mixed_precision=precision, optimizer="adamw", seed=0,
                loss_reduction="mean",
                activation_checkpointing=(units[:len(units) // 2] if spec["ckpt"] == "half"
                                          else units if spec["ckpt"] else None),
                **ADAMW)
            self.sharded = self.private.privacy_engine.sharded
        elif spec["impl"] == "fsdp2":
            mesh = dist.device_mesh.init_device_mesh(device, (world,))
            for block in model.blocks:
                dist.fsdp.fully_shard(block, mesh=mesh)
            dist.fsdp.fully_shard(model, mesh=mesh)
            self.opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        else:
            self._opacus(spec["mode"], model, dataset, global_batch)

    def _opacus(self, mode, model, dataset, global_batch):
        from opacus import PrivacyEngine
        if mode == "ghost_fsdp":
            from opacus.utils.fsdp_utils import FSDP2Wrapper
            model = FSDP2Wrapper(model)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        out = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=DataLoader(dataset, batch_size=global_batch),
            noise_multiplier=SIGMA, max_grad_norm=CLIP, grad_sample_mode=mode,
            criterion=self.loss_fn, loss_reduction="mean", poisson_sampling=False)
        if mode.startswith("ghost"):
            self.model, self.opt, self.loss_fn, _ = out
        else:
            self.model, self.opt, _ = out

    def step(self, idx, targets) -> torch.Tensor:
        if self.private is not None:
            self.private.optimizer.zero_grad()
            # The grid's fixed batches come in through own_batch, the ledgered opt-out for
            # batches a caller samples (Note [batch provenance]); idx is this rank's share.
            idx, targets = self.private.privacy_engine.own_batch(
                (idx, targets), logical_batch_size=self.global_batch)
            loss = self.loss_fn(self.private.model(idx), targets)
            loss.backward()
            self.private.optimizer.step()
        elif self.sharded is not None:
            loss = self.loss_fn(self.sharded(idx), targets)
            loss.backward()
            self.sharded.step()
        else:
            self.opt.zero_grad(set_to_none=True)
            loss = self.loss_fn(self.model(idx), targets)
            loss.backward()
            self.opt.step()
        return loss.detach()

    def state(self) -> dict:
        """Measured and predicted model-state bytes on this rank."""
        if self.sharded is not None:
            m, p = self.sharded.memory(), self.sharded.predicted_memory()
            measured = (m["params"] + m.get("master_params", 0) + m.get("peak_grads", m["grads"])
                        + m["optimizer_state"])
            return dict(state=measured, predicted=p["total"])
        params = [p for p in self.model.parameters()]
        opt_state = [v for s in self.opt.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor)]
        grads = [getattr(p, "grad", None) for p in params]
        local = [getattr(p, "_local_tensor", p) for p in params]  # FSDP2 DTensor shards
        measured = (zero_bench.storage_bytes(local)
                    + zero_bench.storage_bytes(getattr(g, "_local_tensor", g) for g in grads)
                    + zero_bench.storage_bytes(getattr(v, "_local_tensor", v) for v in opt_state))
        psi = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        world = dist.get_world_size() if dist.is_initialized() else 1
        stage = self.spec["stage"]
        predicted = _C.zero.predict_model_state_bytes(stage, psi, world, 4, 4, 8)["total"]
        return dict(state=measured, predicted=predicted)


# ---- rank processes ------------------------------------------------------------------------------


def setup(rank: int, world: int, store: str, device: str, threads: int) -> None:
    torch.set_num_threads(threads)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))


def dataset_for(shape: dict, world: int):
    rows = 64 * world * shape["micro_batch"]  # q = B / N = 1/64 for the accountant
    return TensorDataset(torch.zeros(rows, shape["seq"], dtype=torch.long))


def build_all(names, shape, world, device, rank):
    """{name: System or error text}: a system that fails to build is reported, not fatal; every
    rank must agree, so the errors are gathered."""
    out = {}
    data = dataset_for(shape, world)
    for name in names:
        try:
            out[name] = System(parse(name), shape, world, device, data)
            err = None
        except Exception as e:  # noqa: BLE001 - reported in the results
            err = f"build: {type(e).__name__}: {e}".splitlines()[0][:300]
            out[name] = err
        errs = [None] * world
        dist.all_gather_object(errs, err)
        first = next((e for e in errs if e), None)
        if first and not isinstance(out[name], str):
            out[name] = first
    return out


def timing_rank(rank, world, store, shape, names, cfg, out_path):
    device = cfg["device"]
    with rank_session(rank, world, store, cfg):
        systems = build_all(names, shape, world, device, rank)
        data = batches(shape, world)
        micro = shape["micro_batch"]
        errors = {n: s for n, s in systems.items() if isinstance(s, str)}
        live = [n for n, s in systems.items() if not isinstance(s, str)]
        loss0 = {}
        for name in list(live):  # step 0: every system must see the same loss
            try:
                loss = systems[name].step(*local(data[0], rank, micro, device)).double()
                err = None
            except Exception as e:  # noqa: BLE001
                err, loss = f"step: {type(e).__name__}: {e}".splitlines()[0][:300], torch.zeros((), dtype=torch.float64)
            errs = [None] * world
            dist.all_gather_object(errs, err)
            if any(errs):
                errors[name] = next(e for e in errs if e)
                live.remove(name)
                continue
            dist.all_reduce(loss)
            loss0[name] = loss.item() / world
        times = {n: [] for n in live}
        for r in range(cfg["warmup"] + cfg["repeats"]):
            batch = local(data[1 + r % (len(data) - 1)], rank, micro, device)
            for name in live[r % max(1, len(live)):] + live[:r % max(1, len(live))]:
                dist.barrier()
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                systems[name].step(*batch)
                if device == "cuda":
                    torch.cuda.synchronize()
                if r >= cfg["warmup"]:
                    times[name].append(time.perf_counter() - t0)
        # on the group's device: NCCL, the CUDA runs' backend, reduces no host tensor
        table = torch.tensor([times[n] for n in live], dtype=torch.float64, device=device)
        if live:
            dist.all_reduce(table, op=dist.ReduceOp.MAX)
        result = dict(times={n: table[i].tolist() for i, n in enumerate(live)}, loss0=loss0,
                      errors=errors)
        if rank == 0:
            torch.save(result, out_path)
        del systems


def memory_rank(rank, world, store, shape, name, cfg, out_path):
    device = cfg["device"]
    with rank_session(rank, world, store, cfg):
        data = batches(shape, world)
        micro = shape["micro_batch"]
        zero_bench.warm_up_libraries(dict(vocab=shape["vocab"], seq=shape["seq"],
                                          dim=shape["dim"], heads=shape["heads"], layers=1),
                                     local(data[0], rank, micro, "cpu"))
        base = proc_status_bytes("VmRSS")
        system = build_all([name], shape, world, device, rank)[name]
        row = dict(error=system) if isinstance(system, str) else None
        if row is None:
            for s in range(2):
                system.step(*local(data[s], rank, micro, device))
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            reset_peak_rss("run.py")
            for s in range(cfg["memory_steps"]):
                system.step(*local(data[(2 + s) % len(data)], rank, micro, device))
            peak = (torch.cuda.max_memory_allocated() if device == "cuda"
                    else proc_status_bytes("VmHWM") - base)
            row = dict(peak=peak, **system.state())
        rows = [None] * world
        dist.all_gather_object(rows, row)
        if rank == 0:
            torch.save(rows, out_path)
        del system


@contextlib.contextmanager
def rank_session(rank: int, world: int, store: str, cfg: dict):
    """This rank's process group for one measurement. On leaving, what the body built (and
    deleted) is collected first — the engines hold the group, hooks make reference cycles, and an
    engine collected after destroy_process_group takes the group down at exit ("terminate called
    without an active exception": docs/architecture.md, "Known limitations") — then every rank
    tears the group down together."""
    setup(rank, world, store, cfg["device"], cfg["threads"] if world == 1 else 1)
    try:
        yield
        gc.collect()
    finally:
        dist.barrier()
        dist.destroy_process_group()


def spawn(fn, world, tmp, tag, *args):
    store, out = os.path.join(tmp, f"store_{tag}"), os.path.join(tmp, f"out_{tag}.pt")
    mp.spawn(fn, args=(world, store, *args, out), nprocs=world, join=True)
    return torch.load(out, weights_only=False)


# ---- the grid ------------------------------------------------------------------------------------


def run_grid(grid: dict, shapes: list[str], cfg: dict) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape_name in shapes:
            shape = SHAPES[shape_name]
            n_all, n_body = count_params(shape)
            for world, names in grid["groups"].items():
                t0 = time.time()
                timing = spawn(timing_rank, world, tmp, f"t_{shape_name}_{world}", shape, names,
                               cfg)
                print(f"{shape_name} W={world}: timing {time.time() - t0:.0f} s "
                      f"{timing['errors'] or ''}", flush=True)
                saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
                os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
                try:
                    memory = {}
                    for name in names:
                        if name in timing["errors"]:
                            continue
                        mem = spawn(memory_rank, world, tmp, f"m_{shape_name}_{world}_{name}",
                                    shape, name, cfg)
                        memory[name] = mem
                finally:
                    if saved is None:
                        del os.environ["MALLOC_MMAP_THRESHOLD_"]
                    else:
                        os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
                for name in names:
                    rows.append(summarize(shape_name, shape, world, name, timing, memory,
                                          n_all, n_body, cfg["device"]))
    add_ratios(rows)
    return rows


def summarize(shape_name, shape, world, name, timing, memory, n_all, n_body, device) -> dict:
    spec = parse(name)
    row = dict(shape=shape_name, layers=shape["layers"], d=shape["dim"], T=shape["seq"],
               micro_batch=shape["micro_batch"], world=world, system=name, impl=spec["impl"],
               stage=spec["stage"], precision="bf16" if spec["bf16"] else "fp32",
               dp="yes" if spec["dp"] else "no", clipping=spec["clipping"] or "",
               params_M=round(n_all / 1e6, 2), error="")
    if name in timing["errors"]:
        row["error"] = timing["errors"][name]
        return row
    t = timing["times"][name]
    q = statistics.quantiles(t, n=4) if len(t) >= 2 else [t[0]] * 3
    step = statistics.median(t)
    samples = world * shape["micro_batch"] / step
    flops_per_token = 6 * n_body + 12 * shape["layers"] * shape["dim"] * shape["seq"]
    row.update(step_ms=round(1e3 * step, 1), iqr_ms=f"{1e3 * q[0]:.0f}–{1e3 * q[2]:.0f}",
               samples_s=round(samples, 2), tokens_s=round(samples * shape["seq"], 1),
               model_tflops=round(samples * shape["seq"] * flops_per_token / 1e12, 4),
               loss0=round(timing["loss0"][name], 6))
    mem = memory.get(name)
    if mem:
        if any("error" in r for r in mem):
            row["error"] = next(r["error"] for r in mem if "error" in r)
        else:
            row.update(peak_MiB=round(max(r["peak"] for r in mem) / MIB, 1),
                       state_MiB=round(max(r["state"] for r in mem) / MIB, 1),
                       predicted_state_MiB=round(max(r["predicted"] for r in mem) / MIB, 1))
    return row


def add_ratios(rows: list[dict]) -> None:
    """DP rows: throughput and memory over the non-private dpzero row of the same shape, world,
    stage and precision; every row: samples/s over FSDP2's on its shape (W = 2)."""
    index = {(r["shape"], r["world"], r["system"]): r for r in rows}
    for r in rows:
        if r["dp"] == "yes" and r["impl"] == "dpzero" and "step_ms" in r:
            base = index.get((r["shape"], r["world"],
                              f"zero{r['stage']}" + ("-bf16" if r["precision"] == "bf16" else "")))
            if base and "step_ms" in base:
                r["dp_vs_nondp_throughput"] = round(r["samples_s"] / base["samples_s"], 3)
                if "peak_MiB" in r and "peak_MiB" in base:
                    r["dp_vs_nondp_peak"] = round(r["peak_MiB"] / base["peak_MiB"], 3)
        fsdp = index.get((r["shape"], 2, "fsdp2"))
        if fsdp and "samples_s" in fsdp and "samples_s" in r:
            # whole-machine throughput, so rows of either world size compare
            r["throughput_vs_fsdp2"] = round(r["samples_s"] / fsdp["samples_s"], 3)


# ---- report --------------------------------------------------------------------------------------

FIELDS = ["shape", "params_M", "layers", "d", "T", "micro_batch", "world", "system", "impl",
          "stage", "precision", "dp", "clipping", "step_ms", "iqr_ms", "samples_s", "tokens_s",
          "model_tflops", "peak_MiB", "state_MiB", "predicted_state_MiB",
          "dp_vs_nondp_throughput", "dp_vs_nondp_peak", "throughput_vs_fsdp2", "loss0", "error"]
SHOWN = ["system", "world", "stage", "precision", "dp", "step_ms", "iqr_ms", "samples_s",
         "tokens_s", "peak_MiB", "state_MiB", "predicted_state_MiB", "dp_vs_nondp_throughput",
         "dp_vs_nondp_peak", "throughput_vs_fsdp2"]


def check_losses(rows: list[dict]) -> list[str]:
    """Step 0 sees the initial weights: every system of a shape must report the same loss."""
    out = []
    for shape, world in dict.fromkeys((r["shape"], r["world"]) for r in rows):
        # (a world size has its own global batch, so its own loss)
        losses = {r["system"]: r["loss0"] for r in rows
                  if r["shape"] == shape and r["world"] == world and "loss0" in r}
        ref = statistics.median(losses.values()) if losses else 0.0
        bad = {k: v for k, v in losses.items() if abs(v - ref) > LOSS_RTOL * abs(ref)
               and "bf16" not in k}
        bf16 = {k: v for k, v in losses.items() if "bf16" in k}
        out.append(f"- {shape}, W = {world}: step-0 loss {ref:.6f} (median over systems); "
                   + (f"**disagreeing**: {bad}" if bad else "every fp32 system within 1e-5")
                   + (f"; bf16 rows {bf16}" if bf16 else ""))
    return out


def plot(rows: list[dict], path_prefix: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    made = []
    for key, label, name in (("samples_s", "samples / s", "throughput"),
                             ("peak_MiB", "peak memory per rank (MiB)", "memory")):
        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
        for ax, shape in zip(axes[0], shapes):
            sel = [r for r in rows if r["shape"] == shape and key in r]
            colors = ["tab:red" if r["dp"] == "yes" else "tab:blue" for r in sel]
            ax.barh([f"{r['system']} (W={r['world']})" for r in sel], [r[key] for r in sel],
                    color=colors)
            ax.set_title(shape)
            ax.set_xlabel(label + "  (red: DP)")
            ax.invert_yaxis()
        fig.tight_layout()
        path = f"{path_prefix}-{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(os.path.basename(path))
    return made


def write_results(rows, args, cfg, elapsed, out_dir) -> None:
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"grid-{args.grid}")
    write_csv(base + ".csv", rows, FIELDS)
    images = plot(rows, base)
    # achieved model TFLOP/s means something on a GPU; on 2 CPU cores it is in the CSV only
    shown = SHOWN + (["model_tflops"] if cfg["device"] == "cuda" else [])
    lines = [
        f"Run {datetime.date.today()} on {platform.machine()}, {os.cpu_count()} cores, device "
        f"{cfg['device']}; torch {torch.__version__}, Python {platform.python_version()}; "
        f"{dpzero_version()}; {elapsed:.0f} s in all.", "",
        f"Command: `{' '.join([os.path.relpath(sys.executable, os.getcwd())] + sys.argv)}`", "",
        f"DP rows: sigma {SIGMA}, C {CLIP}, AdamW {ADAMW}; {cfg['repeats']} timed steps after "
        f"{cfg['warmup']} warm-up rounds; W = 1 rows use {cfg['threads']} threads, W = 2 rows one "
        "thread per rank. Columns: see the docstring of experiments/run.py.", "",
        "| " + " | ".join(shown) + " | error |", "|" + "---|" * (len(shown) + 1)]
    shape = None
    for r in rows:
        if r["shape"] != shape:
            shape = r["shape"]
            lines.append(f"| **{shape}** ({r['params_M']} M parameters, {r['layers']} layers, "
                         f"d = {r['d']}, T = {r['T']}, micro-batch {r['micro_batch']}) |"
                         + " |" * len(shown))
        lines.append("| " + " | ".join(str(r.get(k, "")) for k in shown) + " | "
                     + r.get("error", "").replace("|", "/") + " |")
    lines += ["", "Same computation:"] + check_losses(rows)
    lines += ["", "Plots: " + ", ".join(f"`{i}`" for i in images)]
    tag = f"grid-{args.grid}"
    write_marked_section(base + ".md", tag,
                         f"# Experiments grid ({args.grid}): dpzero DP and non-DP against FSDP2 "
                         "and Opacus\n\nWritten by `experiments/run.py`; its docstring says what "
                         "each column measures and how.\n",
                         f"<!-- {tag}:begin -->\n" + "\n".join(lines) + f"\n<!-- {tag}:end -->")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", default="cpu", choices=sorted(GRIDS))
    parser.add_argument("--shapes", help="comma-separated subset of the grid's shapes")
    parser.add_argument("--systems", help="comma-separated subset of the grid's systems")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads of W = 1 rows (W > 1: one per rank)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--paper", action="store_true",
                        help="write results/paper.md (the paper's configurations) and exit")
    args = parser.parse_args()
    if args.paper:
        print(write_paper_table(os.path.join(args.out, "paper.md")))
        return
    grid = dict(GRIDS[args.grid])
    if args.systems:
        keep = set(args.systems.split(","))
        grid["groups"] = {w: [n for n in names if n in keep]
                          for w, names in grid["groups"].items()}
        grid["groups"] = {w: names for w, names in grid["groups"].items() if names}
    if any(n.startswith("opacus") for names in grid["groups"].values() for n in names):
        require_baseline("opacus", "run.py")
    shapes = args.shapes.split(",") if args.shapes else grid["shapes"]
    cfg = dict(device=grid["device"], repeats=args.repeats, warmup=args.warmup,
               memory_steps=args.memory_steps, threads=args.threads)
    t0 = time.time()
    try:
        rows = run_grid(grid, shapes, cfg)
    except Exception:
        traceback.print_exc()
        raise
    write_results(rows, args, cfg, time.time() - t0, args.out)
    print(f"wrote {args.out}/grid-{args.grid}.md ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
