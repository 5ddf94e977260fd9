// kernels/cpu/fingerprint_simd512.cpp — see fingerprint_simd.h. Built with -mavx512f -mavx512dq.
#include "kernels/cpu/fingerprint_simd.h"

#include <immintrin.h>

namespace dpzero::kernels::fingerprint {
namespace {

// Eight words at p, sign-extended to 64 bits.
inline __m512i load8(const int16_t* p) {
  return _mm512_cvtepi16_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512i load8(const int32_t* p) {
  return _mm512_cvtepi32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512i load8(const int64_t* p) { return _mm512_loadu_si512(p); }

template <typename Word>
uint64_t sum(const Word* words, int64_t begin, int64_t end, uint64_t key) {
  int64_t j = begin;
  uint64_t total = 0;
  if (end - j >= 8) {
    // Lane l holds position j + l: (j + l + key) * golden, advanced by 8 * golden a step
    // (multiplication distributes over addition modulo 2^64).
    const uint64_t base = (static_cast<uint64_t>(j) + key) * kGolden;
    __m512i position = _mm512_add_epi64(
        _mm512_set1_epi64(static_cast<long long>(base)),
        _mm512_mullo_epi64(_mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0),
                           _mm512_set1_epi64(static_cast<long long>(kGolden))));
    const __m512i step = _mm512_set1_epi64(static_cast<long long>(8 * kGolden));
    const __m512i mix1 = _mm512_set1_epi64(static_cast<long long>(kMix1));
    const __m512i mix2 = _mm512_set1_epi64(static_cast<long long>(kMix2));
    __m512i acc = _mm512_setzero_si512();
    for (; j + 8 <= end; j += 8) {
      __m512i z = _mm512_xor_si512(load8(words + j), position);
      position = _mm512_add_epi64(position, step);
      z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), mix1);
      z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), mix2);
      acc = _mm512_add_epi64(acc, _mm512_xor_si512(z, _mm512_srli_epi64(z, 31)));
    }
    total = static_cast<uint64_t>(_mm512_reduce_add_epi64(acc));
  }
  for (; j < end; ++j)
    total += term(static_cast<uint64_t>(static_cast<int64_t>(words[j])), static_cast<uint64_t>(j),
                  key);
  return total;
}

}  // namespace

uint64_t sum_avx512(const int16_t* words, int64_t begin, int64_t end, uint64_t key) {
  return sum(words, begin, end, key);
}
uint64_t sum_avx512(const int32_t* words, int64_t begin, int64_t end, uint64_t key) {
  return sum(words, begin, end, key);
}
uint64_t sum_avx512(const int64_t* words, int64_t begin, int64_t end, uint64_t key) {
  return sum(words, begin, end, key);
}

}  // namespace dpzero::kernels::fingerprint
