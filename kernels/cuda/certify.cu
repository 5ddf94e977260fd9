// kernels/cuda/certify.cu — CUDA implementations of dpzero::_certify and dpzero::_group_clip
// (schemas in kernels/ops.cpp; the arithmetic is kernels/certify.h's, as in
// kernels/cpu/certify.cpp). One launch per call: a thread per sample, except kRows, where a
// block per sample reduces the row's squares (float64, a fixed tree: runs repeat bit for bit).
// Compiled with -fmad=false (kernels/CMakeLists.txt): every operation rounds once, so every step
// but kRows gives the CPU's bits.
#include <cstdint>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/certify.h"
#include "kernels/certify_checks.h"

namespace dpzero::kernels {
namespace {

using certify::Step;

constexpr int kThreads = 256;

int blocks_for(int64_t n) {
  return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 4096));
}

// Every step but kRows: thread i computes sample i (kSumUp: over the P parts of column i).
template <typename in_t, typename out_t>
__global__ void certify_kernel(Step step, const in_t* __restrict__ v, const double* __restrict__ s,
                               double coef, double margin, bool f32, certify::Rest rest,
                               out_t* __restrict__ out, int64_t rows, int64_t parts) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    double r;
    if (step == Step::kSumUp) {
      double total = 0.0;
      for (int64_t p = 0; p < parts; ++p) total += static_cast<double>(v[p * rows + i]);
      r = certify::sum_up(total);
    } else {
      r = certify::elementwise(step, static_cast<double>(v[i]), s ? s[i] : 0.0, coef, margin);
    }
    out[i] = static_cast<out_t>(f32 && certify::gives_f64(step) ? certify::f32_up(r) : r);
    if (rest.any()) {
      out[i] = static_cast<out_t>(certify::plus_rest(static_cast<float>(out[i]), rest.at(i)));
    }
  }
}

// kRows: block i sums row i's squares (thread-strided, then a shared-memory tree), thread 0
// certifies (and adds rest, where there is one).
template <typename in_t, typename out_t>
__global__ void certify_rows_kernel(const in_t* __restrict__ v, const double* __restrict__ s,
                                    double coef, bool f32, certify::Rest rest,
                                    out_t* __restrict__ out, int64_t cols) {
  // (coef includes the call's margin: kRows is kDirect of the row's q)
  __shared__ double partial[kThreads];
  const int64_t i = blockIdx.x;
  double q = 0.0;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
    const double x = static_cast<double>(v[i * cols + j]);
    q += x * x;
  }
  partial[threadIdx.x] = q;
  __syncthreads();
  for (int width = kThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) partial[threadIdx.x] += partial[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const double r = certify::direct_bound(partial[0], s[i], coef);
    out[i] = static_cast<out_t>(f32 ? certify::f32_up(r) : r);
    if (rest.any()) {
      out[i] = static_cast<out_t>(certify::plus_rest(static_cast<float>(out[i]), rest.at(i)));
    }
  }
}

at::Tensor certify_cuda(const at::Tensor& value, const c10::optional<at::Tensor>& S, double coef,
                        int64_t step, bool f32, double margin,
                        const c10::optional<at::Tensor>& rest,
                        const c10::optional<at::Tensor>& rest_rows,
                        const c10::optional<at::Tensor>& rest_s, double rest_coef) {
  auto [st, out] =
      certify::certify_result(value, S, step, f32, margin, rest, rest_rows, rest_s, rest_coef);
  const c10::cuda::CUDAGuard guard(value.device());
  const at::Tensor v = value.contiguous();
  const at::Tensor s = certify::takes_s(st) ? S->contiguous() : at::Tensor();
  // A thread computes a kept row's bound in row order, as the CPU does.
  const certify::RestOperands held(rest, rest_rows, rest_s, rest_coef);
  const certify::Rest& pr = held.rest;
  const int64_t rows = out.numel();
  if (rows == 0) return out;
  const double* ps = s.defined() ? s.data_ptr<double>() : nullptr;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto run = [&](auto* pv, auto* po) {
    if (st == Step::kRows) {
      certify_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
          pv, ps, coef + margin, f32, pr, po, v.size(1));
    } else {
      certify_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(
          st, pv, ps, coef, margin, f32, pr, po, rows, st == Step::kSumUp ? v.size(0) : 1);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const auto with_out = [&](auto* pv) {
    if (out.scalar_type() == at::kDouble) {
      run(pv, out.data_ptr<double>());
    } else {
      run(pv, out.data_ptr<float>());
    }
  };
  if (v.scalar_type() == at::kDouble) {
    with_out(v.data_ptr<double>());
  } else {
    with_out(v.data_ptr<float>());
  }
  return out;
}

__global__ void group_clip_kernel(const float* __restrict__ sq, const int64_t* __restrict__ sizes,
                                  int64_t components, int64_t b, int64_t mean, float threshold,
                                  privacy::ClipMode mode, float gamma,
                                  float* __restrict__ factors, float* __restrict__ norms) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < b;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float n = certify::group_norm(sq, sizes, components, b, i, mean);
    norms[i] = n;
    factors[i] = certify::group_factor(n, threshold, mode, gamma, mean);
  }
}

std::tuple<at::Tensor, at::Tensor> group_clip_cuda(const at::Tensor& sq, at::IntArrayRef sizes,
                                                   int64_t mean, double max_norm,
                                                   c10::string_view mode, double gamma) {
  const auto [clip_mode, threshold] =
      certify::check_group_clip(sq, sizes, mean, max_norm, mode, gamma);
  const c10::cuda::CUDAGuard guard(sq.device());
  const at::Tensor q = sq.contiguous();
  const int64_t b = q.size(1);
  at::Tensor factors = at::empty({b}, q.options());
  at::Tensor norms = at::empty({b}, q.options());
  if (b == 0) return {factors, norms};
  // The components' sizes, from pinned host memory, ordered on the stream (no host wait).
  at::Tensor host = at::empty({static_cast<int64_t>(sizes.size())},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(sizes.begin(), sizes.end(), host.data_ptr<int64_t>());
  const at::Tensor dev = host.to(sq.device(), /*non_blocking=*/true);
  group_clip_kernel<<<blocks_for(b), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      q.data_ptr<float>(), dev.data_ptr<int64_t>(), static_cast<int64_t>(sizes.size()), b, mean,
      threshold, clip_mode, static_cast<float>(gamma), factors.data_ptr<float>(),
      norms.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {factors, norms};
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CUDA, m) {
  m.impl("_certify", &certify_cuda);
  m.impl("_group_clip", &group_clip_cuda);
}

}  // namespace dpzero::kernels
