// kernels/cpu/noise_simd512.cpp — the noise draws in AVX-512 lanes (Note [cpu noise lanes] in
// noise_simd.h): the AVX2 code of noise_simd.cpp at twice the width, operation for operation.
// Built with -mavx512f -mavx512dq -ffp-contract=off (kernels/CMakeLists.txt) and called only after
// a CPUID check (the dispatchers in noise.cpp).
//
// Every step is the AVX2 one on sixteen lanes instead of eight:
//   Philox4x32-10 rounds ........ mulhilo by _mm512_mul_epu32 on the even and odd lanes, its
//                                 words gathered by two permutes, the key xors in one ternlog
//   ChaCha20 block .............. the same quarter rounds, rotations by _mm512_rol_epi32
//   radius sqrt(-2 ln u1) ....... the exact 2^52 conversions, SLEEF's logd8 u35 / u10 (AVX2: logd4)
//   fp32 angle and Box–Muller ... SLEEF's sincosf16 u10 (AVX2: sincosf8)
//   fp64 angle, secure sum ...... SLEEF's sincosd8 u10 (AVX2: sincosd4)
// The integer steps, conversions, sqrt, sums and products are exact or correctly rounded, so the
// bits can differ from the AVX2 draw only where SLEEF's wider log / sincos do; they evaluate the
// same operations and agreed on every input tried (Note [cpu noise lanes]).
// GCC 12's avx512fintrin.h seeds the unmasked shifts and conversions from a deliberately
// uninitialized _mm512_undefined_*() value, and -Wuninitialized reports each use (GCC bug 105593,
// fixed in GCC 13); the warning is about the header, not this code.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#include <sleef.h>

#include <cstdint>

#include "kernels/cpu/noise_simd.h"
#include "privacy/philox.h"  // constants only (no function of it is used here)

namespace dpzero::kernels::noise_simd {
namespace {

using privacy::philox_detail::kM0;
using privacy::philox_detail::kM1;
using privacy::philox_detail::kW0;
using privacy::philox_detail::kW1;

inline __m512i set1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }

// Lane-wise 32 x 32 -> 64-bit products of a and the constant m: (hi, lo) words (mulhilo). The
// products of the even and the odd lanes are two registers of 64-bit words; one two-source
// permute gathers their low words and one their high words, back in lane order.
inline void mulhilo16(__m512i a, uint32_t m, __m512i& hi, __m512i& lo) {
  const __m512i mm = set1(m);
  const __m512i even = _mm512_mul_epu32(a, mm);                        // lanes 0, 2, ..., 14
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), mm);  // lanes 1, 3, ..., 15
  // Word 2j of `even` is lane 2j's low word, 2j + 1 its high word; index 16 + w picks odd's w.
  const __m512i lo_words =
      _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
  const __m512i hi_words =
      _mm512_setr_epi32(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  lo = _mm512_permutex2var_epi32(even, lo_words, odd);
  hi = _mm512_permutex2var_epi32(even, hi_words, odd);
}

// a ^ b ^ c in one instruction (truth table 0x96).
inline __m512i xor3(__m512i a, __m512i b, __m512i c) {
  return _mm512_ternarylogic_epi32(a, b, c, 0x96);
}

// Philox4x32-10 on kSets x 16 counters at once; independent sets interleave, as in the AVX2 code.
constexpr int kSets = kBlocks / 16;
static_assert(kBlocks % 16 == 0, "the AVX-512 lanes draw sixteen blocks per set");

inline void philox16(__m512i c[kSets][4], uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    for (int set = 0; set < kSets; ++set) {
      __m512i hi0, lo0, hi1, lo1;
      mulhilo16(c[set][0], kM0, hi0, lo0);
      mulhilo16(c[set][2], kM1, hi1, lo1);
      const __m512i n0 = xor3(hi1, c[set][1], set1(k0));
      const __m512i n2 = xor3(hi0, c[set][3], set1(k1));
      c[set][0] = n0;
      c[set][1] = lo1;
      c[set][2] = n2;
      c[set][3] = lo0;
    }
  }
}

// Eight unsigned 32-bit words -> eight doubles, exactly (the 2^52 magic-number conversion).
inline __m512d u32_to_f64(__m256i x) {
  const __m512i bits =
      _mm512_or_si512(_mm512_cvtepu32_epi64(x), _mm512_set1_epi64(0x4330000000000000LL));
  return _mm512_sub_pd(_mm512_castsi512_pd(bits), _mm512_set1_pd(4503599627370496.0));  // 2^52
}

// box_muller_radius64 on eight (hi, lo) word pairs (radius4 of noise_simd.cpp, with the same
// choice of SLEEF log: u35 for the Philox path, u10 for the secure path).
template <__m512d (*Log)(__m512d)>
inline __m512d radius8(__m256i hi, __m256i lo) {
  constexpr double kLn2Times64 = 44.361419555836499802;  // 64 ln 2, as in gaussian.h
  const __m512d m =
      _mm512_add_pd(_mm512_mul_pd(u32_to_f64(hi), _mm512_set1_pd(4294967296.0)), u32_to_f64(lo));
  const __m512d log_u = Log(_mm512_add_pd(m, _mm512_set1_pd(0.5)));
  const __m512d minus_log_u1 = _mm512_sub_pd(_mm512_set1_pd(kLn2Times64), log_u);
  const __m512d clamped = _mm512_max_pd(minus_log_u1, _mm512_setzero_pd());
  return _mm512_sqrt_pd(_mm512_mul_pd(_mm512_set1_pd(2.0), clamped));
}

inline __m256i low8(__m512i x) { return _mm512_castsi512_si256(x); }
inline __m256i high8(__m512i x) { return _mm512_extracti64x4_epi64(x, 1); }

// ChaCha20 quarter round on sixteen states at once (chacha_detail::quarter_round).
inline void quarter16(__m512i* s, int a, int b, int c, int d) {
  s[a] = _mm512_add_epi32(s[a], s[b]); s[d] = _mm512_rol_epi32(_mm512_xor_si512(s[d], s[a]), 16);
  s[c] = _mm512_add_epi32(s[c], s[d]); s[b] = _mm512_rol_epi32(_mm512_xor_si512(s[b], s[c]), 12);
  s[a] = _mm512_add_epi32(s[a], s[b]); s[d] = _mm512_rol_epi32(_mm512_xor_si512(s[d], s[a]), 8);
  s[c] = _mm512_add_epi32(s[c], s[d]); s[b] = _mm512_rol_epi32(_mm512_xor_si512(s[b], s[c]), 7);
}

// uniform_open01_f64 on eight (hi, lo) word pairs (uniform4_f64 of noise_simd.cpp).
inline __m512d uniform8_f64(__m256i hi, __m256i lo) {
  const __m512i word = _mm512_or_si512(_mm512_slli_epi64(_mm512_cvtepu32_epi64(hi), 32),
                                       _mm512_cvtepu32_epi64(lo));
  const __m512i m = _mm512_srli_epi64(word, 12);
  const __m512d md = _mm512_sub_pd(
      _mm512_castsi512_pd(_mm512_or_si512(m, _mm512_set1_epi64(0x4330000000000000LL))),
      _mm512_set1_pd(4503599627370496.0));
  const __m512d odd = _mm512_add_pd(_mm512_mul_pd(md, _mm512_set1_pd(2.0)), _mm512_set1_pd(1.0));
  return _mm512_mul_pd(odd, _mm512_set1_pd(1.1102230246251565e-16));  // 2^-53
}

// Sixteen pairs first_pair + 0..15 of secure_normal_pairs (secure_normal_pairs8 of
// noise_simd.cpp); double z[32].
void secure_normal_pairs16(const uint32_t* key, uint32_t step, uint32_t stream,
                           uint64_t first_pair, double* z) {
  alignas(64) uint32_t lo[16], hi[16];
  for (int k = 0; k < 16; ++k) {
    const uint64_t pair = first_pair + static_cast<uint64_t>(k);
    lo[k] = static_cast<uint32_t>(pair);
    hi[k] = static_cast<uint32_t>(pair >> 32);
  }
  const __m512i init[16] = {set1(0x61707865u), set1(0x3320646eu), set1(0x79622d32u),
                            set1(0x6b206574u), set1(key[0]), set1(key[1]), set1(key[2]),
                            set1(key[3]), set1(key[4]), set1(key[5]), set1(key[6]), set1(key[7]),
                            _mm512_load_si512(lo), _mm512_load_si512(hi), set1(step),
                            set1(stream)};
  __m512i s[16];
  for (int i = 0; i < 16; ++i) s[i] = init[i];
  for (int r = 0; r < 10; ++r) {
    quarter16(s, 0, 4, 8, 12);
    quarter16(s, 1, 5, 9, 13);
    quarter16(s, 2, 6, 10, 14);
    quarter16(s, 3, 7, 11, 15);
    quarter16(s, 0, 5, 10, 15);
    quarter16(s, 1, 6, 11, 12);
    quarter16(s, 2, 7, 8, 13);
    quarter16(s, 3, 4, 9, 14);
  }
  for (int i = 0; i < 16; ++i) s[i] = _mm512_add_epi32(s[i], init[i]);

  // Coordinate c of each pair: output c (cosine, then sine) of the fp64 Box–Muller pairs from
  // words 4p .. 4p + 3, p = 0..3, summed in that order, then halved (as the AVX2 code, eight pairs
  // at a time).
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  for (int half = 0; half < 2; ++half) {  // pairs 0-7, then 8-15
    const auto part = [half](__m512i x) { return half == 0 ? low8(x) : high8(x); };
    __m512d sum0 = _mm512_setzero_pd(), sum1 = _mm512_setzero_pd();
    for (int p = 0; p < 4; ++p) {
      const __m512i* w = &s[4 * p];
      const __m512d radius = radius8<Sleef_logd8_u10avx512f>(part(w[0]), part(w[1]));
      const __m512d u2 = uniform8_f64(part(w[2]), part(w[3]));
      const Sleef___m512d_2 sc =
          Sleef_sincosd8_u10avx512f(_mm512_mul_pd(_mm512_set1_pd(kTwoPi), u2));
      sum0 = _mm512_add_pd(sum0, _mm512_mul_pd(radius, sc.y));  // z0 = r cos
      sum1 = _mm512_add_pd(sum1, _mm512_mul_pd(radius, sc.x));  // z1 = r sin
    }
    alignas(64) double out0[8], out1[8];
    _mm512_store_pd(out0, _mm512_mul_pd(sum0, _mm512_set1_pd(0.5)));
    _mm512_store_pd(out1, _mm512_mul_pd(sum1, _mm512_set1_pd(0.5)));
    for (int k = 0; k < 8; ++k) {
      z[2 * (8 * half + k)] = out0[k];
      z[2 * (8 * half + k) + 1] = out1[k];
    }
  }
}

}  // namespace

void philox_normal_blocks_avx512(uint64_t seed, uint32_t step, uint32_t stream,
                                 uint64_t first_block, float* z) {
  alignas(64) uint32_t lo[kBlocks], hi[kBlocks];
  for (int k = 0; k < kBlocks; ++k) {
    const uint64_t block = first_block + static_cast<uint64_t>(k);
    lo[k] = static_cast<uint32_t>(block);
    hi[k] = static_cast<uint32_t>(block >> 32);
  }
  __m512i c[kSets][4];
  for (int set = 0; set < kSets; ++set) {
    c[set][0] = _mm512_load_si512(lo + 16 * set);
    c[set][1] = _mm512_load_si512(hi + 16 * set);
    c[set][2] = set1(step);
    c[set][3] = set1(stream);
  }
  philox16(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));

  constexpr float kTwoPi = 6.283185307179586f;
  constexpr float kTwoPowMinus24 = 5.9604644775390625e-08f;
  // Coordinate order (z0[0], z1[0], z0[1], z1[1], ...): index k < 16 picks z0[k], k + 16 z1[k].
  const __m512i first_half =
      _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second_half =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int set = 0; set < kSets; ++set) {
    const __m512i* w = c[set];
    const __m256 r_low = _mm512_cvtpd_ps(radius8<Sleef_logd8_u35avx512f>(low8(w[0]), low8(w[1])));
    const __m256 r_high = _mm512_cvtpd_ps(radius8<Sleef_logd8_u35avx512f>(high8(w[0]), high8(w[1])));
    const __m512 r = _mm512_insertf32x8(_mm512_castps256_ps512(r_low), r_high, 1);
    const __m512i k =
        _mm512_or_si512(_mm512_slli_epi32(_mm512_srli_epi32(w[2], 9), 1), set1(1u));
    const __m512 u2 = _mm512_mul_ps(_mm512_cvtepi32_ps(k), _mm512_set1_ps(kTwoPowMinus24));
    const Sleef___m512_2 sc = Sleef_sincosf16_u10avx512f(_mm512_mul_ps(_mm512_set1_ps(kTwoPi), u2));
    const __m512 z0 = _mm512_mul_ps(r, sc.y);  // r cos θ: coordinate 2b
    const __m512 z1 = _mm512_mul_ps(r, sc.x);  // r sin θ: coordinate 2b + 1
    _mm512_storeu_ps(z + 32 * set, _mm512_permutex2var_ps(z0, first_half, z1));
    _mm512_storeu_ps(z + 32 * set + 16, _mm512_permutex2var_ps(z0, second_half, z1));
  }
}

void secure_normal_pairs_avx512(const uint32_t* key, uint32_t step, uint32_t stream,
                                uint64_t first_pair, double* z) {
  for (int set = 0; set < kBlocks / 16; ++set) {
    secure_normal_pairs16(key, step, stream, first_pair + 16 * static_cast<uint64_t>(set),
                          z + 32 * set);
  }
}

}  // namespace dpzero::kernels::noise_simd
