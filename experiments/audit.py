"""Empirical privacy audit of dpzero's DP-SGD in one run (Note [one-run audit] in
python/dpzero/audit.py).

The model is a linear classifier on Fashion-MNIST (28x28 images average-pooled to 7x7 = 49
features) whose input has m extra coordinates, one per canary. Canary i is the input with value
``canary_scale`` at coordinate 49 + i and zeros elsewhere, with a random label y_i; real examples
are zero there. So canary i's per-sample gradient lies in weight column 49 + i (and the shared
bias), is far above the clipping norm (clipped to exactly C: a "Dirac" canary, Nasr et al. 2023),
and no other example touches that column: the audit is white-box and close to the worst case
for the Gaussian mechanism. Each canary is in the training set with probability 1/2; after T
steps of `make_private` training (Poisson sampling at q, flat clipping at C, noise σC) the score
of canary i is the trained column's movement towards its label, <W[:, 49+i] - W0[:, 49+i],
e_{y_i} - 1/K>. `dpzero.audit.one_run_audit` turns the scores into a lower bound ε̂ on ε at 95 %
confidence, which must stay below the accountant's ε; with the noise switched off (σ = 0, which
the accountant calls ε = ∞) it must exceed the ε the accountant certifies for the noised run.

    .venv/bin/python experiments/audit.py        # writes experiments/results/audit.md
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import dpzero
from dpzero.audit import AuditResult, one_run_audit
from dpzero.train.datasets import fashion_mnist

CLASSES = 10


@dataclass
class CanaryRun:
    noise_multiplier: float
    audit: AuditResult
    epsilon_rdp: float      # the accountant's ε for the run (inf without noise)
    epsilon_prv: float
    dataset_size: int
    seconds: float
    bands: int = 1


def canary_run(noise_multiplier: float, *, canaries: int = 1000, real: int = 1000,
               sample_rate: float = 0.1, steps: int = 100, max_grad_norm: float = 1.0,
               lr: float = 0.5, canary_scale: float = 10.0, delta: float = 1e-5,
               seed: int = 0, bands: int = 1) -> CanaryRun:
    """One training run with m = ``canaries`` Dirac canaries, audited. ``bands`` > 1: banded
    correlated noise (make_private's bands; each canary is then sampled only at the steps of its
    partition), whose ε is DP-SGD's at ceil(steps / bands) steps (Choquette-Choo et al. 2023,
    Theorem 4), counted here independently of dpzero's accountant."""
    g = torch.Generator().manual_seed(seed)
    images, labels = fashion_mnist(train=True).tensors
    x_real = F.avg_pool2d(images[:real].float(), 4).flatten(1)  # [real, 49]
    features = x_real.shape[1]
    included = torch.rand(canaries, generator=g) < 0.5  # [m] the coin flips S
    canary_labels = torch.randint(CLASSES, (canaries,), generator=g)  # [m]
    inside = included.nonzero().flatten()
    x_can = torch.zeros(len(inside), features + canaries)
    x_can[torch.arange(len(inside)), features + inside] = canary_scale
    x = torch.cat([torch.cat([x_real, torch.zeros(real, canaries)], 1), x_can])
    y = torch.cat([labels[:real].long(), canary_labels[inside]])
    dataset = torch.utils.data.TensorDataset(x, y)

    torch.manual_seed(seed)
    model = nn.Linear(features + canaries, CLASSES)
    with torch.no_grad():
        model.weight[:, features:] = 0.0  # a canary's logits start at the bias alone
    start_weight = model.weight.detach().clone()
    p = dpzero.make_private(model, dataset=dataset, sample_rate=sample_rate,
                            noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                            allow_no_noise=noise_multiplier == 0.0, optimizer="sgd", lr=lr,
                            seed=seed, zero_stage=0, accountant="rdp", bands=bands)
    began = time.perf_counter()
    taken = 0
    while taken < steps:
        for xb, yb in p.data_loader:
            p.optimizer.zero_grad()
            F.cross_entropy(p.model(xb), yb).backward()
            if p.optimizer.step():
                taken += 1
                if taken == steps:
                    break
    seconds = time.perf_counter() - began
    moved = (p.privacy_engine.parameters()["weight"] - start_weight)[:, features:]  # [K, m]
    towards = F.one_hot(canary_labels, CLASSES).double() - 1.0 / CLASSES  # [m, K]
    scores = (moved.double().T * towards).sum(1)  # [m]
    audit = one_run_audit(scores, included, delta)
    if noise_multiplier > 0:
        eps_rdp = p.privacy_engine.epsilon(delta)
        prv = dpzero.PRVAccountant()
        prv.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate,
                 num_steps=math.ceil(steps / bands))
        eps_prv = prv.get_epsilon(delta)
    else:
        eps_rdp = eps_prv = math.inf
    return CanaryRun(noise_multiplier, audit, eps_rdp, eps_prv, len(dataset), seconds, bands)


def _table(runs, args) -> str:
    lines = [
        "# Empirical privacy audit (one run, Steinke, Nasr and Jagielski 2023)", "",
        "Produced by `.venv/bin/python experiments/audit.py` (see its docstring for the canary "
        "design). Linear classifier on Fashion-MNIST (7x7 pooled) with "
        f"m = {args.canaries} Dirac canaries (each in the training set with probability 1/2), "
        f"{args.real} real examples, q = {args.sample_rate}, T = {args.steps} steps, C = 1, "
        "δ = 1e-5, SGD" + (f", banded correlated noise with b = {args.bands} bands (cyclic "
                           "Poisson sampling over b partitions; ε of DP-SGD at ⌈T/b⌉ steps)"
                           if args.bands > 1 else "") + ". ε̂: the audit's lower bound at 95 % confidence (Bonferroni over four "
        "guess counts); ε (RDP / PRV): what dpzero's accountants certify for the run.", "",
        "| σ | ε (RDP) | ε (PRV upper) | audit ε̂ | correct / guesses | verdict |",
        "|---|---|---|---|---|---|"]
    for r in runs:
        a = r.audit
        verdict = ("leak detected (no noise: no guarantee)" if r.noise_multiplier == 0 and
                   a.epsilon > min(x.epsilon_rdp for x in runs if x.noise_multiplier > 0)
                   else "consistent (ε̂ ≤ ε)" if a.epsilon <= r.epsilon_prv else
                   "VIOLATION: ε̂ > ε")
        lines.append(f"| {r.noise_multiplier:g} | {r.epsilon_rdp:.3f} | {r.epsilon_prv:.3f} | "
                     f"{a.epsilon:.3f} | {a.correct} / {a.k_plus + a.k_minus} | {verdict} |")
    lines += ["", "Reading: with noise, the audit's bound stays below the accountants' ε, as it "
              "must; it is far below it because one run with m canaries can certify at most "
              "about ln(r/3) and the Gaussian mechanism's worst case is not reached by any one "
              "threshold."]
    if args.bands == 1:
        lines[-1] += (" With σ = 0 the canaries are perfectly separated and ε̂ exceeds the ε "
                      "that any of the noised runs claims: the audit detects the missing noise.")
    else:
        weakest = min(runs, key=lambda r: r.noise_multiplier)
        strongest = max(runs, key=lambda r: r.noise_multiplier)
        lines[-1] += (f" Banded noise refuses σ = 0, so the smallest σ stands for noise far too "
                      f"small: there ε̂ = {weakest.audit.epsilon:.3f} exceeds the ε = "
                      f"{strongest.epsilon_rdp:.3f} that the run at σ = "
                      f"{strongest.noise_multiplier:g} claims" +
                      ("" if weakest.audit.epsilon > strongest.epsilon_rdp else " (NOT)") +
                      ": the audit would see noise that small.")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--canaries", type=int, default=5000)
    parser.add_argument("--real", type=int, default=1000)
    parser.add_argument("--sample-rate", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--sigmas", default="0,1,2,3")
    parser.add_argument("--bands", type=int, default=1,
                        help="banded correlated noise with this many bands (1: DP-SGD)")
    parser.add_argument("--out", default=None,
                        help="default experiments/results/audit.md, or audit-bands-B.md")
    args = parser.parse_args(argv)
    args.out = args.out or os.path.join(os.path.dirname(__file__), "results", "audit.md" if
                                        args.bands == 1 else f"audit-bands-{args.bands}.md")
    runs = []
    for sigma in (float(s) for s in args.sigmas.split(",")):
        run = canary_run(sigma, canaries=args.canaries, real=args.real,
                         sample_rate=args.sample_rate, steps=args.steps, bands=args.bands)
        print(f"σ = {sigma:g}: ε̂ = {run.audit.epsilon:.3f} ({run.audit.correct}/"
              f"{run.audit.k_plus + run.audit.k_minus} correct), ε (RDP) = "
              f"{run.epsilon_rdp:.3f}, {run.seconds:.1f} s", file=sys.stderr)
        runs.append(run)
    text = _table(runs, args)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
