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
// of a few samples. Here a block owns a 64 x 64 tile of self and walks its samples in order; each
// thread holds a 4 x 4 block of the tile twice over in registers:
//   part  this sample's product entries, from zero, one fused multiply-add per row in row order
//         (__fmaf_rn: the same single rounding per row as the host kernel's std::fma);
//   acc   the running sum: acc = acc + c_i * part, the product and the sum each rounded once
//         (__fmul_rn, __fadd_rn: no contraction), so the contribution added is c_i times the
//         sample's float32 product, within ((1 + u)(1 + gamma_T) - 1) c_i S_i of the exact one —
//         the bound the note certifies, with the factor applied after the sum instead of to one
//         operand's rows (no operand is rounded: 16-bit inputs are converted to float32 exactly
//         as they are staged).
// A sample whose factor is 0 or non-finite is skipped whole (sample_products::adds), so a dropped
// sample's NaN or Inf never enters a sum, as _scale_rows zeroes its rows on the other path.
// With one split acc starts from self's entry, so self's entry ends as
// ((self + c_1 p_1) + c_2 p_2) + ..., the order of the host reference in the GoogleTest, bit for
// bit. A layer with few tiles leaves SMs idle; then `splits` blocks share each tile's samples in
// contiguous runs: split 0 starts from self and writes it, split z > 0 starts from zero and writes
// partial[z - 1], and a second launch adds the partials into self in split order. No atomics: a
// run repeats bit for bit, and the split count is fixed by the device and the shape.
//
// Rows are staged 16 at a time in shared memory as float32 (kDepth x 64 of each operand); a
// thread reads its 4 left entries and 4 right entries of a row as two float4s and does 16 fused
// multiply-adds. The loop over a stage's rows stops at T, so the padding of a short last stage is
// never read into part.
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

constexpr int kTile = 64;       // self's rows and columns per block
constexpr int kDepth = 16;      // sample rows per shared-memory stage
constexpr int kMicro = 4;       // a thread's rows and columns of the tile
constexpr int kSide = kTile / kMicro;  // 16 threads a side
constexpr int kThreads = kSide * kSide;
constexpr int kMaxSplits = 8;
static_assert(kDepth * kTile == kThreads * kMicro, "a stage is one load of kMicro per thread");

template <typename T>
__device__ __forceinline__ float as_float(T x) {
  return static_cast<float>(x);
}

// left [c, t, rows] and right [c, t, cols] contiguous (element types L and R), factors [c];
// self [rows, cols] with row stride ld; partial [splits - 1, rows, cols] (unused for one split).
template <typename L, typename R>
__global__ void __launch_bounds__(kThreads)
    sample_products_kernel(const L* __restrict__ left, const R* __restrict__ right,
                           const float* __restrict__ factors, float* __restrict__ self,
                           float* __restrict__ partial, int64_t ld, int64_t c, int64_t t,
                           int64_t rows, int64_t cols, int64_t per_split) {
  __shared__ __align__(16) float ls[kDepth][kTile];
  __shared__ __align__(16) float rs[kDepth][kTile];
  const int tx = threadIdx.x % kSide, ty = threadIdx.x / kSide;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int split = blockIdx.z;
  const int64_t i0 = split * per_split, i1 = i0 + per_split < c ? i0 + per_split : c;
  // This thread's loads of a stage: row `lr` of the stage, columns lc .. lc + kMicro - 1.
  const int lr = threadIdx.x / (kTile / kMicro), lc = (threadIdx.x % (kTile / kMicro)) * kMicro;

  float acc[kMicro][kMicro];
  for (int a = 0; a < kMicro; ++a) {
    for (int b = 0; b < kMicro; ++b) {
      const int64_t r = r0 + ty * kMicro + a, k = k0 + tx * kMicro + b;
      acc[a][b] = (split == 0 && r < rows && k < cols) ? self[r * ld + k] : 0.0f;
    }
  }
  for (int64_t i = i0; i < i1; ++i) {
    const float f = factors[i];
    if (!(isfinite(f) && f != 0.0f)) continue;  // sample_products::adds: a dropped sample
    const L* li = left + i * t * rows;
    const R* ri = right + i * t * cols;
    float part[kMicro][kMicro];
    for (int a = 0; a < kMicro; ++a)
      for (int b = 0; b < kMicro; ++b) part[a][b] = 0.0f;
    for (int64_t s0 = 0; s0 < t; s0 += kDepth) {
      const int64_t s = s0 + lr;
      for (int m = 0; m < kMicro; ++m) {
        const int64_t r = r0 + lc + m, k = k0 + lc + m;
        ls[lr][lc + m] = (s < t && r < rows) ? as_float(li[s * rows + r]) : 0.0f;
        rs[lr][lc + m] = (s < t && k < cols) ? as_float(ri[s * cols + k]) : 0.0f;
      }
      __syncthreads();
      const int depth = t - s0 < kDepth ? static_cast<int>(t - s0) : kDepth;
      for (int u = 0; u < depth; ++u) {
        const float4 lv = *reinterpret_cast<const float4*>(&ls[u][ty * kMicro]);
        const float4 rv = *reinterpret_cast<const float4*>(&rs[u][tx * kMicro]);
        const float lf[kMicro] = {lv.x, lv.y, lv.z, lv.w};
        const float rf[kMicro] = {rv.x, rv.y, rv.z, rv.w};
#pragma unroll
        for (int a = 0; a < kMicro; ++a) {
#pragma unroll
          for (int b = 0; b < kMicro; ++b) part[a][b] = __fmaf_rn(lf[a], rf[b], part[a][b]);
        }
      }
      __syncthreads();  // the stage is read by every thread before the next overwrites it
    }
#pragma unroll
    for (int a = 0; a < kMicro; ++a) {
#pragma unroll
      for (int b = 0; b < kMicro; ++b) acc[a][b] = __fadd_rn(acc[a][b], __fmul_rn(f, part[a][b]));
    }
  }
  for (int a = 0; a < kMicro; ++a) {
    const int64_t r = r0 + ty * kMicro + a;
    if (r >= rows) continue;
    for (int b = 0; b < kMicro; ++b) {
      const int64_t k = k0 + tx * kMicro + b;
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

// Splits that bring the launch to about two blocks per SM, at most kMaxSplits and one per sample.
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
  TORCH_CHECK(tiles_x <= INT32_MAX && tiles_y <= 65535, "dpzero::_add_sample_products_: ", rows,
              " x ", cols, " exceeds the launch grid (rows at most ", 65535 * kTile, ")");
  const int64_t n = std::min<int64_t>(splits == 0 ? auto_splits(tiles_x * tiles_y, c) : splits,
                                      std::min<int64_t>(c, kMaxSplits));
  const int64_t per_split = (c + n - 1) / n;
  const int64_t used = (c + per_split - 1) / per_split;  // splits that hold a sample
  at::Tensor partial;
  if (used > 1) partial = at::empty({used - 1, rows, cols}, self.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(tiles_x), static_cast<unsigned>(tiles_y),
                  static_cast<unsigned>(used));
  with_scalar_type("_add_sample_products_", l.scalar_type(), [&](auto left_type) {
    using L = decltype(left_type);
    with_scalar_type("_add_sample_products_", r.scalar_type(), [&](auto right_type) {
      using R = decltype(right_type);
      sample_products_kernel<L, R><<<grid, kThreads, 0, stream>>>(
          l.data_ptr<L>(), r.data_ptr<R>(), f.data_ptr<float>(), self.data_ptr<float>(),
          used > 1 ? partial.data_ptr<float>() : nullptr, self.stride(0), c, t, rows, cols,
          per_split);
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
