"""Banded Toeplitz strategies (Note [banded strategies] in privacy/banded.h) against direct
matrix computations: the dense C built entry by entry, numpy's triangular solve and inverse, a
brute-force maximum over participation patterns, and mpmath's binomials."""

from __future__ import annotations

import itertools
import math

import mpmath
import numpy as np
import pytest

from dpzero import _C

BandedToeplitz = _C.privacy.BandedToeplitz


def dense(strategy, n: int) -> np.ndarray:
    """C as an n x n float64 matrix: C[t, t - k] = c_k for k < b."""
    c = strategy.coefficients
    m = np.zeros((n, n))
    for t in range(n):
        for k in range(min(len(c), t + 1)):
            m[t, t - k] = c[k]
    return m


def prefix_sums(n: int) -> np.ndarray:
    return np.tril(np.ones((n, n)))


def test_the_square_root_coefficients_are_the_binomial_series():
    c = BandedToeplitz.sqrt_prefix_sum(40).coefficients
    for k, ck in enumerate(c):
        assert ck == pytest.approx(float(mpmath.binomial(2 * k, k) / mpmath.mpf(4) ** k),
                                   rel=1e-14), k


@pytest.mark.parametrize("n", [1, 5, 12])
def test_the_full_band_square_root_squares_to_the_prefix_sums(n):
    c = dense(BandedToeplitz.sqrt_prefix_sum(n), n)
    np.testing.assert_allclose(c @ c, prefix_sums(n), atol=1e-13)


@pytest.mark.parametrize("strategy", [BandedToeplitz.identity(),
                                      BandedToeplitz.sqrt_prefix_sum(4),
                                      BandedToeplitz([2.0, -0.7, 0.3])],
                         ids=["identity", "sqrt-4", "signed"])
def test_the_recursion_is_the_inverse_applied_to_the_draws(strategy):
    """w = C^-1 z, step by step from the b - 1 previous w's, equals numpy's dense solve."""
    n = 17
    z = np.random.default_rng(0).standard_normal(n)
    w = []
    for t in range(n):
        w.append(strategy.next(float(z[t]), list(reversed(w))))
    np.testing.assert_allclose(w, np.linalg.solve(dense(strategy, n), z), rtol=1e-12, atol=1e-12)


def brute_force_sensitivity_squared(c: np.ndarray, separation: int, k: int) -> float:
    """max over participation patterns (at most k steps, any two >= separation apart) of
    ||sum of their columns||^2: the columns' supports are disjoint at separation >= b, so the
    direction of each example's clipped gradient does not matter and equal ones attain it."""
    n = c.shape[0]
    best = 0.0
    for size in range(1, k + 1):
        for steps in itertools.combinations(range(n), size):
            if all(b - a >= separation for a, b in zip(steps, steps[1:])):
                best = max(best, float(np.sum(c[:, list(steps)], axis=1) @
                                       np.sum(c[:, list(steps)], axis=1)))
    return best


@pytest.mark.parametrize("bands, separation, k", [(1, 1, 3), (3, 3, 2), (3, 4, 3), (4, 4, 9)])
def test_the_sensitivity_is_the_worst_participation_pattern(bands, separation, k):
    n = 11
    strategy = BandedToeplitz.sqrt_prefix_sum(bands)
    want = brute_force_sensitivity_squared(dense(strategy, n), separation, k)
    assert strategy.sensitivity_squared(n, separation, k) == pytest.approx(want, rel=1e-13)
    for i in range(n):
        assert strategy.column_norm(n, i) == pytest.approx(
            float(np.linalg.norm(dense(strategy, n)[:, i])), rel=1e-14)


def test_overlapping_participations_are_refused_naming_the_separation():
    with pytest.raises(ValueError, match="participations 2 steps apart overlap the 4 bands"):
        BandedToeplitz.sqrt_prefix_sum(4).sensitivity_squared(10, 2, 3)


@pytest.mark.parametrize("strategy", [BandedToeplitz.identity(),
                                      BandedToeplitz.sqrt_prefix_sum(3),
                                      BandedToeplitz.sqrt_prefix_sum(30),
                                      BandedToeplitz([1.5, 0.4, -0.2, 0.1])],
                         ids=["identity", "sqrt-3", "sqrt-30", "signed"])
def test_the_mean_squared_error_is_that_of_the_dense_factorization(strategy):
    n = 30
    b = prefix_sums(n) @ np.linalg.inv(dense(strategy, n))
    assert strategy.mean_squared_error(n) == pytest.approx(float(np.sum(b * b)) / n, rel=1e-11)


def test_dp_sgd_is_one_band_and_the_square_root_lowers_the_error():
    n = 64
    identity = BandedToeplitz.identity()
    assert identity.mean_squared_error(n) == pytest.approx((n + 1) / 2, rel=1e-15)
    assert identity.sensitivity_squared(n, 1, n) == n
    root = BandedToeplitz.sqrt_prefix_sum(n)
    # Single participation: the error each strategy pays at its own sensitivity.
    assert root.mean_squared_error(n) * root.sensitivity_squared(n, n, 1) < \
        0.5 * identity.mean_squared_error(n) * identity.sensitivity_squared(n, n, 1)


def dense_objective(x: np.ndarray, n: int) -> float:
    """Note [optimized banded strategies]'s f for c = (1, x): the largest column norm squared of
    the dense C times ||A C^-1||_F^2 / n, from dense matrices (inf where C^-1 overflows)."""
    c = dense(BandedToeplitz([1.0, *x]), n)
    with np.errstate(all="ignore"):
        b = prefix_sums(n) @ np.linalg.inv(c)
        value = float((c * c).sum(0).max() * np.sum(b * b) / n)
    return value if np.isfinite(value) else math.inf


@pytest.mark.parametrize("n, bands", [(40, 2), (64, 4), (64, 8), (100, 5)])
def test_the_optimized_strategy_is_scipys_minimum_of_the_dense_objective(n, bands):
    """From the square root's coefficients, SciPy's BFGS on the dense objective (its own
    finite-difference gradients) reaches no lower value than optimized(), whose value is the dense
    objective's at its coefficients and lies below the square root's."""
    from scipy.optimize import minimize

    root = np.array(BandedToeplitz.sqrt_prefix_sum(bands).coefficients[1:])
    best = BandedToeplitz.optimized(bands, n)
    assert best.bands == bands and best.coefficients[0] == 1.0
    ours = dense_objective(np.array(best.coefficients[1:]), n)
    assert ours == pytest.approx(best.column_norm(n, 0) ** 2 * best.mean_squared_error(n),
                                 rel=1e-10)
    assert ours < dense_objective(root, n)
    scipy_best = minimize(dense_objective, root, args=(n,), method="BFGS",
                          options={"gtol": 1e-9}).fun
    assert ours <= scipy_best * (1 + 1e-7)
    assert ours >= scipy_best * (1 - 1e-4)  # the same minimum, not another one


@pytest.mark.parametrize("n, bands", [(3000, 32), (10000, 64)])
def test_the_optimized_strategy_of_a_long_run_is_a_minimum_along_every_coefficient(n, bands):
    """Where dense matrices are too large for SciPy: f (through mean_squared_error, itself checked
    against the dense factorization above) rises when any one coefficient moves either way, so
    the fit (its gradient by reverse-mode differentiation) stopped at a minimum; and it is below
    the square root's."""
    best = np.array(BandedToeplitz.optimized(bands, n).coefficients)

    def f(c):
        return float(np.dot(c, c)) * BandedToeplitz(list(c)).mean_squared_error(n)

    at = f(best)
    assert at < f(np.array(BandedToeplitz.sqrt_prefix_sum(bands).coefficients))
    for j in range(1, bands):
        for h in (1e-4, -1e-4):
            moved = best.copy()
            moved[j] += h
            assert f(moved) > at, (j, h)


def test_the_optimized_strategy_of_one_band_is_dp_sgd_and_bad_sizes_are_refused():
    assert BandedToeplitz.optimized(1, 50).coefficients == [1.0]
    with pytest.raises(ValueError, match="bands must be >= 1, got 0"):
        BandedToeplitz.optimized(0, 50)
    with pytest.raises(ValueError, match="n must be >= 1, got -3"):
        BandedToeplitz.optimized(4, -3)
    # The fit's work grows as n·b²: refused beyond 1e10, before any memory is taken.
    with pytest.raises(ValueError, match=r"fitting 64 bands to n=10000000 steps is n·b² = "
                                         r"4\.096e\+10, above the 1e\+10"):
        BandedToeplitz.optimized(64, 10**7)


@pytest.mark.parametrize("coefficients, match", [
    ([], "must hold c_0 at least"), ([0.0, 1.0], "c_0 \\(the diagonal\\) must be > 0, got 0"),
    ([1.0, math.nan], "coefficient c_1 must be finite, got nan")])
def test_bad_coefficients_are_refused_naming_them(coefficients, match):
    with pytest.raises(ValueError, match=match):
        BandedToeplitz(coefficients)
    with pytest.raises(ValueError, match="bands must be >= 1, got 0"):
        BandedToeplitz.sqrt_prefix_sum(0)
