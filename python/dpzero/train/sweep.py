"""``dpzero sweep CONFIG --grid training.lr=2,4,8 ...``: a small grid of training runs at one ε.

Every combination of the grid's values (times ``--seeds`` seeds) is one ``dpzero train`` run of
the config with those values set, in its own run directory under the sweep's directory. ε stays
fixed across the grid: with ``[privacy] target_epsilon`` each run calibrates σ for its own
(batch, epochs), so every run spends the same ε; with ``[privacy] noise_multiplier`` a grid over
what changes q or the number of steps would change ε, and is refused. The sweep writes
``sweep.csv`` (one row per run), ``sweep.md`` (mean ± sd over the seeds of each combination) and
``sweep.png`` (test accuracy against each knob). Runs already finished are reused and a killed
run is resumed, so a sweep started again finishes the grid without losing a charged step.

Note [the price of tuning]: each run alone is (ε, δ)-DP, but choosing hyperparameters by their
results on the private data is itself a computation on the private data. Papernot & Steinke 2022
("Hyperparameter Tuning with Renyi Differential Privacy", ICLR) show that releasing the best of
several runs can leak more than any one run's ε, and bound the cost when the number of runs is
random. The sweep reports the bound that needs no assumption: releasing the results of all K
runs is (ε_all, δ)-DP with ε_all from one accountant over every run's ledgered steps
(``dpzero.accounting.composed_epsilon``). Publishing the chosen model with one run's ε
understates its privacy cost; tune on public data, or report ε_all.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import itertools
import json
import math
import os
import statistics
import tomllib
from typing import Any, Dict, List, Sequence, Tuple

from .config import ConfigError, RunConfig, typed, validate

# Keys that set ε or what it means (secure_mode = false: ε assumes the seed stays secret, and the
# sweep publishes seeds), the task, or what the sweep sets itself: they cannot vary.
_FIXED = {("privacy", "target_epsilon"), ("privacy", "noise_multiplier"), ("privacy", "delta"),
          ("privacy", "accountant"), ("privacy", "secure_mode"), ("data", "dataset"),
          ("output", "dir"), ("training", "seed"), ("training", "baseline")}
# Keys that change q or the number of steps (the Trainer loop counts steps differently), hence ε
# when σ is given rather than calibrated.
_CHANGE_EPSILON = {("training", "batch_size"), ("training", "epochs"), ("training", "loop"),
                   ("privacy", "bands"),
                   ("data", "limit"), ("data", "test_fraction"), ("data", "categories")}

PRICE_OF_TUNING = (
    "Choosing hyperparameters on the private data costs privacy (Papernot & Steinke 2022, "
    "\"Hyperparameter Tuning with Renyi Differential Privacy\"): each run below is (ε, δ)-DP "
    "alone, but the choice among them is not covered by that ε. Releasing the results of all "
    "{k} runs of this sweep is (ε = {eps_all:.3g}, δ = {delta:.3g})-DP by composition; earlier "
    "sweeps and runs on the same data add to it. Publishing the chosen model with one run's ε "
    "understates its cost: tune on public data, or report the composed ε.")


def parse_grid(items: Sequence[str], cfg: RunConfig) -> Dict[Tuple[str, str], List[Any]]:
    """``["training.lr=2,4", ...]`` -> {("training", "lr"): [2.0, 4.0], ...}, each value checked
    against the config's type for that key; errors name the item."""
    grid: Dict[Tuple[str, str], List[Any]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        section, dot, key = name.strip().partition(".")
        if not sep or not dot or not values.strip():
            raise ConfigError(f"--grid {item!r}: write SECTION.KEY=V1,V2,... "
                              "(e.g. training.lr=2,4,8)")
        target = getattr(cfg, section, None)
        if target is None or not hasattr(target, key):
            raise ConfigError(f"--grid {item!r}: the config has no key [{section}] {key}")
        if (section, key) in _FIXED:
            raise ConfigError(f"--grid {item!r}: a sweep holds ε, the task and its meaning fixed "
                              f"and sets seeds, baselines and run directories itself; [{section}] "
                              f"{key} cannot vary (use --seeds for seeds)")
        if (section, key) in grid:
            raise ConfigError(f"--grid {item!r}: [{section}] {key} is given twice")
        parsed = []
        for text in values.split(","):
            text = text.strip()
            try:
                value = tomllib.loads(f"v = {text}")["v"]
            except tomllib.TOMLDecodeError:
                value = text  # a bare word: a string
            parsed.append(typed(section, key, value, getattr(target, key)))
        grid[(section, key)] = parsed
    if cfg.privacy.noise_multiplier is not None:
        moved = sorted(f"[{s}] {k}" for s, k in grid if (s, k) in _CHANGE_EPSILON)
        if moved:
            raise ConfigError(
                f"the config fixes [privacy] noise_multiplier = {cfg.privacy.noise_multiplier}, "
                f"so a grid over {', '.join(moved)} changes ε from run to run; give [privacy] "
                "target_epsilon instead, and each run calibrates σ to spend that ε")
    return grid


# Note [sweep seeds]
# ~~~~~~~~~~~~~~~~~~
# ε_all composes the sweep's runs as independent mechanisms, which they are only if each draws its
# own noise. In secure mode every run keys its noise from the OS, and the runs of a combination's
# repeats take seeds seed, seed + 1, ... (the model's initialisation and the data's split alike for
# every combination). With secure_mode = false the seed also keys the Philox noise and the Poisson
# batches, and two runs with one seed draw the same z: a privacy review released two runs that
# differed only in C and subtracted their scaled updates, which cancelled the noise exactly and
# told neighbouring datasets apart at any σ, with no seed needed. So there every run's seed is a
# hash of the base seed, the repeat and the run's whole configuration (its output directory
# aside): runs that differ in anything draw different noise, in this sweep, in another sweep with
# the same base seed, or against a `dpzero train` of the base seed; two runs with one seed are the
# same run (seeds base + i would meet again across sweeps).


def _run_seed(base: int, repeat: int, run: RunConfig) -> int:
    """Note [sweep seeds]: a 62-bit seed from the base seed, the repeat and ``run``'s
    configuration without its output directory and seed."""
    config = run.to_dict()
    config["output"].pop("dir", None)
    config["training"].pop("seed", None)
    text = json.dumps([base, repeat, config], sort_keys=True, default=str)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 2


def plan(cfg: RunConfig, grid: Dict[Tuple[str, str], List[Any]], seeds: int,
         out_dir: str) -> List[Tuple[Dict[Tuple[str, str], Any], int, RunConfig]]:
    """[(the combination's values, seed, its run config)], every config validated up front;
    seeds by Note [sweep seeds]."""
    if seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {seeds}")
    if not grid and seeds == 1:
        raise ConfigError("dpzero sweep needs a --grid SECTION.KEY=V1,V2,... or --seeds > 1")
    runs = []
    keys = list(grid)
    for combo in itertools.product(*(grid[k] for k in keys)):
        values = dict(zip(keys, combo))
        for s in range(seeds):
            run = copy.deepcopy(cfg)
            for (section, key), value in values.items():
                setattr(getattr(run, section), key, value)
            run.training.seed = cfg.training.seed + s if cfg.privacy.secure_mode else \
                _run_seed(cfg.training.seed, s, run)  # Note [sweep seeds]
            run.training.baseline = False  # the sweep compares private runs
            run.output.dir = os.path.join(out_dir, f"run-{len(runs):03d}")
            try:
                validate(run)
            except ConfigError as e:
                shown = ", ".join(f"{s_}.{k}={v}" for (s_, k), v in values.items())
                raise ConfigError(f"sweep combination {shown}: {e}") from None
            runs.append((values, run.training.seed, run))
    return runs


def _check_directory(out_dir: str, runs) -> None:
    """Note [the price of tuning]: ε_all composes the runs of this directory, so every run in it
    must be one of this sweep's, with this sweep's settings. Refused, naming the run and what
    differs: a ledger anywhere under the directory outside the planned runs (another grid or
    --seeds; a dpzero train run put there), a planned run that ran with other settings, and one
    that holds charges or results without a readable record of its settings. Such a run would
    show under values it never used, or be left out of ε_all."""
    if not os.path.isdir(out_dir):
        return
    planned = {os.path.abspath(run.output.dir): run for _, _, run in runs}
    for root, _, files in os.walk(out_dir):
        if "ledger.jsonl" in files and os.path.abspath(root) not in planned:
            raise ConfigError(f"{root} holds a ledger but is not one of this sweep's "
                              f"{len(runs)} runs (a run of another grid or --seeds?); compose it "
                              "with the runs it was chosen with, or use another --output")
    for path, run in planned.items():
        if not os.path.isdir(path):
            continue
        saved = os.path.join(path, "config.json")
        ran = [f for f in ("ledger.jsonl", "result.json", "private.json")
               if os.path.exists(os.path.join(path, f))]
        try:
            with open(saved) as f:
                before = json.load(f)
        except (OSError, ValueError):
            if ran:
                raise ConfigError(f"{path} holds {', '.join(ran)} but no readable config.json: "
                                  "what it ran with is unknown; use another --output") from None
            continue  # created, never started: nothing ran, nothing charged
        now = run.to_dict()
        # A key a run's saved config lacks (one added to dpzero since) had its default then.
        then = {section: {**values, **before.get(section, {})}
                for section, values in RunConfig().to_dict().items()}
        differs = [f"[{section}] {key}: {then[section].get(key)!r} then, "
                   f"{value!r} now" for section, values in now.items()
                   for key, value in values.items()
                   if (section, key) != ("output", "dir")  # the run is known by its place
                   and then[section].get(key) != value]
        if differs:
            raise ConfigError(f"{path} ran with other settings than this sweep gives it "
                              f"({'; '.join(differs)}); use another --output")


def _label(section_key: Tuple[str, str]) -> str:
    return f"{section_key[0]}.{section_key[1]}"


def run_sweep(cfg: RunConfig, grid: Dict[Tuple[str, str], List[Any]], seeds: int,
              out_dir: str) -> Dict[str, Any]:
    """Runs (or reuses) every run of the grid, then writes the tables and the plot."""
    from .launch import directory_lock

    runs = plan(cfg, grid, seeds, out_dir)
    os.makedirs(out_dir, exist_ok=True)
    with directory_lock(out_dir, "dpzero sweep"):  # one sweep at a time in a directory
        _check_directory(out_dir, runs)
        return _run_all(cfg, grid, runs, out_dir)


def _run_all(cfg: RunConfig, grid, runs, out_dir: str) -> Dict[str, Any]:
    """Each planned run reused, resumed or run; then the composed ε, the tables and the plot."""
    from ..accounting import Ledger, composed_epsilon
    from .launch import launch_config
    from .outputs import atomic_json

    rows = []
    for i, (values, seed, run) in enumerate(runs):
        shown = ", ".join(f"{_label(k)}={v}" for k, v in values.items()) or "repeat"
        result_path = os.path.join(run.output.dir, "result.json")
        if os.path.exists(result_path):
            print(f"[dpzero sweep] run {i + 1}/{len(runs)} ({shown}, seed {seed}): done before")
            with open(result_path) as f:
                result = json.load(f)["private"]
        else:
            resume = os.path.exists(os.path.join(run.output.dir, "ledger.jsonl"))
            print(f"[dpzero sweep] run {i + 1}/{len(runs)} ({shown}, seed {seed})"
                  + (": resuming" if resume else ""))
            result = launch_config(run, resume)["private"]
        rows.append({**{_label(k): v for k, v in values.items()}, "seed": seed,
                     "accuracy": result["accuracy"], "epsilon": result["epsilon"],
                     "delta": result["delta"], "noise_multiplier": result["noise_multiplier"],
                     "sample_rate": result["sample_rate"], "steps": result["steps"],
                     "charged_steps": result.get("charged_steps", result["steps"]),
                     "stopped": bool(result.get("stopped")), "run_dir": run.output.dir})
    # each run is (ε_run, δ_run)-DP; all of them are composed at the smallest δ
    delta = min(r["delta"] for r in rows)
    ledgers = [Ledger.open_read_only(os.path.join(r["run_dir"], "ledger.jsonl")) for r in rows]
    try:
        eps_all = composed_epsilon(ledgers, delta, cfg.privacy.accountant)
    finally:
        for ledger in ledgers:
            ledger.close()
    summary = {"runs": rows, "knobs": [_label(k) for k in grid], "epsilon_all": eps_all,
               "delta": delta, "accountant": cfg.privacy.accountant}
    _write_csv(rows, os.path.join(out_dir, "sweep.csv"))
    _write_text(format_markdown(summary), os.path.join(out_dir, "sweep.md"))
    _plot(summary, os.path.join(out_dir, "sweep.png"))
    atomic_json(summary, os.path.join(out_dir, "sweep.json"))
    return summary


def price_of_tuning(summary: Dict[str, Any]) -> str:
    return PRICE_OF_TUNING.format(k=len(summary["runs"]), eps_all=summary["epsilon_all"],
                                  delta=summary["delta"])


def combinations(summary: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One entry per combination of the knobs: its values, the seeds' accuracies and ε."""
    groups: Dict[tuple, List[Dict]] = {}
    for row in summary["runs"]:
        groups.setdefault(tuple(row[k] for k in summary["knobs"]), []).append(row)
    out = []
    for values, rows in groups.items():
        acc = [r["accuracy"] for r in rows]
        out.append({"values": dict(zip(summary["knobs"], values)), "accuracies": acc,
                    "mean": statistics.fmean(acc),
                    "sd": statistics.stdev(acc) if len(acc) > 1 else float("nan"),
                    "epsilon": max(r["epsilon"] for r in rows),
                    "delta": max(r["delta"] for r in rows),
                    "noise_multiplier": rows[0]["noise_multiplier"],
                    "steps": min(r["steps"] for r in rows),
                    "charged_steps": max(r["charged_steps"] for r in rows),
                    "stopped": any(r["stopped"] for r in rows)})
    return out


def format_markdown(summary: Dict[str, Any]) -> str:
    knobs = summary["knobs"]
    lines = ["# dpzero sweep", "", f"> {price_of_tuning(summary)}", "",
             "| " + "".join(f"{k} | " for k in knobs) + "test accuracy (mean ± sd) | seeds | "
             f"ε ({summary['accountant']}) | δ | σ | steps |",
             "|" + "---|" * (len(knobs) + 6)]
    for c in combinations(summary):
        sd = "" if math.isnan(c["sd"]) else f" ± {100 * c['sd']:.2f}"
        stopped = " (stopped by the budget guard)" if c["stopped"] else ""
        if c["charged_steps"] > c["steps"]:  # steps trained again after a crash: charged twice
            stopped += f" ({c['charged_steps']} charged)"
        lines.append("| " + "".join(f"{c['values'][k]} | " for k in knobs)
                     + f"{100 * c['mean']:.2f}%{sd} | {len(c['accuracies'])} | "
                     f"{c['epsilon']:.3g} | {c['delta']:.3g} | {c['noise_multiplier']:.4g} | "
                     f"{c['steps']}{stopped} |")
    lines += ["", "Accuracy is on the test split. Choosing by it also fits the test split; a "
              "held-out validation split of public data avoids both costs.", ""]
    return "\n".join(lines)


def _write_text(text: str, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _write_csv(rows: List[Dict[str, Any]], path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def _plot(summary: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    knobs = summary["knobs"] or ["seed"]  # a repeat-only sweep: accuracy per seed
    fig, axes = plt.subplots(1, len(knobs), figsize=(4.2 * len(knobs), 3.4), squeeze=False)
    for ax, knob in zip(axes[0], knobs):
        xs = [r[knob] for r in summary["runs"]]
        numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)
        order = sorted(set(xs), key=lambda v: (v if numeric else str(v)))
        pos = {v: (v if numeric else i) for i, v in enumerate(order)}
        ax.scatter([pos[x] for x in xs], [100 * r["accuracy"] for r in summary["runs"]],
                   s=14, alpha=0.6, label="runs")
        means = [100 * statistics.fmean(r["accuracy"] for r in summary["runs"] if r[knob] == v)
                 for v in order]
        ax.plot([pos[v] for v in order], means, "o-", label="mean over the other knobs")
        if numeric and min(order) > 0 and max(order) / min(order) >= 8:
            ax.set_xscale("log")
        if not numeric:
            ax.set_xticks(range(len(order)), [str(v) for v in order])
        ax.set_xlabel(knob)
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"dpzero sweep at ε = {max(r['epsilon'] for r in summary['runs']):.3g} per run"
                 f" (all {len(summary['runs'])} runs together: ε = {summary['epsilon_all']:.3g})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
