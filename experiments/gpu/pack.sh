#!/usr/bin/env bash
# experiments/gpu/pack.sh — run HERE (the development machine, Debian with apt and PyPI reachable).
# Fills the git-ignored folder .gpu-kit/ with everything a lent GPU machine lacks for building and
# benchmarking dpzero. That machine has Python 3.12 with
# torch 2.11 (cu130), nvcc 13.0, CMake, ninja, pybind11, numpy, SciPy, pytest and NCCL as the pip
# package nvidia-nccl-cu13, and no network. It lacks:
#   - Eigen, nlohmann-json, Boost.Random (headers and libboost_random), GoogleTest and the gloo
#     headers: Debian's .debs of this machine, unpacked to one prefix (prefix.tar.xz). Boost's
#     headers are cut down to the closure of what dpzero includes (g++ -M), not all of Boost;
#   - Opacus (a pure-Python wheel; its needs numpy, SciPy, torch and opt-einsum are there).
# The kit must stay <= 48 MiB (the device tool carries at most 64 MiB of ignored files).
# CMake finds the prefix through CMAKE_PREFIX_PATH alone (experiments/gpu/kit_build.sh); the normal
# build (scripts/setup.sh) is unchanged. Prints the kit's size.
#   Usage:  bash experiments/gpu/pack.sh        then: run(carry=[".gpu-kit"], bash experiments/gpu/check.sh)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
root=$PWD
kit=$root/.gpu-kit
limit_mib=48

# The Debian packages the kit replaces, with what dpzero's build takes from each. The -dev packages
# pull in others (libboost1.74-dev holds Boost's headers; libgmock-dev is named by GTest's CMake
# targets file, which refuses a missing file).
packages=(
  libeigen3-dev            # accounting/: Eigen3::Eigen
  nlohmann-json3-dev       # accounting/, src/checkpoint: nlohmann_json::nlohmann_json
  libboost1.74-dev         # Boost's headers and its CMake package (boost_headers, BoostConfig)
  libboost-random1.74-dev  # privacy/entropy.cpp: Boost::random (random_device)
  libboost-random1.74.0    # libboost_random.so.1.74.0, which dpzero._C loads
  libboost-system1.74-dev  # named by boost_random's CMake dependencies
  libboost-system1.74.0
  libgtest-dev             # GTest::gtest_main for the GoogleTest binaries
  libgmock-dev
  libgloo-dev              # gloo headers for torch's ProcessGroupGloo.hpp (src/comm)
)

log() { printf '[pack] %s\n' "$*"; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

rm -rf "$kit"
mkdir -p "$kit/wheels"
printf '%s\n' "${packages[@]}" > "$kit/packages.txt"

# ---- Debian packages, unpacked to one prefix --------------------------------------------------------
log "downloading ${#packages[@]} Debian packages"
(cd "$tmp" && apt-get -o APT::Sandbox::User=root download -q "${packages[@]}" >/dev/null) \
  || { apt-get update -q >/dev/null && (cd "$tmp" && apt-get -o APT::Sandbox::User=root download -q "${packages[@]}" >/dev/null); }
stage=$tmp/stage
for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$stage"; done
rm -rf "$stage/usr/share/doc" "$stage/usr/share/lintian" "$stage/usr/src"

# Boost: keep the headers dpzero's sources include, and those they include in turn.
headers=$tmp/boost-headers.txt
grep -rhoE '#include <boost/[^>]+>' privacy src kernels accounting python tests/cpp \
  | sort -u > "$tmp/boost-includes.h"
[ -s "$tmp/boost-includes.h" ] || { echo "pack.sh: dpzero includes no Boost header; drop Boost from the kit" >&2; exit 1; }
g++ -std=c++17 -M -I"$stage/usr/include" -x c++ "$tmp/boost-includes.h" -o - \
  | tr ' \\' '\n\n' | grep "^$stage/usr/include/boost/" | sort -u > "$headers"
mv "$stage/usr/include/boost" "$tmp/boost-all"
while read -r h; do
  rel=${h#"$stage/usr/include/boost/"}
  mkdir -p "$stage/usr/include/boost/$(dirname "$rel")"
  cp "$tmp/boost-all/$rel" "$stage/usr/include/boost/$rel"
done < "$headers"
log "Boost headers kept: $(wc -l < "$headers") of $(find "$tmp/boost-all" -type f | wc -l)"

tar -C "$stage" -cJf "$kit/prefix.tar.xz" usr

# ---- Opacus ------------------------------------------------------------------------------------------
opacus=$(grep -E '^opacus==' requirements-bench.txt)
log "downloading $opacus"
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: -d "$kit/wheels" "$opacus"

size_kib=$(du -sk "$kit" | cut -f1)
log "kit: $kit, $((size_kib / 1024)).$(( (size_kib % 1024) * 10 / 1024 )) MiB"
((size_kib <= limit_mib * 1024)) || { echo "pack.sh: the kit is over ${limit_mib} MiB" >&2; exit 1; }
