"""dpzero sweep: a grid of training runs at one ε, its tables and plot, the composed ε of all the
runs (Note [the price of tuning]), and a sweep started again reusing and resuming its runs."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys

import pytest

import dpzero
from dpzero.cli import main
from dpzero.train import ConfigError, config, datasets
from dpzero.train.sweep import parse_grid, plan, run_sweep

BASE = {"privacy": {"target_epsilon": 3.0}}


@pytest.mark.parametrize("item, message", [
    ("training.lr", r"write SECTION.KEY=V1,V2"),
    ("lr=1,2", r"write SECTION.KEY=V1,V2"),
    ("training.speed=1,2", r"the config has no key \[training\] speed"),
    ("privacy.target_epsilon=1,2", r"\[privacy\] target_epsilon cannot vary"),
    ("training.seed=1,2", r"use --seeds for seeds"),
    ("privacy.secure_mode=true,false", r"\[privacy\] secure_mode cannot vary"),
    ("training.baseline=true", r"\[training\] baseline cannot vary"),
    ("training.lr=fast", r"\[training\] lr must be a number, got 'fast'"),
    ("training.batch_size=64,0.5", r"\[training\] batch_size must be an integer, got 0.5"),
])
def test_grid_errors_name_the_item(item, message):
    with pytest.raises(ConfigError, match=message):
        parse_grid([item], config.from_dict(BASE))


def test_grid_values_and_the_fixed_epsilon_rule():
    cfg = config.from_dict(BASE)
    grid = parse_grid(["training.lr=2,4e-1", "data.scale=unit,standardize",
                       "training.batch_size=64"], cfg)
    assert grid == {("training", "lr"): [2.0, 0.4], ("data", "scale"): ["unit", "standardize"],
                    ("training", "batch_size"): [64]}
    with pytest.raises(ConfigError, match="given twice"):
        parse_grid(["training.lr=1", "training.lr=2"], cfg)
    with pytest.raises(ConfigError, match=r"needs a --grid SECTION.KEY=V1,V2,... or --seeds > 1"):
        plan(cfg, parse_grid([], cfg), 1, "unused")
    assert [r.training.seed for _, _, r in plan(cfg, {}, 3, "out")] == [0, 1, 2]  # repeats
    # σ given, not calibrated: a grid over what moves q or the steps would move ε.
    fixed_sigma = config.from_dict({"privacy": {"noise_multiplier": 1.0}})
    with pytest.raises(ConfigError, match=r"noise_multiplier = 1.0, so a grid over "
                                          r"\[training\] batch_size changes ε"):
        parse_grid(["training.batch_size=64,128"], fixed_sigma)
    with pytest.raises(ConfigError, match=r"\[training\] loop changes ε"):  # its step count
        parse_grid(["training.loop=engine,trainer"], fixed_sigma)
    with pytest.raises(ConfigError, match=r"\[privacy\] bands changes ε"):  # q and the steps
        parse_grid(["privacy.bands=1,4"], fixed_sigma)
    assert parse_grid(["privacy.bands=1,4"], cfg) == {("privacy", "bands"): [1, 4]}  # calibrated
    assert parse_grid(["privacy.max_grad_norm=0.1,1"], fixed_sigma)  # ε unchanged: allowed
    # The banded strategy moves the noise's correlation, never ε (Note [run strategy]).
    assert parse_grid(["privacy.strategy=sqrt_prefix_sum,optimized"], fixed_sigma) == {
        ("privacy", "strategy"): ["sqrt_prefix_sum", "optimized"]}
    # Every combination's config is checked before anything runs, the error naming it.
    with pytest.raises(ConfigError, match=r"sweep combination training.momentum=0.9: "
                                          r"\[training\] momentum = 0.9 is SGD's"):
        plan(cfg, parse_grid(["training.momentum=0,0.9"], cfg), 1, "unused")
    runs = plan(cfg, grid, 2, "out")
    assert len(runs) == 2 * 2 * 2
    assert [r.training.seed for _, _, r in runs] == [0, 1] * 4  # secure: repeats' seeds
    assert all(not r.training.baseline for _, _, r in runs)
    assert len({r.output.dir for _, _, r in runs}) == len(runs)
    # Note [sweep seeds]: seeded runs key their noise with the seed, so no two may share one (a
    # review cancelled the noise of two runs that differed only in C).
    seeded = config.from_dict({**BASE, "privacy": {**BASE.get("privacy", {}),
                                                   "secure_mode": False}})
    runs = plan(seeded, grid, 2, "out")
    drawn = [r.training.seed for _, _, r in runs]
    assert len(set(drawn)) == len(runs) and 0 not in drawn  # and none is the base seed's
    assert drawn == [r.training.seed for _, _, r in plan(seeded, grid, 2, "elsewhere")]
    # Another sweep with the same base seed: its runs that differ (here in lr) draw other seeds.
    other = plan(seeded, parse_grid(["training.lr=3,4e-1", "data.scale=unit,standardize",
                                     "training.batch_size=64"], seeded), 2, "out")
    shared = {r.training.seed for v, _, r in other if v[("training", "lr")] == 0.4}
    assert shared <= set(drawn) and not ({r.training.seed for _, _, r in other} - shared) & set(drawn)


@pytest.mark.job
@pytest.mark.skipif(not os.path.isdir(datasets.FASHION_DIR),
                    reason="Debian package dataset-fashion-mnist not installed")
def test_sweep_runs_the_grid_at_one_epsilon_and_composes_all_runs(tmp_path, capsys):
    from dpzero.train.launch import to_toml

    cfg = config.from_dict({
        "model": {"kind": "cnn"}, "data": {"dataset": "fashion-mnist", "limit": 512,
                                           "test_limit": 400},
        "privacy": {"target_epsilon": 4.0, "max_grad_norm": 1.0, "delta": 1e-5},
        "training": {"epochs": 1, "batch_size": 128, "max_physical_batch_size": 64,
                     "lr": 0.05, "optimizer": "sgd", "world_size": 1, "zero_stage": 0,
                     "checkpoint_every": 0}})
    items = ["training.lr=0.1", "training.batch_size=64,128"]
    grid = parse_grid(items, cfg)
    out = str(tmp_path / "sweep")
    # The sweep killed (SIGKILL) in its first run, after the 4th step's ledger record.
    path = tmp_path / "job.toml"
    path.write_text(to_toml(cfg.to_dict()))
    killed = subprocess.run(
        [sys.executable, "-m", "dpzero", "sweep", str(path), "--output", out]
        + [a for item in items for a in ("--grid", item)],
        env={**os.environ, "DPZERO_FAILPOINT": "after_ledger@3"}, capture_output=True,
        text=True, timeout=600)
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    ledger_steps = lambda r: dpzero.Ledger.open_read_only(  # noqa: E731
        os.path.join(r["run_dir"], "ledger.jsonl")).total_steps
    # Started again: the killed run resumes with its 4 charges kept, the other run fresh.
    summary = run_sweep(cfg, grid, 1, out)
    said = capsys.readouterr().out
    assert "run 1/2 (training.lr=0.1, training.batch_size=64, seed 0): resuming" in said
    rows = summary["runs"]
    assert [(r["training.lr"], r["training.batch_size"]) for r in rows] == [(0.1, 64), (0.1, 128)]
    # The killed run's 4 charged steps were never applied (no checkpoint); it trains the 4 its
    # budget has left: 4 updates, 8 charges.
    assert (rows[0]["steps"], rows[0]["charged_steps"], ledger_steps(rows[0])) == (4, 8, 8)
    assert (rows[1]["steps"], rows[1]["charged_steps"], ledger_steps(rows[1])) == (4, 4, 4)
    assert not rows[0]["stopped"] and not rows[1]["stopped"]
    # One ε: each run calibrated σ for its own q and steps to spend the target; the resumed run
    # spent it too, across its two starts.
    for r in rows:
        assert 3.6 < r["epsilon"] <= 4.0, r
    assert rows[0]["noise_multiplier"] != rows[1]["noise_multiplier"]
    # All runs together: one PRV accountant over every run's (σ, q, charged steps), read from
    # the runs' results rather than their ledgers; more than one run's ε, less than their sum.
    prv = dpzero.PRVAccountant()
    for r in rows:
        prv.step(noise_multiplier=r["noise_multiplier"], sample_rate=r["sample_rate"],
                 num_steps=r["charged_steps"])
    assert summary["epsilon_all"] == pytest.approx(prv.get_epsilon(1e-5), rel=1e-6)
    assert max(r["epsilon"] for r in rows) < summary["epsilon_all"] \
        < sum(r["epsilon"] for r in rows)
    md = open(os.path.join(out, "sweep.md")).read()
    assert "Papernot & Steinke 2022" in md and f"ε = {summary['epsilon_all']:.3g}" in md
    assert f"| 0.1 | 64 | {100 * rows[0]['accuracy']:.2f}%" in md
    assert "| 4 (8 charged) |" in md
    with open(os.path.join(out, "sweep.csv")) as f:
        assert len(list(csv.DictReader(f))) == 2
    assert os.path.getsize(os.path.join(out, "sweep.png")) > 0
    # Once more: both runs are reused, nothing is charged again.
    before = [ledger_steps(r) for r in rows]
    again = run_sweep(cfg, grid, 1, out)
    assert capsys.readouterr().out.count("done before") == 2
    assert [ledger_steps(r) for r in rows] == before
    assert [r["accuracy"] for r in again["runs"]] == [r["accuracy"] for r in rows]
    assert again["epsilon_all"] == summary["epsilon_all"]
    # A run saved before a config key existed (here [privacy] strategy) had its default then:
    # still reused. The same key saved with another value is not.
    saved = os.path.join(rows[0]["run_dir"], "config.json")
    with open(saved) as f:
        config_then = json.load(f)
    del config_then["privacy"]["strategy"]
    with open(saved, "w") as f:
        json.dump(config_then, f)
    run_sweep(cfg, grid, 1, out)
    assert capsys.readouterr().out.count("done before") == 2
    config_then["privacy"]["strategy"] = "optimized"
    with open(saved, "w") as f:
        json.dump(config_then, f)
    with pytest.raises(ConfigError, match=r"run-000 ran with other settings than this sweep "
                                          r"gives it \(\[privacy\] strategy: 'optimized' then, "
                                          r"'sqrt_prefix_sum' now\)"):
        run_sweep(cfg, grid, 1, out)
    del config_then["privacy"]["strategy"]
    with open(saved, "w") as f:
        json.dump(config_then, f)
    # The directory's runs are this sweep's or it is refused: another grid at the same place
    # would show these results under values they never used, or leave runs out of ε_all.
    with pytest.raises(ConfigError, match=r"run-000 ran with other settings than this sweep "
                                          r"gives it \(\[training\] lr: 0.1 then, 0.2 now\)"):
        run_sweep(cfg, parse_grid(["training.lr=0.2", "training.batch_size=64,128"], cfg), 1,
                  out)
    with pytest.raises(ConfigError, match=r"run-001 ran with other settings .*\[training\] "
                                          r"batch_size: 128 then, 64 now; \[training\] seed: 0 "
                                          r"then, 1 now"):
        run_sweep(cfg, grid, 2, out)
    with pytest.raises(ConfigError, match=r"run-001 holds a ledger but is not one of this "
                                          r"sweep's 1 runs"):
        run_sweep(cfg, parse_grid(["training.lr=0.1", "training.batch_size=64"], cfg), 1, out)
    extra = os.path.join(out, "extra")  # a dpzero train run put in the sweep's directory
    os.makedirs(extra)
    shutil.copy(os.path.join(rows[0]["run_dir"], "ledger.jsonl"), extra)
    with pytest.raises(ConfigError, match=r"extra holds a ledger but is not one of this sweep"):
        run_sweep(cfg, grid, 1, out)
    shutil.rmtree(extra)
    os.remove(os.path.join(rows[0]["run_dir"], "config.json"))
    with pytest.raises(ConfigError, match=r"run-000 holds ledger.jsonl, result.json, "
                                          r"private.json but no readable config.json"):
        run_sweep(cfg, grid, 1, out)


def test_the_table_marks_stopped_and_recharged_runs_and_a_repeat_only_sweep_plots(tmp_path):
    from dpzero.train.sweep import _plot, format_markdown

    run = {"seed": 0, "accuracy": 0.5, "epsilon": 2.9, "delta": 1e-5, "noise_multiplier": 1.1,
           "sample_rate": 0.1, "steps": 8, "charged_steps": 8, "stopped": False}
    summary = {"knobs": [], "epsilon_all": 4.2, "delta": 1e-5, "accountant": "prv",
               "runs": [run, {**run, "seed": 1, "accuracy": 0.7, "steps": 6,
                              "charged_steps": 9, "stopped": True}]}
    md = format_markdown(summary)
    assert "| 60.00% ± 14.14 | 2 | 2.9 | 1e-05 | 1.1 | 6 (stopped by the budget guard) " \
           "(9 charged) |" in md, md
    assert "all 2 runs of this sweep is (ε = 4.2, δ = 1e-05)-DP" in md
    _plot(summary, str(tmp_path / "sweep.png"))
    assert os.path.getsize(tmp_path / "sweep.png") > 0


def test_sweep_command_refuses_a_bad_grid(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "job.toml"
    path.write_text('[privacy]\nnoise_multiplier = 1.0\n')
    assert main(["sweep", str(path), "--grid", "training.epochs=1,2"]) == 2
    err = capsys.readouterr().err
    assert "dpzero sweep: error:" in err and "[training] epochs changes ε" in err
    assert not os.path.exists(os.path.join("runs", "job-sweep"))
