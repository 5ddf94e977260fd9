// kernels/fingerprint_words.h — the words of dpzero::_state_fingerprint (schema in
// kernels/ops.cpp; kernels/cpu/fingerprint.cpp, its lanes in kernels/cpu/fingerprint_simd.h, and
// kernels/cuda/fingerprint.cu): the one definition of the sum every backend computes.
//
// For words w_j (integers of 1, 2, 4 or 8 bytes; 1-byte words zero-extended, wider ones
// sign-extended to 64 bits) and a key k, the fingerprint is
//     sum_j mix(w_j XOR (j + k) * kGolden)   modulo 2^64,
// with mix splitmix64's finaliser (Steele, Lea and Flood 2014, "Fast splittable pseudorandom
// number generators"): z ^= z >> 30; z *= kMix1; z ^= z >> 27; z *= kMix2; z ^= z >> 31. The sum
// is associative modulo 2^64, so no backend's order of additions (threads, lanes, blocks) can
// change it: every backend gives the same bits. Why this sum guards state is Note [state written
// from data] (src/dp/state_guard.h).
//
// Plain C++ with no ATen headers: the AVX-512 lanes and the CUDA kernel include it too.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DPZERO_FINGERPRINT_HD __host__ __device__
#else
#define DPZERO_FINGERPRINT_HD
#endif

namespace dpzero::kernels::fingerprint {

// splitmix64's golden-ratio increment, which spreads the positions, and its finaliser's two
// multipliers.
inline constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
inline constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ULL;
inline constexpr uint64_t kMix2 = 0x94D049BB133111EBULL;

// The term of word w (already extended to 64 bits) at position j under key. Internal linkage: each
// translation unit keeps its own copy, so the one built with AVX-512 instructions can never stand
// in for a caller on a CPU without them.
static inline DPZERO_FINGERPRINT_HD uint64_t term(uint64_t w, uint64_t j, uint64_t key) {
  uint64_t z = w ^ ((j + key) * kGolden);
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  return z ^ (z >> 31);
}

}  // namespace dpzero::kernels::fingerprint
