// kernels/per_sample_ops.h — the per-sample gradient ops of every layer kind (schemas in
// kernels/ops.cpp): squared norms, clipped sums and the fused clip, written once as ATen
// compositions that run on any device. The only backend-specific piece, the ghost-norm Gram
// reduction, is reached through the dispatcher (dpzero::_ghost_sq_norms and
// dpzero::_token_ghost_sq_norms: kernels/cpu/ghost_norm.cpp, kernels/cuda/ghost_norm.cu), so
// kernels/cpu/per_sample.cpp and kernels/cuda/per_sample.cpp register these same functions for
// their dispatch key.
//
// Note [per-sample ops]
// A DP layer sees its input A and output gradient G for a micro-batch of B samples; any leading
// dims after the batch dim are flattened into a sequence length T, so A is [B, T, d_in] and G is
// [B, T, d_out]. Sample i's weight gradient is G_i^T A_i ([d_out, d_in]).
//  * *_sq_norms return ||g_i||^2 per sample ([B] float32): the ghost or direct path chosen by
//    Note [ghost or direct] (kernels/per_sample_checks.h), the direct path chunked over samples
//    so at most a chunk of per-sample gradients exists at a time, and none outlives the op.
//  * *_clipped_sum return sum_i c_i g_i (float32, the parameter's shape) for per-sample factors
//    c [B] float32: for a Linear layer G^T diag(c) A, one GEMM over K = B*T that replaces
//    autograd's weight-gradient GEMM (book-keeping, "BK", Bu et al. 2023, "Differentially private
//    optimization on large model at small cost": keep (A, G) from the one backward pass, then
//    one weighted GEMM). A sample whose factor is 0 or non-finite contributes exactly
//    nothing, even when its A or G holds NaN/Inf (its rows are zeroed, not multiplied by 0).
//  * *_clip (group / layer-wise clipping) compute the norms, the factors for threshold C
//    (privacy::clip_factor through dpzero::clip_factors: flat min(1, C/(||g||+1e-6)) or automatic
//    C/(||g||+gamma), factor 0 for a NaN/Inf norm, counted) and the clipped sum in one call.
// Precision: inputs float32 / bfloat16 / float16; every product and sum is float32 (low-precision
// inputs are upcast exactly, chunk by chunk), outputs are float32. We do not run the clipped-sum
// GEMM on bf16/fp16 operands: that would round c_i * G_i to the input precision and could leave a
// clipped contribution up to 2^-8 (bf16) above its threshold, breaking the sensitivity bound.
// B = 0 (an empty micro-batch) gives empty norms and a zero clipped sum.
#pragma once

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/string_view.h>

#include "kernels/clip_checks.h"
#include "kernels/per_sample_checks.h"

namespace dpzero::kernels {
namespace per_sample {

using ClipResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// ---- backend kernels and clip factors, through the dispatcher -----------------------------------

// Note [ghost norm]
// ||G_i^T A_i||_F^2 = sum_{s,t} (a_s . a_t)(g_s . g_t) = <A_i A_i^T, G_i G_i^T> (Goodfellow 2015;
// Li et al. 2022, ghost clipping for sequences): two T x T Grams, no d_out x d_in gradient.
// For an embedding the input rows are one-hot, so a_s . a_t = [id_s = id_t], and a padding token's
// row gets no gradient, so its terms drop out: sum_{s,t} [id_s = id_t != padding_idx] g_s . g_t.
// Backends: kernels/cpu/ghost_norm.cpp (batched GEMM Grams, a chunk of samples at a time) and
// kernels/cuda/ghost_norm.cu (one fused kernel over Gram tiles in shared memory, no [B, T, T]).

// [B, T, d_in], [B, T, d_out] -> [B] float32: <A_i A_i^T, G_i G_i^T> (Note [ghost norm]).
inline at::Tensor ghost_sq_norms(const at::Tensor& a, const at::Tensor& g) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_ghost_sq_norms", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(a, g);
}

// ids [B, T] int64, G [B, T, d] -> [B] float32: sum_{s,t} [id_s = id_t != pad] g_s . g_t.
inline at::Tensor token_ghost_sq_norms(const at::Tensor& ids, const at::Tensor& g, int64_t pad) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_token_ghost_sq_norms", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>();
  return op.call(ids, g, pad);
}

// sq_norms [B] -> (factors [B], non-finite count) by privacy::clip_factor.
inline std::tuple<at::Tensor, at::Tensor> clip_factors(const at::Tensor& sq_norms, double max_norm,
                                                       c10::string_view mode, double gamma) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::clip_factors", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, double,
                                                                       c10::string_view, double)>();
  return op.call(at::sqrt(sq_norms), max_norm, mode, gamma);
}

// ---- helpers ------------------------------------------------------------------------------------

inline at::Tensor f32(const at::Tensor& x) { return x.to(at::kFloat); }

// Samples that contribute to a clipped sum: finite, non-zero factor. [B] bool.
inline at::Tensor kept(const at::Tensor& scale) {
  return at::logical_and(at::isfinite(scale), scale != 0);
}

inline std::vector<int64_t> sample_shape(const at::Tensor& x) {  // [c, 1, ..., 1]
  std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
  shape[0] = x.size(0);
  return shape;
}

// Whether some sample is dropped, answered "maybe" on CUDA where asking would cost a device sync.
inline bool may_drop(const at::Tensor& keep) { return !keep.is_cpu() || !keep.all().item<bool>(); }

// x [c, ...] float32 scaled by c_i per sample, with the rows of dropped samples set to 0 (not
// multiplied by 0, which would keep a NaN). Returns a new tensor.
inline at::Tensor scaled_rows(const at::Tensor& x, const at::Tensor& scale,
                              const at::Tensor& keep) {
  const auto shape = sample_shape(x);
  at::Tensor out = x * scale.view(shape);
  if (may_drop(keep)) out.masked_fill_(at::logical_not(keep).view(shape), 0);
  return out;
}

// x [c, ...] float32 with the rows of dropped samples set to 0; in place when `owned` (x is our own
// copy). On CPU a batch without dropped samples is returned as is (on CUDA that check would cost a
// device sync, so the rows are always masked there).
inline at::Tensor masked_rows(const at::Tensor& x, const at::Tensor& keep, bool owned) {
  if (!may_drop(keep)) return x;
  const at::Tensor drop = at::logical_not(keep).view(sample_shape(x));
  return owned ? at::Tensor(x).masked_fill_(drop, 0) : x.masked_fill(drop, 0);
}

// ---- Linear (and HF Conv1D): A [B, T, d_in], G [B, T, d_out] ------------------------------------

// Per-sample squared Frobenius norms of x [c, ...] float32: [c]. Squares in place when `owned`
// (x is ours to overwrite), then ATen's cascade sum: over ~10^6 terms its relative error stays
// near 1e-7, where a BLAS dot (bmm) or linalg_vector_norm reach 1e-3 / 1e-4.
inline at::Tensor sq_frobenius(const at::Tensor& x, bool owned) {
  const at::Tensor flat = x.reshape({x.size(0), -1});
  return (owned ? at::Tensor(flat).square_() : flat.square()).sum(1);
}

// ||G_i^T A_i||_F^2 by instantiating G_i^T A_i for a chunk of samples at a time. [B] float32.
inline at::Tensor direct_sq_norms(const at::Tensor& a, const at::Tensor& g) {
  const int64_t b = a.size(0), t = a.size(1), d_in = a.size(2), d_out = g.size(2);
  at::Tensor out = at::zeros({b}, a.options().dtype(at::kFloat));
  const int64_t chunk = samples_per_chunk(b, 4 * (d_in * d_out + t * (d_in + d_out)));
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    at::Tensor per_sample = at::bmm(f32(g.slice(0, i0, i1)).transpose(1, 2),
                                    f32(a.slice(0, i0, i1)));  // [c, d_out, d_in]
    out.slice(0, i0, i1).copy_(sq_frobenius(per_sample, /*owned=*/true));
  }
  return out;
}

// ||sum_t G_{i,t}||^2: a sample's bias gradient is the sum of its output-gradient rows.
// G [B, T, d].
inline at::Tensor bias_sq_norms_btd(const at::Tensor& g) {
  return at::sum(g, at::IntArrayRef{1}, /*keepdim=*/false, at::kFloat).square_().sum(1);
}

inline at::Tensor linear_sq_norms_btd(const at::Tensor& a, const at::Tensor& g, NormMethod method,
                                      bool bias) {
  at::Tensor sq = use_ghost(method, a.size(1), a.size(2), g.size(2)) ? ghost_sq_norms(a, g)
                                                                     : direct_sq_norms(a, g);
  if (bias) sq.add_(bias_sq_norms_btd(g));
  return sq;
}

// out += sum_i c_i G_i^T A_i ([d_out, d_in]) or its transpose ([d_in, d_out]) when `transposed`.
// One GEMM per chunk over K = chunk * T; the narrower operand carries the factors.
inline void add_linear_clipped_sum(at::Tensor& out, const at::Tensor& a, const at::Tensor& g,
                                   const at::Tensor& scale, const at::Tensor& keep,
                                   bool transposed) {
  const int64_t b = a.size(0), t = a.size(1), d_in = a.size(2), d_out = g.size(2);
  if (b == 0 || t == 0) return;
  const int64_t chunk = samples_per_chunk(b, 8 * t * (d_in + d_out));
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor c = scale.slice(0, i0, i1), k = keep.slice(0, i0, i1);
    at::Tensor ac = f32(a.slice(0, i0, i1)), gc = f32(g.slice(0, i0, i1));
    if (d_out <= d_in) {
      gc = scaled_rows(gc, c, k);
      ac = masked_rows(ac, k, /*owned=*/a.scalar_type() != at::kFloat);
    } else {
      ac = scaled_rows(ac, c, k);
      gc = masked_rows(gc, k, /*owned=*/g.scalar_type() != at::kFloat);
    }
    const at::Tensor a2 = ac.reshape({-1, d_in}), g2 = gc.reshape({-1, d_out});
    if (transposed) {
      out.addmm_(a2.t(), g2);
    } else {
      out.addmm_(g2.t(), a2);
    }
  }
}

// sum_i c_i sum_t G_{i,t}: [d] float32. G [B, T, d].
inline at::Tensor bias_clipped_sum_btd(const at::Tensor& g, const at::Tensor& scale) {
  const at::Tensor per_sample =
      at::sum(g, at::IntArrayRef{1}, /*keepdim=*/false, at::kFloat);  // [B, d]
  return scaled_rows(per_sample, scale, kept(scale)).sum(0);
}

// Public: A [B, ..., d_in], G [B, ..., d_out] -> [B] float32.
inline at::Tensor linear_sq_norms(const at::Tensor& A, const at::Tensor& G, bool bias,
                                  int64_t method) {
  constexpr const char* op = "linear_sq_norms";
  const NormMethod m = check_method(op, method);
  check_layer_pair(op, A, "A", G);
  return linear_sq_norms_btd(as_btd(op, "A", A), as_btd(op, "G", G), m, bias);
}

// Public: A [B, ..., d_in], G [B, ..., d_out], scale [B] -> [d_out, d_in] float32 (nn.Linear's
// weight layout) or [d_in, d_out] when `transposed` (HF Conv1D: y = x W + b, W [d_in, d_out]).
inline at::Tensor linear_clipped_sum(const at::Tensor& A, const at::Tensor& G,
                                     const at::Tensor& scale, bool transposed) {
  constexpr const char* op = "linear_clipped_sum";
  check_layer_pair(op, A, "A", G);
  const at::Tensor a = as_btd(op, "A", A), g = as_btd(op, "G", G);
  check_scale(op, scale, a.size(0), G);
  const int64_t d_in = a.size(2), d_out = g.size(2);
  at::Tensor out = transposed ? at::zeros({d_in, d_out}, a.options().dtype(at::kFloat))
                              : at::zeros({d_out, d_in}, a.options().dtype(at::kFloat));
  add_linear_clipped_sum(out, a, g, scale, kept(scale), transposed);
  return out;
}

// Public: G [B, d] or [B, ..., d] (the bias dim last) -> [B] float32.
inline at::Tensor bias_sq_norms(const at::Tensor& G) {
  constexpr const char* op = "bias_sq_norms";
  check_floating(op, "G", G);
  return bias_sq_norms_btd(as_btd(op, "G", G));
}

// Public: G [B, ..., d], scale [B] -> [d] float32.
inline at::Tensor bias_clipped_sum(const at::Tensor& G, const at::Tensor& scale) {
  constexpr const char* op = "bias_clipped_sum";
  check_floating(op, "G", G);
  const at::Tensor g = as_btd(op, "G", G);
  check_scale(op, scale, g.size(0), G);
  return bias_clipped_sum_btd(g, scale);
}

inline at::Tensor no_bias_grad(const at::Tensor& like) {
  return at::zeros({0}, like.options().dtype(at::kFloat));
}

// The fused clip on the direct path: per chunk of samples, G_i^T A_i is instantiated once and
// serves both the norm and the clipped sum (layer-wise clipping needs no other layer's norm), so
// the chunk costs one batched GEMM plus one pass over its per-sample gradients instead of a second
// GEMM; the per-sample gradients die with the chunk. a [B, T, d_in], g [B, T, d_out].
inline ClipResult linear_clip_direct(const at::Tensor& a, const at::Tensor& g, double max_norm,
                                     c10::string_view mode, double gamma, bool bias,
                                     bool transposed) {
  check_clip_args(at::empty({0}, at::kFloat), max_norm, mode, gamma);  // even when B = 0
  const int64_t b = a.size(0), t = a.size(1), d_in = a.size(2), d_out = g.size(2);
  const auto f32_opts = a.options().dtype(at::kFloat);
  at::Tensor grad_w = at::zeros({d_out, d_in}, f32_opts);
  at::Tensor sq = at::zeros({b}, f32_opts), factors = at::zeros({b}, f32_opts);
  at::Tensor nonfinite = at::zeros({}, a.options().dtype(at::kLong));
  // Per sample: its gradient, the squares for its norm, and its fp32 inputs.
  const int64_t chunk = samples_per_chunk(b, 4 * (2 * d_in * d_out + t * (d_in + d_out)));
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk), c = i1 - i0;
    const at::Tensor gc = g.slice(0, i0, i1);
    at::Tensor per_sample = at::bmm(f32(gc).transpose(1, 2), f32(a.slice(0, i0, i1)))
                                .reshape({c, d_out * d_in});  // [c, d_out * d_in]
    at::Tensor sq_c = sq_frobenius(per_sample, /*owned=*/false);
    if (bias) sq_c.add_(bias_sq_norms_btd(gc));
    auto [f_c, n_c] = clip_factors(sq_c, max_norm, mode, gamma);
    // Factor 0 comes only with a non-finite norm; zero those samples' rows (0 * NaN = NaN). On
    // CPU only when there is one (the count is at hand); on CUDA always (asking would sync).
    if (!per_sample.is_cpu() || n_c.item<int64_t>() > 0) {
      per_sample.masked_fill_(at::logical_not(kept(f_c)).unsqueeze(1), 0);
    }
    grad_w.view({1, d_out * d_in}).addmm_(f_c.unsqueeze(0), per_sample);
    sq.slice(0, i0, i1).copy_(sq_c);
    factors.slice(0, i0, i1).copy_(f_c);
    nonfinite.add_(n_c);
  }
  at::Tensor grad_b = bias ? bias_clipped_sum_btd(g, factors) : no_bias_grad(g);
  return {transposed ? grad_w.t().contiguous() : grad_w, grad_b, sq, factors, nonfinite};
}

// Public fused op: (grad_weight, grad_bias or [0], sq_norms [B], factors [B], non-finite count).
inline ClipResult linear_clip(const at::Tensor& A, const at::Tensor& G, double max_norm,
                              c10::string_view mode, double gamma, bool bias, bool transposed,
                              int64_t method) {
  constexpr const char* op = "linear_clip";
  const NormMethod m = check_method(op, method);
  check_layer_pair(op, A, "A", G);
  const at::Tensor a = as_btd(op, "A", A), g = as_btd(op, "G", G);
  if (!use_ghost(m, a.size(1), a.size(2), g.size(2))) {
    return linear_clip_direct(a, g, max_norm, mode, gamma, bias, transposed);
  }
  at::Tensor sq = linear_sq_norms_btd(a, g, m, bias);
  auto [factors, nonfinite] = clip_factors(sq, max_norm, mode, gamma);
  at::Tensor grad_w = linear_clipped_sum(A, G, factors, transposed);
  at::Tensor grad_b = bias ? bias_clipped_sum_btd(g, factors) : no_bias_grad(G);
  return {grad_w, grad_b, sq, factors, nonfinite};
}

// ---- Embedding: ids [B, ...], G [B, ..., d], weight [V, d] --------------------------------------

// Direct path: the rows sample i touches, sum_{t: id_t = v} G_{i,t} for each distinct v != pad,
// built by one index_add over (sample, token) keys; ||g_i||^2 is the sum of their squared norms.
// At most min(T, V) rows per sample, a chunk of samples at a time. ids [B, T] int64, G [B, T, d].
inline at::Tensor embedding_direct_sq_norms(const at::Tensor& ids, const at::Tensor& g,
                                            int64_t num_embeddings, int64_t pad) {
  const int64_t b = g.size(0), t = g.size(1), d = g.size(2);
  at::Tensor out = at::zeros({b}, g.options().dtype(at::kFloat));
  const int64_t chunk = samples_per_chunk(b, 8 * t * d + 32 * t);
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk), c = i1 - i0;
    const at::Tensor id = ids.slice(0, i0, i1);                            // [c, T]
    const at::Tensor sample = at::arange(c, id.options()).unsqueeze(1);    // [c, 1]
    const at::Tensor keys = (sample * num_embeddings + id).reshape({-1});  // [c*T]
    const at::Tensor rows_in =
        at::where((id != pad).unsqueeze(-1), f32(g.slice(0, i0, i1)), 0).reshape({-1, d});
    auto [unique_keys, inverse, counts] = at::_unique2(keys, /*sorted=*/true,
                                                       /*return_inverse=*/true);
    at::Tensor rows = at::zeros({unique_keys.size(0), d}, rows_in.options());
    rows.index_add_(0, inverse.reshape({-1}), rows_in);  // [U, d]
    out.slice(0, i0, i1).index_add_(0, unique_keys.div(num_embeddings, "trunc"),
                                    rows.square_().sum(1));
  }
  return out;
}

// ids [B, ...] -> [B, T] int64; checks the id range on CPU (on CUDA that would cost a device sync
// in the backward pass; the forward's embedding lookup has already checked the same ids).
inline at::Tensor flat_ids(const char* op, const at::Tensor& ids, int64_t num_embeddings) {
  int64_t t = 1;
  for (int64_t k = 1; k < ids.dim(); ++k) t *= ids.size(k);
  at::Tensor flat = ids.reshape({ids.size(0), t}).to(at::kLong);
  if (ids.is_cpu() && flat.numel() > 0) {
    const int64_t lo = flat.min().item<int64_t>(), hi = flat.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < num_embeddings, "dpzero::", op,
                ": ids must be in [0, num_embeddings) = [0, ", num_embeddings, "), got ",
                lo < 0 ? lo : hi);
  }
  return flat;
}

inline at::Tensor embedding_grad_btd(const at::Tensor& G, const at::Tensor& ids_flat) {
  return G.reshape({ids_flat.size(0), ids_flat.size(1), G.size(-1)});
}

// Public: ids [B, ...], G [B, ..., d] -> [B] float32. padding_idx as in torch.nn.Embedding:
// padding tokens get no gradient.
inline at::Tensor embedding_sq_norms(const at::Tensor& ids, const at::Tensor& G,
                                     int64_t num_embeddings, std::optional<int64_t> padding_idx,
                                     int64_t method) {
  constexpr const char* op = "embedding_sq_norms";
  const NormMethod m = check_method(op, method);
  check_embedding_args(op, ids, G, num_embeddings);
  const int64_t pad = normalize_padding_idx(op, padding_idx, num_embeddings);
  const at::Tensor id = flat_ids(op, ids, num_embeddings);
  const at::Tensor g = embedding_grad_btd(G, id);
  const int64_t t = g.size(1), d = g.size(2);
  if (use_ghost(m, t, std::min(t, num_embeddings), d)) return token_ghost_sq_norms(id, g, pad);
  return embedding_direct_sq_norms(id, g, num_embeddings, pad);
}

// Public: ids [B, ...], G [B, ..., d], scale [B] -> [V, d] float32 (the padding row stays 0).
inline at::Tensor embedding_clipped_sum(const at::Tensor& ids, const at::Tensor& G,
                                        const at::Tensor& scale, int64_t num_embeddings,
                                        std::optional<int64_t> padding_idx) {
  constexpr const char* op = "embedding_clipped_sum";
  check_embedding_args(op, ids, G, num_embeddings);
  const int64_t pad = normalize_padding_idx(op, padding_idx, num_embeddings);
  const at::Tensor id = flat_ids(op, ids, num_embeddings);
  const at::Tensor g = embedding_grad_btd(G, id);
  const int64_t b = g.size(0), t = g.size(1), d = g.size(2);
  check_scale(op, scale, b, G);
  at::Tensor out = at::zeros({num_embeddings, d}, G.options().dtype(at::kFloat));
  const at::Tensor keep = kept(scale);
  const int64_t chunk = samples_per_chunk(b, 8 * t * d);
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor idc = id.slice(0, i0, i1);
    at::Tensor rows =
        scaled_rows(f32(g.slice(0, i0, i1)), scale.slice(0, i0, i1), keep.slice(0, i0, i1));
    rows.masked_fill_((idc == pad).unsqueeze(-1), 0);  // padding tokens get no gradient
    out.index_add_(0, idc.reshape({-1}), rows.reshape({-1, d}));
  }
  return out;
}

// Public fused op: (grad_weight [V, d], sq_norms [B], factors [B], non-finite count).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> embedding_clip(
    const at::Tensor& ids, const at::Tensor& G, int64_t num_embeddings, double max_norm,
    c10::string_view mode, double gamma, std::optional<int64_t> padding_idx, int64_t method) {
  at::Tensor sq = embedding_sq_norms(ids, G, num_embeddings, padding_idx, method);
  auto [factors, nonfinite] = clip_factors(sq, max_norm, mode, gamma);
  at::Tensor grad_w = embedding_clipped_sum(ids, G, factors, num_embeddings, padding_idx);
  return {grad_w, sq, factors, nonfinite};
}

// ---- LayerNorm / RMSNorm: input x [B, ..., d] (raw, before normalisation), G like x -------------
// The op computes x̂ itself from the raw input and eps, in float32, so a hook keeps only the layer
// input it already has. Normalisation is over the last dim; a LayerNorm with a multi-dim
// normalized_shape is the same computation on those dims flattened into d.
//   LayerNorm (Ba et al. 2016, "Layer normalization"): x̂ = (x - mean) / sqrt(var + eps), var
//   biased, as torch.nn.LayerNorm;  RMSNorm (Zhang & Sennrich 2019, "Root mean square layer
//   normalization"): x̂ = x / sqrt(mean(x^2) + eps), as torch.nn.RMSNorm.
// Per-sample gradients: weight sum_t G_{i,t} ⊙ x̂_{i,t}, bias sum_t G_{i,t} (both [d]).

inline void check_norm_layer_args(const char* op, const at::Tensor& x, const at::Tensor& g,
                                  double eps) {
  check_floating(op, "input", x);
  check_floating(op, "G", g);
  check_same_device(op, "G", g, x, "input");
  TORCH_CHECK(x.dim() >= 2 && x.sizes() == g.sizes(), "dpzero::", op,
              ": input and G must both be [B, ..., d] of one shape, got input ", x.sizes(),
              " and G ", g.sizes());
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, "dpzero::", op,
              ": eps must be finite and >= 0, got ", eps);
}

inline at::Tensor normalized(const at::Tensor& x32, double eps, bool rms) {
  if (rms) return x32 * at::rsqrt(x32.square().mean(at::IntArrayRef{-1}, /*keepdim=*/true) + eps);
  auto [var, mean] = at::var_mean(x32, at::IntArrayRef{-1},
                                  /*correction=*/std::optional<at::Scalar>(0), /*keepdim=*/true);
  return (x32 - mean) * at::rsqrt(var + eps);
}

// sum_t G ⊙ x̂ for samples [i0, i1): [c, d] float32.
inline at::Tensor norm_weight_grads(const at::Tensor& x, const at::Tensor& g, int64_t i0,
                                    int64_t i1, double eps, bool rms) {
  return (f32(g.slice(0, i0, i1)) * normalized(f32(x.slice(0, i0, i1)), eps, rms)).sum(1);
}

// Public: -> [B] float32 (weight, plus bias when `bias`).
inline at::Tensor layer_norm_sq_norms(const at::Tensor& input, const at::Tensor& G, double eps,
                                      bool rms, bool bias) {
  constexpr const char* op = "layer_norm_sq_norms";
  check_norm_layer_args(op, input, G, eps);
  const at::Tensor x = as_btd(op, "input", input), g = as_btd(op, "G", G);
  const int64_t b = x.size(0), t = x.size(1), d = x.size(2);
  at::Tensor out = at::zeros({b}, x.options().dtype(at::kFloat));
  const int64_t chunk = samples_per_chunk(b, 12 * t * d);
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    out.slice(0, i0, i1).copy_(norm_weight_grads(x, g, i0, i1, eps, rms).square_().sum(1));
  }
  if (bias) out.add_(bias_sq_norms_btd(g));
  return out;
}

// Public: scale [B] -> weight gradient [d] float32.
inline at::Tensor layer_norm_clipped_sum(const at::Tensor& input, const at::Tensor& G,
                                         const at::Tensor& scale, double eps, bool rms) {
  constexpr const char* op = "layer_norm_clipped_sum";
  check_norm_layer_args(op, input, G, eps);
  const at::Tensor x = as_btd(op, "input", input), g = as_btd(op, "G", G);
  const int64_t b = x.size(0), t = x.size(1), d = x.size(2);
  check_scale(op, scale, b, G);
  at::Tensor out = at::zeros({d}, x.options().dtype(at::kFloat));
  const at::Tensor keep = kept(scale);
  const int64_t chunk = samples_per_chunk(b, 12 * t * d);
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    out.add_(scaled_rows(norm_weight_grads(x, g, i0, i1, eps, rms), scale.slice(0, i0, i1),
                         keep.slice(0, i0, i1))
                 .sum(0));
  }
  return out;
}

// Public fused op: (grad_weight [d], grad_bias [d] or [0], sq_norms, factors, non-finite count).
inline ClipResult layer_norm_clip(const at::Tensor& input, const at::Tensor& G, double eps,
                                  double max_norm, c10::string_view mode, double gamma, bool rms,
                                  bool bias) {
  at::Tensor sq = layer_norm_sq_norms(input, G, eps, rms, bias);
  auto [factors, nonfinite] = clip_factors(sq, max_norm, mode, gamma);
  at::Tensor grad_w = layer_norm_clipped_sum(input, G, factors, eps, rms);
  at::Tensor grad_b = bias ? bias_clipped_sum(G, factors) : no_bias_grad(G);
  return {grad_w, grad_b, sq, factors, nonfinite};
}

// ---- Conv1d / Conv2d: input [B, C_in, (H,) W], G [B, C_out, (H_out,) W_out] ---------------------
// Through im2col: the unfolded input U_i [C_in*K, L] (K = kernel numel, L = output positions)
// turns group j's convolution into a Linear layer with A = U_i[rows of group j]^T [L, C_in/g*K]
// and G = G_i[channels of group j]^T [L, C_out/g] (Bu et al. 2022, ghost clipping of convolutions via unfold). Padding is
// zeros ('same'/'valid' strings and other padding modes: pad the input first and pass 0).

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

// Samples [i0, i1) unfolded: [c, C_in*K, L] float32.
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

// Public: -> [B] float32 (weight, plus bias when `bias`).
inline at::Tensor conv_sq_norms(const at::Tensor& input, const at::Tensor& G,
                                at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                                bool bias, int64_t method) {
  constexpr const char* op = "conv_sq_norms";
  const NormMethod m = check_method(op, method);
  const ConvGeometry geo =
      check_conv_args(op, input, G, kernel_size, stride, padding, dilation, groups);
  const int64_t b = input.size(0);
  const at::Tensor g3 = G.reshape({b, geo.c_out, geo.positions});  // [B, C_out, L]
  at::Tensor out = at::zeros({b}, input.options().dtype(at::kFloat));
  const int64_t chunk = conv_chunk(geo, b);
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor cols = unfold(geo, input, i0, i1);
    const at::Tensor gc = g3.slice(0, i0, i1);
    at::Tensor sq = out.slice(0, i0, i1);
    for (int64_t j = 0; j < groups; ++j) {
      auto [a_j, g_j] = conv_group(geo, cols, gc, j);
      sq.add_(linear_sq_norms_btd(a_j, g_j, m, /*bias=*/false));
    }
  }
  if (bias) out.add_(bias_sq_norms_btd(g3.transpose(1, 2)));
  return out;
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
  const int64_t kin = geo.c_in / groups * geo.kernel_numel, kout = geo.c_out / groups;
  at::Tensor out = at::zeros({geo.c_out, kin}, input.options().dtype(at::kFloat));
  const at::Tensor g3 = G.reshape({b, geo.c_out, geo.positions});
  const at::Tensor keep = kept(scale);
  const int64_t chunk = conv_chunk(geo, b);
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor cols = unfold(geo, input, i0, i1);
    const at::Tensor gc = g3.slice(0, i0, i1);
    for (int64_t j = 0; j < groups; ++j) {
      auto [a_j, g_j] = conv_group(geo, cols, gc, j);
      at::Tensor out_j = out.narrow(0, j * kout, kout);
      add_linear_clipped_sum(out_j, a_j, g_j, scale.slice(0, i0, i1), keep.slice(0, i0, i1),
                             /*transposed=*/false);
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
  at::Tensor sq =
      conv_sq_norms(input, G, kernel_size, stride, padding, dilation, groups, bias, method);
  auto [factors, nonfinite] = clip_factors(sq, max_norm, mode, gamma);
  at::Tensor grad_w =
      conv_clipped_sum(input, G, factors, kernel_size, stride, padding, dilation, groups);
  at::Tensor grad_b =
      bias ? bias_clipped_sum_btd(G.flatten(2).transpose(1, 2), factors) : no_bias_grad(G);
  return {grad_w, grad_b, sq, factors, nonfinite};
}

}  // namespace per_sample
}  // namespace dpzero::kernels
