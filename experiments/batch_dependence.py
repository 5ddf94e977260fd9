"""How far one example more moves the other examples' clipped gradients through torch's
batch-dependent roundings: the limit docs/reliability.md states ("Not held in floating point").

torch's GEMMs compute a row differently as the batch's row count changes. The input of each of n
identical examples is x = u + M·v, v a unit vector in the null space of a frozen Linear(784, 128):
the layer's true output is that of u whatever M is, but the GEMM's partial sums are M times
larger, so its rounding is M times larger too. A trained Linear(128, 1) follows, the loss is the
sum of the outputs, flat clipping at C (the example's true norm), σ = 0, every example in every
batch (sample_rate 1). The table gives ‖S_{n+1} − S_n‖ / C, the clipped sums of n + 1 and n
identical examples: the added example's own contribution is at most 1; the rest is what the
roundings moved the others' contributions by.

    .venv/bin/python experiments/batch_dependence.py            # writes results/batch-dependence.md
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings

import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dpzero  # noqa: E402
from bench_common import dpzero_version, write_marked_section  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "batch-dependence.md")


def model() -> nn.Module:
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(784, 128), nn.Linear(128, 1))
    m[0].requires_grad_(False)
    return m


def crafted(scale: float) -> tuple:
    """(x [1, 784], the example's true gradient norm): u + scale·v, v in the first layer's null
    space, its norm computed in float64 from u alone."""
    g = torch.Generator().manual_seed(9)
    u = torch.randn(1, 784, generator=g).double()
    first = model()[0]
    w = first.weight.detach().double()
    v = torch.randn(784, 1, generator=g).double()
    v = v - w.T @ torch.linalg.lstsq(w.T, v).solution  # the part of v W does not see
    x = (u + scale * v.T / v.norm()).float()
    with torch.no_grad():
        hidden = first(u.float()).double()
    return x, math.sqrt(float(hidden.pow(2).sum()) + 1.0)  # the weight's and the bias's


def clipped_sum(x: torch.Tensor, n: int, c: float) -> torch.Tensor:
    p = dpzero.make_private(model(), dataset=TensorDataset(x.repeat(n, 1),
                                                           torch.zeros(n, dtype=torch.long)),
                            sample_rate=1.0, noise_multiplier=0.0, allow_no_noise=True,
                            max_grad_norm=c, lr=1.0, seed=5, loss_reduction="sum")
    before = torch.cat([t.detach().double().flatten() for t in p.model.parameters()
                        if t.requires_grad])
    for xb, _ in p.data_loader:
        p.model(xb).sum().backward()
        if p.optimizer.step():
            break
    after = torch.cat([t.detach().double().flatten() for t in p.model.parameters()
                       if t.requires_grad])
    return (before - after) * n  # lr 1, divided by the expected batch q·N = n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scales", default="0,1e2,1e4,1e6,1e8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    lines = [f"n = 15 and 16 identical examples, {args.threads} torch thread(s).", "",
             "| M | the example's true norm C | ‖S₁₆ − S₁₅‖ / C |", "|---|---|---|"]
    for scale in (float(s) for s in args.scales.split(",")):
        x, c = crafted(scale)
        move = float((clipped_sum(x, 16, c) - clipped_sum(x, 15, c)).norm()) / c
        lines.append(f"| {scale:g} | {c:.6g} | {move:.4f} |")
        print(lines[-1], flush=True)
    if not args.no_write:
        section = ["<!-- batch:begin -->",
                   f"Written by `experiments/batch_dependence.py` ({dpzero_version()}; "
                   f"{os.cpu_count()} CPU cores). Flat clipping, σ = 0, sum loss. The added "
                   "example's own contribution is at most 1 C.", ""] + lines + \
                  ["<!-- batch:end -->"]
        write_marked_section(RESULTS, "batch", "# One example more, through batch-dependent "
                             "roundings\n", "\n".join(section))
    return 0


if __name__ == "__main__":
    sys.exit(main())
