"""ZeRO step time and memory: dpzero.shard stages 0-3 against PyTorch DDP and FSDP2, side by side.

Systems. One GPT-2-style model (pre-LN blocks, causal scaled-dot-product attention, GELU MLP,
learned positions, output head tied to the token embedding; sizes from the flags) is trained with
AdamW (same hyperparameters everywhere, ADAMW below) on W CPU ranks over Gloo
(torch.multiprocessing, a file store, loopback; torch.set_num_threads(--threads) per rank) by:
  ddp     torch.nn.parallel.DistributedDataParallel (its defaults) + torch.optim.AdamW
  fsdp2   torch.distributed.fsdp.fully_shard on every block, then on the root (its defaults)
          + torch.optim.AdamW on the sharded DTensor parameters
  zero0-3 dpzero.shard(model, stage=k, optimizer="adamw", units=["blocks.0", ...]): the same units
          as FSDP2 (one per block; embeddings, final LayerNorm and head in the root unit), the
          installed engine's other defaults (stage-3 prefetch on where it has the switch)
  zero3-noprefetch  stage 3 with prefetch=False; listed only when the installed dpzero.shard has
          that switch, to show what prefetching the next unit's gather buys
torch.optim.AdamW runs with its CPU default (the per-parameter for-loop, foreach=False); dpzero's
optimizer runs on each unit's flat shard.

Same start, same data. Every system is built after torch.manual_seed(0), so all start from the same
weights; step s uses global batch s mod --batches (random tokens), of which rank r takes rows
[r*b, (r+1)*b) with b = --micro-batch. Each rank's loss is the mean over its rows and gradients are
averaged over ranks (DDP and FSDP2 by default, dpzero by its default grad_scale 1/W), so every
system computes the same global-batch step. Checked before timing, not timed: the global losses
(mean over ranks) of step 0 must agree across systems to STEP0_RTOL (same weights, same data), and
those of step 1 to STEP1_RTOL (the same AdamW update, up to the order gradients are summed in).

Time. All systems are built in the same rank processes and stepped interleaved, round by round,
the order rotated every round, so that changes in machine load hit all of them alike. One step =
zero_grad + forward + backward + optimizer step (dpzero: forward + backward + ShardedModule.step,
which also zeroes). Every rank times each step from a barrier to its own end; a step's time is the
max over ranks. After --warmup rounds (steps 0 and 1 of the check come before them), --repeats
rounds are timed; the table gives each system's median and interquartile range. Ratios are
against FSDP2 and DDP measured in the same run.

Memory, two measures per rank; the table gives the max over ranks. Each system runs alone in fresh
rank processes with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_=131072), so that a freed
large block leaves the resident set instead of staying in the heap:
  state  model-state bytes held at the end of a step, before the next zero_grad: parameters +
         gradients + optimizer state. dpzero: ShardedModule.memory() (params + peak_grads +
         optimizer_state, its persistent buffers; stage 3 holds the parameter shards only). torch:
         the storages under the parameters, their .grad and every optimizer state tensor, each
         storage once; for FSDP2 the local shards of the DTensors. Not counted: activations,
         parameters gathered for a unit's forward/backward and full gradients before their
         reduce-scatter (stage 3, FSDP2), communication buffers, and DDP's gradient buckets (by
         default a second full copy of the gradients); the second measure sees all of them.
  rss    peak resident set size over --memory-steps steady-state steps (VmHWM, reset through
         /proc/self/clear_refs after two steps, when the optimizer state exists) minus the resident
         size (VmRSS) just before the system was built: model state + activations + gathered
         parameters + gradients in flight + communication buffers + allocator overhead. Before that
         baseline a plain copy of the model takes one torch.optim.AdamW step and is freed, so
         one-off library set-up (the first AdamW imports torch._dynamo, ~70 MiB) is not charged
         to any system.

Usage: .venv/bin/python experiments/zero_bench.py [--world-size 2] [--repeats 21] ...
(defaults: 4 blocks, d = 384, T = 128, vocab 8192, 4 sequences per rank; about 5 minutes on 2 cores)
Writes experiments/results/zero.md (the section between its markers; notes outside them are kept)
and experiments/results/zero.csv.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import dpzero
from bench_common import (dpzero_version, proc_status_bytes, reset_peak_rss, write_csv,
                          write_marked_section)

# Everything above is imported before any measurement: module code is not model memory.

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_MD = os.path.join(HERE, "results", "zero.md")
SYSTEMS = ["ddp", "fsdp2", "zero0", "zero1", "zero2", "zero3"]
# Listed too when the installed dpzero.shard has a `prefetch` switch: what stage-3 prefetch buys.
NO_PREFETCH = "zero3-noprefetch"
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEP0_RTOL, STEP1_RTOL = 1e-6, 1e-4
MIB = 2.0**20


# ---- the model -----------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2, self.fc = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):  # x: [B, T, D]
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, H, T, D/H]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D/H]
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, heads: int, layers: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2
        for module in self.modules():  # GPT-2's initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx, targets):  # idx, targets: [B, T] int64 -> scalar mean loss
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # [B, T, V]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model(cfg: dict) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg["vocab"], cfg["seq"], cfg["dim"], cfg["heads"], cfg["layers"])


def make_batches(cfg: dict, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """cfg["batches"] global batches of world_size * micro_batch random-token rows ([B, T] each)."""
    g = torch.Generator().manual_seed(1234)
    shape = (world_size * cfg["micro_batch"], cfg["seq"])
    return [(torch.randint(cfg["vocab"], shape, generator=g),
             torch.randint(cfg["vocab"], shape, generator=g)) for _ in range(cfg["batches"])]


def local_rows(batch, rank: int, micro: int):
    return tuple(t[rank * micro:(rank + 1) * micro] for t in batch)


# ---- the systems ---------------------------------------------------------------------------------


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (DTensors: their local shards)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class TorchSystem:
    """DDP or FSDP2: `runner` is the wrapped module, `model` the one whose parameters it trains."""

    def __init__(self, runner: nn.Module, model: nn.Module):
        self.runner, self.model = runner, model
        self.opt = torch.optim.AdamW(model.parameters(), **ADAMW)

    def step(self, idx, targets) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = self.runner(idx, targets)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def state_bytes(self) -> dict:
        params = list(self.model.parameters())
        opt_state = [v for s in self.opt.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor)]
        return dict(params=storage_bytes(params), grads=storage_bytes(p.grad for p in params),
                    optimizer=storage_bytes(opt_state))


class DpzeroSystem:
    def __init__(self, wrapped):
        self.wrapped = wrapped

    def step(self, idx, targets) -> torch.Tensor:
        loss = self.wrapped(idx, targets)
        loss.backward()
        self.wrapped.step()
        return loss.detach()

    def state_bytes(self) -> dict:
        m = self.wrapped.memory()
        # peak_grads: stages 2-3 release their gradient shard at the step; what they held until
        # then is what torch's .grad holds at the same point.
        return dict(params=m["params"] + m.get("master_params", 0),
                    grads=m.get("peak_grads", m["grads"]),
                    optimizer=m["optimizer_state"], dpzero_peak_params=m["peak_params"])


def build(name: str, cfg: dict, world_size: int):
    model = make_model(cfg)
    if name == "ddp":
        return TorchSystem(DistributedDataParallel(model), model)
    if name == "fsdp2":
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return TorchSystem(model, model)
    units = [f"blocks.{i}" for i in range(len(model.blocks))]
    extra = dict(prefetch=False) if name == NO_PREFETCH else {}
    return DpzeroSystem(dpzero.shard(model, stage=int(name[4]), optimizer="adamw", units=units,
                                     **ADAMW, **extra))


def has_prefetch_switch() -> bool:
    return "prefetch" in inspect.signature(dpzero.shard).parameters


# ---- rank processes ------------------------------------------------------------------------------


def init_rank(rank: int, world_size: int, store: str, threads: int) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=600))


def global_mean(value: torch.Tensor) -> float:
    value = value.detach().to(torch.float64).clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def check_same_losses(systems: dict, batches, rank: int, micro: int) -> dict:
    """Steps 0 and 1 of every system on batches 0 and 1; returns {name: [loss0, loss1]} (global
    means) after asserting they agree with DDP's."""
    losses = {n: [global_mean(s.step(*local_rows(batches[i], rank, micro))) for i in (0, 1)]
              for n, s in systems.items()}
    ref = losses["ddp"] if "ddp" in losses else next(iter(losses.values()))
    for name, (l0, l1) in losses.items():
        assert abs(l0 - ref[0]) <= STEP0_RTOL * abs(ref[0]), f"{name} step-0 loss {l0} != {ref[0]}"
        assert abs(l1 - ref[1]) <= STEP1_RTOL * abs(ref[1]), f"{name} step-1 loss {l1} != {ref[1]}"
    return losses


def time_interleaved(systems: dict, batches, rank: int, micro: int, warmup: int,
                     repeats: int) -> dict:
    """{name: [seconds per timed step]}, each step's time the max over ranks."""
    names = list(systems)
    times = {n: [] for n in names}
    for r in range(warmup + repeats):
        batch = local_rows(batches[(r + 2) % len(batches)], rank, micro)
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            systems[name].step(*batch)
            elapsed = time.perf_counter() - t0
            if r >= warmup:
                times[name].append(elapsed)
    table = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return {n: table[i].tolist() for i, n in enumerate(names)}


def timing_rank(rank, world_size, store, cfg, names, out_path) -> None:
    run_rank(rank, world_size, store, cfg, out_path,
             lambda: measure_time(rank, world_size, cfg, names))


def measure_time(rank, world_size, cfg, names) -> dict:
    batches = make_batches(cfg, world_size)
    systems = {n: build(n, cfg, world_size) for n in names}
    losses = check_same_losses(systems, batches, rank, cfg["micro_batch"])
    times = time_interleaved(systems, batches, rank, cfg["micro_batch"], cfg["warmup"],
                             cfg["repeats"])
    return dict(losses=losses, times=times, threads=torch.get_num_threads())


def run_rank(rank, world_size, store, cfg, out_path, measure) -> None:
    """Runs `measure` on this rank; rank 0 saves what it returns. Everything `measure` built is
    freed before the process group is destroyed, the order torch.distributed expects (see the
    notes in results/zero.md on the teardown hang this once hit)."""
    init_rank(rank, world_size, store, cfg["threads"])
    try:
        result = measure()
        gc.collect()
        if rank == 0:
            torch.save(result, out_path)
    finally:
        dist.destroy_process_group()


def warm_up_libraries(cfg: dict, batch) -> None:
    """One plain training step of a throwaway model, freed again: one-off set-up that is not the
    system's memory (torch.optim's first construction alone imports torch._dynamo, ~70 MiB of
    modules; kernels' first-call state) happens before the baseline."""
    model = make_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    model(*batch).backward()
    opt.step()
    del model, opt
    gc.collect()


def memory_rank(rank, world_size, store, cfg, name, out_path) -> None:
    run_rank(rank, world_size, store, cfg, out_path,
             lambda: measure_memory_rank(rank, world_size, cfg, name))


def measure_memory_rank(rank, world_size, cfg, name) -> list[dict]:
    """Every rank's {params, grads, optimizer, rss} bytes for system `name`."""
    micro = cfg["micro_batch"]
    batches = make_batches(cfg, world_size)
    warm_up_libraries(cfg, local_rows(batches[0], rank, micro))
    base = proc_status_bytes("VmRSS")
    system = build(name, cfg, world_size)
    for s in range(2):
        system.step(*local_rows(batches[s % len(batches)], rank, micro))
    reset_peak_rss("zero_bench")
    for s in range(2, 2 + cfg["memory_steps"]):
        system.step(*local_rows(batches[s % len(batches)], rank, micro))
    peak = proc_status_bytes("VmHWM") - base
    rows = [None] * world_size
    dist.all_gather_object(rows, dict(system.state_bytes(), rss=peak))
    return rows


def spawn(fn, world_size: int, tmp: str, tag: str, *args):
    store, out = os.path.join(tmp, f"store_{tag}"), os.path.join(tmp, f"out_{tag}.pt")
    mp.spawn(fn, args=(world_size, store, *args, out), nprocs=world_size, join=True)
    return torch.load(out)


def measure_memory(cfg, names, world_size, tmp) -> dict:
    """{name: {params, grads, optimizer, rss}}, each the max over ranks."""
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # inherited by the spawned ranks only
    try:
        out = {}
        for name in names:
            rows = spawn(memory_rank, world_size, tmp, f"mem_{name}", cfg, name)
            out[name] = {k: max(r[k] for r in rows) for k in rows[0]}
            out[name]["state"] = max(r["params"] + r["grads"] + r["optimizer"] for r in rows)
            print(f"memory {name}: " + ", ".join(f"{k} {v / MIB:.1f} MiB"
                                                  for k, v in out[name].items()), flush=True)
        return out
    finally:
        if saved is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


# ---- report --------------------------------------------------------------------------------------

CSV_FIELDS = ["system", "step_ms", "q1_ms", "q3_ms", "params", "grads", "optimizer", "state", "rss",
              "time_vs_fsdp2", "state_vs_fsdp2", "rss_vs_fsdp2", "time_vs_ddp", "state_vs_ddp",
              "rss_vs_ddp", "loss0", "loss1", "dpzero_peak_params"]


def summarize(names, timing, memory) -> list[dict]:
    """One row per system: times in ms, bytes, and ratios against FSDP2 and DDP when present."""
    rows = []
    for n in names:
        t = timing["times"][n]
        q1, _, q3 = statistics.quantiles(t, n=4)
        rows.append(dict(system=n, step_ms=1e3 * statistics.median(t), q1_ms=1e3 * q1,
                         q3_ms=1e3 * q3, loss0=timing["losses"][n][0],
                         loss1=timing["losses"][n][1], **memory[n]))
    ref = {r["system"]: r for r in rows}
    for r in rows:
        for base in ("fsdp2", "ddp"):
            if base in ref:
                r[f"time_vs_{base}"] = r["step_ms"] / ref[base]["step_ms"]
                r[f"state_vs_{base}"] = r["state"] / ref[base]["state"]
                r[f"rss_vs_{base}"] = r["rss"] / ref[base]["rss"]
    return rows


def table(rows: list[dict]) -> list[str]:
    bases = [b for b in ("fsdp2", "ddp") if f"time_vs_{b}" in rows[0]]
    head = ["system", "step ms (median)", "IQR ms", "state MiB (params+grads+opt)",
            "peak RSS Δ MiB"]
    head += [f"{what} / {b.upper()}" for b in bases for what in ("time", "state", "RSS")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["system"], f"{r['step_ms']:.1f}", f"{r['q1_ms']:.1f}–{r['q3_ms']:.1f}",
                 f"{r['state'] / MIB:.1f} ({r['params'] / MIB:.1f}+{r['grads'] / MIB:.1f}+"
                 f"{r['optimizer'] / MIB:.1f})", f"{r['rss'] / MIB:.1f}"]
        cells += [f"{r[f'{what}_vs_{b}']:.2f}" for b in bases for what in ("time", "state", "rss")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_markdown(path: str, args, cfg, rows, run: dict) -> None:
    """Replaces the section between the zero_bench markers in `path` (notes outside are kept)."""
    losses = "; ".join(f"{r['system']} {r['loss0']:.6f} / {r['loss1']:.6f}" for r in rows)
    gathered = "; ".join(f"{r['system']} {r['dpzero_peak_params'] / MIB:.1f} MiB"
                         for r in rows if r["system"].startswith("zero3"))
    command = " ".join([".venv/bin/python experiments/zero_bench.py", *sys.argv[1:]])
    section = "\n".join([
        "<!-- zero_bench:begin -->",
        f"Run {datetime.date.today().isoformat()} on {platform.machine()}, {os.cpu_count()} cores, "
        f"{run['threads']} torch thread(s) per rank, W = {args.world_size} Gloo ranks (file store, "
        f"loopback); torch {torch.__version__}, Python {platform.python_version()}; "
        f"{run['version']}. Load average (1 min) {run['load'][0]:.2f} at the start, "
        f"{run['load'][1]:.2f} at the end; {run['seconds']:.0f} s in all.",
        "",
        f"Command: `{command}`",
        "",
        f"Model: GPT-2-style, {cfg['layers']} blocks, d = {cfg['dim']}, {cfg['heads']} heads, "
        f"T = {cfg['seq']}, vocab {cfg['vocab']}, tied head; {run['n_params'] / 1e6:.2f} M "
        f"parameters (fp32). Micro-batch {cfg['micro_batch']} sequences per rank, global batch "
        f"{cfg['micro_batch'] * args.world_size}; AdamW lr {ADAMW['lr']}, betas {ADAMW['betas']}, "
        f"eps {ADAMW['eps']}, weight decay {ADAMW['weight_decay']}. dpzero units = FSDP2's "
        "(one per block + root).",
        "",
        f"Time: median and interquartile range of {args.repeats} steps per system, interleaved "
        f"round by round after {args.warmup} warm-up rounds; a step's time is the max over ranks. "
        "State = parameters + gradients + optimizer state held at the end of a step; peak RSS Δ = "
        f"peak resident memory over {args.memory_steps} steady-state steps minus the resident "
        "memory before the system was built; both the max over ranks, each system alone in fresh "
        "processes (details in the script's docstring).",
        "",
        *table(rows),
        "",
        f"Same computation (asserted before timing): global loss at step 0 / step 1 — {losses}. "
        f"Step 0 must agree to {STEP0_RTOL:g} relative, step 1 to {STEP1_RTOL:g}.",
        "",
        f"dpzero stage 3, most parameter bytes gathered at once (ShardedModule.memory()"
        f"['peak_params'], shards included): {gathered}.",
        "<!-- zero_bench:end -->",
    ])
    title = ("# ZeRO: dpzero.shard stages 0-3 against PyTorch DDP and FSDP2 (CPU, Gloo)\n\n"
             "Written by `experiments/zero_bench.py`; its docstring says what each column "
             "measures and how.\n")
    write_marked_section(path, "zero_bench", title, section)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--batches", type=int, default=4, help="distinct global batches, cycled")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--memory-steps", type=int, default=3)
    available = SYSTEMS + ([NO_PREFETCH] if has_prefetch_switch() else [])
    parser.add_argument("--systems", default=",".join(available),
                        help="comma-separated subset of " + ",".join(available))
    parser.add_argument("--out", default=RESULTS_MD)
    args = parser.parse_args()

    names = args.systems.split(",")
    unknown = sorted(set(names) - set(available))
    if unknown:
        parser.error(f"--systems: unknown {unknown}; choose from {available}")
    if args.dim % args.heads:
        parser.error(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    cfg = dict(vocab=args.vocab, seq=args.seq, dim=args.dim, heads=args.heads, layers=args.layers,
               micro_batch=args.micro_batch, batches=max(args.batches, 2), threads=args.threads,
               warmup=args.warmup, repeats=args.repeats, memory_steps=args.memory_steps)
    run = dict(n_params=sum(p.numel() for p in make_model(cfg).parameters()),
               version=dpzero_version(), load=[os.getloadavg()[0]])
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        timing = spawn(timing_rank, args.world_size, tmp, "time", cfg, names)
        print(f"timing done in {time.perf_counter() - t0:.0f} s", flush=True)
        memory = measure_memory(cfg, names, args.world_size, tmp)
    run.update(threads=timing["threads"], seconds=time.perf_counter() - t0)
    run["load"].append(os.getloadavg()[0])
    rows = summarize(names, timing, memory)
    print("\n".join(table(rows)))
    csv_path = os.path.splitext(args.out)[0] + ".csv"
    write_csv(csv_path, rows, CSV_FIELDS)
    write_markdown(args.out, args, cfg, rows, run)
    print(f"wrote {args.out} and {csv_path}")


if __name__ == "__main__":
    main()
