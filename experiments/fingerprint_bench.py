"""The state fingerprint's rate (Note [state written from data]): ``state_fingerprints`` as the
guards call it (dpzero::_state_fingerprint over the words of Note [fingerprint words] in
src/dp/state_guard.h) against ATen reading the same tensor once (``sum``) and copying it
(``clone``), in one run on the same device (the CPU always; CUDA when present and built). The
private step fingerprints every trained word about three times a step (before a logical batch's
first micro-batch, at the step, after the update), so this rate against the step's own reads of
the weights is its share of a step.

Usage: .venv/bin/python experiments/fingerprint_bench.py [--sizes 1e6,1e7] [--repeats 9]
        [--out experiments/results/fingerprint.md]
Reports GB/s of the tensor's bytes for each and the fingerprint's time over the sum's (> 1: slower
than one read).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys

import torch

import dpzero

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import dpzero_version, median_seconds  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16)
MANY, MANY_WORDS = 150, 4096


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1e6,1e7,3e7")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results", "fingerprint.md"))
    args = parser.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and dpzero._C.with_cuda else [])
    key = secrets.randbits(62)
    lines = ["# State fingerprint throughput (median of repeats, one run, same device)", "",
             f"Written by `experiments/fingerprint_bench.py` ({dpzero_version()}; torch "
             f"{torch.__version__}, {torch.get_num_threads()} CPU threads"
             + (f"; {torch.cuda.get_device_name()}" if "cuda" in devices else "") + "). GB/s of "
             "the tensor's bytes; fingerprint / sum is the fingerprint's time over one ATen "
             "reduction's.", "",
             "| device | dtype | elements | fingerprint (GB/s) | sum (GB/s) | clone (GB/s) "
             "| fingerprint / sum |",
             "|---|---|---|---|---|---|---|"]
    for device in devices:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        for dtype in DTYPES:
            for n in (int(float(s)) for s in args.sizes.split(",")):
                x = torch.randn(n, device=device).to(dtype)
                gb = x.numel() * x.element_size() / 1e9
                f = median_seconds(lambda: dpzero._C.dp.state_fingerprints([x], key),
                                   args.repeats, sync)
                s = median_seconds(lambda: x.sum(), args.repeats, sync)
                c = median_seconds(lambda: x.clone(), args.repeats, sync)
                lines.append(f"| {device} | {str(dtype).split('.')[1]} | {n:.0e} | {gb / f:.1f} | "
                             f"{gb / s:.1f} | {gb / c:.1f} | {f / s:.2f} |")
    lines += ["", f"Many small tensors ({MANY} of {MANY_WORDS} float32 elements, a model's frozen "
              "parameters or units), one call for the list against one call per tensor:", "",
              "| device | one call (ms) | a call each (ms) | a call each / one call |",
              "|---|---|---|---|"]
    for device in devices:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        ts = [torch.randn(MANY_WORDS, device=device) for _ in range(MANY)]
        one = median_seconds(lambda: dpzero._C.dp.state_fingerprints(ts, key), args.repeats, sync)
        each = median_seconds(lambda: [dpzero._C.dp.state_fingerprints([t], key) for t in ts],
                              args.repeats, sync)
        lines.append(f"| {device} | {one * 1e3:.3f} | {each * 1e3:.3f} | {each / one:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
