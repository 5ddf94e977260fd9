// kernels/cpu/cpu_lanes.cpp — see cpu_lanes.h.
#include "kernels/cpu/cpu_lanes.h"

namespace dpzero::kernels::cpu_lanes {

bool avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}

bool avx2_fma() {
  static const bool has = avx2() && __builtin_cpu_supports("fma");
  return has;
}

bool avx512f() {
  static const bool has = avx2_fma() && __builtin_cpu_supports("avx512f");
  return has;
}

bool avx512f_dq() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return has;
}

}  // namespace dpzero::kernels::cpu_lanes
