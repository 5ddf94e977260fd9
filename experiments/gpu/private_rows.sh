#!/usr/bin/env bash
# experiments/gpu/private_rows.sh — the private-step targets on a lent GPU, in one call of the device
# tool's `run` (under its 10-minute limit): experiments/private_bench.py --device cuda on BERT-base
# (12 layers, width 768, vocabulary 30522, B = 32) and on two layers of GPT-2 large's width (1280,
# B = 16), T = 128:
# dpzero non-private and private (flat, layer-wise) against torch and Opacus 1.6's four modes, with
# the correctness check, paired per-round ratios and the CUDA allocator's peak memory.
# Builds dpzero and installs Opacus from the kit (.gpu-kit/, carried; experiments/gpu/pack.sh)
# unless check.sh already did on this machine; writes private.md and its CSVs under $OUT
# (default /tmp/dpzero-gpu).
#   Usage there:  bash experiments/gpu/private_rows.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"  # set -uo pipefail, cd, $out, $py
source "$(dirname "${BASH_SOURCE[0]}")/kit.sh"  # ensure_dpzero
ensure_dpzero || exit 1
threads=$(nproc)  # the float64 reference of the correctness check runs on the CPU
timeout 280 $py experiments/private_bench.py --device cuda --threads "$threads" --tag cuda-bert-base \
  --layers 12 --hidden 768 --heads 12 --intermediate 3072 --vocab 30522 --batch 32 --repeats 21 \
  --max-wait 0 \
  --out "$out/private.md" 2>&1 | tail -12 | tee "$out/private_rows.log"
timeout 280 $py experiments/private_bench.py --device cuda --threads "$threads" --tag cuda-w1280 \
  --layers 2 --hidden 1280 --heads 20 --intermediate 5120 --batch 16 --repeats 21 --max-wait 0 \
  --out "$out/private.md" 2>&1 | tail -12 | tee -a "$out/private_rows.log"
