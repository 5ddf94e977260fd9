// kernels/per_sample/norm.h — the per-sample ops of LayerNorm and RMSNorm (Note [per-sample
// ops] in kernels/per_sample_ops.h; schemas in kernels/ops.cpp).
#pragma once

#include "kernels/per_sample/common.h"
#include "kernels/per_sample/linear.h"  // the bias path (a norm layer's bias is a Linear bias)

namespace dpzero::kernels {
namespace per_sample {

// ---- LayerNorm / RMSNorm: input x [B, ..., normalized_shape] (raw, before normalisation), G like x
// The op computes x̂ itself from the raw input and eps, in float64, so a hook keeps only the layer
// input it already has. Normalisation is over the last `normalized_ndim` dims, flattened into d
// (the dims between the batch dim and those are flattened into T).
//   LayerNorm (Ba et al. 2016, "Layer normalization"): x̂ = (x - mean) / sqrt(var + eps), var
//   biased, as torch.nn.LayerNorm;  RMSNorm (Zhang & Sennrich 2019, "Root mean square layer
//   normalization"): x̂ = x / sqrt(mean(x^2) + eps), as torch.nn.RMSNorm.
// Per-sample gradients: weight sum_t G_{i,t} ⊙ x̂_{i,t}, bias sum_t G_{i,t} (both normalized_shape).

inline void check_norm_layer_args(const char* op, const at::Tensor& x, const at::Tensor& g,
                                  double eps, int64_t normalized_ndim) {
  check_floating(op, "input", x);
  check_floating(op, "G", g);
  check_same_device(op, "G", g, x, "input");
  TORCH_CHECK(x.dim() >= 2 && x.sizes() == g.sizes(), "dpzero::", op,
              ": input and G must both be [B, ..., d] of one shape, got input ", x.sizes(),
              " and G ", g.sizes());
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, "dpzero::", op,
              ": eps must be finite and >= 0, got ", eps);
  TORCH_CHECK(normalized_ndim >= 1 && normalized_ndim < x.dim(), "dpzero::", op,
              ": normalized_ndim must be in [1, input.dim() - 1] = [1, ", x.dim() - 1, "], got ",
              normalized_ndim);
}

// x [B, ..., normalized_shape] viewed as [B, T, d], d = the product of the normalized dims.
inline at::Tensor as_norm_btd(const at::Tensor& x, int64_t normalized_ndim) {
  const int64_t first = x.dim() - normalized_ndim;
  int64_t t = 1, d = 1;
  for (int64_t k = 1; k < first; ++k) t *= x.size(k);
  for (int64_t k = first; k < x.dim(); ++k) d *= x.size(k);
  return x.reshape({x.size(0), t, d});
}

inline std::vector<int64_t> normalized_shape(const at::Tensor& x, int64_t normalized_ndim) {
  return x.sizes().slice(static_cast<size_t>(x.dim() - normalized_ndim)).vec();
}

// Per-sample weight gradients sum_t G_{i,t} ⊙ x̂_{i,t} and their certified squared norms:
// ([B, d] float64, [B] float64, or float32 rounded up when `f32`). x, g [B, T, d]. `rest` (with
// `f32`): the bias's kept rows (bias_rows_btd), certified and added in the same pass (_certify's
// rest_rows: on the host, the bits of dp::certified_sum of the two norms).
inline std::tuple<at::Tensor, at::Tensor> layer_norm_per_sample_btd(
    const at::Tensor& x, const at::Tensor& g, double eps, bool rms, bool f32 = false,
    const KeptRest& rest = {}) {
  auto [grads, s] = norm_row_sums(x, g, eps, rms);
  const double e = rounding_gamma(static_cast<double>(x.size(1) + 1));
  // The margin of one float32 rounding of the contribution, as bias_per_sample_btd's.
  return {grads, certify_op(grads, s, direct_coefficient(e, x.size(2) + 1), Step::kRows, f32,
                            clipped_sum_margin(1), c10::nullopt, rest)};
}

// Certified [B] float64 (weight, plus bias when `bias`). x, g [B, T, d].
inline at::Tensor layer_norm_sq_norms_btd(const at::Tensor& x, const at::Tensor& g, double eps,
                                          bool rms, bool bias) {
  const at::Tensor out = std::get<1>(layer_norm_per_sample_btd(x, g, eps, rms));
  return bias ? add_up(out, bias_sq_norms_btd(g)) : out;
}

// Public: -> (per-sample weight gradients [B, *normalized_shape] float64, certified squared norms
// [B] float32) (Note [kept per-sample gradients]); the bias's come from bias_per_sample.
// The book's form of it: `rest`, the bias's kept rows from bias_rows, whose norm is added into
// the weight's (Note [kept per-sample gradients]).
inline std::tuple<at::Tensor, at::Tensor> layer_norm_per_sample_plus(
    const at::Tensor& input, const at::Tensor& G, double eps, bool rms, int64_t normalized_ndim,
    const KeptRest& rest) {
  constexpr const char* op = "layer_norm_per_sample";
  check_norm_layer_args(op, input, G, eps, normalized_ndim);
  const Fp32MatmulGuard precision;
  auto [grads, sq] = layer_norm_per_sample_btd(as_norm_btd(input, normalized_ndim),
                                               as_norm_btd(G, normalized_ndim), eps, rms,
                                               /*f32=*/true, rest);
  std::vector<int64_t> shape = normalized_shape(input, normalized_ndim);
  shape.insert(shape.begin(), input.size(0));
  return {grads.reshape(shape), sq};
}

inline std::tuple<at::Tensor, at::Tensor> layer_norm_per_sample(const at::Tensor& input,
                                                                const at::Tensor& G, double eps,
                                                                bool rms,
                                                                int64_t normalized_ndim) {
  return layer_norm_per_sample_plus(input, G, eps, rms, normalized_ndim, KeptRest{});
}

// Public: -> [B] float32 (weight, plus bias when `bias`).
inline at::Tensor layer_norm_sq_norms(const at::Tensor& input, const at::Tensor& G, double eps,
                                      bool rms, bool bias, int64_t normalized_ndim) {
  constexpr const char* op = "layer_norm_sq_norms";
  check_norm_layer_args(op, input, G, eps, normalized_ndim);
  const Fp32MatmulGuard precision;
  return to_f32_up(layer_norm_sq_norms_btd(as_norm_btd(input, normalized_ndim),
                                           as_norm_btd(G, normalized_ndim), eps, rms, bias));
}

// Public: scale [B] -> weight gradient [normalized_shape] float32 (summed in float64).
inline at::Tensor layer_norm_clipped_sum(const at::Tensor& input, const at::Tensor& G,
                                         const at::Tensor& scale, double eps, bool rms,
                                         int64_t normalized_ndim) {
  constexpr const char* op = "layer_norm_clipped_sum";
  check_norm_layer_args(op, input, G, eps, normalized_ndim);
  const at::Tensor x = as_norm_btd(input, normalized_ndim), g = as_norm_btd(G, normalized_ndim);
  check_scale(op, scale, x.size(0), G);
  const Fp32MatmulGuard precision;
  const at::Tensor sums = std::get<0>(norm_row_sums(x, g, eps, rms));  // [B, d] float64
  const at::Tensor out = scale_rows(sums, scale, /*multiply=*/true).sum(0);
  return f32(out).reshape(normalized_shape(input, normalized_ndim));
}

// Public fused op: (grad_weight, grad_bias or [0], sq_norms, factors, non-finite count); the
// gradients have the normalized shape.
inline ClipResult layer_norm_clip(const at::Tensor& input, const at::Tensor& G, double eps,
                                  double max_norm, c10::string_view mode, double gamma, bool rms,
                                  bool bias, int64_t normalized_ndim) {
  constexpr const char* op = "layer_norm_clip";
  check_norm_layer_args(op, input, G, eps, normalized_ndim);
  check_clip_op_args(op, max_norm, mode, gamma);
  const Fp32MatmulGuard precision;
  const at::Tensor g = as_norm_btd(G, normalized_ndim);
  const at::Tensor sq =
      layer_norm_sq_norms_btd(as_norm_btd(input, normalized_ndim), g, eps, rms, bias);
  auto [factors, nonfinite] = clip_from_sq_norms(sq, max_norm, mode, gamma);
  at::Tensor grad_w = layer_norm_clipped_sum(input, G, factors, eps, rms, normalized_ndim);
  at::Tensor grad_b = bias ? bias_clipped_sum_btd(g, factors).reshape(
                                 normalized_shape(input, normalized_ndim))
                           : no_bias_grad(G);
  return {grad_w, grad_b, to_f32_up(sq), factors, nonfinite};
}

}  // namespace per_sample
}  // namespace dpzero::kernels
