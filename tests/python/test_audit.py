"""The one-run privacy audit (Note [one-run audit] in dpzero/audit.py).

References: the worked examples of Steinke, Nasr and Jagielski (2023), Appendix D; the binomial
tail and the theorem's δ term evaluated independently with mpmath; guess counts by hand. End to
end (experiments/audit.py): dpzero's DP-SGD with Dirac canaries stays below the accountant's ε,
and the audit catches a run whose noise is missing or ten times too small.
"""

import math
import os
import sys

import mpmath
import pytest
import torch

from dpzero.audit import one_run_audit, one_run_epsilon, one_run_p_value
from dpzero.train import datasets

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "experiments"))
import audit as audit_experiment  # noqa: E402


@pytest.mark.parametrize("m, r, v, delta, want", [
    (100, 100, 75, 0.0, 0.702), (100, 100, 75, 1e-4, 0.699), (1000, 100, 75, 1e-4, 0.673)])
def test_the_papers_worked_examples(m, r, v, delta, want):
    assert one_run_epsilon(m, r, v, delta, confidence=0.95) == pytest.approx(want, abs=1e-3)


def _mp_tail(r, p, v):
    return mpmath.fsum(mpmath.binomial(r, k) * p**k * (1 - p)**(r - k) for k in range(v, r + 1))


@pytest.mark.parametrize("eps, m, r, v, delta", [
    (0.8, 300, 200, 140, 0.0), (0.8, 300, 200, 140, 1e-5), (2.0, 5000, 300, 260, 1e-6),
    (0.1, 50, 40, 10, 1e-3)])
def test_p_value_matches_the_theorem_evaluated_with_mpmath(eps, m, r, v, delta):
    mpmath.mp.dps = 40
    p = mpmath.e**eps / (1 + mpmath.e**eps)
    f_v = _mp_tail(r, p, v)
    want = f_v
    if delta:
        alpha = max((_mp_tail(r, p, v - i) - f_v) / i for i in range(1, v + 1))
        want = min(1, f_v + 2 * m * delta * alpha)
    assert one_run_p_value(eps, m, r, v, delta) == pytest.approx(float(want), rel=1e-9,
                                                                 abs=1e-300)


def test_the_bound_is_where_the_p_value_reaches_beta():
    eps = one_run_epsilon(1000, 400, 300, 0.0, confidence=0.9)
    mpmath.mp.dps = 40
    at = lambda e: _mp_tail(400, mpmath.e**e / (1 + mpmath.e**e), 300)  # noqa: E731
    assert float(at(eps)) <= 0.1 < float(at(eps + 1e-5))
    assert one_run_epsilon(100, 100, 50, 0.0) == 0.0  # chance level certifies nothing


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"v \(correct guesses\) must be <= r \(guesses\), "
                                         r"got v=11, r=10"):
        one_run_epsilon(20, 10, 11, 0.0)
    with pytest.raises(ValueError, match=r"r \(guesses\) must be <= m \(canaries\)"):
        one_run_epsilon(5, 10, 3, 0.0)
    with pytest.raises(ValueError, match=r"confidence must be in \(0, 1\), got 1.0"):
        one_run_epsilon(20, 10, 5, 0.0, confidence=1.0)
    with pytest.raises(ValueError, match=r"delta must be in \[0, 1\), got -0.1"):
        one_run_p_value(0.5, 20, 10, 5, -0.1)
    with pytest.raises(ValueError, match=r"guesses \(6, 6\) do not fit 10 canaries"):
        one_run_audit(torch.arange(10.0), torch.ones(10, dtype=torch.bool), 0.0,
                      guesses=[(6, 6)])
    with pytest.raises(ValueError, match="scores has 3 canaries, included has 2"):
        one_run_audit(torch.zeros(3), torch.zeros(2, dtype=torch.bool), 0.0)


def test_guesses_are_counted_as_written_by_hand():
    # scores ranked: 9 (in), 8 (out), 7 (in), 6 (in) ... 1 (out), 0 (out)
    scores = torch.tensor([9.0, 8, 7, 6, 5, 4, 3, 2, 1, 0])
    included = torch.tensor([1, 0, 1, 1, 0, 1, 0, 1, 0, 0], dtype=torch.bool)
    res = one_run_audit(scores, included, 0.0, guesses=[(3, 2)])
    # top 3 guessed in: 2 right (9, 7); bottom 2 guessed out: both right (1, 0)
    assert (res.k_plus, res.k_minus, res.correct, res.included) == (3, 2, 4, 5)
    assert res.epsilon == one_run_epsilon(10, 5, 4, 0.0, 0.95)
    two = one_run_audit(scores, included, 0.0, guesses=[(3, 2), (1, 0)])
    assert two.epsilon == max(one_run_epsilon(10, 5, 4, 0.0, 0.975),
                              one_run_epsilon(10, 1, 1, 0.0, 0.975))  # Bonferroni


needs_fashion = pytest.mark.skipif(not os.path.isdir(datasets.FASHION_DIR),
                                   reason="Debian package dataset-fashion-mnist not installed")


@needs_fashion
@pytest.mark.filterwarnings("ignore:the best RDP order")  # σ = 0.2's ε (not used) is huge
def test_dp_sgd_stays_below_its_epsilon_and_missing_noise_is_caught():
    noised = audit_experiment.canary_run(2.0)
    claimed = noised.epsilon_rdp
    assert 2.0 < claimed < 3.0 and noised.epsilon_prv <= claimed
    # The audit has power (it certifies something) and stays below what the accountant says.
    assert 0.1 < noised.audit.epsilon <= noised.epsilon_prv
    assert noised.audit.included == noised.dataset_size - 1000
    for sigma in (0.0, 0.2):  # noise off, and noise ten times too small for the claimed ε
        leaky = audit_experiment.canary_run(sigma)
        assert leaky.audit.epsilon > claimed + 1.0, (sigma, leaky.audit)
    assert math.isinf(audit_experiment.canary_run(0.0, steps=2).epsilon_rdp)


@needs_fashion
@pytest.mark.filterwarnings("ignore:the best RDP order")
def test_banded_noise_stays_below_its_epsilon_and_too_little_noise_is_caught():
    """The same audit of banded correlated noise (4 bands, cyclic Poisson sampling): the final
    model's noise is a sum of correlated draws, and the ε charged is DP-SGD's at a quarter of the
    steps, so an error in either (the strategy's scale, the sampling, the equivalent step count)
    that left too little noise would show as ε̂ above ε. σ = 0 is refused with bands; noise
    twenty times smaller than a σ = 2 run's is caught against that run's claim."""
    noised = audit_experiment.canary_run(1.0, bands=4)
    assert noised.epsilon_prv <= noised.epsilon_rdp < 6.0
    assert 0.1 < noised.audit.epsilon <= noised.epsilon_prv
    claimed = audit_experiment.canary_run(2.0, bands=4).epsilon_rdp
    leaky = audit_experiment.canary_run(0.1, bands=4)
    assert leaky.audit.epsilon > claimed + 0.5, (claimed, leaky.audit)

