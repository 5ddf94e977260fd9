// kernels/cpu/row_sums_simd.cpp — row_sums_simd in AVX2 lanes (Note [row sums in lanes] in
// kernels/cpu/row_sums_simd.h). Built with -mavx2 -ffp-contract=off (kernels/CMakeLists.txt); it
// runs only after row_sums_simd::available()'s CPUID check.
//
// Rows go two at a time: each entry of the sums gets row r's value, then row r + 1's (the scalar
// order), in one load and one store, and the two rows' partial sums are independent chains of
// adds, so neither waits on the other's latency.
#include "kernels/cpu/row_sums_simd.h"

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace dpzero::kernels::row_sums_simd {
namespace {

inline __m256d widen(const float* x) { return _mm256_cvtps_pd(_mm_loadu_ps(x)); }

// The four partials of a register, with `tail` (the scalar entries after the last group of four)
// already in partial 0: (p0 + p1) + (p2 + p3).
struct Partials {
  alignas(32) double p[4];
  explicit Partials(__m256d v) { _mm256_store_pd(p, v); }
  double total() const { return (p[0] + p[1]) + (p[2] + p[3]); }
};

// sum_k (x[k] - shift), squared when `square`, as row_sums.cpp's sum4 sums it; for two rows at
// once (x0 with shift0 into *out0, x1 with shift1 into *out1).
inline void sum4_pair(const float* x0, const float* x1, int64_t d, double shift0, double shift1,
                      bool square, double* out0, double* out1) {
  const __m256d s0 = _mm256_set1_pd(shift0), s1 = _mm256_set1_pd(shift1);
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  int64_t k = 0;
  for (; k + 4 <= d; k += 4) {
    const __m256d c0 = _mm256_sub_pd(widen(x0 + k), s0);
    const __m256d c1 = _mm256_sub_pd(widen(x1 + k), s1);
    acc0 = _mm256_add_pd(acc0, square ? _mm256_mul_pd(c0, c0) : c0);
    acc1 = _mm256_add_pd(acc1, square ? _mm256_mul_pd(c1, c1) : c1);
  }
  Partials p0(acc0), p1(acc1);
  for (; k < d; ++k) {
    const double c0 = static_cast<double>(x0[k]) - shift0;
    const double c1 = static_cast<double>(x1[k]) - shift1;
    p0.p[0] += square ? c0 * c0 : c0;
    p1.p[0] += square ? c1 * c1 : c1;
  }
  *out0 = p0.total();
  *out1 = p1.total();
}

// x̂'s shift (the mean; 0 for RMSNorm) and 1/std of one row, as the scalar row computes them.
struct RowStats {
  double mean, rstd;
};

inline void stats_pair(const float* x0, const float* x1, int64_t d, double eps, bool rms,
                       RowStats* r0, RowStats* r1) {
  const double inv_d = 1.0 / static_cast<double>(d);
  double m0 = 0.0, m1 = 0.0;
  if (!rms) {
    sum4_pair(x0, x1, d, 0.0, 0.0, false, &m0, &m1);
    m0 *= inv_d;
    m1 *= inv_d;
  }
  double v0, v1;
  sum4_pair(x0, x1, d, m0, m1, true, &v0, &v1);
  *r0 = {m0, 1.0 / std::sqrt(v0 * inv_d + eps)};
  *r1 = {m1, 1.0 / std::sqrt(v1 * inv_d + eps)};
}

// One row (entry k given by the lane function e and the scalar function sc) added into sums;
// -> its squared norm.
template <typename Lane, typename Scalar>
inline double add_one(double* sums, int64_t d, const Lane& e, const Scalar& sc) {
  __m256d acc = _mm256_setzero_pd();
  int64_t k = 0;
  for (; k + 4 <= d; k += 4) {
    const __m256d v = e(k);
    _mm256_storeu_pd(sums + k, _mm256_add_pd(_mm256_loadu_pd(sums + k), v));
    acc = _mm256_add_pd(acc, _mm256_mul_pd(v, v));
  }
  Partials p(acc);
  for (; k < d; ++k) {
    const double v = sc(k);
    sums[k] += v;
    p.p[0] += v * v;
  }
  return p.total();
}

// Two rows added into sums, the first before the second in every entry; -> their squared norms.
template <typename Lane0, typename Lane1, typename Scalar0, typename Scalar1>
inline void add_two(double* sums, int64_t d, const Lane0& e0, const Lane1& e1, const Scalar0& s0,
                    const Scalar1& s1, double* q0, double* q1) {
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  int64_t k = 0;
  for (; k + 4 <= d; k += 4) {
    const __m256d v0 = e0(k), v1 = e1(k);
    _mm256_storeu_pd(sums + k, _mm256_add_pd(_mm256_add_pd(_mm256_loadu_pd(sums + k), v0), v1));
    acc0 = _mm256_add_pd(acc0, _mm256_mul_pd(v0, v0));
    acc1 = _mm256_add_pd(acc1, _mm256_mul_pd(v1, v1));
  }
  Partials p0(acc0), p1(acc1);
  for (; k < d; ++k) {
    const double v0 = s0(k), v1 = s1(k);
    sums[k] = (sums[k] + v0) + v1;
    p0.p[0] += v0 * v0;
    p1.p[0] += v1 * v1;
  }
  *q0 = p0.total();
  *q1 = p1.total();
}

// Row x's entries, widened (lanes and scalar).
inline auto raw_lane(const float* x) {
  return [x](int64_t k) { return widen(x + k); };
}
inline auto raw_scalar(const float* x) {
  return [x](int64_t k) { return static_cast<double>(x[k]); };
}

// A norm layer's row g ⊙ x̂, x̂ = (x - mean) * rstd (lanes and scalar).
inline auto norm_lane(const float* x, const float* g, RowStats st) {
  const __m256d m = _mm256_set1_pd(st.mean), r = _mm256_set1_pd(st.rstd);
  return [=](int64_t k) {
    return _mm256_mul_pd(widen(g + k), _mm256_mul_pd(_mm256_sub_pd(widen(x + k), m), r));
  };
}
inline auto norm_scalar(const float* x, const float* g, RowStats st) {
  return [=](int64_t k) { return static_cast<double>(g[k]) * ((x[k] - st.mean) * st.rstd); };
}

}  // namespace

double add_row(double* sums, const float* x, int64_t d) {
  return add_one(sums, d, raw_lane(x), raw_scalar(x));
}

double add_rows(double* sums, const float* x, int64_t t, int64_t d) {
  double s = 0.0;
  int64_t r = 0;
  for (; r + 2 <= t; r += 2) {
    const float* x0 = x + r * d;
    const float* x1 = x0 + d;
    double q0, q1;
    add_two(sums, d, raw_lane(x0), raw_lane(x1), raw_scalar(x0), raw_scalar(x1), &q0, &q1);
    s += std::sqrt(q0);
    s += std::sqrt(q1);
  }
  if (r < t) s += std::sqrt(add_row(sums, x + r * d, d));
  return s;
}

double add_norm_rows(double* sums, const float* x, const float* g, int64_t t, int64_t d,
                     double eps, bool rms) {
  if (d == 0) return 0.0;
  double s = 0.0;
  int64_t r = 0;
  for (; r + 2 <= t; r += 2) {
    const float *x0 = x + r * d, *x1 = x0 + d, *g0 = g + r * d, *g1 = g0 + d;
    RowStats st0, st1;
    stats_pair(x0, x1, d, eps, rms, &st0, &st1);
    double q0, q1;
    add_two(sums, d, norm_lane(x0, g0, st0), norm_lane(x1, g1, st1), norm_scalar(x0, g0, st0),
            norm_scalar(x1, g1, st1), &q0, &q1);
    s += std::sqrt(q0);
    s += std::sqrt(q1);
  }
  if (r < t) {  // an odd last row: its statistics twice over, its entries once
    const float *xr = x + r * d, *gr = g + r * d;
    RowStats st, unused;
    stats_pair(xr, xr, d, eps, rms, &st, &unused);
    s += std::sqrt(add_one(sums, d, norm_lane(xr, gr, st), norm_scalar(xr, gr, st)));
  }
  return s;
}

}  // namespace dpzero::kernels::row_sums_simd
