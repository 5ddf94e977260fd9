"""Noise-generation throughput: dpzero's counter-based add_noise_ against torch.randn + add_ of the
same size, in one run on the same device (CPU always; CUDA when present and built).

Usage: .venv/bin/python experiments/noise_bench.py [--sizes 1e6,1e7] [--repeats 5]
Reports elements/s for both and the ratio dpzero / torch (> 1 means dpzero is faster).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import dpzero

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import median_seconds  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1e5,1e6,1e7")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "noise.md"))
    args = parser.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and dpzero._C.with_cuda else [])
    lines = [
        "# Noise generation throughput (median of repeats, one run, same device)",
        "",
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads. dpzero/torch > 1 means "
        "dpzero is faster. Secure mode (ChaCha20, fp64, 4 normals per coordinate) is listed too.",
        "",
        "| device | elements | dpzero add_noise_ (elem/s) | torch randn+add_ (elem/s) | dpzero/torch "
        "| dpzero secure (elem/s) |",
        "|---|---|---|---|---|---|",
    ]
    for line in lines:
        print(line)
    for device in devices:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        for n in (int(float(s)) for s in args.sizes.split(",")):
            x = torch.zeros(n, device=device)
            t_ours = median_seconds(lambda: torch.ops.dpzero.add_noise_(x, 1.0, 1, 2, 0),
                                    args.repeats, sync)
            t_torch = median_seconds(lambda: x.add_(torch.randn(n, device=device), alpha=1.0),
                                     args.repeats, sync)
            key = list(range(8))
            t_secure = median_seconds(
                lambda: torch.ops.dpzero.add_secure_noise_(x, 1.0, key, 2, 0), args.repeats, sync)
            line = (f"| {device} | {n:.0e} | {n / t_ours:.3e} | {n / t_torch:.3e} | "
                    f"{t_torch / t_ours:.2f} | {n / t_secure:.3e} |")
            print(line, flush=True)
            lines.append(line)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
