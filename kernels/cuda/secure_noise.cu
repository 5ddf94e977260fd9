// kernels/cuda/secure_noise.cu — CUDA implementation of dpzero::add_secure_noise_ (schema in
// kernels/ops.cpp; the draw is Note [secure noise] in privacy/secure_noise.h).
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/noise_checks.h"
#include "privacy/secure_noise.h"

namespace dpzero::kernels {
namespace {

// One thread per ChaCha20 block (a pair of global coordinates), grid-stride over pairs.
template <typename scalar_t>
__global__ void add_secure_noise_kernel(scalar_t* __restrict__ data,  // [n]
                                        int64_t n, int64_t offset, int64_t first_pair,
                                        int64_t num_pairs, privacy::ChaCha20Key key,
                                        uint32_t step, double stddev) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < num_pairs;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t pair = first_pair + p;
    double z[2];
    privacy::secure_normal2(key, step, static_cast<uint64_t>(pair), z);
#pragma unroll
    for (int lane = 0; lane < 2; ++lane) {
      const int64_t i = pair * 2 + lane - offset;
      if (i < 0 || i >= n) continue;
      data[i] = static_cast<scalar_t>(static_cast<double>(data[i]) + stddev * z[lane]);
    }
  }
}

at::Tensor& add_secure_noise_cuda_(at::Tensor& self, double stddev, c10::IntArrayRef key,
                                   int64_t step, int64_t offset) {
  check_add_noise_args("dpzero::add_secure_noise_", self, stddev, step, offset, /*allow_double=*/true);
  const privacy::ChaCha20Key k = secure_key_from(key);
  const int64_t n = self.numel();
  if (n == 0) return self;
  const c10::cuda::CUDAGuard guard(self.device());
  const int64_t first_pair = offset / 2;
  const int64_t num_pairs = (offset + n - 1) / 2 - first_pair + 1;
  constexpr int kThreads = 256;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int grid = static_cast<int>(
      std::min<int64_t>((num_pairs + kThreads - 1) / kThreads, static_cast<int64_t>(sms) * 32));
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, self.scalar_type(), "add_secure_noise_cuda_", [&] {
    add_secure_noise_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
        self.data_ptr<scalar_t>(), n, offset, first_pair, num_pairs, k,
        static_cast<uint32_t>(step), stddev);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return self;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CUDA, m) { m.impl("add_secure_noise_", &add_secure_noise_cuda_); }

}  // namespace dpzero::kernels
