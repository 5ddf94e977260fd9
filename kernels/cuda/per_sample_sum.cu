// kernels/cuda/per_sample_sum.cu — CUDA implementation of dpzero::add_per_sample_clipped_sum_ and
// of its list form _add_per_sample_clipped_sums_ (schemas in kernels/ops.cpp; the CPU's are in
// kernels/cpu/per_sample_sum.cpp): the sum of Note [kept sums in chunks]
// (kernels/per_sample_sum.h), each product and addition an explicit round-to-nearest intrinsic, so
// the bits are the CPU kernel's. The single op is a list of one pair. Up to kPairsPerLaunch pairs
// share each launch, their blocks laid end to end along x. One launch when the samples make one
// chunk (B <= 32): a thread per entry adds its chunk's sum into self. Otherwise two: a thread per
// entry and chunk (chunks along grid y, in turn past its limit) writes its chunk's sum to a
// float64 workspace [chunks, d] of its pair, then a thread per entry adds the chunks in order into
// self. A warp reads 32 consecutive entries of a row.
#include <algorithm>
#include <cstdint>
#include <vector>

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
// Grid y's limit: past it, a block sums chunks blockIdx.y, + gridDim.y, ... in turn.
constexpr int64_t kMaxGridY = 65535;
// Pairs per launch: the table below is the kernels' parameter (4 KiB at most), read in place
// (__grid_constant__: indexing it copies nothing to each thread's local memory).
constexpr int kPairsPerLaunch = 48;

struct Pair {
  float* out;           // [d] float32, contiguous: the accumulator
  const void* grads;    // [b, d] float64 (f64) or float32, contiguous
  double* parts;        // [chunks, d] float64: the chunks' sums; null for one chunk
  int64_t d;            // entries
  int64_t first_block;  // the pair's first blockIdx.x; its blocks are ceil(d / kThreads)
  bool f64;
};

struct Pairs {
  Pair pair[kPairsPerLaunch];
  int n;
};

// The pair that block x belongs to (the pairs' blocks are laid end to end, in order), copied into
// registers once.
__device__ Pair pair_of(const Pairs& pairs, int64_t x) {
  int k = 0;
  while (k + 1 < pairs.n && pairs.pair[k + 1].first_block <= x) ++k;
  return pairs.pair[k];
}

// Entry j's sum over samples [i0, i1) of grads [b, d], from 0.0, dropped samples skipped.
template <typename scalar_t>
__device__ double chunk_sum(const scalar_t* __restrict__ grads, const float* __restrict__ scale,
                            int64_t i0, int64_t i1, int64_t d, int64_t j) {
  double part = 0.0;
  for (int64_t i = i0; i < i1; ++i) {
    const float f = scale[i];
    if (!sample_products::adds(f)) continue;
    const double term = __dmul_rn(static_cast<double>(f), static_cast<double>(grads[i * d + j]));
    part = __dadd_rn(part, term);
  }
  return part;
}

// Entry j of a pair, chunks k = blockIdx.y, + gridDim.y, ...: each chunk's kept samples' sum from
// 0.0, added from 0.0 into self when there is one chunk (`parts` null), else written to
// parts[k d + j].
__global__ void chunk_sums_kernel(const __grid_constant__ Pairs pairs,
                                  const float* __restrict__ scale, int64_t b, int64_t chunks) {
  const Pair p = pair_of(pairs, blockIdx.x);
  const int64_t j = (blockIdx.x - p.first_block) * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= p.d) return;
  for (int64_t k = blockIdx.y; k < max(chunks, int64_t{1}); k += gridDim.y) {
    const int64_t i0 = k * per_sample_sum::kSamplesPerChunk;
    const int64_t i1 = min(b, i0 + per_sample_sum::kSamplesPerChunk);
    const double part =
        p.f64 ? chunk_sum(static_cast<const double*>(p.grads), scale, i0, i1, p.d, j)
              : chunk_sum(static_cast<const float*>(p.grads), scale, i0, i1, p.d, j);
    if (p.parts == nullptr) {
      p.out[j] = __fadd_rn(p.out[j], __double2float_rn(__dadd_rn(0.0, part)));
    } else {
      p.parts[k * p.d + j] = part;
    }
  }
}

// Entry j of a pair: the chunks' sums in order from 0.0, added into self.
__global__ void add_chunks_kernel(const __grid_constant__ Pairs pairs, int64_t chunks) {
  const Pair p = pair_of(pairs, blockIdx.x);
  const int64_t j = (blockIdx.x - p.first_block) * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= p.d) return;
  double total = 0.0;
  for (int64_t k = 0; k < chunks; ++k) total = __dadd_rn(total, p.parts[k * p.d + j]);
  p.out[j] = __fadd_rn(p.out[j], __double2float_rn(total));
}

// One launch's pairs, its blocks along x and its entries.
struct Launch {
  Pairs pairs{};
  int64_t blocks = 0;
  int64_t entries = 0;
};

// Every pair, checked: accumulators and rows made contiguous, the launches' tables built and
// their grids checked before anything is written, the launches, the copies written back.
void add_pairs(const char* op, at::TensorList self, at::TensorList grads,
               const at::Tensor& scale) {
  const c10::cuda::CUDAGuard guard(scale.device());
  const at::Tensor s = scale.contiguous();
  const int64_t b = s.size(0);
  const int64_t chunks = per_sample_sum::chunks(b);
  std::vector<at::Tensor> outs, rows;
  std::vector<Launch> launches;
  for (size_t k = 0; k < self.size(); ++k) {
    outs.push_back(per_sample_sum::accumulator(self[k]));
    rows.push_back(grads[k].contiguous());
    const int64_t d = outs[k].numel();
    if (d == 0) continue;
    if (launches.empty() || launches.back().pairs.n == kPairsPerLaunch) launches.emplace_back();
    Launch& launch = launches.back();
    Pair& p = launch.pairs.pair[launch.pairs.n++];
    p.out = outs[k].data_ptr<float>();
    p.grads = rows[k].data_ptr();
    p.d = d;
    p.first_block = launch.blocks;
    p.f64 = rows[k].scalar_type() == at::kDouble;
    launch.blocks += (d + kThreads - 1) / kThreads;
    launch.entries += d;
    TORCH_CHECK(launch.blocks <= 2147483647, "dpzero::", op, ": ", launch.entries,
                " entries exceed one launch's grid");
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (Launch& launch : launches) {
    at::Tensor work;  // stream-ordered: freed after the launches that use it are queued
    if (chunks > 1) {
      work = at::empty({chunks * launch.entries}, s.options().dtype(at::kDouble));
      double* next = work.data_ptr<double>();
      for (int k = 0; k < launch.pairs.n; ++k) {
        launch.pairs.pair[k].parts = next;
        next += chunks * launch.pairs.pair[k].d;
      }
    }
    const dim3 grid(static_cast<unsigned>(launch.blocks),
                    static_cast<unsigned>(std::clamp<int64_t>(chunks, 1, kMaxGridY)));
    chunk_sums_kernel<<<grid, kThreads, 0, stream>>>(launch.pairs, s.data_ptr<float>(), b,
                                                      chunks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (chunks > 1) {
      add_chunks_kernel<<<grid.x, kThreads, 0, stream>>>(launch.pairs, chunks);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  for (size_t k = 0; k < self.size(); ++k) {
    at::Tensor target = self[k];
    per_sample_sum::written_back(target, outs[k]);
  }
}

at::Tensor& add_per_sample_clipped_sum_cuda_(at::Tensor& self, const at::Tensor& grads,
                                             const at::Tensor& scale) {
  check_add_per_sample_clipped_sum(self, grads, scale);
  add_pairs("add_per_sample_clipped_sum_", {self}, {grads}, scale);
  return self;
}

void add_per_sample_clipped_sums_cuda_(at::TensorList self, at::TensorList grads,
                                       const at::Tensor& scale) {
  check_add_per_sample_clipped_sums(self, grads, scale);  // every pair before any is written
  add_pairs("_add_per_sample_clipped_sums_", self, grads, scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CUDA, m) {
  m.impl("add_per_sample_clipped_sum_", &add_per_sample_clipped_sum_cuda_);
  m.impl("_add_per_sample_clipped_sums_", &add_per_sample_clipped_sums_cuda_);
}

}  // namespace dpzero::kernels
