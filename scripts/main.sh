#!/usr/bin/env bash
# scripts/main.sh — install everything (scripts/setup.sh), then run dpzero's main job.
#
# Until private fine-tuning lands, the main job is the privacy-budget report a user runs before
# training: for DP-SGD on a 60,000-example dataset (Fashion-MNIST size) with batches of 256
# (q = 256/60000) over 30 epochs, the ε spent at σ = 1.0 under the RDP and PRV accountants, a plot
# of ε versus steps, and the σ that gives ε = 3 at δ = 1e-5.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
out=runs/budget
mkdir -p "$out"
q=$(python3 -c "print(256/60000)")
.venv/bin/dpzero budget --sample-rate "$q" --noise-multiplier 1.0 --epochs 30 --delta 1e-5 \
  --plot "$out/epsilon.png"
.venv/bin/dpzero budget --sample-rate "$q" --noise-multiplier 1.0 --epochs 30 --delta 1e-5 \
  --json > "$out/budget.json"
.venv/bin/dpzero calibrate --target-epsilon 3 --delta 1e-5 --sample-rate "$q" --epochs 30 \
  --accountant prv
.venv/bin/dpzero calibrate --target-epsilon 3 --delta 1e-5 --sample-rate "$q" --epochs 30 \
  --accountant rdp
echo "[main] report data: $out/budget.json, plot: $out/epsilon.png"
