"""dpzero sweep: a grid of training runs at one ε, its tables and plot, the composed ε of all the
runs (Note [the price of tuning]), and a sweep started again reusing and resuming its runs."""

from __future__ import annotations

import csv
import json
import os

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
    assert parse_grid(["privacy.max_grad_norm=0.1,1"], fixed_sigma)  # ε unchanged: allowed
    # Every combination's config is checked before anything runs, the error naming it.
    with pytest.raises(ConfigError, match=r"sweep combination training.momentum=0.9: "
                                          r"\[training\] momentum = 0.9 is SGD's"):
        plan(cfg, parse_grid(["training.momentum=0,0.9"], cfg), 1, "unused")
    runs = plan(cfg, grid, 2, "out")
    assert len(runs) == 2 * 2 * 2
    assert [r.training.seed for _, _, r in runs[:2]] == [0, 1]
    assert all(not r.training.baseline for _, _, r in runs)
    assert len({r.output.dir for _, _, r in runs}) == len(runs)


@pytest.mark.skipif(not os.path.isdir(datasets.FASHION_DIR),
                    reason="Debian package dataset-fashion-mnist not installed")
def test_sweep_runs_the_grid_at_one_epsilon_and_composes_all_runs(tmp_path, capsys):
    cfg = config.from_dict({
        "model": {"kind": "cnn"}, "data": {"dataset": "fashion-mnist", "limit": 512,
                                           "test_limit": 400},
        "privacy": {"target_epsilon": 4.0, "max_grad_norm": 1.0, "delta": 1e-5},
        "training": {"epochs": 1, "batch_size": 128, "max_physical_batch_size": 64,
                     "lr": 0.05, "optimizer": "sgd", "world_size": 1, "zero_stage": 0,
                     "checkpoint_every": 0}})
    grid = parse_grid(["training.lr=0.1", "training.batch_size=64,128"], cfg)
    out = str(tmp_path / "sweep")
    summary = run_sweep(cfg, grid, 1, out)
    rows = summary["runs"]
    assert [(r["training.lr"], r["training.batch_size"]) for r in rows] == [(0.1, 64), (0.1, 128)]
    # One ε: each run calibrated σ for its own q and steps to spend the target.
    for r in rows:
        assert 3.9 < r["epsilon"] <= 4.0, r
    sigmas = {r["training.batch_size"]: r["noise_multiplier"] for r in rows}
    assert sigmas[64] != sigmas[128]
    # All runs together: one PRV accountant over every run's (σ, q, steps), read from the runs'
    # results rather than their ledgers; more than one run's ε, at most their sum.
    prv = dpzero.PRVAccountant()
    for r in rows:
        prv.step(noise_multiplier=r["noise_multiplier"], sample_rate=r["sample_rate"],
                 num_steps=r["steps"])
    assert summary["epsilon_all"] == pytest.approx(prv.get_epsilon(1e-5), rel=1e-6)
    assert max(r["epsilon"] for r in rows) < summary["epsilon_all"] \
        < sum(r["epsilon"] for r in rows)
    md = open(os.path.join(out, "sweep.md")).read()
    assert "Papernot & Steinke 2022" in md and f"ε = {summary['epsilon_all']:.3g}" in md
    assert "| 0.1 | 64 |" in md and "| 0.1 | 128 |" in md
    with open(os.path.join(out, "sweep.csv")) as f:
        assert len(list(csv.DictReader(f))) == 2
    assert os.path.getsize(os.path.join(out, "sweep.png")) > 0
    # Started again: finished runs are reused (nothing charged twice); a run whose directory
    # has a ledger but no result is resumed, its charged steps kept.
    os.remove(os.path.join(rows[1]["run_dir"], "result.json"))
    steps_before = [dpzero.Ledger.open_read_only(os.path.join(r["run_dir"], "ledger.jsonl"))
                    .total_steps for r in rows]
    capsys.readouterr()
    again = run_sweep(cfg, grid, 1, out)
    said = capsys.readouterr().out
    assert said.count("done before") == 1 and "resuming" in said
    assert [r["accuracy"] for r in again["runs"]] == [r["accuracy"] for r in rows]
    assert [dpzero.Ledger.open_read_only(os.path.join(r["run_dir"], "ledger.jsonl"))
            .total_steps for r in rows] == steps_before
    assert again["epsilon_all"] == summary["epsilon_all"]
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
    with pytest.raises(ConfigError, match=r"run-001 is a run of another sweep \(1 runs planned"):
        run_sweep(cfg, parse_grid(["training.lr=0.1", "training.batch_size=64"], cfg), 1, out)


def test_sweep_command_refuses_a_bad_grid(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text('[privacy]\nnoise_multiplier = 1.0\n')
    assert main(["sweep", str(path), "--grid", "training.epochs=1,2"]) == 2
    err = capsys.readouterr().err
    assert "dpzero sweep: error:" in err and "[training] epochs changes ε" in err
    assert not os.path.exists(os.path.join("runs", "job-sweep"))
