// kernels/noise_checks.h — argument checks shared by the CPU and CUDA noise-op implementations,
// so both backends reject the same inputs with the same messages.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include "privacy/chacha20.h"

namespace dpzero::kernels {

// `op` names the calling op in every message ("dpzero::add_noise_", "dpzero::add_secure_noise_").
inline void check_add_noise_args(const char* op, const at::Tensor& self, double stddev, int64_t step,
                                 int64_t offset, bool allow_double = false) {
  TORCH_CHECK(self.is_contiguous(), op, ": self must be contiguous, got strides ", self.strides());
  const auto dtype = self.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf ||
                  (allow_double && dtype == at::kDouble),
              op, ": self must be float32, bfloat16 or float16",
              allow_double ? " (or float64)" : "", ", got ", dtype);
  TORCH_CHECK(std::isfinite(stddev) && stddev >= 0.0, op, ": std must be finite and >= 0, got ",
              stddev);
  TORCH_CHECK(step >= 0 && step <= static_cast<int64_t>(std::numeric_limits<uint32_t>::max()),
              op, ": step must be in [0, 2^32), got ", step);
  TORCH_CHECK(offset >= 0, op, ": offset must be >= 0, got ", offset);
  TORCH_CHECK(offset <= std::numeric_limits<int64_t>::max() - self.numel(), op,
              ": offset + numel overflows int64 (offset ", offset, ", numel ", self.numel(), ")");
}

// The 256-bit secure-mode key as eight 32-bit words; each must fit in uint32.
inline privacy::ChaCha20Key secure_key_from(c10::IntArrayRef key) {
  TORCH_CHECK(key.size() == 8, "dpzero::add_secure_noise_: key must have 8 words, got ", key.size());
  privacy::ChaCha20Key out;
  for (size_t i = 0; i < 8; ++i) {
    TORCH_CHECK(key[i] >= 0 && key[i] <= static_cast<int64_t>(std::numeric_limits<uint32_t>::max()),
                "dpzero::add_secure_noise_: key word ", i, " must be in [0, 2^32), got ", key[i]);
    out.w[i] = static_cast<uint32_t>(key[i]);
  }
  return out;
}

}  // namespace dpzero::kernels
