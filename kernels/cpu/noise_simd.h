// kernels/cpu/noise_simd.h — the CPU noise draws, eight Philox / ChaCha20 blocks at a time in AVX2
// registers (kernels/cpu/noise_simd.cpp, built with -mavx2 -mfma) or sixteen in AVX-512 registers
// (kernels/cpu/noise_simd512.cpp, built with -mavx512f -mavx512dq).
//
// Note [cpu noise lanes]
// ~~~~~~~~~~~~~~~~~~~~~~
// The scalar draw of privacy/noise.h costs ~27 ns per coordinate pair on one core, almost all of
// it Philox rounds, one fp64 log and a float sine and cosine; at 5 M parameters that was 70 ms of
// every private step, more than a quarter of the non-private step it is added to. Here the same
// draw runs on eight blocks at once: the block function's integer rounds in 8 × 32-bit lanes
// (_mm256_mul_epu32 for the multiply-hi/lo), the transforms through SLEEF's vector log and sincos
// (the copy that libtorch links and exports, header <sleef.h> shipped with torch), and the
// integer-to-float steps exactly as the scalar code does them. The sincos functions are SLEEF's
// u10 (within 1.0 ulp). The fp64 log is u10 on the secure path, whose draw stays in fp64, and u35
// (within 3.5 fp64 ulps, a third faster: 3.19 -> 2.84 ms for 0.6 M coordinates on one core) on the
// Philox path, whose radius is rounded to float32 right after. The log is about 44 there (of
// m + 1/2 < 2^64), so its error is at most 3.5·2^-47 in absolute value, and r = sqrt(2(64 ln 2 -
// log)) moves by at most ~2.5·10^-14 / r: less than one float ulp of r for r above ~5·10^-4, and
// below 10^-7 in absolute value for r above ~2.5·10^-7 (u10's 1-ulp error does the same with a
// 3.5 times smaller constant). Note [gaussian tail] is untouched: the tail is at large r, where
// the error is ~10^-15. So on an AVX2 + FMA machine the CPU draw differs from privacy::normal2 /
// privacy::secure_normal2 only where SLEEF's log / sin / cos round differently from the C
// library's: by about a float ulp of z, or ~10^-7 absolutely for the smallest radii (the tests
// bound it at 4·10^-7 (1 + |z|)).
//
// CPUs with AVX-512F and DQ run the same steps in sixteen lanes (noise_simd512.cpp; the speedup
// is in experiments/results/noise.md). Its bits are the eight lanes' bits: the integer rounds,
// the exact conversions, sqrt, sums and products are the same IEEE operations at either width,
// and SLEEF's 16-lane sincosf / 8-lane logd and sincosd evaluate the same operations as its 8- /
// 4-lane ones. That last part is checked, not proved: a one-off check against libtorch's SLEEF
// compared all 2^23 float angles the Philox path can produce and random log and fp64 angle
// inputs (experiments/results/noise.md says how many and when). The u35 log the Philox path uses
// now was not in that check; at either width it splits d into an exact exponent and mantissa
// (AVX2: ilogb and ldexp; AVX-512: getexp and getmant) and then runs the same FMA sequence, so it
// should agree the same way. tests/cpp/torch/noise_shard_test.cpp compares the two paths on 2^21 Philox
// and 2^20 secure coordinates wherever the tests run on an AVX-512 machine (they skip elsewhere).
//
// What the engine relies on still holds (Note [noise ownership] in privacy/noise.h): every lane
// function is elementwise, so the draw of block b is the same whichever lane and group it is
// computed in — a shard starting at any offset gets bit for bit the single tensor's values. The
// CPU draw is a pure function of (seed or key, step, j) on a given kind of CPU: AVX2 + FMA
// machines (every x86 server of the last decade) use these lanes, eight or sixteen wide, with the
// same bits; any other CPU uses the scalar header functions, whose bits can differ by those few
// ulps, so a run whose ranks mix lanes and scalar would not be bitwise world-size invariant (it
// would still add each coordinate's noise exactly once).
//
// These headers and .cpp files include no ATen headers, and of privacy/ only philox.h, for its
// constants: an inline function they called would be emitted under -mavx2 or -mavx512f, and the
// linker could pick that copy for callers on machines without those instructions. They call none.
#pragma once

#include <cstdint>

namespace dpzero::kernels::noise_simd {

constexpr int kBlocks = 32;  // blocks (Philox) or pairs (ChaCha20) per call, a multiple of 16

// True iff this CPU runs AVX2 and FMA (so the functions below may be called) and the tests-only
// op dpzero::_set_noise_lanes has not switched the lanes off. Defined in kernels/cpu/noise.cpp,
// which is built for the baseline ISA: the check must not itself need AVX2.
bool available();

// Tests only: turn the lanes on (where the CPU has them) or off; returns the previous setting.
bool set_enabled(bool enabled);

// True iff available() and the CPU also runs AVX-512F and AVX-512DQ (the OS saving their state),
// so that philox_normal_blocks and secure_normal_pairs take the sixteen-lane paths.
bool wide_available();

// Philox path: for blocks b = first_block .. first_block + kBlocks - 1, the two N(0,1) draws of
// global coordinates 2b (z[2k]) and 2b + 1 (z[2k + 1]), k = b - first_block. float z[2 kBlocks].
// Call only when available(): it runs philox_normal_blocks_avx512 where wide_available(), else
// philox_normal_blocks_avx2 (the same bits, Note [cpu noise lanes]). Defined in noise.cpp.
void philox_normal_blocks(uint64_t seed, uint32_t step, uint32_t stream, uint64_t first_block,
                          float* z);
// The two implementations (noise_simd.cpp, noise_simd512.cpp), for the dispatch above and for the
// test that they agree bit for bit.
void philox_normal_blocks_avx2(uint64_t seed, uint32_t step, uint32_t stream,
                               uint64_t first_block, float* z);
void philox_normal_blocks_avx512(uint64_t seed, uint32_t step, uint32_t stream,
                                 uint64_t first_block, float* z);

// Secure path: for pairs p = first_pair .. first_pair + kBlocks - 1, the two secure N(0,1) draws
// of coordinates 2p (z[2k]) and 2p + 1 (z[2k + 1]) (Note [secure noise] in
// privacy/secure_noise.h). key: the eight ChaCha20 key words. double z[2 kBlocks].
// Call only when available(); dispatched like philox_normal_blocks (defined in noise.cpp).
void secure_normal_pairs(const uint32_t* key, uint32_t step, uint32_t stream, uint64_t first_pair,
                         double* z);
void secure_normal_pairs_avx2(const uint32_t* key, uint32_t step, uint32_t stream,
                              uint64_t first_pair, double* z);
void secure_normal_pairs_avx512(const uint32_t* key, uint32_t step, uint32_t stream,
                                uint64_t first_pair, double* z);

}  // namespace dpzero::kernels::noise_simd
