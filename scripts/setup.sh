#!/usr/bin/env bash
# scripts/setup.sh — install everything dpzero needs, idempotently, then build and install dpzero
# into the project venv (.venv/). A second run only rebuilds what changed (ccache + build/).
#   1. Debian packages (apt-get; sudo only when not root), only those missing.
#   2. .venv/ with the pinned Python dependencies (requirements.txt), skipped when unchanged.
#   3. dpzero itself: `pip install .` drives CMake through scikit-build-core into build/, which
#      also holds the GoogleTest binaries that ctest runs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD

log() { printf '[setup] %s\n' "$*"; }

# ---- 1. Debian packages -------------------------------------------------------------------------
# Why each is here: docs/architecture.md "Dependencies".
apt_packages=(build-essential cmake ccache git pkg-config
  libeigen3-dev libboost-random-dev nlohmann-json3-dev libgtest-dev libgmock-dev libgloo-dev
  fortunes fortunes-min dataset-fashion-mnist iproute2)
python=${PYTHON:-python3}
# Debian's own python3 needs python3-venv for `python3 -m venv`; other Pythons ship ensurepip.
"$python" -c "import venv, ensurepip" 2>/dev/null || apt_packages+=(python3-venv)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  log "Debian packages present"
fi

# ---- 2. Python venv with pinned dependencies ------------------------------------------------------
if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $($python --version)"
  "$python" -m venv .venv
fi
stamp=.venv/.dpzero-requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing pinned Python dependencies (requirements.txt)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements.txt
  echo "$want" > "$stamp"
else
  log "Python dependencies up to date"
fi

# ---- 3. Build and install dpzero ------------------------------------------------------------------
export PATH="$root/.venv/bin:$PATH"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export DPZERO_BUILD_TESTS=${DPZERO_BUILD_TESTS:-ON}  # the GoogleTest binaries ctest runs
log "building dpzero (DPZERO_CUDA=${DPZERO_CUDA:-AUTO}, $CMAKE_BUILD_PARALLEL_LEVEL jobs)"
start=$(date +%s)
.venv/bin/python -m pip install -q --no-build-isolation --no-deps .
log "dpzero built and installed in $(( $(date +%s) - start )) s"
.venv/bin/python -c "import dpzero; print('[setup] dpzero', dpzero.__version__, 'CUDA kernels:', dpzero._C.with_cuda)"
