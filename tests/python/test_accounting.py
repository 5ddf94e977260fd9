"""Accountants from Python against independent references: mpmath quadrature for log A_α, the
published values in tests/reference/accounting_cases.json through the Opacus-compatible API,
and the closed-form exact Gaussian (μ-GDP) for the PRV bounds."""

import math

import mpmath
import numpy as np
import pytest

import dpzero
from dpzero import accounting as acc


# ---- log A_α against mpmath quadrature (Mironov, Talwar, Zhang 2019, eq. for A_α) ---------------

def _log_integrand_f64(z, q, sigma, alpha):
    # log[ N(z; 0, σ²) · ((1-q) + q·exp((2z-1)/(2σ²)))^α ] in float64, only to find the peaks.
    mix = np.logaddexp(np.log1p(-q) if q < 1 else -np.inf, np.log(q) + (2 * z - 1) / (2 * sigma**2))
    return -(z**2) / (2 * sigma**2) + alpha * mix


def mpmath_log_a(q, sigma, alpha, dps=40):
    """log A_α = log ∫ μ0(z) (μ(z)/μ0(z))^α dz with μ0 = N(0, σ²), μ = (1-q)μ0 + q N(1, σ²)."""
    mpmath.mp.dps = dps
    q_, s_ = mpmath.mpf(q), mpmath.mpf(sigma)

    def integrand(z):
        ratio = (1 - q_) + q_ * mpmath.exp((2 * z - 1) / (2 * s_**2))
        return mpmath.npdf(z, 0, s_) * ratio ** mpmath.mpf(alpha)

    # Breakpoints around every local maximum of the integrand (the (1-q) mode near 0 and the
    # q mode near α), found on a fine float64 grid, so tanh-sinh sees each peak.
    grid = np.linspace(-60 * sigma - 2, alpha + 60 * sigma + 2, 200001)
    vals = _log_integrand_f64(grid, q, sigma, alpha)
    peaks = [grid[i] for i in range(1, len(grid) - 1) if vals[i] >= vals[i - 1] and vals[i] >= vals[i + 1]]
    points = {0.0, 0.5, 1.0}
    for c in peaks + [0.0, float(alpha)]:
        for k in (-60, -20, -8, -3, -1, 0, 1, 3, 8, 20, 60):
            points.add(c + k * sigma)
    pts = [-mpmath.inf] + [mpmath.mpf(p) for p in sorted(points)] + [mpmath.inf]
    return float(mpmath.log(mpmath.quad(integrand, pts)))


LOG_A_CASES = [
    # from the reference file's rdp_log_moment_check
    (1e-6, 1.0, 27), (1e-3, 1.0, 2), (0.01, 10.0, 20), (0.99, 0.1, 256), (0.01, 2.5, 1.5),
    # more fractional and integer orders
    (0.05, 1.1, 3.7), (0.2, 0.8, 12.5), (0.5, 2.0, 1.01), (0.04, 1.5, 3.9), (1.0, 1.3, 7.25),
]


@pytest.mark.parametrize("q,sigma,alpha", LOG_A_CASES)
def test_log_a_matches_mpmath_quadrature(q, sigma, alpha):
    expected = mpmath_log_a(q, sigma, alpha)
    got = acc.compute_log_a(q, sigma, alpha)
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-300)


def test_log_a_of_unsampled_mechanism_is_zero():
    assert acc.compute_log_a(0.0, 1.0, 5.0) == 0.0


@pytest.mark.parametrize("mechanism", ["rdp", "prv"])
def test_nothing_released_spends_nothing(mechanism):
    # Note [nothing released] (accounting/rdp.cpp): before a step, or after steps that sample
    # nothing (q = 0), both accountants say (0, 0), as Opacus's do; one real step costs ε > 0.
    accountant = acc.create_accountant(mechanism)
    assert accountant.get_epsilon(1e-5) == 0.0 and accountant.get_delta(1.0) == 0.0
    accountant.step(noise_multiplier=1.0, sample_rate=0.0, num_steps=100)
    assert accountant.get_epsilon(1e-5) == 0.0
    accountant.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=1)
    assert accountant.get_epsilon(1e-5) > 0.0
    assert dpzero.PrivacyEngine(accountant=mechanism).accountant.get_epsilon(1e-5) == 0.0


# ---- published reference values through the Opacus-compatible front end -------------------------

def _orders(spec):
    if spec == "opacus_default":
        return acc.opacus_default_orders()
    if spec == "tfp_default":
        return acc.tfp_default_orders()
    if spec == "integers 2..32":
        return [float(a) for a in range(2, 33)]
    return [float(a) for a in spec]


def test_opacus_default_grid_is_as_documented():
    assert acc.opacus_default_orders() == [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


def test_rdp_reference_epsilons(accounting_cases):
    for case in accounting_cases["rdp_epsilon"]:
        accountant = acc.RDPAccountant(orders=_orders(case["orders"]))
        for ph in case.get("phases", [case]):
            accountant.step(noise_multiplier=ph["sigma"], sample_rate=ph["q"], num_steps=ph["steps"])
        eps, best = accountant.get_privacy_spent(delta=case["delta"])
        assert eps == pytest.approx(case["epsilon"], abs=case["abs_tol"]), case["source"]
        assert best == pytest.approx(case["best_order"]), case["source"]


@pytest.mark.parametrize("kind", ["rdp_noise_multiplier", "prv_noise_multiplier"])
def test_reference_noise_multipliers(accounting_cases, kind):
    for case in accounting_cases[kind]:
        sigma = dpzero.get_noise_multiplier(
            target_epsilon=case["target_epsilon"], target_delta=case["delta"],
            sample_rate=case["q"], epochs=case.get("epochs"), steps=case.get("steps"),
            accountant=kind.split("_")[0])
        assert sigma == pytest.approx(case["sigma"], abs=case["abs_tol"]), case


def test_prv_reference_upper_bounds(accounting_cases):
    for case in accounting_cases["prv_epsilon_upper"]:
        accountant = acc.PRVAccountant()
        accountant.step(noise_multiplier=case["sigma"], sample_rate=case["q"], num_steps=case["steps"])
        assert accountant.get_epsilon(case["delta"]) == pytest.approx(
            case["epsilon"], abs=case["abs_tol"]), case


def _gdp_delta(eps, mu):
    # Exact δ(ε) of μ-GDP (Dong, Roth, Su 2019, Cor. 2.13).
    Phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731
    return Phi(-eps / mu + mu / 2) - math.exp(eps) * Phi(-eps / mu - mu / 2)


def test_prv_brackets_exact_gaussian(accounting_cases):
    for case in accounting_cases["gaussian_exact"]["cases"]:
        phases = case.get("phases", [case])
        prv = dpzero._C.accounting.PrvAccountant()
        for ph in phases:
            prv.step(1.0, ph["sigma"], ph["steps"])
        mu = math.sqrt(sum(ph["steps"] / ph["sigma"] ** 2 for ph in phases))
        for eps in case["eps"]:
            d = prv.delta(eps)
            exact = _gdp_delta(eps, mu)
            assert d.lower <= exact <= d.upper, (case, eps, d.lower, exact, d.upper)


# ---- properties and bad input -----------------------------------------------------------------

def test_epsilon_monotone_and_prv_below_rdp():
    def eps(q, sigma, steps):
        r = acc.RDPAccountant()
        r.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
        p = acc.PRVAccountant()
        p.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
        return r.get_epsilon(1e-5), p.epsilon_bounds(1e-5)

    base_rdp, base_prv = eps(0.01, 1.0, 1000)
    assert base_prv.lower <= base_prv.estimate <= base_prv.upper <= base_rdp
    assert eps(0.01, 1.0, 2000)[0] > base_rdp
    assert eps(0.02, 1.0, 1000)[0] > base_rdp
    assert eps(0.01, 1.5, 1000)[0] < base_rdp
    assert eps(0.01, 1.0, 2000)[1].upper > base_prv.upper


def test_rdp_delta_epsilon_round_trip():
    r = acc.RDPAccountant()
    r.step(noise_multiplier=1.1, sample_rate=0.01, num_steps=3000)
    eps = r.get_epsilon(1e-6)
    assert r.get_delta(eps) == pytest.approx(1e-6, rel=1e-6)


@pytest.mark.parametrize(
    "call,needle",
    [
        (lambda: acc.RDPAccountant().step(noise_multiplier=1.0, sample_rate=1.5), "1.5"),
        (lambda: acc.RDPAccountant().step(noise_multiplier=-2.0, sample_rate=0.1), "-2"),
        (lambda: acc.RDPAccountant().step(noise_multiplier=1.0, sample_rate=0.1, num_steps=-3), "-3"),
        (lambda: acc.RDPAccountant().get_epsilon(1.5), "1.5"),
        (lambda: acc.RDPAccountant(orders=[]), "order"),
        (lambda: acc.PRVAccountant().step(noise_multiplier=0.0, sample_rate=0.1), "0"),
        (lambda: dpzero.get_noise_multiplier(target_epsilon=-1.0, target_delta=1e-5,
                                             sample_rate=0.01, steps=100), "-1"),
    ],
)
def test_bad_input_names_the_value(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


def test_warns_when_best_order_on_grid_edge():
    # A tiny-ε run is best served by a large order: on the grid [2, 3] the best order is the edge.
    r = acc.RDPAccountant(orders=[2.0, 3.0])
    r.step(noise_multiplier=50.0, sample_rate=0.001, num_steps=10)
    with pytest.warns(RuntimeWarning, match="edge of the order grid"):
        r.get_epsilon(1e-5)
    wide = acc.RDPAccountant()
    wide.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=1000)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wide.get_epsilon(1e-5)  # best order inside Opacus's grid: no warning
