// The small-T Grams of the CPU ghost kernels (kernels/cpu/gram_simd.h): the AVX-512 twin gives the
// AVX2 code's bits for every length tail d % 8 and every sequence length's parity, and both are
// the exact float64 inner products up to float64 rounding (a long double reference).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/gram_simd.h"
#include "tests/cpp/torch/spread_values.h"

namespace dpzero {
namespace {

namespace gram = kernels::gram_simd;

TEST(GramInLanes, Avx512GivesTheAvx2BitsAndBothTheInnerProducts) {
  if (!gram::available()) GTEST_SKIP() << "this CPU has no AVX2 and FMA";
  std::mt19937 rng(11);
  for (int64_t t : {1, 2, 3, 4, 7, 16, 17}) {
    for (int64_t d : {1, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 64, 67, 256}) {
      const std::vector<float> x = testing::spread_values(rng, t * d, 20);
      std::vector<double> scratch(static_cast<size_t>(t * d));
      std::vector<double> narrow(static_cast<size_t>(t * t), -1.0), wide = narrow;
      gram::gram_f32(x.data(), t, d, scratch.data(), narrow.data());
      for (int64_t s = 0; s < t; ++s) {
        for (int64_t u = 0; u < t; ++u) {
          long double exact = 0.0L, size = 0.0L;
          for (int64_t k = 0; k < d; ++k) {
            const long double p = static_cast<long double>(x[static_cast<size_t>(s * d + k)]) *
                                  static_cast<long double>(x[static_cast<size_t>(u * d + k)]);
            exact += p;
            size += std::fabs(p);
          }
          const double got = narrow[static_cast<size_t>(s * t + u)];
          EXPECT_LE(std::fabs(static_cast<long double>(got) - exact),
                    static_cast<long double>(d) * 1.2e-16L * size)
              << "t " << t << ", d " << d << ", entry " << s << ", " << u;
        }
      }
      if (!gram::wide_available()) continue;
      gram::gram_f32_avx512(x.data(), t, d, scratch.data(), wide.data());
      ASSERT_EQ(0, std::memcmp(narrow.data(), wide.data(), narrow.size() * sizeof(double)))
          << "t " << t << ", d " << d;
    }
  }
  if (!gram::wide_available()) GTEST_SKIP() << "this CPU has no AVX-512F (the AVX2 Grams checked)";
}

}  // namespace
}  // namespace dpzero
