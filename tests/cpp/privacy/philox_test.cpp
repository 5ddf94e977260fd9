// Known-answer tests for Philox4x32-10 against the vectors published with [SMDS11]
// (Random123 kat_vectors, format: counter[4] key[2] -> output[4]), and the noise-draw contract.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "privacy/noise.h"
#include "privacy/philox.h"

namespace dpzero::privacy {
namespace {

struct Kat {
  Philox4x32Counter counter;
  Philox4x32Key key;
  uint32_t expected[4];
};

TEST(Philox4x32_10, PublishedKnownAnswers) {
  const Kat kats[] = {
      {{{0u, 0u, 0u, 0u}}, {{0u, 0u}}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}},
       {{0xffffffffu, 0xffffffffu}},
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
       {{0xa4093822u, 0x299f31d0u}},
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Kat& kat : kats) {
    const Philox4x32Counter out = philox4x32_10(kat.counter, kat.key);
    for (int w = 0; w < 4; ++w) EXPECT_EQ(out.v[w], kat.expected[w]) << "word " << w;
  }
}

TEST(BoxMullerRadius, SixtyFourBitTailReachesBeyondNineSigma) {
  // Note [gaussian tail]: the largest radius is sqrt(130 ln 2) ~ 9.49 (u1 = 2^-65), the smallest 0.
  EXPECT_NEAR(box_muller_radius64(0u, 0u), std::sqrt(130.0 * std::log(2.0)), 1e-12);
  EXPECT_GT(box_muller_radius64(0u, 0u), 9.4);
  EXPECT_LT(box_muller_radius64(0xffffffffu, 0xffffffffu), 1e-6);
  // u1 = 1/2 (m = 2^63): radius sqrt(2 ln 2).
  EXPECT_NEAR(box_muller_radius64(0x80000000u, 0u), std::sqrt(2.0 * std::log(2.0)), 1e-12);
}

TEST(UniformOpen01, NeverZeroOrOne) {
  const float ulp = 5.9604644775390625e-08f;  // 2^-24
  EXPECT_EQ(uniform_open01(0u), ulp);                // smallest value, not 0
  EXPECT_EQ(uniform_open01(0xffffffffu), 1.0f - ulp);  // largest value, not 1
  EXPECT_EQ(uniform_open01(0x80000000u), 0.5f + ulp);  // cells are symmetric about 1/2
  EXPECT_EQ(uniform_open01(0x7fffffffu), 0.5f - ulp);
}

TEST(NoiseDraw, LaneOfItsBlockAndIndependentOfNeighbours) {
  const uint64_t seed = 0x0123456789abcdefull;
  for (uint64_t j : {0ull, 1ull, 2ull, 3ull, 4ull, 1000003ull, (1ull << 40) + 7}) {
    float z[kNoiseLanes];
    normal2(seed, 17u, kNoiseStream, j / kNoiseLanes, z);
    EXPECT_EQ(noise_draw(seed, 17u, j), z[j % kNoiseLanes]) << "j=" << j;
    EXPECT_TRUE(std::isfinite(z[j % kNoiseLanes]));
  }
  // Another step or another stream gives a different draw for the same coordinate.
  EXPECT_NE(noise_draw(seed, 17u, 5), noise_draw(seed, 18u, 5));
  float a[kNoiseLanes], b[kNoiseLanes];
  normal2(seed, 17u, kNoiseStream, 1, a);
  normal2(seed, 17u, kSamplerStream, 1, b);
  EXPECT_NE(a[0], b[0]);
}

}  // namespace
}  // namespace dpzero::privacy
