// src/dp/clip_group.cpp — see clip_group.h (Note [certified group norms]). The arithmetic is
// kernels/certify.h's, run by dpzero::_group_clip and dpzero::_certify: one pass, one launch per
// call on a device.
#include "src/dp/clip_group.h"

#include <tuple>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include "kernels/certify.h"
#include "kernels/per_sample_ops.h"  // certify_op

namespace dpzero::dp {
namespace {

using kernels::certify::Step;
using kernels::per_sample::certify_op;

void check_sq(const char* op, const at::Tensor& sq, const at::Tensor& first, size_t component,
              size_t part) {
  TORCH_CHECK(sq.dim() == 1 && sq.scalar_type() == at::kFloat, "dpzero::dp::", op,
              ": component ", component, " part ", part,
              ": squared norms must be [B] float32, got ", sq.scalar_type(), " of shape ",
              sq.sizes());
  TORCH_CHECK(sq.size(0) == first.size(0) && sq.device() == first.device(), "dpzero::dp::", op,
              ": component ", component, " part ", part, " has ", sq.size(0), " rows on ",
              sq.device(), ", the first part ", first.size(0), " on ", first.device(),
              ": every part is one micro-batch");
}

}  // namespace

at::Tensor round_up_f32(const at::Tensor& x) { return certify_op(x, c10::nullopt, 0.0, Step::kRoundUp); }

at::Tensor round_down_f32(const at::Tensor& x) {
  return certify_op(x, c10::nullopt, 0.0, Step::kRoundDown);
}

std::tuple<at::Tensor, at::Tensor> group_clip(
    const std::vector<std::vector<at::Tensor>>& components, int64_t mean, double max_norm,
    const std::string& mode, double gamma) {
  TORCH_CHECK(!components.empty(), "dpzero::dp::group_clip: a group has at least one component");
  TORCH_CHECK(!components[0].empty(), "dpzero::dp::group_clip: component 0 has no parts");
  const at::Tensor& first = components[0][0];
  std::vector<at::Tensor> parts;
  std::vector<int64_t> sizes;
  for (size_t c = 0; c < components.size(); ++c) {
    for (size_t p = 0; p < components[c].size(); ++p) {
      check_sq("group_clip", components[c][p], first, c, p);
      parts.push_back(components[c][p]);
    }
    sizes.push_back(static_cast<int64_t>(components[c].size()));  // (_group_clip checks them)
  }
  using Signature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::IntArrayRef,
                                                      int64_t, double, c10::string_view, double);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_group_clip", "")
                             .typed<Signature>();
  const at::Tensor sq = parts.size() == 1 ? parts[0].unsqueeze(0) : at::stack(parts);
  return op.call(sq, sizes, mean, max_norm, mode, gamma);
}

at::Tensor group_norms(const std::vector<std::vector<at::Tensor>>& components) {
  return std::get<1>(group_clip(components, /*mean=*/1, /*max_norm=*/1.0, "flat", 0.01));
}

at::Tensor mean_scaled_sq(const at::Tensor& sq, int64_t b) {
  TORCH_CHECK(b >= 1 && b < (int64_t{1} << 26),
              "dpzero::dp::mean_scaled_sq: b must be in [1, 2^26) rows (b^2 exact), got ", b);
  if (b == 1) return sq;
  const double bb = static_cast<double>(b) * static_cast<double>(b);  // exact below 2^26 rows
  return certify_op(sq, c10::nullopt, bb, Step::kScaleUp);
}

at::Tensor mean_scaled_factors(const at::Tensor& factors, int64_t b) {
  TORCH_CHECK(b >= 1 && b < (int64_t{1} << 29),
              "dpzero::dp::mean_scaled_factors: b must be in [1, 2^29) rows (c b exact), got ",
              b);
  if (b == 1) return factors;
  // c_i · b is exact in float64 (a float32 times an integer below 2^29).
  return certify_op(factors, c10::nullopt, static_cast<double>(b), Step::kScaleDown);
}

at::Tensor certified_sum(const std::vector<at::Tensor>& sqs) {
  TORCH_CHECK(!sqs.empty() && sqs.size() <= 8, "dpzero::dp::certified_sum: takes 1 to 8 [B] "
              "float32 squared norms, got ", sqs.size());
  for (size_t p = 0; p < sqs.size(); ++p) check_sq("certified_sum", sqs[p], sqs[0], 0, p);
  if (sqs.size() == 1) return sqs[0];
  return certify_op(at::stack(sqs), c10::nullopt, 0.0, Step::kSumUp);
}

}  // namespace dpzero::dp
