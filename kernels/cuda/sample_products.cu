// kernels/cuda/sample_products.cu — CUDA implementation of dpzero::_add_sample_products_ (schema
// in kernels/ops.cpp; the CPU's is in kernels/cpu/sample_products.cpp): the device path's clipped
// sum of a Linear (or Conv) layer, self += sum_i c_i L_i^T R_i, without the per-sample products
// ever reaching memory.
//
// Note [fused sample products]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Note [clipped-sum rounding] (kernels/per_sample/common.h) needs each sample's contribution
// formed alone before it is added. A batched GEMM does that by writing c products of rows x cols
// floats and summing them after: for B = 32 samples of a 768 x 3072 layer, 302 MB written and
// read again, next to a GEMM of 19 GFLOP, and the products' memory also cut the batch into chunks
// of a few samples. Here a block owns a 128 x 128 tile of self and walks its samples in order;
// each thread holds an 8 x 8 block of the tile (two runs of four rows, 64 apart, by two of four
// columns) twice over in registers:
//   part  this sample's contribution, from zero: its left rows times c_i as they are staged
//         (c_i l_t rounded once, __fmul_rn, after the exact conversion of a 16-bit input), then
//         one fused multiply-add per row in row order (__fmaf_rn: the same single rounding per
//         row as the host kernel's std::fma), so it is within ((1 + u)(1 + gamma_T) - 1) c_i S_i
//         of the exact c_i L_i^T R_i: the bound the note certifies;
//   acc   the running sum: acc = acc + part, one rounding (__fadd_rn).
// The factor goes in before the sum, not after it: a kept sample's unscaled product may leave
// float32's range (a certified norm below 3.4e38 allows S_i near 1e45, with rows that cancel and a
// factor near 1e-33), and Inf times c_i stays Inf; scaled rows keep every partial sum within
// c_i S_i (1 + gamma_T), which the certification keeps below C / m.
// A sample whose factor is 0 or non-finite is skipped whole (sample_products::adds), so a dropped
// sample's NaN or Inf never enters a sum, as _scale_rows zeroes its rows on the other path.
// With one split acc starts from self's entry, so self's entry ends as ((self + p_1) + p_2) + ...
// (p_i the sample's part), the order of the host reference in the GoogleTest, bit for bit. A
// layer with few tiles leaves SMs idle; then `splits` blocks share each tile's samples in
// contiguous runs: split 0 starts from self and writes it, split z > 0 starts from zero and writes
// partial[z - 1], and a second launch adds the partials into self in split order. No atomics: a
// run repeats bit for bit, and the split count is fixed by the device and the shape. So a layer
// split on one GPU model need not give another model's bits (its SM count sets the splits), and
// with more than one split a -0.0 in self becomes +0.0 even when every sample is dropped.
//
// Rows are staged 8 at a time in shared memory as float32, in two buffers: while the block
// computes from one stage, each thread's share of the next (the next rows of this sample, or the
// first of the next kept sample) is on its way from global memory into registers, and goes into
// the other buffer after; one barrier per stage. A thread reads its 8 left and 8 right entries of
// a row as four float4s (conflict-free: a warp's right reads are 256 contiguous bytes) and does 64
// fused multiply-adds. The loop over a stage's rows stops at T, so the zeros padding a short
// last stage are never read into part.
#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/cuda/scalar_types.cuh"
#include "kernels/sample_products_checks.h"

namespace dpzero::kernels {
namespace {

constexpr int kTile = 128;             // self's rows and columns per block
constexpr int kDepth = 8;              // sample rows per shared-memory stage
constexpr int kMicro = 8;              // a thread's rows and columns of the tile
constexpr int kHalf = kTile / 2;       // a thread's entries: two 4-wide runs, kHalf apart
constexpr int kSide = kTile / kMicro;  // 16 threads a side
constexpr int kThreads = kSide * kSide;
constexpr int kLoad = 4;               // consecutive entries of a stage row one thread loads
constexpr int kMaxSplits = 8;
static_assert(kDepth * kTile == kThreads * kLoad, "a stage is one load of kLoad per thread");
static_assert(kMicro == 8 && kHalf == kSide * 4, "the micro-tile is two float4 runs a side");

template <typename T>
__device__ __forceinline__ float as_float(T x) {
  return static_cast<float>(x);
}

// The first sample at or after i (before end) whose factor adds (sample_products::adds).
__device__ __forceinline__ int64_t next_kept(const float* __restrict__ factors, int64_t i,
                                             int64_t end) {
  while (i < end && !sample_products::adds(factors[i])) ++i;
  return i;
}

// Offset of a thread's m-th entry along one side of the tile (m < kMicro): two runs of four.
__device__ __forceinline__ int side_offset(int thread, int m) {
  return (m < 4 ? 0 : kHalf) + thread * 4 + (m & 3);
}

// This thread's kLoad entries of row s0 + lr of sample i, from column r (left) and k (right) on,
// as float32 (exact for every input type), the left ones times the sample's factor f (one
// rounding), 0 past T or the tile's edge.
template <typename L, typename R>
__device__ __forceinline__ void load_stage(const L* __restrict__ left, const R* __restrict__ right,
                                           float f, int64_t t, int64_t rows, int64_t cols,
                                           int64_t i, int64_t s0, int lr, int64_t r, int64_t k,
                                           float (&out_l)[kLoad], float (&out_r)[kLoad]) {
  const int64_t s = s0 + lr;
#pragma unroll
  for (int m = 0; m < kLoad; ++m) {
    out_l[m] = 0.0f;
    out_r[m] = 0.0f;
  }
  if (s >= t) return;
  const L* li = left + (i * t + s) * rows;
  const R* ri = right + (i * t + s) * cols;
#pragma unroll
  for (int m = 0; m < kLoad; ++m) {
    if (r + m < rows) out_l[m] = __fmul_rn(f, as_float(li[r + m]));
    if (k + m < cols) out_r[m] = as_float(ri[k + m]);
  }
}

__device__ __forceinline__ void store_stage(float (&ls)[kDepth][kTile], float (&rs)[kDepth][kTile],
                                            int lr, int lc, const float (&in_l)[kLoad],
                                            const float (&in_r)[kLoad]) {
#pragma unroll
  for (int m = 0; m < kLoad; ++m) {
    ls[lr][lc + m] = in_l[m];
    rs[lr][lc + m] = in_r[m];
  }
}

// left [c, t, rows] and right [c, t, cols] contiguous (element types L and R), factors [c];
// self [rows, cols] with row stride ld; partial [splits - 1, rows, cols] (unused for one split).
// blockIdx.x numbers the tiles row-major over tiles_x tiles a row; blockIdx.z is the split.
template <typename L, typename R>
__global__ void __launch_bounds__(kThreads, 1)
    sample_products_kernel(const L* __restrict__ left, const R* __restrict__ right,
                           const float* __restrict__ factors, float* __restrict__ self,
                           float* __restrict__ partial, int64_t ld, int64_t c, int64_t t,
                           int64_t rows, int64_t cols, int64_t per_split, int64_t tiles_x) {
  // Two stages: the block computes from one while the next is stored into the other.
  __shared__ __align__(16) float ls[2][kDepth][kTile];
  __shared__ __align__(16) float rs[2][kDepth][kTile];
  const int tx = threadIdx.x % kSide, ty = threadIdx.x / kSide;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) / tiles_x * kTile;
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) % tiles_x * kTile;
  const int split = blockIdx.z;
  const int64_t i_begin = split * per_split;
  const int64_t i_end = i_begin + per_split < c ? i_begin + per_split : c;
  // This thread's loads of a stage: row `lr` of the stage, entries lc .. lc + kLoad - 1.
  const int lr = threadIdx.x / (kTile / kLoad), lc = (threadIdx.x % (kTile / kLoad)) * kLoad;

  float acc[kMicro][kMicro];
#pragma unroll
  for (int a = 0; a < kMicro; ++a) {
#pragma unroll
    for (int b = 0; b < kMicro; ++b) {
      const int64_t r = r0 + side_offset(ty, a), k = k0 + side_offset(tx, b);
      acc[a][b] = (split == 0 && r < rows && k < cols) ? self[r * ld + k] : 0.0f;
    }
  }
  float part[kMicro][kMicro];
#pragma unroll
  for (int a = 0; a < kMicro; ++a)
#pragma unroll
    for (int b = 0; b < kMicro; ++b) part[a][b] = 0.0f;

  float next_l[kLoad], next_r[kLoad];  // the next stage's entries, on their way to shared memory
  int64_t i = next_kept(factors, i_begin, i_end), s0 = 0;
  if (i < i_end) {
    load_stage(left, right, factors[i], t, rows, cols, i, 0, lr, r0 + lc, k0 + lc, next_l,
               next_r);
    store_stage(ls[0], rs[0], lr, lc, next_l, next_r);
  }
  __syncthreads();
  int buffer = 0;
  while (i < i_end) {  // i, s0 and the loop's exit are the same in every thread of the block
    int64_t next_i = i, next_s0 = s0 + kDepth;
    const bool last_stage = next_s0 >= t;
    if (last_stage) {
      next_i = next_kept(factors, i + 1, i_end);
      next_s0 = 0;
    }
    const bool more = next_i < i_end;
    if (more)  // in flight while this stage is computed
      load_stage(left, right, factors[next_i], t, rows, cols, next_i, next_s0, lr, r0 + lc,
                 k0 + lc, next_l, next_r);
    const int depth = t - s0 < kDepth ? static_cast<int>(t - s0) : kDepth;
    for (int u = 0; u < depth; ++u) {
      const float4 l_lo = *reinterpret_cast<const float4*>(&ls[buffer][u][ty * 4]);
      const float4 l_hi = *reinterpret_cast<const float4*>(&ls[buffer][u][kHalf + ty * 4]);
      const float4 r_lo = *reinterpret_cast<const float4*>(&rs[buffer][u][tx * 4]);
      const float4 r_hi = *reinterpret_cast<const float4*>(&rs[buffer][u][kHalf + tx * 4]);
      const float lf[kMicro] = {l_lo.x, l_lo.y, l_lo.z, l_lo.w, l_hi.x, l_hi.y, l_hi.z, l_hi.w};
      const float rf[kMicro] = {r_lo.x, r_lo.y, r_lo.z, r_lo.w, r_hi.x, r_hi.y, r_hi.z, r_hi.w};
#pragma unroll
      for (int a = 0; a < kMicro; ++a) {
#pragma unroll
        for (int b = 0; b < kMicro; ++b) part[a][b] = __fmaf_rn(lf[a], rf[b], part[a][b]);
      }
    }
    if (more)  // that buffer was last read in the stage before this one, behind its barrier
      store_stage(ls[buffer ^ 1], rs[buffer ^ 1], lr, lc, next_l, next_r);
    if (last_stage) {  // sample i's contribution is whole: add it, start the next from zero
#pragma unroll
      for (int a = 0; a < kMicro; ++a) {
#pragma unroll
        for (int b = 0; b < kMicro; ++b) {
          acc[a][b] = __fadd_rn(acc[a][b], part[a][b]);
          part[a][b] = 0.0f;
        }
      }
    }
    __syncthreads();  // the next stage is stored before anyone reads it
    buffer ^= 1;
    i = next_i;
    s0 = next_s0;
  }
#pragma unroll
  for (int a = 0; a < kMicro; ++a) {
    const int64_t r = r0 + side_offset(ty, a);
    if (r >= rows) continue;
#pragma unroll
    for (int b = 0; b < kMicro; ++b) {
      const int64_t k = k0 + side_offset(tx, b);
      if (k >= cols) continue;
      if (split == 0) {
        self[r * ld + k] = acc[a][b];
      } else {
        partial[((split - 1) * rows + r) * cols + k] = acc[a][b];
      }
    }
  }
}

// self[r, k] = ((self + partial[0]) + partial[1]) + ... over the splits - 1 partials, in order.
__global__ void add_partials_kernel(float* __restrict__ self, const float* __restrict__ partial,
                                    int64_t ld, int64_t rows, int64_t cols, int64_t count) {
  const int64_t total = rows * cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / cols, k = e % cols;
    float v = self[r * ld + k];
    for (int64_t z = 0; z < count; ++z) v = __fadd_rn(v, partial[z * total + e]);
    self[r * ld + k] = v;
  }
}

// Splits that bring the launch to about two blocks per SM (two waves: at its register count one
// block fits on an SM at a time), at most kMaxSplits and one per sample.
int64_t auto_splits(int64_t tiles, int64_t c) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = (2 * static_cast<int64_t>(sms) + tiles - 1) / std::max<int64_t>(tiles, 1);
  return std::max<int64_t>(1, std::min<int64_t>({want, kMaxSplits, c}));
}

at::Tensor& add_sample_products_cuda_(at::Tensor& self, const at::Tensor& left,
                                      const at::Tensor& right, const at::Tensor& scale,
                                      int64_t splits) {
  sample_products::check(self, left, right, scale, splits);
  const int64_t c = left.size(0), t = left.size(1), rows = self.size(0), cols = self.size(1);
  if (c == 0 || t == 0 || rows == 0 || cols == 0) return self;
  const c10::cuda::CUDAGuard guard(self.device());
  const at::Tensor l = left.contiguous(), r = right.contiguous(), f = scale.contiguous();
  const int64_t tiles_x = (cols + kTile - 1) / kTile, tiles_y = (rows + kTile - 1) / kTile;
  TORCH_CHECK(tiles_x * tiles_y <= INT32_MAX, "dpzero::_add_sample_products_: ", rows, " x ",
              cols, " has more than 2^31 - 1 tiles of ", kTile, " x ", kTile);
  const int64_t n = std::min<int64_t>(splits == 0 ? auto_splits(tiles_x * tiles_y, c) : splits,
                                      std::min<int64_t>(c, kMaxSplits));
  const int64_t per_split = (c + n - 1) / n;
  const int64_t used = (c + per_split - 1) / per_split;  // splits that hold a sample
  at::Tensor partial;
  if (used > 1) partial = at::empty({used - 1, rows, cols}, self.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(tiles_x * tiles_y), 1, static_cast<unsigned>(used));
  with_scalar_type("_add_sample_products_", l.scalar_type(), [&](auto left_type) {
    using L = decltype(left_type);
    with_scalar_type("_add_sample_products_", r.scalar_type(), [&](auto right_type) {
      using R = decltype(right_type);
      sample_products_kernel<L, R><<<grid, kThreads, 0, stream>>>(
          l.data_ptr<L>(), r.data_ptr<R>(), f.data_ptr<float>(), self.data_ptr<float>(),
          used > 1 ? partial.data_ptr<float>() : nullptr, self.stride(0), c, t, rows, cols,
          per_split, tiles_x);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  if (used > 1) {
    constexpr int kAddThreads = 256;
    const int blocks =
        static_cast<int>(std::min<int64_t>((rows * cols + kAddThreads - 1) / kAddThreads, 65535));
    add_partials_kernel<<<blocks, kAddThreads, 0, stream>>>(
        self.data_ptr<float>(), partial.data_ptr<float>(), self.stride(0), rows, cols, used - 1);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  self.unsafeGetTensorImpl()->bump_version();
  return self;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CUDA, m) { m.impl("_add_sample_products_", &add_sample_products_cuda_); }

}  // namespace dpzero::kernels
