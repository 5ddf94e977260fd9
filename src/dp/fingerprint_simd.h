// src/dp/fingerprint_simd.h — the host fingerprint of Note [state written from data]
// (state_guard.h) in AVX-512 registers (fingerprint_simd512.cpp, built with -mavx512f
// -mavx512dq): eight words a step, each through the same splitmix64 finaliser as the scalar loop
// in state_guard.cpp, the sum wrapping modulo 2^64 (associative, so the lanes' order cannot
// change it: the value is the scalar loop's, bit for bit).
//
// Like kernels/cpu/gram_simd.h, this header and its .cpp include no ATen headers and call no
// inline function of the project: an inline function emitted under -mavx512f could be the copy
// the linker keeps for callers on CPUs without it.
#pragma once

#include <cstdint>

namespace dpzero::dp::fingerprint_simd {

// splitmix64's constants (Steele, Lea and Flood 2014, "Fast splittable pseudorandom number
// generators"): the golden-ratio increment that spreads positions, and the finaliser's two
// multipliers. The one definition of the fingerprint's words (state_guard.cpp's paths use them).
inline constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
inline constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ULL;
inline constexpr uint64_t kMix2 = 0x94D049BB133111EBULL;

// sum over j in [begin, end) of mix(w_j ^ ((j + key) * golden)) modulo 2^64, with w_j the word
// at words[j] sign-extended to 64 bits and mix splitmix64's finaliser. Call only where
// kernels::cpu_lanes::avx512f_dq() says yes.
uint64_t sum_avx512(const int16_t* words, int64_t begin, int64_t end, uint64_t key);
uint64_t sum_avx512(const int32_t* words, int64_t begin, int64_t end, uint64_t key);
uint64_t sum_avx512(const int64_t* words, int64_t begin, int64_t end, uint64_t key);

}  // namespace dpzero::dp::fingerprint_simd
