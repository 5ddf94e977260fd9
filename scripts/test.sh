#!/usr/bin/env bash
# scripts/test.sh — install everything (scripts/setup.sh), then run all tests: GoogleTest through
# ctest, then pytest. Exits non-zero if anything failed; the output ends with both summaries.
#   bash scripts/test.sh           every test (what CI runs)
#   bash scripts/test.sh --quick   the unit tier: ctest, and pytest without the tests marked
#                                  multirank, job or gpu (pyproject.toml lists the markers)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
select=()
case "${1:-}" in
  "") ;;
  --quick) select=(-m "not multirank and not job and not gpu") ;;
  *) echo "[test] unknown option '$1' (use --quick, or nothing for every test)"; exit 2 ;;
esac
bash scripts/setup.sh || { echo "[test] setup failed"; exit 1; }

jobs=${DPZERO_TEST_JOBS:-$(nproc)}
echo "[test] ctest (GoogleTest)"
ctest --test-dir build --output-on-failure -j "$jobs" 2>&1 | tee build/ctest.log
ctest_rc=${PIPESTATUS[0]}

# One pytest-xdist worker per core, one intra-op thread each (docs/architecture.md, "Workers and
# threads"; measured in experiments/results/build.md).
echo "[test] pytest ($jobs workers)"
OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/python -q -ra --durations=40 -n "$jobs" \
  --dist worksteal "${select[@]}" 2>&1 | tee build/pytest.log
pytest_rc=${PIPESTATUS[0]}

echo
echo "[test] summary"
grep -E "tests passed|tests failed" build/ctest.log | tail -1
tail -n 1 build/pytest.log
if [ "$ctest_rc" -ne 0 ] || [ "$pytest_rc" -ne 0 ]; then
  echo "[test] FAILED (ctest exit $ctest_rc, pytest exit $pytest_rc)"
  exit 1
fi
