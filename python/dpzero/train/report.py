"""The run report: ``report.md``, ``report.json`` and PNG plots, from the run directory.

The privacy part is recomputed from ``ledger.jsonl`` alone (the ledger is the record of what was
spent; ``dpzero report RUN_DIR`` can regenerate it for any run, even one whose other files are
gone): ε versus steps under RDP and PRV (estimate with its [lower, upper] band) and the final ε.
The private model's test metrics come from ``metrics.jsonl`` and ``result.json``. δ is the one
the run used (``config.json``), else the default min(1e-5, 1/(10 N)) from the ledger header.

The report carries only released figures (Note [released figures] in private/engine.py): ε, δ,
σ, q, C, steps, the expected batch size, who sampled the batches, and the private model evaluated
on held-out data. What depends on the training data without noise — realised batch sizes,
dropped samples, training losses, and everything about the non-private baseline — goes to
``private/diagnostics.md`` (with ``private/loss.png``), headed as not covered by ε.
"""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional

from .. import _C
from ..accounting import Ledger
from ..budget import curve_over, evaluate

_acc = _C.accounting

# The run directory's folder for what is NOT covered by ε (Note [released figures]).
PRIVATE_DIR = "private"


def _prefix(phases, steps: int):
    """The phases of the first ``steps`` steps."""
    out, left = [], steps
    for p in phases:
        if left <= 0:
            break
        take = min(left, p.steps)
        out.append(_acc.Phase(p.q, p.sigma, take))
        left -= take
    return out


def ledger_curve(phases, delta: float, points: int = 16) -> Dict[str, List[float]]:
    """ε after t steps of the recorded phases, t on a grid up to the total (RDP and PRV)."""
    total = sum(p.steps for p in phases)
    if total == 0:
        return {"steps": []}
    grid = sorted({max(1, round(total * k / (points - 1))) for k in range(points)} | {total})
    return curve_over(grid, lambda t: _prefix(phases, t), delta)


def _read_jsonl(path: str) -> List[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


def _plot_epsilon(curve, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    s = curve["steps"]
    ax.plot(s, curve["rdp"], label="RDP", color="tab:blue")
    ax.plot(s, curve["prv_estimate"], label="PRV estimate", color="tab:orange")
    ax.fill_between(s, curve["prv_lower"], curve["prv_upper"], color="tab:orange", alpha=0.25,
                    label="PRV [lower, upper]")
    ax.set_xlabel("steps")
    ax.set_ylabel("ε")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(run_dir: str, delta: Optional[float] = None) -> Dict:
    """Writes report.md, report.json and the plots into ``run_dir``, and the data-dependent diagnostics
    into ``run_dir/private`` when the run has any; returns the report data. ``delta``: the run's
    δ when its ``config.json`` is not dpzero's (the Trainer's output_dir holds the model's)."""
    from .config import default_delta

    ledger_path = os.path.join(run_dir, "ledger.jsonl")
    if not os.path.exists(ledger_path):
        raise FileNotFoundError(f"{ledger_path} does not exist: a report needs the run's ledger")
    ledger = Ledger.open_read_only(ledger_path)
    config = {}
    if os.path.exists(os.path.join(run_dir, "config.json")):
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
    n = ledger.dataset_size
    d = delta if delta is not None else config.get("privacy", {}).get("delta", "auto")
    delta = {"1/N": 1.0 / n, "auto": default_delta(n), None: default_delta(n)}.get(d) \
        if not isinstance(d, (int, float)) else float(d)
    noised = not ledger.has_unnoised_steps
    # A ledger with unnoised steps has no finite ε and no phases to compose; the report says so.
    phases = [p for p in ledger.phases() if p.steps > 0] if noised else []
    final = evaluate(phases, delta).to_dict() if phases and noised else None
    curve = ledger_curve(phases, delta) if phases and noised else {"steps": []}
    results = {}
    if os.path.exists(os.path.join(run_dir, "result.json")):
        with open(os.path.join(run_dir, "result.json")) as f:
            results = {"private": json.load(f).get("private")}
    metrics = _read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    settings = ledger.settings
    # A banded run's phase is its equivalent DP-SGD steps, each sampling one of b partitions.
    bands = ledger.native.bands
    data = {
        "run_id": ledger.run_id, "dataset_size": n, "delta": delta,
        "steps": ledger.total_steps, "noise": noised, "bands": bands,
        "secure_mode": settings.get("secure_mode"), "settings": settings,
        "phases": [{"q": p.q, "sigma": p.sigma, "steps": p.steps,
                    "expected_batch_size": p.q * n / bands} for p in phases],
        "caller_sampled_steps": ledger.caller_sampled_steps,
        "privacy_unit": PRIVACY_UNIT, "not_covered": NOT_COVERED,
        "epsilon": final, "curve": curve, "results": results,
    }
    with open(os.path.join(run_dir, "report.json"), "w") as f:
        json.dump(data, f, indent=2, default=str)
    plots = []
    if curve["steps"]:
        _plot_epsilon(curve, os.path.join(run_dir, "epsilon.png"),
                      f"ε spent (δ = {delta:.3g}, N = {n})")
        plots.append("epsilon.png")
    evals = [m for m in metrics if m.get("run") == "private" and "accuracy" in m]
    if evals:
        _plot_curves({"private": evals}, "accuracy", "test accuracy (private model)",
                     os.path.join(run_dir, "accuracy.png"))
        plots.append("accuracy.png")
    with open(os.path.join(run_dir, "report.md"), "w") as f:
        f.write(_markdown(data, plots))
    private_dir = os.path.join(run_dir, PRIVATE_DIR)
    if os.path.isdir(private_dir):
        _write_diagnostics(private_dir, results.get("private") or {})
    return data


def _plot_curves(runs: Dict[str, List[dict]], key: str, ylabel: str, path: str) -> None:
    """``key`` against step for each run (a resumed run logs some steps twice: the last wins)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"private": "tab:red", "baseline": "tab:green"}
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for run, rows in runs.items():
        pts = sorted({m["step"]: m[key] for m in rows if key in m}.items())
        if pts:
            ax.plot(*zip(*pts), label=run, color=colors.get(run),
                    marker="o" if key == "accuracy" else None)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


DIAGNOSTICS_WARNING = (
    "**PRIVATE: not covered by the run's ε.** Everything below depends on the training data "
    "without the mechanism's noise (each step's realised batch size, samples dropped for a "
    "non-finite loss or gradient, training losses, wall times) or comes from a model trained "
    "without privacy (the baseline). Keep this folder with the training data; do not share it.")


def _write_diagnostics(private_dir: str, private_result: dict) -> None:
    """private/diagnostics.md (and loss.png) from the private folder's files."""
    steps = [r for r in _read_jsonl(os.path.join(private_dir, "diagnostics.jsonl"))
             if r.get("kind") == "step"]
    training = _read_jsonl(os.path.join(private_dir, "training.jsonl"))
    baseline = None
    if os.path.exists(os.path.join(private_dir, "baseline.json")):
        with open(os.path.join(private_dir, "baseline.json")) as f:
            baseline = json.load(f)
    lines = ["# Data-dependent diagnostics", "", DIAGNOSTICS_WARNING, ""]
    if steps:
        sizes = [r["logical_batch_size"] for r in steps]
        dropped = sum(r["dropped"] for r in steps)
        lines.append(f"- realised logical batch sizes over {len(sizes)} steps: min {min(sizes)}, "
                     f"mean {sum(sizes) / len(sizes):.1f}, max {max(sizes)}")
        lines.append(f"- samples dropped (NaN/Inf loss or gradient): {dropped}")
        all_dropped = sum(1 for r in steps if r.get("all_dropped"))
        if all_dropped:
            lines.append(f"- **{all_dropped} step(s) dropped every example: the model moved by "
                         "noise alone** (charged like the others)")
    seconds = {m["run"]: m["seconds"] for m in training if "seconds" in m}
    if baseline or seconds:
        lines += ["", "| run | test accuracy | test loss | steps | seconds |",
                  "|---|---|---|---|---|"]
        for name, run, r in (("private", "private", private_result),
                             ("baseline (no privacy)", "baseline", baseline)):
            if r:
                lines.append(f"| {name} | {_fmt(r.get('accuracy'))} | "
                             f"{_fmt(r.get('test_loss'))} | {r.get('steps')} | "
                             f"{_fmt(seconds.get(run), 3)} |")
    runs = {run: [m for m in training if m.get("run") == run and "loss" in m]
            for run in ("private", "baseline")}
    runs = {k: v for k, v in runs.items() if v}
    if runs:
        _plot_curves(runs, "loss", "training loss (rank 0's rows)",
                     os.path.join(private_dir, "loss.png"))
        lines += ["", "![loss.png](loss.png)"]
    lines.append("")
    with open(os.path.join(private_dir, "diagnostics.md"), "w") as f:
        f.write("\n".join(lines))


def _fmt(x, digits=4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isinf(x):
            return "∞"
        return f"{x:.{digits}g}"
    return str(x)


# What ε is about, and what it leaves out, in every report.
PRIVACY_UNIT = ("one training example: (ε, δ) bounds what the run reveals about adding or "
                "removing any one example (replacing one: at most 2ε, with δ(1 + e^ε))")
NOT_COVERED = ("settings (σ, C, batch size, learning rate, epochs) chosen by trying runs on the "
               "same training data: each such trial costs privacy this ε does not include "
               "(dpzero sweep reports the ε of all its runs composed)")


def _markdown(data: Dict, plots: List[str]) -> str:
    lines = [f"# Run report: {data['run_id']}", ""]
    lines.append("Privacy (recomputed from `ledger.jsonl`):")
    lines.append("")
    mode = "secure (ChaCha20, OS-entropy key, never stored)" if data.get("secure_mode") else \
        ("seeded (Philox; reproducible). The guarantee below assumes the seed stays secret: "
         "anyone who knows it can regenerate the noise")
    lines.append(f"- privacy unit: {data['privacy_unit']}")
    lines.append(f"- not covered: {data['not_covered']}")
    lines.append(f"- noise source: {mode}")
    lines.append(f"- dataset size N = {data['dataset_size']}, δ = {_fmt(data['delta'])}, "
                 f"steps charged = {data['steps']}")
    if data.get("bands", 1) > 1:
        settings = data["settings"]
        strategy = settings.get("strategy")
        if settings.get("strategy_rows"):
            strategy += f", fitted to {settings['strategy_rows']} steps"
        lines.append(f"- banded correlated noise, bands = {data['bands']} (strategy "
                     f"{strategy}): each step sampled one of "
                     f"{data['bands']} fixed partitions, and ε is DP-SGD's at one step in "
                     f"{data['bands']} (the phase below counts those equivalent steps)")
    for ph in data["phases"]:
        lines.append(f"- phase: q = {_fmt(ph['q'])} (expected batch size "
                     f"{_fmt(ph['expected_batch_size'])}), σ = {_fmt(ph['sigma'])}, "
                     f"steps = {ph['steps']}")
    if data.get("caller_sampled_steps"):
        lines.append(f"- **{data['caller_sampled_steps']} step(s) took batches the caller "
                     "sampled itself (own_batch), not dpzero's Poisson sampler: ε assumes they "
                     "were Poisson-sampled at q**")
    if not data["noise"]:
        lines.append("- **noise was disabled for some steps: ε = ∞ (no privacy guarantee)**")
    elif data["epsilon"]:
        for r in data["epsilon"]["results"]:
            if r["accountant"] == "rdp":
                lines.append(f"- ε (RDP) = {_fmt(r['epsilon'])}")
            else:
                lines.append(f"- ε (PRV) = {_fmt(r['epsilon'])} (upper bound; estimate "
                             f"{_fmt(r['estimate'])}, lower {_fmt(r['lower'])})")
    lines += ["", "ε covers the model and anything computed from it alone (such as the test "
                  "metrics below, on held-out data). This report holds nothing else that "
                  "depends on the training data; the run's data-dependent diagnostics (realised batch "
                  "sizes, dropped samples, training losses, the non-private baseline) are in "
                  "`private/`, which is not covered by ε and is not to be shared.", ""]
    priv = (data.get("results") or {}).get("private") or {}
    if priv:
        lines += ["Results:", "", "| run | test accuracy | test loss | ε | steps |",
                  "|---|---|---|---|---|",
                  f"| private | {_fmt(priv.get('accuracy'))} | {_fmt(priv.get('test_loss'))}"
                  f" | {_fmt(priv.get('epsilon'))} | {priv.get('steps')} |"]
        if priv.get("charged_steps", 0) > (priv.get("steps") or 0):
            lines += ["", f"The private run was resumed after a crash: its model went through "
                          f"{priv['steps']} updates and {priv['charged_steps']} steps are "
                          "charged (steps trained again after the last checkpoint are charged "
                          "again; ε counts every charge)."]
        stopped = priv.get("stopped")
        if stopped:
            lines += ["", f"The budget guard stopped the private run: {stopped}"]
        lines.append("")
    for p in plots:
        lines.append(f"![{p}]({p})")
    lines.append("")
    return "\n".join(lines)
