// kernels/certify_checks.h — argument checks and result shapes shared by the CPU and CUDA
// implementations of dpzero::_certify, dpzero::_group_clip and dpzero::_scale_rows (schemas in
// kernels/ops.cpp), so both backends refuse the same calls with the same words.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include "kernels/certify.h"
#include "kernels/clip_checks.h"

namespace dpzero::kernels::certify {

// Whether `step` takes S (the steps that certify, and kAdd's second bound).
inline bool takes_s(Step step) {
  return step == Step::kGhost || step == Step::kDirect || step == Step::kRows ||
         step == Step::kAdd;
}

// Checks a _certify call; returns its step and the result (uninitialised, on value's device).
inline std::pair<Step, at::Tensor> certify_result(const at::Tensor& value,
                                                  const c10::optional<at::Tensor>& s,
                                                  int64_t step, bool f32, double margin,
                                                  const c10::optional<at::Tensor>& rest,
                                                  const c10::optional<at::Tensor>& rest_rows = {},
                                                  const c10::optional<at::Tensor>& rest_s = {},
                                                  double rest_coef = 0.0) {
  TORCH_CHECK(step >= 0 && step < kSteps, "dpzero::_certify: step must be in [0, ", kSteps,
              "), got ", step);
  const Step st = static_cast<Step>(step);
  TORCH_CHECK(std::isfinite(margin) && margin >= 0.0 &&
                  (margin == 0.0 || st == Step::kGhost || st == Step::kDirect ||
                   st == Step::kRows),
              "dpzero::_certify: margin must be finite and >= 0, and 0 for step ", step, ", got ",
              margin);
  TORCH_CHECK(value.scalar_type() == at::kDouble || value.scalar_type() == at::kFloat,
              "dpzero::_certify: value must be float64 or float32, got ", value.scalar_type());
  std::vector<int64_t> shape = value.sizes().vec();
  if (st == Step::kRows || st == Step::kSumUp) {
    TORCH_CHECK(value.dim() == 2, "dpzero::_certify: step ", step, " takes value [",
                st == Step::kRows ? "B, n" : "P, B", "], got shape ", value.sizes());
    shape = {value.size(st == Step::kRows ? 0 : 1)};
  }
  if (takes_s(st)) {
    TORCH_CHECK(s.has_value() && s->defined(), "dpzero::_certify: step ", step, " takes S");
    TORCH_CHECK(s->scalar_type() == at::kDouble, "dpzero::_certify: S must be float64, got ",
                s->scalar_type());
    TORCH_CHECK(s->sizes().vec() == shape, "dpzero::_certify: S must have shape ", shape,
                " for value of shape ", value.sizes(), ", got ", s->sizes());
    TORCH_CHECK(s->device() == value.device(), "dpzero::_certify: S is on ", s->device(),
                ", value on ", value.device());
  } else {
    TORCH_CHECK(!s.has_value() || !s->defined(), "dpzero::_certify: step ", step,
                " takes no S");
  }
  const bool out_f64 = gives_f64(st) && !f32;
  const bool has_rest = rest.has_value() && rest->defined();
  const bool has_rows = rest_rows.has_value() && rest_rows->defined();
  if (has_rest || has_rows) {
    // Added as certified_sum adds two parts: to a certified float32 squared norm only.
    TORCH_CHECK((st == Step::kGhost || st == Step::kDirect || st == Step::kRows)
                    ? f32
                    : st == Step::kRoundUp,
                "dpzero::_certify: rest is added to a float32 certified squared norm (steps 0, 1 "
                "and 2 with f32, or step 5), got step ", step, " with f32 ", f32);
    TORCH_CHECK(!(has_rest && has_rows), "dpzero::_certify: pass rest or rest_rows, not both");
  }
  if (has_rest) {
    TORCH_CHECK(rest->scalar_type() == at::kFloat && rest->sizes().vec() == shape,
                "dpzero::_certify: rest must be float32 of shape ", c10::IntArrayRef(shape),
                ", got ", rest->scalar_type(), " of shape ", rest->sizes());
    TORCH_CHECK(rest->device() == value.device(), "dpzero::_certify: rest is on ",
                rest->device(), ", value on ", value.device());
  }
  if (has_rows) {  // certify::rows_bound of each sample's kept row
    TORCH_CHECK(shape.size() == 1, "dpzero::_certify: rest_rows adds one row per sample to a "
                "result of shape [B], got value of shape ", value.sizes(), " at step ", step);
    TORCH_CHECK(rest_rows->scalar_type() == at::kDouble && rest_rows->dim() == 2 &&
                    rest_rows->size(0) == shape[0],
                "dpzero::_certify: rest_rows must be float64 [B, n] with B = ", shape[0],
                ", got ", rest_rows->scalar_type(), " of shape ", rest_rows->sizes());
    TORCH_CHECK(rest_s.has_value() && rest_s->defined() &&
                    rest_s->scalar_type() == at::kDouble && rest_s->sizes().vec() == shape,
                "dpzero::_certify: rest_rows takes rest_s, float64 of shape ",
                c10::IntArrayRef(shape));
    TORCH_CHECK(rest_rows->device() == value.device() && rest_s->device() == value.device(),
                "dpzero::_certify: rest_rows and rest_s must be on value's device ",
                value.device());
    TORCH_CHECK(std::isfinite(rest_coef) && rest_coef >= 0.0,
                "dpzero::_certify: rest_coef must be finite and >= 0, got ", rest_coef);
  } else {
    TORCH_CHECK((!rest_s.has_value() || !rest_s->defined()) && rest_coef == 0.0,
                "dpzero::_certify: rest_s and rest_coef go with rest_rows, which was not given "
                "(rest_coef ", rest_coef, ")");
  }
  return {st, at::empty(shape, value.options().dtype(out_f64 ? at::kDouble : at::kFloat))};
}

// A checked _certify call's rest as the kernels read it (certify::Rest), with the contiguous
// tensors it points into kept alive beside it.
struct RestOperands {
  at::Tensor value, rows, s;
  Rest rest;

  RestOperands(const c10::optional<at::Tensor>& rest_value,
               const c10::optional<at::Tensor>& rest_rows,
               const c10::optional<at::Tensor>& rest_s, double rest_coef) {
    if (rest_value && rest_value->defined()) {
      value = rest_value->contiguous();
      rest.value = value.data_ptr<float>();
    }
    if (rest_rows && rest_rows->defined()) {
      rows = rest_rows->contiguous();
      s = rest_s->contiguous();
      rest.rows = rows.data_ptr<double>();
      rest.s = s.data_ptr<double>();
      rest.n = rows.size(1);
      rest.coef = rest_coef;
      rest.has_rows = true;  // rows' pointer is null when n = 0
    }
  }
};

// Checks a _group_clip call; returns the clip mode and the float32 threshold.
inline std::pair<privacy::ClipMode, float> check_group_clip(const at::Tensor& sq,
                                                            at::IntArrayRef sizes, int64_t mean,
                                                            double max_norm,
                                                            c10::string_view mode,
                                                            double gamma) {
  const privacy::ClipMode clip_mode =
      check_clip_args("_group_clip", at::empty({0}, at::kFloat), max_norm, mode, gamma);
  TORCH_CHECK(sq.dim() == 2 && sq.scalar_type() == at::kFloat,
              "dpzero::_group_clip: sq must be [P, B] float32 (the parts' certified squared "
              "norms), got ", sq.scalar_type(), " of shape ", sq.sizes());
  // The padding kGroupPad covers up to 4000 parts per component and 9000 components (Note
  // [certified group norms] in src/dp/clip_group.h).
  TORCH_CHECK(!sizes.empty() && sizes.size() <= 9000, "dpzero::_group_clip: a group has 1 to "
              "9000 components (the certified bound covers no more), got ", sizes.size());
  int64_t parts = 0;
  for (size_t c = 0; c < sizes.size(); ++c) {
    TORCH_CHECK(sizes[c] >= 1 && sizes[c] <= 4000, "dpzero::_group_clip: component ", c,
                " has ", sizes[c], " parts; each has 1 to 4000 (the certified bound covers no "
                "more)");
    parts += sizes[c];
  }
  TORCH_CHECK(parts == sq.size(0), "dpzero::_group_clip: the components' sizes add up to ", parts,
              " parts, sq has ", sq.size(0));
  TORCH_CHECK(mean >= 1 && mean < (int64_t{1} << 26),
              "dpzero::_group_clip: mean must be in [1, 2^26) rows (mean^2 exact), got ", mean);
  return {clip_mode, privacy::threshold_f32(max_norm)};
}

// Checks a _scale_rows call.
inline void check_scale_rows(const at::Tensor& x, const at::Tensor& scale) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
              "dpzero::_scale_rows: x must be float32 or float64, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "dpzero::_scale_rows: x must be [B, ...], got a 0-dim tensor");
  TORCH_CHECK(scale.dim() == 1 && scale.scalar_type() == at::kFloat &&
                  scale.size(0) == x.size(0),
              "dpzero::_scale_rows: scale must be [", x.size(0), "] float32 (one factor per row "
              "of x), got ", scale.scalar_type(), " of shape ", scale.sizes());
  TORCH_CHECK(scale.device() == x.device(), "dpzero::_scale_rows: scale is on ", scale.device(),
              ", x on ", x.device());
}

}  // namespace dpzero::kernels::certify
