// kernels/cpu/row_sums_simd.h — one row of the CPU row-sum kernels (kernels/cpu/row_sums.cpp) in
// AVX2 registers (kernels/cpu/row_sums_simd.cpp, built with -mavx2 -ffp-contract=off).
//
// Note [row sums in lanes]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// The scalar row loops of row_sums.cpp convert each float32 entry to float64, add it into the
// sample's sums and square it into one of four partial sums (entry k into partial k mod 4, the
// tail after the last full group of four into partial 0, then (p0 + p1) + (p2 + p3)). Here the four
// partials are the four float64 lanes of one register, so every partial sees the same additions in
// the same order, and the sums' entries are added one row at a time as before: the results are
// the scalar loops' bits (tests/cpp/torch/row_sums_simd_test.cpp compares them), only faster
// (about 3x at d = 64..256; experiments/results/host.md). Multiplies and adds stay separately
// rounded (-ffp-contract=off, no FMA), as in the baseline build.
//
// Like kernels/cpu/gram_simd.h, this header and its .cpp include no ATen headers and call no
// inline function of the project: an inline function emitted under -mavx2 could be the copy the
// linker keeps for callers on CPUs without AVX2.
#pragma once

#include <cstdint>

namespace dpzero::kernels::row_sums_simd {

// True iff this CPU runs AVX2. Defined in kernels/cpu/row_sums.cpp, built for the baseline ISA.
bool available();

// sums [d] float64 += x [d] float32 (widened exactly); -> ||x||^2 in float64, summed as the four
// partials above.
double add_row(double* sums, const float* x, int64_t d);

// One sample's rows x [t, d] float32 added into sums [d] float64 in row order; -> S = sum_r
// ||x_r|| in float64, added in row order (each ||x_r||^2 as add_row sums it).
double add_rows(double* sums, const float* x, int64_t t, int64_t d);

// One sample's LayerNorm / RMSNorm rows: x̂_r = (x_r - mean_r) * rstd_r, then sums [d] float64 +=
// g_r ⊙ x̂_r in row order (x, g [t, d] float32); -> S = sum_r ||g_r ⊙ x̂_r||. mean_r (0 for RMSNorm)
// and rstd_r = 1 / sqrt(var_r + eps) as row_sums.cpp's scalar rows compute them: the two-pass
// variance, each pass in the four partials.
double add_norm_rows(double* sums, const float* x, const float* g, int64_t t, int64_t d,
                     double eps, bool rms);

}  // namespace dpzero::kernels::row_sums_simd

// The same functions in scalar code, for CPUs without AVX2 (defined in
// kernels/cpu/row_sums.cpp, built for the baseline ISA): the reference the lanes must match.
namespace dpzero::kernels::row_sums_scalar {
double add_row(double* sums, const float* x, int64_t d);
double add_rows(double* sums, const float* x, int64_t t, int64_t d);
double add_norm_rows(double* sums, const float* x, const float* g, int64_t t, int64_t d,
                     double eps, bool rms);
}  // namespace dpzero::kernels::row_sums_scalar
