// kernels/cuda/ghost_norm.cu — CUDA implementations of dpzero::_ghost_sq_norms,
// dpzero::_ghost_sq_norms_multi and dpzero::_token_ghost_sq_norms (schemas in kernels/ops.cpp),
// the backend kernels behind the ghost path of the layer ops (Note [ghost norm] in
// kernels/per_sample/common.h). Four paths, by sequence length T (Note [ghost roofline]):
//  * T = 1: rank_one_kernel, ||a||^2 ||g||^2 per sample (Note [rank-one ghost] in
//    kernels/per_sample_checks.h);
//  * 2 <= T < ghost_gemm_min_rows() (kernels/per_sample_checks.h; 256 unless a benchmark sets it):
//    one fused kernel over Gram tiles, below;
//  * from ghost_split_min_rows() (no length unless a test or benchmark sets it) to the strips:
//    the split tiles, float64 tensor-core Grams with the features split over blocks
//    (Note [split tiles] in kernels/cuda/ghost_split_tiles.cu; sm_80 and later);
//  * from ghost_gemm_min_rows() on: float64 GEMM Gram strips on the tensor cores
//    (kernels/ghost_gemm.cpp).
//
// The fused kernel computes, per sample i, sum_{s,t} (a_s . a_t)(g_s . g_t) without writing a
// Gram to global memory: a block owns one tile (s-block, t-block) of sample i's T x T Grams (16R
// positions a side, R = 1, 2 or 4 by T), builds the tile of G G^T (and of A A^T) in registers
// from slices of the rows staged in shared memory as float64, multiplies the two tiles entry by
// entry and reduces the tile to one number. Both Grams are symmetric, so only tiles with s-block
// <= t-block are launched and the off-diagonal ones count twice. Each block writes its tile's sum
// to partial[i, tile]; a deterministic at::sum over the tiles gives the norm (no atomics, so runs
// repeat bit for bit). For an embedding the A-Gram is the token-equality indicator [id_s = id_t
// != padding_idx], evaluated from the ids, so no one-hot input exists either.
//
// Precision (Note [certified norms] in kernels/per_sample/common.h): rows are staged as float64
// (exact for float32 / bfloat16 / float16 inputs), every Gram entry, the entry-by-entry product
// and every reduction are float64 (a product of two floats is exact in float64), and the partials
// are float64. The summation tree is the one Note [ghost summation depth]
// (kernels/per_sample_checks.h) counts. The diagonal tiles also read S = sum_t ||a_t|| ||g_t||
// off the Gram diagonals (for an embedding sum_{t: id_t != pad} ||g_t||), reduced the same way
// into a second partial. Both are raw float64 values; the layer ops turn them into a certified
// upper bound.
//
// Note [ghost roofline]
// ~~~~~~~~~~~~~~~~~~~~~
// Per sample, with T rows and d = d_in + d_out features (an embedding: d = d_out), the two Grams
// cost 2 T^2 d FLOPs in full and the inputs are 4 T d bytes (float32; 2 T d for bfloat16). The
// arithmetic is float64, so the ceilings are the device's FP64 rates: the vector units (DFMA)
// and, for cuBLAS's DGEMM, the tensor cores (DMMA, about twice the vector rate on sm_80 and
// sm_90); the ridge points are those rates over the memory bandwidth.
//  * Fused tiles: of the n(n+1)/2 tile pairs (n = ceil(T / 64)) each costs 2 * 64^2 * d FLOPs and
//    the inputs are read once per tile row: intensity ~T/4 FLOP/byte for many tiles, T/2 for
//    one, so the kernel is compute-bound from T ~ 32 on and then bounded by the vector peak. Each
//    element is converted to float64 once, when it is staged, and shared memory holds float64
//    (a conversion in the inner loop runs at a quarter of the DFMA rate). A thread owns
//    R x R = 4 x 4 entries, so one feature costs 2R = 8 shared loads for R^2 = 16 DFMAs; the
//    loads are conflict-free and half of them broadcasts: the shared-memory pipe and the DFMAs
//    are balanced, so the kernel can reach a good fraction of the vector peak but not the tensor
//    cores'.
//  * GEMM strips (kernels/ghost_gemm.cpp): float64 copies of the rows (read 4, write 8, the GEMM
//    reads 8 bytes per element: 5x the fused path's traffic), DGEMMs over the strips of
//    gemm_row_blocks ((nb + 1) / (2 nb) of the full Grams' FLOPs, nb = ceil(T / 128) <= 8) at up
//    to the tensor-core rate, then the strips and their product written and read (~6 strip
//    passes), and ~10 launches per row block.
// The fused kernel's FLOPs grow as T^2 at the vector rate, the strips' at the tensor-core rate
// plus traffic linear in T: the strips win once T is large enough for the rate to pay for the
// traffic and launches. The split tiles sit between: the tensor-core rate and the fused tiles'
// reads, plus a float64 workspace of 32 KiB per sample, tile pair and feature chunk (Note [split
// tiles] in kernels/cuda/ghost_split_tiles.cu). kGhostGemmMinRows = 256 is where that estimate puts the crossover at
// d_in = d_out = 4096 (the per-T figures, and the measured kernel times, are in
// experiments/results/kernels.md); below it the fused kernel (one launch, no float64 workspace,
// the only sensible choice where it is memory-bound); the roofline stage times every path at every
// T (experiments/roofline.py, rows "ghost tiles", "ghost split" and "ghost strips") to measure
// it. The paths are the same float64 arithmetic up to the order of additions (Note [certified
// norms] assumes every GEMM entry is an inner product in some order, which cuBLAS's DGEMM on DMMA
// is; cuBLAS's opt-in emulated-FP64 math modes are outside that assumption). T = 1 has no Gram
// to speak of: rank_one_kernel reads each row once (memory-bound, 4 d bytes for 2 d FLOPs).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/cuda/ghost_split_tiles.h"
#include "kernels/cuda/ghost_tiles.cuh"
#include "kernels/cuda/scalar_types.cuh"
#include "kernels/ghost_gemm.h"
#include "kernels/per_sample_checks.h"

namespace dpzero::kernels {
namespace {

using ghost_tiles::block_sum2;
using ghost_tiles::kBlockSize;
using ghost_tiles::kMaxGridY;
using ghost_tiles::kWarps;
using ghost_tiles::tile_place;

constexpr int kThreads = 16;  // a block is kThreads x kThreads threads
static_assert(kThreads * kThreads == kBlockSize, "a fused tile's block reduces as block_sum2 does");
constexpr int kStageElems = 1024;  // elements of one operand staged per step

// The shared-memory staging of one tile of 16R x 16R Gram entries. A thread owns R x R of them:
// rows ty + 16u and columns tx + 16v (u, v < R).
template <int R>
struct Tile {
  static constexpr int kRows = kThreads * R;          // positions per side: 16, 32, 64
  static constexpr int kSlice = kStageElems / kRows;  // features per staging step: 64, 32, 16
  // Feature-major: at one feature k the 16 threads of a half-warp read 16 consecutive doubles
  // (rows tx + 16v: one 128-byte wavefront) or one double (rows ty + 16u: a broadcast). The +1
  // pad makes the row stride odd, so the staging writes (consecutive threads: consecutive k,
  // one row) fall on distinct banks as well.
  double s[kSlice][kRows + 1];  // rows s0 .. s0 + kRows - 1 of the features f0 .. f0 + kSlice - 1
  double t[kSlice][kRows + 1];  // rows t0 .. (unused in a diagonal tile, whose t rows are s's)
};

// acc[u][v] += sum_f x[s0 + ty + 16u, f] * x[t0 + tx + 16v, f] over all d features of one
// sample's rows x [T, d], in float64 (each fma adds an exact float product with one rounding);
// rows past T and features past d read as 0. In a diagonal tile (s0 = t0) the rows are staged
// once and serve both sides.
template <int R, typename scalar_t>
__device__ __forceinline__ void accumulate_gram_tile(const scalar_t* __restrict__ x,  // [T, d]
                                                     int64_t t_len, int64_t d, int64_t s0,
                                                     int64_t t0, bool diagonal, Tile<R>& tile,
                                                     double (&acc)[R][R]) {
  constexpr int kRows = Tile<R>::kRows, kSlice = Tile<R>::kSlice;
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * kThreads + tx;
  const double(*rows_t)[kRows + 1] = diagonal ? tile.s : tile.t;
  for (int64_t f0 = 0; f0 < d; f0 += kSlice) {
    // Stage rows s0.. and t0.. at features f0..f0+kSlice-1, converted to float64 once here:
    // consecutive threads read consecutive features of one row (coalesced).
#pragma unroll
    for (int e = tid; e < kRows * kSlice; e += kBlockSize) {
      const int r = e / kSlice, k = e % kSlice;
      const int64_t f = f0 + k, s = s0 + r, t = t0 + r;
      tile.s[k][r] =
          (s < t_len && f < d) ? static_cast<double>(static_cast<float>(x[s * d + f])) : 0.0;
      if (!diagonal) {
        tile.t[k][r] =
            (t < t_len && f < d) ? static_cast<double>(static_cast<float>(x[t * d + f])) : 0.0;
      }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kSlice; ++k) {
      double row_s[R], row_t[R];
#pragma unroll
      for (int u = 0; u < R; ++u) row_s[u] = tile.s[k][ty + kThreads * u];
#pragma unroll
      for (int v = 0; v < R; ++v) row_t[v] = rows_t[k][tx + kThreads * v];
#pragma unroll
      for (int u = 0; u < R; ++u) {
#pragma unroll
        for (int v = 0; v < R; ++v) acc[u][v] = fma(row_s[u], row_t[v], acc[u][v]);
      }
    }
    __syncthreads();  // the next slice overwrites the tile
  }
}

// This thread's share of a Linear tile's sums, from its R x R entries of both Grams: local +=
// sum_{u,v} gram_a * gram_g over entries inside the sequence (a chain: depth R^2), local_s +=
// sum_t ||a_t|| ||g_t|| over its diagonal entries (diagonal tiles, threads with tx = ty, u = v).
template <int R>
__device__ __forceinline__ void add_linear_tile(const double (&gram_a)[R][R],
                                                const double (&gram_g)[R][R], int64_t s0,
                                                int64_t t0, int64_t t_len, bool diagonal_thread,
                                                double& local, double& local_s) {
  const int tx = threadIdx.x, ty = threadIdx.y;
#pragma unroll
  for (int u = 0; u < R; ++u) {
    const bool row_in_range = s0 + ty + kThreads * u < t_len;
#pragma unroll
    for (int v = 0; v < R; ++v) {
      // Entries past T are 0 * 0 = 0 unless a real row holds an Inf; leave them out anyway.
      if (row_in_range && t0 + tx + kThreads * v < t_len) {
        local = fma(gram_a[u][v], gram_g[u][v], local);
      }
    }
    if (diagonal_thread && row_in_range) local_s += sqrt(gram_a[u][u] * gram_g[u][u]);
  }
}

// grid = (num_pairs, samples in this launch), block = (kThreads, kThreads); tiles of 16R rows.
// kTokens: the A-Gram is [ids_s = ids_t != padding_idx] (embedding); otherwise a_s . a_t.
template <typename scalar_t, int R, bool kTokens>
__global__ void __launch_bounds__(kBlockSize)
    ghost_norm_kernel(const scalar_t* __restrict__ a,   // [b, T, d_in] (unused when kTokens)
                      const int64_t* __restrict__ ids,  // [b, T] (kTokens only)
                      const scalar_t* __restrict__ g,   // [b, T, d_out]
                      double* __restrict__ partial,     // [b, num_pairs]: tile sums
                      double* __restrict__ partial_s,   // [b, num_pairs]: tile diagonal norms
                      int64_t t_len, int64_t d_in, int64_t d_out, int64_t padding_idx,
                      int64_t num_tiles) {
  constexpr int kRows = Tile<R>::kRows;
  __shared__ Tile<R> tile;
  __shared__ int64_t ids_s[kRows];
  __shared__ int64_t ids_t[kRows];
  __shared__ double warp_sums[2][kWarps];

  const int64_t pair = blockIdx.x, num_pairs = gridDim.x, i = blockIdx.y;
  const auto [s0, t0, diagonal] = tile_place(pair, num_tiles, Tile<R>::kRows);
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * kThreads + tx;

  double gram_g[R][R] = {};
  accumulate_gram_tile<R>(g + i * t_len * d_out, t_len, d_out, s0, t0, diagonal, tile, gram_g);

  // local: this thread's share of the tile's sum (its R x R entries in a chain: depth R^2);
  // local_s: of sum_t ||a_t|| ||g_t|| over the tile's diagonal entries (s = t, only in diagonal
  // tiles, only threads with tx = ty, u = v).
  double local = 0.0, local_s = 0.0;
  const bool diagonal_thread = diagonal && tx == ty;
  if constexpr (kTokens) {
    if (tid < kRows) {
      ids_s[tid] = s0 + tid < t_len ? ids[i * t_len + s0 + tid] : padding_idx;
      ids_t[tid] = t0 + tid < t_len ? ids[i * t_len + t0 + tid] : padding_idx;
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < R; ++u) {
#pragma unroll
      for (int v = 0; v < R; ++v) {
        const int64_t id = ids_s[ty + kThreads * u];
        const bool in_range = s0 + ty + kThreads * u < t_len && t0 + tx + kThreads * v < t_len;
        const bool same = in_range && id != padding_idx && id == ids_t[tx + kThreads * v];
        // A select, not a multiply by the 0/1 indicator: 0 * NaN is NaN, and a padding token's
        // G row (which gets no gradient) may hold anything.
        local += same ? gram_g[u][v] : 0.0;
        if (diagonal_thread && u == v && in_range && id != padding_idx) {
          local_s += sqrt(gram_g[u][v]);
        }
      }
    }
  } else {
    double gram_a[R][R] = {};
    accumulate_gram_tile<R>(a + i * t_len * d_in, t_len, d_in, s0, t0, diagonal, tile, gram_a);
    add_linear_tile<R>(gram_a, gram_g, s0, t0, t_len, diagonal_thread, local, local_s);
  }
  block_sum2(local, local_s, warp_sums, tid);
  if (tid == 0) {
    partial[i * num_pairs + pair] = (diagonal ? 1.0 : 2.0) * local;
    partial_s[i * num_pairs + pair] = local_s;
  }
}

// Note [shared inputs] (kernels/per_sample/linear.h): the output gradients of up to kMaxShared
// layers that read one input, for one launch of ghost_norm_multi_kernel.
constexpr int kMaxShared = 4;
template <typename scalar_t>
struct SharedOutputs {
  const scalar_t* g[kMaxShared];  // G_l [b, T, d_out[l]] from this launch's first sample
  int64_t d_out[kMaxShared];
  int64_t first[kMaxShared];      // G_l's row of partial: layer index l of the whole op
  int count;
};

// ghost_norm_kernel for Linear layers sharing their input: the block's A-Gram tile is built once
// and held in registers while each G_l's tile is built, multiplied entry by entry and reduced in
// turn, so each layer's tile sum is the single kernel's, bit for bit (same tiles, same order).
// grid = (num_pairs, samples in this launch); partial / partial_s [L, samples, num_pairs] from this
// launch's first sample, row stride `samples` (the op's B).
template <typename scalar_t, int R>
__global__ void __launch_bounds__(kBlockSize)
    ghost_norm_multi_kernel(const scalar_t* __restrict__ a,  // [b, T, d_in]
                            SharedOutputs<scalar_t> outs,
                            double* __restrict__ partial, double* __restrict__ partial_s,
                            int64_t samples, int64_t t_len, int64_t d_in, int64_t num_tiles) {
  __shared__ Tile<R> tile;
  __shared__ double warp_sums[2][kWarps];

  const int64_t pair = blockIdx.x, num_pairs = gridDim.x, i = blockIdx.y;
  const auto [s0, t0, diagonal] = tile_place(pair, num_tiles, Tile<R>::kRows);
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * kThreads + tx;
  const bool diagonal_thread = diagonal && tx == ty;

  double gram_a[R][R] = {};
  accumulate_gram_tile<R>(a + i * t_len * d_in, t_len, d_in, s0, t0, diagonal, tile, gram_a);
  for (int l = 0; l < outs.count; ++l) {
    const int64_t d_out = outs.d_out[l];
    double gram_g[R][R] = {};
    accumulate_gram_tile<R>(outs.g[l] + i * t_len * d_out, t_len, d_out, s0, t0, diagonal, tile,
                            gram_g);
    double local = 0.0, local_s = 0.0;
    add_linear_tile<R>(gram_a, gram_g, s0, t0, t_len, diagonal_thread, local, local_s);
    block_sum2(local, local_s, warp_sums, tid);
    if (tid == 0) {
      const int64_t k = (outs.first[l] * samples + i) * num_pairs + pair;
      partial[k] = (diagonal ? 1.0 : 2.0) * local;
      partial_s[k] = local_s;
    }
    __syncthreads();  // warp_sums and the tile are written again for the next layer
  }
}

// Note [rank-one ghost]: grid = (samples), block = kBlockSize threads. Block i writes value[i] =
// ||a_i||^2 ||g_i||^2 and s[i] = sqrt(value[i]); with kTokens, ||g_i||^2 and ||g_i|| unless
// token i is padding (then 0 and 0). Each thread sums the squares of its strided features in
// float64 (exact squares), then block_sum2 adds the threads' sums.
template <typename scalar_t, bool kTokens>
__global__ void __launch_bounds__(kBlockSize)
    rank_one_kernel(const scalar_t* __restrict__ a,   // [b, d_in] (unused when kTokens)
                    const int64_t* __restrict__ ids,  // [b] (kTokens only)
                    const scalar_t* __restrict__ g,   // [b, d_out]
                    double* __restrict__ value,       // [b]
                    double* __restrict__ s,           // [b]
                    int64_t d_in, int64_t d_out, int64_t padding_idx) {
  __shared__ double warp_sums[2][kWarps];
  const int64_t i = blockIdx.x;
  const int tid = threadIdx.x;
  double qa = 0.0, qg = 0.0;
  if constexpr (!kTokens) {
    for (int64_t k = tid; k < d_in; k += kBlockSize) {
      const double x = static_cast<double>(static_cast<float>(a[i * d_in + k]));
      qa = fma(x, x, qa);
    }
  }
  for (int64_t k = tid; k < d_out; k += kBlockSize) {
    const double x = static_cast<double>(static_cast<float>(g[i * d_out + k]));
    qg = fma(x, x, qg);
  }
  block_sum2(qa, qg, warp_sums, tid);
  if (tid == 0) {
    if constexpr (kTokens) {
      // A select: a padding token's G row may hold anything, NaN included.
      const bool kept = ids[i] != padding_idx;
      value[i] = kept ? qg : 0.0;
      s[i] = kept ? sqrt(qg) : 0.0;
    } else {
      const double v = qa * qg;
      value[i] = v;
      s[i] = sqrt(v);
    }
  }
}

// The fused tiles with 16R-row tiles: a [B, T, d_in] (undefined when tokens), ids [B, T] int64
// (tokens only), g [B, T, d_out], all contiguous, B >= 1, T >= 1 -> (value [B], S [B]) float64.
template <int R>
std::tuple<at::Tensor, at::Tensor> launch_tiles(const at::Tensor& a, const at::Tensor& ids,
                                                const at::Tensor& g, int64_t padding_idx,
                                                bool tokens) {
  const int64_t b = g.size(0), t_len = g.size(1), d_out = g.size(2);
  const int64_t d_in = tokens ? 0 : a.size(2);
  const int64_t num_tiles = (t_len + Tile<R>::kRows - 1) / Tile<R>::kRows;
  const int64_t num_pairs = num_tiles * (num_tiles + 1) / 2;
  TORCH_CHECK(num_pairs <= std::numeric_limits<int32_t>::max(),
              "dpzero ghost norm: sequence length T = ", t_len, " needs too many Gram tiles");
  at::Tensor partial = at::empty({b, num_pairs}, g.options().dtype(at::kDouble));
  at::Tensor partial_s = at::empty({b, num_pairs}, g.options().dtype(at::kDouble));
  const auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 block(kThreads, kThreads);
  with_scalar_type("ghost norm", g.scalar_type(), [&](auto tag) {
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
        ghost_norm_kernel<scalar_t, R, true><<<grid, block, 0, stream>>>(
            nullptr, pid + b0 * t_len, pg + b0 * t_len * d_out, pp + b0 * num_pairs,
            ps + b0 * num_pairs, t_len, 0, d_out, padding_idx, num_tiles);
      } else {
        ghost_norm_kernel<scalar_t, R, false><<<grid, block, 0, stream>>>(
            pa + b0 * t_len * d_in, nullptr, pg + b0 * t_len * d_out, pp + b0 * num_pairs,
            ps + b0 * num_pairs, t_len, d_in, d_out, padding_idx, num_tiles);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {partial.sum(1), partial_s.sum(1)};
}

// Note [rank-one ghost]: the T = 1 inputs as in launch_tiles -> (value [B], S [B]) float64.
std::tuple<at::Tensor, at::Tensor> launch_rank_one(const at::Tensor& a, const at::Tensor& ids,
                                                   const at::Tensor& g, int64_t padding_idx,
                                                   bool tokens) {
  const int64_t b = g.size(0), d_out = g.size(2);
  const int64_t d_in = tokens ? 0 : a.size(2);
  at::Tensor value = at::empty({b}, g.options().dtype(at::kDouble));
  at::Tensor s = at::empty({b}, g.options().dtype(at::kDouble));
  const auto stream = at::cuda::getCurrentCUDAStream();
  with_scalar_type("ghost norm", g.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const dim3 grid(static_cast<unsigned>(b));
    if (tokens) {
      rank_one_kernel<scalar_t, true><<<grid, kBlockSize, 0, stream>>>(
          nullptr, ids.data_ptr<int64_t>(), g.data_ptr<scalar_t>(), value.data_ptr<double>(),
          s.data_ptr<double>(), 0, d_out, padding_idx);
    } else {
      rank_one_kernel<scalar_t, false><<<grid, kBlockSize, 0, stream>>>(
          a.data_ptr<scalar_t>(), nullptr, g.data_ptr<scalar_t>(), value.data_ptr<double>(),
          s.data_ptr<double>(), d_in, d_out, padding_idx);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {value, s};
}

// a: [B, T, d_in] (undefined when tokens), ids: [B, T] int64 (tokens only), g: [B, T, d_out],
// contiguous, a and g of one dtype. -> (value [B], S [B]) float64, by the path Note [ghost
// roofline] picks for T.
std::tuple<at::Tensor, at::Tensor> launch_ghost(const at::Tensor& a, const at::Tensor& ids,
                                                const at::Tensor& g, int64_t padding_idx,
                                                bool tokens) {
  const c10::cuda::CUDAGuard guard(g.device());
  const int64_t b = g.size(0), t_len = g.size(1);
  if (b == 0 || t_len == 0) {
    return {at::zeros({b}, g.options().dtype(at::kDouble)),
            at::zeros({b}, g.options().dtype(at::kDouble))};
  }
  if (t_len == 1) return launch_rank_one(a, ids, g, padding_idx, tokens);
  if (t_len >= ghost_gemm_min_rows().load()) return ghost_values_gemm(a, ids, g, padding_idx);
  if (t_len >= ghost_split_min_rows().load() && split_tiles_supported(g.device())) {
    const auto [values, norms] = ghost_split_tiles(a, ids, {g}, padding_idx, tokens);
    return {values[0], norms[0]};
  }
  if (t_len <= Tile<1>::kRows) return launch_tiles<1>(a, ids, g, padding_idx, tokens);
  if (t_len <= Tile<2>::kRows) return launch_tiles<2>(a, ids, g, padding_idx, tokens);
  return launch_tiles<4>(a, ids, g, padding_idx, tokens);
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

// The fused tiles for layers sharing their input: a [B, T, d_in], gs[l] [B, T, d_out_l], one
// element type, contiguous, B >= 1, 2 <= T -> (value [L, B], S [L, B]) float64. Up to kMaxShared
// layers per launch (more take further launches, each building A's tiles again).
template <int R>
std::tuple<at::Tensor, at::Tensor> launch_tiles_multi(const at::Tensor& a,
                                                      const std::vector<at::Tensor>& gs) {
  const int64_t b = a.size(0), t_len = a.size(1), d_in = a.size(2);
  const int64_t layers = static_cast<int64_t>(gs.size());
  const int64_t num_tiles = (t_len + Tile<R>::kRows - 1) / Tile<R>::kRows;
  const int64_t num_pairs = num_tiles * (num_tiles + 1) / 2;
  TORCH_CHECK(num_pairs <= std::numeric_limits<int32_t>::max(),
              "dpzero ghost norm: sequence length T = ", t_len, " needs too many Gram tiles");
  at::Tensor partial = at::empty({layers, b, num_pairs}, a.options().dtype(at::kDouble));
  at::Tensor partial_s = at::empty({layers, b, num_pairs}, a.options().dtype(at::kDouble));
  const auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 block(kThreads, kThreads);
  with_scalar_type("ghost norm", a.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* pa = a.data_ptr<scalar_t>();
    for (int64_t l0 = 0; l0 < layers; l0 += kMaxShared) {
      for (int64_t b0 = 0; b0 < b; b0 += kMaxGridY) {
        const int64_t nb = std::min(kMaxGridY, b - b0);
        SharedOutputs<scalar_t> outs{};
        outs.count = static_cast<int>(std::min<int64_t>(kMaxShared, layers - l0));
        for (int k = 0; k < outs.count; ++k) {
          const at::Tensor& g = gs[static_cast<size_t>(l0 + k)];
          outs.d_out[k] = g.size(2);
          outs.g[k] = g.data_ptr<scalar_t>() + b0 * t_len * g.size(2);
          outs.first[k] = l0 + k;
        }
        const dim3 grid(static_cast<unsigned>(num_pairs), static_cast<unsigned>(nb));
        ghost_norm_multi_kernel<scalar_t, R><<<grid, block, 0, stream>>>(
            pa + b0 * t_len * d_in, outs, partial.data_ptr<double>() + b0 * num_pairs,
            partial_s.data_ptr<double>() + b0 * num_pairs, b, t_len, d_in, num_tiles);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    }
  });
  return {partial.sum(2), partial_s.sum(2)};
}

// Note [shared inputs]: A [B, T, d_in] against each G[l] [B, T, d_out_l] -> ([L, B] values, [L,
// B] S), float64, row l what _ghost_sq_norms(A, G[l]) gives on the same path; A's Gram is built
// once for all L (the fused tiles, the split tiles and the GEMM strips; T = 1 reads ||a||^2 once
// per layer, a pass over its rows).
std::tuple<at::Tensor, at::Tensor> ghost_sq_norms_multi_cuda(const at::Tensor& a,
                                                             at::TensorList gs) {
  constexpr const char* op = "_ghost_sq_norms_multi";
  TORCH_CHECK(!gs.empty(), "dpzero::", op, ": G must hold at least one tensor");
  bool one_type = true;
  for (const at::Tensor& g : gs) {
    check_ghost_args(op, a, "A", g);
    one_type = one_type && g.scalar_type() == a.scalar_type();
  }
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t b = a.size(0), t_len = a.size(1), layers = static_cast<int64_t>(gs.size());
  if (b == 0 || t_len == 0) {
    return {at::zeros({layers, b}, a.options().dtype(at::kDouble)),
            at::zeros({layers, b}, a.options().dtype(at::kDouble))};
  }
  // The strips convert each operand to float64 themselves, whatever its dtype.
  if (t_len >= ghost_gemm_min_rows().load()) return ghost_values_gemm_multi(a, gs);
  // One element type for every operand of the kernels: mixed inputs are all read as float32.
  const auto type = one_type ? a.scalar_type() : at::kFloat;
  const at::Tensor ac = a.to(type).contiguous();
  std::vector<at::Tensor> gc;
  for (const at::Tensor& g : gs) gc.push_back(g.to(type).contiguous());
  if (t_len == 1) {
    std::vector<at::Tensor> values, norms;
    for (const at::Tensor& g : gc) {
      auto [v, n] = launch_rank_one(ac, at::Tensor(), g, -1, /*tokens=*/false);
      values.push_back(v);
      norms.push_back(n);
    }
    return {at::stack(values), at::stack(norms)};
  }
  if (t_len >= ghost_split_min_rows().load() && split_tiles_supported(a.device())) {
    return ghost_split_tiles(ac, at::Tensor(), gc, -1, /*tokens=*/false);
  }
  if (t_len <= Tile<1>::kRows) return launch_tiles_multi<1>(ac, gc);
  if (t_len <= Tile<2>::kRows) return launch_tiles_multi<2>(ac, gc);
  return launch_tiles_multi<4>(ac, gc);
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CUDA, m) {
  m.impl("_ghost_sq_norms", &ghost_sq_norms_cuda);
  m.impl("_ghost_sq_norms_multi", &ghost_sq_norms_multi_cuda);
  m.impl("_token_ghost_sq_norms", &token_ghost_sq_norms_cuda);
}

}  // namespace dpzero::kernels
