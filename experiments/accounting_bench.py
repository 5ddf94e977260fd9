"""Accountant benchmark: dpzero's RDP and PRV accountants and calibration, side by side with
Opacus's accountants on the same cases in the same run (when Opacus is installed).

Usage:  .venv/bin/python experiments/accounting_bench.py [--repeats 5] [--out experiments/results]

Writes accounting.md and accounting.csv: per case the median wall time of each implementation,
the ε each one returned, and the ratio opacus / dpzero (> 1 means dpzero is faster).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from typing import Callable, List, Optional

import dpzero
from dpzero import accounting as acc

try:  # Opacus is the baseline when present; the benchmark still runs without it.
    import opacus
    from opacus.accountants import PRVAccountant as OpacusPRV
    from opacus.accountants import RDPAccountant as OpacusRDP
    from opacus.accountants.utils import get_noise_multiplier as opacus_get_noise_multiplier
except ImportError:  # pragma: no cover - depends on the environment
    opacus = None

DELTA = 1e-5


def timed(fn: Callable[[], float], repeats: int):
    times, value = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), value


def dpzero_rdp(q, sigma, steps):
    a = acc.RDPAccountant()
    a.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return a.get_epsilon(DELTA)


def dpzero_prv(q, sigma, steps):
    a = acc.PRVAccountant()
    a.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return a.get_epsilon(DELTA)


def opacus_acc(cls, q, sigma, steps):
    a = cls()
    a.history = [(sigma, q, steps)]  # what `steps` calls of a.step() would leave behind
    return a.get_epsilon(DELTA)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)

    rows = []
    q, sigma = 0.001, 1.0
    for steps in (10**3, 10**4, 10**5, 10**6):
        for name, ours, theirs in (
            ("RDP ε", lambda: dpzero_rdp(q, sigma, steps),
             (lambda: opacus_acc(OpacusRDP, q, sigma, steps)) if opacus else None),
            ("PRV ε (upper)", lambda: dpzero_prv(q, sigma, steps),
             (lambda: opacus_acc(OpacusPRV, q, sigma, steps)) if opacus else None),
        ):
            rows.append(measure(f"{name}, q={q}, σ={sigma}, {steps:.0e} steps", ours, theirs,
                                args.repeats))
    q, sigma, steps = 0.04, 1.5, 2249
    rows.append(measure("PRV ε (upper), q=0.04, σ=1.5, 2249 steps",
                        lambda: dpzero_prv(q, sigma, steps),
                        (lambda: opacus_acc(OpacusPRV, q, sigma, steps)) if opacus else None,
                        args.repeats))
    for accountant in ("rdp", "prv"):
        rows.append(measure(
            f"calibrate σ for ε=8, q=0.04, 2000 steps ({accountant})",
            lambda: dpzero.get_noise_multiplier(target_epsilon=8, target_delta=DELTA,
                                                sample_rate=0.04, steps=2000,
                                                accountant=accountant),
            (lambda: opacus_get_noise_multiplier(target_epsilon=8, target_delta=DELTA,
                                                 sample_rate=0.04, steps=2000,
                                                 accountant=accountant)) if opacus else None,
            max(1, args.repeats // 2)))
    write(rows, args.out)


def measure(case, ours, theirs, repeats):
    t_ours, v_ours = timed(ours, repeats)
    row = {"case": case, "dpzero_ms": t_ours * 1e3, "dpzero_value": v_ours,
           "opacus_ms": None, "opacus_value": None, "ratio": None}
    if theirs is not None:
        t_theirs, v_theirs = timed(theirs, repeats)
        row.update(opacus_ms=t_theirs * 1e3, opacus_value=v_theirs, ratio=t_theirs / t_ours)
    print(fmt_row(row), flush=True)
    return row


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def fmt_row(r):
    return (f"| {r['case']} | {fmt(r['dpzero_ms'], '.3f')} | {fmt(r['dpzero_value'], '.4f')} | "
            f"{fmt(r['opacus_ms'], '.3f')} | {fmt(r['opacus_value'], '.4f')} | "
            f"{fmt(r['ratio'], '.1f')} |")


def write(rows, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "accounting.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(out_dir, "accounting.md"), "w") as f:
        f.write("# Accountant benchmark (median wall time, one run, same machine)\n\n")
        f.write(f"dpzero {dpzero.__version__}; Opacus {opacus.__version__ if opacus else 'absent'}; "
                f"δ = {DELTA:g}; PRV eps_error = 0.01, delta_error = δ/1000.\n\n")
        f.write("| case | dpzero ms | dpzero value | Opacus ms | Opacus value | Opacus/dpzero |\n")
        f.write("|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(fmt_row(r) + "\n")
    print(f"wrote {out_dir}/accounting.md and accounting.csv")


if __name__ == "__main__":
    main()
