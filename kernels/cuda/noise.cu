// kernels/cuda/noise.cu — CUDA implementations of dpzero::add_noise_ and dpzero::add_noise_runs_
// (schemas in kernels/ops.cpp): one kernel over a table of coordinate runs (Note [noise launches]
// in kernels/cuda/noise_runs.cuh); add_noise_ is the one-run table.
//
// Note [cuda noise draw]
// ~~~~~~~~~~~~~~~~~~~~~~
// The draw is the header code of privacy/noise.h and privacy/gaussian.h compiled for the device,
// so the Philox rounds, the integer-to-float steps (uniform_open01, the uint64 -> double of m and
// its + 0.5), the float angle 2π·u2, sqrt (IEEE, correctly rounded on both), the float rounding of
// the radius and the product r·cos are the same operations with the same bits as on the CPU. What
// differs from the CPU draw (kernels/cpu/noise.cpp; its AVX2 / AVX-512 lanes, Note [cpu noise
// lanes] in kernels/cpu/noise_simd.h):
//  * the fp64 log of box_muller_radius64 is CUDA's double `log` (within 1 ulp, CUDA C Programming
//    Guide, "Mathematical Functions"); the CPU lanes use SLEEF's u35 log (within 3.5 ulps), the
//    scalar fallback the C library's log;
//  * the float cosf / sinf are CUDA's (within 2 ulps; no --use_fast_math in this build, so they
//    are not the __cosf / __sinf intrinsics); the CPU lanes use SLEEF's u10 sincosf (within 1 ulp),
//    the scalar fallback the C library's;
//  * the update x + std·z is one fused multiply-add here (nvcc contracts it: --fmad=true is the
//    default), rounded once to float; the CPU rounds the product and the sum separately (the
//    scalar file is built for baseline x86-64, which has no FMA; the lane files with
//    -ffp-contract=off, kernels/CMakeLists.txt).
// So for z (std = 1, self = 0) the devices differ by at most ~6 float ulps of |z| (the radius may
// round to the neighbouring float, cos/sin by up to 3 ulps, the product and the update by one
// each), plus up to ~1e-7 absolutely at the smallest radii, where the log's few-ulp difference
// (~3·10^-14 absolute near 44) moves r = sqrt(2(64 ln 2 - log)) by ~3·10^-14 / r. That is below
// 1e-6 (1 + |z|); the tests compare the devices with 1e-5 (1 + |z|): rtol = atol = 1e-5 in
// tests/python/test_noise.py, and CudaNoise.DrawsAgreeWithTheCpuWithinTheDocumentedTolerance in
// tests/cpp/torch/noise_shard_test.cpp. For bfloat16 / float16 self the float result is rounded
// once more, to self's type, and can land one of its ulps apart where the float results straddle
// a rounding boundary. Within a device the draw is a pure function of (seed, step, j): shards,
// runs and the one-tensor call agree bit for bit (Note [noise ownership]).
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/cuda/noise_runs.cuh"
#include "kernels/noise_checks.h"
#include "privacy/noise.h"

namespace dpzero::kernels {
namespace {

// grid = (x, runs.count), block = kNoiseThreads. Block row y draws run y: one thread per Philox
// block of kNoiseLanes global coordinates, grid-stride over the run's blocks.
template <typename scalar_t>
__global__ void add_noise_runs_kernel(scalar_t* __restrict__ data,  // [numel of self]
                                      const __grid_constant__ NoiseRuns runs, uint64_t seed,
                                      uint32_t step, float stddev) {
  const int r = blockIdx.y;
  scalar_t* __restrict__ run = data + runs.local[r];  // [n]
  const int64_t n = runs.length[r], offset = runs.global[r];
  const int64_t first_block = offset / privacy::kNoiseLanes;
  const int64_t num_blocks = (offset + n - 1) / privacy::kNoiseLanes - first_block + 1;
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < num_blocks;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t block = first_block + b;
    float z[privacy::kNoiseLanes];
    privacy::normal2(seed, step, privacy::kNoiseStream, static_cast<uint64_t>(block), z);
#pragma unroll
    for (int lane = 0; lane < privacy::kNoiseLanes; ++lane) {
      const int64_t i = block * privacy::kNoiseLanes + lane - offset;
      if (i < 0 || i >= n) continue;
      run[i] = static_cast<scalar_t>(static_cast<float>(run[i]) + stddev * z[lane]);
    }
  }
}

// Checked runs [3 R] -> one launch per kNoiseRunsPerLaunch non-empty runs, on the current stream.
void launch_noise_runs(at::Tensor& self, c10::IntArrayRef runs, double stddev, int64_t seed,
                       int64_t step) {
  const c10::cuda::CUDAGuard guard(self.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, self.scalar_type(), "add_noise_runs_cuda_", [&] {
    scalar_t* data = self.data_ptr<scalar_t>();
    for_each_noise_run_batch(runs, [&](const NoiseRuns& table, int64_t max_length) {
      const dim3 grid = noise_grid(max_length / privacy::kNoiseLanes + 1, table.count);
      add_noise_runs_kernel<scalar_t><<<grid, kNoiseThreads, 0, stream>>>(
          data, table, static_cast<uint64_t>(seed), static_cast<uint32_t>(step),
          static_cast<float>(stddev));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

at::Tensor& add_noise_cuda_(at::Tensor& self, double stddev, int64_t seed, int64_t step,
                            int64_t offset) {
  check_add_noise_args("dpzero::add_noise_", self, stddev, step, offset);
  const int64_t run[3] = {0, self.numel(), offset};
  launch_noise_runs(self, run, stddev, seed, step);
  return self;
}

at::Tensor& add_noise_runs_cuda_(at::Tensor& self, double stddev, int64_t seed, int64_t step,
                                 c10::IntArrayRef runs) {
  constexpr const char* op = "dpzero::add_noise_runs_";
  check_add_noise_args(op, self, stddev, step, /*offset=*/0);
  check_noise_runs(op, self, runs);
  launch_noise_runs(self, runs, stddev, seed, step);
  return self;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CUDA, m) {
  m.impl("add_noise_", &add_noise_cuda_);
  m.impl("add_noise_runs_", &add_noise_runs_cuda_);
}

}  // namespace dpzero::kernels
