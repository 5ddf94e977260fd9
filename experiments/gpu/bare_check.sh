#!/usr/bin/env bash
# experiments/gpu/bare_check.sh — run HERE, as root, after pack.sh: proves that the kit alone
# builds dpzero, without a GPU. It makes a /usr without the Debian packages the kit
# replaces (.gpu-kit/packages.txt): a hard-linked copy of /usr from which every file those
# packages installed (dpkg -L) is removed. In a private mount namespace where that copy is /usr,
# it builds dpzero from the kit exactly as check.sh does (kit.sh), CPU-only, into build-bare/,
# then runs every GoogleTest and the pytest files that use what the kit brings (Eigen and the
# published values: accounting; Boost.Random: secure noise and entropy; nlohmann-json:
# checkpoints; gloo: process groups from C++), and with CUDA on, nccl.h only in torch's NCCL wheel,
# compiles the NCCL process group and every .cu file for sm_90. The real /usr is never touched, so other processes
# keep their headers. Writes status.txt, build.log and run.log under $OUT (default /tmp/dpzero-gpu).
#   Usage:  bash experiments/gpu/pack.sh && bash experiments/gpu/bare_check.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
[ "$(id -u)" -eq 0 ] || { echo "bare_check.sh: needs root (a mount namespace)" >&2; exit 1; }
[ -f .gpu-kit/packages.txt ] || { echo "bare_check.sh: no .gpu-kit/; run experiments/gpu/pack.sh first" >&2; exit 1; }
bare=${BARE_USR:-/tmp/dpzero-bare-usr}

echo "[bare] hard-linked copy of /usr at $bare"
rm -rf "$bare" && cp -al /usr "$bare"
removed=0
while read -r pkg; do
  dpkg-query -W "$pkg" >/dev/null 2>&1 || continue  # not installed here: nothing to remove
  while read -r path; do
    path=${path/#\/lib\//\/usr\/lib\/}  # merged /usr: /lib is /usr/lib
    [[ $path == /usr/* ]] || continue
    target=$bare${path#/usr}
    if [ -f "$target" ] || [ -L "$target" ]; then rm -f "$target" && removed=$((removed + 1)); fi
  done < <(dpkg -L "$pkg")
done < .gpu-kit/packages.txt
echo "[bare] removed $removed files of $(wc -l < .gpu-kit/packages.txt) packages"
# A GPU machine may have no NCCL in its CUDA toolkit, only torch's nvidia-nccl-cu13 wheel.
rm -rf "$bare"/local/cuda-*/targets/*/include/nccl*

export PYTHON=${PYTHON:-$PWD/.venv/bin/python} CCACHE_DISABLE=1 PATH=$PWD/.venv/bin:$PATH
unshare -m bash -c '
  set -uo pipefail
  mount --bind "$0" /usr || exit 1
  for h in eigen3/Eigen/Core nlohmann/json.hpp boost/random/random_device.hpp gtest/gtest.h gloo/context.h; do
    [ ! -e "/usr/include/$h" ] || { echo "[bare] /usr/include/$h is still there" >&2; exit 1; }
  done
  echo "[bare] /usr has no Eigen, nlohmann-json, Boost, GoogleTest or gloo headers"
  source experiments/gpu/env.sh
  budget_s=${BARE_BUDGET_S:-3600}
  source experiments/gpu/kit.sh
  : >"$status"
  stage unpack 60 unpack_kit || exit 1
  stage build 3000 build_dpzero build-bare OFF 90 || exit 1
  ensure_dpzero  # PYTHONPATH, DPZERO_REFERENCE_DIR, DPZERO_BUILD_DIR
  stage ctest 900 ctest --test-dir build-bare --output-on-failure -j 2 >>"$out/run.log" 2>&1
  ctest_rc=$?
  grep -E "tests passed|tests failed" "$out/run.log" | tail -1 | tee -a "$status"
  stage pytest 1800 $py -m pytest -q -ra -p no:cacheprovider tests/python/test_accounting.py \
    tests/python/test_noise.py tests/python/test_privacy.py \
    tests/python/test_checkpointing.py tests/python/test_cpp_api.py >>"$out/run.log" 2>&1
  pytest_rc=$?
  tail -1 "$out/run.log" | tee -a "$status"
  # The CUDA side of check.sh as far as it goes without a GPU: configure with CUDA on (sm_90) and
  # nccl.h from the pip wheel alone, then compile the NCCL process group and every .cu file.
  cuda_objects() {
    configure_dpzero build-bare-cuda ON 90 &&
      ninja -C build-bare-cuda -j 2 src/CMakeFiles/dpzero_engine.dir/comm/process_group.cpp.o \
        $(ninja -C build-bare-cuda -t targets all | grep -oE "^[^:]+\.cu\.o")
  }
  export -f cuda_objects
  stage cuda 1500 cuda_objects >>"$out/build.log" 2>&1
  cuda_rc=$?
  grep -E "dpzero: (nccl|CUDA)" "$out/build.log" | tail -2 | tee -a "$status"
  $py -c "import dpzero, os; assert os.path.dirname(dpzero.__file__) == \"$site/dpzero\", dpzero.__file__; print(\"[bare] dpzero imported from\", dpzero.__file__)" | tee -a "$status"
  exit $((ctest_rc || pytest_rc || cuda_rc))
' "$bare"
rc=$?
rm -rf "$bare"
exit $rc
