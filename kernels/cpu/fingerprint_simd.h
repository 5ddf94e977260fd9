// kernels/cpu/fingerprint_simd.h — the host fingerprint (kernels/fingerprint_words.h) in AVX-512
// registers (fingerprint_simd512.cpp, built with -mavx512f -mavx512dq): eight words a step, each
// through the same finaliser as the scalar loop in fingerprint.cpp, the sum wrapping modulo 2^64
// (associative, so the lanes' order cannot change it: the value is the scalar loop's, bit for
// bit).
//
// Like kernels/cpu/gram_simd.h, this header and its .cpp include no ATen headers and call no
// inline function of the project with external linkage: an inline function emitted under
// -mavx512f could be the copy the linker keeps for callers on CPUs without it (the fingerprint's
// term is static, one copy per translation unit).
#pragma once

#include <cstdint>

#include "kernels/fingerprint_words.h"

namespace dpzero::kernels::fingerprint {

// sum over j in [begin, end) of mix(w_j ^ ((j + key) * golden)) modulo 2^64, with w_j the word
// at words[j] sign-extended to 64 bits and mix splitmix64's finaliser. Call only where
// kernels::cpu_lanes::avx512f_dq() says yes.
uint64_t sum_avx512(const int16_t* words, int64_t begin, int64_t end, uint64_t key);
uint64_t sum_avx512(const int32_t* words, int64_t begin, int64_t end, uint64_t key);
uint64_t sum_avx512(const int64_t* words, int64_t begin, int64_t end, uint64_t key);

}  // namespace dpzero::kernels::fingerprint
