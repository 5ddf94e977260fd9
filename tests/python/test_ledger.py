"""The privacy ledger from Python, on real files: durable round trip, ε recomputed from the ledger
alone equals the accountants fed the same steps, torn tails detected, other runs refused."""

import math

import pytest

import dpzero
from dpzero.accounting import Ledger, LedgerError, PRVAccountant, RDPAccountant


def _write_run(path):
    led = Ledger.create(path, run_id="run-a", dataset_size=1000, settings={"delta": 1e-5})
    led.append(first_step=0, last_step=99, q=0.01, sigma=1.1, max_grad_norm=1.0)
    led.append(first_step=100, last_step=149, q=0.02, sigma=0.9, max_grad_norm=1.0,
               sampling="caller")
    led.append(first_step=150, q=0.02, sigma=0.9, max_grad_norm=1.0)
    return led


def test_reload_recomputes_epsilon_exactly(tmp_path):
    path = tmp_path / "ledger.jsonl"
    _write_run(path).close()
    led = Ledger.open_read_only(path, expected_run_id="run-a")
    assert led.total_steps == 151 and led.settings == {"delta": 1e-5}
    assert [(p.q, p.sigma, p.steps) for p in led.phases()] == [(0.01, 1.1, 100), (0.02, 0.9, 51)]
    rdp, prv = RDPAccountant(), PRVAccountant()
    for acc in (rdp, prv):
        acc.step(noise_multiplier=1.1, sample_rate=0.01, num_steps=100)
        acc.step(noise_multiplier=0.9, sample_rate=0.02, num_steps=51)
    assert led.epsilon(1e-5, "rdp") == rdp.get_epsilon(1e-5)
    assert led.epsilon(1e-5, "prv") == prv.get_epsilon(1e-5)
    assert [r.sampling for r in led.records] == ["poisson", "caller", "poisson"]
    assert led.caller_sampled_steps == 50 and led.format == 2


def test_torn_tail_is_reported_never_dropped_silently(tmp_path):
    path = tmp_path / "ledger.jsonl"
    _write_run(path).close()
    with open(path, "ab") as f:
        f.write(b'{"kind":"steps","first_step":151,"last_st')  # crash mid-write
    with pytest.raises(LedgerError, match="line 5"):
        Ledger.open(path)
    ro = Ledger.open_read_only(path)
    assert ro.total_steps == 151 and ro.torn_tail.startswith(b'{"kind":"steps"')
    ro.close()
    led = Ledger.open(path, truncate_torn_tail=True)
    assert led.torn_tail_line == 5 and led.total_steps == 151
    led.append(first_step=151, q=0.02, sigma=0.9, max_grad_norm=1.0)
    led.close()
    assert Ledger.open_read_only(path).total_steps == 152


def test_other_run_existing_file_and_unnoised_steps(tmp_path):
    path = tmp_path / "ledger.jsonl"
    _write_run(path).close()
    with pytest.raises(LedgerError, match="run-b"):
        Ledger.open(path, expected_run_id="run-b")
    with pytest.raises(LedgerError, match="ledger.jsonl .*open it to continue its run, or choose "
                                          "another path"):
        Ledger.create(path, run_id="run-a", dataset_size=1000)
    writer = Ledger.open(path)
    with pytest.raises(LedgerError, match="held by another writer.*Read it with open_read_only"):
        Ledger.open(path)
    writer.close()

    other = tmp_path / "nonoise.jsonl"
    led = Ledger.create(other, run_id="x", dataset_size=10)
    led.append(first_step=0, q=0.1, sigma=0.0, max_grad_norm=1.0, noise=False)
    assert led.epsilon(1e-5) == math.inf


def test_create_makes_the_missing_folders_and_the_ledger_survives_them(tmp_path):
    # A run directory named by the user need not exist (the user guide's snippets write
    # run/ledger.jsonl in a fresh folder). Reference: the file read back.
    path = tmp_path / "runs" / "a" / "ledger.jsonl"
    led = Ledger.create(path, run_id="a", dataset_size=10)
    led.append(first_step=0, q=0.1, sigma=1.0, max_grad_norm=1.0)
    led.close()
    assert Ledger.open_read_only(path).total_steps == 1
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(LedgerError, match=f"cannot create the folder of ledger {blocker}/sub/x.jsonl"):
        Ledger.create(blocker / "sub" / "x.jsonl", run_id="b", dataset_size=10)


def test_append_rejects_bad_values_naming_them(tmp_path):
    led = Ledger.create(tmp_path / "l.jsonl", run_id="r", dataset_size=10)
    with pytest.raises(ValueError, match="1.5"):
        led.append(first_step=0, q=1.5, sigma=1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="last_step"):
        led.append(first_step=3, last_step=2, q=0.1, sigma=1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match='"uniform"'):
        led.append(first_step=0, q=0.1, sigma=1.0, max_grad_norm=1.0, sampling="uniform")
    assert led.total_steps == 0


def test_a_privacy_state_resumed_into_a_ledger_missing_its_steps_is_refused(tmp_path):
    # A review: a checkpoint's privacy state loaded into an engine whose ledger path had a typo
    # (a fresh ledger, now that folders are created) went on counting in memory while the
    # durable ledger held 1 step of 4. Reference: the ledger read back.
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,)))

    def engine(path):
        torch.manual_seed(0)
        return dpzero.make_private(torch.nn.Linear(3, 2), data_loader=DataLoader(data, batch_size=4),
                                   noise_multiplier=1.0, max_grad_norm=1.0, seed=0,
                                   ledger_path=str(path))

    def step(p):
        for x, y in p.data_loader:
            F.cross_entropy(p.model(x), y).backward()
            if p.optimizer.step():
                return

    first = engine(tmp_path / "run" / "ledger.jsonl")
    for _ in range(3):
        step(first)
    saved = first.privacy_engine.state_dict()
    first.privacy_engine.detach()
    with pytest.raises(ValueError, match=r"charged 3 steps, but this engine's ledger "
                                         r".*rnu/ledger.jsonl holds 0; make private with the "
                                         r"ledger_path of the run that wrote it"):
        engine(tmp_path / "rnu" / "ledger.jsonl").privacy_engine.load_state_dict(saved)
    del first
    import gc
    gc.collect()  # the first engine's writer lock goes with it
    resumed = engine(tmp_path / "run" / "ledger.jsonl")
    resumed.privacy_engine.load_state_dict(saved)
    step(resumed)
    assert Ledger.open_read_only(tmp_path / "run" / "ledger.jsonl").total_steps == 4
