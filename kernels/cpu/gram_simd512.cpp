// kernels/cpu/gram_simd512.cpp — gram_simd::gram_f32_avx512, the AVX-512 twin of gram_f32
// (kernels/cpu/gram_simd.h). Built with -mavx512f -mfma -ffp-contract=off (kernels/CMakeLists.txt);
// it runs only after gram_simd::wide_available()'s CPUID check.
//
// Entry for entry the AVX2 code of gram_simd.cpp at twice the width: where that code keeps two
// four-lane accumulators per dot (lanes k..k+3 and k+4..k+7 of each step of eight), one eight-lane
// register here holds them as its low and high halves, a step of four touches the low half alone
// (masked), and the halves are added and reduced exactly as there. Every Gram entry therefore gets
// the AVX2 code's bits (tests/cpp/torch/gram_simd_test.cpp); the entries are only grouped
// differently, 4 x 4 at a time, so that sixteen independent chains keep the FMA units busy.
#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/gram_simd.h"

namespace dpzero::kernels::gram_simd {
namespace {

constexpr __mmask8 kLow = 0x0F;

inline double lane_sum(__m256d v) {  // (v0 + v2) + (v1 + v3), as gram_simd.cpp
  const __m128d lo = _mm256_castpd256_pd128(v), hi = _mm256_extractf128_pd(v, 1);
  const __m128d pair = _mm_add_pd(lo, hi);
  return _mm_cvtsd_f64(_mm_add_sd(pair, _mm_unpackhi_pd(pair, pair)));
}

// The low half (lanes k..k+3 of each step) plus the high half (k+4..k+7), then lane_sum.
inline double halves_sum(__m512d acc) {
  return lane_sum(_mm256_add_pd(_mm512_castpd512_pd256(acc), _mm512_extractf64x4_pd(acc, 1)));
}

// The R x C dots x[r] . y[c] (out[r * C + c]), each summed as gram_simd.cpp's dot() sums it: a
// block of them only gives the multiply-adds of different entries to different registers (R C
// independent chains, where one dot's chain of dependent fused multiply-adds would leave the units
// idle).
template <int R, int C>
inline void dots(const double* const* x, const double* const* y, int64_t d, double* out) {
  __m512d acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_pd();
  int64_t k = 0;
  for (; k + 8 <= d; k += 8) {
    __m512d q[C];
    for (int c = 0; c < C; ++c) q[c] = _mm512_loadu_pd(y[c] + k);
    for (int r = 0; r < R; ++r) {
      const __m512d p = _mm512_loadu_pd(x[r] + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_pd(p, q[c], acc[r][c]);
    }
  }
  for (; k + 4 <= d; k += 4) {
    __m512d q[C];
    for (int c = 0; c < C; ++c) q[c] = _mm512_maskz_loadu_pd(kLow, y[c] + k);
    for (int r = 0; r < R; ++r) {
      const __m512d p = _mm512_maskz_loadu_pd(kLow, x[r] + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_mask3_fmadd_pd(p, q[c], acc[r][c], kLow);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      double sum = halves_sum(acc[r][c]);
      for (int64_t j = k; j < d; ++j) sum += x[r][j] * y[c][j];
      out[r * C + c] = sum;
    }
  }
}

}  // namespace

void gram_f32_avx512(const float* x, int64_t t, int64_t d, double* rows, double* gram) {
  const int64_t n = t * d;
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) _mm512_storeu_pd(rows + k, _mm512_cvtps_pd(_mm256_loadu_ps(x + k)));
  for (; k < n; ++k) rows[k] = static_cast<double>(x[k]);
  const auto set = [&](int64_t s, int64_t u, double v) {
    gram[s * t + u] = v;
    gram[u * t + s] = v;
  };
  // Blocks of 4 x 4 entries below and on the diagonal; each entry is its own dot (above), so
  // the blocking does not change its bits.
  int64_t s = 0;
  for (; s + 4 <= t; s += 4) {
    const double* x[4] = {rows + s * d, rows + (s + 1) * d, rows + (s + 2) * d, rows + (s + 3) * d};
    double out[16];
    for (int64_t u = 0; u <= s; u += 4) {
      const double* y[4] = {rows + u * d, rows + (u + 1) * d, rows + (u + 2) * d,
                            rows + (u + 3) * d};
      dots<4, 4>(x, y, d, out);
      for (int r = 0; r < 4; ++r)
        for (int c = 0; c < 4 && u + c <= s + r; ++c) set(s + r, u + c, out[r * 4 + c]);
    }
  }
  for (; s < t; ++s) {  // the last t % 4 rows against every row up to their own
    const double* x[1] = {rows + s * d};
    int64_t u = 0;
    for (; u + 4 <= s + 1; u += 4) {
      const double* y[4] = {rows + u * d, rows + (u + 1) * d, rows + (u + 2) * d,
                            rows + (u + 3) * d};
      double out[4];
      dots<1, 4>(x, y, d, out);
      for (int c = 0; c < 4; ++c) set(s, u + c, out[c]);
    }
    for (; u <= s; ++u) {
      const double* y[1] = {rows + u * d};
      double out[1];
      dots<1, 1>(x, y, d, out);
      set(s, u, out[0]);
    }
  }
}

}  // namespace dpzero::kernels::gram_simd
