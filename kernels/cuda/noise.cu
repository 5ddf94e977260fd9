// kernels/cuda/noise.cu — CUDA implementation of dpzero::add_noise_ (schema in kernels/ops.cpp).
// The draw is the same header code as on the CPU (privacy/noise.h); only libm's last-ulp
// differences in logf/sinf/cosf separate the devices, so bit equality holds per device type.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/noise_checks.h"
#include "privacy/noise.h"

namespace dpzero::kernels {
namespace {

// One thread per Philox block of kNoiseLanes global coordinates, grid-stride over blocks.
template <typename scalar_t>
__global__ void add_noise_kernel(scalar_t* __restrict__ data,  // [n]
                                 int64_t n, int64_t offset, int64_t first_block,
                                 int64_t num_blocks, uint64_t seed, uint32_t step, float stddev) {
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < num_blocks;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t block = first_block + b;
    float z[privacy::kNoiseLanes];
    privacy::normal2(seed, step, privacy::kNoiseStream, static_cast<uint64_t>(block), z);
#pragma unroll
    for (int lane = 0; lane < privacy::kNoiseLanes; ++lane) {
      const int64_t i = block * privacy::kNoiseLanes + lane - offset;
      if (i < 0 || i >= n) continue;
      data[i] = static_cast<scalar_t>(static_cast<float>(data[i]) + stddev * z[lane]);
    }
  }
}

at::Tensor& add_noise_cuda_(at::Tensor& self, double stddev, int64_t seed, int64_t step,
                            int64_t offset) {
  check_add_noise_args("dpzero::add_noise_", self, stddev, step, offset);
  const int64_t n = self.numel();
  if (n == 0) return self;
  const c10::cuda::CUDAGuard guard(self.device());
  const int64_t first_block = offset / privacy::kNoiseLanes;
  const int64_t num_blocks = (offset + n - 1) / privacy::kNoiseLanes - first_block + 1;
  constexpr int kThreads = 256;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t wanted = (num_blocks + kThreads - 1) / kThreads;
  const int grid = static_cast<int>(std::min<int64_t>(wanted, static_cast<int64_t>(sms) * 32));
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, self.scalar_type(), "add_noise_cuda_", [&] {
    add_noise_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
        self.data_ptr<scalar_t>(), n, offset, first_block, num_blocks, static_cast<uint64_t>(seed),
        static_cast<uint32_t>(step), static_cast<float>(stddev));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return self;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CUDA, m) { m.impl("add_noise_", &add_noise_cuda_); }

}  // namespace dpzero::kernels
