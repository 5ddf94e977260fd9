// kernels/noise_checks.h — argument checks shared by the CPU and CUDA noise-op implementations,
// so both backends reject the same inputs with the same messages.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

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

// The runs table of dpzero::add_noise_runs_ / add_secure_noise_runs_ (`op`): runs [3 R] int64,
// triples (local, length, global). Checks that each run lies inside self's numel elements, that
// the runs are disjoint and in ascending order of `local` (so no element of self is drawn twice),
// that global + length fits in int64, and that no two runs share a global coordinate (two
// elements with one coordinate's draw would carry the same noise, which their difference
// cancels); the message names the run and its values. Returns R.
inline int64_t check_noise_runs(const char* op, const at::Tensor& self, c10::IntArrayRef runs) {
  TORCH_CHECK(runs.size() % 3 == 0, op,
              ": runs must hold (local, length, global) triples, got ", runs.size(), " values");
  const int64_t n = self.numel();
  int64_t end = 0;  // one past the last element of the previous non-empty run
  for (size_t r = 0; r < runs.size() / 3; ++r) {
    const int64_t local = runs[3 * r], length = runs[3 * r + 1], global = runs[3 * r + 2];
    TORCH_CHECK(local >= 0 && length >= 0 && global >= 0 && length <= n - local, op, ": run ", r,
                " (local ", local, ", length ", length, ", global ", global,
                ") must have local, length, global >= 0 and lie inside self's ", n, " elements");
    TORCH_CHECK(global <= std::numeric_limits<int64_t>::max() - length, op, ": run ", r,
                " global + length overflows int64 (global ", global, ", length ", length, ")");
    if (length == 0) continue;
    TORCH_CHECK(local >= end, op, ": run ", r, " (local ", local, ", length ", length,
                ") overlaps or precedes the previous run, which ends at ", end,
                "; runs must be disjoint and ascending");
    end = local + length;
  }
  std::vector<std::pair<int64_t, size_t>> by_global;  // (global, run) of the non-empty runs
  for (size_t r = 0; r < runs.size() / 3; ++r) {
    if (runs[3 * r + 1] > 0) by_global.emplace_back(runs[3 * r + 2], r);
  }
  std::sort(by_global.begin(), by_global.end());
  for (size_t k = 1; k < by_global.size(); ++k) {
    const size_t a = by_global[k - 1].second, b = by_global[k].second;
    TORCH_CHECK(runs[3 * b + 2] >= runs[3 * a + 2] + runs[3 * a + 1], op, ": runs ", a, " (global ",
                runs[3 * a + 2], ", length ", runs[3 * a + 1], ") and ", b, " (global ",
                runs[3 * b + 2], ", length ", runs[3 * b + 1],
                ") share global coordinates; each coordinate's draw may be added once");
  }
  return static_cast<int64_t>(runs.size() / 3);
}

// The 256-bit secure-mode key as eight 32-bit words; each must fit in uint32.
inline privacy::ChaCha20Key secure_key_from(c10::IntArrayRef key,
                                            const char* op = "dpzero::add_secure_noise_") {
  TORCH_CHECK(key.size() == 8, op, ": key must have 8 words, got ", key.size());
  privacy::ChaCha20Key out;
  for (size_t i = 0; i < 8; ++i) {
    TORCH_CHECK(key[i] >= 0 && key[i] <= static_cast<int64_t>(std::numeric_limits<uint32_t>::max()),
                op, ": key word ", i, " must be in [0, 2^32), got ", key[i]);
    out.w[i] = static_cast<uint32_t>(key[i]);
  }
  return out;
}

}  // namespace dpzero::kernels
