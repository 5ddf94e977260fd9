// src/dp/clip_group.cpp — see clip_group.h (Note [certified group norms]).
#include "src/dp/clip_group.h"

#include <cmath>
#include <limits>

#include <c10/util/Exception.h>

namespace dpzero::dp {
namespace {

// The relative padding of Note [certified group norms].
constexpr double kPad = 1.0 + 1e-12;

void check_sq(const at::Tensor& sq, const at::Tensor& first, size_t component, size_t part) {
  TORCH_CHECK(sq.dim() == 1 && sq.scalar_type() == at::kFloat,
              "dpzero::dp::group_norms: component ", component, " part ", part,
              ": squared norms must be [B] float32, got ", sq.scalar_type(), " of shape ",
              sq.sizes());
  TORCH_CHECK(sq.size(0) == first.size(0) && sq.device() == first.device(),
              "dpzero::dp::group_norms: component ", component, " part ", part, " has ",
              sq.size(0), " rows on ", sq.device(), ", the group's first part ", first.size(0),
              " on ", first.device(), ": every part of a group is one micro-batch");
}

}  // namespace

at::Tensor round_up_f32(const at::Tensor& x) {
  const at::Tensor f = x.to(at::kFloat);
  const at::Tensor inf = at::full({}, std::numeric_limits<float>::infinity(), f.options());
  return at::where(f.to(at::kDouble) < x, at::nextafter(f, inf), f);
}

at::Tensor round_down_f32(const at::Tensor& x) {
  const at::Tensor f = x.to(at::kFloat);
  const at::Tensor zero = at::zeros({}, f.options());
  return at::where(f.to(at::kDouble) > x, at::nextafter(f, zero), f);
}

at::Tensor group_norms(const std::vector<std::vector<at::Tensor>>& components) {
  TORCH_CHECK(!components.empty(), "dpzero::dp::group_norms: a group has at least one component");
  TORCH_CHECK(!components[0].empty(),
              "dpzero::dp::group_norms: component 0 has no parts");
  const at::Tensor& first = components[0][0];
  at::Tensor total;  // [B] float64: the group's squared norm
  for (size_t c = 0; c < components.size(); ++c) {
    const auto& parts = components[c];
    TORCH_CHECK(!parts.empty(), "dpzero::dp::group_norms: component ", c, " has no parts");
    at::Tensor sq;
    if (parts.size() == 1) {
      check_sq(parts[0], first, c, 0);
      sq = parts[0].to(at::kDouble);
    } else {
      at::Tensor n;  // Σ_p √sq_p: the triangle bound on the component's norm
      for (size_t p = 0; p < parts.size(); ++p) {
        check_sq(parts[p], first, c, p);
        const at::Tensor root = at::sqrt(parts[p].to(at::kDouble));
        n = n.defined() ? n + root : root;
      }
      n = n * kPad;
      sq = n * n;
    }
    total = total.defined() ? total + sq : sq;
  }
  return round_up_f32(at::sqrt(total) * kPad);
}

at::Tensor mean_scaled_sq(const at::Tensor& sq, int64_t b) {
  TORCH_CHECK(b >= 1, "dpzero::dp::mean_scaled_sq: b must be >= 1 rows, got ", b);
  if (b == 1) return sq;
  const double bb = static_cast<double>(b) * static_cast<double>(b);  // exact below 2^26 rows
  return round_up_f32(sq.to(at::kDouble) * bb * (1.0 + 1e-15));
}

at::Tensor mean_scaled_factors(const at::Tensor& factors, int64_t b) {
  TORCH_CHECK(b >= 1, "dpzero::dp::mean_scaled_factors: b must be >= 1 rows, got ", b);
  if (b == 1) return factors;
  // c_i · b is exact in float64 (a float32 times an integer below 2^29).
  return round_down_f32(factors.to(at::kDouble) * static_cast<double>(b));
}

}  // namespace dpzero::dp
