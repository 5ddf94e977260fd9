"""experiments/gpu/pytest_isolated.py — pytest that survives a crashing test (check.sh's pytest stage).

A test that kills its process (a segfault in a CUDA path) ends a plain pytest run there, and the
tests after it never run. This driver collects the test ids, runs them in one pytest process, and
when that process dies by a signal, records the test that was running as crashed and starts a new
process with the tests not yet run. The first crashed test (--diagnose N: the first N) is then
run once more alone, in a fresh process (does it crash without the tests before it?), under cuda-gdb where it is on the PATH (the
lent GPU machines have it, and no gdb), for the native backtrace.

    python experiments/gpu/pytest_isolated.py [-k EXPR] FILE...      (the summary is the last line)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
JOURNAL_ENV = "DPZERO_PYTEST_JOURNAL"


# ---- the plugin half (loaded into each pytest process with -p pytest_isolated) ------------------
# One line per event, written and flushed at once, so what a crashed process did survives it:
# "start ID" before a test runs, "OUTCOME ID" (passed, failed, skipped, error) when it is done.


def _journal(line: str) -> None:
    path = os.environ.get(JOURNAL_ENV)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def pytest_runtest_logstart(nodeid, location):
    _journal(f"start {nodeid}")


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        outcome = report.outcome if report.when == "call" or report.skipped else "error"
        _journal(f"{outcome} {report.nodeid}")


# ---- the driver half -----------------------------------------------------------------------------


def collect(files: list[str], expr: str | None) -> list[str]:
    args = PYTEST + ["--collect-only", "-q"] + (["-k", expr] if expr else []) + files
    listing = subprocess.run(args, capture_output=True, text=True)
    ids = [line for line in listing.stdout.splitlines() if "::" in line]
    # 5: no test selected, a valid answer; 0 with no id listed means the listing was not read
    if listing.returncode not in (0, 5) or (listing.returncode == 0 and not ids):
        sys.stdout.write(listing.stdout + listing.stderr)
        raise SystemExit(f"pytest_isolated: collection failed (rc={listing.returncode})")
    return ids


def run_until_crash(ids: list[str], outcomes: dict[str, str],
                    journal: str) -> tuple[int, str | None]:
    """Runs `ids` in one pytest process; fills `outcomes` from the journal. -> (return code, the
    id that was running when the process died by a signal, or None)."""
    open(journal, "w").close()
    env = dict(os.environ, **{JOURNAL_ENV: journal})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, env.get("PYTHONPATH")]))
    rc = subprocess.run(PYTEST + ["-p", "pytest_isolated", "-q", "-rfE"] + ids, env=env).returncode
    running = None
    with open(journal) as f:
        for line in f:
            kind, test_id = line.rstrip("\n").split(" ", 1)
            if kind == "start":
                running = test_id
            else:
                # a test's worst report wins (a failed teardown after a passed call is an error)
                if outcomes.get(test_id) in (None, "passed"):
                    outcomes[test_id] = kind
    died = rc < 0 or rc >= 128
    return rc, running if died else None


def diagnose(test_id: str, timeout_s: float) -> str:
    """Runs the crashed test alone in a fresh process (does it crash without the tests before
    it?), under cuda-gdb where there is one (then with the native backtrace of the crash)."""
    gdb = shutil.which("cuda-gdb")
    args = PYTEST + ["-q", test_id]
    if gdb:
        args = [gdb, "-q", "-batch", "-ex", "set pagination off", "-ex", "run", "-ex", "bt 40",
                "--args"] + PYTEST + ["-q", "-p", "no:faulthandler", test_id]
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"{'cuda-gdb' if gdb else 'pytest'} timed out after {timeout_s:.0f} s"
    text = r.stdout + r.stderr
    at = text.find("received signal")
    if gdb and at < 0:
        return f"no signal under cuda-gdb (rc={r.returncode}): it did not crash alone\n{text[-2000:]}"
    return text[max(0, at - 200):][-6000:] if at >= 0 else f"rc={r.returncode}\n{text[-4000:]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", dest="expr", help="pytest -k expression")
    parser.add_argument("--diagnose", type=int, default=1,
                        help="crashed tests run again alone (the first ones; they often share a cause)")
    parser.add_argument("--diagnose-s", type=float, default=60.0,
                        help="time for each crashed test's lone run (under cuda-gdb where there is one)")
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    ids = collect(args.files, args.expr)
    outcomes: dict[str, str] = {}
    crashed: list[str] = []
    journal = os.path.join(tempfile.mkdtemp(prefix="pytest-isolated-"), "journal")
    remaining = ids
    while remaining:
        rc, running = run_until_crash(remaining, outcomes, journal)
        if running is None:
            break
        print(f"pytest_isolated: {running} CRASHED (rc={rc}); going on with the tests after it",
              flush=True)
        outcomes[running] = "crashed"
        crashed.append(running)
        remaining = [i for i in remaining if i not in outcomes]
    for test_id in crashed[:args.diagnose]:
        print(f"\n---- {test_id} alone, in a fresh process:\n{diagnose(test_id, args.diagnose_s)}",
              flush=True)
    counts = {k: sum(v == k for v in outcomes.values())
              for k in ("passed", "failed", "error", "skipped", "crashed")}
    not_run = len(ids) - len(outcomes)
    summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    print(f"pytest_isolated: {len(ids)} tests: {summary}" + (f", {not_run} not run" if not_run else "")
          + (f"; crashed: {' '.join(crashed)}" if crashed else ""))
    bad = counts["failed"] + counts["error"] + counts["crashed"] + not_run
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
