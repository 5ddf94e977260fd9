"""Noise-generation throughput: dpzero's counter-based add_noise_ against torch.randn + add_ of the
same size, in one run on the same device (CPU always; CUDA when present and built).

Usage: .venv/bin/python experiments/noise_bench.py [--sizes 1e6,1e7] [--repeats 5]
Reports elements/s for both and the ratio dpzero / torch (> 1 means dpzero is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dpzero


def bench(fn, repeats, sync):
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1e5,1e6,1e7")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and dpzero._C.with_cuda else [])
    print(f"torch threads: {torch.get_num_threads()}")
    print("| device | elements | dpzero add_noise_ (elem/s) | torch randn+add_ (elem/s) | dpzero/torch |")
    print("|---|---|---|---|---|")
    for device in devices:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        for n in (int(float(s)) for s in args.sizes.split(",")):
            x = torch.zeros(n, device=device)
            t_ours = bench(lambda: torch.ops.dpzero.add_noise_(x, 1.0, 1, 2, 0), args.repeats, sync)
            t_torch = bench(lambda: x.add_(torch.randn(n, device=device), alpha=1.0), args.repeats,
                            sync)
            print(f"| {device} | {n:.0e} | {n / t_ours:.3e} | {n / t_torch:.3e} | "
                  f"{t_torch / t_ours:.2f} |", flush=True)


if __name__ == "__main__":
    main()
