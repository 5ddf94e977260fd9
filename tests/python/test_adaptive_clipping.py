"""clipping="adaptive" (Note [adaptive clipping] in privacy/adaptive_clipping.h): the bound follows
a noisy quantile of the per-sample norms, Andrew et al. 2021.

References, each independent of dpzero's clipping code: per-example float64 gradients through
torch's autograd (private_reference.clipped_step_by_example and a per-example norm loop), the
geometric update written from the paper, Theorem 1's noise split written here, and the count's
draw from the pure-Python Philox and ChaCha20 of philox_reference.py.
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzero
from dpzero import PrivacyEngine
from philox_reference import normal2, secure_noise
from private_reference import clipped_step_by_example

CLIP_STREAM = int.from_bytes(b"clip", "big")
ADAPTIVE = dict(target_unclipped_quantile=0.5, clipbound_learning_rate=0.5, min_clipbound=0.01,
                max_clipbound=100.0)


def _data(n=24, d=6, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.linspace(0.2, 3.0, n).unsqueeze(1)
    return TensorDataset(x, torch.randint(0, classes, (n,), generator=g))


def _mlp():
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _one_layer():
    return nn.Linear(6, 3)


def _norms(model, inputs, targets):
    """Each example's whole-gradient norm in float64, one backward each."""
    ref = copy.deepcopy(model).double()
    out = []
    for i in range(len(inputs)):
        ref.zero_grad()
        F.cross_entropy(ref(inputs[i:i + 1].double()), targets[i:i + 1]).backward()
        out.append(math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ref.parameters()
                                 if p.grad is not None)))
    return out


RAMP = 0.05  # κ: an example's share falls from 1 to 0 over C(1 ± κ/2)


def _share(norm, c):
    """Note [adaptive clipping]'s unclipped share of an example of this norm, at bound c."""
    return min(1.0, max(0.0, (c - norm) / (RAMP * c) + 0.5))


def _next_bound(c, centred, expected, gamma, eta, lo, hi):
    """Andrew et al.'s geometric update from the centred count."""
    return min(max(c * math.exp(-eta * (centred / expected + 0.5 - gamma)), lo), hi)


def _steps(p, steps):
    """Yields, per logical step, (its inputs, its targets), the step taken."""
    xs, ys = [], []
    for x, y in p.data_loader:
        xs.append(x.as_subclass(torch.Tensor))
        ys.append(y.as_subclass(torch.Tensor))
        F.cross_entropy(p.model(x), y, reduction="sum").backward()
        if p.optimizer.step():
            p.optimizer.zero_grad()
            yield torch.cat(xs), torch.cat(ys)
            xs, ys = [], []
            steps -= 1
            if steps == 0:
                return


@pytest.mark.parametrize("make_model", [_mlp, _one_layer], ids=["mlp", "one_layer"])
@pytest.mark.parametrize("isolation", ["detect", "strict"])
def test_the_bound_and_the_steps_follow_the_reference(tmp_path, make_model, isolation):
    """σ = 0 and σ_b = 0: at every step the parameters are those of DP-SGD clipped at C_t, and
    C_{t+1} is the paper's update from the examples' unclipped shares at C_t."""
    torch.manual_seed(0)
    model = make_model()
    shadow = copy.deepcopy(model)
    data = _data()
    lr, c0 = 0.5, 1.0
    p = dpzero.make_private(model, dataset=data, batch_size=8, max_physical_batch_size=3,
                            noise_multiplier=0.0, allow_no_noise=True, max_grad_norm=c0,
                            clipping="adaptive", unclipped_num_std=0.0, lr=lr, seed=3,
                            isolation=isolation, ledger_path=str(tmp_path / "ledger.jsonl"),
                            loss_reduction="sum", **ADAPTIVE)
    engine = p.privacy_engine
    expected = 8.0
    bounds, moved = [c0], set()
    for inputs, targets in _steps(p, 4):
        c = bounds[-1]
        norms = _norms(shadow, inputs, targets)
        unclipped = sum(_share(n, c) for n in norms)
        moved.add(0 < unclipped < len(norms))
        want = clipped_step_by_example(shadow, inputs, targets, max_grad_norm=c, lr=lr,
                                       expected_batch=expected)
        got = engine.parameters()
        for name, value in want.items():
            torch.testing.assert_close(got[name].double(), value, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            for name, param in shadow.named_parameters():
                param.copy_(want[name])
        bounds.append(_next_bound(c, unclipped - 0.5 * len(norms), expected, 0.5, 0.5,
                                  0.01, 100.0))
        assert engine.max_grad_norm == pytest.approx(bounds[-1], rel=1e-7)
        bounds[-1] = engine.max_grad_norm  # the next step clips at dpzero's
        assert p.optimizer.max_grad_norm == engine.max_grad_norm
    assert True in moved  # some step had examples on both sides of C
    assert len(set(bounds)) == len(bounds)  # the bound moved at every step

    # The ledger records each step's C_t and the run's adaptive settings; ε reads σ alone.
    lines = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    header, records = lines[0], lines[1:]
    settings = header["settings"]["adaptive"]
    assert settings["unclipped_num_std"] == 0.0 and settings["min_clipbound"] == 0.01
    assert [r["max_grad_norm"] for r in records] == bounds[:-1]


def _released_count(p, n):
    """The centred count a σ = σ_b = 0 step released, read back from the bound it moved."""
    engine = p.privacy_engine
    c0 = engine.max_grad_norm
    next(_steps(p, 1))
    ratio = engine.max_grad_norm / c0
    assert 0.01 < engine.max_grad_norm < 100.0  # not clamped
    return (-math.log(ratio) / ADAPTIVE["clipbound_learning_rate"] - 0.5
            + ADAPTIVE["target_unclipped_quantile"]) * n


@pytest.mark.parametrize("extra", [0, 1], ids=["unclipped", "clipped"])
def test_one_example_moves_the_released_count_by_half(extra):
    """Adding one example moves the released count by exactly ½ (its centred bit), where the
    uncentred count Opacus noises moves by 1 or 0: the sensitivity Theorem 1 is applied with."""
    data = _data(n=16)
    scales = (0.01, 50.0)  # the added example's norm below or far above C
    x = torch.cat([data.tensors[0], scales[extra] * torch.ones(1, 6)])
    y = torch.cat([data.tensors[1], torch.tensor([1])])
    c = 3.0
    torch.manual_seed(0)
    norm = _norms(_mlp(), x[-1:], y[-1:])[0]
    assert _share(norm, c) == (0.0 if extra else 1.0)
    counts = []
    for dataset in (data, TensorDataset(x, y)):
        torch.manual_seed(0)
        p = dpzero.make_private(_mlp(), dataset=dataset, sample_rate=1.0, noise_multiplier=0.0,
                                allow_no_noise=True, max_grad_norm=c, clipping="adaptive",
                                unclipped_num_std=0.0, lr=0.1, seed=5, loss_reduction="sum",
                                **ADAPTIVE)
        counts.append(_released_count(p, len(dataset)))
    assert counts[1] - counts[0] == pytest.approx(0.5 if extra == 0 else -0.5, abs=1e-5)


def _zero_gradient_updates(clipping, seed, **kwargs):
    """(the first update, the bound after it) of a model whose loss has zero gradient: the
    update is the noise alone, and every example is unclipped (norm 0)."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    start = {n: t.detach().clone() for n, t in model.named_parameters()}
    data = TensorDataset(torch.randn(20, 64), torch.zeros(20, dtype=torch.long))
    p = dpzero.make_private(model, dataset=data, sample_rate=1.0, noise_multiplier=1.0,
                            max_grad_norm=1.0, clipping=clipping, lr=1.0, seed=seed,
                            loss_reduction="sum", **kwargs)
    for x, _ in p.data_loader:
        (p.model(x) * 0.0).sum().backward()
        if p.optimizer.step():
            break
    got = p.privacy_engine.parameters()
    return {n: got[n] - start[n] for n in start}, p


def test_the_gradient_takes_theorem_1s_share_of_the_noise():
    """σ = z = 1, σ_b = 2: the gradient's noise is σ_Δ·C with σ_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2), the
    same draws as flat clipping's noise σ·C at the same seed and charge index."""
    flat, _ = _zero_gradient_updates("flat", 11)
    adaptive, p = _zero_gradient_updates("adaptive", 11, unclipped_num_std=2.0, **ADAPTIVE)
    sigma_delta = 1.0 / math.sqrt(1.0 - 1.0 / 16.0)
    for name in flat:
        torch.testing.assert_close(adaptive[name], flat[name] * sigma_delta, rtol=1e-5,
                                   atol=1e-7)
    assert p.privacy_engine.epsilon(1e-5) == pytest.approx(
        _zero_gradient_updates("flat", 12)[1].privacy_engine.epsilon(1e-5), rel=1e-12)


@pytest.mark.parametrize("secure", [False, True], ids=["philox", "secure"])
def test_the_count_is_noised_by_its_own_draw(secure):
    """σ_b = 3: the released count is Σ(b_i − ½) + σ_b z with z the run's draw of the count's
    own stream at charge index 0, from the Philox seed or secure mode's key."""
    kwargs = dict(seed=None, secure_mode=True) if secure else dict(seed=21)
    _, p = _zero_gradient_updates("adaptive", unclipped_num_std=3.0, **kwargs, **ADAPTIVE)
    engine = p.privacy_engine
    if secure:
        key = engine.state_dict(include_secrets=True)["key"]
        z = float(secure_noise([k & 0xFFFFFFFF for k in key], 0, 0, 1, stream=CLIP_STREAM)[0])
    else:
        z = float(normal2(engine.noise_source.seed, 0, 0, stream=CLIP_STREAM)[0])
    n = 20  # every example, each unclipped (norm 0 <= C)
    want = _next_bound(1.0, n - 0.5 * n + 3.0 * z, n, 0.5, 0.5, 0.01, 100.0)
    assert engine.max_grad_norm == pytest.approx(want, rel=1e-6)
    assert engine.max_grad_norm != pytest.approx(
        _next_bound(1.0, n - 0.5 * n, n, 0.5, 0.5, 0.01, 100.0), rel=1e-3)


def _make(clipping="adaptive", **changes):
    kwargs = dict(dataset=_data(), batch_size=8, noise_multiplier=1.0, max_grad_norm=1.0,
                  clipping=clipping, seed=1, unclipped_num_std=2.0, loss_reduction="sum",
                  **ADAPTIVE)
    kwargs.update(changes)
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    torch.manual_seed(0)
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    return model, before, kwargs


@pytest.mark.parametrize("changes, message", [
    (dict(target_unclipped_quantile=1.5), "target_unclipped_quantile must be in [0, 1], got 1.5"),
    (dict(clipbound_learning_rate=0.0), "clipbound_learning_rate must be finite and > 0, got 0"),
    (dict(min_clipbound=2.0, max_grad_norm=3.0, max_clipbound=1.5),
     "max_clipbound must be finite and >= min_clipbound=2, got 1.5"),
    (dict(min_clipbound=-1.0), "min_clipbound must be finite and > 0, got -1"),
    (dict(max_grad_norm=500.0), "the initial max_grad_norm=500 must lie in [min_clipbound, "
                                "max_clipbound] = [0.01, 100]"),
    (dict(unclipped_num_std=0.5), "unclipped_num_std=0.5 must be above noise_multiplier / 2 = "
                                  "0.5"),
    (dict(unclipped_num_std=None), "clipping='adaptive' needs ['unclipped_num_std']"),
    (dict(min_clipbound=None, max_clipbound=None),
     "clipping='adaptive' needs ['min_clipbound', 'max_clipbound']"),
    (dict(bands=2), "clipping='adaptive' with bands=2"),
    (dict(clipping_groups=[["0"]]), "clipping_groups is for clipping='group', not 'adaptive'"),
    (dict(loss_reduction="mean"), "clipping='adaptive' with loss_reduction='mean': under a mean "
                                  "loss each example's gradient comes through the rounding of "
                                  "1/b"),
    (dict(noise_multiplier=3e38, unclipped_num_std=3e38, max_clipbound=1.0),
     "is not a finite standard deviation in float32"),
    (dict(clipping="flat"), "['clipbound_learning_rate', 'max_clipbound', 'min_clipbound', "
                            "'target_unclipped_quantile', 'unclipped_num_std'] are read by "
                            "clipping='adaptive' only"),
])
def test_bad_settings_are_refused_naming_the_value(changes, message):
    model, before, kwargs = _make(**changes)
    with pytest.raises(ValueError) as info:
        dpzero.make_private(model, **kwargs)
    assert message in str(info.value)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])
    assert not hasattr(model, "_dpzero_engine") or model._dpzero_engine is None


def test_a_checkpoint_carries_the_bound():
    """state_dict holds the next step's C; a new engine continues from it, and an engine of
    another clipping, or a bound outside [min_clipbound, max_clipbound], is refused."""
    model, _, kwargs = _make()
    p = dpzero.make_private(model, **kwargs)
    list(_steps(p, 2))
    state = p.privacy_engine.state_dict()
    assert state["clipbound"] == p.privacy_engine.max_grad_norm != 1.0
    assert state["max_grad_norm"] == 1.0

    model2, _, kwargs2 = _make()
    q = dpzero.make_private(model2, **kwargs2)
    q.privacy_engine.load_state_dict(state)
    assert q.privacy_engine.max_grad_norm == state["clipbound"]
    assert q.privacy_engine.book.thresholds == [state["clipbound"]]

    x, y = next(iter(q.data_loader))  # mid logical batch: refused, nothing changed
    F.cross_entropy(q.model(x), y, reduction="sum").backward()
    with pytest.raises(ValueError, match="an adaptive run's clip bound changes between steps"):
        q.privacy_engine.load_state_dict(dict(state, clipbound=2.0))
    assert q.privacy_engine.max_grad_norm == state["clipbound"]

    bad = dict(state, clipbound=1000.0)
    with pytest.raises(ValueError, match=r"the clip bound must lie in \[min_clipbound, "
                                         r"max_clipbound\] = \[0.01, 100\], got 1000"):
        q.privacy_engine.load_state_dict(bad)
    assert q.privacy_engine.max_grad_norm == state["clipbound"]

    model3, _, kwargs3 = _make(clipping="flat", target_unclipped_quantile=None,
                               clipbound_learning_rate=None, min_clipbound=None,
                               max_clipbound=None, unclipped_num_std=None)
    r = dpzero.make_private(model3, **kwargs3)
    with pytest.raises(ValueError, match="holds an adaptive clip bound, and this engine has "
                                         "clipping='flat'"):
        r.privacy_engine.load_state_dict(state)


def test_an_opacus_script_with_adaptive_clipping_runs_unchanged():
    """Opacus's AdaClipDPOptimizer settings by their names through PrivacyEngine.make_private: the
    optimizer's max_grad_norm moves, and ε is the flat run's at the same noise_multiplier."""
    torch.manual_seed(0)
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(_data(), batch_size=8)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
        max_grad_norm=1.0, clipping="adaptive", target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.2, max_clipbound=10.0, min_clipbound=0.1,
        unclipped_num_std=0.5 * 8 / 4, noise_generator=torch.Generator().manual_seed(7),
        loss_reduction="sum")
    criterion = nn.CrossEntropyLoss(reduction="sum")
    seen = [optimizer.max_grad_norm]
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
            seen.append(optimizer.max_grad_norm)
    assert len(set(seen)) > 1 and all(0.1 <= c <= 10.0 for c in seen)
    flat = dpzero.accounting.create_accountant("prv")
    flat.step(noise_multiplier=1.0, sample_rate=8 / 24, num_steps=engine.charges)
    assert engine.get_epsilon(1e-5) == pytest.approx(flat.get_epsilon(1e-5), rel=1e-9)
    assert np.isfinite(engine.get_epsilon(1e-5))


def _bounds(steps, **kwargs):
    """The bound before each of ``steps`` steps and after the last, σ = 1 and σ_b = 2."""
    torch.manual_seed(0)
    p = dpzero.make_private(_mlp(), dataset=_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=1.0, clipping="adaptive", unclipped_num_std=2.0, lr=0.5,
                            seed=9, loss_reduction="sum", **ADAPTIVE, **kwargs)
    out = [p.privacy_engine.max_grad_norm]
    for _ in _steps(p, steps):
        out.append(p.privacy_engine.max_grad_norm)
    return out


def _bounds_rank(rank, world_size, stage):
    return _bounds(3, zero_stage=stage)


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [0, 3])
def test_every_rank_counts_the_whole_batch(tmp_path, stage):
    """Two ranks each clip half of a batch: the count they release is the whole batch's, with one
    draw of its noise, so both follow the one-rank run's bounds exactly."""
    import ranks

    want = _bounds(3)
    assert len(set(want)) == len(want)
    for got in ranks.spawn(_bounds_rank, 2, tmp_path, stage):
        assert got == want


def test_the_report_says_how_the_bound_moved(tmp_path):
    """dpzero report, from the ledger alone: the adaptive settings, σ_Δ, and ε at σ."""
    from dpzero.train.report import write_report

    model, _, kwargs = _make(ledger_path=str(tmp_path / "ledger.jsonl"))
    p = dpzero.make_private(model, **kwargs)
    list(_steps(p, 2))
    del p
    data = write_report(str(tmp_path), delta=1e-5)
    text = (tmp_path / "report.md").read_text()
    sigma_delta = 1.0 / math.sqrt(1.0 - 1.0 / 16.0)
    assert (f"adaptive clipping: each step's bound C (in the ledger) moved towards the 0.5 "
            f"quantile of the per-example norms, within [0.01, 100], from a count released "
            f"with noise σ_b = 2; ε below counts both releases at σ (the gradient's own noise "
            f"was σ_Δ = {sigma_delta:.4g})") in text
    flat = dpzero.accounting.create_accountant("prv")
    flat.step(noise_multiplier=1.0, sample_rate=8 / 24, num_steps=2)
    prv = [r for r in data["epsilon"]["results"] if r["accountant"] == "prv"][0]
    assert prv["epsilon"] == pytest.approx(flat.get_epsilon(1e-5), rel=1e-6)


def test_a_ledger_continues_only_with_the_same_bound_rule(tmp_path):
    """The ledger's header says how the bound moved (the report reads it): a run with a fixed
    bound, or other adaptive settings, cannot continue an adaptive run's ledger; the same
    settings continue it."""
    import gc

    ledger = str(tmp_path / "ledger.jsonl")
    model, _, kwargs = _make(ledger_path=ledger)
    p = dpzero.make_private(model, **kwargs)
    list(_steps(p, 1))
    del p, model
    gc.collect()  # the ledger's writer lock goes with the engine
    flat = {k: None for k in ("target_unclipped_quantile", "clipbound_learning_rate",
                              "min_clipbound", "max_clipbound", "unclipped_num_std")}
    for changes, theirs in ((dict(clipping="flat", **flat), "a fixed clip bound"),
                            (dict(unclipped_num_std=3.0), "clipping='adaptive' with")):
        model, before, kwargs = _make(ledger_path=ledger, **changes)
        with pytest.raises(ValueError, match="is of a run with clipping='adaptive' with "
                                             rf".*\"unclipped_num_std\":2\.0.*, this run has "
                                             rf"{theirs}"):
            dpzero.make_private(model, **kwargs)
    model, _, kwargs = _make(ledger_path=ledger)
    p = dpzero.make_private(model, **kwargs)
    assert p.privacy_engine.charges == 1


class _Scale(nn.Module):
    """y = w·x: a module with no kernel of its own (the generic path)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.w


def _ones_linear():
    m = nn.Linear(1, 1, bias=False)
    nn.init.ones_(m.weight)
    return m


# name -> (model, the input at which an example's norm is C = 1, the norm of input x,
#          make_private's extras)
_AT_THE_BOUND = {
    "fused": (_ones_linear, 1.0, abs, {}),
    "group": (lambda: nn.Sequential(_ones_linear(), _ones_linear()), 1 / math.sqrt(2),
              lambda x: math.sqrt(2) * x, {}),
    "generic": (_Scale, 1.0, abs, {}),
    "strict": (_ones_linear, 1.0, abs, dict(isolation="strict")),
    "micro-batches": (_ones_linear, 1.0, abs, dict(max_physical_batch_size=41)),
}


@pytest.mark.parametrize("path", sorted(_AT_THE_BOUND))
def test_identical_examples_at_the_bound_move_the_count_by_half(path):
    """n and n + 1 identical examples whose norm lies within a few float32 ulps of C, through
    models whose per-example gradient is exact (1-wide): the added one moves the released count
    by its own centred share and nothing else, on every path."""
    make_model, centre, norm_of, extras = _AT_THE_BOUND[path]
    sizes = (81, 82) if path == "micro-batches" else (40, 41)  # the last micro-batch grows
    x = np.float32(centre)
    for _ in range(3):
        x = np.nextafter(x, np.float32(0))
    for _ in range(6):
        counts = []
        for n in sizes:
            torch.manual_seed(0)
            data = TensorDataset(torch.full((n, 1), float(x)), torch.zeros(n, dtype=torch.long))
            p = dpzero.make_private(make_model(), dataset=data, sample_rate=1.0,
                                    noise_multiplier=0.0, allow_no_noise=True, max_grad_norm=1.0,
                                    clipping="adaptive", unclipped_num_std=0.0, lr=1.0, seed=5,
                                    loss_reduction="sum", **ADAPTIVE, **extras)
            c0 = p.privacy_engine.max_grad_norm
            for (inputs, _) in p.data_loader:
                p.model(inputs).sum().backward()
                if p.optimizer.step():
                    break
            ratio = p.privacy_engine.max_grad_norm / c0
            counts.append((-math.log(ratio) / 0.5 - 0.5 + 0.5) * n)
        own = _share(norm_of(float(x)), 1.0) - 0.5
        assert counts[1] - counts[0] == pytest.approx(own, abs=1e-5), (float(x), counts)
        x = np.nextafter(x, np.float32(2))


def test_a_batch_dependent_gemm_moves_the_count_by_half():
    """torch's GEMM computes a row differently as the batch's row count changes (here 15 and
    16 rows of a frozen Linear(784, 128)), so identical examples' norms move together by a
    rounding when one is added: their shares move by that rounding / κ, and the released count
    by the added example's own centred share up to that, at every bound around their norm (a
    bit flipped all 15 at once)."""
    def model():
        torch.manual_seed(1)
        m = nn.Sequential(nn.Linear(784, 128), nn.Linear(128, 1))
        m[0].requires_grad_(False)
        return m

    x1 = torch.randn(1, 784, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        norm = math.sqrt(float(model()[0](x1).double().pow(2).sum()) + 1.0)
    for c in (norm, float(np.nextafter(np.float32(norm), np.float32(0))),
              norm / (1 + RAMP / 2), norm / (1 - RAMP / 2)):
        counts = []
        for n in (15, 16):
            data = TensorDataset(x1.repeat(n, 1), torch.zeros(n, dtype=torch.long))
            p = dpzero.make_private(model(), dataset=data, sample_rate=1.0, noise_multiplier=0.0,
                                    allow_no_noise=True, max_grad_norm=c, clipping="adaptive",
                                    unclipped_num_std=0.0, lr=1.0, seed=5, loss_reduction="sum",
                                    target_unclipped_quantile=0.5, clipbound_learning_rate=0.5,
                                    min_clipbound=1e-3, max_clipbound=1e3)
            for (inputs, _) in p.data_loader:
                p.model(inputs).sum().backward()
                if p.optimizer.step():
                    break
            ratio = p.privacy_engine.max_grad_norm / c
            counts.append(-math.log(ratio) / 0.5 * n)
        own = _share(norm, c) - 0.5
        assert counts[1] - counts[0] == pytest.approx(own, abs=1e-4), (c, counts)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and dpzero._C.with_cuda else [])


@pytest.mark.parametrize("device", DEVICES)
def test_a_rows_norm_is_the_same_in_every_batch(device):
    """dpzero's own norm kernels add no dependence on the batch: each kernel's certified norm of
    one row is the same to the bit whatever the other rows of its batch are, and however many
    (ghost and direct linear norms, a sequence, conv, layer norm, embedding). torch's GEMMs before
    them do depend on it, which Note [adaptive clipping]'s shares absorb."""
    ops = torch.ops.dpzero
    g = torch.Generator().manual_seed(0)

    def rows(*shape):
        return torch.randn(65, *shape, generator=g).to(device)

    A1, G1, A4, G4 = rows(48), rows(24), rows(4, 48), rows(4, 24)
    X, GX = rows(3, 8, 8), rows(5, 6, 6)
    L, GL = rows(4, 16), rows(4, 16)
    ids, GE = torch.randint(0, 30, (65, 4), generator=g).to(device), rows(4, 12)
    norms = {  # each of the rows `i` of its batch, in that order
        "linear": lambda i: ops.linear_sq_norms(A1[i], G1[i], True, 0),
        "linear-ghost": lambda i: ops.linear_sq_norms(A4[i], G4[i], True, 1),
        "linear-direct": lambda i: ops.linear_sq_norms(A4[i], G4[i], True, 2),
        "conv": lambda i: ops.conv_sq_norms(X[i], GX[i], [3, 3], [1, 1], [0, 0], [1, 1], 1,
                                            True, 0),
        "layer-norm": lambda i: ops.layer_norm_sq_norms(L[i], GL[i], 1e-5, False, True, 1),
        "embedding": lambda i: ops.embedding_sq_norms(ids[i], GE[i], 30, None, 0),
    }
    for name, of in norms.items():
        alone = of(torch.tensor([0]))[0]
        for k in (2, 3, 17, 64, 65):
            first = torch.arange(k)  # row 0 first, then k - 1 others
            assert torch.equal(of(first)[0], alone), (name, k)
            assert torch.equal(of(first.flip(0))[-1], alone), (name, k)  # row 0 last


def _divergent_rank(rank, world_size):
    """Rank 1 restores another bound than rank 0's before the first step."""
    from dpzero.private.errors import PrivacyViolation

    model, _, kwargs = _make()
    p = dpzero.make_private(model, **kwargs)
    if rank == 1:
        p.privacy_engine.load_state_dict(dict(p.privacy_engine.state_dict(), clipbound=2.0))
    try:
        next(_steps(p, 1))
    except PrivacyViolation as e:
        return str(e), p.privacy_engine.charges
    return None, p.privacy_engine.charges


@pytest.mark.multirank
def test_ranks_with_different_bounds_refuse_the_step(tmp_path):
    """A rank restored to another C would clip at it while rank 0's ledger records and the noise
    is drawn at its own: the step's agreement refuses it on every rank, nothing charged."""
    import ranks

    for rank, (error, charges) in enumerate(ranks.spawn(_divergent_rank, 2, tmp_path)):
        assert error is not None and "the ranks clip at different bounds (this rank " \
            f"max_grad_norm={2 if rank else 1})" in error, error
        assert charges == 0
