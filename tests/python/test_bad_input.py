"""The bad-input matrix at make_private (docs/reliability.md): every invalid privacy
parameter is refused before anything is attached, with a ValueError naming the bad value, and an
unreachable target epsilon names the target and the sigma range searched."""

import json
import warnings

import pytest
import torch
from torch import nn

import dpzero
from dpzero.private import PrivacyViolation

from test_private import D, K, V, SeqNet, seq_data

NAN, INF = float("nan"), float("inf")
NOISE = dict(noise_multiplier=1.0, max_grad_norm=1.0)
TARGET = dict(target_delta=1e-5, epochs=1, max_grad_norm=1.0)


SIGMA_MSG = r"noise_multiplier must be finite and >= 0, got "
Q_MSG = r"sample_rate must be in \(0, 1\], got "


@pytest.mark.parametrize("kwargs, message", [
    (dict(noise_multiplier=-1.0, max_grad_norm=1.0), SIGMA_MSG + "-1$"),
    (dict(noise_multiplier=NAN, max_grad_norm=1.0), SIGMA_MSG + "nan"),
    (dict(noise_multiplier=INF, max_grad_norm=1.0), SIGMA_MSG + "inf"),
    (dict(noise_multiplier=1.0, max_grad_norm=NAN), r"max_grad_norm must be > 0, got nan"),
    (dict(noise_multiplier=1.0, max_grad_norm=0.0), r"max_grad_norm must be > 0, got 0$"),
    (dict(noise_multiplier=1.0, max_grad_norm=1e-42),
     r"max_grad_norm must be at least 2\^-64 \(about 5.4e-20\), the smallest clip norm whose "
     r"rounding the clipped sums' bound absorbs \(Note \[smallest clip norm\]\), got 1e-42$"),
    (dict(target_epsilon=-1.0, **TARGET), r"target epsilon must be > 0 and finite, got -1"),
    (dict(target_epsilon=3.0, target_delta=1.5, epochs=1, max_grad_norm=1.0),
     r"delta must be in \(0, 1\), got 1.5"),
    (dict(sample_rate=0.0, **NOISE), Q_MSG + "0$"),
    (dict(sample_rate=NAN, **NOISE), Q_MSG + "nan"),
    (dict(sample_rate=1.5, **NOISE), Q_MSG + "1.5"),
], ids=["sigma<0", "sigma-nan", "sigma-inf", "C-nan", "C-0", "C-subnormal", "eps<0", "delta>1",
        "q=0", "q-nan", "q>1"])
def test_invalid_privacy_parameters_are_named_and_nothing_is_attached(kwargs, message):
    model = SeqNet()
    before = {n: type(m).forward for n, m in model.named_modules()}
    batch = {} if "sample_rate" in kwargs else dict(batch_size=8)
    with pytest.raises(ValueError, match=message):
        dpzero.make_private(model, dataset=seq_data(), seed=1, **batch, **kwargs)
    # no DP forward patched, no hook left behind
    assert all("forward" not in vars(m) for m in model.modules())
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())
    assert {n: type(m).forward for n, m in model.named_modules()} == before


def test_an_unreachable_target_epsilon_names_the_target_and_the_sigma_range():
    with pytest.raises(ValueError, match=r"target epsilon 1e-09 cannot be reached with sigma in "
                                         r"\[0, 1e\+06\]: epsilon at sigma \d+ is 0\.00"):
        dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, seed=1,
                            target_epsilon=1e-9, **TARGET)


def test_parameters_unfrozen_or_added_after_make_private_stop_the_step():
    # Each change comes after a first step, so the step's check has listed the modules already
    # (private/trainable.py): a submodule added, inserted or removed since must be seen.
    for change in ("unfreeze", "freeze", "add", "submodule", "replace", "insert", "remove"):
        model = SeqNet()
        model.emb.weight.requires_grad_(False)  # frozen before make_private: fine
        p = dpzero.make_private(model, dataset=seq_data(), batch_size=8, seed=1, **NOISE)
        batches = iter(p.data_loader)
        x, y = next(batches)
        torch.nn.functional.cross_entropy(p.model(x), y).backward()
        assert p.optimizer.step()
        p.optimizer.zero_grad()
        if change == "unfreeze":
            model.emb.weight.requires_grad_(True)
            name = "emb.weight"
        elif change == "freeze":  # still in the model, no longer trainable: it would be updated
            model.head.weight.requires_grad_(False)
            name = "head.weight"
        elif change == "add":
            model.extra = torch.nn.Parameter(torch.zeros(3))
            name = "extra"
        elif change == "submodule":
            model.head.side = torch.nn.Linear(2, 2)
            name = "head.side.weight"
        elif change == "replace":
            model.head.bias = torch.nn.Parameter(model.head.bias.detach().clone())
            name = "head.bias"
        elif change == "insert":  # ModuleDict/ModuleList.insert write _modules directly
            model.head._modules["side"] = torch.nn.Linear(2, 2)
            name = "head.side.weight"
        else:  # a trainable parameter removed with its module: no longer in the model
            del model.head
            model.head = torch.nn.Linear(D, K).requires_grad_(False)
            name = None
        x, y = next(batches)
        torch.nn.functional.cross_entropy(p.model(x), y).backward()
        want = rf"'{name}'" if name else r"\(2 trained parameter\(s\) no longer in the model\)"
        with pytest.raises(dpzero.PrivacyViolation,
                           match=rf"trainable parameters changed .*{want}"):
            p.optimizer.step()


def test_a_nan_example_is_dropped_counted_and_the_step_goes_on():
    """One example with NaN features: its clip factor is 0, it is counted, and the update is the
    clipped sum of the others (reference: torch.func per-sample gradients, clipped by hand)."""
    torch.manual_seed(0)
    n, c, lr = 6, 0.5, 1.0
    x = torch.randn(n, 4)
    x[2, 1] = float("nan")
    y = torch.randint(0, 2, (n,))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    p = dpzero.make_private(model, dataset=torch.utils.data.TensorDataset(x, y), sample_rate=1.0,
                            noise_multiplier=0.0, allow_no_noise=True, max_grad_norm=c,
                            optimizer="sgd", lr=lr, seed=0, loss_reduction="sum")
    # Note [released figures]: no warning, whose one bit would tell that a record with a
    # non-finite gradient was sampled (a privacy review used it as a membership oracle).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for xb, yb in p.data_loader:  # q = 1: one logical batch of every row
            torch.nn.functional.cross_entropy(p.model(xb), yb, reduction="sum").backward()
            p.optimizer.step()
            break
    # Note [released figures]: counted, as a data-dependent diagnostic only.
    stats = p.privacy_engine.last_step_diagnostics
    assert stats["dropped"] == 1 and stats["logical_batch_size"] == n, stats
    assert p.privacy_engine.last_step == {"step": 0, "noise_index": 0}
    got = p.privacy_engine.parameters()
    assert all(torch.isfinite(v).all() for v in got.values())

    ref_model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref_model.load_state_dict({k: v for k, v in start.items()})
    params = {k: v for k, v in ref_model.named_parameters()}

    def loss(ps, xi, yi):
        out = torch.func.functional_call(ref_model, ps, (xi.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(out, yi.unsqueeze(0), reduction="sum")

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.sqrt(sum(g.flatten(1).double().pow(2).sum(1) for g in grads.values()))
    factors = torch.clamp(c / (norms + 1e-6), max=1.0)
    factors[2] = 0.0  # the NaN example contributes nothing
    for k, g in grads.items():
        g = torch.nan_to_num(g.double())  # only row 2 is NaN, and its factor is 0
        clipped = (factors.view(-1, *[1] * (g.dim() - 1)) * g).sum(0)
        want = start[k].double() - lr * clipped / n  # normalised by the expected batch q N
        torch.testing.assert_close(got[k].double(), want, rtol=1e-5, atol=1e-6)


def _ledger_session(path, n=40, q=0.2, sigma=1.0, run_id="r", steps=1, **kw):
    """make_private on a fresh model with a ledger; takes ``steps`` steps; returns the engine."""
    ds = torch.utils.data.TensorDataset(torch.randn(n, 3), torch.randint(0, 2, (n,)))
    p = dpzero.make_private(torch.nn.Sequential(torch.nn.Linear(3, 2)), dataset=ds,
                            sample_rate=q, noise_multiplier=sigma, max_grad_norm=1.0, seed=5,
                            optimizer="sgd", lr=0.1, ledger_path=path, run_id=run_id, **kw)
    taken = 0
    for x, y in p.data_loader:
        if taken == steps:
            break
        torch.nn.functional.cross_entropy(p.model(x), y).backward()
        taken += bool(p.optimizer.step())
        p.optimizer.zero_grad()
    p.privacy_engine.ledger.close()
    return p.privacy_engine


@pytest.mark.parametrize("change, message", [
    (dict(q=0.1), r"holds steps at sigma=1, q=0.2; this run uses sigma=1, q=0.1\. "),
    (dict(n=80), r"is for a dataset of 40 examples, this run has 80"),
    (dict(run_id="zzz"), r'belongs to run "r", expected run "zzz"'),
], ids=["other-q", "other-dataset", "other-run"])
def test_a_ledger_of_other_settings_or_another_run_is_refused(tmp_path, change, message):
    path = str(tmp_path / "ledger.jsonl")
    _ledger_session(path)
    before = open(path).read()
    with pytest.raises(Exception, match=message):  # ValueError, or the ledger's LedgerError
        _ledger_session(path, **change)
    assert open(path).read() == before  # nothing appended by the refused run


def test_a_ledger_with_unnoised_steps_is_not_continued_privately(tmp_path):
    path = str(tmp_path / "ledger.jsonl")
    _ledger_session(path, sigma=0.0, allow_no_noise=True)
    with pytest.raises(ValueError, match="records steps without noise; a private run cannot "
                                         "continue it"):
        _ledger_session(path)


@pytest.mark.parametrize("layer, message", [
    # Inter-layer dropout: the per-sample recompute would draw other masks (fallback.py); an
    # LSTM with proj_size takes the generic path (recurrent.generic_reason).
    (lambda: nn.LSTM(4, 6, num_layers=2, dropout=0.1, batch_first=True, proj_size=4),
     r"lstm \(LSTM\): LSTM has dropout=0.1, whose mask the per-sample recompute would draw"),
    (lambda: nn.InstanceNorm1d(4, affine=True, track_running_stats=True),
     r"norm \(InstanceNorm1d\): InstanceNorm with track_running_stats=True averages statistics"),
    # Nothing to train, but its running statistics would still leak the training data.
    (lambda: nn.InstanceNorm1d(4, affine=False, track_running_stats=True),
     r"norm \(InstanceNorm1d\): InstanceNorm with track_running_stats=True"),
])
def test_recurrent_dropout_and_instance_norm_with_running_stats_are_refused(layer, message):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, 4)
            if "LSTM" in message:
                self.lstm = layer()
            else:
                self.norm = layer()
            self.head = nn.Linear(4, 2)

        def forward(self, ids):
            h = self.emb(ids)
            if hasattr(self, "lstm"):
                h = self.lstm(h)[0]
            else:
                h = self.norm(h.transpose(1, 2)).transpose(1, 2)
            return self.head(h.mean(1))

    model = Net()
    with pytest.raises(PrivacyViolation, match=message):
        dpzero.make_private(model, dataset=seq_data(), batch_size=4, noise_multiplier=1.0,
                            max_grad_norm=1.0)
    assert all("forward" not in vars(m) for m in model.modules())  # nothing was patched


def test_a_step_whose_every_example_is_nan_is_reported_and_still_charged(tmp_path):
    """An all-NaN logical batch: no row contributes, the update is exactly the step's noise
    (reference: the noise op with the step's charge index, scaled as the engine documents), the
    step is charged, and the data-dependent diagnostics show it; no warning and no released report does
    (Note [released figures])."""
    from dpzero.train.report import write_report

    torch.manual_seed(0)
    n, c, sigma, lr = 6, 0.5, 1.3, 1.0
    x = torch.full((n, 4), float("nan"))
    y = torch.randint(0, 2, (n,))
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    start = torch.cat([v.detach().flatten().clone() for v in model.parameters()])
    ledger = str(tmp_path / "ledger.jsonl")
    p = dpzero.make_private(model, dataset=torch.utils.data.TensorDataset(x, y), sample_rate=1.0,
                            noise_multiplier=sigma, max_grad_norm=c, optimizer="sgd", lr=lr,
                            seed=4, ledger_path=ledger, run_id="nan",
                            diagnostics_path=str(tmp_path / "private" / "diagnostics.jsonl"))
    with warnings.catch_warnings():  # Note [released figures]: no warning says so
        warnings.simplefilter("error")
        for xb, yb in p.data_loader:
            torch.nn.functional.cross_entropy(p.model(xb), yb).backward()
            p.optimizer.step()
    engine = p.privacy_engine
    assert engine.last_step_diagnostics["all_dropped"]
    assert engine.charges == 1 and len(engine.accountant) == 1
    noise = torch.zeros(start.numel())
    torch.ops.dpzero.add_noise_(noise, sigma * c, 4, 0, 0)
    got = torch.cat([v.flatten() for v in engine.parameters().values()])
    torch.testing.assert_close(got, start - lr * noise / (1.0 * n), rtol=1e-6, atol=1e-7)
    engine.ledger.close()
    data = write_report(str(tmp_path))
    assert "1 step(s) dropped every example" in \
        (tmp_path / "private" / "diagnostics.md").read_text()
    assert "samples dropped (NaN/Inf loss or gradient): 6" in \
        (tmp_path / "private" / "diagnostics.md").read_text()
    # Released: no such figure in the report (data, report.json, report.md) or the ledger.
    released = json.loads((tmp_path / "report.json").read_text())
    assert released == json.loads(json.dumps(data, default=str))
    keys = _keys(released) | {k for line in (tmp_path / "ledger.jsonl").read_text().splitlines()
                              for k in _keys(json.loads(line))}
    assert not {k for k in keys if "dropped" in k or "batch_size" in k} - \
        {"expected_batch_size"}, keys
    md = (tmp_path / "report.md").read_text()
    assert "dropped every example" not in md and "NaN/Inf loss or gradient)" not in md


def _keys(record) -> set:
    """Every key of a JSON record, at any depth."""
    if isinstance(record, dict):
        return set(record) | {k for v in record.values() for k in _keys(v)}
    if isinstance(record, list):
        return {k for v in record for k in _keys(v)}
    return set()


def test_an_empty_logical_batch_is_a_charged_noise_only_step():
    """Poisson sampling can draw no example at all: the step still happens (skipping it would
    reveal that the batch was empty), is charged, and moves the model by exactly its noise."""
    torch.manual_seed(0)
    n, c, sigma, lr, q = 50, 0.5, 1.3, 1.0, 0.01
    ds = torch.utils.data.TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    start = torch.cat([v.detach().flatten().clone() for v in model.parameters()])
    p = dpzero.make_private(model, dataset=ds, sample_rate=q, noise_multiplier=sigma,
                            max_grad_norm=c, optimizer="sgd", lr=lr, seed=11)
    engine = p.privacy_engine
    for xb, yb in p.data_loader:
        p.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(p.model(xb), yb).backward()
        if p.optimizer.step():
            break
    assert engine.last_step_diagnostics["logical_batch_size"] == 0, \
        "seed 11 must draw an empty first batch"
    assert engine.charges == 1 and len(engine.accountant) == 1
    noise = torch.zeros(start.numel())
    torch.ops.dpzero.add_noise_(noise, sigma * c, 11, 0, 0)
    got = torch.cat([v.flatten() for v in engine.parameters().values()])
    torch.testing.assert_close(got, start - lr * noise / (q * n), rtol=1e-6, atol=1e-7)
