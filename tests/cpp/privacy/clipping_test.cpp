// Clipping policies (privacy/clipping.h) against their defining formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>

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
  // Sensitivity: a clipped norm never exceeds C, whatever the input norm.
  for (float n : {1e-8f, 0.3f, 1.0f, 7.0f, 1e30f}) {
    EXPECT_LE(n * clip_factor(n, 1.5f, ClipMode::kFlat, 0.01f), 1.5f);
    EXPECT_LE(n * clip_factor(n, 1.5f, ClipMode::kAutomatic, 0.01f), 1.5f);
  }
}

TEST(GroupThresholds, SquaresSumToCSquared) {
  for (auto weights : {std::vector<double>{}, std::vector<double>{1, 2, 3, 4}}) {
    const auto t = group_thresholds(2.0, 4, weights);
    ASSERT_EQ(t.size(), 4u);
    double sq = 0;
    for (double c : t) sq += c * c;
    EXPECT_NEAR(sq, 4.0, 1e-12);
    if (weights.empty()) EXPECT_NEAR(t[0], 1.0, 1e-15);  // equal split: C / sqrt(4)
    else EXPECT_NEAR(t[3] / t[0], 2.0, 1e-12);           // sqrt(4 / 1)
  }
  EXPECT_THROW(group_thresholds(0.0, 2), std::invalid_argument);
  EXPECT_THROW(group_thresholds(1.0, 0), std::invalid_argument);
  EXPECT_THROW(group_thresholds(1.0, 2, {1.0}), std::invalid_argument);
  EXPECT_THROW(group_thresholds(1.0, 2, {1.0, -1.0}), std::invalid_argument);
  EXPECT_THROW(parse_clip_mode("ghost"), std::invalid_argument);
}

}  // namespace
}  // namespace dpzero::privacy
