"""kill -9 and resume under the multi-rank launcher (Note [resuming a run] in
dpzero/train/runner.py, Note [failpoints] in src/dp/failpoints.h).

A two-rank private CNN job (`dpzero train`, torchrun, Gloo, stage 2, a checkpoint every 4 steps)
is killed with SIGKILL, then continued with `dpzero train --resume`:

* one rank killed right after the ledger record of a step and before its update (a failpoint:
  the worst moment, hit exactly), resumed in one process (`--world-size 1`, so the checkpoint is
  resharded). The resumed run must end where an independent in-process
  reference ends: 8 steps from the same start, then the ledger's 10 charges taken as spent (noise
  indices and sampler steps 8 and 9 are never reused), then 8 more steps;
* every process of the job killed at a moment the test does not choose (polling its metrics).

Both check what survives: every charged step is still in the ledger and charged again when
trained again, ε counts all of them, and every checkpoint on disk is complete.
"""

import json
import math
import os
import subprocess
import sys
import time

import psutil
import pytest
import torch
import torch.nn.functional as F

import dpzero
from dpzero.train import datasets
from dpzero.train.config import from_dict
from dpzero.train.task import build

pytestmark = pytest.mark.skipif(not os.path.isdir(datasets.FASHION_DIR),
                                reason="Debian package dataset-fashion-mnist not installed")

N, BATCH, EPOCHS, EVERY = 512, 64, 2, 4
STEPS = int(EPOCHS / (BATCH / N))  # 16


def _config(tmp_path, run_dir, bands=1, **training):
    raw = {"model": {"kind": "cnn"}, "data": {"dataset": "fashion-mnist", "limit": N},
           "privacy": {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "accountant": "rdp",
                       "secure_mode": False, "bands": bands},
           "training": {"epochs": EPOCHS, "batch_size": BATCH, "max_physical_batch_size": 32,
                        "lr": 0.01, "world_size": 2, "zero_stage": 2, "baseline": False,
                        "checkpoint_every": EVERY, "keep_checkpoints": 2, "timeout_s": 60,
                        **training},
           "output": {"dir": str(run_dir)}}
    path = tmp_path / "job.toml"
    path.write_text("\n".join(f"[{s}]\n" + "\n".join(f"{k} = {json.dumps(v)}"
                                                       for k, v in vals.items())
                              for s, vals in raw.items()) + "\n")
    return path, raw


def _train(config, *extra, env=None, **popen):
    cmd = [sys.executable, "-m", "dpzero", "train", str(config), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})}, **popen)


def _ledger_charges(run_dir):
    ledger = dpzero.Ledger.open_read_only(str(run_dir / "ledger.jsonl"))
    return [r.first_step for r in ledger.records], ledger


def _checkpoints_are_whole(run_dir):
    """Every step directory the root holds is committed (has its manifest), and latest, when
    there is one, names one of them. Returns the newest committed step, where a resume starts
    (0 without a checkpoint): a crash right after a commit leaves latest one behind."""
    root = run_dir / "checkpoints"
    steps = sorted(p for p in root.iterdir() if p.name.startswith("step-")) \
        if root.exists() else []
    for p in steps:
        assert (p / "manifest.json").exists(), f"{p} is a torn checkpoint"
    if (root / "latest").exists():
        latest = dpzero.checkpoint.resolve(str(root))
        assert os.path.basename(latest) in {p.name for p in steps}
    return max((int(json.loads((p / "manifest.json").read_text())["step"]) for p in steps),
               default=0)


def _resume_and_check(config, run_dir, charged_before, checkpoint_step, *extra, bands=1):
    out = _train(config, "--resume", *extra)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())["private"]
    replayed = charged_before - checkpoint_step
    assert result["steps"] == STEPS
    assert result["charged_steps"] == STEPS + replayed
    first_steps, ledger = _ledger_charges(run_dir)
    # Every charge from before the crash is still there, each later one is new: the sampler
    # step of every charge is fresh (strictly increasing), none was reused.
    assert len(first_steps) == STEPS + replayed
    assert all(a < b for a, b in zip(first_steps, first_steps[1:])), first_steps
    # ε is computed from every charge (independent count: the ledger's own records); with
    # bands, DP-SGD's at one step in b over the rows, which are the charges here (none refused).
    rdp = dpzero.RDPAccountant()
    rdp.step(noise_multiplier=1.0, sample_rate=BATCH * bands / N,
             num_steps=math.ceil((STEPS + replayed) / bands))
    delta = min(1e-5, 1.0 / (10 * N))  # the default δ
    assert result["delta"] == delta
    assert result["epsilon"] == pytest.approx(rdp.get_epsilon(delta), rel=1e-12)
    assert ledger.epsilon(delta, "rdp") == pytest.approx(result["epsilon"], rel=1e-12)
    if replayed:
        assert f"{STEPS + replayed} steps charged to the ledger" in out.stdout
        assert "resumed after a crash" in (run_dir / "report.md").read_text()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumed = [m for m in metrics if "resumed_at_step" in m]
    assert resumed == [{"run": "private", "resumed_at_step": checkpoint_step,
                        "charged_steps": charged_before}], resumed
    newest = _checkpoints_are_whole(run_dir)
    # The resumed run's own saves leave latest naming the newest committed step again.
    latest = dpzero.checkpoint.resolve(str(run_dir / "checkpoints"))
    assert os.path.basename(latest) == f"step-{newest:08d}", (latest, newest)
    return result, out


def _reference_parameters(raw, charges_at_crash, checkpoint_step, bands=1):
    """The same job in this process (one rank, stage 0, the loop written out): checkpoint_step
    steps, then the ledger's charges taken as spent, then the remaining steps."""
    cfg = from_dict(raw)
    model, train, _, unpack = build(cfg)
    t = cfg.training
    p = dpzero.make_private(model, dataset=train, batch_size=BATCH, zero_stage=0,
                            max_physical_batch_size=t.max_physical_batch_size,
                            optimizer=t.optimizer,
                            lr=t.lr, weight_decay=t.weight_decay, seed=t.seed, accountant="rdp",
                            noise_multiplier=1.0, max_grad_norm=1.0, clipping="flat",
                            bands=bands)

    def take(n):
        taken = 0
        while taken < n:
            for batch in p.data_loader:
                inputs, y = unpack(batch)
                p.optimizer.zero_grad()
                F.cross_entropy(p.model(*inputs), y).backward()
                if p.optimizer.step():
                    taken += 1
                    if taken == n:
                        return

    take(checkpoint_step)
    engine = p.privacy_engine
    state = engine.state_dict()
    state.update(charges=charges_at_crash, next_step=charges_at_crash, rows=charges_at_crash,
                 history=[(1.0, BATCH * bands / N, math.ceil(charges_at_crash / bands))])
    engine.load_state_dict(state)
    take(STEPS - checkpoint_step)
    assert engine.charges == STEPS + charges_at_crash - checkpoint_step
    return engine.parameters()


@pytest.mark.job
@pytest.mark.parametrize("bands", [1, 2])
def test_a_rank_killed_after_the_ledger_record_resumes_from_the_checkpoint(tmp_path, bands):
    """With bands = 2 the resumed noise must also continue the banded sequence: its rows after
    the crash follow the ledger's, and the history is C⁻¹z from row 0 (Note [banded steps])."""
    run_dir = tmp_path / "run"
    # SGD with a small learning rate with bands: the reference is one rank at stage 0, the job two
    # at stage 2, so their gradient sums differ in the last bits. AdamW's early steps divide by
    # |g|, and a large SGD step lets the network's nonlinearity grow such differences step by
    # step (by how much depends on the CPU's GEMM kernels); a small SGD step keeps them far below
    # the tolerance while one noise row out of place still moves the weights by hundreds of times
    # it.
    config, raw = _config(tmp_path, run_dir, bands=bands,
                          **({"optimizer": "sgd", "lr": 0.05} if bands > 1 else {}))
    crash_charge = 9  # the 10th step: charged, never applied; the last checkpoint is step 8
    out = _train(config, env={"DPZERO_FAILPOINT": f"after_ledger@{crash_charge}@1"})
    assert out.returncode != 0, out.stdout[-2000:]
    first_steps, _ = _ledger_charges(run_dir)
    assert len(first_steps) == crash_charge + 1  # the killed step is in the ledger (write-ahead)
    assert _checkpoints_are_whole(run_dir) == 8
    assert not (run_dir / "result.json").exists() and not (run_dir / "model.pt").exists()

    # Not resuming refuses the directory instead of silently continuing its budget.
    refused = _train(config)
    assert refused.returncode == 2 and "--resume" in refused.stderr
    assert len(_ledger_charges(run_dir)[0]) == crash_charge + 1

    # Resumed in one process: the two ranks' checkpoint is resharded on load.
    _resume_and_check(config, run_dir, crash_charge + 1, 8, "--world-size", "1", bands=bands)
    want = _reference_parameters(raw, crash_charge + 1, 8, bands)
    got = torch.load(run_dir / "model.pt")
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")

    # Resuming a finished run trains nothing more and charges nothing more.
    again = _train(config, "--resume")
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(_ledger_charges(run_dir)[0]) == STEPS + 2


@pytest.mark.job
def test_a_killed_launcher_takes_every_rank_with_it_and_no_charge_is_lost(tmp_path):
    """kill -9 of `dpzero train` alone, at a moment the test does not choose: torchrun and both
    ranks must die with it (Note [orphan ranks]; torchrun puts ranks in sessions of their own,
    so without it they would go on training and writing the ledger), then resume."""
    run_dir = tmp_path / "run"
    config, _ = _config(tmp_path, run_dir)
    job = psutil.Popen([sys.executable, "-m", "dpzero", "train", str(config)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    try:
        while time.time() < deadline and job.poll() is None:
            if metrics.exists() and any(json.loads(line).get("step", 0) >= 6
                                        for line in metrics.read_text().splitlines()):
                break
            time.sleep(0.05)
        assert job.poll() is None, "the job ended before it could be killed"
        below = job.children(recursive=True)
        assert len(below) >= 3  # torchrun and two ranks
    finally:
        job.kill()
        job.wait()
    gone, alive = psutil.wait_procs(below, timeout=20)
    assert not alive, f"processes outlived the killed launcher: {alive}"
    first_steps, _ = _ledger_charges(run_dir)  # a torn last line is left out here
    charged = len(first_steps)
    checkpoint = _checkpoints_are_whole(run_dir)
    assert 6 <= charged < STEPS and checkpoint in (4, 8) and checkpoint <= charged
    result, _ = _resume_and_check(config, run_dir, charged_before=charged,
                                  checkpoint_step=checkpoint)
    assert math.isfinite(result["epsilon"]) and result["accuracy"] > 0.2


@pytest.mark.job
def test_a_crash_between_a_commit_and_latest_resumes_from_the_committed_step(tmp_path):
    # Note [checkpoint commit]: killed after step-4 is committed, before latest names it (the
    # first save, so there is no latest at all). The resume starts from step 4; from the step
    # before it, it would retrain to step 4 and refuse to overwrite the committed step-4.
    run_dir = tmp_path / "run"
    config, _ = _config(tmp_path, run_dir)
    out = _train(config, env={"DPZERO_CHECKPOINT_FAULT": "before_latest:0"})
    assert out.returncode != 0 and "before_latest" in out.stderr, out.stderr[-2000:]
    assert not (run_dir / "checkpoints" / "latest").exists()
    assert _checkpoints_are_whole(run_dir) == EVERY
    charged = len(_ledger_charges(run_dir)[0])
    assert charged >= EVERY
    _resume_and_check(config, run_dir, charged_before=charged, checkpoint_step=EVERY)


@pytest.mark.job
def test_a_second_job_in_a_running_jobs_directory_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    config, _ = _config(tmp_path, run_dir)
    job = subprocess.Popen([sys.executable, "-m", "dpzero", "train", str(config)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tree = []
    try:
        deadline = time.time() + 120
        while not (run_dir / "ledger.jsonl").exists() and time.time() < deadline:
            time.sleep(0.05)
        # Paused, not finished, while the second job starts (a job this small can end first).
        tree = [psutil.Process(job.pid)] + psutil.Process(job.pid).children(recursive=True)
        for proc in tree:
            proc.suspend()
        second = _train(config, "--resume")
        assert second.returncode == 2 and f"pid {job.pid}" in second.stderr, second.stderr
    finally:
        for proc in tree:  # a stopped rank would outlive its killed launcher
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        job.kill()
        job.wait()


@pytest.mark.parametrize("value, message", [
    ("after_update", r"'after_update' is not POINT@CHARGE\[@RANK\]\[:raise\]"),
    ("during_lunch@3", r"'during_lunch@3' is not POINT@CHARGE\[@RANK\]\[:raise\] with POINT one "
                       r"of"),
    ("after_ledger@x", r"'after_ledger@x': CHARGE and RANK must be integers"),
    ("after_ledger@0:raise", r"after_ledger takes no :raise \(the step is recorded but not yet "
                             r"counted there\); use after_charge"),
])
def test_a_misspelt_failpoint_is_an_error_naming_it(monkeypatch, value, message):
    """Read when the model is made private (Note [failpoints]): a misspelt value is an error
    there, never a failpoint that silently does not fire."""
    monkeypatch.setenv("DPZERO_FAILPOINT", value)
    ds = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,)))
    with pytest.raises(ValueError, match=message):
        dpzero.make_private(torch.nn.Linear(3, 2), dataset=ds, batch_size=4,
                            noise_multiplier=1.0, max_grad_norm=1.0, seed=0)


@pytest.mark.job
def test_resuming_a_run_whose_budget_is_spent_is_refused_and_charges_nothing(tmp_path):
    """The runner's own guard: a run killed after its last charged step (here: its result files
    removed, as if killed during the final evaluation) cannot train on; --resume refuses naming
    the spent budget, and the ledger is left as it was."""
    run_dir = tmp_path / "run"
    config, _ = _config(tmp_path, run_dir, world_size=1, epochs=0.5)
    text = config.read_text().replace('noise_multiplier = 1.0', 'target_epsilon = 2.0')
    config.write_text(text)
    first = _train(config)
    assert first.returncode == 0, first.stderr[-3000:]
    charged = len(_ledger_charges(run_dir)[0])
    result = json.loads((run_dir / "result.json").read_text())["private"]
    assert result["steps"] == charged == 4 and result["epsilon"] <= 2.0
    for name in ("private.json", "result.json", "model.pt"):
        (run_dir / name).unlink()
    again = _train(config, "--resume")
    assert again.returncode == 3, again.stderr[-3000:]
    assert f"the ε budget of the ledger in {run_dir} is already spent ({charged} steps " \
           "charged); refusing to start" in again.stderr
    assert len(_ledger_charges(run_dir)[0]) == charged
