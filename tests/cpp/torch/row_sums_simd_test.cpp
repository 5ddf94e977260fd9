// Note [row sums in lanes] (kernels/cpu/row_sums_simd.h): the AVX2 rows of the CPU row-sum kernels
// give the scalar reference's bits exactly (sums and squared norm), for every length tail d % 4,
// and both are the exact float64 quantities up to float64 rounding (a long double reference).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/row_sums_simd.h"
#include "tests/cpp/torch/spread_values.h"

namespace dpzero {
namespace {

namespace lanes = kernels::row_sums_simd;
namespace scalar = kernels::row_sums_scalar;

// d floats spread over a wide range of magnitudes (and signs), so that rounding differences in
// the order of additions would show.
std::vector<float> row(std::mt19937& rng, int64_t d) { return testing::spread_values(rng, d, 20); }

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

const int64_t kLengths[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 63, 64, 65, 192, 257};
const int64_t kRows[] = {0, 1, 2, 3, 5, 16};

// sums [d] starting from non-zero values (a sample's sums start from zeros; any start must do).
std::vector<double> start(int64_t d) {
  std::vector<double> s(static_cast<size_t>(d));
  for (int64_t k = 0; k < d; ++k) s[static_cast<size_t>(k)] = 0.25 * static_cast<double>(k) - 1.0;
  return s;
}

void expect_same_sums(const std::vector<double>& a, const std::vector<double>& b,
                      const std::string& where) {
  for (size_t k = 0; k < a.size(); ++k) {
    ASSERT_TRUE(same_bits(a[k], b[k])) << where << ", entry " << k << ": " << a[k] << " vs " << b[k];
  }
}

TEST(RowSumsInLanes, RowsAreTheScalarRowsBitForBit) {
  if (!lanes::available()) GTEST_SKIP() << "this CPU has no AVX2";
  std::mt19937 rng(7);
  for (const int64_t t : kRows) {
    for (const int64_t d : kLengths) {
      const std::string where = "t = " + std::to_string(t) + ", d = " + std::to_string(d);
      const std::vector<float> x = row(rng, t * d);
      std::vector<double> a = start(d), b = start(d);
      const double sa = lanes::add_rows(a.data(), x.data(), t, d);
      const double sb = scalar::add_rows(b.data(), x.data(), t, d);
      ASSERT_TRUE(same_bits(sa, sb)) << where << ": " << sa << " vs " << sb;
      expect_same_sums(a, b, where);
      // Both are the exact quantities up to float64 rounding (long double reference).
      long double s = 0.0L;
      for (int64_t r = 0; r < t; ++r) {
        long double q = 0.0L;
        for (int64_t k = 0; k < d; ++k) {
          const long double v = x[static_cast<size_t>(r * d + k)];
          q += v * v;
        }
        s += std::sqrt(q);
      }
      EXPECT_NEAR(static_cast<double>(s), sa, 1e-14 * static_cast<double>(s)) << where;
      // The single-row adder (the embedding rows' path) too, on the first row.
      if (t == 0) continue;
      std::vector<double> c = start(d), e = start(d);
      ASSERT_TRUE(same_bits(lanes::add_row(c.data(), x.data(), d),
                            scalar::add_row(e.data(), x.data(), d)))
          << where;
      expect_same_sums(c, e, where);
    }
  }
}

TEST(RowSumsInLanes, NormRowsAreTheScalarRowsBitForBit) {
  if (!lanes::available()) GTEST_SKIP() << "this CPU has no AVX2";
  std::mt19937 rng(8);
  for (const bool rms : {false, true}) {
    for (const int64_t t : kRows) {
      for (const int64_t d : kLengths) {
        const std::string where = "rms = " + std::to_string(rms) + ", t = " + std::to_string(t) +
                                  ", d = " + std::to_string(d);
        std::vector<float> x = row(rng, t * d);
        const std::vector<float> g = row(rng, t * d);
        // A constant row (zero variance: x̂ = 0 up to eps) among the others.
        if (t > 0) {
          for (int64_t k = 0; k < d; ++k) x[static_cast<size_t>(k)] = 3.0f;
        }
        std::vector<double> a = start(d), b = start(d);
        const double sa = lanes::add_norm_rows(a.data(), x.data(), g.data(), t, d, 1e-5, rms);
        const double sb = scalar::add_norm_rows(b.data(), x.data(), g.data(), t, d, 1e-5, rms);
        ASSERT_TRUE(same_bits(sa, sb)) << where << ": " << sa << " vs " << sb;
        expect_same_sums(a, b, where);
        // Reference: x̂ = (x - mean) / sqrt(var + eps) in long double.
        long double s = 0.0L;
        for (int64_t r = 0; r < t; ++r) {
          const float* xr = x.data() + r * d;
          const float* gr = g.data() + r * d;
          long double mean = 0.0L, var = 0.0L, q = 0.0L;
          if (!rms) {
            for (int64_t k = 0; k < d; ++k) mean += xr[k];
            mean /= d;
          }
          for (int64_t k = 0; k < d; ++k) var += (xr[k] - mean) * (xr[k] - mean);
          const long double rstd = 1.0L / std::sqrt(var / d + 1e-5L);
          for (int64_t k = 0; k < d; ++k) {
            const long double e = gr[k] * ((xr[k] - mean) * rstd);
            q += e * e;
          }
          s += std::sqrt(q);
        }
        EXPECT_NEAR(static_cast<double>(s), sa, 1e-12 * static_cast<double>(s)) << where;
      }
    }
  }
}

}  // namespace
}  // namespace dpzero
