// kernels/fingerprint_checks.h — the argument check of dpzero::_state_fingerprint shared by the
// CPU and CUDA implementations, so both reject the same inputs with the same message.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace dpzero::kernels {

// words: L >= 1 tensors [n_l], contiguous, uint8 (zero-extended), int16, int32 or int64
// (sign-extended), all on one device.
inline void check_fingerprint_words(at::TensorList words) {
  TORCH_CHECK(!words.empty(), "dpzero::_state_fingerprint: words must hold at least one tensor");
  for (size_t l = 0; l < words.size(); ++l) {
    const at::Tensor& w = words[l];
    const auto dtype = w.scalar_type();
    TORCH_CHECK(dtype == at::kByte || dtype == at::kShort || dtype == at::kInt ||
                    dtype == at::kLong,
                "dpzero::_state_fingerprint: words must be uint8, int16, int32 or int64 (a "
                "tensor's bits viewed as integers), got ", dtype, " for words[", l, "]");
    TORCH_CHECK(w.dim() == 1 && w.is_contiguous(),
                "dpzero::_state_fingerprint: words must each be one contiguous dimension, got "
                "sizes ", w.sizes(), " and strides ", w.strides(), " for words[", l, "]");
    TORCH_CHECK(w.device() == words[0].device(),
                "dpzero::_state_fingerprint: words must be on one device, got ",
                words[0].device(), " for words[0] and ", w.device(), " for words[", l, "]");
  }
}

}  // namespace dpzero::kernels
