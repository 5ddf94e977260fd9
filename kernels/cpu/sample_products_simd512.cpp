// kernels/cpu/sample_products_simd512.cpp — sample_products_simd::add_block_avx512, the
// sixteen-lane twin of kernels/cpu/sample_products_simd.cpp (kernels/cpu/sample_products_simd.h).
// Built with -mavx512f -mfma -ffp-contract=off (kernels/CMakeLists.txt); it runs only after
// sample_products_simd::wide_available()'s CPUID check.
#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/sample_products_simd.h"

namespace dpzero::kernels::sample_products_simd {
namespace {

// The lanes [k0, k0 + 16) of a row of `cols` columns that exist.
inline __mmask16 lane_mask(int64_t k0, int64_t cols) {
  const int64_t n = cols - k0;
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : n <= 0 ? static_cast<__mmask16>(0)
                          : static_cast<__mmask16>((1u << n) - 1u);
}

// One tile: the block's MR rows, 32 columns from k0; otherwise as the eight-lane tile, so every
// entry sees the same operations in the same order (and gets the same bits).
template <int MR>
void tile(float* out, int64_t ld, const float* panel, const float* right, int64_t t, int64_t cols,
          int64_t k0) {
  const __mmask16 m0 = lane_mask(k0, cols), m1 = lane_mask(k0 + 16, cols);
  __m512 p[MR][2];
  #pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) p[m][0] = p[m][1] = _mm512_setzero_ps();
  const float* l = panel;
  const float* r = right + k0;
  for (int64_t s = 0; s < t; ++s, l += MR, r += cols) {
    const __m512 b0 = _mm512_maskz_loadu_ps(m0, r), b1 = _mm512_maskz_loadu_ps(m1, r + 16);
    #pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(l[m]);
      p[m][0] = _mm512_fmadd_ps(a, b0, p[m][0]);
      p[m][1] = _mm512_fmadd_ps(a, b1, p[m][1]);
    }
  }
  #pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) {
    float* o = out + m * ld + k0;
    _mm512_mask_storeu_ps(o, m0, _mm512_add_ps(_mm512_maskz_loadu_ps(m0, o), p[m][0]));
    _mm512_mask_storeu_ps(o + 16, m1, _mm512_add_ps(_mm512_maskz_loadu_ps(m1, o + 16), p[m][1]));
  }
}

}  // namespace

void add_block_avx512(float* out, int64_t ld, const float* panel, const float* right, int64_t t,
                      int64_t cols, int64_t n) {
  for (int64_t k = 0; k < cols; k += 32) {
    switch (n) {
      case 12: tile<12>(out, ld, panel, right, t, cols, k); break;
      case 11: tile<11>(out, ld, panel, right, t, cols, k); break;
      case 10: tile<10>(out, ld, panel, right, t, cols, k); break;
      case 9: tile<9>(out, ld, panel, right, t, cols, k); break;
      case 8: tile<8>(out, ld, panel, right, t, cols, k); break;
      case 7: tile<7>(out, ld, panel, right, t, cols, k); break;
      case 6: tile<6>(out, ld, panel, right, t, cols, k); break;
      case 5: tile<5>(out, ld, panel, right, t, cols, k); break;
      case 4: tile<4>(out, ld, panel, right, t, cols, k); break;
      case 3: tile<3>(out, ld, panel, right, t, cols, k); break;
      case 2: tile<2>(out, ld, panel, right, t, cols, k); break;
      default: tile<1>(out, ld, panel, right, t, cols, k); break;
    }
  }
}

}  // namespace dpzero::kernels::sample_products_simd
