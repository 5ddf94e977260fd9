// kernels/fingerprint_checks.h — the argument check of dpzero::_state_fingerprint shared by the
// CPU and CUDA implementations, so both reject the same inputs with the same message.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace dpzero::kernels {

// words: [n] contiguous, uint8 (zero-extended), int16, int32 or int64 (sign-extended).
inline void check_fingerprint_words(const at::Tensor& words) {
  const auto dtype = words.scalar_type();
  TORCH_CHECK(dtype == at::kByte || dtype == at::kShort || dtype == at::kInt || dtype == at::kLong,
              "dpzero::_state_fingerprint: words must be uint8, int16, int32 or int64 (a tensor's "
              "bits viewed as integers), got ", dtype);
  TORCH_CHECK(words.dim() == 1 && words.is_contiguous(),
              "dpzero::_state_fingerprint: words must be one contiguous dimension, got sizes ",
              words.sizes(), " and strides ", words.strides());
}

}  // namespace dpzero::kernels
