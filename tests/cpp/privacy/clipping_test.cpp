// Clipping policies (privacy/clipping.h) against their defining formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <algorithm>

#include "privacy/clipping.h"

namespace dpzero::privacy {
namespace {

TEST(ClipFactor, FlatAutomaticAndNonFinite) {
  EXPECT_FLOAT_EQ(clip_factor(0.5f, 1.0f, ClipMode::kFlat, 0.01f), 1.0f);  // already inside
  EXPECT_FLOAT_EQ(clip_factor(4.0f, 1.0f, ClipMode::kFlat, 0.01f), 1.0f / (4.0f + 1e-6f));
  EXPECT_FLOAT_EQ(clip_factor(4.0f, 2.0f, ClipMode::kAutomatic, 0.01f), 2.0f / 4.01f);
  EXPECT_FLOAT_EQ(clip_factor(0.0f, 2.0f, ClipMode::kAutomatic, 0.01f), 200.0f);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(clip_factor(bad, 1.0f, ClipMode::kFlat, 0.01f), 0.0f);
    EXPECT_EQ(clip_factor(bad, 1.0f, ClipMode::kAutomatic, 0.01f), 0.0f);
  }
  // Negative norms (never a real norm) must not produce a factor either.
  EXPECT_EQ(clip_factor(-0.5f, 1.0f, ClipMode::kFlat, 0.01f), 0.0f);
  EXPECT_EQ(clip_factor(-1e-7f, 1.0f, ClipMode::kAutomatic, 0.01f), 0.0f);
}

TEST(ClipFactor, SensitivityHoldsExactlyNotJustUpToRounding) {
  // n * c is exact in fp64 (two fp32 factors); it must never exceed C, for a million random norms
  // spread over 60 binades and several C — the fp32 formula alone overshoots in about half of them.
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> exponent(-20.0, 40.0);
  int overshoot_naive = 0;
  for (float C : {1.0f, 0.1f, 1.5f, 3.7e-3f}) {
    for (int i = 0; i < 250000; ++i) {
      const float n = static_cast<float>(std::exp2(exponent(rng)));
      for (ClipMode mode : {ClipMode::kFlat, ClipMode::kAutomatic}) {
        const float c = clip_factor(n, C, mode, 0.01f);
        ASSERT_LE(static_cast<double>(n) * c, static_cast<double>(C))
            << "n=" << n << " C=" << C << " mode=" << static_cast<int>(mode);
        ASSERT_GE(c, 0.0f);
      }
      const float naive = std::min(1.0f, C / (n + 1e-6f));
      overshoot_naive += static_cast<double>(n) * naive > static_cast<double>(C);
    }
  }
  EXPECT_GT(overshoot_naive, 0);  // the property is not vacuous: plain fp32 division overshoots
}

// C rounded toward zero (float32(0.1) rounded to nearest is above 0.1).
TEST(Threshold, RoundsTowardZeroToFloat32) {
  for (double c : {0.1, 0.3, 1.0 / 3.0, 1e-3, 1.0, 0.25, 7.0 / 3.0, 1e30}) {
    const float t = threshold_f32(c);
    EXPECT_LE(static_cast<double>(t), c) << c;
    EXPECT_GT(static_cast<double>(std::nextafterf(t, INFINITY)), c) << c;  // the largest such
  }
  EXPECT_GT(static_cast<double>(static_cast<float>(0.1)), 0.1);  // what rounding to nearest did
  EXPECT_EQ(threshold_f32(0.25), 0.25f);                          // exact values stay
}

// The float32 thresholds the clipping uses: each <= its float64 value C sqrt(1/k), and their
// squares sum to at most C^2, exactly (long double holds the squares and their sum exactly here:
// equal float32 values, 48-bit products, at most 11 of them).
TEST(GroupThresholds, Float32ThresholdsNeverExceedTheBudget) {
  for (double c : {0.1, 0.3, 1.0 / 3.0, 1e-3, 1.0}) {
    for (int64_t k : {1, 3, 5, 7, 11}) {
      const auto t = group_thresholds(c, k);
      long double sum = 0;
      for (double tg : t) {
        ASSERT_EQ(static_cast<double>(static_cast<float>(tg)), tg) << "not a float32: " << tg;
        ASSERT_LE(tg, c * std::sqrt(1.0 / static_cast<double>(k)) * (1 + 1e-15)) << c << " " << k;
        sum += static_cast<long double>(tg) * tg;
      }
      EXPECT_LE(sum, static_cast<long double>(c) * c) << "C=" << c << " k=" << k;
      EXPECT_GT(sum, static_cast<long double>(c) * c * (1 - 1e-6L)) << "C=" << c << " k=" << k;
    }
  }
}

TEST(GroupThresholds, SquaresSumToCSquared) {
  for (auto weights : {std::vector<double>{}, std::vector<double>{1, 2, 3, 4}}) {
    const auto t = group_thresholds(2.0, 4, weights);
    ASSERT_EQ(t.size(), 4u);
    double sq = 0;
    for (double c : t) sq += c * c;
    EXPECT_LE(sq, 4.0);
    EXPECT_NEAR(sq, 4.0, 1e-6);
    // Equal split: C / sqrt(4) = 1, stepped down one float32 ulp (the sum landed on C^2).
    if (weights.empty()) EXPECT_EQ(t[0], static_cast<double>(std::nextafterf(1.0f, 0.0f)));
    else EXPECT_NEAR(t[3] / t[0], 2.0, 1e-6);  // sqrt(4 / 1), up to float32 rounding
  }
  EXPECT_THROW(group_thresholds(0.0, 2), std::invalid_argument);
  EXPECT_THROW(group_thresholds(1.0, 0), std::invalid_argument);
  EXPECT_THROW(group_thresholds(1.0, 2, {1.0}), std::invalid_argument);
  EXPECT_THROW(group_thresholds(1.0, 2, {1.0, -1.0}), std::invalid_argument);
  // Note [smallest clip norm]: C, or a group's share of it, below 2^-64 is refused, naming it.
  EXPECT_EQ(group_thresholds(0x1p-64, 1), std::vector<double>{0x1p-64});
  const auto below = [](double c, std::vector<double> w) {
    try {
      group_thresholds(c, static_cast<int64_t>(w.size()), w);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const std::string c_below = below(1e-42, {1.0});
  EXPECT_EQ(c_below.rfind("max_grad_norm C = 1", 0), 0u) << c_below;
  EXPECT_NE(c_below.find("e-42 is below 2^-64"), std::string::npos) << c_below;
  const std::string group_below = below(1.0, {1.0, 1e-120});
  EXPECT_EQ(group_below.rfind("clipping group 1's threshold C sqrt(w_g / sum w) = ", 0), 0u)
      << group_below;
  EXPECT_NE(group_below.find("e-6"), std::string::npos) << group_below;
  EXPECT_NE(group_below.find("raise C or that group's weight"), std::string::npos) << group_below;
  EXPECT_THROW(parse_clip_mode("ghost"), std::invalid_argument);
}

}  // namespace
}  // namespace dpzero::privacy
