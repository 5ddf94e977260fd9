"""Banded correlated noise (make_private's ``bands``) against DP-SGD at equal ε: the strategies'
expected errors, and test accuracy side by side.

  errors    For a run of n steps at DP-SGD's sample rate q and a target ε, each b: σ_b calibrated
            by the PRV accountant for the run with b bands (n/b equivalent steps at rate b·q,
            accounting/banded.h), and the noise's expected squared error of a prefix sum of the
            updates, σ_b² κ_b² MeanSE_b(n) (privacy/banded.h: κ the strategy's largest column
            norm, MeanSE its error per unit noise), over DP-SGD's σ_1² (n + 1)/2. Below 1 the
            banded noise disturbs the trajectory less. Arithmetic only (seconds).
  utility   ScatterNet + linear on Fashion-MNIST (configs/scatternet-fashion-mnist.toml, with the
            batch, epochs and learning rate below), DP-SGD (b = 1) against b bands at ε = 1, 3
            and 8, three seeds each, the same model, steps and hyperparameters: one ``dpzero
            sweep --grid privacy.bands=1,B --seeds 3`` per ε (the features are computed once per
            sweep). About 45 minutes on 2 cores. --model cnn: the end-to-end tanh CNN
            (configs/cnn-fashion-mnist-tb.toml) with the same batch, epochs and learning rate,
            about 13 minutes a run here.

  cost      The private step's time on experiments/private_bench.py's BERT (4 × 256, T = 128,
            expected batch 16, SGD, σ = 1, C = 1, one logical batch per step through the private
            data loader), b = 1 (DP-SGD), 4 and 16, stepped round by round (interleaved), median
            of each and the paired ratio to b = 1; the noise history's bytes beside it (b − 1
            float32 copies of the trained parameters at stage 0, what dpzero plan predicts).

    .venv/bin/python experiments/bandmf.py errors
    .venv/bin/python experiments/bandmf.py utility [--bands 4] [--model scatternet|cnn]
        [--epsilons 1,3,8] [--seeds 3] [--out runs/bandmf]
    .venv/bin/python experiments/bandmf.py cost [--rounds 20]
Each writes its section of experiments/results/bandmf.md.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tomllib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dpzero  # noqa: E402
from bench_common import dpzero_version, write_marked_section  # noqa: E402
from dpzero import _C  # noqa: E402
from dpzero.train.launch import to_toml  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results", "bandmf.md")
TITLE = "# Banded correlated noise against DP-SGD at equal ε\n"
N = 60000  # Fashion-MNIST's training split
EPSILONS = (1.0, 3.0, 8.0)
# The utility runs: ScatterNet's config with a smaller batch and more steps than Tramèr & Boneh's
# (B = 8192, 292 steps), where the errors table predicts no gain for any b (below).
UTILITY = {"batch_size": 1024, "epochs": 20, "lr": 2.0, "max_physical_batch_size": 1024}


def relative_errors(batch: int, epochs: float, eps: float, bands: list) -> list:
    """[(b, σ_b, error_b / error_1, optimized_b / error_1)] for a run of ``epochs`` at expected
    batch ``batch``: the square root's error and the optimized strategy's (Note [optimized banded
    strategies]), both at σ_b."""
    q1 = batch / N
    n = int(epochs / q1)
    out = []
    for b in bands:
        sigma = dpzero.get_noise_multiplier(target_epsilon=eps, target_delta=1e-5,
                                            sample_rate=q1 * b, epochs=epochs, accountant="prv")
        errors = []
        for strategy in ((_C.privacy.BandedToeplitz.sqrt_prefix_sum(b),
                          _C.privacy.BandedToeplitz.optimized(b, n)) if b > 1
                         else (_C.privacy.BandedToeplitz.identity(),) * 2):
            kappa = strategy.column_norm(b, 0)
            errors.append((sigma * kappa) ** 2 * strategy.mean_squared_error(n))
        out.append((b, sigma, *errors))
    return [(b, s, e / out[0][2], o / out[0][2]) for b, s, e, o in out]


def errors() -> str:
    lines = ["<!-- errors:begin -->",
             f"Written by `experiments/bandmf.py errors` ({dpzero_version()}). Fashion-MNIST's "
             "N = 60,000, δ = 1e-5, PRV accountant. Each cell: σ_b calibrated for ε with b bands, "
             "and the expected squared error of a prefix sum of the noise, σ_b² κ_b² MeanSE_b(n), "
             "relative to DP-SGD's (b = 1), for the banded square root and (after the slash) for "
             "the optimized banded strategy of the same b and n (Note [optimized banded "
             "strategies]). Below 1: less noise in the trajectory than DP-SGD.",
             ""]
    for batch, epochs in ((8192, 40), (2048, 40), (1024, 20), (256, 10)):
        bands = [b for b in (1, 2, 4, 8, 16, 32) if batch * b <= N]
        n = int(epochs / (batch / N))
        lines += [f"Expected batch {batch}, {epochs} epochs ({n} steps):", "",
                  "| ε | " + " | ".join(f"b = {b}" for b in bands) + " |",
                  "|---|" + "---|" * len(bands)]
        for eps in EPSILONS:
            cells = [f"σ {s:.2f}, {e:.2f}" + (f" / {o:.2f}" if b > 1 else "")
                     for b, s, e, o in relative_errors(batch, epochs, eps, bands)]
            lines.append(f"| {eps:g} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("<!-- errors:end -->")
    return "\n".join(lines)


# The utility runs' models: their base configs and their results sections.
MODELS = {"scatternet": ("scatternet-fashion-mnist.toml", "utility", "ScatterNet + linear"),
          "cnn": ("cnn-fashion-mnist-tb.toml", "utility-cnn",
                  "the end-to-end tanh CNN (Tramèr & Boneh's recipe: pixels in [0, 1], "
                  "padding 2)")}


def _sweep(raw: dict, sweep_dir: str, grid: list, seeds: int) -> list:
    """``dpzero sweep`` of ``raw`` (a config) into ``sweep_dir`` (its finished runs reused): the
    rows of its sweep.csv."""
    raw["output"]["dir"] = sweep_dir
    os.makedirs(os.path.dirname(sweep_dir), exist_ok=True)
    config = sweep_dir + ".toml"
    with open(config, "w") as f:
        f.write(to_toml(raw))
    subprocess.run([os.path.join(ROOT, ".venv", "bin", "dpzero"), "sweep", config, *grid,
                    "--seeds", str(seeds), "--output", sweep_dir], check=True)
    with open(os.path.join(sweep_dir, "sweep.csv")) as f:
        return list(csv.DictReader(f))


def utility(bands: int, out: str, model: str = "scatternet", epsilons=EPSILONS,
            seeds: int = 3, strategies=("sqrt_prefix_sum",), batch: int = 1024,
            lr: float = 2.0, epochs: float = 20) -> tuple:
    """(section tag, section text) of DP-SGD against ``bands`` bands with each of ``strategies``
    on ``model`` at each ε, at expected batch ``batch``, learning rate ``lr`` and ``epochs``."""
    config_name, tag, what = MODELS[model]
    recipe = dict(UTILITY, batch_size=batch, lr=lr, epochs=epochs,
                  max_physical_batch_size=min(batch, UTILITY["max_physical_batch_size"]))
    standard = (batch, lr, epochs) == (UTILITY["batch_size"], UTILITY["lr"], UTILITY["epochs"])
    if not standard:  # another recipe: its own runs and section
        name = f"batch{batch}-lr{lr:g}-epochs{epochs:g}"
        tag, model_dir = f"{tag}-{name}", f"{model}-{name}"
    else:
        model_dir = model
    with open(os.path.join(ROOT, "configs", config_name), "rb") as f:
        raw = tomllib.load(f)
    raw["privacy"].pop("noise_multiplier", None)  # σ is calibrated for each ε and b
    raw["training"].update(recipe)
    columns = [(1, "sqrt_prefix_sum")] + [(bands, s) for s in strategies]
    acc, sig = {}, {}  # (ε, column) -> accuracies, σ
    for eps in epsilons:
        raw["privacy"]["target_epsilon"] = eps
        sweep_dir = os.path.join(out, model_dir, f"eps{eps:g}")
        square_root = "sqrt_prefix_sum" in strategies
        found = [((1 if int(r.get("privacy.bands", 1)) == 1 else bands, "sqrt_prefix_sum"), r)
                 for r in _sweep(dict(raw, privacy=dict(raw["privacy"])), sweep_dir,
                                 ["--grid", f"privacy.bands=1,{bands}"] if square_root else [],
                                 seeds)]
        if "optimized" in strategies:
            fitted = dict(raw, privacy=dict(raw["privacy"], bands=bands, strategy="optimized"))
            found += [((bands, "optimized"), r)
                      for r in _sweep(fitted, sweep_dir + "-optimized", [], seeds)]
        for column, r in found:
            acc.setdefault((eps, column), []).append(float(r["accuracy"]))
            sig[(eps, column)] = float(r["noise_multiplier"])
    names = {(1, "sqrt_prefix_sum"): "DP-SGD (b = 1)", (bands, "sqrt_prefix_sum"):
             f"b = {bands}, square root", (bands, "optimized"): f"b = {bands}, optimized"}
    flags = "".join([f" --model {model}", f" --bands {bands}" if bands != 4 else "",
                     f" --strategies {','.join(strategies)}"
                     if tuple(strategies) != ("sqrt_prefix_sum",) else "",
                     "" if standard else f" --batch {batch} --lr {lr:g} --epochs {epochs:g}"])
    lines = [f"<!-- {tag}:begin -->",
             f"Written by `experiments/bandmf.py utility{flags}` ({dpzero_version()}; "
             f"2-core CPU, one rank). {what}: `configs/{config_name}` with expected batch "
             f"{recipe['batch_size']}, {recipe['epochs']:g} epochs, lr {recipe['lr']:g} (SGD, "
             "momentum 0.9, C = 0.1), δ = 1e-5, σ calibrated by PRV for each ε; the same "
             "hyperparameters for every mechanism. Test accuracy, mean ± sd over seeds "
             f"{', '.join(str(k) for k in range(seeds))}; the gain is over DP-SGD, in points.",
             "", "| ε | " + " | ".join(names[c] for c in columns) + " | gain (points) | σ (" +
             " / ".join(f"b = {b}" for b in sorted({b for b, _ in columns})) + ") |",
             "|---|" + "---|" * (len(columns) + 2)]
    for eps in epsilons:
        mean = {c: statistics.mean(acc[(eps, c)]) for c in columns}
        sd = {c: statistics.stdev(acc[(eps, c)]) if len(acc[(eps, c)]) > 1 else 0.0
              for c in columns}
        cells = [f"{100 * mean[c]:.2f}% ± {100 * sd[c]:.2f}" for c in columns]
        gains = " / ".join(f"{100 * (mean[c] - mean[columns[0]]):+.2f}" for c in columns[1:])
        sigmas = " / ".join(f"{next(v for (e, (bb, _)), v in sig.items() if e == eps and bb == b):.3g}"
                            for b in sorted({b for b, _ in columns}))
        lines.append(f"| {eps:g} | " + " | ".join(cells) + f" | {gains} | {sigmas} |")
    lines.append(f"<!-- {tag}:end -->")
    return tag, "\n".join(lines)


def cost(rounds: int) -> str:
    import time

    import torch
    import torch.nn.functional as F

    from bench_common import paired_ratios
    from private_bench import make_model

    torch.set_num_threads(2)
    cfg = dict(vocab=8192, hidden=256, layers=4, heads=4, intermediate=1024, seq=128)
    n, batch = 4096, 16
    g = torch.Generator().manual_seed(1234)
    data = torch.utils.data.TensorDataset(torch.randint(cfg["vocab"], (n, cfg["seq"]), generator=g),
                                          torch.randint(2, (n,), generator=g))
    systems, params = {}, 0
    for b in (1, 4, 16):
        model = make_model(cfg)
        params = sum(p.numel() for p in model.parameters())
        p = dpzero.make_private(model, dataset=data, batch_size=batch, noise_multiplier=1.0,
                                max_grad_norm=1.0, lr=0.1, seed=0, bands=b)
        systems[b] = (p, iter(p.data_loader))

    def step(b):
        p, batches = systems[b]
        try:
            ids, labels = next(batches)
        except StopIteration:
            systems[b] = (p, iter(p.data_loader))
            ids, labels = next(systems[b][1])
        start = time.perf_counter()
        F.cross_entropy(p.model(ids).logits, labels).backward()
        middle = time.perf_counter()
        p.optimizer.step()
        p.optimizer.zero_grad()
        end = time.perf_counter()
        return end - start, end - middle

    times = {b: [] for b in systems}
    updates = {b: [] for b in systems}
    for r in range(rounds + 3):
        for b in systems:
            t, u = step(b)
            if r >= 3:
                times[b].append(t)
                updates[b].append(u)
    lines = ["<!-- cost:begin -->",
             f"Written by `experiments/bandmf.py cost` ({dpzero_version()}; 2 torch threads, "
             f"{rounds} interleaved rounds after 3 warm-up). BERT {cfg['layers']} × "
             f"{cfg['hidden']}, T = {cfg['seq']}, {params / 1e6:.2f} M parameters, expected batch "
             f"{batch}, SGD, σ = 1, C = 1, stage 0, one rank. Step = forward + backward + the "
             "private step (noise included); Poisson batches, so sizes vary from step to step "
             "and the whole step's ratio is wide. The private step alone (optimizer.step(): the "
             "ledger-free transaction, the noise and the SGD update) does not depend on the "
             "batch.", "",
             "| bands | median step (ms) | × b = 1 (paired, IQR) | optimizer.step() (ms) | "
             "× b = 1 (paired, IQR) | noise history (MiB) |",
             "|---|---|---|---|---|---|"]
    for b in systems:
        ratio = paired_ratios(times, b, 1) if b != 1 else (1.0, 1.0, 1.0)
        upd = paired_ratios(updates, b, 1) if b != 1 else (1.0, 1.0, 1.0)
        lines.append(f"| {b} | {1e3 * statistics.median(times[b]):.1f} | {ratio[0]:.2f} "
                     f"({ratio[1]:.2f}–{ratio[2]:.2f}) | {1e3 * statistics.median(updates[b]):.1f}"
                     f" | {upd[0]:.2f} ({upd[1]:.2f}–{upd[2]:.2f}) | "
                     f"{4 * (b - 1) * params / 2**20:.1f} |")
    lines.append("<!-- cost:end -->")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("errors", "utility", "cost"))
    parser.add_argument("--bands", type=int, default=4)
    parser.add_argument("--model", choices=sorted(MODELS), default="scatternet",
                        help="utility: the model (its section of bandmf.md)")
    parser.add_argument("--epsilons", default=",".join(f"{e:g}" for e in EPSILONS),
                        help="utility: the target ε values")
    parser.add_argument("--seeds", type=int, default=3, help="utility: seeds per cell")
    parser.add_argument("--strategies", default="sqrt_prefix_sum",
                        help="utility: the banded strategies to run beside DP-SGD, comma-separated "
                             "(sqrt_prefix_sum, optimized)")
    parser.add_argument("--batch", type=int, default=UTILITY["batch_size"],
                        help="utility: the expected batch")
    parser.add_argument("--lr", type=float, default=UTILITY["lr"], help="utility: SGD's lr")
    parser.add_argument("--epochs", type=float, default=UTILITY["epochs"], help="utility: epochs")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bandmf"))
    args = parser.parse_args(argv)
    if args.what == "errors":
        tag, section = "errors", errors()
    elif args.what == "cost":
        tag, section = "cost", cost(args.rounds)
    else:
        strategies = tuple(args.strategies.split(","))
        bad = sorted(set(strategies) - {"sqrt_prefix_sum", "optimized"})
        if bad:
            parser.error(f"--strategies: unknown {bad}; use sqrt_prefix_sum and/or optimized")
        tag, section = utility(args.bands, args.out, args.model,
                               tuple(float(e) for e in args.epsilons.split(",")), args.seeds,
                               strategies, args.batch, args.lr, args.epochs)
    print(section)
    write_marked_section(RESULTS, tag, TITLE, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
