// kernels/cpu/sample_products.h — the host clipped sum's sum of per-sample products (Note
// [clipped-sum rounding] in kernels/per_sample/common.h), called by add_linear_clipped_sum
// (kernels/per_sample/linear.h) in place of a batched GEMM and a sum over its samples.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace dpzero::kernels {

// out [rows, cols] += sum_i left[i]^T right[i], with left [c, T, rows] and right [c, T, cols]
// float32 on the host and out a float32 host matrix with unit column stride; each sample's
// product is formed alone and then added (add_sample_rows below), so nothing of the
// size of c products is held. Returns false, having done nothing, where that kernel does not
// apply (no AVX2 and FMA, other dtypes or strides, more than 64 rows per sample, out sharing
// memory with itself or an operand): the caller forms the products itself. A write bumps out's
// version counter, as any in-place op does.
bool add_sample_products(at::Tensor& out, const at::Tensor& left, const at::Tensor& right);

// What add_sample_products does on one thread: rows [r0, r1) of out (row stride ld) +=
// sum_i left[i]^T right[i] (left [c, t, rows], right [c, t, cols] float32, contiguous), sample
// after sample, each sample's rows in blocks (sample_products_simd::add_block, or
// add_block_avx512 when `wide`). Call only where the lanes exist (available(), wide_available()).
void add_sample_rows(float* out, int64_t ld, const float* left, const float* right, int64_t c,
                     int64_t t, int64_t rows, int64_t cols, int64_t r0, int64_t r1, bool wide);

}  // namespace dpzero::kernels
