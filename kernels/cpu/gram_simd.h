// kernels/cpu/gram_simd.h — the Gram of one sample's short sequence of float32 rows, in float64,
// in AVX2 registers (kernels/cpu/gram_simd.cpp, built with -mavx2 -mfma): the small-T path of the
// CPU ghost kernels (Note [small ghost] in kernels/cpu/ghost_norm.cpp).
//
// Like kernels/cpu/noise_simd.h, this header and its .cpp include no ATen headers and call no
// inline function of the project: an inline function emitted under -mavx2 could be the copy the
// linker keeps for callers on CPUs without AVX2.
#pragma once

#include <cstdint>

namespace dpzero::kernels::gram_simd {

// True iff this CPU runs AVX2 and FMA, so gram_f32 may be called; wide_available(): AVX-512F too,
// so gram_f32_avx512 may be. Defined in kernels/cpu/ghost_norm.cpp, built for the baseline ISA.
bool available();
bool wide_available();

// x [t, d] float32 (row-major, contiguous) -> gram [t, t] float64 (row-major, both triangles),
// gram[s * t + u] = sum_k double(x[s, k]) * double(x[u, k]). `rows` is scratch for t * d
// float64 values. Every product is exact in float64 (24 + 24 significand bits), and each entry is
// summed in some order of its d products: within gamma_d of the exact inner product (Note
// [certified norms] in kernels/per_sample/common.h). gram[s, u] and gram[u, s] are the same value.
void gram_f32(const float* x, int64_t t, int64_t d, double* rows, double* gram);

// gram_f32 in AVX-512 lanes (kernels/cpu/gram_simd512.cpp), with gram_f32's bits.
void gram_f32_avx512(const float* x, int64_t t, int64_t d, double* rows, double* gram);

}  // namespace dpzero::kernels::gram_simd
