#!/usr/bin/env bash
# scripts/bench.sh — install everything (scripts/setup.sh) and the benchmarks' baselines
# (requirements-bench.txt: Opacus, SciPy), idempotently, then run a benchmark with the project
# venv's Python:
#   bash scripts/bench.sh experiments/private_bench.py --systems zero0,dp-flat
# With no arguments it only installs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
stamp=.venv/.dpzero-bench-requirements.sha256
want=$(sha256sum requirements-bench.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[bench] installing the benchmarks' baselines (requirements-bench.txt)"
  .venv/bin/python -m pip install -q -r requirements-bench.txt
  echo "$want" > "$stamp"
fi
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python "$@"
fi
