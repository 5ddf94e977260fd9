// kernels/cpu/noise_simd.cpp — the CPU noise draws in AVX2 lanes (Note [cpu noise lanes] in
// noise_simd.h). Built with -mavx2 -mfma -ffp-contract=off (kernels/CMakeLists.txt): the last
// keeps every multiply and add separately rounded, as in the scalar code.
//
// Each function mirrors a scalar one step for step; the comments name it:
//   Philox4x32-10 rounds ........ privacy/philox.h   philox4x32_10
//   ChaCha20 block .............. privacy/chacha20.h chacha20_block
//   radius sqrt(-2 ln u1) ....... privacy/gaussian.h box_muller_radius64 (SLEEF's log)
//   fp32 angle and Box–Muller ... privacy/gaussian.h uniform_open01, box_muller
//   fp64 angle, secure sum ...... privacy/secure_noise.h uniform_open01_f64, secure_normal2
#include "kernels/cpu/noise_simd.h"

#include <immintrin.h>
#include <sleef.h>

#include <cstdint>

#include "privacy/philox.h"  // constants only (no function of it is used here)

namespace dpzero::kernels::noise_simd {
namespace {

using privacy::philox_detail::kM0;
using privacy::philox_detail::kM1;
using privacy::philox_detail::kW0;
using privacy::philox_detail::kW1;

inline __m256i set1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }

// Lane-wise 32 x 32 -> 64-bit products of a and the constant m: (hi, lo) words (mulhilo).
inline void mulhilo8(__m256i a, uint32_t m, __m256i& hi, __m256i& lo) {
  const __m256i mm = set1(m);
  const __m256i even = _mm256_mul_epu32(a, mm);                        // lanes 0, 2, 4, 6
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), mm);  // lanes 1, 3, 5, 7
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// Philox4x32-10 on kSets x 8 counters at once (philox4x32_10 with the round of
// philox_detail::round). A round is a chain of dependent multiplies and shuffles, so one set of 8
// lanes would wait on latency; kSets independent sets interleave.
constexpr int kSets = kBlocks / 8;

inline void philox8(__m256i c[kSets][4], uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    for (int set = 0; set < kSets; ++set) {
      __m256i hi0, lo0, hi1, lo1;
      mulhilo8(c[set][0], kM0, hi0, lo0);
      mulhilo8(c[set][2], kM1, hi1, lo1);
      const __m256i n0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c[set][1]), set1(k0));
      const __m256i n2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c[set][3]), set1(k1));
      c[set][0] = n0;
      c[set][1] = lo1;
      c[set][2] = n2;
      c[set][3] = lo0;
    }
  }
}

// Four unsigned 32-bit words -> four doubles, exactly (the 2^52 magic-number conversion).
inline __m256d u32_to_f64(__m128i x) {
  const __m256i bits =
      _mm256_or_si256(_mm256_cvtepu32_epi64(x), _mm256_set1_epi64x(0x4330000000000000LL));
  return _mm256_sub_pd(_mm256_castsi256_pd(bits), _mm256_set1_pd(4503599627370496.0));  // 2^52
}

// box_muller_radius64 on four (hi, lo) word pairs: sqrt(2 max(64 ln 2 - ln(m + 1/2), 0)),
// m = hi 2^32 + lo. double(hi) 2^32 is exact, so the sum is m rounded once to nearest, which is
// static_cast<double>(m). `Log` is SLEEF's fp64 log (Note [cpu noise lanes]: u35 for the Philox
// path, whose radius is rounded to float32; u10 for the secure path, which stays in fp64).
template <__m256d (*Log)(__m256d)>
inline __m256d radius4(__m128i hi, __m128i lo) {
  constexpr double kLn2Times64 = 44.361419555836499802;  // 64 ln 2, as in gaussian.h
  const __m256d m =
      _mm256_add_pd(_mm256_mul_pd(u32_to_f64(hi), _mm256_set1_pd(4294967296.0)), u32_to_f64(lo));
  const __m256d log_u = Log(_mm256_add_pd(m, _mm256_set1_pd(0.5)));
  const __m256d minus_log_u1 = _mm256_sub_pd(_mm256_set1_pd(kLn2Times64), log_u);
  const __m256d clamped = _mm256_max_pd(minus_log_u1, _mm256_setzero_pd());
  return _mm256_sqrt_pd(_mm256_mul_pd(_mm256_set1_pd(2.0), clamped));
}

inline __m128i low4(__m256i x) { return _mm256_castsi256_si128(x); }
inline __m128i high4(__m256i x) { return _mm256_extracti128_si256(x, 1); }

// ChaCha20 quarter round on eight states at once (chacha_detail::quarter_round).
template <int N>
inline __m256i rotl8(__m256i x) {
  return _mm256_or_si256(_mm256_slli_epi32(x, N), _mm256_srli_epi32(x, 32 - N));
}
inline void quarter8(__m256i* s, int a, int b, int c, int d) {
  s[a] = _mm256_add_epi32(s[a], s[b]); s[d] = rotl8<16>(_mm256_xor_si256(s[d], s[a]));
  s[c] = _mm256_add_epi32(s[c], s[d]); s[b] = rotl8<12>(_mm256_xor_si256(s[b], s[c]));
  s[a] = _mm256_add_epi32(s[a], s[b]); s[d] = rotl8<8>(_mm256_xor_si256(s[d], s[a]));
  s[c] = _mm256_add_epi32(s[c], s[d]); s[b] = rotl8<7>(_mm256_xor_si256(s[b], s[c]));
}

// uniform_open01_f64 on four (hi, lo) word pairs: (2m + 1) 2^-53, m the top 52 bits of hi:lo.
// m < 2^52 converts exactly, and 2m + 1 < 2^53 and the power-of-two scaling are exact too.
inline __m256d uniform4_f64(__m128i hi, __m128i lo) {
  const __m256i word = _mm256_or_si256(_mm256_slli_epi64(_mm256_cvtepu32_epi64(hi), 32),
                                       _mm256_cvtepu32_epi64(lo));
  const __m256i m = _mm256_srli_epi64(word, 12);
  const __m256d md = _mm256_sub_pd(
      _mm256_castsi256_pd(_mm256_or_si256(m, _mm256_set1_epi64x(0x4330000000000000LL))),
      _mm256_set1_pd(4503599627370496.0));
  const __m256d odd = _mm256_add_pd(_mm256_mul_pd(md, _mm256_set1_pd(2.0)), _mm256_set1_pd(1.0));
  return _mm256_mul_pd(odd, _mm256_set1_pd(1.1102230246251565e-16));  // 2^-53
}

}  // namespace

void philox_normal_blocks_avx2(uint64_t seed, uint32_t step, uint32_t stream,
                               uint64_t first_block, float* z) {
  // Counters (block lo, block hi, step, stream) of blocks first_block + 0..kBlocks-1, eight per
  // set (privacy::normal2).
  alignas(32) uint32_t lo[kBlocks], hi[kBlocks];
  for (int k = 0; k < kBlocks; ++k) {
    const uint64_t block = first_block + static_cast<uint64_t>(k);
    lo[k] = static_cast<uint32_t>(block);
    hi[k] = static_cast<uint32_t>(block >> 32);
  }
  __m256i c[kSets][4];
  for (int set = 0; set < kSets; ++set) {
    c[set][0] = _mm256_load_si256(reinterpret_cast<const __m256i*>(lo + 8 * set));
    c[set][1] = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi + 8 * set));
    c[set][2] = set1(step);
    c[set][3] = set1(stream);
  }
  philox8(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));

  constexpr float kTwoPi = 6.283185307179586f;
  constexpr float kTwoPowMinus24 = 5.9604644775390625e-08f;
  for (int set = 0; set < kSets; ++set) {
    const __m256i* w = c[set];
    // Radius from words 0 (hi) and 1 (lo) in fp64, rounded to float (box_muller).
    const __m256d r_low = radius4<Sleef_logd4_u35avx2>(low4(w[0]), low4(w[1]));
    const __m256d r_high = radius4<Sleef_logd4_u35avx2>(high4(w[0]), high4(w[1]));
    const __m256 r = _mm256_set_m128(_mm256_cvtpd_ps(r_high), _mm256_cvtpd_ps(r_low));
    // Angle 2π u2, u2 = (2 (w2 >> 9) + 1) 2^-24 (uniform_open01), all in float.
    const __m256i k = _mm256_or_si256(_mm256_slli_epi32(_mm256_srli_epi32(w[2], 9), 1), set1(1u));
    const __m256 u2 = _mm256_mul_ps(_mm256_cvtepi32_ps(k), _mm256_set1_ps(kTwoPowMinus24));
    const Sleef___m256_2 sc = Sleef_sincosf8_u10avx2(_mm256_mul_ps(_mm256_set1_ps(kTwoPi), u2));
    const __m256 z0 = _mm256_mul_ps(r, sc.y);  // r cos θ: coordinate 2b
    const __m256 z1 = _mm256_mul_ps(r, sc.x);  // r sin θ: coordinate 2b + 1
    // Interleave to coordinate order: (z0[0], z1[0], z0[1], z1[1], ...).
    const __m256 even = _mm256_unpacklo_ps(z0, z1);  // blocks 0, 1 | 4, 5
    const __m256 odd = _mm256_unpackhi_ps(z0, z1);   // blocks 2, 3 | 6, 7
    _mm256_storeu_ps(z + 16 * set, _mm256_permute2f128_ps(even, odd, 0x20));
    _mm256_storeu_ps(z + 16 * set + 8, _mm256_permute2f128_ps(even, odd, 0x31));
  }
}

namespace {

// Eight pairs first_pair + 0..7 of secure_normal_pairs; double z[16].
void secure_normal_pairs8(const uint32_t* key, uint32_t step, uint32_t stream, uint64_t first_pair,
                          double* z) {
  // ChaCha20 states (RFC 8439 §2.3) of pairs first_pair + 0..7: counter = pair lo, nonce =
  // (pair hi, step, stream) (privacy::secure_normal2). ChaCha20's 16-word state gives plenty of
  // independent work per round, so one set of 8 lanes at a time suffices.
  alignas(32) uint32_t lo[8], hi[8];
  for (int k = 0; k < 8; ++k) {
    const uint64_t pair = first_pair + static_cast<uint64_t>(k);
    lo[k] = static_cast<uint32_t>(pair);
    hi[k] = static_cast<uint32_t>(pair >> 32);
  }
  __m256i init[16] = {set1(0x61707865u), set1(0x3320646eu), set1(0x79622d32u), set1(0x6b206574u),
                      set1(key[0]), set1(key[1]), set1(key[2]), set1(key[3]),
                      set1(key[4]), set1(key[5]), set1(key[6]), set1(key[7]),
                      _mm256_load_si256(reinterpret_cast<const __m256i*>(lo)),
                      _mm256_load_si256(reinterpret_cast<const __m256i*>(hi)),
                      set1(step), set1(stream)};
  __m256i s[16];
  for (int i = 0; i < 16; ++i) s[i] = init[i];
  for (int r = 0; r < 10; ++r) {
    quarter8(s, 0, 4, 8, 12);
    quarter8(s, 1, 5, 9, 13);
    quarter8(s, 2, 6, 10, 14);
    quarter8(s, 3, 7, 11, 15);
    quarter8(s, 0, 5, 10, 15);
    quarter8(s, 1, 6, 11, 12);
    quarter8(s, 2, 7, 8, 13);
    quarter8(s, 3, 4, 9, 14);
  }
  for (int i = 0; i < 16; ++i) s[i] = _mm256_add_epi32(s[i], init[i]);

  // Coordinate c of each pair: output c (cosine, then sine) of the fp64 Box–Muller pairs from
  // words 4p .. 4p + 3, p = 0..3 (radius from the first two; angle from the last two), summed in
  // that order, then halved (privacy::secure_normal2).
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  for (int half = 0; half < 2; ++half) {  // pairs 0-3, then 4-7
    const auto part = [half](__m256i x) { return half == 0 ? low4(x) : high4(x); };
    __m256d sum0 = _mm256_setzero_pd(), sum1 = _mm256_setzero_pd();
    for (int p = 0; p < 4; ++p) {
      const __m256i* w = &s[4 * p];
      const __m256d radius = radius4<Sleef_logd4_u10avx2>(part(w[0]), part(w[1]));
      const __m256d u2 = uniform4_f64(part(w[2]), part(w[3]));
      const Sleef___m256d_2 sc =
          Sleef_sincosd4_u10avx2(_mm256_mul_pd(_mm256_set1_pd(kTwoPi), u2));
      sum0 = _mm256_add_pd(sum0, _mm256_mul_pd(radius, sc.y));  // z0 = r cos
      sum1 = _mm256_add_pd(sum1, _mm256_mul_pd(radius, sc.x));  // z1 = r sin
    }
    alignas(32) double out0[4], out1[4];
    _mm256_store_pd(out0, _mm256_mul_pd(sum0, _mm256_set1_pd(0.5)));
    _mm256_store_pd(out1, _mm256_mul_pd(sum1, _mm256_set1_pd(0.5)));
    for (int k = 0; k < 4; ++k) {
      z[2 * (4 * half + k)] = out0[k];
      z[2 * (4 * half + k) + 1] = out1[k];
    }
  }
}

}  // namespace

void secure_normal_pairs_avx2(const uint32_t* key, uint32_t step, uint32_t stream,
                              uint64_t first_pair, double* z) {
  for (int set = 0; set < kSets; ++set) {
    secure_normal_pairs8(key, step, stream, first_pair + 8 * static_cast<uint64_t>(set),
                         z + 16 * set);
  }
}

}  // namespace dpzero::kernels::noise_simd
