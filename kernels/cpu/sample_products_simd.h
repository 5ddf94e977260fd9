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

// True iff this CPU runs AVX2 and FMA, so add_block may be called; wide_available(): AVX-512F
// too, so add_block_avx512 may be. Defined in kernels/cpu/sample_products.cpp, built for the
// baseline ISA.
bool available();
bool wide_available();

// One block of n rows of a sample's product added to out (n <= kTileRows for add_block,
// <= kWideTileRows for add_block_avx512): out [n, cols] float32 (row stride ld, unit column
// stride) gets out[m, k] += P[m, k], P[m, k] = sum_s panel[s, m] * right[s, k], with panel
// [t, n] and right [t, cols] float32, contiguous (the sample's rows of the block and its other
// operand). Each tile of P is formed in registers from zero by t fused multiply-adds (within
// gamma_t sum_s |panel right| of the exact value) and only then added to out, one rounding:
// every entry is computed by the same operations in the same order as std::fma(panel, right, p)
// from p = 0 over s, then out + p, whatever the lane width (sample_products.cpp adds the
// samples in turn; tests/cpp/torch/sample_products_test.cpp).
constexpr int64_t kTileRows = 6;       // 6 x 16 products: twelve registers, two loads, a broadcast
constexpr int64_t kWideTileRows = 12;  // 12 x 32: 24 registers
void add_block(float* out, int64_t ld, const float* panel, const float* right, int64_t t,
               int64_t cols, int64_t n);
void add_block_avx512(float* out, int64_t ld, const float* panel, const float* right, int64_t t,
                      int64_t cols, int64_t n);

}  // namespace dpzero::kernels::sample_products_simd
