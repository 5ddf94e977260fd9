// kernels/cpu/sample_products_simd.cpp — sample_products_simd::add_block in AVX2 lanes
// (kernels/cpu/sample_products_simd.h). Built with -mavx2 -mfma -ffp-contract=off
// (kernels/CMakeLists.txt); it runs only after sample_products_simd::available()'s CPUID check.
#include "kernels/cpu/sample_products_simd.h"

#include <immintrin.h>

#include <cstdint>

namespace dpzero::kernels::sample_products_simd {
namespace {

// Lanes [k0, k0 + 8) of a row of `cols` columns that exist: all eight, or a mask of the first
// cols - k0 (a masked load reads nothing past the row's end).
inline __m256i lane_mask(int64_t k0, int64_t cols) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols - k0)), lane);
}

template <bool kFull>
inline __m256 load(const float* p, __m256i mask) {
  return kFull ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask);
}

template <bool kFull>
inline void store(float* p, __m256i mask, __m256 v) {
  if (kFull) {
    _mm256_storeu_ps(p, v);
  } else {
    _mm256_maskstore_ps(p, mask, v);
  }
}

// One tile: the block's MR rows, 16 columns from k0 (kFull: all sixteen exist; otherwise the
// lanes past `cols` are masked off): its MR x 16 products live in twelve or fewer registers,
// start from zero and take one fused multiply-add per row t; the finished P_i tile is then added
// to out's.
template <int MR, bool kFull>
void tile(float* out, int64_t ld, const float* panel, const float* right, int64_t t, int64_t cols,
          int64_t k0) {
  const __m256i m0 = lane_mask(k0, cols), m1 = lane_mask(k0 + 8, cols);
  __m256 p[MR][2];
  #pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) p[m][0] = p[m][1] = _mm256_setzero_ps();
  const float* l = panel;
  const float* r = right + k0;
  for (int64_t s = 0; s < t; ++s, l += MR, r += cols) {
    const __m256 b0 = load<kFull>(r, m0), b1 = load<kFull>(r + 8, m1);
    #pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      const __m256 a = _mm256_broadcast_ss(l + m);
      p[m][0] = _mm256_fmadd_ps(a, b0, p[m][0]);
      p[m][1] = _mm256_fmadd_ps(a, b1, p[m][1]);
    }
  }
  #pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) {
    float* o = out + m * ld + k0;
    store<kFull>(o, m0, _mm256_add_ps(load<kFull>(o, m0), p[m][0]));
    store<kFull>(o + 8, m1, _mm256_add_ps(load<kFull>(o + 8, m1), p[m][1]));
  }
}

template <int MR>
void tile(float* out, int64_t ld, const float* panel, const float* right, int64_t t, int64_t cols,
          int64_t k0) {
  if (k0 + 16 <= cols) {
    tile<MR, true>(out, ld, panel, right, t, cols, k0);
  } else {
    tile<MR, false>(out, ld, panel, right, t, cols, k0);
  }
}

}  // namespace

void add_block(float* out, int64_t ld, const float* panel, const float* right, int64_t t,
               int64_t cols, int64_t n) {
  for (int64_t k = 0; k < cols; k += 16) {
    switch (n) {
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
