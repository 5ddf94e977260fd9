// kernels/cpu/sample_products_simd.h — the host clipped sum of Note [clipped-sum rounding]
// (kernels/per_sample/common.h) in AVX2 registers (kernels/cpu/sample_products_simd.cpp, built
// with -mavx2 -mfma) or AVX-512 ones (kernels/cpu/sample_products_simd512.cpp, -mavx512f -mfma):
// each sample's product of its T rows formed alone, then added.
//
// Like kernels/cpu/gram_simd.h, this header and its .cpp include no ATen headers and call no
// inline function of the project: an inline function emitted under -mavx2 could be the copy the
// linker keeps for callers on CPUs without AVX2.
#pragma once

#include <cstdint>

namespace dpzero::kernels::sample_products_simd {

// True iff this CPU runs AVX2 and FMA, so add_rows may be called; wide_available(): AVX-512F
// too, so add_rows_avx512 may be. Defined in kernels/cpu/sample_products.cpp, built for the
// baseline ISA.
bool available();
bool wide_available();

// Rows [r0, r1) of out [rows, cols] float32 (row stride ld, unit column stride):
//   out[r, k] += sum_i P_i[r, k],   P_i[r, k] = sum_t left[i, t, r] * right[i, t, k],
// left [c, t, rows] and right [c, t, cols] float32, contiguous. Each P_i is formed alone, in
// registers from zero, by t fused multiply-adds (within gamma_t sum_t |left right| of the exact
// value), and only then added to out, one rounding per sample: one sample's rows never meet
// another's partial sums. Every entry is computed by the same operations in the same order as
// std::fma(left, right, p) from p = 0 over t, then out + p: its bits depend on neither the lane
// width, r0, r1 nor the other entries (tests/cpp/torch/sample_products_test.cpp).
// `panel` is scratch for t * kMaxTileRows floats.
constexpr int64_t kMaxTileRows = 12;
void add_rows(float* out, int64_t ld, const float* left, const float* right, int64_t c, int64_t t,
              int64_t rows, int64_t cols, int64_t r0, int64_t r1, float* panel);
void add_rows_avx512(float* out, int64_t ld, const float* left, const float* right, int64_t c,
                     int64_t t, int64_t rows, int64_t cols, int64_t r0, int64_t r1, float* panel);

}  // namespace dpzero::kernels::sample_products_simd
