#!/usr/bin/env bash
# experiments/gpu/check.sh — the one prepared script for a lent GPU machine (the device tool's
# `run`), inside 8 minutes on its 16 cores. That machine comes bare (KINDS.md): the kit that
# experiments/gpu/pack.sh made here (.gpu-kit/) brings what it lacks. The measurements come first
# (where the step's time goes, then the rows the targets are stated in), the tests after them, as
# far as the budget allows (a rerun names the rest: CHECK_STAGES="errors ctest pytest"). In order,
# each stage with its own line in $OUT/status.txt (so a run cut off anywhere says how far it got):
#   env      the machine: GPU, Python, torch, nvcc, CMake, cores
#   unpack   the kit's Debian prefix and wheels
#   build    CMake + ninja on every core, CUDA on, sm_90 only (DPZERO_CUDA_ARCHS to change it);
#            the whole log in $OUT/build.log
#   profile  profile_step.py: a step's wall time against the GPU's busy time, launches and host
#            waits, the costliest operators (dpzero flat, Opacus ghost, plain torch)
#   private  one experiments/private_bench.py --device cuda configuration (dpzero, also with its
#            norms on a side stream, and Opacus);
#            CHECK_PRIVATE_ARGS is appended to its flags (a rerun: "--skip-check --repeats 5";
#            the step on the split tiles: "--ghost-split-from 2 --tag cuda-w768-split")
#   paper    one row set of experiments/run.py --grid gpu (non-DP, DP flat, Opacus hooks)
#   errors   error_paths.py: one of our ops' argument errors raised on the CPU and on the GPU, with
#            and without a number in the message, each in a fresh process (the first H200 run's
#            crashes); which libstdc++ the process maps and which libraries define
#            std::locale::classic(); each crash again with LC_ALL=C and with the toolchain's
#            libstdc++ preloaded, and the first one's backtrace under gdb
#   private-bf16  the private stage's configuration under --autocast bf16 (every system's forward and loss
#            under torch.autocast; the target: 1.3x the bf16 non-private step), no memory runs
#   ctest    every GoogleTest
#   pytest   the CUDA tests (the files that hold them, CUDA cases selected), through
#            pytest_isolated.py: a test that crashes its process is recorded, run again alone and
#            under cuda-gdb for a backtrace, and the tests after it still run
#   noise    experiments/noise_bench.py, 1e6..1e8 coordinates
#   fingerprint  experiments/fingerprint_bench.py: the state fingerprint's one launch against one
#            ATen read and a copy of the same tensor, 1e6..1e8 words
#   kernels  experiments/kernel_bench.py --device cuda at B = 32 (GB/s against the copy rate)
#   roofline experiments/roofline.py --device cuda: the norm kernels' TFLOP/s and GB/s against the
#            device's measured GEMM rates (fp64, TF32, bf16) and copy rate, beside batched-bmm
#            Grams and Opacus's per-layer einsums, T = 64..512
#   sanitize compute-sanitizer's racecheck and synccheck over the ghost and sample-product kernels' CUDA GoogleTests
#            (shared-memory races and barriers the tests' values might not show)
# CHECK_STAGES names the stages after build to run (default: all of them), for a rerun that
# skips what an earlier run already measured; env, unpack and build always run.
# $OUT gets at most 8 files: status.txt, build.log, run.log (tests and benchmarks), noise.md,
# private.md, kernels.md, paper.md and results.tar.gz (profile.md, roofline.md, fingerprint.md and
# every CSV the benchmarks wrote).
#   Here:   bash experiments/gpu/pack.sh
#   There:  run(command="bash experiments/gpu/check.sh", carry=[".gpu-kit"], timeout_s=540)
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"  # set -uo pipefail, cd, $out, $py
budget_s=${CHECK_BUDGET_S:-470}
source "$(dirname "${BASH_SOURCE[0]}")/kit.sh"  # stage, unpack_kit, build_dpzero, $kit, $site
: >"$status"
log=$out/run.log
results=$kitdir-results
rm -rf "$results" && mkdir -p "$results"
archs=${DPZERO_CUDA_ARCHS:-90}

collect() {
  for f in private paper; do [ -f "$results/$f.md" ] && cp "$results/$f.md" "$out/$f.md"; done
  local files
  files=$(cd "$results" && ls -- *.csv profile.md roofline.md fingerprint.md 2>/dev/null)
  [ -n "$files" ] && tar -C "$results" -czf "$out/results.tar.gz" $files
  printf '%s  done       %ss in all\n' "$(date +%T)" $((SECONDS - t_start)) | tee -a "$status"
}
stages=" ${CHECK_STAGES:-profile private paper errors private-bf16 ctest pytest noise fingerprint kernels roofline sanitize} "
want() { [[ $stages == *" $1 "* ]]; }

machine() {
  nvidia-smi -L
  $py -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__, "CUDA",
torch.version.cuda, torch.cuda.get_device_name())'
  nvcc --version | tail -1
  g++ --version | head -1  # nvcc's host compiler too
  cmake --version | head -1
  echo "$(nproc) cores"
}
export -f machine
stage env 30 machine >>"$status"  # stage's own lines go to $status already, and to stderr
stage unpack 60 unpack_kit >>"$log" 2>&1 || { collect; exit 1; }
stage build 330 build_dpzero build-gpu ON "$archs" 2>&1 | tee -a "$log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { collect; exit 1; }
ensure_dpzero  # dpzero (just built) and the reference values on PYTHONPATH / in the environment

want profile && stage profile 90 $py experiments/gpu/profile_step.py --systems dp-flat,opacus-ghost,torch \
  --out "$results/profile.md" >>"$log" 2>&1
want private && stage private 150 $py experiments/private_bench.py --device cuda --threads "$(nproc)" \
  --tag cuda-w768 --layers 4 --hidden 768 --heads 12 --intermediate 3072 --vocab 30522 --batch 32 \
  --repeats 11 --max-wait 0 --out "$results/private.md" \
  --systems torch,zero0,dp-flat,dp-layer,dp-flat-stream,opacus-hooks,opacus-ghost,opacus-ew,opacus-functorch \
  ${CHECK_PRIVATE_ARGS:-} >>"$log" 2>&1
# Opacus hooks, not ghost: ghost clipping refuses GPT-2's tied embedding
want paper && stage paper 90 bash -c "cd experiments && $py run.py --grid gpu --systems zero0,dp0-flat,opacus-hooks \
  --repeats 5 --out '$results' && mv '$results/grid-gpu.md' '$results/paper.md'" >>"$log" 2>&1
want errors && stage errors 180 $py experiments/gpu/error_paths.py >>"$status" 2>>"$log"
want private-bf16 && stage private-bf16 120 $py experiments/private_bench.py --device cuda \
  --threads "$(nproc)" --tag cuda-w768-bf16 --autocast bf16 --layers 4 --hidden 768 --heads 12 \
  --intermediate 3072 --vocab 30522 --batch 32 --repeats 11 --max-wait 0 --skip-memory \
  --systems torch,zero0,dp-flat,dp-layer,opacus-hooks,opacus-ghost --out "$results/private.md" \
  ${CHECK_PRIVATE_ARGS:-} >>"$log" 2>&1
if want ctest; then
  stage ctest 60 ctest --test-dir build-gpu --output-on-failure -j "$(nproc)" >>"$log" 2>&1
  grep -E "tests passed|tests failed" "$log" | tail -1 | tee -a "$status"
fi
if want pytest; then
  # A fixed cuBLAS workspace: equal bits on every stream (test_norm_schedule.py compares them).
  CUBLAS_WORKSPACE_CONFIG=:4096:8 stage pytest 150 $py experiments/gpu/pytest_isolated.py \
    -k "cuda or gpu or offload or sync" \
    tests/python/test_kernels.py tests/python/test_noise.py tests/python/test_sync_free.py \
    tests/python/test_zero.py tests/python/test_checkpointing.py tests/python/test_op_errors.py \
    tests/python/test_clipped_sum_rounding.py tests/python/test_norm_schedule.py \
    tests/python/test_generators.py >>"$log" 2>&1
  grep "^pytest_isolated: [0-9]* tests" "$log" | tail -1 | tee -a "$status"
fi
want noise && stage noise 40 $py experiments/noise_bench.py --sizes 1e6,1e7,1e8 --out "$out/noise.md" >>"$log" 2>&1
want fingerprint && stage fingerprint 30 $py experiments/fingerprint_bench.py --sizes 1e6,1e7,1e8 \
  --out "$results/fingerprint.md" >>"$log" 2>&1
want kernels && stage kernels 90 $py experiments/kernel_bench.py --device cuda --batches 32 --repeats 5 \
  --out "$out/kernels.md" >>"$log" 2>&1
want roofline && stage roofline 60 $py experiments/roofline.py --device cuda --out "$results/roofline.md" \
  >>"$log" 2>&1
if want sanitize; then
  for tool in racecheck synccheck; do
    stage "sanitize-$tool" 60 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      build-gpu/tests/cpp/torch/torch_tests --gtest_filter='GhostPaths.*Cuda*:SampleProducts.Cuda*' >>"$log" 2>&1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1 | tee -a "$status"
  done
fi
collect
