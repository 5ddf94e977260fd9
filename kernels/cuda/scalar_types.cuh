// kernels/cuda/scalar_types.cuh — the element types the CUDA per-sample kernels read (float32,
// bfloat16, float16: each exact in float32 and in float64), dispatched to a templated launch.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace dpzero::kernels {

// f(T{}) for the scalar type `t`'s element type T; `what` names the kernel in the error.
template <typename F>
void with_scalar_type(const char* what, at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(at::BFloat16{});
      break;
    case at::kHalf:
      f(at::Half{});
      break;
    default:
      TORCH_CHECK(false, "dpzero ", what, ": unsupported dtype ", t);
  }
}

}  // namespace dpzero::kernels
