"""Empirical privacy auditing in one training run (Steinke, Nasr and Jagielski, "Privacy Auditing
with One (1) Training Run", NeurIPS 2023, arXiv:2305.08846).

Note [one-run audit]
~~~~~~~~~~~~~~~~~~~~
m canaries are each put into the training set independently with probability 1/2 (S_i = +1 in,
-1 out). After one run the auditor scores every canary (how much the trained model "remembers"
it) and guesses: T_i = +1 for the k+ highest scores, -1 for the k- lowest, 0 (abstain) for the
rest, r = k+ + k- guesses in all. Let W be the number of correct guesses. For an (ε, δ)-DP
mechanism, for every v (the paper's main theorem, general form; Corollary "ternary guesses"):

    P[W >= v] <= f(v) + 2 m δ · max_{1 <= i <= v} (f(v - i) - f(v)) / i,
    f(v) = P[Binomial(r, e^ε / (1 + e^ε)) >= v].

The right side, p(ε), is a p-value for "the run was ε-DP" given v observed correct guesses; it
grows with ε. The audit's lower bound at confidence 1 - β is ε̂ = sup{ε : p(ε) <= β}: every
ε < ε̂ is rejected at level β. (The max over i stops at v: beyond it f(v - i) = 1 and the ratio
only falls. This is the computation of the paper's Appendix D.) Several guess counts may be
tried on one run; ``one_run_audit`` then tests each at β / (number of counts), a Bonferroni
correction, so the reported maximum keeps confidence 1 - β.

A correct implementation of a mechanism that is (ε, δ)-DP yields ε̂ <= ε except with probability
β; an ε̂ above the accountant's ε is evidence of a privacy bug. The bound is loose by design
(m canaries can certify at most about ln(r / 3) with r guesses), so ε̂ well below ε is normal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["AuditResult", "one_run_audit", "one_run_epsilon", "one_run_p_value"]


def _binomial_tails(r: int, p: float) -> list:
    """tail[v] = P[Binomial(r, p) >= v] for v = 0..r+1, from log-space probabilities."""
    if p <= 0.0 or p >= 1.0:
        point = 0 if p <= 0.0 else r
        return [1.0 if v <= point else 0.0 for v in range(r + 2)]
    lp, lq = math.log(p), math.log1p(-p)
    lgr = math.lgamma(r + 1)
    pmf = [math.exp(lgr - math.lgamma(k + 1) - math.lgamma(r - k + 1) + k * lp + (r - k) * lq)
           for k in range(r + 1)]
    tail = [0.0] * (r + 2)
    for k in range(r, -1, -1):  # summed from the small end of the upper tail
        tail[k] = tail[k + 1] + pmf[k]
    return [min(1.0, t) for t in tail]


def _check_counts(m: int, r: int, v: int, delta: float) -> None:
    for name, value in (("m", m), ("r", r), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if not r <= m:
        raise ValueError(f"r (guesses) must be <= m (canaries), got r={r}, m={m}")
    if not v <= r:
        raise ValueError(f"v (correct guesses) must be <= r (guesses), got v={v}, r={r}")
    if not (0.0 <= delta < 1.0):
        raise ValueError(f"delta must be in [0, 1), got {delta!r}")


def one_run_p_value(epsilon: float, m: int, r: int, v: int, delta: float) -> float:
    """p(ε) of Note [one-run audit]: a bound on P[W >= v] for an (ε, δ)-DP mechanism, with m
    canaries, r guesses and v of them correct."""
    _check_counts(m, r, v, delta)
    if not (epsilon >= 0.0):
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    tail = _binomial_tails(r, 1.0 / (1.0 + math.exp(-epsilon)))
    base = tail[v]
    if delta == 0.0 or v == 0:
        return base
    alpha = max((tail[v - i] - base) / i for i in range(1, v + 1))
    return min(1.0, base + 2.0 * m * delta * alpha)


def one_run_epsilon(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """ε̂ = sup{ε : p(ε) <= β}, β = 1 - confidence (Note [one-run audit]); 0 when even ε = 0 is
    not rejected. Bisection to 1e-6 in ε."""
    _check_counts(m, r, v, delta)
    if not (0.0 < confidence < 1.0):
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    beta = 1.0 - confidence
    if one_run_p_value(0.0, m, r, v, delta) > beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while one_run_p_value(hi, m, r, v, delta) <= beta:
        lo, hi = hi, 2.0 * hi
        if hi > 1e3:  # v = r guesses all right with δ = 0 still has finite ε̂ (p(ε) -> 1)
            break
    while hi - lo > 1e-6:
        mid = 0.5 * (lo + hi)
        if one_run_p_value(mid, m, r, v, delta) <= beta:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class AuditResult:
    """The best lower bound over the guess counts tried, and the guesses that gave it."""
    epsilon: float          # ε̂ at the stated confidence (Bonferroni over the counts tried)
    confidence: float
    canaries: int           # m
    included: int           # canaries that were in the training set
    k_plus: int             # guesses "in" (highest scores)
    k_minus: int            # guesses "out" (lowest scores)
    correct: int            # v, of r = k_plus + k_minus


def one_run_audit(scores: torch.Tensor, included: torch.Tensor, delta: float,
                  confidence: float = 0.95,
                  guesses: Optional[Sequence[tuple]] = None) -> AuditResult:
    """ε̂ from one run's canary scores (Note [one-run audit]).

    scores: [m] float, higher = more likely in the training set.
    included: [m] bool, which canaries were (the coin flips S).
    guesses: (k+, k-) pairs to try; default (k, k) for k in m/20, m/10, m/5, 2m/5 (rounded).
    """
    scores = torch.as_tensor(scores, dtype=torch.float64).flatten()
    included = torch.as_tensor(included, dtype=torch.bool).flatten()
    m = scores.numel()
    if included.numel() != m:
        raise ValueError(f"scores has {m} canaries, included has {included.numel()}")
    if m == 0 or not torch.isfinite(scores).all():
        raise ValueError("scores must be a non-empty vector of finite numbers")
    if guesses is None:
        guesses = sorted({(max(1, round(m * f)), max(1, round(m * f)))
                          for f in (0.05, 0.1, 0.2, 0.4)})
    for kp, km in guesses:
        if kp < 0 or km < 0 or kp + km > m or kp + km == 0:
            raise ValueError(f"guesses ({kp}, {km}) do not fit {m} canaries")
    order = torch.argsort(scores, descending=True, stable=True)
    ranked = included[order]
    tried = len(guesses)
    level = 1.0 - (1.0 - confidence) / tried
    best = None
    for kp, km in guesses:
        v = int(ranked[:kp].sum()) + int((~ranked[m - km:]).sum()) if km else int(
            ranked[:kp].sum())
        eps = one_run_epsilon(m, kp + km, v, delta, level)
        if best is None or eps > best.epsilon:
            best = AuditResult(eps, confidence, m, int(included.sum()), kp, km, v)
    return best
