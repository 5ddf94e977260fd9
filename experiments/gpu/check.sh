#!/usr/bin/env bash
# experiments/gpu/check.sh — the one prepared script for a lent GPU machine (device tool's `run`).
# Builds dpzero with the CUDA kernels for the machine's architecture only, runs the CUDA twins of
# the tests and the GPU benchmarks, and writes logs under $OUT (default /tmp/dpzero-gpu).
# Needs a Python with the pinned torch importable (carry wheels as the device README describes).
#   Usage there:  bash experiments/gpu/check.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"  # set -uo pipefail, cd, $out, $py
$py -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())" \
  | tee "$out/env.txt" || exit 1
arch=$($py -c "import torch; p=torch.cuda.get_device_capability(); print(f'{p[0]}{p[1]}')")
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) DPZERO_CUDA=ON CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=$arch"
$py -m pip install -q --no-build-isolation --no-deps . 2>&1 | tail -20 | tee "$out/build.log"
$py -c "import dpzero; assert dpzero._C.with_cuda, 'CUDA kernels not built'" || exit 1
ctest --test-dir build --output-on-failure 2>&1 | tee "$out/ctest.log" | tail -5
$py -m pytest tests/python -q -ra 2>&1 | tee "$out/pytest.log" | tail -5
$py experiments/noise_bench.py --sizes 1e6,1e7,1e8 --out "$out/noise.md" 2>&1 | tail -8
$py experiments/kernel_bench.py --device cuda --full --out "$out/kernels.md" 2>&1 | tail -20
