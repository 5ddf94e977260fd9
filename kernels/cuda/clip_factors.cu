// kernels/cuda/clip_factors.cu — CUDA implementation of dpzero::clip_factors (schema in
// kernels/ops.cpp; the policies are privacy/clipping.h).
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/clip_checks.h"
#include "privacy/clipping.h"

namespace dpzero::kernels {
namespace {

__global__ void clip_factors_kernel(const float* __restrict__ norms,  // [B]
                                    float* __restrict__ factors,      // [B]
                                    unsigned long long* __restrict__ nonfinite,  // [1]
                                    int64_t b, float max_norm, privacy::ClipMode mode,
                                    float gamma) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < b;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float n = norms[i];
    factors[i] = privacy::clip_factor(n, max_norm, mode, gamma);
    if (!privacy::valid_norm(n)) atomicAdd(nonfinite, 1ull);
  }
}

std::tuple<at::Tensor, at::Tensor> clip_factors_cuda(const at::Tensor& norms, double max_norm,
                                                     c10::string_view mode, double gamma) {
  const privacy::ClipMode clip_mode =
      check_clip_args("clip_factors", norms, max_norm, mode, gamma);
  const c10::cuda::CUDAGuard guard(norms.device());
  const at::Tensor n = norms.contiguous();
  at::Tensor factors = at::empty_like(n);
  at::Tensor count = at::zeros({}, n.options().dtype(at::kLong));
  const int64_t b = n.numel();
  if (b > 0) {
    constexpr int kThreads = 256;
    const int grid = static_cast<int>(std::min<int64_t>((b + kThreads - 1) / kThreads, 1024));
    clip_factors_kernel<<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        n.data_ptr<float>(), factors.data_ptr<float>(),
        reinterpret_cast<unsigned long long*>(count.data_ptr<int64_t>()), b,
        privacy::threshold_f32(max_norm), clip_mode, static_cast<float>(gamma));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {factors, count};
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CUDA, m) { m.impl("clip_factors", &clip_factors_cuda); }

}  // namespace dpzero::kernels
