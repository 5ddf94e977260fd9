#!/usr/bin/env bash
# experiments/gpu/paper_rows.sh — the key rows of the DP-ZeRO tables on a lent GPU, in one call of
# the device tool's `run` (well under its 10-minute limit): GPT-2 small on E2E-length sequences
# (T = 100, micro-batch 32) on one GPU, dpzero non-DP / DP flat / DP layer-wise in fp32 and bf16,
# and Opacus 1.6 (hooks, ghost), through experiments/run.py --grid gpu; then the paper table.
# Builds dpzero from the kit (.gpu-kit/, carried; experiments/gpu/pack.sh) unless check.sh already
# did on this machine, and writes
# the tables under $OUT (default /tmp/dpzero-gpu).
#   Usage there:  bash experiments/gpu/paper_rows.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"  # set -uo pipefail, cd, $out, $py
source "$(dirname "${BASH_SOURCE[0]}")/kit.sh"  # ensure_dpzero
ensure_dpzero || exit 1
cd experiments
timeout 480 $py run.py --grid gpu --repeats 10 --out "$out" 2>&1 | tail -30 | tee "$out/paper_rows.log"
$py run.py --paper --out "$out" | tee -a "$out/paper_rows.log"
