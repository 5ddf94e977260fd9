// kernels/cuda/ghost_split_tiles.cu — the split tiles: a CUDA path of dpzero::_ghost_sq_norms,
// _ghost_sq_norms_multi and _token_ghost_sq_norms for 2 <= T below the GEMM strips' length, taken
// from ghost_split_min_rows() on (kernels/per_sample_checks.h; kernels/cuda/ghost_norm.cu routes).
//
// Note [split tiles]
// ~~~~~~~~~~~~~~~~~~
// The fused tiles (kernels/cuda/ghost_norm.cu) give a block one tile of one sample's Grams and all
// d = d_in + d_out features, on the float64 vector units, staging each slice of rows before it
// computes on it: at B = 32, T = 128 that is B x 3 = 96 blocks, fewer than some devices have SMs.
// The split tiles change three things:
//  * the Gram products run on the FP64 tensor cores (WMMA's 8 x 8 x 4 double fragments, sm_80 and
//    later: twice the vector rate on sm_80 and sm_90);
//  * each operand's features are cut into chunks of F features and a block computes one chunk's
//    partial Gram tile, so a layer launches B x P x chunks blocks (P tile pairs); F depends on B,
//    P and the SM count only (plan_chunk_width), so a layer's chunks, and its bits, are the same
//    alone and beside other layers that share its input (Note [shared inputs]);
//  * the next stage of rows is read into registers while the tensor cores work on the current one.
// Phase 1 (split_gram_kernel): grid (P x chunks, samples), 4 warps, each owning 32 x 32 of the
// 64 x 64 tile as 4 x 4 fragments; it writes the chunk's partial tile, float64, to a workspace
// [samples, P, chunks, 64, 64]. Phase 2 (split_combine_kernel): grid (P, samples, layers); it adds
// each entry's chunks in chunk order (A's chunks for the A-Gram, the layer's G chunks for the
// G-Gram), multiplies the two Grams entry by entry and reduces the tile as the fused kernel does
// (ghost_tiles.cuh: each of 256 threads 16 entries in a chain, then block_sum2), writing the same
// tile sums and diagonal norms. An embedding's A-Gram is the token-equality indicator, as there.
//
// Precision (Note [certified norms] in kernels/per_sample/common.h): staging converts every
// element to float64 exactly. That Note takes every GEMM entry to be an inner product in some
// order, with or without FMA, as cuBLAS's DGEMM on these same tensor cores is; so each chunk's
// Gram entry is one over the chunk's features, and the chunks added in a fixed order make the
// whole entry one of length d: within gamma_d as before (the zeros staged past d or past T are
// exact and add no rounding). The product sum's tree is the fused tiles' (16, 5, 5, then P:
// Note [ghost summation depth]), so the certified margin is unchanged; the rows past T are
// staged as 0 but their entries are left out of the sums (0 * Inf from a real row is NaN).
//
// Cost: the inputs are read as by the fused tiles (each row once per tile it meets), and each
// (sample, pair, chunk) writes a 32 KiB tile that phase 2 reads back: B P chunks x 32 KiB each
// way against the Grams' 2 B T^2 d FLOPs (experiments/results/gpu.md works the paper rows'
// shape through on a device's rates). kBlocksPerSm trades the fill against that traffic; once
// B x P reaches half the target grid, each operand of up to kPlanWidth features is one chunk.
// The workspace stays within chunk_bytes_budget() (kernels/per_sample_checks.h) by taking fewer
// samples a launch. Both phases are deterministic (no atomics): runs repeat bit for bit. A
// sample's bits depend on B (through F), not on the other samples' values.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <mma.h>

#include "kernels/cuda/ghost_split_tiles.h"
#include "kernels/cuda/ghost_tiles.cuh"
#include "kernels/cuda/scalar_types.cuh"
#include "kernels/per_sample_checks.h"

namespace dpzero::kernels {
namespace {

using ghost_tiles::block_sum2;
using ghost_tiles::kBlockSize;
using ghost_tiles::kMaxGridY;
using ghost_tiles::kWarps;
using ghost_tiles::tile_place;

constexpr int kRows = 64;                  // tile side (positions)
constexpr int kTileElems = kRows * kRows;  // one float64 tile of the workspace
constexpr int kStage = 16;                 // features staged a step
constexpr int kLd = kStage + 4;            // staging row stride in doubles (below)
constexpr int kGramThreads = 128;          // phase 1: 4 warps, a 2 x 2 grid of warp tiles
constexpr int kGramBlocksPerSm = 3;        // resident phase-1 blocks an SM: 168 registers, no spill
constexpr int kWarpTile = kRows / 2;       // a warp's 32 x 32 entries
constexpr int kFrags = kWarpTile / 8;      // 8 x 8 fragments a warp tile side
constexpr int kPerThread = kRows * kStage / kGramThreads;  // staged elements a row set a thread
constexpr int kEntries = kTileElems / kBlockSize;          // phase 2: entries a thread (16)
constexpr int kMaxOperands = 8;            // operands (A and G's) of one phase-1 launch
constexpr int kMaxLayers = 8;              // layers of one phase-2 launch
constexpr int64_t kMinChunk = 64;          // features: a chunk's work amortises its 32 KiB tile
constexpr int64_t kBlocksPerSm = 2 * kGramBlocksPerSm;  // phase 1's grid: two waves an SM
constexpr int64_t kPlanWidth = 768;        // the layer width plan_chunk_width aims its grid at
// WMMA reads a fragment at a 32-byte aligned address with a row stride that is a multiple of 16
// bytes: fragments start at rows that are multiples of 8 (64 kLd bytes apart) and at features
// that are multiples of 4 (32 bytes), so an even kLd suffices; its 4 extra doubles spread a
// fragment's rows over the banks.
static_assert(kLd % 2 == 0 && kStage % 4 == 0, "WMMA fragment alignment");
static_assert(kEntries == 16, "Note [ghost summation depth] counts 16 entries a thread");
static_assert(kGramThreads % kStage == 0 && kRows * kStage % kGramThreads == 0,
              "every thread stages one feature of kPerThread rows");

// One phase-1 launch's operands: operand j is x[j] [samples, T, d[j]] from the launch's first
// sample; its chunks are the global chunk indices first[j] .. first[j + 1] - 1, chunk k of them
// covering features k F .. min(d[j], (k + 1) F) - 1.
template <typename scalar_t>
struct GramOperands {
  const scalar_t* x[kMaxOperands];
  int64_t d[kMaxOperands];
  int64_t first[kMaxOperands + 1];
  int count;
};

// Phase 1: grid (num_pairs x the launch's chunks, samples), block kGramThreads. Block (pair, c,
// i) writes work[i, pair, c] = X_s X_t^T over chunk c's features, X_s the rows s0.. and X_t the
// rows t0.. of its operand (64 each; rows past T read as 0), row-major 64 x 64, float64.
template <typename scalar_t>
__global__ void __launch_bounds__(kGramThreads, kGramBlocksPerSm)
    split_gram_kernel(GramOperands<scalar_t> ops,
                      double* __restrict__ work,  // [samples, num_pairs, chunks_total, 64, 64]
                      int64_t t_len, int64_t num_tiles, int64_t num_pairs, int64_t chunk_width,
                      int64_t chunks_total) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  namespace wmma = nvcuda::wmma;
  __shared__ __align__(32) double xs[2][kRows][kLd];  // [s rows | t rows][row][feature]

  const int64_t launch_chunks = ops.first[ops.count] - ops.first[0];
  const int64_t pair = blockIdx.x / launch_chunks;
  const int64_t c = ops.first[0] + blockIdx.x % launch_chunks;
  const int64_t i = blockIdx.y;
  int j = 0;
  while (c >= ops.first[j + 1]) ++j;
  const int64_t d = ops.d[j];
  const int64_t lo = (c - ops.first[j]) * chunk_width;
  const int64_t hi = lo + chunk_width < d ? lo + chunk_width : d;
  const scalar_t* __restrict__ x = ops.x[j] + i * t_len * d;
  const ghost_tiles::TilePlace place = tile_place(pair, num_tiles, kRows);
  const int64_t s0 = place.s0, t0 = place.t0;  // plain names: the lambda below captures them
  const bool diagonal = place.diagonal;

  const int tid = threadIdx.x, warp = tid >> 5;
  const int wr = (warp >> 1) * kWarpTile, wc = (warp & 1) * kWarpTile;

  // The next stage in registers. Element q of this thread is row r0 + 8q of each row set at
  // feature k of the stage (e = tid + q * kGramThreads: consecutive threads read consecutive
  // features of one row), so its addresses are one base and a stride of 8 rows.
  constexpr int kRowStep = kGramThreads / kStage;  // 8
  const int r0 = tid / kStage, k_own = tid % kStage;
  float next[2][kPerThread];
  const auto fetch = [&](int64_t f0) {
    const int64_t f = f0 + k_own;
    const scalar_t* __restrict__ ps = x + (s0 + r0) * d + f;
    const scalar_t* __restrict__ pt = x + (t0 + r0) * d + f;
#pragma unroll
    for (int q = 0; q < kPerThread; ++q) {
      const int64_t r = r0 + kRowStep * q;
      const int64_t step = kRowStep * q * d;
      next[0][q] = (f < hi && s0 + r < t_len) ? static_cast<float>(ps[step]) : 0.0f;
      next[1][q] = (!diagonal && f < hi && t0 + r < t_len) ? static_cast<float>(pt[step]) : 0.0f;
    }
  };

  wmma::fragment<wmma::accumulator, 8, 8, 4, double> acc[kFrags][kFrags];
#pragma unroll
  for (int u = 0; u < kFrags; ++u) {
#pragma unroll
    for (int v = 0; v < kFrags; ++v) wmma::fill_fragment(acc[u][v], 0.0);
  }
  const double(*rows_t)[kLd] = diagonal ? xs[0] : xs[1];  // a diagonal tile's t rows are its s rows
  if (lo < hi) fetch(lo);
  for (int64_t f0 = lo; f0 < hi; f0 += kStage) {
#pragma unroll
    for (int q = 0; q < kPerThread; ++q) {
      xs[0][r0 + kRowStep * q][k_own] = static_cast<double>(next[0][q]);  // exact
      if (!diagonal) xs[1][r0 + kRowStep * q][k_own] = static_cast<double>(next[1][q]);
    }
    __syncthreads();
    if (f0 + kStage < hi) fetch(f0 + kStage);  // in flight while the fragments below multiply
#pragma unroll
    for (int k = 0; k < kStage; k += 4) {
      // A fragment (m, k) = X_s[row m][feature k] (row-major); B fragment (k, n) = X_t[row n]
      // [feature k] (column-major over the same staging), so D(m, n) = x_s . x_t.
      wmma::fragment<wmma::matrix_a, 8, 8, 4, double, wmma::row_major> fa[kFrags];
      wmma::fragment<wmma::matrix_b, 8, 8, 4, double, wmma::col_major> fb[kFrags];
#pragma unroll
      for (int u = 0; u < kFrags; ++u) wmma::load_matrix_sync(fa[u], &xs[0][wr + 8 * u][k], kLd);
#pragma unroll
      for (int v = 0; v < kFrags; ++v) wmma::load_matrix_sync(fb[v], &rows_t[wc + 8 * v][k], kLd);
#pragma unroll
      for (int u = 0; u < kFrags; ++u) {
#pragma unroll
        for (int v = 0; v < kFrags; ++v) wmma::mma_sync(acc[u][v], fa[u], fb[v], acc[u][v]);
      }
    }
    __syncthreads();  // the next stage overwrites the staging
  }
  double* out = work + ((i * num_pairs + pair) * chunks_total + c) * kTileElems;
#pragma unroll
  for (int u = 0; u < kFrags; ++u) {
#pragma unroll
    for (int v = 0; v < kFrags; ++v) {
      wmma::store_matrix_sync(out + (wr + 8 * u) * kRows + wc + 8 * v, acc[u][v], kRows,
                              wmma::mem_row_major);
    }
  }
#else
  // Compiled for a device without float64 WMMA (or JIT-compiled from such PTX): never launched,
  // since split_tiles_supported() checks the code's architecture. Were it launched, the tiles
  // would go unwritten and the norms be anything, so fail loudly instead.
  __trap();
#endif
}

// One phase-2 launch's layers: layer z's G-Gram is the sum of chunks g_first[z] ..
// g_first[z] + g_count[z] - 1; its results go to row `row[z]` of partial / partial_s.
struct CombineLayers {
  int64_t g_first[kMaxLayers];
  int64_t g_count[kMaxLayers];
  int64_t row[kMaxLayers];
  int count;
};

// Phase 2: grid (num_pairs, samples, layers of this launch), block kBlockSize. Writes
// partial[row, i, pair] = (1 or 2) sum_{s,t in the tile, < T} GA[s,t] GG[s,t] and partial_s[row,
// i, pair] = sum over the tile's diagonal of sqrt(GA[t,t] GG[t,t]), with GA the sum of chunks 0 ..
// a_count - 1 (kTokens: [id_s = id_t != padding_idx], and sqrt(GG[t,t]) on the diagonal) and GG
// the layer's chunks; partial and partial_s from the launch's first sample, row stride `samples`.
template <bool kTokens>
__global__ void __launch_bounds__(kBlockSize)
    split_combine_kernel(const double* __restrict__ work,  // [b, num_pairs, chunks_total, 64, 64]
                         const int64_t* __restrict__ ids,  // [b, T] (kTokens only)
                         CombineLayers layers, int64_t a_count, double* __restrict__ partial,
                         double* __restrict__ partial_s, int64_t samples, int64_t t_len,
                         int64_t num_tiles, int64_t chunks_total, int64_t padding_idx) {
  __shared__ double warp_sums[2][kWarps];
  __shared__ int64_t ids_s[kRows];
  __shared__ int64_t ids_t[kRows];
  const int64_t pair = blockIdx.x, num_pairs = gridDim.x, i = blockIdx.y;
  const int z = blockIdx.z, tid = threadIdx.x;
  const auto [s0, t0, diagonal] = tile_place(pair, num_tiles, kRows);
  if constexpr (kTokens) {
    if (tid < kRows) {
      ids_s[tid] = s0 + tid < t_len ? ids[i * t_len + s0 + tid] : padding_idx;
      ids_t[tid] = t0 + tid < t_len ? ids[i * t_len + t0 + tid] : padding_idx;
    }
    __syncthreads();
  }
  const double* __restrict__ tiles = work + (i * num_pairs + pair) * chunks_total * kTileElems;
  const int64_t g_first = layers.g_first[z], g_count = layers.g_count[z];
  double local = 0.0, local_s = 0.0;
#pragma unroll 4
  for (int q = 0; q < kEntries; ++q) {
    const int e = tid + q * kBlockSize, r = e / kRows, col = e % kRows;
    const bool in_range = s0 + r < t_len && t0 + col < t_len;
    const bool on_diagonal = diagonal && r == col && in_range;
    double gg = 0.0;
    for (int64_t c = g_first; c < g_first + g_count; ++c) gg += tiles[c * kTileElems + e];
    if constexpr (kTokens) {
      const int64_t id = ids_s[r];
      // A select, not a multiply by the indicator: a padding token's G row may hold NaN.
      const bool same = in_range && id != padding_idx && id == ids_t[col];
      local += same ? gg : 0.0;
      if (on_diagonal && id != padding_idx) local_s += sqrt(gg);
    } else {
      double ga = 0.0;
      for (int64_t c = 0; c < a_count; ++c) ga += tiles[c * kTileElems + e];
      if (in_range) local = fma(ga, gg, local);
      if (on_diagonal) local_s += sqrt(ga * gg);
    }
  }
  block_sum2(local, local_s, warp_sums, tid);
  if (tid == 0) {
    const int64_t k = (layers.row[z] * samples + i) * num_pairs + pair;
    partial[k] = (diagonal ? 1.0 : 2.0) * local;
    partial_s[k] = local_s;
  }
}

// The chunk width F for a grid of `base` = samples x pairs blocks a chunk: a multiple of kStage,
// at least kMinChunk, at which a layer of kPlanWidth -> kPlanWidth features fills kBlocksPerSm
// blocks an SM (where base alone does not). Each block then does the same work (F features), a
// wider operand taking more chunks and a narrower one fewer; and F does not depend on the
// operands' widths, so a layer's chunks are the same whether it is reduced alone or with other
// layers sharing its input (Note [shared inputs]: the same bits).
int64_t plan_chunk_width(int64_t base, int64_t sms) {
  const int64_t target = kBlocksPerSm * sms;
  const int64_t per_operand = std::max<int64_t>(1, (target + 2 * base - 1) / (2 * base));
  const int64_t width = (kPlanWidth + per_operand - 1) / per_operand;
  return std::max(kMinChunk, (width + kStage - 1) / kStage * kStage);
}

// Whether the phase-1 kernel's code for the current device was built for sm_80 or later (a build
// for older architectures JIT-compiles their PTX, in which the kernel has no body).
bool split_kernel_has_body() {
  cudaFuncAttributes attributes{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, split_gram_kernel<float>));
  return attributes.ptxVersion >= 80;
}

}  // namespace

bool split_tiles_supported(const c10::Device& device) {
  if (at::cuda::getDeviceProperties(device.index())->major < 8) return false;
  // Per device (0: not yet asked, 1: yes, 2: no); a CUDA device index is below 64.
  static std::array<std::atomic<int8_t>, 64> known{};
  std::atomic<int8_t>& answer = known.at(static_cast<size_t>(device.index()));
  if (answer.load() == 0) {
    const c10::cuda::CUDAGuard guard(device);
    answer.store(split_kernel_has_body() ? 1 : 2);
  }
  return answer.load() == 1;
}

// a [B, T, d_in] (undefined when tokens), ids [B, T] int64 (tokens only), gs[l] [B, T, d_l]; all
// contiguous, a and every G of one element type, on one CUDA device, B >= 1, T >= 2. -> (value
// [L, B], S [L, B]) float64: row l what the fused tiles give for (A or ids, G[l]) up to the order
// of additions inside each Gram entry.
std::tuple<at::Tensor, at::Tensor> ghost_split_tiles(const at::Tensor& a, const at::Tensor& ids,
                                                     const std::vector<at::Tensor>& gs,
                                                     int64_t padding_idx, bool tokens) {
  const c10::cuda::CUDAGuard guard(gs.front().device());
  const int64_t b = gs.front().size(0), t_len = gs.front().size(1);
  TORCH_INTERNAL_ASSERT(b >= 1 && t_len >= 2, "dpzero ghost norm (split tiles): B = ", b,
                        ", T = ", t_len, " (the launchers take T = 1 and empty inputs elsewhere)");
  const int64_t layers = static_cast<int64_t>(gs.size());
  const int64_t num_tiles = (t_len + kRows - 1) / kRows;
  const int64_t num_pairs = num_tiles * (num_tiles + 1) / 2;

  // The operands in chunk order: A (unless tokens), then each G.
  std::vector<const at::Tensor*> operands;
  if (!tokens) operands.push_back(&a);
  for (const at::Tensor& g : gs) operands.push_back(&g);
  std::vector<int64_t> widths;
  for (const at::Tensor* x : operands) widths.push_back(x->size(2));

  const int64_t sms = at::cuda::getDeviceProperties(gs.front().device().index())
                          ->multiProcessorCount;
  const int64_t width = plan_chunk_width(std::min(b, kMaxGridY) * num_pairs, sms);
  std::vector<int64_t> first = {0};  // operand j's chunks: first[j] .. first[j + 1] - 1
  for (const int64_t w : widths) {
    first.push_back(first.back() + std::max<int64_t>(1, (w + width - 1) / width));
  }
  const int64_t chunks_total = first.back();
  TORCH_CHECK(num_pairs * chunks_total <= std::numeric_limits<int32_t>::max(),
              "dpzero ghost norm (split tiles): sequence length T = ", t_len, " gives ", num_pairs,
              " tile pairs x ", chunks_total, " chunks, too many blocks for one launch");
  const int64_t a_count = tokens ? 0 : first[1];
  const int64_t g_base = tokens ? 0 : 1;  // gs[l] is operand g_base + l

  // Samples a launch: the workspace within the chunk budget (at least one sample). The host loops'
  // 64 MiB, not the device budget of samples_per_chunk: the workspace adds to the step's peak
  // memory, and a few more launches cost little next to it.
  const int64_t per_sample = num_pairs * chunks_total * kTileElems * int64_t{sizeof(double)};
  const int64_t per_launch =
      std::max<int64_t>(1, std::min(kMaxGridY, chunk_bytes_budget().load() / per_sample));

  const auto opts = gs.front().options().dtype(at::kDouble);
  at::Tensor partial = at::empty({layers, b, num_pairs}, opts);
  at::Tensor partial_s = at::empty({layers, b, num_pairs}, opts);
  at::Tensor work = at::empty({std::min(b, per_launch), num_pairs, chunks_total, kRows, kRows},
                              opts);
  const auto stream = at::cuda::getCurrentCUDAStream();
  with_scalar_type("ghost norm (split tiles)", gs.front().scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    for (int64_t b0 = 0; b0 < b; b0 += per_launch) {
      const int64_t nb = std::min(per_launch, b - b0);
      // Phase 1, kMaxOperands operands a launch.
      for (size_t j0 = 0; j0 < operands.size(); j0 += kMaxOperands) {
        GramOperands<scalar_t> ops{};
        ops.count = static_cast<int>(std::min<size_t>(kMaxOperands, operands.size() - j0));
        for (int k = 0; k <= ops.count; ++k) ops.first[k] = first[j0 + static_cast<size_t>(k)];
        for (int k = 0; k < ops.count; ++k) {
          const at::Tensor& x = *operands[j0 + static_cast<size_t>(k)];
          ops.x[k] = x.data_ptr<scalar_t>() + b0 * t_len * x.size(2);
          ops.d[k] = x.size(2);
        }
        const int64_t launch_chunks = ops.first[ops.count] - ops.first[0];
        const dim3 grid(static_cast<unsigned>(num_pairs * launch_chunks),
                        static_cast<unsigned>(nb));
        split_gram_kernel<scalar_t><<<grid, kGramThreads, 0, stream>>>(
            ops, work.data_ptr<double>(), t_len, num_tiles, num_pairs, width, chunks_total);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      // Phase 2, kMaxLayers layers a launch.
      for (int64_t l0 = 0; l0 < layers; l0 += kMaxLayers) {
        CombineLayers ls{};
        ls.count = static_cast<int>(std::min<int64_t>(kMaxLayers, layers - l0));
        for (int k = 0; k < ls.count; ++k) {
          const auto j = static_cast<size_t>(g_base + l0 + k);
          ls.g_first[k] = first[j];
          ls.g_count[k] = first[j + 1] - first[j];
          ls.row[k] = l0 + k;
        }
        const dim3 grid(static_cast<unsigned>(num_pairs), static_cast<unsigned>(nb),
                        static_cast<unsigned>(ls.count));
        double* pp = partial.data_ptr<double>() + b0 * num_pairs;
        double* ps = partial_s.data_ptr<double>() + b0 * num_pairs;
        if (tokens) {
          split_combine_kernel<true><<<grid, kBlockSize, 0, stream>>>(
              work.data_ptr<double>(), ids.data_ptr<int64_t>() + b0 * t_len, ls, 0, pp, ps, b,
              t_len, num_tiles, chunks_total, padding_idx);
        } else {
          split_combine_kernel<false><<<grid, kBlockSize, 0, stream>>>(
              work.data_ptr<double>(), nullptr, ls, a_count, pp, ps, b, t_len, num_tiles,
              chunks_total, padding_idx);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    }
  });
  return {partial.sum(2), partial_s.sum(2)};
}

}  // namespace dpzero::kernels
