// kernels/cpu/clip_factors.cpp — CPU implementation of dpzero::clip_factors (schema in
// kernels/ops.cpp; the policies are privacy/clipping.h).
#include <cmath>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "kernels/clip_checks.h"
#include "privacy/clipping.h"

namespace dpzero::kernels {
namespace {

std::tuple<at::Tensor, at::Tensor> clip_factors_cpu(const at::Tensor& norms, double max_norm,
                                                    c10::string_view mode, double gamma) {
  const privacy::ClipMode clip_mode =
      check_clip_args("clip_factors", norms, max_norm, mode, gamma);
  const at::Tensor n = norms.contiguous();
  at::Tensor factors = at::empty_like(n);
  const float* in = n.data_ptr<float>();
  float* out = factors.data_ptr<float>();
  int64_t nonfinite = 0;
  const float threshold = privacy::threshold_f32(max_norm);
  for (int64_t i = 0; i < n.numel(); ++i) {
    out[i] = privacy::clip_factor(in[i], threshold, clip_mode, static_cast<float>(gamma));
    nonfinite += privacy::valid_norm(in[i]) ? 0 : 1;
  }
  return {factors, at::scalar_tensor(nonfinite, at::kLong)};
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CPU, m) { m.impl("clip_factors", &clip_factors_cpu); }

}  // namespace dpzero::kernels
