"""Budget reports: ε of a planned or finished run under each accountant, as data and as a plot.

Used by ``dpzero budget`` and, later, by training reports; everything here reads only
(q, σ, steps, δ), so a report can be regenerated from a ledger alone.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

from . import _C
from .accounting import ACCOUNTANTS

_acc = _C.accounting


@dataclass
class AccountantResult:
    accountant: str
    epsilon: float                       # the value to quote: RDP's ε, PRV's upper bound
    lower: Optional[float] = None        # PRV only
    estimate: Optional[float] = None     # PRV only
    best_order: Optional[float] = None   # RDP only
    order_on_edge: Optional[bool] = None  # RDP only: widen the order grid if True
    error: Optional[str] = None          # set when the accountant could not answer


@dataclass
class BudgetReport:
    phases: List[Dict[str, float]]
    delta: float
    eps_error: float
    results: List[AccountantResult] = field(default_factory=list)

    def to_dict(self) -> Dict:
        return {
            "phases": self.phases,
            "delta": self.delta,
            "eps_error": self.eps_error,
            "results": [asdict(r) for r in self.results],
        }


def _phases(phases: Sequence[_acc.Phase]) -> List[Dict[str, float]]:
    return [{"q": p.q, "sigma": p.sigma, "steps": p.steps} for p in phases]


def evaluate(
    phases: Sequence[_acc.Phase],
    delta: float,
    accountants: Sequence[str] = ACCOUNTANTS,
    eps_error: float = 0.01,
    orders: Optional[Sequence[float]] = None,
) -> BudgetReport:
    """ε of the composition of ``phases`` under each accountant named in ``accountants``."""
    for name in accountants:
        if name not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {name!r}")
    report = BudgetReport(phases=_phases(phases), delta=delta, eps_error=eps_error)
    for name in accountants:
        if name == "rdp":
            acc = _acc.RdpAccountant(list(orders) if orders is not None else None)
            for p in phases:
                acc.add(p)
            r = acc.epsilon(delta)
            report.results.append(
                AccountantResult("rdp", r.epsilon, best_order=r.best_order,
                                 order_on_edge=r.order_on_edge))
        else:
            acc = _acc.PrvAccountant()
            for p in phases:
                acc.add(p)
            try:
                r = acc.epsilon(delta, eps_error)
            except RuntimeError as exc:  # the PRV method cannot meet the accuracy asked for
                report.results.append(AccountantResult("prv", math.nan, error=str(exc)))
                continue
            report.results.append(
                AccountantResult("prv", r.upper, lower=r.lower, estimate=r.estimate))
    return report


def epsilon_curve(
    q: float, sigma: float, steps: int, delta: float, accountants: Sequence[str] = ACCOUNTANTS,
    points: int = 24, eps_error: float = 0.01,
) -> Dict[str, List[float]]:
    """ε after t steps for t on a geometric grid up to ``steps`` (RDP, PRV lower/estimate/upper)."""
    grid = sorted({max(1, round(steps ** (k / (points - 1)))) for k in range(points)} | {steps})
    return curve_over(grid, lambda t: [_acc.Phase(q, sigma, t)], delta, accountants, eps_error)


def curve_over(grid: Sequence[int], phases_at, delta: float,
               accountants: Sequence[str] = ACCOUNTANTS,
               eps_error: float = 0.01) -> Dict[str, List[float]]:
    """ε of ``phases_at(t)`` (the phases of the first t steps) for each t in ``grid``: the curve
    of a planned run (``epsilon_curve``) or of a recorded ledger (training reports)."""
    curve: Dict[str, List[float]] = {"steps": [float(t) for t in grid]}
    for t in grid:
        rep = evaluate(phases_at(t), delta, accountants, eps_error)
        for r in rep.results:
            if r.accountant == "rdp":
                curve.setdefault("rdp", []).append(r.epsilon)
            else:
                curve.setdefault("prv_upper", []).append(r.epsilon)
                curve.setdefault("prv_estimate", []).append(
                    r.estimate if r.estimate is not None else math.nan)
                curve.setdefault("prv_lower", []).append(
                    r.lower if r.lower is not None else math.nan)
    return curve


def plot_epsilon_curve(curve: Dict[str, List[float]], title: str, path: str) -> None:
    """ε versus steps: RDP as a line, PRV as its estimate with the [lower, upper] band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    steps = curve["steps"]
    if "rdp" in curve:
        ax.plot(steps, curve["rdp"], label="RDP", color="tab:blue")
    if "prv_upper" in curve:
        ax.plot(steps, curve["prv_estimate"], label="PRV estimate", color="tab:orange")
        ax.fill_between(steps, curve["prv_lower"], curve["prv_upper"], color="tab:orange",
                        alpha=0.25, label="PRV [lower, upper]")
    ax.set_xscale("log")
    ax.set_xlabel("steps")
    ax.set_ylabel("ε")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
