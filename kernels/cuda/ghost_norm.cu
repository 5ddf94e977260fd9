// kernels/cuda/ghost_norm.cu — CUDA implementations of dpzero::_ghost_sq_norms and
// dpzero::_token_ghost_sq_norms (schemas in kernels/ops.cpp), the backend kernels behind the
// ghost path of the layer ops in kernels/per_sample_ops.h (Note [ghost norm] there).
//
// One fused kernel computes, per sample i, sum_{s,t} (a_s . a_t)(g_s . g_t) without ever writing a
// Gram to global memory: a block owns one 32 x 32 tile (s-block, t-block) of sample i's T x T
// Grams, builds the tile of G G^T (and of A A^T) in registers from 32-feature slices of the rows
// staged in shared memory, multiplies the two tiles entry by entry and reduces the tile to one
// number. Both Grams are symmetric, so only tiles with s-block <= t-block are launched and the
// off-diagonal ones count twice. Each block writes its tile's sum to partial[i, tile]; a
// deterministic at::sum over the tiles gives the norm (no atomics, so runs repeat bit for bit).
// For an embedding the A-Gram is the token-equality indicator [id_s = id_t != padding_idx],
// evaluated from the ids, so no one-hot input exists either.
//
// Precision (Note [certified norms] in kernels/per_sample_ops.h): rows are staged as float (exact
// for float32 / bfloat16 / float16 inputs), but every Gram entry, the entry-by-entry product and
// every reduction are float64 (a product of two floats is exact in float64), and the partials are
// float64. The summation tree is the one Note [ghost summation depth] (kernels/per_sample_checks.h)
// counts. The diagonal tiles also read S = sum_t ||a_t|| ||g_t|| off the Gram diagonals (for an
// embedding sum_{t: id_t != pad} ||g_t||), reduced the same way into a second partial. Both are
// raw float64 values; the layer ops turn them into a certified upper bound.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/per_sample_checks.h"

namespace dpzero::kernels {
namespace {

constexpr int kTile = 32;     // positions per side of a Gram tile
constexpr int kSlice = 32;    // features staged in shared memory per step
constexpr int kThreads = 16;  // a block is kThreads x kThreads; a thread owns 2 x 2 tile entries
constexpr int kBlockSize = kThreads * kThreads;
constexpr int kWarps = kBlockSize / 32;
constexpr int64_t kMaxGridY = 65535;  // samples per launch (gridDim.y limit)

// acc[u][v] += sum_f x[s0 + ty + 16u, f] * x[t0 + tx + 16v, f] over all d features of one sample's
// rows x [T, d], accumulated in float64 (each fma adds an exact float product with one rounding);
// rows past T read as 0. The +1 column pad keeps the threads of a warp, which read 16 different
// rows of rows_t at one feature, on 16 different banks.
template <typename scalar_t>
__device__ __forceinline__ void accumulate_gram_tile(const scalar_t* __restrict__ x,  // [T, d]
                                                     int64_t t_len, int64_t d, int64_t s0,
                                                     int64_t t0,
                                                     float (*rows_s)[kSlice + 1],  // [kTile][.]
                                                     float (*rows_t)[kSlice + 1],  // [kTile][.]
                                                     double acc[2][2]) {
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * kThreads + tx;
  for (int64_t f0 = 0; f0 < d; f0 += kSlice) {
    // Stage rows s0.. and t0.. at features f0..f0+31: consecutive threads read consecutive
    // features of one row (coalesced).
    for (int e = tid; e < kTile * kSlice; e += kBlockSize) {
      const int r = e / kSlice, k = e % kSlice;
      const int64_t f = f0 + k, s = s0 + r, t = t0 + r;
      rows_s[r][k] = (s < t_len && f < d) ? static_cast<float>(x[s * d + f]) : 0.0f;
      rows_t[r][k] = (t < t_len && f < d) ? static_cast<float>(x[t * d + f]) : 0.0f;
    }
    __syncthreads();
#pragma unroll 8
    for (int k = 0; k < kSlice; ++k) {
      const double s_lo = rows_s[ty][k], s_hi = rows_s[ty + kThreads][k];
      const double t_lo = rows_t[tx][k], t_hi = rows_t[tx + kThreads][k];
      acc[0][0] = fma(s_lo, t_lo, acc[0][0]);
      acc[0][1] = fma(s_lo, t_hi, acc[0][1]);
      acc[1][0] = fma(s_hi, t_lo, acc[1][0]);
      acc[1][1] = fma(s_hi, t_hi, acc[1][1]);
    }
    __syncthreads();  // the next slice overwrites rows_s / rows_t
  }
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

// grid = (num_pairs, samples in this launch), block = (kThreads, kThreads).
// kTokens: the A-Gram is [ids_s = ids_t != padding_idx] (embedding); otherwise a_s . a_t.
template <typename scalar_t, bool kTokens>
__global__ void __launch_bounds__(kBlockSize)
    ghost_norm_kernel(const scalar_t* __restrict__ a,   // [b, T, d_in] (unused when kTokens)
                      const int64_t* __restrict__ ids,  // [b, T] (kTokens only)
                      const scalar_t* __restrict__ g,   // [b, T, d_out]
                      double* __restrict__ partial,     // [b, num_pairs]: tile sums
                      double* __restrict__ partial_s,   // [b, num_pairs]: tile diagonal norms
                      int64_t t_len, int64_t d_in, int64_t d_out, int64_t padding_idx,
                      int64_t num_tiles) {
  __shared__ float rows_s[kTile][kSlice + 1];
  __shared__ float rows_t[kTile][kSlice + 1];
  __shared__ int64_t ids_s[kTile];
  __shared__ int64_t ids_t[kTile];
  __shared__ double warp_sums[2][kWarps];

  const int64_t pair = blockIdx.x, num_pairs = gridDim.x, i = blockIdx.y;
  // pair -> (bs, bt) with bs <= bt, enumerating row bs's tiles bt = bs .. num_tiles-1 in order.
  int64_t bs = 0, rest = pair;
  while (rest >= num_tiles - bs) {
    rest -= num_tiles - bs;
    ++bs;
  }
  const int64_t bt = bs + rest;
  const int64_t s0 = bs * kTile, t0 = bt * kTile;
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * kThreads + tx;

  double gram_g[2][2] = {{0.0, 0.0}, {0.0, 0.0}};
  accumulate_gram_tile(g + i * t_len * d_out, t_len, d_out, s0, t0, rows_s, rows_t, gram_g);

  // local: this thread's share of the tile's sum; local_s: of sum_t ||a_t|| ||g_t|| over the
  // tile's diagonal entries (s = t, only in diagonal tiles, only threads with tx = ty, u = v).
  double local = 0.0, local_s = 0.0;
  const bool diagonal_thread = bs == bt && tx == ty;
  if constexpr (kTokens) {
    if (tid < kTile) {
      ids_s[tid] = s0 + tid < t_len ? ids[i * t_len + s0 + tid] : padding_idx;
      ids_t[tid] = t0 + tid < t_len ? ids[i * t_len + t0 + tid] : padding_idx;
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < 2; ++u) {
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const int64_t id = ids_s[ty + u * kThreads];
        const bool in_range = s0 + ty + u * kThreads < t_len && t0 + tx + v * kThreads < t_len;
        const bool same = in_range && id != padding_idx && id == ids_t[tx + v * kThreads];
        // A select, not a multiply by the 0/1 indicator: 0 * NaN is NaN, and a padding token's
        // G row (which gets no gradient) may hold anything.
        local += same ? gram_g[u][v] : 0.0;
        if (diagonal_thread && u == v && in_range && id != padding_idx) {
          local_s += sqrt(gram_g[u][v]);
        }
      }
    }
  } else {
    double gram_a[2][2] = {{0.0, 0.0}, {0.0, 0.0}};
    accumulate_gram_tile(a + i * t_len * d_in, t_len, d_in, s0, t0, rows_s, rows_t, gram_a);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
#pragma unroll
      for (int v = 0; v < 2; ++v) local = fma(gram_a[u][v], gram_g[u][v], local);
      if (diagonal_thread && s0 + ty + u * kThreads < t_len) {
        local_s += sqrt(gram_a[u][u] * gram_g[u][u]);
      }
    }
  }
  local = warp_sum(local);
  local_s = warp_sum(local_s);
  if ((tid & 31) == 0) {
    warp_sums[0][tid >> 5] = local;
    warp_sums[1][tid >> 5] = local_s;
  }
  __syncthreads();
  if (tid < 32) {
    double v = tid < kWarps ? warp_sums[0][tid] : 0.0;
    double v_s = tid < kWarps ? warp_sums[1][tid] : 0.0;
    v = warp_sum(v);
    v_s = warp_sum(v_s);
    if (tid == 0) {
      partial[i * num_pairs + pair] = (bs == bt ? 1.0 : 2.0) * v;
      partial_s[i * num_pairs + pair] = v_s;
    }
  }
}

// Calls f with a value of the C++ type of `t` (float, at::BFloat16 or at::Half).
template <typename F>
void with_scalar_type(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(at::BFloat16{});
      break;
    case at::kHalf:
      f(at::Half{});
      break;
    default:
      TORCH_CHECK(false, "dpzero ghost norm: unsupported dtype ", t);
  }
}

// a: [B, T, d_in] (undefined when tokens), ids: [B, T] int64 (tokens only), g: [B, T, d_out].
// -> (value [B], S [B]) float64.
std::tuple<at::Tensor, at::Tensor> launch_ghost(const at::Tensor& a, const at::Tensor& ids,
                                                const at::Tensor& g, int64_t padding_idx,
                                                bool tokens) {
  const c10::cuda::CUDAGuard guard(g.device());
  const int64_t b = g.size(0), t_len = g.size(1), d_out = g.size(2);
  const int64_t d_in = tokens ? 0 : a.size(2);
  if (b == 0 || t_len == 0) {
    return {at::zeros({b}, g.options().dtype(at::kDouble)),
            at::zeros({b}, g.options().dtype(at::kDouble))};
  }
  const int64_t num_tiles = (t_len + kTile - 1) / kTile;
  const int64_t num_pairs = num_tiles * (num_tiles + 1) / 2;
  TORCH_CHECK(num_pairs <= std::numeric_limits<int32_t>::max(),
              "dpzero ghost norm: sequence length T = ", t_len, " needs too many Gram tiles");
  at::Tensor partial = at::empty({b, num_pairs}, g.options().dtype(at::kDouble));
  at::Tensor partial_s = at::empty({b, num_pairs}, g.options().dtype(at::kDouble));
  const auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 block(kThreads, kThreads);
  with_scalar_type(g.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* pa = tokens ? nullptr : a.data_ptr<scalar_t>();
    const int64_t* pid = tokens ? ids.data_ptr<int64_t>() : nullptr;
    const scalar_t* pg = g.data_ptr<scalar_t>();
    double* pp = partial.data_ptr<double>();
    double* ps = partial_s.data_ptr<double>();
    for (int64_t b0 = 0; b0 < b; b0 += kMaxGridY) {
      const int64_t nb = std::min(kMaxGridY, b - b0);
      const dim3 grid(static_cast<unsigned>(num_pairs), static_cast<unsigned>(nb));
      if (tokens) {
        ghost_norm_kernel<scalar_t, true><<<grid, block, 0, stream>>>(
            nullptr, pid + b0 * t_len, pg + b0 * t_len * d_out, pp + b0 * num_pairs,
            ps + b0 * num_pairs, t_len, 0, d_out, padding_idx, num_tiles);
      } else {
        ghost_norm_kernel<scalar_t, false><<<grid, block, 0, stream>>>(
            pa + b0 * t_len * d_in, nullptr, pg + b0 * t_len * d_out, pp + b0 * num_pairs,
            ps + b0 * num_pairs, t_len, d_in, d_out, padding_idx, num_tiles);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {partial.sum(1), partial_s.sum(1)};
}

// A [B, T, d_in], G [B, T, d_out] -> ([B] <A_i A_i^T, G_i G_i^T>, [B] sum_t ||a_t|| ||g_t||),
// float64.
std::tuple<at::Tensor, at::Tensor> ghost_sq_norms_cuda(const at::Tensor& a, const at::Tensor& g) {
  check_ghost_args("_ghost_sq_norms", a, "A", g);
  // One element type for both operands: mixed inputs (an fp32 activation under bf16 autocast)
  // are both read as float32.
  const auto type = a.scalar_type() == g.scalar_type() ? g.scalar_type() : at::kFloat;
  return launch_ghost(a.to(type).contiguous(), at::Tensor(), g.to(type).contiguous(), -1,
                      /*tokens=*/false);
}

// ids [B, T] int64, G [B, T, d] -> ([B] value, [B] sum_{t: id_t != pad} ||g_t||), float64;
// padding_idx >= 0, or -1 for none.
std::tuple<at::Tensor, at::Tensor> token_ghost_sq_norms_cuda(const at::Tensor& ids,
                                                             const at::Tensor& g,
                                                             int64_t padding_idx) {
  check_token_ghost_args(ids, g, padding_idx);
  return launch_ghost(at::Tensor(), ids.contiguous(), g.contiguous(), padding_idx,
                      /*tokens=*/true);
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CUDA, m) {
  m.impl("_ghost_sq_norms", &ghost_sq_norms_cuda);
  m.impl("_token_ghost_sq_norms", &token_ghost_sq_norms_cuda);
}

}  // namespace dpzero::kernels
