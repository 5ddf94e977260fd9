// kernels/cuda/ghost_tiles.cuh — what the two tile kernels of the CUDA ghost norm share
// (kernels/cuda/ghost_norm.cu: the fused tiles; kernels/cuda/ghost_split_tiles.cu: the split
// tiles): where a block's tile of the T x T Grams lies, and the block's float64 sums. Both
// kernels reduce a tile with these, so Note [ghost summation depth] counts one tree for both.
#pragma once

#include <cstdint>

namespace dpzero::kernels::ghost_tiles {

constexpr int kBlockSize = 256;  // threads of a block that reduces a tile
constexpr int kWarps = kBlockSize / 32;
constexpr int64_t kMaxGridY = 65535;  // samples per launch (gridDim.y limit)

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

// The block's sums of v and w (a warp shuffle tree, then one over the warps' sums), valid in
// thread 0. `warp_sums` is shared scratch; tid = the thread's index in the block of kBlockSize.
__device__ __forceinline__ void block_sum2(double& v, double& w, double (&warp_sums)[2][kWarps],
                                           int tid) {
  v = warp_sum(v);
  w = warp_sum(w);
  if ((tid & 31) == 0) {
    warp_sums[0][tid >> 5] = v;
    warp_sums[1][tid >> 5] = w;
  }
  __syncthreads();
  if (tid < 32) {
    v = warp_sum(tid < kWarps ? warp_sums[0][tid] : 0.0);
    w = warp_sum(tid < kWarps ? warp_sums[1][tid] : 0.0);
  }
}

// A block's tile of the Grams: its first rows on each side and whether it is on the diagonal.
struct TilePlace {
  int64_t s0, t0;
  bool diagonal;
};

// Tile pair `pair` -> (bs, bt) with bs <= bt (the launch's pairs enumerate row bs's tiles bt = bs
// .. num_tiles - 1 in order, row after row) -> first rows s0 = rows * bs and t0 = rows * bt, for
// tiles of `rows` positions a side. Both Grams are symmetric, so only these pairs are launched
// and an off-diagonal tile counts twice.
__device__ __forceinline__ TilePlace tile_place(int64_t pair, int64_t num_tiles, int64_t rows) {
  int64_t rest = pair, bs = 0;
  while (rest >= num_tiles - bs) {
    rest -= num_tiles - bs;
    ++bs;
  }
  const int64_t bt = bs + rest;
  return {bs * rows, bt * rows, bs == bt};
}

}  // namespace dpzero::kernels::ghost_tiles
