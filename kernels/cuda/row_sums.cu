// kernels/cuda/row_sums.cu — CUDA implementations of dpzero::_row_sums, dpzero::_norm_row_sums and
// dpzero::_embedding_rows (schemas in kernels/ops.cpp; Note [row sums] and Note [embedding rows]
// in kernels/per_sample/embedding.h, whose generic ATen versions these replace on CUDA).
//
// One pass over the inputs for all B samples, with no float64 copies and no loop over samples:
//  * norm rows only (_norm_row_sums): norm_stats_kernel, one warp per row, computes each row's
//    mean and 1 / sqrt(var + eps) in float64 with the CPU kernel's two-pass variance (the mean,
//    then the mean of squared deviations; RMSNorm: the mean of squares) -> stats [B, T, 2];
//  * row_pass_kernel: block (tile, i) owns sample i's columns [kCols tile, kCols (tile + 1)), a
//    thread one column. The thread adds its column's T entries into a float64 register in row
//    order (each entry of the sums is a length-T sum of depth T - 1, the e = gamma_T of Note
//    [certified norms]) and squares each entry; a row's squares are reduced over the block's
//    columns (warp shuffles, then the warps' partials in a fixed order) into row_sq [B, tiles, T];
//  * finish_kernel, one block per sample: S_i = sum_t sqrt(sum_tile row_sq[i, tile, t]), a sum of
//    non-negative terms in a fixed tree.
// Entries are read as float32 (bfloat16 / float16 widened exactly) and converted to float64
// once; a norm row's entry is G * ((x - mean) * rstd), the CPU kernel's expression.
//
// Embedding rows, as the CPU kernel: sort_tokens_kernel, one block per sample, sorts the
// sample's non-padding tokens by (id, position) in shared memory (bitonic, sort_tokens.cuh; past
// 2048 tokens an ATen sort gives the same order, sort_tokens::presort) -> order [B, T], ids
// [B, T], count [B]; then
// embedding_pass_kernel walks the sorted tokens as the row pass walks rows, with one float64
// accumulator per column and run of equal ids (added in position order: depth <= T - 1), adding
// its square to the column's q when the run ends; finish_kernel sums the tiles' q and the real
// tokens' row norms. Padding tokens are never read, so a NaN in their rows reaches nothing.
//
// No atomics: runs repeat bit for bit. They are not the CPU kernels' bits, within the bounds of
// Note [certified norms] (which hold for any order of the additions, with or without FMA): nvcc
// fuses multiply-adds (an entry G x-hat added to its sum, a square added to a row's), and the
// reductions run in other orders (warp shuffles and the warps' partials for S, a LayerNorm row's
// mean and variance and an embedding's q, each of which the CPU adds in an order of its own).
// The column sums of _row_sums and an embedding's per-id row sums have no multiply and one
// order, the CPU's. Launches per call: 2 (_row_sums), 3 (_norm_row_sums and _embedding_rows;
// past 2048 tokens presort's eight-odd ATen ops instead of the block sort), plus one row pass per
// further 65535 samples.
#include <algorithm>
#include <cstdint>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/cuda/scalar_types.cuh"
#include "kernels/cuda/sort_tokens.cuh"
#include "kernels/per_sample_checks.h"
#include "kernels/per_sample_ops.h"

namespace dpzero::kernels {
namespace {

constexpr int kCols = 256;  // threads of a block: one column each (row pass), rows (finish)
constexpr int kWarps = kCols / 32;
constexpr int kRowsPerFlush = 32;      // rows whose squares a block gathers between two barriers
constexpr int64_t kMaxGridY = 65535;   // samples per launch of the row pass (gridDim.y limit)

template <typename scalar_t>
__device__ __forceinline__ double as_f64(const scalar_t* p) {
  return static_cast<double>(static_cast<float>(*p));
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  return v;  // lane 0 holds the warp's sum
}

// Where a thread of the row and embedding passes stands: sample i of its launch (blockIdx.y), the
// column tile (blockIdx.x), its column k (active while k < d), its lane and warp.
struct ColumnThread {
  int64_t i, tile, k;
  int lane, warp;
  bool active;
  __device__ explicit ColumnThread(int64_t d)
      : i(blockIdx.y),
        tile(blockIdx.x),
        k(static_cast<int64_t>(blockIdx.x) * kCols + threadIdx.x),
        lane(static_cast<int>(threadIdx.x & 31)),
        warp(static_cast<int>(threadIdx.x >> 5)),
        active(k < d) {}
};

// Rows' squared norms, per warp in part[w][j] for the block's j < rows rows, added over the
// warps in a fixed order into sq[j]. Every thread of the block calls it (two barriers; part is
// free again afterwards).
__device__ __forceinline__ void flush_row_squares(double (&part)[kWarps][kRowsPerFlush], int rows,
                                                  double* __restrict__ sq) {
  __syncthreads();
  if (threadIdx.x < rows) {
    double v = 0.0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += part[w][threadIdx.x];
    sq[threadIdx.x] = v;
  }
  __syncthreads();
}

// x [rows, d] -> stats [rows, 2] float64: (mean, 1 / sqrt(var + eps)) per row, mean 0 for RMSNorm
// (var is then the mean of squares). One warp per row.
template <typename scalar_t>
__global__ void __launch_bounds__(kCols)
    norm_stats_kernel(const scalar_t* __restrict__ x, int64_t rows, int64_t d, double eps, bool rms,
                      double* __restrict__ stats) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= rows) return;  // a whole warp leaves together
  const scalar_t* xr = x + row * d;
  const double inv_d = d > 0 ? 1.0 / static_cast<double>(d) : 0.0;
  double mean = 0.0;
  if (!rms) {
    double s = 0.0;
    for (int64_t k = lane; k < d; k += 32) s += as_f64(xr + k);
    mean = __shfl_sync(0xffffffffu, warp_sum(s), 0) * inv_d;
  }
  double v = 0.0;
  for (int64_t k = lane; k < d; k += 32) {
    const double c = as_f64(xr + k) - mean;
    v += c * c;
  }
  v = warp_sum(v);
  if (lane == 0) {
    stats[2 * row] = mean;
    stats[2 * row + 1] = 1.0 / sqrt(v * inv_d + eps);
  }
}

// g, x [B, T, d] (x and stats only when kNorm), stats [B, T, 2] -> sums [B, d] float64 (sum_t of
// the rows' entries) and row_sq [B, tiles, T] float64 (each row's squared norm over the tile's
// columns). Grid (tiles, samples of this launch); the pointers start at the launch's first sample.
template <typename scalar_t, bool kNorm>
__global__ void __launch_bounds__(kCols)
    row_pass_kernel(const scalar_t* __restrict__ g, const scalar_t* __restrict__ x,
                    const double* __restrict__ stats, int64_t t_len, int64_t d, int64_t num_tiles,
                    double* __restrict__ sums, double* __restrict__ row_sq) {
  __shared__ double part[kWarps][kRowsPerFlush];
  const ColumnThread c(d);
  const scalar_t* gi = g + c.i * t_len * d;
  const scalar_t* xi = kNorm ? x + c.i * t_len * d : nullptr;
  const double* st = kNorm ? stats + c.i * t_len * 2 : nullptr;
  double* sq = row_sq + (c.i * num_tiles + c.tile) * t_len;
  double acc = 0.0;
  for (int64_t r0 = 0; r0 < t_len; r0 += kRowsPerFlush) {
    const int rows = static_cast<int>(t_len - r0 < kRowsPerFlush ? t_len - r0 : kRowsPerFlush);
    for (int j = 0; j < rows; ++j) {
      const int64_t r = r0 + j;
      double e = 0.0;
      if (c.active) {
        e = as_f64(gi + r * d + c.k);
        if (kNorm) e = e * ((as_f64(xi + r * d + c.k) - st[2 * r]) * st[2 * r + 1]);
      }
      acc += e;
      const double q = warp_sum(e * e);
      if (c.lane == 0) part[c.warp][j] = q;
    }
    flush_row_squares(part, rows, sq + r0);
  }
  if (c.active) sums[c.i * d + c.k] = acc;
}

// row_sq [B, tiles, T] -> s [B] float64: S_i = sum_{t < n_i} sqrt(sum_tile row_sq[i, tile, t]),
// n_i = count[i] (T when count is null); and, when q_part [B, tiles] is given, q [B] = its sums
// over the tiles. One block per sample.
__global__ void __launch_bounds__(kCols)
    finish_kernel(const double* __restrict__ row_sq, const int* __restrict__ count, int64_t t_len,
                  int64_t num_tiles, double* __restrict__ s, const double* __restrict__ q_part,
                  double* __restrict__ q) {
  __shared__ double part[kWarps];
  const int64_t i = blockIdx.x;
  const int64_t n = count != nullptr ? count[i] : t_len;
  const double* rq = row_sq + i * num_tiles * t_len;
  double acc = 0.0;
  for (int64_t r = threadIdx.x; r < n; r += kCols) {
    double sq = 0.0;
    for (int64_t tile = 0; tile < num_tiles; ++tile) sq += rq[tile * t_len + r];
    acc += sqrt(sq);
  }
  acc = warp_sum(acc);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += part[w];
    s[i] = total;
    if (q_part != nullptr) {
      double qi = 0.0;
      for (int64_t tile = 0; tile < num_tiles; ++tile) qi += q_part[i * num_tiles + tile];
      q[i] = qi;
    }
  }
}

// ids [B, T] int64 -> per sample, its non-padding tokens sorted by (id, position): order [B, T]
// int32 (positions), sorted [B, T] int64 (their ids), count [B] int32 (how many); entries past
// count are left unwritten. One block per sample (sort_tokens::sort).
__global__ void __launch_bounds__(kCols)
    sort_tokens_kernel(const int64_t* __restrict__ ids, int64_t t_len, int p, int64_t pad,
                       int* __restrict__ order, int64_t* __restrict__ sorted,
                       int* __restrict__ count) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int64_t i = blockIdx.x;
  int64_t* key;
  int* pos;
  const int n = sort_tokens::sort(ids + i * t_len, t_len, p, pad, kCols, smem, key, pos);
  for (int k = threadIdx.x; k < n; k += kCols) {
    order[i * t_len + k] = pos[k];
    sorted[i * t_len + k] = key[k];
  }
  if (threadIdx.x == 0) count[i] = n;
}

// g [B, T, d], the sort's order / sorted / count -> q_part [B, tiles] (the tile's columns' share of
// sum_v ||r_v||^2) and row_sq [B, tiles, T] (entry k: the squared norm over the tile's columns of
// the k-th sorted token's row). Grid (tiles, samples of this launch), pointers at its first sample.
template <typename scalar_t>
__global__ void __launch_bounds__(kCols)
    embedding_pass_kernel(const scalar_t* __restrict__ g, const int* __restrict__ order,
                          const int64_t* __restrict__ sorted, const int* __restrict__ count,
                          int64_t t_len, int64_t d, int64_t num_tiles, double* __restrict__ q_part,
                          double* __restrict__ row_sq) {
  __shared__ double part[kWarps][kRowsPerFlush];
  const ColumnThread c(d);
  const scalar_t* gi = g + c.i * t_len * d;
  const int* ord = order + c.i * t_len;
  const int64_t* sid = sorted + c.i * t_len;
  const int64_t n = count[c.i];
  double* sq = row_sq + (c.i * num_tiles + c.tile) * t_len;
  double acc = 0.0, q = 0.0;
  for (int64_t r0 = 0; r0 < n; r0 += kRowsPerFlush) {
    const int rows = static_cast<int>(n - r0 < kRowsPerFlush ? n - r0 : kRowsPerFlush);
    for (int j = 0; j < rows; ++j) {
      const int64_t r = r0 + j;
      const double e = c.active ? as_f64(gi + static_cast<int64_t>(ord[r]) * d + c.k) : 0.0;
      acc += e;
      const double rq = warp_sum(e * e);
      if (c.lane == 0) part[c.warp][j] = rq;
      if (r + 1 == n || sid[r + 1] != sid[r]) {  // the run of this id ends here
        q += acc * acc;
        acc = 0.0;
      }
    }
    flush_row_squares(part, rows, sq + r0);
  }
  q = warp_sum(q);
  if (c.lane == 0) part[c.warp][0] = q;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += part[w][0];
    q_part[c.i * num_tiles + c.tile] = total;
  }
}

// g [B, T, d] (and x, when norm, of g's dtype), contiguous -> (sums [B, d], S [B]) float64.
std::tuple<at::Tensor, at::Tensor> launch_row_sums(const at::Tensor& g, const at::Tensor& x,
                                                   double eps, bool rms, bool norm) {
  const c10::cuda::CUDAGuard guard(g.device());
  const int64_t b = g.size(0), t_len = g.size(1), d = g.size(2);
  const auto f64 = g.options().dtype(at::kDouble);
  if (b == 0 || t_len == 0 || d == 0) return {at::zeros({b, d}, f64), at::zeros({b}, f64)};
  const int64_t num_tiles = (d + kCols - 1) / kCols;
  at::Tensor sums = at::empty({b, d}, f64);
  at::Tensor s = at::empty({b}, f64);
  at::Tensor row_sq = at::empty({b, num_tiles, t_len}, f64);
  at::Tensor stats = norm ? at::empty({b, t_len, 2}, f64) : at::Tensor();
  const auto stream = at::cuda::getCurrentCUDAStream();
  with_scalar_type("row sums", g.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* pg = g.data_ptr<scalar_t>();
    const scalar_t* px = norm ? x.data_ptr<scalar_t>() : nullptr;
    double* pst = norm ? stats.data_ptr<double>() : nullptr;
    if (norm) {
      const int64_t rows = b * t_len;
      norm_stats_kernel<scalar_t><<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kCols,
                                    0, stream>>>(px, rows, d, eps, rms, pst);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    for (int64_t b0 = 0; b0 < b; b0 += kMaxGridY) {
      const int64_t nb = std::min(kMaxGridY, b - b0);
      const dim3 grid(static_cast<unsigned>(num_tiles), static_cast<unsigned>(nb));
      const int64_t off = b0 * t_len * d;
      double* ps = sums.data_ptr<double>() + b0 * d;
      double* pq = row_sq.data_ptr<double>() + b0 * num_tiles * t_len;
      if (norm) {
        row_pass_kernel<scalar_t, true><<<grid, kCols, 0, stream>>>(
            pg + off, px + off, pst + b0 * t_len * 2, t_len, d, num_tiles, ps, pq);
      } else {
        row_pass_kernel<scalar_t, false><<<grid, kCols, 0, stream>>>(
            pg + off, nullptr, nullptr, t_len, d, num_tiles, ps, pq);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  finish_kernel<<<static_cast<unsigned>(b), kCols, 0, stream>>>(
      row_sq.data_ptr<double>(), nullptr, t_len, num_tiles, s.data_ptr<double>(), nullptr,
      nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {sums, s};
}

// G [B, T, d] -> (sums [B, d] float64 = sum_t G_t, S [B] float64 = sum_t ||G_t||).
std::tuple<at::Tensor, at::Tensor> row_sums_cuda(const at::Tensor& g) {
  check_floating("_row_sums", "G", g);
  TORCH_CHECK(g.dim() == 3, "dpzero::_row_sums: G must be [B, T, d], got shape ", g.sizes());
  return launch_row_sums(g.contiguous(), at::Tensor(), 0.0, false, /*norm=*/false);
}

// x, G [B, T, d] -> (sums [B, d] float64 = sum_t G_t ⊙ x̂_t, S [B] float64 = sum_t ||G_t ⊙ x̂_t||).
std::tuple<at::Tensor, at::Tensor> norm_row_sums_cuda(const at::Tensor& x, const at::Tensor& g,
                                                      double eps, bool rms) {
  check_floating("_norm_row_sums", "x", x);
  check_floating("_norm_row_sums", "G", g);
  TORCH_CHECK(x.dim() == 3 && x.sizes() == g.sizes(),
              "dpzero::_norm_row_sums: x and G must both be [B, T, d], got ", x.sizes(), " and ",
              g.sizes());
  check_same_device("_norm_row_sums", "x", x, g, "G");
  // One element type for both: mixed inputs (an fp32 activation under bf16 autocast) are both
  // read as float32, which is exact for either.
  const auto type = x.scalar_type() == g.scalar_type() ? g.scalar_type() : at::kFloat;
  return launch_row_sums(g.to(type).contiguous(), x.to(type).contiguous(), eps, rms,
                         /*norm=*/true);
}

// Note [embedding rows]: ids [B, T] int64, G [B, T, d] -> (q [B], S [B]) float64; pad >= 0, or -1
// for none.
std::tuple<at::Tensor, at::Tensor> embedding_rows_cuda(const at::Tensor& ids_in,
                                                       const at::Tensor& g_in,
                                                       int64_t num_embeddings, int64_t pad) {
  check_embedding_rows_args(ids_in, g_in, num_embeddings, pad);
  const int64_t b = g_in.size(0), t_len = g_in.size(1), d = g_in.size(2);
  const c10::cuda::CUDAGuard guard(g_in.device());
  const auto f64 = g_in.options().dtype(at::kDouble);
  if (b == 0 || t_len == 0 || d == 0) return {at::zeros({b}, f64), at::zeros({b}, f64)};
  const at::Tensor ids = ids_in.contiguous(), g = g_in.contiguous();
  const int64_t num_tiles = (d + kCols - 1) / kCols;
  const auto i32 = ids.options().dtype(at::kInt);
  at::Tensor order, sorted, count;
  at::Tensor q_part = at::empty({b, num_tiles}, f64);
  at::Tensor row_sq = at::empty({b, num_tiles, t_len}, f64);
  at::Tensor q = at::empty({b}, f64);
  at::Tensor s = at::empty({b}, f64);
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (t_len > sort_tokens::kMaxSortTokens) {  // past what one block sorts: an ATen sort
    std::tie(order, sorted, count) = sort_tokens::presort(ids, pad, num_embeddings);
  } else {
    order = at::empty({b, t_len}, i32);
    sorted = at::empty({b, t_len}, ids.options());
    count = at::empty({b}, i32);
    const int p = sort_tokens::padded_length(t_len);
    sort_tokens_kernel<<<static_cast<unsigned>(b), kCols, sort_tokens::shared_bytes(p), stream>>>(
        ids.data_ptr<int64_t>(), t_len, p, pad, order.data_ptr<int>(), sorted.data_ptr<int64_t>(),
        count.data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  with_scalar_type("row sums", g.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    for (int64_t b0 = 0; b0 < b; b0 += kMaxGridY) {
      const int64_t nb = std::min(kMaxGridY, b - b0);
      const dim3 grid(static_cast<unsigned>(num_tiles), static_cast<unsigned>(nb));
      embedding_pass_kernel<scalar_t><<<grid, kCols, 0, stream>>>(
          g.data_ptr<scalar_t>() + b0 * t_len * d, order.data_ptr<int>() + b0 * t_len,
          sorted.data_ptr<int64_t>() + b0 * t_len, count.data_ptr<int>() + b0, t_len, d,
          num_tiles, q_part.data_ptr<double>() + b0 * num_tiles,
          row_sq.data_ptr<double>() + b0 * num_tiles * t_len);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  finish_kernel<<<static_cast<unsigned>(b), kCols, 0, stream>>>(
      row_sq.data_ptr<double>(), count.data_ptr<int>(), t_len, num_tiles, s.data_ptr<double>(),
      q_part.data_ptr<double>(), q.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, s};
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CUDA, m) {
  m.impl("_row_sums", &row_sums_cuda);
  m.impl("_norm_row_sums", &norm_row_sums_cuda);
  m.impl("_embedding_rows", &embedding_rows_cuda);
}

}  // namespace dpzero::kernels
