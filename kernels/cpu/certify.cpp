// kernels/cpu/certify.cpp — CPU implementations of dpzero::_certify and dpzero::_group_clip
// (schemas in kernels/ops.cpp; the arithmetic is kernels/certify.h's, run here as a scalar loop
// over the samples, which at a few hundred samples costs less than handing it to threads).
// Compiled with -ffp-contract=off (kernels/CMakeLists.txt): every operation rounds once, as
// kernels/cuda/certify.cu's do.
#include <cstdint>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "kernels/certify.h"
#include "kernels/certify_checks.h"

namespace dpzero::kernels {
namespace {

using certify::Step;

template <typename in_t, typename out_t>
void certify_loop(Step step, const in_t* v, const double* s, double coef, double margin,
                  bool f32, const certify::Rest& rest, out_t* out, int64_t rows,
                  int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    double r;
    if (step == Step::kRows) {  // q in row order
      double q = 0.0;
      for (int64_t j = 0; j < cols; ++j) {
        const double x = static_cast<double>(v[i * cols + j]);
        q += x * x;
      }
      r = certify::direct_bound(q, s[i], coef + margin);
    } else if (step == Step::kSumUp) {  // v [P, B]: rows = B, cols = P
      double total = 0.0;
      for (int64_t p = 0; p < cols; ++p) total += static_cast<double>(v[p * rows + i]);
      r = certify::sum_up(total);
    } else {
      r = certify::elementwise(step, static_cast<double>(v[i]), s ? s[i] : 0.0, coef, margin);
    }
    out[i] = static_cast<out_t>(f32 && certify::gives_f64(step) ? certify::f32_up(r) : r);
    if (rest.any()) {
      out[i] = static_cast<out_t>(certify::plus_rest(static_cast<float>(out[i]), rest.at(i)));
    }
  }
}

at::Tensor certify_cpu(const at::Tensor& value, const c10::optional<at::Tensor>& S, double coef,
                       int64_t step, bool f32, double margin,
                       const c10::optional<at::Tensor>& rest,
                       const c10::optional<at::Tensor>& rest_rows,
                       const c10::optional<at::Tensor>& rest_s, double rest_coef) {
  auto [st, out] =
      certify::certify_result(value, S, step, f32, margin, rest, rest_rows, rest_s, rest_coef);
  const at::Tensor v = value.contiguous();
  const at::Tensor s = certify::takes_s(st) ? S->contiguous() : at::Tensor();
  const certify::RestOperands held(rest, rest_rows, rest_s, rest_coef);
  const certify::Rest& pr = held.rest;
  const int64_t rows = out.numel();
  const int64_t cols = st == Step::kRows ? v.size(1) : st == Step::kSumUp ? v.size(0) : 1;
  const double* ps = s.defined() ? s.data_ptr<double>() : nullptr;
  const auto run = [&](auto* pv) {
    if (out.scalar_type() == at::kDouble) {
      certify_loop(st, pv, ps, coef, margin, f32, pr, out.data_ptr<double>(), rows, cols);
    } else {
      certify_loop(st, pv, ps, coef, margin, f32, pr, out.data_ptr<float>(), rows, cols);
    }
  };
  if (v.scalar_type() == at::kDouble) {
    run(v.data_ptr<double>());
  } else {
    run(v.data_ptr<float>());
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> group_clip_cpu(const at::Tensor& sq, at::IntArrayRef sizes,
                                                  int64_t mean, double max_norm,
                                                  c10::string_view mode, double gamma) {
  const auto [clip_mode, threshold] =
      certify::check_group_clip(sq, sizes, mean, max_norm, mode, gamma);
  const at::Tensor q = sq.contiguous();
  const int64_t b = q.size(1);
  at::Tensor factors = at::empty({b}, q.options());
  at::Tensor norms = at::empty({b}, q.options());
  const float* pq = q.data_ptr<float>();
  float* pf = factors.data_ptr<float>();
  float* pn = norms.data_ptr<float>();
  const auto components = static_cast<int64_t>(sizes.size());
  for (int64_t i = 0; i < b; ++i) {
    pn[i] = certify::group_norm(pq, sizes.data(), components, b, i, mean);
    pf[i] = certify::group_factor(pn[i], threshold, clip_mode, static_cast<float>(gamma), mean);
  }
  return {factors, norms};
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CPU, m) {
  m.impl("_certify", &certify_cpu);
  m.impl("_group_clip", &group_clip_cpu);
}

}  // namespace dpzero::kernels
