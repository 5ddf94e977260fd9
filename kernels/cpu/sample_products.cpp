// kernels/cpu/sample_products.cpp — see sample_products.h; the rows run in AVX2 or AVX-512 lanes
// (kernels/cpu/sample_products_simd.h), split across threads by blocks of rows.
#include "kernels/cpu/sample_products.h"

#include <algorithm>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels/cpu/cpu_lanes.h"
#include "kernels/cpu/sample_products_simd.h"
#include "kernels/per_sample/common.h"
#include "kernels/sample_products_checks.h"

namespace dpzero::kernels {

namespace sample_products_simd {
bool available() { return cpu_lanes::avx2_fma(); }
bool wide_available() { return cpu_lanes::avx512f(); }
}  // namespace sample_products_simd

// The longest sequence this kernel takes. Each tile reads its sample's T rows of a 12 or 6 row
// panel and of 32 or 16 columns; past about 64 rows those stop fitting the core's first-level
// cache next to each other, and the batched GEMM per sample with a sum after was measured as
// fast or faster (experiments/results/host.md has the shapes and times).
constexpr int64_t kMaxRowsPerSample = 64;

void add_sample_rows(float* out, int64_t ld, const float* left, const float* right, int64_t c,
                     int64_t t, int64_t rows, int64_t cols, int64_t r0, int64_t r1, bool wide) {
  namespace simd = sample_products_simd;
  const int64_t height = wide ? simd::kWideTileRows : simd::kTileRows;
  std::vector<float> panel(static_cast<size_t>(t * height));
  for (int64_t i = 0; i < c; ++i) {  // samples in turn: each entry adds them in order
    const float* sample_left = left + i * t * rows;
    const float* sample_right = right + i * t * cols;
    for (int64_t r = r0; r < r1; r += height) {
      // The block's rows of this sample's left operand, [t, n], read in order by every tile.
      const int64_t n = std::min(height, r1 - r);
      for (int64_t s = 0; s < t; ++s)
        for (int64_t m = 0; m < n; ++m) panel[s * n + m] = sample_left[s * rows + r + m];
      if (wide) {
        simd::add_block_avx512(out + r * ld, ld, panel.data(), sample_right, t, cols, n);
      } else {
        simd::add_block(out + r * ld, ld, panel.data(), sample_right, t, cols, n);
      }
    }
  }
}

bool add_sample_products(at::Tensor& out, const at::Tensor& left, const at::Tensor& right) {
  if (!sample_products_simd::available()) return false;
  const auto host_f32 = [](const at::Tensor& x) {
    return x.is_cpu() && x.scalar_type() == at::kFloat;
  };
  if (!host_f32(out) || !host_f32(left) || !host_f32(right) || out.dim() != 2 ||
      left.dim() != 3 || right.dim() != 3)
    return false;
  const int64_t c = left.size(0), t = left.size(1), rows = left.size(2), cols = right.size(2);
  if (right.size(0) != c || right.size(1) != t || out.size(0) != rows || out.size(1) != cols ||
      t > kMaxRowsPerSample)
    return false;
  if (rows == 0 || cols == 0 || c == 0 || t == 0) return true;
  if (out.stride(1) != 1 && cols > 1) return false;
  // The kernel writes `out` while it reads the operands: none may share memory with it, nor may
  // two of its entries (the caller's GEMM path refuses or handles those).
  if (at::has_internal_overlap(out) != at::MemOverlap::No ||
      at::get_overlap_status(out, left) != at::MemOverlapStatus::No ||
      at::get_overlap_status(out, right) != at::MemOverlapStatus::No)
    return false;
  const at::Tensor l = left.contiguous(), r = right.contiguous();
  float* o = out.data_ptr<float>();
  const int64_t ld = out.stride(0);
  const float* lp = l.data_ptr<float>();
  const float* rp = r.data_ptr<float>();
  // Threads take blocks of 24 rows (a multiple of both tile heights); no entry's bits depend on
  // the split.
  constexpr int64_t kBlock = 24;
  const int64_t blocks = (rows + kBlock - 1) / kBlock;
  const int64_t per_block = 2 * c * t * kBlock * cols;  // flops
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, per_block));
  const bool wide = sample_products_simd::wide_available();
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    add_sample_rows(o, ld, lp, rp, c, t, rows, cols, b0 * kBlock, std::min(rows, b1 * kBlock),
                    wide);
  });
  out.unsafeGetTensorImpl()->bump_version();  // an in-place write, as autograd must see it
  return true;
}

namespace {

// dpzero::_add_sample_products_ on the host (schema in kernels/ops.cpp; the CUDA one is
// kernels/cuda/sample_products.cu): sample after sample, its left rows times its factor (each
// rounded once), its contribution alone from zero (one float32 GEMM of its T rows), added to self
// (Note [clipped-sum rounding], Note [fused sample products]). What the device path of the
// clipped sums runs on CPU tensors (Note [device path]); `splits` is a CUDA launch choice and
// changes nothing here.
at::Tensor& add_sample_products_cpu_(at::Tensor& self, const at::Tensor& left,
                                     const at::Tensor& right, const at::Tensor& scale,
                                     int64_t splits) {
  sample_products::check(self, left, right, scale, splits);
  if (self.numel() == 0) return self;
  const per_sample::Fp32MatmulGuard precision;
  const at::Tensor factors = scale.contiguous();
  const float* f = factors.data_ptr<float>();
  for (int64_t i = 0; i < left.size(0); ++i) {
    if (!sample_products::adds(f[i])) continue;
    const at::Tensor scaled = left[i].to(at::kFloat).mul(f[i]);  // [T, rows]
    self.add_(at::mm(scaled.t(), right[i].to(at::kFloat)));      // [rows, cols]
  }
  return self;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CPU, m) { m.impl("_add_sample_products_", &add_sample_products_cpu_); }

}  // namespace dpzero::kernels
