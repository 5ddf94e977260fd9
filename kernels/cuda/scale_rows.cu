// kernels/cuda/scale_rows.cu — CUDA implementation of dpzero::_scale_rows (schema in
// kernels/ops.cpp; the CPU's is kernels/cpu/scale_rows.cpp): one launch writes every element,
// x times its row's factor (or as it is), or 0 for a dropped sample's row (factor 0 or
// non-finite), never a product with 0 (which would keep a NaN).
#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/certify_checks.h"

namespace dpzero::kernels {
namespace {

template <typename scalar_t>
__global__ void scale_rows_kernel(const scalar_t* __restrict__ x, const float* __restrict__ scale,
                                  scalar_t* __restrict__ out, int64_t total, int64_t n,
                                  bool multiply) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float f = scale[k / n];
    if (!isfinite(f) || f == 0.0f) {
      out[k] = scalar_t(0);
    } else {
      out[k] = multiply ? x[k] * static_cast<scalar_t>(f) : x[k];
    }
  }
}

at::Tensor scale_rows_cuda(const at::Tensor& x, const at::Tensor& scale, bool multiply) {
  certify::check_scale_rows(x, scale);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), s = scale.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t total = xc.numel(), n = xc.size(0) == 0 ? 1 : total / xc.size(0);
  if (total == 0) return out;
  constexpr int kThreads = 256;
  const int grid = static_cast<int>(std::min<int64_t>((total + kThreads - 1) / kThreads, 65535));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (xc.scalar_type() == at::kDouble) {
    scale_rows_kernel<<<grid, kThreads, 0, stream>>>(xc.data_ptr<double>(), s.data_ptr<float>(),
                                                     out.data_ptr<double>(), total, n, multiply);
  } else {
    scale_rows_kernel<<<grid, kThreads, 0, stream>>>(xc.data_ptr<float>(), s.data_ptr<float>(),
                                                     out.data_ptr<float>(), total, n, multiply);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CUDA, m) { m.impl("_scale_rows", &scale_rows_cuda); }

}  // namespace dpzero::kernels
