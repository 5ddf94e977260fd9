"""Banded correlated noise through make_private (Note [banded steps] in src/dp/private_step.h, Note
[amplified banded accounting] in accounting/banded.h), each against an independent reference: the
noise a run adds against a dense float64 solve of C⁻¹z from DP-SGD's own draws, ε against DP-SGD
at ⌈n/b⌉ steps, W = 2 at ZeRO-3 against W = 1, a resumed run against the uninterrupted one, and the
sampling and settings the theorem does not cover refused."""

import gc
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpzero
import ranks
from dpzero import _C

N, D = 32, 5
SIGMA, C, LR = 1.3, 0.7, 1.0


def data(n=N):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, D, generator=g),
                                          torch.randint(0, 2, (n,), generator=g))


def net():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(D, 4), nn.Tanh(), nn.Linear(4, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # the updates below are then the parameters' differences, exactly
    return model


def flat(params: dict) -> torch.Tensor:
    return torch.cat([params[name].reshape(-1).double() for name in sorted(params)])


def updates(bands, taken, *, rate, stage=0, loss_scale=0.0, seed=11, **kw):
    """Each step's parameter update, for ``taken`` steps, of a run whose loss is ``loss_scale`` ×
    cross-entropy: with 0 the clipped sums are exact zeros and an update is the noise alone (SGD,
    lr 1). ``bands`` None: make_private's default."""
    if bands is not None:
        kw["bands"] = bands
    p = dpzero.make_private(net(), dataset=data(), sample_rate=rate, noise_multiplier=SIGMA,
                            max_grad_norm=C, lr=LR, seed=seed, zero_stage=stage, **kw)
    return steps_of(p, taken, loss_scale), p.privacy_engine


def steps_of(p, steps, loss_scale=1.0):
    """The updates of ``steps`` steps of ``p`` through its data loader."""
    before, out = flat(p.privacy_engine.parameters()), []
    while len(out) < steps:
        for x, y in p.data_loader:
            (loss_scale * F.cross_entropy(p.model(x), y)).backward()
            assert p.optimizer.step()
            p.optimizer.zero_grad()
            after = flat(p.privacy_engine.parameters())
            out.append(after - before)
            before = after
            if len(out) == steps:
                break
    return torch.stack(out)


def banded_sqrt(bands, n):
    """The strategy's n × n matrix, written out: c_k = binom(2k, k)/4^k on the first b
    diagonals (the coefficients of (1 − x)^(−1/2))."""
    return toeplitz([math.comb(2 * k, k) / 4.0 ** k for k in range(bands)], n)


def toeplitz(c, n):
    """The n × n lower-triangular Toeplitz matrix with c_k on its k-th diagonal (k < len(c))."""
    bands = len(c)
    m = torch.zeros(n, n, dtype=torch.float64)
    for t in range(n):
        for k in range(min(bands, t + 1)):
            m[t, t - k] = c[k]
    return m


def dp_sgd_draws(steps, rate, seed=11):
    """z_t of DP-SGD's rows 0..steps−1 (the draws a banded run's rows use, Note [correlated
    noise on shards]), read off a DP-SGD run's updates: update_t = −lr σC z_t / (qN)."""
    sgd, _ = updates(1, steps, rate=rate, seed=seed)
    return -sgd * (rate * N) / (LR * SIGMA * C)


def banded_want(z, strategy, bands, rate):
    """A banded run's updates, from the dense float64 strategy: −lr κσC (C⁻¹z)_t / (qN/b), κ the
    full band's column norm."""
    w = torch.linalg.solve_triangular(strategy, z, upper=False)
    kappa = strategy[:, 0].norm().item()
    return -LR * kappa * SIGMA * C * w / (rate * N / bands)


@pytest.mark.parametrize("bands", [2, 4])
def test_the_noise_is_the_strategy_inverse_of_dp_sgds_draws(bands):
    steps, rate = 9, 0.25
    z = dp_sgd_draws(steps, rate)
    banded, engine = updates(bands, steps, rate=rate)
    want = banded_want(z, banded_sqrt(bands, steps), bands, rate)
    torch.testing.assert_close(banded, want, rtol=1e-4, atol=1e-6)
    sgd = -z * (LR * SIGMA * C) / (rate * N)
    kappa = banded_sqrt(bands, steps)[:, 0].norm().item()
    assert not torch.allclose(banded, sgd * bands * kappa, rtol=1e-2)  # correlated, not scaled
    assert engine._step.rows == steps and engine._step.equivalent_steps == math.ceil(steps / bands)


@pytest.mark.parametrize("bands, length", [(3, dict(steps=9)), (4, dict(epochs=2.0))])
def test_the_optimized_strategy_is_fitted_to_the_run_and_its_noise_is_its_inverse(tmp_path, bands,
                                                                                  length):
    """Note [run strategy]: strategy='optimized' takes BandedToeplitz.optimized(b, rows) (checked
    against SciPy's minimiser in test_banded.py), rows the run's length (steps, or the private
    loader's epochs: b·int(1/q) rows each); the noise is that strategy's C⁻¹z, the ledger names
    it, and ε is the square root's (the accounting reads b alone)."""
    steps, rate = 9, 0.25
    rows = length.get("steps") or math.ceil(length["epochs"] * bands * int(1 / rate))
    fitted = _C.privacy.BandedToeplitz.optimized(bands, rows).coefficients
    assert fitted != _C.privacy.BandedToeplitz.sqrt_prefix_sum(bands).coefficients
    z = dp_sgd_draws(steps, rate)
    path = tmp_path / "o.jsonl"
    got, engine = updates(bands, steps, rate=rate, strategy="optimized", ledger_path=str(path),
                          **length)
    torch.testing.assert_close(got, banded_want(z, toeplitz(fitted, steps), bands, rate),
                               rtol=1e-4, atol=1e-6)
    settings = dpzero.accounting.Ledger.open_read_only(str(path)).settings
    assert settings["strategy"] == "optimized" and settings["strategy_rows"] == rows
    assert settings["strategy_coefficients"] == fitted
    _, sqrt = updates(bands, steps, rate=rate, ledger_path=str(tmp_path / "s.jsonl"))
    assert engine.get_epsilon(1e-5) == sqrt.get_epsilon(1e-5)
    assert json.loads((tmp_path / "s.jsonl").read_text().splitlines()[0])["settings"][
        "strategy_coefficients"] == [math.comb(2 * k, k) / 4.0 ** k for k in range(bands)]


def test_a_continued_ledger_gives_its_strategy_coefficients(tmp_path):
    """Note [run strategy]: a run continuing a ledger adds the noise of the coefficients the ledger
    holds (not a fit of its own), from the ledger's next row on: (C⁻¹z)_t for t after it."""
    ledger, held = str(tmp_path / "l.jsonl"), [1.0, 0.25, -0.125]
    log = dpzero.accounting.Ledger.create(ledger, run_id="l.jsonl", dataset_size=N, settings={
        "bands": 3, "strategy": "optimized", "strategy_rows": 40,
        "strategy_coefficients": held})
    log.append(first_step=0, last_step=2, q=0.25, sigma=SIGMA, max_grad_norm=C)
    log.close()
    got, engine = updates(3, 4, rate=0.25, strategy="optimized", steps=40, ledger_path=ledger)
    assert engine.next_step == 7  # rows 3..6
    want = banded_want(dp_sgd_draws(7, 0.25), toeplitz(held, 7), 3, 0.25)[3:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_a_resumed_optimized_run_continues_the_same_noise(tmp_path):
    ledger, length = str(tmp_path / "l.jsonl"), dict(strategy="optimized", steps=12)
    want, _ = updates(3, 6, rate=0.25, **length)
    first, engine = updates(3, 2, rate=0.25, ledger_path=ledger, **length)
    state = engine.state_dict()
    model_state = {k: v.clone() for k, v in engine.parameters().items()}
    del engine
    gc.collect()  # the engine's ledger lock goes with it
    model = net()
    model.load_state_dict(model_state)
    p = dpzero.make_private(model, dataset=data(), sample_rate=0.25, noise_multiplier=SIGMA,
                            max_grad_norm=C, lr=LR, seed=11, bands=3, ledger_path=ledger,
                            **length)
    p.privacy_engine.load_state_dict(state)
    rest = steps_of(p, 4, loss_scale=0.0)
    torch.testing.assert_close(torch.cat([first, rest]), want, rtol=1e-5, atol=1e-7)


def test_one_band_is_dp_sgd_step_for_step(tmp_path):
    one, _ = updates(1, 6, rate=0.25, loss_scale=1.0, ledger_path=str(tmp_path / "a.jsonl"),
                     run_id="r")
    default, _ = updates(None, 6, rate=0.25, loss_scale=1.0,
                         ledger_path=str(tmp_path / "b.jsonl"), run_id="r")
    assert torch.equal(one, default)
    assert (tmp_path / "a.jsonl").read_bytes().splitlines()[1:] == \
        (tmp_path / "b.jsonl").read_bytes().splitlines()[1:]
    a, b = (json.loads((tmp_path / f).read_text().splitlines()[0]) for f in ("a.jsonl", "b.jsonl"))
    assert "bands" not in a["settings"] and a["settings"] == b["settings"]


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
@pytest.mark.parametrize("bands,steps", [(3, 7), (4, 8), (5, 1)])
def test_epsilon_is_dp_sgd_at_one_step_in_b(tmp_path, accountant, bands, steps):
    path = tmp_path / "ledger.jsonl"
    rate = 0.2
    _, engine = updates(bands, steps, rate=rate, loss_scale=1.0, ledger_path=str(path),
                        accountant=accountant)
    # The theorem's equivalent, counted by hand: ⌈n/b⌉ Poisson-sampled Gaussians at (q, σ).
    reference = dpzero.accounting.create_accountant(accountant)
    reference.step(noise_multiplier=SIGMA, sample_rate=rate, num_steps=-(-steps // bands))
    want = reference.get_epsilon(1e-5)
    assert engine.get_epsilon(1e-5) == pytest.approx(want, rel=1e-12)
    ledger = dpzero.accounting.Ledger.open_read_only(str(path))
    assert ledger.settings["bands"] == bands and ledger.native.rows == steps
    assert ledger.epsilon(1e-5, accountant) == pytest.approx(want, rel=1e-12)
    # More epsilon than DP-SGD at one step in b can only come from more rows.
    fewer = dpzero.accounting.create_accountant(accountant)
    fewer.step(noise_multiplier=SIGMA, sample_rate=rate, num_steps=max(1, steps // bands))
    assert fewer.get_epsilon(1e-5) <= want


def test_a_ledger_counts_the_rows_it_spans_not_its_records(tmp_path):
    path = str(tmp_path / "l.jsonl")
    ledger = dpzero.accounting.Ledger.create(path, run_id="r", dataset_size=N,
                                             settings={"bands": 4})
    for t in (0, 1, 2, 9):  # rows 3..8 refused before their charge: 10 rows, ⌈10/4⌉ = 3
        ledger.append(first_step=t, q=0.2, sigma=SIGMA, max_grad_norm=C)
    phases = ledger.phases()
    assert [(ph.q, ph.sigma, ph.steps) for ph in phases] == [(0.2, SIGMA, 3)]
    assert _C.accounting.banded_equivalent_steps(10, 4) == 3
    ledger.append(first_step=10, q=0.3, sigma=SIGMA, max_grad_norm=C)
    with pytest.raises(dpzero.accounting.LedgerError, match="one sigma and q"):
        ledger.phases()


@pytest.mark.parametrize("bands", [0, 2.5, "4", True])
def test_a_ledger_with_a_bad_bands_setting_is_refused(tmp_path, bands):
    path = str(tmp_path / "l.jsonl")
    with pytest.raises(ValueError, match="bands must be an integer >= 1, got " +
                       json.dumps(bands).replace(".", r"\.")):
        dpzero.accounting.Ledger.create(path, run_id="r", dataset_size=N,
                                        settings={"bands": bands})


def _zero3_rank(rank, world_size, bands, steps, kw):
    got, _ = updates(bands, steps, rate=0.25, stage=3, units=["0", "2"], **kw)
    return got


@pytest.mark.multirank
@pytest.mark.parametrize("kw", [{}, dict(strategy="optimized", steps=6)])
def test_two_ranks_at_stage_3_add_the_noise_of_one_rank_bit_for_bit(tmp_path, kw):
    want, _ = updates(4, 6, rate=0.25, units=["0", "2"], **kw)
    got = ranks.spawn(_zero3_rank, 2, tmp_path, 4, 6, kw)
    for rank_updates in got:
        assert torch.equal(rank_updates, want)


def test_a_resumed_run_continues_the_same_noise(tmp_path):
    ledger = str(tmp_path / "l.jsonl")
    want, _ = updates(4, 7, rate=0.25, loss_scale=1.0)
    first, engine = updates(4, 3, rate=0.25, loss_scale=1.0, ledger_path=ledger)
    state = json.loads(json.dumps(engine.state_dict()))
    model_state = {k: v.clone() for k, v in engine.parameters().items()}
    assert state["rows"] == 3 and state["bands"] == 4
    del engine
    gc.collect()  # the engine's ledger lock goes with it
    # A fresh process's engine: the model's trained values, the engine's state, the ledger.
    model = net()
    model.load_state_dict(model_state)
    p = dpzero.make_private(model, dataset=data(), sample_rate=0.25, noise_multiplier=SIGMA,
                            max_grad_norm=C, lr=LR, seed=11, bands=4, ledger_path=ledger)
    p.privacy_engine.load_state_dict(state)
    assert p.privacy_engine.next_step == 3 and p.privacy_engine._step.equivalent_steps == 1
    rest = steps_of(p, 4)
    torch.testing.assert_close(torch.cat([first, rest]), want, rtol=1e-5, atol=1e-7)
    assert dpzero.accounting.Ledger.open_read_only(ledger).native.rows == 7


def test_a_continued_ledger_starts_after_its_last_row(tmp_path):
    ledger = str(tmp_path / "l.jsonl")
    log = dpzero.accounting.Ledger.create(ledger, run_id="l.jsonl", dataset_size=N,
                                          settings={"bands": 4})
    log.append(first_step=5, q=0.25, sigma=SIGMA, max_grad_norm=C)
    log.close()
    p = dpzero.make_private(net(), dataset=data(), sample_rate=0.25, noise_multiplier=SIGMA,
                            max_grad_norm=C, lr=LR, seed=11, bands=4, ledger_path=ledger)
    engine = p.privacy_engine
    assert engine.charges == 1 and engine.next_step == 6 and engine._step.equivalent_steps == 2
    x, y = next(iter(p.data_loader))
    F.cross_entropy(p.model(x), y).backward()
    assert p.optimizer.step() and engine.last_step["step"] == 6


def test_a_state_of_another_strategy_is_refused(tmp_path):
    """Note [run strategy]: a run resumed from its state_dict (no ledger pins the strategy) with
    another strategy or length would continue the same draws through another C⁻¹, which is no
    banded mechanism; refused, naming both."""
    _, sqrt = updates(3, 2, rate=0.25)
    _, fitted = updates(3, 2, rate=0.25, strategy="optimized", steps=12)
    for state, kw, message in [
            (sqrt.state_dict(), dict(strategy="optimized", steps=12),
             "its strategy is 'sqrt_prefix_sum', this engine's 'optimized'"),
            (fitted.state_dict(), dict(strategy="optimized", steps=20),
             "its strategy_rows is 12, this engine's 20"),
            (fitted.state_dict(), {}, "its strategy is 'optimized', this engine's "
             "'sqrt_prefix_sum'; strategy_rows is 12, this engine's 0")]:
        p = dpzero.make_private(net(), dataset=data(), sample_rate=0.25, noise_multiplier=SIGMA,
                                max_grad_norm=C, lr=LR, seed=11, bands=3, **kw)
        with pytest.raises(ValueError, match=message):
            p.privacy_engine.load_state_dict(json.loads(json.dumps(state)))
        assert p.privacy_engine.next_step == 0  # nothing changed
    # A state written before strategies were recorded is the square root's.
    old = sqrt.state_dict()
    for key in ("strategy", "strategy_rows", "strategy_coefficients"):
        del old[key]
    p = dpzero.make_private(net(), dataset=data(), sample_rate=0.25, noise_multiplier=SIGMA,
                            max_grad_norm=C, lr=LR, seed=11, bands=3)
    p.privacy_engine.load_state_dict(old)
    assert p.privacy_engine.next_step == 2


@pytest.mark.parametrize("settings, message", [
    ({"strategy": 5}, "has strategy 5; it must be a string"),
    ({"strategy": "optimized", "strategy_rows": 40.0}, "has strategy_rows 40.0; it must be an "
     "integer"),
    ({"strategy_coefficients": [1.0, 0.5, 0.3]}, r"has strategy_coefficients \[1.0,0.5,0.3\]; "
     "it must be 3 finite numbers, the first 1, the square root's"),
    ({"strategy": "optimized", "strategy_rows": 40, "strategy_coefficients": [1.0, 1e200, 0.0]},
     "whose column norm is finite"),
    ({"strategy": "optimized", "strategy_rows": 40, "strategy_coefficients": [1.0, True, 0.0]},
     r"\[1.0,true,0.0\]; it must be 3 finite numbers"),
])
def test_an_edited_ledger_strategy_is_refused_naming_it(tmp_path, settings, message):
    ledger = str(tmp_path / "l.jsonl")
    log = dpzero.accounting.Ledger.create(ledger, run_id="l.jsonl", dataset_size=N,
                                          settings={"bands": 3, **settings})
    log.append(first_step=0, q=0.25, sigma=SIGMA, max_grad_norm=C)
    log.close()
    length = dict(strategy="optimized", steps=40) if "strategy_rows" in settings else {}
    with pytest.raises(ValueError, match=message):
        dpzero.make_private(net(), dataset=data(), sample_rate=0.25, noise_multiplier=SIGMA,
                            max_grad_norm=C, lr=LR, seed=11, bands=3, ledger_path=ledger,
                            **length)


def test_own_batch_is_refused_by_a_banded_run():
    p = dpzero.make_private(net(), dataset=data(), sample_rate=0.25, noise_multiplier=SIGMA,
                            max_grad_norm=C, lr=LR, seed=11, bands=2)
    x, y = data()[:4]
    (x, y) = p.privacy_engine.own_batch((x, y), logical_batch_size=4)
    F.cross_entropy(p.model(x), y).backward()
    with pytest.raises(dpzero.PrivacyViolation, match="own_batch cannot drive it"):
        p.optimizer.step()
    assert p.privacy_engine.charges == 0


@pytest.mark.parametrize("kwargs,message", [
    (dict(bands=0), "bands must be >= 1, got 0"),
    (dict(bands=2.0), "bands must be an integer, got 2.0"),
    (dict(bands=5, batch_size=8), "batch_size=8 with bands=5"),
    (dict(bands=N + 1, sample_rate=0.5), f"bands={N + 1} splits the data"),
    (dict(bands=2, noise_multiplier=0.0, allow_no_noise=True), "use bands=1"),
    (dict(bands=2, strategy="optimized"), "needs strategy_rows >= 1 .make_private: epochs or "
     "steps., got 0"),
    (dict(bands=1, strategy="optimized", steps=10), "strategy='optimized' with bands=1"),
    (dict(bands=2, strategy="sqrt"), "strategy must be 'sqrt_prefix_sum' or 'optimized', got "
     "'sqrt'"),
    (dict(bands=2, strategy=None), "strategy must be 'sqrt_prefix_sum' or 'optimized', got None"),
    (dict(bands=2, strategy="optimized", epochs=1.0, steps=4), "at most one of epochs and steps"),
    (dict(bands=2, strategy="optimized", steps=0), "steps must be an integer >= 1, got 0"),
    (dict(bands=2, strategy="optimized", steps=True), "steps must be an integer >= 1, got True"),
    (dict(bands=2, strategy="optimized", steps=2**70), "steps must be an integer >= 1, got "
     f"{2**70}"),
    (dict(bands=2, strategy="optimized", epochs=-1.0), "epochs must be a finite number > 0, got "
     "-1.0"),
    (dict(bands=2, epochs=math.nan), "epochs must be a finite number > 0, got nan"),
    (dict(bands=2, strategy="optimized", epochs=True), "epochs must be a finite number > 0, got "
     "True"),
    (dict(bands=2, strategy="optimized", epochs="2"), "epochs must be a finite number > 0, got "
     "'2'"),
    (dict(bands=2, strategy="optimized", epochs=1e300), r"epochs=1e\+300 is \d+ steps"),
    (dict(bands=2, strategy="optimized", steps=10**10), "strategy_rows=10000000000 and bands=2: "
     r"the fit's work, rows × bands², is above 1e\+10"),
])
def test_settings_the_theorem_does_not_cover_are_refused(kwargs, message):
    args = dict(dataset=data(), noise_multiplier=SIGMA, max_grad_norm=C, lr=LR, seed=11)
    if "batch_size" not in kwargs:
        args["sample_rate"] = 0.25
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        dpzero.make_private(net(), **args)


def test_a_ledger_of_other_bands_is_refused(tmp_path):
    ledger = str(tmp_path / "l.jsonl")
    updates(1, 2, rate=0.25, loss_scale=1.0, ledger_path=ledger)
    gc.collect()  # the engine's ledger lock goes with it
    with pytest.raises(ValueError, match="bands=1, this run has bands=4"):
        dpzero.make_private(net(), dataset=data(), sample_rate=0.25, noise_multiplier=SIGMA,
                            max_grad_norm=C, lr=LR, seed=11, bands=4, ledger_path=ledger)


def test_the_budget_counts_equivalent_steps():
    rate = 0.25
    reference = dpzero.accounting.create_accountant("prv")
    reference.step(noise_multiplier=SIGMA, sample_rate=rate, num_steps=2)
    budget = reference.get_epsilon(1e-5) * 1.0001  # two equivalent steps, not three
    p = dpzero.make_private(net(), dataset=data(), sample_rate=rate, noise_multiplier=SIGMA,
                            max_grad_norm=C, lr=LR, seed=11, bands=3, epsilon_budget=budget,
                            budget_delta=1e-5)
    assert p.privacy_engine.max_steps == 2 and p.privacy_engine.remaining_steps == 6
    taken = 0
    with pytest.raises(dpzero.BudgetExhausted, match="so step 6 was not taken"):
        while True:
            for x, y in p.data_loader:
                F.cross_entropy(p.model(x), y).backward()
                p.optimizer.step()
                p.optimizer.zero_grad()
                taken += 1
    assert taken == 6 and p.privacy_engine.charges == 6


def test_a_loader_batch_is_refused_while_an_own_batch_batch_is_open():
    """A logical batch is all the sampler's or all the caller's: rows given through own_batch
    and left open must not be released under a step the ledger records as the sampler's (a
    privacy review injected an example the sampler never drew that way)."""
    p = dpzero.make_private(net(), dataset=data(), sample_rate=0.25, noise_multiplier=SIGMA,
                            max_grad_norm=C, lr=LR, seed=11)
    x, y = data()[:4]
    x, y = p.privacy_engine.own_batch((x, y), logical_batch_size=4)
    F.cross_entropy(p.model(x), y).backward()
    with pytest.raises(RuntimeError, match="while a logical batch of own_batch is open"):
        next(iter(p.data_loader))
    p.optimizer.zero_grad()
    x, y = next(iter(p.data_loader))  # the batch dropped, the loader goes on
    F.cross_entropy(p.model(x), y).backward()
    assert p.optimizer.step() and p.privacy_engine.last_step_diagnostics["sampling"] == "poisson"


@pytest.mark.parametrize("name", ["bands", "sample_rate", "dataset_size"])
def test_what_the_sampler_reads_cannot_be_changed_after_make_private(name):
    p = dpzero.make_private(net(), dataset=data(), sample_rate=0.25, noise_multiplier=SIGMA,
                            max_grad_norm=C, lr=LR, seed=11, bands=4)
    with pytest.raises(AttributeError):
        setattr(p.privacy_engine, name, 1)


@pytest.mark.parametrize("change", [dict(rows=2), dict(rows=9), dict(rows=None)])
def test_a_banded_state_with_inconsistent_rows_is_refused(change):
    _, engine = updates(4, 5, rate=0.25, loss_scale=1.0)
    state = json.loads(json.dumps(engine.state_dict()))
    assert (state["charges"], state["rows"], state["next_step"]) == (5, 5, 5)
    state.update(change)
    if change["rows"] is None:
        del state["rows"]
    p = dpzero.make_private(net(), dataset=data(), sample_rate=0.25, noise_multiplier=SIGMA,
                            max_grad_norm=C, lr=LR, seed=11, bands=4)
    with pytest.raises(ValueError, match="a banded state needs charges <= rows <= next_step"):
        p.privacy_engine.load_state_dict(state)
    assert p.privacy_engine.charges == 0 and p.privacy_engine.next_step == 0


@pytest.mark.parametrize("bands", [1, 2])
def test_a_second_iteration_of_the_loader_cannot_hand_a_micro_batch_out_twice(bands):
    """A privacy review fed micro-batch 0 of a step twice (two iterators of the loader) and
    skipped a micro-batch of the same size, so the rows clipped matched the batch and its
    examples counted twice under one charge: a micro-batch is handed out once per logical
    batch while the batch holds gradients."""
    p = dpzero.make_private(net(), dataset=data(64), sample_rate=0.5, noise_multiplier=SIGMA,
                            max_grad_norm=C, lr=LR, seed=11, bands=bands,
                            max_physical_batch_size=4)
    first = iter(p.data_loader)
    x, y = next(first)
    F.cross_entropy(p.model(x), y).backward()
    assert not p.optimizer.step()  # only accumulates
    with pytest.raises(RuntimeError, match="a second iteration of the loader inside a logical"):
        next(iter(p.data_loader))
    p.optimizer.zero_grad()  # mid logical batch (Opacus's loop): the batch is kept
    for x, y in first:  # the first iteration goes on to the step
        F.cross_entropy(p.model(x), y).backward()
        taken = p.optimizer.step()
        p.optimizer.zero_grad()
        if taken:
            break
    assert taken and p.privacy_engine.charges == 1
    x, y = next(iter(p.data_loader))  # nothing held: a new iteration starts at the next step
    F.cross_entropy(p.model(x), y).backward()


def test_the_sampler_position_cannot_be_moved_back():
    """A review set next_step back and had step 0's Poisson batch drawn and charged again: the
    position is read-only, and the step refuses a sampler's step it has charged."""
    _, engine = updates(1, 3, rate=0.25, loss_scale=1.0)
    with pytest.raises(AttributeError):
        engine.next_step = 0
    assert engine.next_step == 3 and engine._step.rows == 3
