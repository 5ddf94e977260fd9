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

namespace dpzero::kernels::fingerprint {

// splitmix64's golden-ratio increment, which spreads the positions, and its finaliser's two
// multipliers.
inline constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
inline constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ULL;
inline constexpr uint64_t kMix2 = 0x94D049BB133111EBULL;

}  // namespace dpzero::kernels::fingerprint
