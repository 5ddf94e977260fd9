// kernels/cpu/gram_simd.cpp — gram_simd::gram_f32 in AVX2 lanes (kernels/cpu/gram_simd.h).
// Built with -mavx2 -mfma -ffp-contract=off (kernels/CMakeLists.txt); it runs only after
// gram_simd::available()'s CPUID check.
#include "kernels/cpu/gram_simd.h"

#include <immintrin.h>

#include <cstdint>

namespace dpzero::kernels::gram_simd {
namespace {

inline double lane_sum(__m256d v) {  // (v0 + v2) + (v1 + v3)
  const __m128d lo = _mm256_castpd256_pd128(v), hi = _mm256_extractf128_pd(v, 1);
  const __m128d pair = _mm_add_pd(lo, hi);  // (v0 + v2, v1 + v3)
  return _mm_cvtsd_f64(_mm_add_sd(pair, _mm_unpackhi_pd(pair, pair)));
}

// sum_k x[k] y[k] over float64 rows of length d. The products of float32 values converted to
// float64 are exact, so a fused multiply-add rounds exactly as the separate multiply and add
// would: one rounding per addition, whatever the order (gamma_d bound, gram_simd.h).
inline double dot(const double* x, const double* y, int64_t d) {
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  int64_t k = 0;
  for (; k + 8 <= d; k += 8) {
    acc0 = _mm256_fmadd_pd(_mm256_loadu_pd(x + k), _mm256_loadu_pd(y + k), acc0);
    acc1 = _mm256_fmadd_pd(_mm256_loadu_pd(x + k + 4), _mm256_loadu_pd(y + k + 4), acc1);
  }
  for (; k + 4 <= d; k += 4) {
    acc0 = _mm256_fmadd_pd(_mm256_loadu_pd(x + k), _mm256_loadu_pd(y + k), acc0);
  }
  double sum = lane_sum(_mm256_add_pd(acc0, acc1));
  for (; k < d; ++k) sum += x[k] * y[k];
  return sum;
}

// Adds the products of four lanes at k of rows x0, x1 with rows y0, y1 into acc (x0.y0, x0.y1,
// x1.y0, x1.y1).
inline void fma2x2(const double* x0, const double* x1, const double* y0, const double* y1,
                   int64_t k, __m256d acc[4]) {
  const __m256d p0 = _mm256_loadu_pd(x0 + k), p1 = _mm256_loadu_pd(x1 + k);
  const __m256d q0 = _mm256_loadu_pd(y0 + k), q1 = _mm256_loadu_pd(y1 + k);
  acc[0] = _mm256_fmadd_pd(p0, q0, acc[0]);
  acc[1] = _mm256_fmadd_pd(p0, q1, acc[1]);
  acc[2] = _mm256_fmadd_pd(p1, q0, acc[2]);
  acc[3] = _mm256_fmadd_pd(p1, q1, acc[3]);
}

// The four dots of rows x0, x1 with rows y0, y1 (out: x0.y0, x0.y1, x1.y0, x1.y1), each summed
// as dot() sums it; one pass over the four rows, so each load feeds two multiply-adds.
inline void dots2x2(const double* x0, const double* x1, const double* y0, const double* y1,
                    int64_t d, double out[4]) {
  __m256d even[4], odd[4];  // the lanes at k and at k + 4 of each step of 8
  for (int j = 0; j < 4; ++j) even[j] = odd[j] = _mm256_setzero_pd();
  int64_t k = 0;
  for (; k + 8 <= d; k += 8) {
    fma2x2(x0, x1, y0, y1, k, even);
    fma2x2(x0, x1, y0, y1, k + 4, odd);
  }
  for (; k + 4 <= d; k += 4) fma2x2(x0, x1, y0, y1, k, even);
  for (int j = 0; j < 4; ++j) out[j] = lane_sum(_mm256_add_pd(even[j], odd[j]));
  for (; k < d; ++k) {
    out[0] += x0[k] * y0[k];
    out[1] += x0[k] * y1[k];
    out[2] += x1[k] * y0[k];
    out[3] += x1[k] * y1[k];
  }
}

}  // namespace

void gram_f32(const float* x, int64_t t, int64_t d, double* rows, double* gram) {
  const int64_t n = t * d;
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) _mm256_storeu_pd(rows + k, _mm256_cvtps_pd(_mm_loadu_ps(x + k)));
  for (; k < n; ++k) rows[k] = static_cast<double>(x[k]);
  const auto set = [&](int64_t s, int64_t u, double v) {
    gram[s * t + u] = v;
    gram[u * t + s] = v;
  };
  int64_t s = 0;
  for (; s + 2 <= t; s += 2) {  // rows s, s + 1 against every earlier pair, then each other
    const double* x0 = rows + s * d;
    const double* x1 = x0 + d;
    double out[4];
    for (int64_t u = 0; u < s; u += 2) {
      dots2x2(x0, x1, rows + u * d, rows + (u + 1) * d, d, out);
      set(s, u, out[0]);
      set(s, u + 1, out[1]);
      set(s + 1, u, out[2]);
      set(s + 1, u + 1, out[3]);
    }
    dots2x2(x0, x1, x0, x1, d, out);
    set(s, s, out[0]);
    set(s + 1, s, out[1]);  // x0.x1: the same products in the same order as x1.x0
    set(s + 1, s + 1, out[3]);
  }
  for (; s < t; ++s) {  // an odd last row
    for (int64_t u = 0; u <= s; ++u) set(s, u, dot(rows + s * d, rows + u * d, d));
  }
}

}  // namespace dpzero::kernels::gram_simd
