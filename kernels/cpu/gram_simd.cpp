// kernels/cpu/gram_simd.cpp — gram_simd::gram_f32 in AVX2 lanes (kernels/cpu/gram_simd.h).
// Built with -mavx2 -mfma -ffp-contract=off (kernels/CMakeLists.txt); it runs only after
// gram_simd::available()'s CPUID check.
#include "kernels/cpu/gram_simd.h"

#include <immintrin.h>

#include <cstdint>

namespace dpzero::kernels::gram_simd {
namespace {

inline double lane_sum(__m256d v) {  // (v0 + v1) + (v2 + v3)
  const __m128d lo = _mm256_castpd256_pd128(v), hi = _mm256_extractf128_pd(v, 1);
  const __m128d pair = _mm_add_pd(lo, hi);  // (v0 + v2, v1 + v3)
  return _mm_cvtsd_f64(_mm_add_sd(pair, _mm_unpackhi_pd(pair, pair)));
}

// sum_k x[k] y[k] over float64 rows of length d. The products of float32 values converted to
// float64 are exact, so a fused multiply-add rounds exactly as the separate multiply and add
// would: one rounding per addition, whatever the order (gamma_d bound, gram_simd.h).
inline double dot(const double* x, const double* y, int64_t d) {
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  __m256d acc2 = _mm256_setzero_pd(), acc3 = _mm256_setzero_pd();
  int64_t k = 0;
  for (; k + 16 <= d; k += 16) {
    acc0 = _mm256_fmadd_pd(_mm256_loadu_pd(x + k), _mm256_loadu_pd(y + k), acc0);
    acc1 = _mm256_fmadd_pd(_mm256_loadu_pd(x + k + 4), _mm256_loadu_pd(y + k + 4), acc1);
    acc2 = _mm256_fmadd_pd(_mm256_loadu_pd(x + k + 8), _mm256_loadu_pd(y + k + 8), acc2);
    acc3 = _mm256_fmadd_pd(_mm256_loadu_pd(x + k + 12), _mm256_loadu_pd(y + k + 12), acc3);
  }
  for (; k + 4 <= d; k += 4) {
    acc0 = _mm256_fmadd_pd(_mm256_loadu_pd(x + k), _mm256_loadu_pd(y + k), acc0);
  }
  double sum = lane_sum(_mm256_add_pd(_mm256_add_pd(acc0, acc1), _mm256_add_pd(acc2, acc3)));
  for (; k < d; ++k) sum += x[k] * y[k];
  return sum;
}

}  // namespace

void gram_f32(const float* x, int64_t t, int64_t d, double* rows, double* gram) {
  const int64_t n = t * d;
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) _mm256_storeu_pd(rows + k, _mm256_cvtps_pd(_mm_loadu_ps(x + k)));
  for (; k < n; ++k) rows[k] = static_cast<double>(x[k]);
  for (int64_t s = 0; s < t; ++s) {
    for (int64_t u = 0; u <= s; ++u) {
      const double v = dot(rows + s * d, rows + u * d, d);
      gram[s * t + u] = v;
      gram[u * t + s] = v;
    }
  }
}

}  // namespace dpzero::kernels::gram_simd
