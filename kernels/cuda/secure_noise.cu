// kernels/cuda/secure_noise.cu — CUDA implementations of dpzero::add_secure_noise_ and
// dpzero::add_secure_noise_runs_ (schemas in kernels/ops.cpp; the draw is Note [secure noise] in
// privacy/secure_noise.h): one kernel over a table of coordinate runs (Note [noise launches] in
// kernels/cuda/noise_runs.cuh); add_secure_noise_ is the one-run table.
//
// Against the CPU draw (kernels/cpu/secure_noise.cpp), as Note [cuda noise draw] in
// kernels/cuda/noise.cu says for the Philox path: the ChaCha20 words and the uniforms are the same
// bits; the fp64 log is CUDA's (within 1 ulp; the CPU lanes: SLEEF's u10 log, within 1 ulp), cos
// and sin are CUDA's fp64 ones (within 2 ulps; SLEEF's u10 sincos, within 1 ulp), and nvcc may
// fuse multiply-adds that the CPU rounds twice (--fmad=true is the default): radius·cos +
// radius·sin in the sum of a Box–Muller pair (once inlined) and the update x + std·z. Each of the
// four summands is within a few fp64 ulps of the CPU's (~10^-15 relative), except at radii so
// small that the log's ulp (~7·10^-15 near 44) matters: r moves by ~1.4·10^-14 / r, by 10^-10
// only below r = 1.4·10^-4 (probability ~10^-8 per radius). The tests compare the devices with
// 1e-9 (1 + |z|) over 2^16 coordinates (2^17 radii): rtol = atol = 1e-9 in
// tests/python/test_noise.py, and CudaNoise.DrawsAgreeWithTheCpuWithinTheDocumentedTolerance in
// tests/cpp/torch/noise_shard_test.cpp, which also compares runs, shards and the one-tensor call
// within the device bit for bit.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/cuda/noise_runs.cuh"
#include "kernels/noise_checks.h"
#include "privacy/secure_noise.h"

namespace dpzero::kernels {
namespace {

// grid = (x, runs.count), block = kNoiseThreads. Block row y draws run y: one thread per ChaCha20
// block (a pair of global coordinates), grid-stride over the run's pairs.
template <typename scalar_t>
__global__ void add_secure_noise_runs_kernel(scalar_t* __restrict__ data,  // [numel of self]
                                             const __grid_constant__ NoiseRuns runs,
                                             privacy::ChaCha20Key key, uint32_t step,
                                             double stddev) {
  const int r = blockIdx.y;
  scalar_t* __restrict__ run = data + runs.local[r];  // [n]
  const int64_t n = runs.length[r], offset = runs.global[r];
  const int64_t first_pair = offset / 2;
  const int64_t num_pairs = (offset + n - 1) / 2 - first_pair + 1;
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < num_pairs;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t pair = first_pair + p;
    double z[2];
    privacy::secure_normal2(key, step, static_cast<uint64_t>(pair), z);
#pragma unroll
    for (int lane = 0; lane < 2; ++lane) {
      const int64_t i = pair * 2 + lane - offset;
      if (i < 0 || i >= n) continue;
      run[i] = static_cast<scalar_t>(static_cast<double>(run[i]) + stddev * z[lane]);
    }
  }
}

// Checked runs [3 R] -> one launch per kNoiseRunsPerLaunch non-empty runs, on the current stream.
void launch_secure_noise_runs(at::Tensor& self, c10::IntArrayRef runs, double stddev,
                              const privacy::ChaCha20Key& key, int64_t step) {
  const c10::cuda::CUDAGuard guard(self.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, self.scalar_type(), "add_secure_noise_runs_cuda_", [&] {
    scalar_t* data = self.data_ptr<scalar_t>();
    for_each_noise_run_batch(runs, [&](const NoiseRuns& table, int64_t max_length) {
      const dim3 grid = noise_grid(max_length / 2 + 1, table.count);
      add_secure_noise_runs_kernel<scalar_t><<<grid, kNoiseThreads, 0, stream>>>(
          data, table, key, static_cast<uint32_t>(step), stddev);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

at::Tensor& add_secure_noise_cuda_(at::Tensor& self, double stddev, c10::IntArrayRef key,
                                   int64_t step, int64_t offset) {
  check_add_noise_args("dpzero::add_secure_noise_", self, stddev, step, offset,
                       /*allow_double=*/true);
  const privacy::ChaCha20Key k = secure_key_from(key);
  const int64_t run[3] = {0, self.numel(), offset};
  launch_secure_noise_runs(self, run, stddev, k, step);
  return self;
}

at::Tensor& add_secure_noise_runs_cuda_(at::Tensor& self, double stddev, c10::IntArrayRef key,
                                        int64_t step, c10::IntArrayRef runs) {
  constexpr const char* op = "dpzero::add_secure_noise_runs_";
  check_add_noise_args(op, self, stddev, step, /*offset=*/0, /*allow_double=*/true);
  const privacy::ChaCha20Key k = secure_key_from(key, op);
  check_noise_runs(op, self, runs);
  launch_secure_noise_runs(self, runs, stddev, k, step);
  return self;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CUDA, m) {
  m.impl("add_secure_noise_", &add_secure_noise_cuda_);
  m.impl("add_secure_noise_runs_", &add_secure_noise_runs_cuda_);
}

}  // namespace dpzero::kernels
