// src/dp/clip_group.cpp — see clip_group.h (Note [certified group norms]).
#include "src/dp/clip_group.h"

#include <cmath>
#include <limits>
#include <vector>

#include <c10/util/Exception.h>

#include "kernels/per_sample_ops.h"  // f32_up, to_f32_up: the kernels' directed roundings

namespace dpzero::dp {
namespace {

using kernels::per_sample::f32_up;

// The relative padding of Note [certified group norms].
constexpr double kPad = 1.0 + 1e-12;

// Note [host certification] (kernels/per_sample_ops.h): on the host these [B] computations run
// as one scalar loop each instead of a handful of ATen calls; the same IEEE operations, rounded
// the same way.
bool on_host(const at::Tensor& x) { return kernels::host_path(x) && x.is_contiguous(); }

float f32_down(double x) {  // x >= 0
  const float f = static_cast<float>(x);
  return static_cast<double>(f) > x ? std::nextafter(f, 0.0f) : f;
}

// out[i] = fn(i) for a [n] float32 result on `like`'s device.
template <typename Fn>
at::Tensor host_f32(const at::Tensor& like, int64_t n, Fn fn) {
  at::Tensor out = at::empty({n}, like.options().dtype(at::kFloat));
  float* po = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) po[i] = fn(i);
  return out;
}

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

at::Tensor round_up_f32(const at::Tensor& x) { return kernels::per_sample::to_f32_up(x); }

at::Tensor round_down_f32(const at::Tensor& x) {
  if (on_host(x) && x.scalar_type() == at::kDouble && x.dim() == 1) {
    const double* px = x.data_ptr<double>();
    return host_f32(x, x.size(0), [&](int64_t i) { return f32_down(px[i]); });
  }
  const at::Tensor f = x.to(at::kFloat);
  const at::Tensor zero = at::zeros({}, f.options());
  return at::where(f.to(at::kDouble) > x, at::nextafter(f, zero), f);
}

at::Tensor group_norms(const std::vector<std::vector<at::Tensor>>& components) {
  TORCH_CHECK(!components.empty(), "dpzero::dp::group_norms: a group has at least one component");
  TORCH_CHECK(!components[0].empty(),
              "dpzero::dp::group_norms: component 0 has no parts");
  const at::Tensor& first = components[0][0];
  // The padding kPad covers up to 4000 parts per component and 9000 components (Note
  // [certified group norms]).
  TORCH_CHECK(components.size() <= 9000, "dpzero::dp::group_norms: ", components.size(),
              " components in one group: the certified bound covers at most 9000");
  for (size_t c = 0; c < components.size(); ++c) {
    TORCH_CHECK(components[c].size() <= 4000, "dpzero::dp::group_norms: component ", c,
                " has ", components[c].size(), " parts (layer calls sharing a parameter): the "
                "certified bound covers at most 4000");
    TORCH_CHECK(!components[c].empty(), "dpzero::dp::group_norms: component ", c,
                " has no parts");
    for (size_t p = 0; p < components[c].size(); ++p) {
      check_sq("group_norms", components[c][p], first, c, p);
    }
  }
  bool host = true;
  for (const auto& parts : components) {
    for (const at::Tensor& sq : parts) host = host && on_host(sq);
  }
  if (host) {
    const int64_t b = first.size(0);
    std::vector<double> total(static_cast<size_t>(b), 0.0);
    std::vector<const float*> ptrs;
    for (const auto& parts : components) {
      ptrs.clear();
      for (const at::Tensor& part : parts) ptrs.push_back(part.data_ptr<float>());
      for (int64_t i = 0; i < b; ++i) {
        double sq;
        if (ptrs.size() == 1) {
          sq = ptrs[0][i];
        } else {
          double n = 0.0;
          for (const float* part : ptrs) n += std::sqrt(double{part[i]});
          n *= kPad;
          sq = n * n;
        }
        total[static_cast<size_t>(i)] += sq;
      }
    }
    return host_f32(first, b, [&](int64_t i) {
      return f32_up(std::sqrt(total[static_cast<size_t>(i)]) * kPad);
    });
  }
  at::Tensor total;  // [B] float64: the group's squared norm
  for (size_t c = 0; c < components.size(); ++c) {
    const auto& parts = components[c];
    at::Tensor sq;
    if (parts.size() == 1) {
      sq = kernels::as_dtype(parts[0], at::kDouble);
    } else {
      at::Tensor n;  // Σ_p √sq_p: the triangle bound on the component's norm
      for (size_t p = 0; p < parts.size(); ++p) {
        const at::Tensor root = at::sqrt(kernels::as_dtype(parts[p], at::kDouble));
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
  TORCH_CHECK(b >= 1 && b < (int64_t{1} << 26),
              "dpzero::dp::mean_scaled_sq: b must be in [1, 2^26) rows (b^2 exact), got ", b);
  if (b == 1) return sq;
  const double bb = static_cast<double>(b) * static_cast<double>(b);  // exact below 2^26 rows
  if (on_host(sq) && sq.scalar_type() == at::kFloat && sq.dim() == 1) {
    const float* ps = sq.data_ptr<float>();
    return host_f32(sq, sq.size(0), [&](int64_t i) {
      return f32_up(double{ps[i]} * bb * (1.0 + 1e-15));
    });
  }
  return round_up_f32(kernels::as_dtype(sq, at::kDouble) * bb * (1.0 + 1e-15));
}

at::Tensor mean_scaled_factors(const at::Tensor& factors, int64_t b) {
  TORCH_CHECK(b >= 1 && b < (int64_t{1} << 29),
              "dpzero::dp::mean_scaled_factors: b must be in [1, 2^29) rows (c b exact), got ",
              b);
  if (b == 1) return factors;
  // c_i · b is exact in float64 (a float32 times an integer below 2^29).
  if (on_host(factors) && factors.scalar_type() == at::kFloat && factors.dim() == 1) {
    const float* pf = factors.data_ptr<float>();
    return host_f32(factors, factors.size(0), [&](int64_t i) {
      return f32_down(double{pf[i]} * static_cast<double>(b));
    });
  }
  return round_down_f32(kernels::as_dtype(factors, at::kDouble) * static_cast<double>(b));
}

at::Tensor certified_sum(const std::vector<at::Tensor>& sqs) {
  TORCH_CHECK(!sqs.empty() && sqs.size() <= 8, "dpzero::dp::certified_sum: takes 1 to 8 [B] "
              "float32 squared norms, got ", sqs.size());
  for (size_t p = 0; p < sqs.size(); ++p) check_sq("certified_sum", sqs[p], sqs[0], 0, p);
  if (sqs.size() == 1) return sqs[0];
  bool host = true;
  for (const at::Tensor& sq : sqs) host = host && on_host(sq);
  if (host) {
    std::vector<const float*> ptrs;
    for (const at::Tensor& sq : sqs) ptrs.push_back(sq.data_ptr<float>());
    return host_f32(sqs[0], sqs[0].size(0), [&](int64_t i) {
      double total = 0.0;
      for (const float* sq : ptrs) total += sq[i];
      return f32_up(total * (1.0 + 1e-15));
    });
  }
  at::Tensor total = kernels::as_dtype(sqs[0], at::kDouble);
  for (size_t p = 1; p < sqs.size(); ++p) total = total + kernels::as_dtype(sqs[p], at::kDouble);
  return round_up_f32(total * (1.0 + 1e-15));
}

}  // namespace dpzero::dp
