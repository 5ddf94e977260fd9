"""Pieces the benchmarks in experiments/ share: peak-RSS measurement through /proc, paired
per-round ratios of interleaved timings, the CSV and the marked section of a results markdown
file, and the version stamp of the engine under test."""

from __future__ import annotations

import csv
import datetime
import importlib.util
import os
import random
import re
import statistics
import subprocess
import time

import dpzero

HERE = os.path.dirname(os.path.abspath(__file__))


def require_baseline(name: str, tool: str) -> None:
    """Exits naming the one command that installs it unless the baseline ``name`` (a package of
    requirements-bench.txt, such as opacus) is importable; ``tool`` names the benchmark."""
    if importlib.util.find_spec(name) is None:
        raise SystemExit(f"{tool}: the baseline {name!r} is not installed; `scripts/bench.sh` "
                         f"installs every benchmark baseline (requirements-bench.txt) into .venv")


def proc_status_bytes(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss(tool: str) -> None:
    """Resets VmHWM to the current VmRSS (Linux >= 4.0); ``tool`` names the caller in the error."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        raise SystemExit(f"{tool}: cannot reset the peak RSS through /proc/self/clear_refs "
                         f"({e}); the rss measure needs it") from None


def paired_ratios(times: dict, a: str, b: str) -> tuple[float, float, float] | None:
    """(median, lower quartile, upper quartile) of times[a][k] / times[b][k] over the timed
    rounds k, or None when either system was not timed. In an interleaved benchmark every timed
    round appends one step of every system still in the run (a system that fails is dropped
    whole), so the lists are aligned round by round, and a ratio compares two steps run seconds
    apart: drifts of the machine's speed slower than a round cancel (experiments/private_bench.py's
    docstring, "Paired ratios")."""
    if a not in times or b not in times or not times[a]:
        return None
    if len(times[a]) != len(times[b]):
        raise RuntimeError(f"paired ratios need aligned rounds: {a} has {len(times[a])} timed "
                           f"steps, {b} {len(times[b])}")
    ratios = [x / y for x, y in zip(times[a], times[b])]
    if len(ratios) == 1:
        return ratios[0], ratios[0], ratios[0]
    q1, med, q3 = statistics.quantiles(ratios, n=4)
    return med, q1, q3


def interleaved_steps(built: dict, rounds: int, warmup: int, failures: dict,
                      verbose: bool = False) -> dict:
    """Times ``s.step()`` of every system in ``built`` (name -> object with ``step()``), one step
    of each per round, for ``warmup`` untimed and ``rounds`` timed rounds: name -> seconds per
    timed round. Each round runs the systems in an order of its own (shuffled, seeded by the
    round): in one fixed order a system always followed the same neighbour, and paid for what
    that one left in the caches and the allocator. A system whose step raises is dropped whole
    (so the lists stay aligned for ``paired_ratios``) and its error goes to ``failures``."""
    built = dict(built)
    times = {n: [] for n in built}
    for r in range(warmup + rounds):
        names = list(built)
        random.Random(r).shuffle(names)
        for name in names:
            s = built[name]
            t0 = time.perf_counter()
            try:
                s.step()
            except Exception as e:  # noqa: BLE001 - the table names the failure
                failures[name] = f"step failed: {type(e).__name__}: {str(e)[:160]}"
                if verbose:
                    print(f"  {name}: {failures[name]}", flush=True)
                del built[name], times[name]
                continue
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def median_seconds(fn, repeats: int, sync=lambda: None) -> float:
    """Median wall time of ``repeats`` calls of fn after one warm-up call; ``sync`` (e.g.
    torch.cuda.synchronize) runs after each call, inside its time."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def write_csv(path: str, rows: list[dict], fields: list[str]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def dpzero_version() -> str:
    """The git commit of this checkout (+ "-dirty") and when the installed extension was built:
    the engine under test is the installed one, which may lag or lead the checkout."""
    try:
        commit = subprocess.run(["git", "-C", HERE, "describe", "--always", "--dirty"],
                                capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown commit"
    built = datetime.datetime.fromtimestamp(os.path.getmtime(dpzero._C.__file__))
    return f"checkout {commit}, installed dpzero/_C built {built:%Y-%m-%d %H:%M}"


def write_marked_section(path: str, tag: str, title: str, section: str) -> None:
    """Replaces the part of ``path`` between <!-- TAG:begin --> and <!-- TAG:end --> with
    ``section`` (which carries the markers), keeping notes outside them; a new file starts with
    ``title``."""
    text = open(path).read() if os.path.exists(path) else title
    pattern = re.compile(rf"<!-- {tag}:begin -->.*?<!-- {tag}:end -->", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n")
