// kernels/cuda/per_sample_sum.cu — CUDA implementation of dpzero::add_per_sample_clipped_sum_
// (schema in kernels/ops.cpp; the CPU's is kernels/cpu/per_sample_sum.cpp): the sum of Note [kept
// sums in chunks] (kernels/per_sample_sum.h), each product and addition an explicit
// round-to-nearest intrinsic, so the bits are the CPU kernel's. One launch when the samples make
// one chunk (B <= 32): a thread per entry adds its chunk's sum into self. Otherwise two: a thread
// per entry and chunk writes its chunk's sum to a float64 workspace [chunks, d], then a thread per
// entry adds the chunks in order into self. A warp reads 32 consecutive entries of a row.
#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/per_sample_checks.h"
#include "kernels/per_sample_sum.h"
#include "kernels/sample_products_checks.h"

namespace dpzero::kernels {
namespace {

constexpr int kThreads = 256;

// Entry j (blockIdx.x, threadIdx.x) of chunk k = blockIdx.y: its kept samples' sum from 0.0, added
// from 0.0 into self when there is one chunk (`parts` null), else written to parts[k d + j].
template <typename scalar_t>
__global__ void chunk_sums_kernel(float* __restrict__ out, double* __restrict__ parts,
                                  const scalar_t* __restrict__ grads,
                                  const float* __restrict__ scale, int64_t b, int64_t d) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= d) return;
  const int64_t k = blockIdx.y;
  const int64_t i0 = k * per_sample_sum::kSamplesPerChunk;
  const int64_t i1 = min(b, i0 + per_sample_sum::kSamplesPerChunk);
  double part = 0.0;
  for (int64_t i = i0; i < i1; ++i) {
    const float f = scale[i];
    if (!sample_products::adds(f)) continue;
    const double term = __dmul_rn(static_cast<double>(f), static_cast<double>(grads[i * d + j]));
    part = __dadd_rn(part, term);
  }
  if (parts == nullptr) {
    out[j] = __fadd_rn(out[j], __double2float_rn(__dadd_rn(0.0, part)));
  } else {
    parts[k * d + j] = part;
  }
}

// Entry j: the chunks' sums in order from 0.0, added into self.
__global__ void add_chunks_kernel(float* __restrict__ out, const double* __restrict__ parts,
                                  int64_t chunks, int64_t d) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= d) return;
  double total = 0.0;
  for (int64_t k = 0; k < chunks; ++k) total = __dadd_rn(total, parts[k * d + j]);
  out[j] = __fadd_rn(out[j], __double2float_rn(total));
}

at::Tensor& add_per_sample_clipped_sum_cuda_(at::Tensor& self, const at::Tensor& grads,
                                             const at::Tensor& scale) {
  check_add_per_sample_clipped_sum(self, grads, scale);
  const c10::cuda::CUDAGuard guard(self.device());
  const at::Tensor g = grads.contiguous(), s = scale.contiguous();
  at::Tensor out = per_sample_sum::accumulator(self);
  const int64_t b = g.size(0), d = out.numel();
  const int64_t chunks = per_sample_sum::chunks(b);
  if (d > 0) {  // B = 0 still adds 0.0 into self, as the CPU kernel does (a -0 becomes +0)
    TORCH_CHECK(chunks <= 65535 && (d + kThreads - 1) / kThreads <= 2147483647,
                "dpzero::add_per_sample_clipped_sum_: ", b, " samples of ", d,
                " entries exceed one launch's grid");
    const dim3 grid(static_cast<unsigned>((d + kThreads - 1) / kThreads),
                    static_cast<unsigned>(std::max<int64_t>(chunks, 1)));
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    at::Tensor parts;
    if (chunks > 1) parts = at::empty({chunks, d}, out.options().dtype(at::kDouble));
    double* pp = chunks > 1 ? parts.data_ptr<double>() : nullptr;
    if (g.scalar_type() == at::kDouble) {
      chunk_sums_kernel<<<grid, kThreads, 0, stream>>>(out.data_ptr<float>(), pp,
                                                       g.data_ptr<double>(), s.data_ptr<float>(),
                                                       b, d);
    } else {
      chunk_sums_kernel<<<grid, kThreads, 0, stream>>>(out.data_ptr<float>(), pp,
                                                       g.data_ptr<float>(), s.data_ptr<float>(),
                                                       b, d);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (chunks > 1) {
      add_chunks_kernel<<<grid.x, kThreads, 0, stream>>>(out.data_ptr<float>(), pp, chunks, d);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  return per_sample_sum::written_back(self, out);
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CUDA, m) {
  m.impl("add_per_sample_clipped_sum_", &add_per_sample_clipped_sum_cuda_);
}

}  // namespace dpzero::kernels
