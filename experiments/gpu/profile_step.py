"""experiments/gpu/profile_step.py — where a private step's time goes on the GPU (check.sh's profile
stage).

experiments/private_bench.py times whole steps; this profiles a few steps of the same systems (its
System, Data and BERT model, same flags) with torch.profiler and writes, per system, the step's
wall time against the GPU's busy time (the sum of kernel and copy times), the number of kernel
launches and of host waits (synchronisations and device-to-host copies) per step, and for the
first system the operators with the most CPU and CUDA time. A step whose GPU is idle most of the
wall time is bound by the host: launches, synchronisations, Python.

    python experiments/gpu/profile_step.py --systems dp-flat,opacus-ghost,torch --out profile.md
    (--autocast bf16: every forward and loss under torch.autocast, as private_bench.py's flag)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import private_bench as pb  # noqa: E402

HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpyAsync", "cudaMemcpy")


def synchronize(cfg: dict) -> None:
    if cfg["device"] == "cuda":
        torch.cuda.synchronize()


def profile_system(name: str, cfg: dict, data: pb.Data, steps: int):
    system = pb.System(name, cfg, data, sigma=1.0, clip=1.0)
    for s in range(3):
        system.step(data.step_batches(s))
    synchronize(cfg)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cfg["device"] == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for s in range(3, 3 + steps):
            system.step(data.step_batches(s))
        synchronize(cfg)
        wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    # the kernels' and copies' own events (an operator's events carry its kernels' time too)
    on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    device_us = sum(e.self_device_time_total for e in on_device)
    kernels = sum(e.count for e in on_device)
    waits = {k: sum(e.count for e in events if e.key == k) / steps for k in HOST_WAITS}
    row = (f"| {name} | {wall * 1e3:.1f} | {device_us / steps / 1e3:.1f} | "
           f"{device_us / steps / 1e6 / wall:.0%} | {kernels / steps:.0f} | "
           + " | ".join(f"{waits[k]:.0f}" for k in HOST_WAITS) + " |")
    del system
    if cfg["device"] == "cuda":
        torch.cuda.empty_cache()
    return row, events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="dp-flat,opacus-ghost,torch")
    pb.add_model_arguments(parser)
    # check.sh's private stage's shape (BERT-base width, 4 layers, B = 32)
    parser.set_defaults(hidden=768, heads=12, intermediate=3072, vocab=30522, batch=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the same tables without GPU rows (a check of this script)")
    parser.add_argument("--autocast", choices=sorted(pb.AUTOCAST), default=None,
                        help="run every forward and loss under torch.autocast to this dtype")
    parser.add_argument("--rows", type=int, default=25, help="operators listed per table")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    cfg = dict(vocab=args.vocab, seq=args.seq, hidden=args.hidden, heads=args.heads,
               layers=args.layers, intermediate=args.intermediate, batch=args.batch, accumulate=1,
               batches=4, lr=0.1, threads=torch.get_num_threads(), device=args.device,
               autocast=args.autocast)
    data = pb.Data(cfg)
    names = args.systems.split(",")
    lines = [f"# Profile of one step (torch.profiler, mean of {args.steps} steps after 3)", "",
             f"BERT {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
             f"vocab {args.vocab}, B = {args.batch}, T = {args.seq}"
             + (f", forward and loss under {args.autocast} autocast" if args.autocast else "")
             + "; "
             f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}, "
             f"torch {torch.__version__}. GPU busy = the sum of "
             "kernel and copy times (overlaps counted twice); waits per step by CUDA call.", "",
             "| system | wall ms | GPU busy ms | busy/wall | kernels | "
             + " | ".join(HOST_WAITS) + " |", "|---" * (5 + len(HOST_WAITS)) + "|"]
    detail = None
    for name in names:
        row, events = profile_system(name, cfg, data, args.steps)
        print(row, flush=True)
        lines.append(row)
        detail = detail or (name, events)
    name, events = detail
    for key in ("self_device_time_total", "self_cpu_time_total"):
        lines += ["", f"## {name}: operators by {key}", "", "```",
                  events.table(sort_by=key, row_limit=args.rows, max_name_column_width=60), "```"]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[-4:]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
