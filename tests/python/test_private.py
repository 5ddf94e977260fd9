"""make_private end to end on the engine: reference equality with a naive torch.func DP-SGD step,
sensitivity, tied parameters, validation, sampling and accounting (design.md §3)."""

from __future__ import annotations

import copy
import gc
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpzero
import ranks
from dpzero.private import PrivacyViolation
from private_reference import first_private_step, naive_dp_sgd_step

V, T, D, K = 23, 6, 8, 3  # vocabulary, sequence length, width, classes
EXTRA = {}


class PosEmbed(nn.Module):
    """Parameters used directly in the forward (like ViT's position embeddings): the generic
    torch.func path covers them."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(0.3 * torch.randn(1, T, D))
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(D))

    def forward(self, h):
        return h * self.scale + self.pos


class SeqNet(nn.Module):
    """One DP layer of every kind: Embedding, direct parameters, Conv1d, LayerNorm, HF Conv1D,
    RMSNorm, Linear; ``tied``: an output layer sharing the Embedding's table; ``depth``: the
    LayerNorm and the HF Conv1D called a second time (layers shared across depth, as ALBERT's)."""

    def __init__(self, tied: bool = False, depth: bool = False):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.emb = nn.Embedding(V, D, padding_idx=0)
        self.pos = PosEmbed()
        self.conv = nn.Conv1d(D, D, 3, padding=1)
        self.ln = nn.LayerNorm(D)
        self.proj = Conv1D(D, D)
        nn.init.normal_(self.proj.weight, std=0.3)
        self.rms = nn.RMSNorm(D)
        self.head = nn.Linear(D, K)
        self.tied, self.depth = tied, depth
        if tied:
            self.out = nn.Linear(D, V, bias=False)
            self.out.weight = self.emb.weight

    def forward(self, ids):
        h = self.pos(self.emb(ids))
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = self.proj(torch.tanh(self.ln(h)))
        if self.depth:
            h = self.proj(torch.tanh(self.ln(h)))
        h = self.rms(h)
        logits = self.head(h.mean(1))
        if self.tied:
            logits = logits + self.out(h).mean(1)[:, :K]
        return logits


def seq_data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n, T), generator=g)
    y = torch.randint(0, K, (n,), generator=g)
    return torch.utils.data.TensorDataset(ids, y)


def loss_fn(out, y):
    return F.cross_entropy(out, y)


def own(p, *tensors):
    """The test's own batch, handed in through the ledgered opt-out for callers who sample
    themselves (PrivacyEngine.own_batch): one logical batch of len(tensors[0]) examples."""
    return p.privacy_engine.own_batch(tensors, logical_batch_size=len(tensors[0]))


def one_private_step(model, dataset, **kwargs):
    """Runs step 0 through the loader; returns (engine, the logical batch, params after)."""
    reduction = kwargs.get("loss_reduction", "mean")
    p, x, y = first_private_step(
        model, dataset, lambda out, t: F.cross_entropy(out, t, reduction=reduction), **kwargs)
    return p, x, y, p.privacy_engine.parameters()


def assert_close_params(got, want, atol=2e-5):
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("clipping", ["flat", "layer", "automatic", "group"])
@pytest.mark.parametrize("tied", [False, True, "depth"])
def test_one_step_equals_naive_dp_sgd(clipping, tied):
    """One step against the float64 torch.func step; tied weights and layers called twice per
    example are clipped on the sum of their uses' norms (design.md §2.3), as the reference's
    untied copy does."""
    torch.manual_seed(1)
    model = SeqNet(tied=tied is True, depth=tied == "depth")
    ref_model = copy.deepcopy(model)
    ds = seq_data()
    c, sigma, lr, q = 0.5, 0.7, 0.2, 0.25
    groups = [["emb", "pos", "out"], ["conv", "ln"], ["proj", "rms", "head"]]
    extra = {"clipping_groups": groups} if clipping == "group" else {}
    p, x, y, got = one_private_step(
        model, ds, sample_rate=q, noise_multiplier=sigma, max_grad_norm=c, clipping=clipping,
        seed=1234, lr=lr, max_physical_batch_size=4, **extra)
    assert x.shape[0] > 4  # several micro-batches were accumulated
    want = naive_dp_sgd_step(ref_model, loss_fn, x, y, max_grad_norm=c, noise_multiplier=sigma,
                             seed=1234, noise_index=0, lr=lr, expected_batch=q * len(ds),
                             clipping=clipping, groups=groups)
    assert_close_params(got, want)


class _SelfTiedNorm(nn.Module):
    """A LayerNorm whose bias is its weight: one parameter that one DP layer holds twice, so both
    of the layer's kept per-sample rows add into one slot."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.ln = nn.LayerNorm(8)
        with torch.no_grad():
            self.ln.weight.add_(0.1 * torch.randn(8))
        self.ln.bias = self.ln.weight
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.ln(self.fc(x))))


@pytest.mark.parametrize("clipping", ["flat", "layer"])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_parameter_a_layer_holds_twice_equals_naive_dp_sgd(clipping, stage):
    # Note [a group's kept rows in one add] in src/dp/book.cpp: the layer's two kept rows meet in
    # one slot, so the first is added before the second joins the waiting ones (a review found the
    # list op refusing the pair: "self[0] shares memory with self[1]").
    torch.manual_seed(0)
    model = _SelfTiedNorm()
    ref = copy.deepcopy(model)
    ds = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randint(0, 3, (24,)))
    p, x, y = first_private_step(model, ds, loss_fn, sample_rate=0.5, noise_multiplier=0.0,
                                 allow_no_noise=True, max_grad_norm=0.3, clipping=clipping, seed=1,
                                 lr=0.5, max_physical_batch_size=4, zero_stage=stage)
    want = naive_dp_sgd_step(ref, loss_fn, x, y, max_grad_norm=0.3, noise_multiplier=0.0, seed=1,
                             noise_index=0, lr=0.5, expected_batch=0.5 * len(ds),
                             clipping=clipping)
    assert_close_params(p.privacy_engine.parameters(), want)


def test_no_noise_and_no_clipping_reproduce_plain_sgd():
    torch.manual_seed(2)
    model = SeqNet()
    ref = copy.deepcopy(model)
    ds = seq_data()
    q, lr = 0.25, 0.3
    p, x, y, got = one_private_step(model, ds, sample_rate=q, noise_multiplier=0.0,
                                    max_grad_norm=math.inf, allow_no_noise=True, seed=5, lr=lr,
                                    loss_reduction="sum")
    opt = torch.optim.SGD(ref.parameters(), lr=lr / (q * len(ds)))
    F.cross_entropy(ref(x), y, reduction="sum").backward()
    opt.step()
    assert_close_params(got, {n: t.detach() for n, t in ref.named_parameters()})
    assert p.privacy_engine.epsilon(1e-5) == math.inf


@pytest.mark.parametrize("clipping", ["flat", "layer", "automatic", "group"])
def test_sensitivity_one_outlier_moves_the_sum_by_at_most_c(clipping):
    """design.md §3: an example whose gradient is 1e6 times the others' changes the pre-noise
    sum by at most C. Pre-noise sums are read off an SGD step with lr = q N and no noise."""
    c = 0.25
    groups = [["emb", "pos"], ["conv", "ln", "proj"], ["rms", "head"]]

    amplify = [False]

    def pre_noise_sum(ids, y, outlier):
        amplify[0] = outlier
        torch.manual_seed(3)
        model = SeqNet()
        before = {n: t.detach().clone() for n, t in model.named_parameters()}
        p = dpzero.make_private(model, dataset=seq_data(), sample_rate=0.5, optimizer="sgd",
                                lr=0.5 * 40, noise_multiplier=0.0, allow_no_noise=True,
                                max_grad_norm=c, clipping=clipping, loss_reduction="sum",
                                clipping_groups=groups if clipping == "group" else None)
        p.optimizer.zero_grad()
        x, t = own(p, ids, y)
        F.cross_entropy(p.model(x), t, reduction="sum").backward()
        p.optimizer.step()
        after = p.privacy_engine.parameters()
        return torch.cat([(before[n] - after[n]).flatten().double() for n in after])

    ds = seq_data()
    ids, y = ds.tensors[0][:8].clone(), ds.tensors[1][:8].clone()

    class Outlier(torch.autograd.Function):  # multiplies example 0's gradient by 1e6
        @staticmethod
        def forward(ctx, h):
            return h.clone()

        @staticmethod
        def backward(ctx, g):
            g = g.clone()
            if amplify[0]:
                g[0] *= 1e6
            return g

    orig_forward = SeqNet.forward

    def outlier_forward(self, ids):
        logits = orig_forward(self, ids)
        return Outlier.apply(logits)

    SeqNet.forward = outlier_forward
    try:
        with_outlier = pre_noise_sum(ids, y, True)
        without = pre_noise_sum(ids[1:], y[1:], False)
    finally:
        SeqNet.forward = orig_forward
    moved = (with_outlier - without).norm().item()
    assert moved <= c * (1 + 1e-5), moved
    assert moved > 0.5 * c  # the outlier is clipped to (about) C, not dropped


def test_every_trainable_parameter_must_be_covered():
    class WithLSTM(nn.Module):
        def __init__(self):
            super().__init__()
            # proj_size keeps the generic path (recurrent.generic_reason)
            self.rnn = nn.LSTM(D, D, num_layers=2, batch_first=True, proj_size=2)
            self.head = nn.Linear(2, K)

        def forward(self, x):
            return self.head(self.rnn(x)[0].mean(1))

    model = WithLSTM()
    model.rnn.dropout = 0.1  # dropout between its layers: the generic path cannot replay it
    with pytest.raises(PrivacyViolation, match=r"rnn \(LSTM\): LSTM has dropout=0.1"):
        dpzero.make_private(model, dataset=seq_data(), batch_size=4, noise_multiplier=1.0,
                            max_grad_norm=1.0)
    assert "forward" not in model.head.__dict__  # a rejected model is left as it was
    # Frozen: fine.
    for p in model.rnn.parameters():
        p.requires_grad_(False)
    dpzero.make_private(model, dataset=seq_data(), batch_size=4, noise_multiplier=1.0,
                        max_grad_norm=1.0)


def test_batchnorm_is_rejected_with_the_reason():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(),
                          nn.Linear(4 * 36, 2))
    with pytest.raises(PrivacyViolation, match=r"1 \(BatchNorm2d\): BatchNorm normalises"):
        dpzero.make_private(model, dataset=seq_data(), batch_size=4, noise_multiplier=1.0,
                            max_grad_norm=1.0)


@pytest.mark.parametrize("frozen", [False, True])
def test_an_embedding_with_max_norm_is_rejected_trained_or_frozen(frozen):
    """max_norm renormalises the looked-up rows of the table in place: the table then depends on
    the examples' ids without noise (found by a review, for a frozen table in the probe)."""
    model = nn.Sequential(nn.Embedding(V, D, max_norm=1.0), nn.Flatten(), nn.Linear(D * T, K))
    model[0].requires_grad_(not frozen)
    with pytest.raises(PrivacyViolation, match=r"0 \(Embedding\): max_norm=1.0 renormalises"):
        dpzero.make_private(model, dataset=seq_data(), batch_size=4, noise_multiplier=1.0,
                            max_grad_norm=1.0)


def test_a_parameter_used_outside_its_layer_stops_the_step():
    class Leaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.head = nn.Linear(D, K)

        def forward(self, ids):
            h = self.emb(ids).mean(1)
            return self.head(h) + F.linear(h, self.head.weight)  # escapes the DP layer

    p = dpzero.make_private(Leaky(), dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=1.0)
    ids, y = seq_data().tensors
    x, t = own(p, ids[:8], y[:8])
    with pytest.raises(PrivacyViolation, match="'head.weight' received a gradient"):
        F.cross_entropy(p.model(x), t).backward()
    with pytest.raises(PrivacyViolation, match="refusing the step"):
        p.optimizer.step()

def test_a_dp_layer_gives_autograd_no_path_to_its_parameters():
    """Note [no parameter edges] (src/dp/dp_layers.h): a private backward never reaches the
    parameters of a C++ DP layer (Linear, HF Conv1D, Embedding, LayerNorm) through autograd, so
    their escape hooks run only for an escape. Counted by a second hook on each parameter."""
    model = SeqNet()
    p = dpzero.make_private(model, dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=1.0)
    calls = []
    for name, param in model.named_parameters():
        param.register_hook(lambda g, name=name: calls.append(name))
    ids, y = seq_data().tensors
    x, t = own(p, ids[:8], y[:8])
    F.cross_entropy(p.model(x), t).backward()
    cpp_layers = ("emb.", "ln.", "proj.", "head.")
    assert [n for n in calls if n.startswith(cpp_layers)] == []
    # The Python autograd functions (Conv1d, RMSNorm) and the generic path (pos) keep theirs.
    assert {"conv.weight", "rms.weight", "pos.pos"} <= set(calls)
    p.optimizer.step()


@pytest.mark.parametrize("call", ["grad", "inputs"])
def test_a_backward_restricted_to_some_tensors_is_refused(call):
    """Note [no parameter edges]: torch.autograd.grad or backward(inputs=...) runs only the DP
    layers on a path to the given tensors (here conv's weight: the head above it runs, the
    embedding below does not); the book refuses it, and the step refuses until zero_grad()."""
    model = SeqNet()
    p = dpzero.make_private(model, dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=1.0)
    ids, y = seq_data().tensors
    x, t = own(p, ids[:8], y[:8])
    loss = F.cross_entropy(p.model(x), t)
    with pytest.raises(PrivacyViolation, match="a backward restricted to some tensors"):
        if call == "grad":
            torch.autograd.grad(loss, [model.conv.weight])
        else:
            loss.backward(inputs=[model.conv.weight])
    with pytest.raises(PrivacyViolation, match="refusing the step"):
        p.optimizer.step()


def test_arguments_are_checked_and_named():
    def mk(**kw):
        base = dict(dataset=seq_data(), batch_size=4, noise_multiplier=1.0, max_grad_norm=1.0)
        base.update(kw)
        return dpzero.make_private(SeqNet(), **base)

    with pytest.raises(ValueError, match="allow_no_noise"):
        mk(noise_multiplier=0.0)
    with pytest.raises(ValueError, match="max_grad_norm must be > 0, got -1$"):
        mk(max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="clipping must be one of .* got 'perlayer'"):
        mk(clipping="perlayer")
    with pytest.raises(ValueError, match=r"batch_size must be in \[1, 40\] \(the dataset's size\), "
                                         "got 100"):
        mk(batch_size=100)
    with pytest.raises(ValueError, match=r"sample_rate must be in \(0, 1\], got 1.5"):
        mk(batch_size=None, sample_rate=1.5)
    with pytest.raises(ValueError, match="noise needs a finite max_grad_norm"):
        mk(max_grad_norm=math.inf)
    with pytest.raises(ValueError, match="DP layer 'head' is in no clipping group"):
        mk(clipping="group", clipping_groups=[["emb", "pos", "conv", "ln", "proj", "rms"]])
    with pytest.raises(ValueError, match="optimizer RMSprop is not supported"):
        m = SeqNet()
        dpzero.make_private(m, optimizer=torch.optim.RMSprop(m.parameters()), dataset=seq_data(),
                            batch_size=4, noise_multiplier=1.0, max_grad_norm=1.0)


def test_batch_sizes_are_binomial_and_the_accountant_gets_the_samplers_q(tmp_path):
    n, q, steps = 400, 0.05, 120
    ds = torch.utils.data.TensorDataset(torch.randn(n, 3), torch.randint(0, 2, (n,)))
    model = nn.Sequential(nn.Linear(3, 2))
    p = dpzero.make_private(model, dataset=ds, sample_rate=q, noise_multiplier=1.1,
                            max_grad_norm=1.0, seed=9, ledger_path=str(tmp_path / "ledger.jsonl"),
                            accountant="rdp", diagnostics_path=str(tmp_path / "diagnostics.jsonl"))
    sizes = []
    for _ in range(math.ceil(steps / len(p.data_loader)) + 1):
        for x, y in p.data_loader:
            sizes.append(x.shape[0])
            p.optimizer.zero_grad()
            F.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            if len(sizes) == steps:
                break
        if len(sizes) == steps:
            break
    sizes_t = torch.tensor(sizes, dtype=torch.float64)
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes_t.mean().item() - mean) < 4 * math.sqrt(var / steps)
    assert 0.6 * var < sizes_t.var().item() < 1.5 * var
    assert p.data_loader.sample_rate == q
    assert p.privacy_engine.accountant.history == [(1.1, q, steps)]
    ledger = dpzero.Ledger.open_read_only(str(tmp_path / "ledger.jsonl"))
    assert ledger.total_steps == steps
    assert all(r.q == q and r.sigma == 1.1 and r.sampling == "poisson" for r in ledger.records)
    # Note [released figures]: the realised sizes are data-dependent diagnostics, never in the ledger.
    with open(tmp_path / "diagnostics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert rows[0]["kind"] == "header" and "NOT covered by the run's epsilon" in rows[0]["warning"]
    assert [r["logical_batch_size"] for r in rows[1:]] == sizes
    text = open(tmp_path / "ledger.jsonl").read()
    assert "batch_sizes" not in text and "dropped" not in text
    want = dpzero.RDPAccountant()
    want.step(noise_multiplier=1.1, sample_rate=q, num_steps=steps)
    assert p.privacy_engine.epsilon(1e-5) == pytest.approx(want.get_epsilon(1e-5), rel=1e-12)
    assert ledger.epsilon(1e-5, "rdp") == pytest.approx(want.get_epsilon(1e-5), rel=1e-12)


def test_noise_index_is_the_ledger_charge_count(tmp_path):
    """Note [noise index]: a run resumed on the same ledger never reuses a draw."""
    path = str(tmp_path / "ledger.jsonl")
    ds = seq_data()

    def run(steps):
        torch.manual_seed(4)
        p = dpzero.make_private(SeqNet(), dataset=ds, batch_size=8, noise_multiplier=1.0,
                                max_grad_norm=1.0, seed=3, ledger_path=path, run_id="r")
        indices = []
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            F.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            indices.append(p.privacy_engine.last_step["noise_index"])
            if len(indices) == steps:
                break
        p.privacy_engine.ledger.close()
        return indices

    assert run(3) == [0, 1, 2]
    assert run(2) == [3, 4]


def test_a_step_charged_then_failed_never_redraws_its_batch(monkeypatch):
    """Note [noise index]: a step that fails after its charge (here a failpoint raises between
    the charge and the update) used its Poisson batch; the sampler goes on from the charge count,
    never drawing step 0 again (without the fix the next epoch starts at step 0: one draw for two
    charges). The failure is a dpzero.UpdateError that says the step was charged, and the
    accountant holds the charge."""
    monkeypatch.setenv("DPZERO_FAILPOINT", "after_charge@0:raise")  # read at make_private
    torch.manual_seed(4)
    p = dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=1.0, seed=3, accountant="rdp")
    engine = p.privacy_engine
    for x, y in p.data_loader:
        p.optimizer.zero_grad()
        F.cross_entropy(p.model(x), y).backward()
        with pytest.raises(dpzero.UpdateError, match=r"step 0 \(charge 0\): the step was "
                           r"charged .*DPZERO_FAILPOINT after_charge@0:raise") as raised:
            p.optimizer.step()
        assert raised.value.charged is True
        break
    assert engine.charges == 1 == len(engine.accountant)
    assert engine.next_step == 1
    p.optimizer.zero_grad()
    for x, y in p.data_loader:
        F.cross_entropy(p.model(x), y).backward()
        assert p.optimizer.step()
        break
    assert engine.last_step == {"step": 1, "noise_index": 1}
    assert len(engine.accountant) == engine.charges == 2


def test_the_step_calls_no_python():
    """Between the call into the C++ step (``PrivateStep.take``) and its return, no Python
    function runs: the agreement, budget, ledger, accountant and update are C++ (design.md §1:
    C++ never calls back into Python). Observed with a profile hook, which sees every Python
    call, also one made from C++; its control is a C function that does call Python (``sorted``
    with a Python key)."""
    p = dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=1.0, seed=3, accountant="prv")
    inside, entered, called = [], [], []

    def profile(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", None) in ("take", "sorted"):
            inside.append(arg.__name__)
            entered.append(arg.__name__)
        elif event in ("c_return", "c_exception") and inside and \
                getattr(arg, "__name__", None) == inside[-1]:
            inside.pop()
        elif event == "call" and inside:
            called.append((inside[-1], frame.f_code.co_name))

    gc.disable()  # no finalizer may run Python inside the measured calls
    sys.setprofile(profile)
    try:
        sorted([2, 1], key=lambda v: v)
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            F.cross_entropy(p.model(x), y).backward()
            assert p.optimizer.step()
            break
    finally:
        sys.setprofile(None)
        gc.enable()
    assert ("sorted", "<lambda>") in called  # the hook sees Python called from C
    assert entered.count("take") == 1  # the C++ step, entered once
    assert [c for c in called if c[0] == "take"] == []
    assert len(p.privacy_engine.accountant) == 1 == p.privacy_engine.charges


def test_opacus_style_entry_point():
    torch.manual_seed(5)
    model = SeqNet()
    ds = seq_data()
    loader = torch.utils.data.DataLoader(ds, batch_size=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = dpzero.PrivacyEngine(accountant="rdp")
    model, opt, loader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                             noise_multiplier=1.0, max_grad_norm=1.0)
    assert loader.sample_rate == 8 / 40
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert engine.steps_taken == 5  # one epoch = 1/q steps
    assert engine.sharded.zero_state.lr == 0.1
    eps = engine.get_epsilon(1e-5)
    assert 0 < eps < math.inf


# ---- sharding invariance (design.md §3): same seeds => same parameters for any W and stage -----

def take_steps(p, n):
    """n private steps of ``p`` (a make_private result) through its data loader."""
    taken = 0
    while taken < n:
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            F.cross_entropy(p.model(x), y).backward()
            if p.optimizer.step():
                taken += 1
                if taken == n:
                    return


def private_run(stage, clipping, tied, *, steps=10, rank=0, world_size=1):
    """``clipping`` "strict": flat clipping under isolation="strict"."""
    torch.manual_seed(6)
    model = SeqNet(tied=tied)
    how = dict(clipping="flat", isolation="strict") if clipping == "strict" else \
        dict(clipping=clipping)
    p = dpzero.make_private(model, dataset=seq_data(48), sample_rate=0.2, noise_multiplier=0.8,
                            max_grad_norm=0.5, zero_stage=stage, seed=77, optimizer="adam",
                            lr=0.01, max_physical_batch_size=3, **how, **EXTRA)
    take_steps(p, steps)
    return {"params": p.privacy_engine.parameters(),
            "sizes": [r for r in p.privacy_engine.accountant.history]}


_SINGLE: dict = {}


def _single_rank(clipping, tied):
    if (clipping, tied) not in _SINGLE:
        _SINGLE[(clipping, tied)] = private_run(0, clipping, tied)
    return _SINGLE[(clipping, tied)]


def _private_rank_main(rank, world_size, cases):
    return {key: private_run(*case, rank=rank, world_size=world_size)
            for key, case in cases.items()}


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_sharding_invariance_across_world_sizes_and_stages(tmp_path, world_size):
    # W = 4 runs four ranks on two cores (slow collectives): stages 1-3 flat, stage 3 layer.
    # Strict isolation at stage 2 (padding batches on short ranks included).
    combos = [(s, c, t) for s in (0, 1, 2, 3) for c, t in (("flat", True), ("layer", False))]
    combos.append((2, "strict", True))
    if world_size == 4:
        combos = [(1, "flat", True), (2, "flat", True), (3, "flat", True), (3, "layer", False)]
    cases = {combo: combo for combo in combos}
    results = ranks.spawn(_private_rank_main, world_size, tmp_path, cases)[0]
    for (stage, clipping, tied), got in results.items():
        want = _single_rank(clipping, tied)
        assert got["sizes"] == want["sizes"]
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, atol=1e-5, rtol=1e-4,
                                       msg=lambda m, name=name: f"stage {stage} {clipping} "
                                       f"W={world_size} {name}: {m}")


@pytest.mark.parametrize("clipping", ["flat", "layer"])
def test_stage3_frees_each_unit_after_its_layers_backward(clipping):
    """Note [early release] in src/dp/book.h: with flat clipping the clipped sums wait for the
    end of the backward, but the gathered parameters must not — at most the root unit and two
    blocks (the running one and the prefetched one) are gathered at once, as with layer-wise
    clipping; before, every unit stayed gathered to the end (the whole model)."""
    torch.manual_seed(0)
    width, blocks = 48, 6
    model = nn.Sequential(nn.Embedding(V, width),
                          *[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                            for _ in range(blocks)],
                          nn.Linear(width, K))
    units = [str(i) for i in range(1, blocks + 1)]
    data = torch.utils.data.TensorDataset(torch.randint(0, V, (16, T)),
                                          torch.randint(0, K, (16,)))
    p = dpzero.make_private(model, dataset=data, sample_rate=0.5, noise_multiplier=1.0,
                            max_grad_norm=1.0, clipping=clipping, zero_stage=3, units=units,
                            seed=0)
    for x, y in [data[:8], data[8:]]:
        p.optimizer.zero_grad()
        x, y = own(p, x, y)
        F.cross_entropy(p.model(x).mean(1), y).backward()
        p.optimizer.step()
    memory = p.privacy_engine.sharded.memory()
    block_bytes = (width * width + width) * 4
    root_bytes = (V * width + width * K + K) * 4
    gathered = memory["peak_params"] - memory["params"]  # above the held shards
    assert gathered >= root_bytes + block_bytes  # the measure sees gathers at all
    assert gathered <= root_bytes + 2 * block_bytes + 64  # alignment padding
    # the model's parameters all gathered at once would be root + 6 blocks


def test_a_second_backward_through_one_forward_is_refused():
    p = dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=1.0, clipping="layer")
    ids, y = own(p, *(t[:8] for t in seq_data().tensors))
    loss = F.cross_entropy(p.model(ids), y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already taken"):
        loss.backward()
    with pytest.raises(PrivacyViolation, match="refusing the step"):
        p.optimizer.step()


def test_secure_mode_draws_fresh_noise_every_run():
    def run():
        torch.manual_seed(8)
        p = dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                                max_grad_norm=1.0, secure_mode=True, lr=0.1)
        ids, y = own(p, *(t[:8] for t in seq_data().tensors))
        F.cross_entropy(p.model(ids), y).backward()
        p.optimizer.step()
        assert p.privacy_engine.state_dict()["seed"] is None  # nothing reproducible is kept
        return p.privacy_engine.parameters()

    a, b = run(), run()
    assert not torch.equal(a["head.weight"], b["head.weight"])


def test_every_front_door_draws_in_secure_mode_unless_given_a_seed():
    """Note [secure by default]: make_private and the Opacus-style PrivacyEngine draw secure
    noise unless the run has a seed (two unseeded runs from the same model and batch differ, and
    their state holds neither seed nor key), a seed gives Philox noise that reruns exactly,
    secure_mode=False without a seed draws a seed that the state keeps, and a seed with
    secure_mode=True is refused naming the seed. (PrivateTrainer and the C++ front door: their
    own tests.)"""
    def step(front, **kw):
        torch.manual_seed(8)
        model = SeqNet()
        if front == "opacus":
            engine = dpzero.PrivacyEngine(**{k: v for k, v in kw.items() if k == "secure_mode"})
            loader = torch.utils.data.DataLoader(seq_data(), batch_size=8)
            rest = {k: v for k, v in kw.items() if k != "secure_mode"}
            model, optimizer, loader = engine.make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, **rest)
        else:
            p = dpzero.make_private(model, dataset=seq_data(), batch_size=8,
                                    noise_multiplier=1.0, max_grad_norm=1.0, lr=0.1, **kw)
            engine, model, optimizer = p.privacy_engine, p.model, p.optimizer
        ids, y = engine.own_batch(tuple(t[:8] for t in seq_data().tensors), logical_batch_size=8)
        F.cross_entropy(model(ids), y).backward()
        optimizer.step()
        return engine, engine.parameters()["head.weight"]

    for front in ("make_private", "opacus"):
        (e1, w1), (e2, w2) = step(front), step(front)
        assert e1.secure_mode and e2.secure_mode
        assert not torch.equal(w1, w2)  # fresh keys
        state = e1.state_dict()
        assert state["seed"] is None and "key" not in state
        (s1, v1), (_, v2) = step(front, seed=5), step(front, seed=5)
        assert not s1.secure_mode and s1.state_dict()["seed"] == 5
        assert torch.equal(v1, v2)  # the seed reruns it exactly
        drawn, _ = step(front, secure_mode=False)
        assert not drawn.secure_mode and isinstance(drawn.state_dict()["seed"], int)
        with pytest.raises(ValueError, match=r"seed=5 with secure_mode=True: secure mode draws "
                                             r"its key from the OS"):
            step(front, seed=5, secure_mode=True)


def _secure_step(tmp_path, name, state=None):
    """A secure-mode SeqNet (the same initial weights each time) with its own ledger, given
    ``state`` first if any, and its first step on the first 8 examples; (engine, head update)."""
    torch.manual_seed(8)
    p = dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=1.0, lr=0.1, ledger_path=str(tmp_path / name))
    before = p.privacy_engine.parameters()["head.weight"]
    refusal = None
    if state is not None:
        try:
            p.privacy_engine.load_state_dict(state)
        except ValueError as e:
            refusal = str(e)
    ids, y = own(p, *(t[:8] for t in seq_data().tensors))
    F.cross_entropy(p.model(ids), y).backward()
    p.optimizer.step()
    return p.privacy_engine, p.privacy_engine.parameters()["head.weight"] - before, refusal


def test_a_refused_state_leaves_no_key_behind(tmp_path):
    """A state that load_state_dict refuses (here: it counts a charge this run's ledger lacks)
    changes nothing, not even the secure key it holds: with the other run's key, this run's
    first step would draw the noise that run released at the same charge index, and the two
    updates would give the noise away."""
    a, update_a, _ = _secure_step(tmp_path, "a.jsonl")
    _, update_b, refusal = _secure_step(tmp_path, "b.jsonl", a.state_dict(include_secrets=True))
    assert "charged 1 steps, but this engine's ledger" in refusal
    assert not torch.allclose(update_a, update_b)


def test_a_state_whose_history_is_not_its_charges_is_refused():
    """ε is composed from the history: a state whose history counts fewer steps than its
    charges, or steps at another σ or q, or comes from another accountant, would make ε count
    less than was charged."""
    p = dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=1.0, seed=3, accountant="prv")
    engine = p.privacy_engine
    good = engine.state_dict() | {"charges": 50, "history": [(1.0, 8 / 40, 50)]}
    for bad, why in [({"history": []}, r"its history \[\] is not 50 steps at sigma=1.0"),
                     ({"history": [(50.0, 8 / 40, 50)]}, r"is not 50 steps at sigma=1.0, q=0.2"),
                     ({"accountant": "rdp"}, r"its accountant is 'rdp', this engine's 'prv'")]:
        with pytest.raises(ValueError, match=why):
            engine.load_state_dict(good | bad)
        assert engine.charges == 0 and len(engine.accountant) == 0  # nothing changed
    engine.load_state_dict(good)
    assert engine.charges == len(engine.accountant) == 50


def test_the_accountant_the_step_charges_cannot_be_replaced():
    p = dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=1.0, seed=3)
    with pytest.raises(AttributeError, match="the private step charges the engine's own"):
        p.privacy_engine.accountant = dpzero.PRVAccountant()


def test_a_failed_attach_does_not_turn_secure_mode_off():
    """Note [secure by default] is applied to what the caller asked, at every attach: a refused
    make_private with a seed leaves a later one without a seed in secure mode."""
    engine = dpzero.PrivacyEngine()
    loader = torch.utils.data.DataLoader(seq_data(), batch_size=8)

    class WithBatchNorm(SeqNet):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

    with pytest.raises(Exception, match="BatchNorm"):
        model = WithBatchNorm()
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, seed=5)
    model = SeqNet()
    engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)
    assert engine.secure_mode is True and engine.state_dict()["seed"] is None


def test_only_the_private_step_updates_a_private_model():
    """Note [only the private step updates a private model]: the ZeRO state's own step would
    release the clipped gradients with no noise and no charge."""
    p = dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, noise_multiplier=10.0,
                            max_grad_norm=1.0, seed=3)
    ids, y = own(p, *(t[:8] for t in seq_data().tensors))
    F.cross_entropy(p.model(ids), y).backward()
    before = p.privacy_engine.parameters()
    with pytest.raises(RuntimeError, match=r"ZeroState.step\(\): this model is private"):
        p.privacy_engine.sharded.step()
    with pytest.raises(RuntimeError, match=r"ZeroState.noisy_step\(\): this model is private"):
        p.privacy_engine.sharded.zero_state.noisy_step(seed=0, stddev=0.0, step=0,
                                                       grad_scale=1.0)
    after = p.privacy_engine.parameters()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert p.privacy_engine.charges == 0
    assert p.optimizer.step() and p.privacy_engine.charges == 1


def test_a_resumed_run_without_noise_reports_infinite_epsilon():
    p = dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, noise_multiplier=0.0,
                            allow_no_noise=True, max_grad_norm=1.0, seed=3)
    p.privacy_engine.load_state_dict(p.privacy_engine.state_dict() | {"charges": 7})
    assert p.privacy_engine.epsilon(1e-5) == math.inf


def test_bf16_compute_keeps_the_fp32_clipping_contract():
    """design.md §4: under bf16 compute the clipped sum is still formed in fp32 and one example
    still moves it by at most C; the step matches the fp32 naive reference to bf16 accuracy."""
    torch.manual_seed(9)
    model = SeqNet()
    ref = copy.deepcopy(model)
    ds = seq_data()
    c, q, lr = 0.5, 0.25, 0.2
    p, x, y, got = one_private_step(model, ds, sample_rate=q, noise_multiplier=0.0,
                                    allow_no_noise=True, max_grad_norm=c, seed=1, lr=lr,
                                    mixed_precision="bf16", zero_stage=2)
    assert p.privacy_engine.sharded.param_dtype == torch.bfloat16
    want = naive_dp_sgd_step(ref, loss_fn, x, y, max_grad_norm=c, noise_multiplier=0.0, seed=1,
                             noise_index=0, lr=lr, expected_batch=q * len(ds))
    before = dict(ref.named_parameters())
    for name in want:
        step_got = got[name] - before[name].detach()
        step_want = want[name] - before[name].detach()
        err = (step_got - step_want).norm() / step_want.norm().clamp_min(1e-12)
        assert err < 0.05, (name, err.item())


# ---- misuse that would break the accounting (found in review) --------------------------------

def _tiny(n=4, **kw):
    ds = torch.utils.data.TensorDataset(torch.randn(n, 3), torch.randint(0, 2, (n,)))
    model = nn.Sequential(nn.Linear(3, 2))
    base = dict(dataset=ds, sample_rate=1.0, noise_multiplier=0.0, allow_no_noise=True,
                max_grad_norm=math.inf, optimizer="sgd", lr=1.0, seed=0,
                max_physical_batch_size=3, loss_reduction="sum")
    base.update(kw)
    return model, ds, dpzero.make_private(model, **base)


C_TINY, SIGMA_TINY, LR_TINY = 0.5, 0.7, 0.2  # the private-buffer tests below


def _private_seqnet(seed, noise_seed, **kw):
    """(model, untouched copy, ids, targets, make_private result) for the private-buffer tests:
    SeqNet, 8 rows per logical batch, driven without the loader."""
    torch.manual_seed(seed)
    model = SeqNet()
    ref = copy.deepcopy(model)
    ds = seq_data()
    p = dpzero.make_private(model, dataset=ds, batch_size=8, noise_multiplier=SIGMA_TINY,
                            max_grad_norm=C_TINY, seed=noise_seed, optimizer="sgd", lr=LR_TINY,
                            **kw)
    ids, y = ds.tensors
    return model, ref, ids, y, p


def _assert_naive_step(p, ref, ids, y, noise_seed, clipping="flat"):
    """The engine took exactly one naive DP-SGD step on (ids, y) from ``ref``'s weights."""
    want = naive_dp_sgd_step(ref, loss_fn, ids, y, max_grad_norm=C_TINY,
                             noise_multiplier=SIGMA_TINY, seed=noise_seed, noise_index=0,
                             lr=LR_TINY, expected_batch=8, clipping=clipping)
    assert_close_params(p.privacy_engine.parameters(), want)


@pytest.mark.parametrize("clipping", ["flat", "layer"])
def test_zero_grad_drops_a_backward_the_engine_buffer_already_holds(clipping):
    """Note [private accumulator]: at stage 0 the clipped sums are added straight into the
    engine's gradient buffer (checked: it holds them after the backward), and zero_grad() zeroes
    that buffer only when something wrote it since the last zeroing (Note [private gradients]).
    A backward that zero_grad() drops must still leave nothing behind: the step after it equals
    the naive DP-SGD step of its own batch alone."""
    model, ref, ids, y, p = _private_seqnet(11, 21, clipping=clipping)
    state = p.privacy_engine.sharded.zero_state
    accumulators = [state.grad_accumulator(u) for u in range(state.num_units)]
    assert all(a is not None for a in accumulators)
    p.optimizer.zero_grad()
    x, t = own(p, ids[:8], y[:8])
    F.cross_entropy(p.model(x), t).backward()  # lands in the engine's buffer ...
    assert any(a.abs().sum() > 0 for a in accumulators)
    p.optimizer.zero_grad()  # ... and is dropped
    assert all(a.abs().sum() == 0 for a in accumulators)
    p.optimizer.zero_grad()  # clean: nothing to zero
    x, t = own(p, ids[8:16], y[8:16])
    F.cross_entropy(p.model(x), t).backward()
    assert p.optimizer.step()
    _assert_naive_step(p, ref, ids[8:16], y[8:16], 21, clipping)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_grad_written_by_the_caller_never_reaches_the_step(stage):
    """Note [private gradients]: under DP the engine attaches no .grad views. With views, step()
    copied each parameter's .grad into the gradient buffer: model.zero_grad() (.grad = None)
    between backward and step wiped the clipped sums (a noise-only step, charged), and a .grad
    set by hand was released unclipped. Both must leave the step equal to the naive one."""
    model, ref, ids, y, p = _private_seqnet(12, 22, zero_stage=stage)
    p.optimizer.zero_grad()
    x, t = own(p, ids[:8], y[:8])
    F.cross_entropy(p.model(x), t).backward()
    model.zero_grad(set_to_none=True)
    model.head.weight.grad = torch.full_like(model.head.weight, 1e6)
    assert p.optimizer.step()
    _assert_naive_step(p, ref, ids[:8], y[:8], 22)


def test_a_backward_that_failed_partway_must_be_dropped_before_the_next_forward():
    """A backward that raises in a node after some DP layers were clipped leaves their clipped
    sums accumulated; a retried forward + backward would count those examples twice. The next
    forward is refused until zero_grad(), and then the step is the naive one."""
    model, ref, ids, y, p = _private_seqnet(13, 23, clipping="layer")
    fail = [True]

    def fail_once(grad):
        if fail[0]:
            fail[0] = False
            raise RuntimeError("boom")
        return grad

    # conv's output gradient arrives after ln, proj, rms and head were clipped (layer clipping
    # adds each at once). Not in the provenance probe's forward (Note [batch provenance]).
    def hook_output(module, inputs, out):
        if p.privacy_engine.book.probe is None:
            out.register_hook(fail_once)

    handle = model.conv.register_forward_hook(hook_output)
    p.optimizer.zero_grad()
    x, t = own(p, ids[:8], y[:8])
    with pytest.raises(RuntimeError, match="boom"):
        F.cross_entropy(p.model(x), t).backward()
    handle.remove()
    with pytest.raises(PrivacyViolation, match="stopped partway"):
        p.model(x)
    with pytest.raises(PrivacyViolation, match="refusing the step"):
        p.optimizer.step()
    p.optimizer.zero_grad()
    x, t = own(p, ids[:8], y[:8])
    F.cross_entropy(p.model(x), t).backward()
    assert p.optimizer.step()
    _assert_naive_step(p, ref, ids[:8], y[:8], 23, "layer")


def test_step_then_zero_grad_loop_keeps_the_logical_batch():
    """Opacus's semantics: after a step() that only accumulated, zero_grad() keeps the
    accumulation, whichever order the loop calls them in."""
    results = []
    for order in ("zero_grad_first", "step_first"):
        torch.manual_seed(0)
        model, ds, p = _tiny()
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for x, y in p.data_loader:
            if order == "zero_grad_first":
                p.optimizer.zero_grad()
            F.cross_entropy(p.model(x), y, reduction="sum").backward()
            taken = p.optimizer.step()
            if order == "step_first":
                p.optimizer.zero_grad()
            if taken:
                break
        results.append(p.privacy_engine.parameters()["0.weight"])
    ref = nn.Sequential(nn.Linear(3, 2))
    ref.load_state_dict(start)
    F.cross_entropy(ref(ds.tensors[0]), ds.tensors[1], reduction="sum").backward()
    want = ref[0].weight.detach() - 1.0 * ref[0].weight.grad / 4
    for got in results:
        torch.testing.assert_close(got, want)


def test_a_logical_batch_left_unstepped_is_not_mixed_into_the_next():
    model, ds, p = _tiny(n=12, sample_rate=0.5)
    batches = iter(p.data_loader)
    x, y = next(batches)
    for _ in range(p.privacy_engine.micro_batches_of_step):  # step 0's, never stepped
        F.cross_entropy(p.model(x), y).backward()
        x, y = next(batches)
    with pytest.raises(RuntimeError, match="previous one's gradients were still accumulated"):
        F.cross_entropy(p.model(x), y).backward()  # step 1's first micro-batch
    with pytest.raises(PrivacyViolation, match="refusing the step"):
        p.optimizer.step()


def test_two_backward_passes_on_one_micro_batch_are_refused():
    model, ds, p = _tiny()
    x, y = next(iter(p.data_loader))
    F.cross_entropy(p.model(x), y).backward()
    with pytest.raises(PrivacyViolation, match="second backward pass"):
        F.cross_entropy(p.model(x), y).backward()  # e.g. a second forward on the same batch


def test_two_micro_batches_back_propagated_together_are_refused():
    # Forward on micro-batch A, the loader hands out B, forward on B, one backward through both:
    # row i of A and of B would be clipped as one example (found by a review of the C++ book).
    model, ds, p = _tiny(n=6, max_physical_batch_size=3, max_grad_norm=1.0)
    batches = iter(p.data_loader)
    xa, ya = next(batches)
    loss_a = F.cross_entropy(p.model(xa), ya, reduction="sum")
    xb, yb = next(batches)
    assert xa.shape[0] == xb.shape[0] == 3  # equal rows: a row count cannot tell them apart
    loss_b = F.cross_entropy(p.model(xb), yb, reduction="sum")
    with pytest.raises(PrivacyViolation, match="of an earlier micro-batch"):
        (loss_a + loss_b).backward()
    with pytest.raises(PrivacyViolation, match="refusing the step"):
        p.optimizer.step()


def test_unbatched_position_ids_are_refused():
    class NanoGPT(nn.Module):  # wpe(arange(T)): positions on dim 0 when B == T
        def __init__(self):
            super().__init__()
            self.wte, self.wpe, self.head = nn.Embedding(V, D), nn.Embedding(T, D), nn.Linear(D, K)

        def forward(self, ids):
            h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
            return self.head(h.mean(1))

    p = dpzero.make_private(NanoGPT(), dataset=seq_data(), batch_size=6, noise_multiplier=1.0,
                            max_grad_norm=1.0, max_physical_batch_size=T)
    ids, y = own(p, *(t[:T] for t in seq_data().tensors))  # B = T = 6
    with pytest.raises(PrivacyViolation, match=r"Embedding 'wpe': its input of shape \[6\] does "
                                               r"not come from the examples.*unsqueeze\(0\)"):
        p.model(ids)


def test_a_resumed_ledger_is_charged_and_never_replayed(tmp_path):
    path = str(tmp_path / "ledger.jsonl")
    seen = []

    def session(steps):
        model, ds, p = _tiny(n=40, sample_rate=0.2, noise_multiplier=1.0, allow_no_noise=False,
                             max_grad_norm=1.0, ledger_path=path, run_id="r", seed=5,
                             max_physical_batch_size=None, accountant="rdp")
        taken = 0
        for x, y in p.data_loader:
            seen.append(x.sum().item())
            F.cross_entropy(p.model(x), y).backward()
            taken += bool(p.optimizer.step())
            p.optimizer.zero_grad()
            if taken == steps:
                break
        p.privacy_engine.ledger.close()
        return p.privacy_engine

    session(2)
    engine = session(2)
    assert engine.charges == 4 and engine.last_step["noise_index"] == 3
    assert engine.last_step["step"] == 3  # the sampler continued, not restarted
    assert len(set(seen)) == 4  # four different batches, none replayed
    want = dpzero.RDPAccountant()
    want.step(noise_multiplier=1.0, sample_rate=0.2, num_steps=4)
    assert engine.epsilon(1e-5) == pytest.approx(want.get_epsilon(1e-5), rel=1e-12)
    with pytest.raises(ValueError, match="holds steps at sigma=1, q=0.2; this run uses "
                                         "sigma=2, q=0.2"):
        _tiny(n=40, sample_rate=0.2, noise_multiplier=2.0, max_grad_norm=1.0, ledger_path=path,
              run_id="r")


def test_settings_the_private_path_owns_are_refused():
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['reduce_dtype'\]"):
        _tiny(mixed_precision="bf16", reduce_dtype=torch.bfloat16)
    model, ds, p = _tiny()
    with pytest.raises(AttributeError):
        p.privacy_engine.max_grad_norm = 0.5  # read-only: thresholds were fixed from it


def test_a_detached_engine_refuses_to_step_and_a_second_step_is_refused():
    model, ds, p = _tiny()
    for x, y in p.data_loader:
        F.cross_entropy(p.model(x), y).backward()
        if p.optimizer.step():
            break
    with pytest.raises(RuntimeError, match="step\\(\\) without a micro-batch since the last step"):
        p.optimizer.step()
    p.privacy_engine.detach()
    F.cross_entropy(model(ds.tensors[0]), ds.tensors[1]).backward()  # plain autograd again
    with pytest.raises(RuntimeError, match="was detached"):
        p.optimizer.step()


def test_parameters_unfrozen_after_make_private_stop_the_step():
    model, ds, p = _tiny()
    model[0].bias.requires_grad_(False)
    with pytest.raises(PrivacyViolation, match=r"trainable parameters changed .*'0.bias'"):
        for x, y in p.data_loader:
            F.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()


def test_layer_thresholds_never_exceed_the_total():
    torch.manual_seed(0)
    model = SeqNet()
    p = dpzero.make_private(model, dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=0.7, clipping="layer")
    th = p.privacy_engine.book.thresholds
    assert len(th) == 7
    import fractions
    total = sum(fractions.Fraction(t) ** 2 for t in th)
    assert total <= fractions.Fraction(0.7) ** 2


def _agreement_rank_main(rank, world_size):
    outcome = {}
    try:  # seed = base + rank: ranks would draw different batches and noise
        dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=1.0, seed=100 + rank)
        outcome["seed"] = "accepted"
    except ValueError as e:
        outcome["seed"] = str(e)
    try:  # seed -1 (2^64 - 1) on rank 0, none on rank 1: not the same as no seed anywhere
        dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=1.0, seed=-1 if rank == 0 else None,
                            secure_mode=False)
        outcome["seed given"] = "accepted"
    except ValueError as e:
        outcome["seed given"] = str(e)
    try:  # rank 1 would clip at 2C while rank 0's ledger records C
        dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=1.0 + rank, seed=3)
        outcome["clip"] = "accepted"
    except ValueError as e:
        outcome["clip"] = str(e)
    try:  # each rank derives the others' micro-batch counts from its own cap
        dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=1.0, seed=3, max_physical_batch_size=2 + rank)
        outcome["cap"] = "accepted"
    except ValueError as e:
        outcome["cap"] = str(e)
    p = dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=1.0, seed=3, zero_stage=2)
    from dpzero.utils.batch_memory_manager import BatchMemoryManager
    try:
        with BatchMemoryManager(data_loader=p.data_loader, max_physical_batch_size=2 + rank):
            outcome["manager"] = "accepted"
    except ValueError as e:
        outcome["manager"] = str(e)
    for x, y in p.data_loader:
        F.cross_entropy(p.model(x), y).backward()
        if rank == 1:  # a refusal on one rank only (e.g. a parameter escaped its layer)
            p.privacy_engine.book.error = "planted on rank 1"
        try:
            p.optimizer.step()
            outcome["step"] = "taken"
        except PrivacyViolation as e:
            outcome["step"] = str(e)
        break
    return outcome


@pytest.mark.multirank
def test_refusals_and_seed_mismatch_are_agreed_across_ranks(tmp_path):
    """No rank may update (or wait forever in a collective) when another refuses; a seed or a
    privacy setting that differs from rank 0's is refused on every rank."""
    outcomes = ranks.spawn(_agreement_rank_main, 2, tmp_path, timeout_s=60)
    for rank in range(2):
        got = outcomes[rank]
        assert "with the same settings" in got["seed"], got
        assert "with the same settings" in got["seed given"], got
        assert "with the same settings" in got["clip"], got
        assert "max_physical_batch_size" in got["cap"] or "settings differ" in got["cap"], got
        assert "max_physical_batch_size" in got["manager"] or "differ" in got["manager"], got
        assert got["step"].startswith("refusing the step"), got
    assert "planted on rank 1" in outcomes[1]["step"]
    assert "another rank refused it" in outcomes[0]["step"]
    assert "seed=101 on rank 1 differs from rank 0's" in outcomes[1]["seed"]
    assert "seed given=False on rank 1 differs from rank 0's" in outcomes[1]["seed given"]
    assert "another rank's privacy settings differ" in outcomes[0]["seed"]
    assert "max_grad_norm=2 on rank 1" in outcomes[1]["clip"]


def _steps(model_call, p, n=2):
    taken = 0
    while taken < n:
        for ids, y in p.data_loader:
            loss_fn(model_call(ids), y).backward()
            if p.optimizer.step():
                taken += 1
                if taken == n:
                    break
    return p.privacy_engine.parameters()


def test_torch_compile_of_the_private_model_gives_the_eager_update():
    """Note [compiled private models]: torch.compile(private model) runs it eagerly with every
    DP layer intact (a privacy review found a RecursionError); the same seeds give the same
    parameters as without compilation, bit for bit."""
    def run(compiled):
        torch.manual_seed(0)
        p = dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                                max_grad_norm=0.5, seed=3)
        return _steps(torch.compile(p.model) if compiled else p.model, p)

    eager, compiled = run(False), run(True)
    for name in eager:
        assert torch.equal(eager[name], compiled[name]), name


def test_a_compiled_model_or_compiled_caller_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"module '<model>' \(OptimizedModule\) is compiled"):
        dpzero.make_private(torch.compile(SeqNet()), dataset=seq_data(), batch_size=8,
                            noise_multiplier=1.0, max_grad_norm=0.5)
    inner = SeqNet()
    inner.head.compile()
    with pytest.raises(ValueError, match=r"module 'head' \(Linear\) is compiled"):
        dpzero.make_private(inner, dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=0.5)
    p = dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=0.5)
    step = torch.compile(lambda ids, y: loss_fn(p.model(ids), y))
    ids, y = next(iter(p.data_loader))
    with pytest.raises(Exception, match=r"a torch.compile'd function received the private "
                                        r"loader's tensors"):
        step(ids, y)


def test_batches_and_losses_save_and_load_as_plain_tensors(tmp_path):
    """A privacy review: torch.save(batch) or torch.save(loss) wrote the Examples subclass, which
    torch.load(weights_only=True) refuses."""
    p = dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=0.5)
    ids, y = next(iter(p.data_loader))
    loss = loss_fn(p.model(ids), y)
    assert f"{loss:.3f}" == f"{loss.item():.3f}"  # a review: formatting a loss raised TypeError
    torch.save({"batch": (ids, y), "loss": loss.detach(), "rows": ids[:2] + 1}, tmp_path / "b.pt")
    back = torch.load(tmp_path / "b.pt")  # weights_only=True, torch's default
    assert type(back["batch"][0]) is torch.Tensor and type(back["loss"]) is torch.Tensor
    assert torch.equal(back["batch"][0], ids.as_subclass(torch.Tensor))
    assert torch.equal(back["rows"], ids.as_subclass(torch.Tensor)[:2] + 1)
