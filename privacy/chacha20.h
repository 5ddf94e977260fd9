// privacy/chacha20.h — the ChaCha20 block function (RFC 8439 §2.3), host and device.
//
// Secure mode's generator: a cryptographic PRF keyed by 256 bits of OS entropy, so the noise
// cannot be predicted from anything the run reveals (unlike a user-chosen Philox seed). Like
// Philox it is counter-based and stateless: block(key, counter, nonce) depends on nothing else.
#pragma once

#include <cstdint>

#include "privacy/host_device.h"

namespace dpzero::privacy {

struct ChaCha20Key {
  uint32_t w[8];  // the 256-bit key as eight little-endian words (RFC 8439 §2.3)
};

struct ChaCha20Block {
  uint32_t w[16];
};

namespace chacha_detail {

DPZERO_HOST_DEVICE uint32_t rotl(uint32_t x, int n) { return (x << n) | (x >> (32 - n)); }

// The quarter round, RFC 8439 §2.1.
DPZERO_HOST_DEVICE void quarter_round(uint32_t* s, int a, int b, int c, int d) {
  s[a] += s[b]; s[d] ^= s[a]; s[d] = rotl(s[d], 16);
  s[c] += s[d]; s[b] ^= s[c]; s[b] = rotl(s[b], 12);
  s[a] += s[b]; s[d] ^= s[a]; s[d] = rotl(s[d], 8);
  s[c] += s[d]; s[b] ^= s[c]; s[b] = rotl(s[b], 7);
}

}  // namespace chacha_detail

// RFC 8439 §2.3: state = constants "expand 32-byte k" | key | block counter | nonce (3 words);
// 20 rounds as 10 column + diagonal double rounds; output = final state + initial state.
DPZERO_HOST_DEVICE ChaCha20Block chacha20_block(const ChaCha20Key& key, uint32_t counter,
                                                uint32_t nonce0, uint32_t nonce1, uint32_t nonce2) {
  uint32_t init[16] = {0x61707865u, 0x3320646eu, 0x79622d32u, 0x6b206574u,
                       key.w[0], key.w[1], key.w[2], key.w[3],
                       key.w[4], key.w[5], key.w[6], key.w[7],
                       counter, nonce0, nonce1, nonce2};
  ChaCha20Block out;
  for (int i = 0; i < 16; ++i) out.w[i] = init[i];
  for (int r = 0; r < 10; ++r) {
    chacha_detail::quarter_round(out.w, 0, 4, 8, 12);
    chacha_detail::quarter_round(out.w, 1, 5, 9, 13);
    chacha_detail::quarter_round(out.w, 2, 6, 10, 14);
    chacha_detail::quarter_round(out.w, 3, 7, 11, 15);
    chacha_detail::quarter_round(out.w, 0, 5, 10, 15);
    chacha_detail::quarter_round(out.w, 1, 6, 11, 12);
    chacha_detail::quarter_round(out.w, 2, 7, 8, 13);
    chacha_detail::quarter_round(out.w, 3, 4, 9, 14);
  }
  for (int i = 0; i < 16; ++i) out.w[i] += init[i];
  return out;
}

}  // namespace dpzero::privacy
