// kernels/per_sample/conv.h — the per-sample ops of Conv1d and Conv2d (Note [per-sample ops] in
// kernels/per_sample_ops.h; schemas in kernels/ops.cpp).
#pragma once

#include "kernels/per_sample/common.h"
// A Conv is a Linear over its input's patches.
#include "kernels/per_sample/linear.h"

namespace dpzero::kernels {
namespace per_sample {

// ---- Conv1d / Conv2d: input [B, C_in, (H,) W], G [B, C_out, (H_out,) W_out] ---------------------
// Through im2col: the unfolded input U_i [C_in*K, L] (K = kernel numel, L = output positions)
// turns group j's convolution into a Linear layer with A = U_i[rows of group j]^T [L, C_in/g*K]
// and G = G_i[channels of group j]^T [L, C_out/g] (Bu et al. 2022, ghost clipping of convolutions
// via unfold). Padding is zeros ('same'/'valid' strings and other padding modes: pad the input
// first and pass 0).

struct ConvGeometry {
  at::IntArrayRef kernel_size, stride, padding, dilation;  // as given (1 or 2 dims)
  std::vector<int64_t> k2, s2, p2, d2;                     // the 2-D im2col arguments
  int64_t groups, c_in, c_out, kernel_numel, positions;
};

inline ConvGeometry check_conv_args(const char* op, const at::Tensor& input, const at::Tensor& G,
                                    at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                    at::IntArrayRef padding, at::IntArrayRef dilation,
                                    int64_t groups) {
  check_floating(op, "input", input);
  check_floating(op, "G", G);
  check_same_device(op, "G", G, input, "input");
  const int64_t nd = static_cast<int64_t>(kernel_size.size());
  TORCH_CHECK(nd == 1 || nd == 2, "dpzero::", op,
              ": kernel_size must have 1 (Conv1d) or 2 (Conv2d) entries, got ", kernel_size);
  TORCH_CHECK(static_cast<int64_t>(stride.size()) == nd &&
                  static_cast<int64_t>(padding.size()) == nd &&
                  static_cast<int64_t>(dilation.size()) == nd,
              "dpzero::", op, ": stride, padding and dilation must have ", nd,
              " entries like kernel_size, got stride ", stride, ", padding ", padding,
              ", dilation ", dilation);
  TORCH_CHECK(input.dim() == nd + 2 && G.dim() == nd + 2 && input.size(0) == G.size(0),
              "dpzero::", op, ": input must be [B, C_in, ", nd == 2 ? "H, W" : "L",
              "] and G [B, C_out, ", nd == 2 ? "H_out, W_out" : "L_out", "], got input ",
              input.sizes(), " and G ", G.sizes());
  TORCH_CHECK(groups >= 1 && input.size(1) % groups == 0 && G.size(1) % groups == 0, "dpzero::", op,
              ": groups must be >= 1 and divide C_in = ", input.size(1), " and C_out = ", G.size(1),
              ", got ", groups);
  ConvGeometry geo{kernel_size, stride, padding,       dilation,  {}, {}, {},
                   {},          groups, input.size(1), G.size(1), 1,  1};
  for (int64_t k = 0; k < nd; ++k) {
    TORCH_CHECK(kernel_size[k] >= 1 && stride[k] >= 1 && padding[k] >= 0 && dilation[k] >= 1,
                "dpzero::", op,
                ": need kernel_size, stride, dilation >= 1 and padding >= 0, got "
                "kernel_size ",
                kernel_size, ", stride ", stride, ", padding ", padding, ", dilation ", dilation);
    const int64_t in = input.size(2 + k);
    const int64_t want =
        (in + 2 * padding[k] - dilation[k] * (kernel_size[k] - 1) - 1) / stride[k] + 1;
    TORCH_CHECK(G.size(2 + k) == want, "dpzero::", op, ": G's spatial dim ", k, " is ",
                G.size(2 + k), " but the convolution of input ", input.sizes(), " gives ", want);
    geo.kernel_numel *= kernel_size[k];
    geo.positions *= want;
  }
  if (nd == 1) {  // Conv1d as a Conv2d of height 1.
    geo.k2 = {1, kernel_size[0]};
    geo.s2 = {1, stride[0]};
    geo.p2 = {0, padding[0]};
    geo.d2 = {1, dilation[0]};
  } else {
    geo.k2 = kernel_size.vec();
    geo.s2 = stride.vec();
    geo.p2 = padding.vec();
    geo.d2 = dilation.vec();
  }
  return geo;
}

// Samples [i0, i1) unfolded: [c, C_in*K, L] float32 (exact copies of the inputs, and zeros).
inline at::Tensor unfold(const ConvGeometry& geo, const at::Tensor& input, int64_t i0, int64_t i1) {
  at::Tensor x = f32(input.slice(0, i0, i1));
  if (geo.kernel_size.size() == 1) x = x.unsqueeze(2);
  return at::im2col(x, geo.k2, geo.d2, geo.p2, geo.s2);
}

// Group j of an unfolded chunk as a Linear layer: (A [c, L, C_in/g*K], G [c, L, C_out/g]).
inline std::pair<at::Tensor, at::Tensor> conv_group(const ConvGeometry& geo, const at::Tensor& cols,
                                                    const at::Tensor& g3, int64_t j) {
  const int64_t kin = geo.c_in / geo.groups * geo.kernel_numel, kout = geo.c_out / geo.groups;
  return {cols.narrow(1, j * kin, kin).transpose(1, 2),
          g3.narrow(1, j * kout, kout).transpose(1, 2)};
}

inline int64_t conv_chunk(const ConvGeometry& geo, int64_t b) {
  return samples_per_chunk(b, 8 * geo.positions * (geo.c_in * geo.kernel_numel + geo.c_out));
}

// Certified [B] float64 (weight, plus bias when `bias`), the checks done.
inline at::Tensor conv_sq_norms_f64(const ConvGeometry& geo, const at::Tensor& input,
                                    const at::Tensor& G, NormMethod method, bool bias) {
  const int64_t b = input.size(0);
  const at::Tensor g3 = G.reshape({b, geo.c_out, geo.positions});  // [B, C_out, L]
  at::Tensor out = at::empty({b}, input.options().dtype(at::kDouble));
  const int64_t chunk = conv_chunk(geo, b);
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor cols = unfold(geo, input, i0, i1);
    const at::Tensor gc = g3.slice(0, i0, i1);
    at::Tensor sq;
    for (int64_t j = 0; j < geo.groups; ++j) {
      auto [a_j, g_j] = conv_group(geo, cols, gc, j);
      const at::Tensor part = linear_sq_norms_btd(a_j, g_j, method, /*bias=*/false);
      sq = j == 0 ? part : add_up(sq, part);
    }
    out.slice(0, i0, i1).copy_(sq);
  }
  return bias ? add_up(out, bias_sq_norms_btd(g3.transpose(1, 2))) : out;
}

// Public: -> [B] float32 (weight, plus bias when `bias`).
inline at::Tensor conv_sq_norms(const at::Tensor& input, const at::Tensor& G,
                                at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                                bool bias, int64_t method) {
  constexpr const char* op = "conv_sq_norms";
  const NormMethod m = check_method(op, method);
  const ConvGeometry geo =
      check_conv_args(op, input, G, kernel_size, stride, padding, dilation, groups);
  const Fp32MatmulGuard precision;
  return to_f32_up(conv_sq_norms_f64(geo, input, G, m, bias));
}

// Public: scale [B] -> weight gradient [C_out, C_in/groups, *kernel_size] float32.
inline at::Tensor conv_clipped_sum(const at::Tensor& input, const at::Tensor& G,
                                   const at::Tensor& scale, at::IntArrayRef kernel_size,
                                   at::IntArrayRef stride, at::IntArrayRef padding,
                                   at::IntArrayRef dilation, int64_t groups) {
  constexpr const char* op = "conv_clipped_sum";
  const ConvGeometry geo =
      check_conv_args(op, input, G, kernel_size, stride, padding, dilation, groups);
  const int64_t b = input.size(0);
  check_scale(op, scale, b, G);
  const Fp32MatmulGuard precision;
  const int64_t kin = geo.c_in / groups * geo.kernel_numel, kout = geo.c_out / groups;
  at::Tensor out = at::zeros({geo.c_out, kin}, input.options().dtype(at::kFloat));
  const at::Tensor g3 = G.reshape({b, geo.c_out, geo.positions});
  const bool host = host_factors_apply(scale, input, G);
  const int64_t chunk = conv_chunk(geo, b);
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor cols = unfold(geo, input, i0, i1);
    const at::Tensor gc = g3.slice(0, i0, i1);
    for (int64_t j = 0; j < groups; ++j) {
      auto [a_j, g_j] = conv_group(geo, cols, gc, j);
      at::Tensor out_j = out.narrow(0, j * kout, kout);
      add_linear_clipped_sum(out_j, a_j, g_j, scale.slice(0, i0, i1),
                             host, /*transposed=*/false);
    }
  }
  std::vector<int64_t> shape{geo.c_out, geo.c_in / groups};
  for (int64_t k : kernel_size) shape.push_back(k);
  return out.reshape(shape);
}

// Public fused op: (grad_weight, grad_bias [C_out] or [0], sq_norms, factors, non-finite count).
inline ClipResult conv_clip(const at::Tensor& input, const at::Tensor& G,
                            at::IntArrayRef kernel_size, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                            double max_norm, c10::string_view mode, double gamma, bool bias,
                            int64_t method) {
  constexpr const char* op = "conv_clip";
  const NormMethod m = check_method(op, method);
  const ConvGeometry geo =
      check_conv_args(op, input, G, kernel_size, stride, padding, dilation, groups);
  check_clip_op_args(op, max_norm, mode, gamma);
  const Fp32MatmulGuard precision;
  const at::Tensor sq = conv_sq_norms_f64(geo, input, G, m, bias);
  auto [factors, nonfinite] = clip_from_sq_norms(sq, max_norm, mode, gamma);
  at::Tensor grad_w =
      conv_clipped_sum(input, G, factors, kernel_size, stride, padding, dilation, groups);
  at::Tensor grad_b =
      bias ? bias_clipped_sum_btd(G.flatten(2).transpose(1, 2), factors) : no_bias_grad(G);
  return {grad_w, grad_b, to_f32_up(sq), factors, nonfinite};
}

}  // namespace per_sample
}  // namespace dpzero::kernels
