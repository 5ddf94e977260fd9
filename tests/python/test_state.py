"""Module state written from data (Note [state written from data] in private/state_guard.py):
buffers and frozen parameters are released with the model without noise, so nothing computed
from the training batch may be written into them, by any means, at any step.

Each model below is a case a privacy review found accepted: two neighbouring datasets (one
example replaced by an outlier) trained for a few steps without noise released buffers that
differed by 23.6 to 63.2 (the bound for anything released without noise is 0). Each must now be
refused at its step, its buffers put back, and every release must refuse a frozen parameter
that changed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpzero
from dpzero.private import PrivacyViolation

D, K, N = 6, 3, 12


def _data(outlier: bool = False):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, D, generator=g), torch.randint(0, K, (N,), generator=g)
    if outlier:
        x[0] = 1e3  # the replaced example
    return torch.utils.data.TensorDataset(x, y)


class Ema(nn.Module):
    """A Linear whose forward writes the batch's mean into module state, as ``how`` says:
    "data" (an EMA through ``.data``, VQ-VAE's codebook update), "frozen" (into a frozen
    nn.Parameter in place), "foreach" (``torch._foreach_lerp_`` on a buffer list), "late" (the
    EMA starts after ``start`` forward calls), "counter" (a count of forward calls, which
    follows the realised Poisson batch sizes), or None (nothing)."""

    def __init__(self, how=None, start=3):
        super().__init__()
        self.how, self.start, self.calls = how, start, 0
        self.fc = nn.Linear(D, K)
        self.register_buffer("run", torch.zeros(D))
        self.register_buffer("var", torch.ones(D))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.frozen = nn.Parameter(torch.zeros(D), requires_grad=False)

    def forward(self, x):
        self.calls += 1
        m = x.detach().mean(0)
        if self.how == "data":
            self.run.data.mul_(0.9).add_(0.1 * m)
        elif self.how == "frozen":
            with torch.no_grad():
                self.frozen.mul_(0.9).add_(0.1 * m)
        elif self.how == "frozen-data":
            self.frozen.data.mul_(0.9).add_(0.1 * m)
        elif self.how == "foreach":
            torch._foreach_lerp_([self.run, self.var], [m, x.detach().var(0)], 0.1)
        elif self.how == "late" and self.calls > self.start:
            with torch.no_grad():
                self.run.mul_(0.9).add_(0.1 * m)
        elif self.how == "counter":
            self.count += 1
        return self.fc(x + self.frozen)


def _train(model: nn.Module, steps: int, outlier: bool = False):
    """``steps`` private steps without noise (every example, micro-batches of 4): the engine."""
    p = dpzero.make_private(model, dataset=_data(outlier), sample_rate=1.0, noise_multiplier=0.0,
                            allow_no_noise=True, max_grad_norm=1.0, optimizer="sgd", lr=0.1,
                            seed=0, max_physical_batch_size=4)
    taken = 0
    while taken < steps:
        for x, y in p.data_loader:
            F.cross_entropy(p.model(x), y).backward()
            if p.optimizer.step():
                taken += 1
                if taken == steps:
                    break
    return p


STATE = ["run", "var", "count", "frozen"]


@pytest.mark.parametrize("how,steps", [("data", 1), ("foreach", 1), ("late", 5),
                                       ("counter", 1), ("frozen", 1)])
def test_a_write_into_module_state_refuses_the_step_and_is_undone(how, steps):
    """Whatever the forward writes into a buffer or a frozen parameter, by whatever means and
    from whichever step on, its forward (the probe sees the first such write) or the step that
    follows is refused naming the tensor, and the buffers hold their values from make_private
    again (the review: neighbouring
    runs released buffers 63.2 (.data), 23.6 (_foreach_lerp_), 44.8 (from the fourth call)
    apart)."""
    torch.manual_seed(0)
    model = Ema(how)
    before = {k: v.clone() for k, v in model.state_dict().items() if k in STATE}
    names = {"data": "run", "foreach": "var", "late": "run", "counter": "count",
             "frozen": "frozen"}
    with pytest.raises(PrivacyViolation, match=rf"'?{names[how]}'?.*Note \[state written from "
                                               r"data\]"):
        _train(model, steps)
    # The refused step charged nothing beyond the steps before it, and the buffers are back.
    for k in ("run", "var", "count"):
        assert torch.equal(getattr(model, k), before[k]), (how, k)


def test_the_step_names_the_module_and_the_tensor():
    model = Ema("late", start=2)  # from the second micro-batch on: the step sees it
    with pytest.raises(PrivacyViolation, match=r"buffer 'run' of module '<model>' \(Ema\).*"
                                               r"accept_state_change"):
        _train(model, 1)


def test_a_model_that_writes_nothing_trains_and_releases():
    torch.manual_seed(0)
    p = _train(Ema(None), 3)
    state = p.model.state_dict()
    assert torch.equal(state["_module.run"], torch.zeros(D))


def test_a_frozen_parameter_written_through_data_refuses_every_release(tmp_path):
    """A write through ``.data`` bumps no version counter; the step cannot see it without
    hashing every frozen tensor, so the releases do: state_dict, a checkpoint, detach."""
    torch.manual_seed(0)
    model = Ema(None)
    p = _train(model, 1)
    model.frozen.data.add_(1.0)  # between steps, from anything
    for release in (lambda: p.model.state_dict(), lambda: model.state_dict(),
                    lambda: dpzero.checkpoint.save(p.privacy_engine.sharded, tmp_path / "ck"),
                    lambda: p.privacy_engine.detach()):
        with pytest.raises(PrivacyViolation, match=r"is refused: .*frozen parameter 'frozen'"):
            release()
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def test_a_write_holding_no_training_data_is_accepted_by_name():
    """The caller's own write between steps (computed from the released model) is accepted with
    accept_state_change; a load_state_dict accepts what it loads."""
    torch.manual_seed(0)
    model = Ema(None)
    p = _train(model, 1)
    with torch.no_grad():
        model.run.copy_(model.fc.weight.sum(0))  # from the released model only
    with pytest.raises(PrivacyViolation):
        p.model.state_dict()
    p.privacy_engine.accept_state_change(["run"])
    p.model.state_dict()
    with pytest.raises(ValueError, match=r"\['nope'\] name no buffer"):
        p.privacy_engine.accept_state_change(["nope"])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["var"] = torch.full((D,), 2.0)
    model.load_state_dict(state)
    model.state_dict()


def test_the_probe_leaves_no_trace_in_any_state():
    """The probe's forward sees example 0 twice: whatever it writes is put back, also through
    ``.data`` and into frozen parameters, and the forward is refused naming the tensors."""
    from dpzero.private.state_guard import ProbeWrites

    model = Ema("frozen-data")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with ProbeWrites(model, {id(p) for p in model.fc.parameters()}) as watch:
        model(torch.randn(4, D))
        model.how = "data"
        model(torch.randn(4, D))
        model.how = "foreach"
        model(torch.randn(4, D))
    assert watch.written == ["frozen", "run", "var"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
