// Known-answer tests for the ChaCha20 block function against RFC 8439 §2.3.2 and Appendix A.1, and
// the secure draw's layout (Note [secure noise]).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "privacy/chacha20.h"
#include "privacy/entropy.h"
#include "privacy/secure_noise.h"

namespace dpzero::privacy {
namespace {

TEST(ChaCha20, Rfc8439Section232BlockVector) {
  // Key 00 01 02 .. 1f, nonce 00:00:00:09:00:00:00:4a:00:00:00:00, block count 1.
  const ChaCha20Key key{{0x03020100u, 0x07060504u, 0x0b0a0908u, 0x0f0e0d0cu, 0x13121110u,
                         0x17161514u, 0x1b1a1918u, 0x1f1e1d1cu}};
  const uint32_t expected[16] = {0xe4e7f110u, 0x15593bd1u, 0x1fdd0f50u, 0xc47120a3u,
                                 0xc7f4d1c7u, 0x0368c033u, 0x9aaa2204u, 0x4e6cd4c3u,
                                 0x466482d2u, 0x09aa9f07u, 0x05d7c214u, 0xa2028bd9u,
                                 0xd19c12b5u, 0xb94e16deu, 0xe883d0cbu, 0x4e3c50a2u};
  const ChaCha20Block out = chacha20_block(key, 1u, 0x09000000u, 0x4a000000u, 0u);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(out.w[i], expected[i]) << "word " << i;
}

TEST(ChaCha20, Rfc8439AppendixA1Vector1) {
  const ChaCha20Key key{{0, 0, 0, 0, 0, 0, 0, 0}};
  const uint32_t expected[16] = {0xade0b876u, 0x903df1a0u, 0xe56a5d40u, 0x28bd8653u,
                                 0xb819d2bdu, 0x1aed8da0u, 0xccef36a8u, 0xc70d778bu,
                                 0x7c5941dau, 0x8d485751u, 0x3fe02477u, 0x374ad8b8u,
                                 0xf4b8436au, 0x1ca11815u, 0x69b687c3u, 0x8665eeb2u};
  const ChaCha20Block out = chacha20_block(key, 0u, 0u, 0u, 0u);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(out.w[i], expected[i]) << "word " << i;
}

TEST(SecureNoise, PairLayoutAndSumOfFourIndependentNormals) {
  const ChaCha20Key key{{1, 2, 3, 4, 5, 6, 7, 8}};
  // Recompute coordinates 6 and 7 (pair 3) from the block by hand: each sums one output of each
  // of the block's four Box–Muller pairs (cosines for 6, sines for 7), so four radii and angles
  // each; both outputs of one pair in one coordinate would be one sample (Note [secure noise]).
  const ChaCha20Block b = chacha20_block(key, 3u, 0u, 11u, kNoiseStream);
  double cosines = 0.0, sines = 0.0;
  for (int p = 0; p < 4; ++p) {
    const uint32_t* w = &b.w[4 * p];
    const double u2 = uniform_open01_f64(w[2], w[3]);
    const double r = box_muller_radius64(w[0], w[1]);
    cosines += r * std::cos(2.0 * M_PI * u2);
    sines += r * std::sin(2.0 * M_PI * u2);
  }
  EXPECT_NEAR(secure_noise_draw(key, 11u, 6), cosines / 2.0, 1e-12);
  EXPECT_NEAR(secure_noise_draw(key, 11u, 7), sines / 2.0, 1e-12);
  EXPECT_GT(uniform_open01_f64(0u, 0u), 0.0);
  EXPECT_LT(uniform_open01_f64(0xffffffffu, 0xffffffffu), 1.0);
}

TEST(Entropy, KeysDifferBetweenCalls) {
  const ChaCha20Key a = entropy_key(), b = entropy_key();
  int same = 0;
  for (int i = 0; i < 8; ++i) same += a.w[i] == b.w[i];
  EXPECT_LT(same, 8);  // 256 equal bits by chance: probability 2^-256
}

}  // namespace
}  // namespace dpzero::privacy
