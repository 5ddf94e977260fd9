"""`dpzero train` with ``[training] loop = "trainer"``: the job through
dpzero.hf.PrivateTrainer, two real ranks under the launcher (torchrun, Gloo).

References: ε from an RDP accountant fed (σ, q, steps) by the test, the ledger's own records,
and the final model's test accuracy recomputed here from model.pt with a plain loop.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import dpzero
from dpzero.train import datasets
from dpzero.train.models import TanhCNN

pytestmark = [pytest.mark.job,
              pytest.mark.skipif(not os.path.isdir(datasets.FASHION_DIR),
                                 reason="Debian package dataset-fashion-mnist not installed")]

N, BATCH, EPOCHS, EVERY = 512, 64, 2, 4
STEPS = EPOCHS * (N // BATCH)  # 16
DELTA = 1e-5  # the default: min(1e-5, 1/(10 N))


def _config(tmp_path, run_dir, privacy=None, **training):
    raw = {"model": {"kind": "cnn"}, "data": {"dataset": "fashion-mnist", "limit": N},
           "privacy": {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "accountant": "rdp",
                       **(privacy or {})},
           "training": {"loop": "trainer", "epochs": EPOCHS, "batch_size": BATCH,
                        "max_physical_batch_size": 32, "lr": 0.5, "optimizer": "sgd",
                        "world_size": 2, "zero_stage": 3, "checkpoint_every": EVERY,
                        "keep_checkpoints": 2, "timeout_s": 60, "baseline": False, **training},
           "output": {"dir": str(run_dir)}}
    path = tmp_path / "job.toml"
    path.write_text("\n".join(f"[{s}]\n" + "\n".join(f"{k} = {json.dumps(v)}"
                                                       for k, v in vals.items())
                              for s, vals in raw.items()) + "\n")
    return path


def _train(config, *extra, env=None):
    return subprocess.run([sys.executable, "-m", "dpzero", "train", str(config), *extra],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def _rdp_epsilon(steps):
    rdp = dpzero.RDPAccountant()
    rdp.step(noise_multiplier=1.0, sample_rate=BATCH / N, num_steps=steps)
    return rdp.get_epsilon(DELTA)


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_trainer_loop_job_writes_the_run_directory(tmp_path):
    run = tmp_path / "run"
    out = _train(_config(tmp_path, run, baseline=True))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((run / "result.json").read_text())["private"]
    assert result["loop"] == "trainer" and result["zero_stage"] == 3
    assert result["steps"] == STEPS and result["charged_steps"] == STEPS
    assert result["sample_rate"] == BATCH / N and result["delta"] == DELTA
    assert result["epsilon"] == pytest.approx(_rdp_epsilon(STEPS), rel=1e-12)
    ledger = dpzero.Ledger.open_read_only(str(run / "ledger.jsonl"))
    assert ledger.total_steps == STEPS  # the baseline's unnoised steps are not in it
    assert (run / "private" / "baseline" / "ledger.jsonl").exists()
    assert (run / "private" / "baseline.json").exists()

    metrics = _metrics(run)
    assert [m["epoch"] for m in metrics if "epoch" in m] == [1, 2]
    eps = {m["step"]: m["epsilon"] for m in metrics if m.get("epsilon") is not None}
    assert set(eps) == {10, 16}
    for step, value in eps.items():
        assert value == pytest.approx(_rdp_epsilon(step), rel=1e-12)

    # model.pt is the model whose accuracy the result reports.
    model = TanhCNN(10)
    model.load_state_dict(torch.load(run / "model.pt"))
    test = datasets.fashion_mnist(train=False)
    with torch.no_grad():
        x, y = test.tensors
        correct = (model(x).argmax(-1) == y).sum().item()
    assert result["accuracy"] == correct / len(y) and result["accuracy"] > 0.3

    # The Trainer's checkpoints, the newest two kept, each with the privacy state and no key.
    names = sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-"))
    assert names == ["checkpoint-12", "checkpoint-16"]
    for name in names:
        text = (run / name / "dpzero_privacy.json").read_text()
        assert '"key"' not in text
    assert (run / "report.md").exists()

    # What ε does not cover stays in private/: no training loss or wall time in any file outside
    # it (the Trainer's trainer_state.json included) or on the console, and no step times.
    assert "loss" in (run / "private" / "training.jsonl").read_text()
    assert (run / "private" / "diagnostics.jsonl").exists()
    for path in run.rglob("*"):
        if path.suffix in (".json", ".jsonl", ".md") and "private" not in path.parts:
            text = path.read_text()
            assert '"loss"' not in text and "train_runtime" not in text, path
    console = out.stdout + out.stderr
    assert "'loss'" not in console and "train_runtime" not in console and "it/s" not in console


def test_trainer_loop_resumes_a_killed_rank_counting_every_charge(tmp_path):
    # Rank 1 is killed right after the ledger record of the 10th step, before its update; the
    # newest checkpoint is step 8. The resume trains steps 9-16 again, charging them again.
    run = tmp_path / "run"
    config = _config(tmp_path, run, privacy={"secure_mode": False}, zero_stage=2)
    out = _train(config, env={"DPZERO_FAILPOINT": "after_ledger@9@1"})
    assert out.returncode != 0 and "SIGKILL" in out.stderr, out.stderr[-2000:]
    charged = len(dpzero.Ledger.open_read_only(str(run / "ledger.jsonl")).records)
    assert charged == 10
    refused = _train(config)  # not resuming: the directory's budget is not silently continued
    assert refused.returncode == 2 and "--resume" in refused.stderr

    out = _train(config, "--resume")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((run / "result.json").read_text())["private"]
    assert result["steps"] == STEPS and result["charged_steps"] == STEPS + 2
    assert result["epsilon"] == pytest.approx(_rdp_epsilon(STEPS + 2), rel=1e-12)
    first_steps = [r.first_step for r in
                   dpzero.Ledger.open_read_only(str(run / "ledger.jsonl")).records]
    assert len(first_steps) == STEPS + 2
    assert all(a < b for a, b in zip(first_steps, first_steps[1:])), first_steps
    resumed = [m for m in _metrics(run) if "resumed_at_step" in m]
    assert resumed == [{"run": "private", "resumed_at_step": 8, "charged_steps": 10}]
    assert math.isfinite(result["epsilon"]) and result["accuracy"] > 0.2


def test_trainer_loop_resumes_a_run_killed_before_its_first_checkpoint(tmp_path):
    # No checkpoint to resume from: the run starts over, and the ledger keeps the 2 steps it
    # charged before the crash (they count, and their noise indices are not reused).
    run = tmp_path / "run"
    config = _config(tmp_path, run, privacy={"secure_mode": False}, zero_stage=0)
    out = _train(config, env={"DPZERO_FAILPOINT": "after_ledger@1@1"})
    assert out.returncode != 0 and "SIGKILL" in out.stderr, out.stderr[-2000:]
    assert not list(run.glob("checkpoint-*"))
    out = _train(config, "--resume")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((run / "result.json").read_text())["private"]
    assert result["steps"] == STEPS and result["charged_steps"] == STEPS + 2
    assert result["epsilon"] == pytest.approx(_rdp_epsilon(STEPS + 2), rel=1e-12)
    resumed = [m for m in _metrics(run) if "resumed_at_step" in m]
    assert resumed == [{"run": "private", "resumed_at_step": 0, "charged_steps": 2}]

