// kernels/per_sample/conv.h — the per-sample ops of Conv1d and Conv2d (Note [per-sample ops] in
// kernels/per_sample_ops.h; schemas in kernels/ops.cpp).
#pragma once

#include <optional>
#include <tuple>

#include "kernels/per_sample/common.h"
// A Conv is a Linear over its input's patches.
#include "kernels/per_sample/linear.h"

namespace dpzero::kernels {
namespace per_sample {

// ---- Conv1d / Conv2d: input [B, C_in, (H,) W], G [B, C_out, (H_out,) W_out] ---------------------
// Through the input's patches: sample i's patches P_i [L, K*C_in] (K = kernel numel, L = output
// positions; Note [kernel-major patches]) turn group j's convolution into a Linear layer with
// A = P_i[columns of group j] [L, K*C_in/g] and G = G_i[channels of group j]^T [L, C_out/g] (Bu
// et al. 2022, ghost clipping of convolutions via unfold). Padding is zeros ('same'/'valid'
// strings and other padding modes: pad the input first and pass 0).

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

// Note [kernel-major patches]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A Conv's A is its input's patches, one row per output position. im2col writes them as
// [c, C_in*K, L] (channel-major columns, the weight's own order), whose transpose is the
// [c, L, C_in*K] a Linear takes: a strided operand that the ops then copied, two passes over the
// largest tensor of the layer. Here each row is gathered in kernel-major order (kernel position,
// then channel) from the input in channels-last layout, one pass writing [c, L, K*C_in] with
// runs of C_in contiguous floats. Each row is the im2col row with its columns permuted by the
// same permutation, so every per-sample norm is the norm of the same gradient's entries
// permuted (the Grams and the certified bounds are computed from the rows as given, Note
// [certified norms]); the clipped sum comes out in the same order, [C_out/g, K*C_in/g], and is
// permuted back to the weight's [C_out, C_in/g, *kernel_size] at the end.

// Samples [i0, i1) as their patches: [c, L, K*C_in] float32 (exact copies of the inputs, and
// zeros), columns kernel-major (Note [kernel-major patches]).
inline at::Tensor patches(const ConvGeometry& geo, const at::Tensor& input, int64_t i0,
                          int64_t i1) {
  at::Tensor x = f32(input.slice(0, i0, i1));
  if (geo.kernel_size.size() == 1) x = x.unsqueeze(2);  // [c, C_in, 1, W]
  x = at::constant_pad_nd(x, {geo.p2[1], geo.p2[1], geo.p2[0], geo.p2[0]}, 0.0);
  x = x.permute({0, 2, 3, 1}).contiguous();  // [c, H_p, W_p, C_in]
  const int64_t c = x.size(0), wp = x.size(2), ch = x.size(3);
  const int64_t h_out = (x.size(1) - geo.d2[0] * (geo.k2[0] - 1) - 1) / geo.s2[0] + 1;
  const int64_t w_out = (wp - geo.d2[1] * (geo.k2[1] - 1) - 1) / geo.s2[1] + 1;
  const int64_t row = wp * ch;  // one input row, all channels
  const at::Tensor view = x.as_strided(
      {c, h_out, w_out, geo.k2[0], geo.k2[1], ch},
      {x.size(1) * row, geo.s2[0] * row, geo.s2[1] * ch, geo.d2[0] * row, geo.d2[1] * ch, 1});
  return view.reshape({c, h_out * w_out, geo.kernel_numel * ch});
}

// Group j of a chunk's patches as a Linear layer: (A [c, L, K*C_in/g], G [c, L, C_out/g]).
inline std::pair<at::Tensor, at::Tensor> conv_group(const ConvGeometry& geo, const at::Tensor& rows,
                                                    const at::Tensor& g3, int64_t j) {
  const int64_t cg = geo.c_in / geo.groups, kout = geo.c_out / geo.groups;
  const at::Tensor a =
      geo.groups == 1
          ? rows
          : rows.view({rows.size(0), rows.size(1), geo.kernel_numel, geo.c_in})
                .narrow(3, j * cg, cg)
                .reshape({rows.size(0), rows.size(1), geo.kernel_numel * cg});
  return {a, g3.narrow(1, j * kout, kout).transpose(1, 2)};
}

// Samples per chunk of the patch loops (kConvChunkBytes on the CPU).
inline int64_t conv_chunk(const ConvGeometry& geo, int64_t b, const at::Tensor& input) {
  const int64_t budget = host_path(input)
                             ? std::min(kConvChunkBytes, chunk_bytes_budget().load())
                             : chunk_bytes_budget().load();
  const int64_t per = 8 * geo.positions * (geo.c_in * geo.kernel_numel + geo.c_out);
  return std::max<int64_t>(1, std::min<int64_t>(b, budget / std::max<int64_t>(1, per)));
}

// fn(i0, i1, j, A_j, G_j) for every chunk [i0, i1) of the samples and every group j: A_j the
// chunk's patches of group j [c, L, K*C_in/g] float32, G_j its output gradient [c, L, C_out/g]
// (conv_group). g3: G as [B, C_out, L].
template <typename Fn>
inline void for_each_patch_group(const ConvGeometry& geo, const at::Tensor& input,
                                 const at::Tensor& g3, Fn&& fn) {
  const int64_t b = input.size(0), chunk = conv_chunk(geo, b, input);
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor rows = patches(geo, input, i0, i1);
    const at::Tensor gc = g3.slice(0, i0, i1);
    for (int64_t j = 0; j < geo.groups; ++j) {
      auto [a_j, g_j] = conv_group(geo, rows, gc, j);
      fn(i0, i1, j, a_j, g_j);
    }
  }
}

// Kernel-major columns back to the weight's order (Note [kernel-major patches]):
// [..., C_out, K*C_in/g] -> [..., C_out, C_in/g, *kernel_size].
inline at::Tensor weight_order(const ConvGeometry& geo, const at::Tensor& t) {
  const int64_t cg = geo.c_in / geo.groups, lead = t.dim() - 2;
  std::vector<int64_t> split = t.sizes().slice(0, lead + 1).vec(), shape = split;
  split.insert(split.end(), {geo.kernel_numel, cg});
  shape.push_back(cg);
  for (int64_t k : geo.kernel_size) shape.push_back(k);
  return t.view(split).transpose(lead + 1, lead + 2).reshape(shape);
}

// Certified [B] float64 (weight, plus bias when `bias`), the checks done.
inline at::Tensor conv_sq_norms_f64(const ConvGeometry& geo, const at::Tensor& input,
                                    const at::Tensor& G, NormMethod method, bool bias) {
  const int64_t b = input.size(0);
  const at::Tensor g3 = G.reshape({b, geo.c_out, geo.positions});  // [B, C_out, L]
  at::Tensor out = at::empty({b}, input.options().dtype(at::kDouble));
  at::Tensor sq;  // the chunk's, its groups' bounds added
  for_each_patch_group(geo, input, g3, [&](int64_t i0, int64_t i1, int64_t j,
                                           const at::Tensor& a_j, const at::Tensor& g_j) {
    const at::Tensor part = linear_sq_norms_btd(a_j, g_j, method, /*bias=*/false);
    sq = j == 0 ? part : add_up(sq, part);
    if (j == geo.groups - 1) out.slice(0, i0, i1).copy_(sq);
  });
  return bias ? add_up(out, bias_sq_norms_btd(g3.transpose(1, 2))) : out;
}

// Note [kept conv gradients]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Where every group of a Conv takes the direct path (Note [ghost or direct]: a convolution's
// many output positions make its Grams the larger), its per-sample weight gradients are smaller
// than its Grams, and its clipped sum would form each sample's contribution again from the
// input's patches. When those gradients take no more memory than the input and output gradient
// the book would otherwise keep (conv_keeps_per_sample), it keeps them instead (ConvOps::keep in
// src/dp/layer_ops.cpp; Note [kept per-sample gradients] in linear.h): each sample's G_i^T P_i
// formed once in float32 from its patches (P_i) and its output gradient, as the clipped sums form
// contributions, and the bias's sums over positions. These rows are exactly what the clipped sum
// then adds, scaled by c_i (per_sample_clipped_sum), so the norm to bound is theirs, not the
// exact gradient's: kept_rows_sq_norms certifies it from their entries, with the margin of one
// float32 rounding of each scaled entry, as for the generic path's rows (Note [clipped-sum
// rounding]). No float64 copy of the patches and no S_i term: the rows' own rounding (relative
// ~T 2^-24 against the exact gradient where the positions do not cancel) changes which gradient
// is clipped, never the bound.

// Whether a Conv with this input [B, C_in, ...] and output gradient G keeps its per-sample
// weight gradients (Note [kept conv gradients]): float32 rows no bigger than a sample's share of
// both.
inline bool conv_keeps_per_sample(const ConvGeometry& geo, const at::Tensor& input,
                                  const at::Tensor& G) {
  const int64_t d_in = geo.c_in / geo.groups * geo.kernel_numel, d_out = geo.c_out / geo.groups;
  const int64_t b = std::max<int64_t>(input.size(0), 1);
  return !ghost_is_cheaper(geo.positions, d_in, d_out) &&
         geo.c_out * d_in <= (input.numel() + G.numel()) / b;
}

// The kept rows (Note [kept conv gradients]): the weight's per-sample gradients [B, C_out,
// C_in/g, *kernel_size] float32, the bias's [B, C_out] float32 (undefined without `bias`), and
// their certified squared norms [B] float64.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_kept_rows(const ConvGeometry& geo,
                                                                     const at::Tensor& input,
                                                                     const at::Tensor& G,
                                                                     bool bias) {
  const int64_t b = input.size(0), kout = geo.c_out / geo.groups;
  const at::Tensor g3 = f32(G).reshape({b, geo.c_out, geo.positions});  // [B, C_out, L]
  at::Tensor grads = at::empty({b, geo.c_out, geo.c_in / geo.groups * geo.kernel_numel},
                               input.options().dtype(at::kFloat));
  for_each_patch_group(geo, input, g3, [&](int64_t i0, int64_t i1, int64_t j,
                                           const at::Tensor& a_j, const at::Tensor& g_j) {
    grads.slice(0, i0, i1).narrow(1, j * kout, kout).copy_(at::bmm(g_j.transpose(1, 2), a_j));
  });
  std::vector<at::Tensor> rows{weight_order(geo, grads)};
  if (bias) rows.push_back(g3.sum(2));  // [B, C_out]
  return {rows[0], bias ? rows[1] : at::Tensor(), kept_rows_sq_norms_f64(rows)};
}

// Public (internal to the book): a Conv's kept rows (Note [kept conv gradients]): (weight
// [B, C_out, C_in/g, *kernel_size] float32, bias [B, C_out] float32 or undefined, certified
// squared norms of both [B] float32), or nullopt where the Conv keeps its input and output
// gradient instead.
inline std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> conv_per_sample(
    const at::Tensor& input, const at::Tensor& G, at::IntArrayRef kernel_size,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    bool bias) {
  constexpr const char* op = "conv_per_sample";
  const ConvGeometry geo =
      check_conv_args(op, input, G, kernel_size, stride, padding, dilation, groups);
  if (!conv_keeps_per_sample(geo, input, G)) return std::nullopt;
  const Fp32MatmulGuard precision;
  auto [grads, grad_b, sq] = conv_kept_rows(geo, input, G, bias);
  return std::make_tuple(grads, grad_b, to_f32_up(sq));
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
  for_each_patch_group(geo, input, g3, [&](int64_t i0, int64_t i1, int64_t j,
                                           const at::Tensor& a_j, const at::Tensor& g_j) {
    at::Tensor out_j = out.narrow(0, j * kout, kout);
    add_linear_clipped_sum(out_j, a_j, g_j, scale.slice(0, i0, i1), host, /*transposed=*/false);
  });
  return weight_order(geo, out);
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
  if (m == NormMethod::kAuto && conv_keeps_per_sample(geo, input, G)) {
    // Note [kept conv gradients]: one pass over the patches. The factors from the float64
    // norms, as the other paths' (a norm above float32's range is clipped, not dropped).
    auto [grads, grad_b, sq] = conv_kept_rows(geo, input, G, bias);
    auto [factors, nonfinite] = clip_from_sq_norms(sq, max_norm, mode, gamma);
    at::Tensor grad_w = per_sample_clipped_sum(grads, factors);
    return {grad_w, bias ? per_sample_clipped_sum(grad_b, factors) : no_bias_grad(G),
            to_f32_up(sq), factors, nonfinite};
  }
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
