// kernels/clip_checks.h — argument checks shared by the CPU and CUDA clip_factors implementations
// and the fused *_clip ops of kernels/per_sample_ops.h (each passes its own op name, so an error
// names the op the caller called).
#pragma once

#include <cmath>
#include <stdexcept>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include "privacy/clipping.h"

namespace dpzero::kernels {

// `op`: the public op name without the "dpzero::" prefix ("clip_factors", "linear_clip", ...).
inline privacy::ClipMode check_clip_args(const char* op, const at::Tensor& norms, double max_norm,
                                         c10::string_view mode, double gamma) {
  TORCH_CHECK(norms.dim() == 1, "dpzero::", op, ": norms must be 1-D [B], got shape ",
              norms.sizes());
  TORCH_CHECK(norms.scalar_type() == at::kFloat, "dpzero::", op,
              ": norms must be float32 (fp32 accumulation), got ", norms.scalar_type());
  TORCH_CHECK(std::isfinite(max_norm) && max_norm > 0.0, "dpzero::", op,
              ": max_norm must be finite and > 0, got ", max_norm);
  TORCH_CHECK(max_norm >= privacy::kMinClipNorm, "dpzero::", op,
              ": max_norm must be at least 2^-64 (Note [smallest clip norm]), got ", max_norm);
  privacy::ClipMode clip_mode;
  try {
    clip_mode = privacy::parse_clip_mode(std::string(mode.data(), mode.size()));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, "dpzero::", op, ": ", e.what());
  }
  TORCH_CHECK(clip_mode != privacy::ClipMode::kAutomatic || (std::isfinite(gamma) && gamma > 0.0),
              "dpzero::", op, ": automatic clipping needs a finite gamma > 0, got ", gamma);
  return clip_mode;
}

}  // namespace dpzero::kernels
