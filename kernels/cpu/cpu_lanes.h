// kernels/cpu/cpu_lanes.h — which vector instruction sets this CPU runs, each checked once
// (libgcc's __builtin_cpu_supports, which includes the OS's XSAVE support for the registers).
// Defined in cpu_lanes.cpp, built for the baseline ISA; the lanes of the *_simd*.cpp files run
// only after these say yes (each family's available() / wide_available() asks here).
#pragma once

namespace dpzero::kernels::cpu_lanes {

bool avx2();        // AVX2
bool avx2_fma();    // AVX2 and FMA
bool avx512f();     // AVX-512F, AVX2 and FMA
bool avx512f_dq();  // AVX-512F and DQ

}  // namespace dpzero::kernels::cpu_lanes
