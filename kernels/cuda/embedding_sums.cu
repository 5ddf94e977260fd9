// kernels/cuda/embedding_sums.cu — CUDA implementation of dpzero::_add_embedding_sums_ (schema in
// kernels/ops.cpp; the CPU one is kernels/cpu/embedding_sums.cpp): the two passes of Note
// [embedding sums] (kernels/embedding_sums.h), each product and addition an explicit
// round-to-nearest intrinsic, so the bits are the CPU kernel's; no atomics, so they repeat.
//  1. run_sums_kernel, block (column tile, sample), a thread per column: the sample's tokens sorted
//     in shared memory (sort_tokens.cuh; a sample longer than it sorts takes an ATen sort along its
//     tokens first), each run of one id summed in a float32 register and written to the workspace
//     [B T, d] at the run's last sorted position, the run's key beside it (the column tile 0
//     blocks write the keys);
//  2. the keys sorted (one ATen sort of B T int64);
//  3. add_runs_kernel, block (sorted position, column tile): a block at the first key of a row v
//     adds that row's run sums in key order into self; the other blocks return at once.
// Launches per call: 3 for each chunk of samples (one chunk, unless the workspace would pass
// samples_per_chunk's device budget or the grids their limits), the ATen sort of the keys maybe
// more than one; samples of more than 2048 tokens add about eight ATen ops per chunk (their
// tokens' sort). The ATen composition this replaced on the device path took 20. With d > 256
// each column tile's block sorts its sample again: a few thousand shared-memory steps against the
// T d loads of its rows.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/cuda/scalar_types.cuh"
#include "kernels/cuda/sort_tokens.cuh"
#include "kernels/embedding_sums.h"
#include "kernels/per_sample_sum.h"
#include "kernels/sample_products_checks.h"

namespace dpzero::kernels {
namespace {

using embedding_sums::kNoRun;

constexpr int kCols = 256;            // threads of a block: one column each
constexpr int64_t kMaxGridY = 65535;  // samples per launch of the run pass (gridDim.y limit)

// Pass 1, block (column tile, sample i < B = gridDim.y): g [B, T, d] contiguous, scale [B];
// presorted: order [B, T] int32 positions, sorted [B, T] ids and count [B] from an ATen sort, else
// the block sorts (p: the padded length). -> work [B T, d] (each run's sum at its last sorted
// position; the other positions unwritten) and keys [B T] (v B + i there, kNoRun elsewhere).
template <typename scalar_t, bool kPresorted>
__global__ void __launch_bounds__(kCols)
    run_sums_kernel(const int64_t* __restrict__ ids, const scalar_t* __restrict__ g,
                    const float* __restrict__ scale, const int* __restrict__ order,
                    const int64_t* __restrict__ sorted, const int* __restrict__ count,
                    int64_t b, int64_t t_len, int64_t d, int p, int64_t pad, int64_t rows,
                    float* __restrict__ work, int64_t* __restrict__ keys) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int64_t i = blockIdx.y;
  const float c = scale[i];
  int64_t* key = nullptr;
  int* pos = nullptr;
  int64_t n = 0;  // the same in every thread: the branches below are the block's, barriers and all
  if (sample_products::adds(c)) {
    if (kPresorted) {
      n = count[i];
    } else {
      n = sort_tokens::sort(ids + i * t_len, t_len, p, pad, kCols, smem, key, pos);
    }
  }
  auto id_at = [&](int64_t r) -> int64_t { return kPresorted ? sorted[i * t_len + r] : key[r]; };
  auto pos_at = [&](int64_t r) -> int64_t { return kPresorted ? order[i * t_len + r] : pos[r]; };
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kCols + threadIdx.x;
  if (j < d) {
    const scalar_t* gi = g + i * t_len * d + j;
    float* wi = work + i * t_len * d + j;
    float acc = 0.0f;
    for (int64_t r = 0; r < n; ++r) {
      acc = __fadd_rn(acc, __fmul_rn(c, static_cast<float>(gi[pos_at(r) * d])));
      if (r + 1 == n || id_at(r + 1) != id_at(r)) {  // the run of this id ends here
        wi[r * d] = acc;
        acc = 0.0f;
      }
    }
  }
  if (blockIdx.x == 0) {
    for (int64_t r = threadIdx.x; r < t_len; r += kCols) {
      int64_t k = kNoRun;
      if (r < n) {
        const int64_t v = id_at(r);
        if ((r + 1 == n || id_at(r + 1) != v) && v >= 0 && v < rows) k = v * b + i;
      }
      keys[i * t_len + r] = k;
    }
  }
}

// Pass 3: sorted_keys [n] ascending, where [n] (each key's workspace row), work [n, d] ->
// out [V, d] += each row's run sums in key order (ascending sample).
__global__ void __launch_bounds__(kCols)
    add_runs_kernel(const int64_t* __restrict__ sorted_keys, const int64_t* __restrict__ where,
                    const float* __restrict__ work, int64_t n, int64_t b, int64_t d,
                    float* __restrict__ out) {
  const int64_t p = blockIdx.x;
  const int64_t first = sorted_keys[p];
  if (first == kNoRun) return;
  const int64_t v = first / b;
  if (p > 0 && sorted_keys[p - 1] / b == v) return;  // not the row's first key
  const int64_t j = static_cast<int64_t>(blockIdx.y) * kCols + threadIdx.x;
  if (j >= d) return;
  float x = out[v * d + j];
  for (int64_t q = p; q < n; ++q) {
    const int64_t k = sorted_keys[q];
    if (k == kNoRun || k / b != v) break;
    x = __fadd_rn(x, work[where[q] * d + j]);
  }
  out[v * d + j] = x;
}

// The three passes over one chunk of samples: ids [c, T], g [c, T, d], scale [c], all contiguous,
// c <= kMaxGridY; out [V, d] contiguous. Chunks run in sample order on one stream, so a row's sums
// are added in ascending sample order across them too.
void add_chunk(at::Tensor& out, const at::Tensor& ids, const at::Tensor& g,
               const at::Tensor& scale, int64_t pad) {
  const int64_t c = g.size(0), t_len = g.size(1), d = g.size(2), rows = out.size(0);
  const int64_t n = c * t_len, tiles = (d + kCols - 1) / kCols;
  const bool presorted = t_len > sort_tokens::kMaxSortTokens;
  const int p = presorted ? 1 : sort_tokens::padded_length(t_len);
  at::Tensor order, sorted, count;
  if (presorted) std::tie(order, sorted, count) = sort_tokens::presort(ids, pad, rows);
  at::Tensor work = at::empty({n, d}, out.options());
  at::Tensor keys = at::empty({n}, ids.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const size_t smem = presorted ? 0 : sort_tokens::shared_bytes(p);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(c));
  with_scalar_type("embedding sums", g.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const auto launch = [&](auto kernel) {
      kernel<<<grid, kCols, smem, stream>>>(
          ids.data_ptr<int64_t>(), g.data_ptr<scalar_t>(), scale.data_ptr<float>(),
          presorted ? order.data_ptr<int>() : nullptr,
          presorted ? sorted.data_ptr<int64_t>() : nullptr,
          presorted ? count.data_ptr<int>() : nullptr, c, t_len, d, p, pad, rows,
          work.data_ptr<float>(), keys.data_ptr<int64_t>());
    };
    if (presorted) {
      launch(run_sums_kernel<scalar_t, true>);
    } else {
      launch(run_sums_kernel<scalar_t, false>);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  const auto [sorted_keys, where] = keys.sort();
  add_runs_kernel<<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(tiles)), kCols, 0,
                    stream>>>(sorted_keys.data_ptr<int64_t>(), where.data_ptr<int64_t>(),
                              work.data_ptr<float>(), n, c, d, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor& add_embedding_sums_cuda_(at::Tensor& self, const at::Tensor& ids_in,
                                     const at::Tensor& g_in, const at::Tensor& scale_in,
                                     int64_t pad) {
  embedding_sums::check_args(self, ids_in, g_in, scale_in, pad);
  const c10::cuda::CUDAGuard guard(self.device());
  const at::Tensor ids = ids_in.contiguous(), g = g_in.contiguous(), scale = scale_in.contiguous();
  at::Tensor out = per_sample_sum::accumulator(self);
  const int64_t b = g.size(0), t_len = g.size(1), d = g.size(2);
  if (b > 0 && t_len > 0 && d > 0) {
    TORCH_CHECK(t_len <= INT_MAX && (d + kCols - 1) / kCols <= kMaxGridY,
                "dpzero::_add_embedding_sums_: samples of ", t_len, " tokens and ", d,
                " columns exceed one launch's grid");
    // The workspace: 4 d + 8 bytes a token (as much as a float32 copy of G), and the token sort's
    // temporaries past 2048 tokens; the chunks of samples_per_chunk's device budget keep them
    // bounded, and the grids within their limits.
    const int64_t per_token = 4 * d + 8 + (t_len > sort_tokens::kMaxSortTokens ? 48 : 0);
    const int64_t chunk = std::min({samples_per_chunk(b, t_len * per_token, /*device=*/true),
                                    kMaxGridY, std::max<int64_t>(1, INT_MAX / t_len)});
    for (int64_t i0 = 0; i0 < b; i0 += chunk) {
      const int64_t i1 = std::min(b, i0 + chunk);
      add_chunk(out, ids.slice(0, i0, i1), g.slice(0, i0, i1), scale.slice(0, i0, i1), pad);
    }
  }
  return per_sample_sum::written_back(self, out);
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CUDA, m) {
  m.impl("_add_embedding_sums_", &add_embedding_sums_cuda_);
}

}  // namespace dpzero::kernels
