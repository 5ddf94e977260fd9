// privacy/philox.h — the Philox4x32-10 counter-based block function, host and device.
//
// Reference: [SMDS11] Salmon, Moraes, Dror, Shaw. "Parallel Random Numbers: As Easy as 1, 2, 3",
// SC'11, §4 (Philox: multiply-hi/lo S-box and Weyl key schedule), with the constants and the
// known-answer vectors published alongside it (Random123 kat_vectors).
//
// A block function keeps no state: the same (key, counter) gives the same 128 bits on any thread,
// rank or device. dpzero's noise and sampler draws are built on it (see Note [noise ownership] in
// privacy/noise.h).
#pragma once

#include <cstdint>

#include "privacy/host_device.h"

namespace dpzero::privacy {

struct Philox4x32Counter {
  uint32_t v[4];
};
struct Philox4x32Key {
  uint32_t v[2];
};

namespace philox_detail {
// [SMDS11] Table 2: multipliers and Weyl constants (golden ratio, sqrt(3) - 1) for Philox4x32.
constexpr uint32_t kM0 = 0xD2511F53u;
constexpr uint32_t kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u;
constexpr uint32_t kW1 = 0xBB67AE85u;

DPZERO_HOST_DEVICE void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(product >> 32);
  lo = static_cast<uint32_t>(product);
}

// One Philox round [SMDS11 §4, Fig. 2]: two multiplications, the high halves xored with the other
// counter words and the round key, then the words permuted.
DPZERO_HOST_DEVICE Philox4x32Counter round(const Philox4x32Counter& c, const Philox4x32Key& k) {
  uint32_t hi0, lo0, hi1, lo1;
  mulhilo(kM0, c.v[0], hi0, lo0);
  mulhilo(kM1, c.v[2], hi1, lo1);
  return Philox4x32Counter{{hi1 ^ c.v[1] ^ k.v[0], lo1, hi0 ^ c.v[3] ^ k.v[1], lo0}};
}
}  // namespace philox_detail

// Philox4x32 with R = 10 rounds, the variant [SMDS11] recommends (Crush-resistant with margin).
DPZERO_HOST_DEVICE Philox4x32Counter philox4x32_10(Philox4x32Counter counter, Philox4x32Key key) {
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      key.v[0] += philox_detail::kW0;
      key.v[1] += philox_detail::kW1;
    }
    counter = philox_detail::round(counter, key);
  }
  return counter;
}

}  // namespace dpzero::privacy
