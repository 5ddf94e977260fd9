# experiments/gpu/env.sh — sourced by the scripts beside it, not run: strict mode, the repository
# root as the working directory, $out (the logs' folder: $OUT, default /tmp/dpzero-gpu, created),
# $py (the Python to use: $PYTHON, default python3) and unbuffered Python output.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${OUT:-/tmp/dpzero-gpu}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
