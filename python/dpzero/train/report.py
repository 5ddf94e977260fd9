"""The run report: ``report.md``, ``report.json`` and PNG plots, from the run directory.

The privacy part is recomputed from ``ledger.jsonl`` alone (the ledger is the record of what was
spent; ``dpzero report RUN_DIR`` can regenerate it for any run, even one whose other files are
gone): ε versus steps under RDP and PRV (estimate with its [lower, upper] band) and the final ε.
Loss and accuracy curves come from ``metrics.jsonl`` and the summary from ``result.json`` when
they exist. δ is the one the run used (``config.json``), else 1/N from the ledger header.
"""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List

from .. import _C
from ..accounting import Ledger
from ..budget import curve_over, evaluate

_acc = _C.accounting


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


def _plot_training(metrics: List[dict], path_loss: str, path_acc: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for key, path, ylabel, rows in (
            ("loss", path_loss, "training loss (rank 0's rows)",
             [m for m in metrics if "loss" in m]),
            ("accuracy", path_acc, "test accuracy", [m for m in metrics if "accuracy" in m])):
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
        for run, color in (("private", "tab:red"), ("baseline", "tab:green")):
            # A resumed run logs the steps after its checkpoint twice: the later line wins.
            pts = sorted({m["step"]: m[key] for m in rows if m.get("run") == run}.items())
            if pts:
                ax.plot(*zip(*pts), label=run, color=color, marker="o" if key == "accuracy"
                        else None)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


def write_report(run_dir: str) -> Dict:
    """Writes report.md, report.json and the plots into ``run_dir``; returns the report data."""
    ledger_path = os.path.join(run_dir, "ledger.jsonl")
    if not os.path.exists(ledger_path):
        raise FileNotFoundError(f"{ledger_path} does not exist: a report needs the run's ledger")
    ledger = Ledger.open_read_only(ledger_path)
    config = {}
    if os.path.exists(os.path.join(run_dir, "config.json")):
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
    n = ledger.dataset_size
    d = config.get("privacy", {}).get("delta", "1/N")
    delta = 1.0 / n if d in ("1/N", None) else float(d)
    records = ledger.records
    noised = not ledger.has_unnoised_steps
    # A ledger with unnoised steps has no finite ε and no phases to compose; the report says so.
    phases = [p for p in ledger.phases() if p.steps > 0] if noised else []
    final = evaluate(phases, delta).to_dict() if phases and noised else None
    curve = ledger_curve(phases, delta) if phases and noised else {"steps": []}
    results = {}
    if os.path.exists(os.path.join(run_dir, "result.json")):
        with open(os.path.join(run_dir, "result.json")) as f:
            results = json.load(f)
    metrics = _read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    settings = ledger.settings
    data = {
        "run_id": ledger.run_id, "dataset_size": n, "delta": delta,
        "steps": ledger.total_steps, "noise": noised,
        "secure_mode": settings.get("secure_mode"), "settings": settings,
        "phases": [{"q": p.q, "sigma": p.sigma, "steps": p.steps} for p in phases],
        "batch_sizes": [b for r in records for b in r.batch_sizes],
        "dropped_samples": sum(r.dropped_samples for r in records),
        # steps whose every example was dropped: the model moved by noise alone
        "all_dropped_steps": sum(1 for r in records
                                 if sum(r.batch_sizes) > 0 and
                                 r.dropped_samples >= sum(r.batch_sizes)),
        "epsilon": final, "curve": curve, "results": results,
    }
    with open(os.path.join(run_dir, "report.json"), "w") as f:
        json.dump(data, f, indent=2, default=str)
    plots = []
    if curve["steps"]:
        _plot_epsilon(curve, os.path.join(run_dir, "epsilon.png"),
                      f"ε spent (δ = {delta:.3g}, N = {n})")
        plots.append("epsilon.png")
    if metrics:
        _plot_training(metrics, os.path.join(run_dir, "loss.png"),
                       os.path.join(run_dir, "accuracy.png"))
        plots += ["loss.png", "accuracy.png"]
    with open(os.path.join(run_dir, "report.md"), "w") as f:
        f.write(_markdown(data, plots))
    return data


def _fmt(x, digits=4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isinf(x):
            return "∞"
        return f"{x:.{digits}g}"
    return str(x)


def _markdown(data: Dict, plots: List[str]) -> str:
    lines = [f"# Run report: {data['run_id']}", ""]
    lines.append("Privacy (recomputed from `ledger.jsonl`):")
    lines.append("")
    mode = "secure (ChaCha20, OS-entropy key, never stored)" if data.get("secure_mode") else \
        ("seeded (Philox; reproducible). The guarantee below assumes the seed stays secret: "
         "anyone who knows it can regenerate the noise")
    lines.append(f"- noise source: {mode}")
    lines.append(f"- dataset size N = {data['dataset_size']}, δ = {_fmt(data['delta'])}, "
                 f"steps charged = {data['steps']}")
    for ph in data["phases"]:
        lines.append(f"- phase: q = {_fmt(ph['q'])}, σ = {_fmt(ph['sigma'])}, "
                     f"steps = {ph['steps']}")
    sizes = data["batch_sizes"]
    if sizes:
        lines.append(f"- realised batch sizes: min {min(sizes)}, mean "
                     f"{sum(sizes) / len(sizes):.1f}, max {max(sizes)}; dropped (NaN/Inf) "
                     f"samples: {data['dropped_samples']}")
    if data.get("all_dropped_steps"):
        lines.append(f"- **{data['all_dropped_steps']} step(s) dropped every example "
                     "(non-finite loss or gradients): the model moved by noise alone; these "
                     "steps are charged like the others**")
    if not data["noise"]:
        lines.append("- **noise was disabled for some steps: ε = ∞ (no privacy guarantee)**")
    elif data["epsilon"]:
        for r in data["epsilon"]["results"]:
            if r["accountant"] == "rdp":
                lines.append(f"- ε (RDP) = {_fmt(r['epsilon'])}")
            else:
                lines.append(f"- ε (PRV) = {_fmt(r['epsilon'])} (upper bound; estimate "
                             f"{_fmt(r['estimate'])}, lower {_fmt(r['lower'])})")
    lines.append("")
    res = data.get("results") or {}
    if res:
        lines += ["Results:", "", "| run | test accuracy | test loss | ε | steps | seconds |",
                  "|---|---|---|---|---|---|"]
        for name in ("private", "baseline"):
            r = res.get(name)
            if r:
                lines.append(f"| {name} | {_fmt(r.get('accuracy'))} | {_fmt(r.get('test_loss'))}"
                             f" | {_fmt(r.get('epsilon'))} | {r.get('steps')} | "
                             f"{_fmt(r.get('seconds'), 3)} |")
        priv = res.get("private") or {}
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
