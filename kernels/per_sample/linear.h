// kernels/per_sample/linear.h — the per-sample ops of Linear and Hugging Face's Conv1D (Note
// [per-sample ops] in kernels/per_sample_ops.h; schemas in kernels/ops.cpp).
#pragma once

#include "kernels/cpu/sample_products.h"
#include "kernels/per_sample/common.h"

namespace dpzero::kernels {
namespace per_sample {

// ---- Linear (and HF Conv1D): A [B, T, d_in], G [B, T, d_out] ------------------------------------

// Certified ||G_i^T A_i||_F^2 by the ghost kernel: [B] float64 (float32, rounded up, when `f32`).
inline at::Tensor ghost_linear_sq_norms(const at::Tensor& a, const at::Tensor& g,
                                        bool f32 = false) {
  const auto [value, s] = ghost_sq_norms(a, g);
  return certify_op(value, s, 2.0 * ghost_error_coefficient(a.size(1), a.size(2), g.size(2)),
                    Step::kGhost, f32, clipped_sum_margin(a.size(1)));
}

// Certified ||G_i^T A_i||_F^2 by instantiating G_i^T A_i in float64 for a chunk of samples at a
// time: [B] float64.
inline at::Tensor direct_sq_norms(const at::Tensor& a, const at::Tensor& g) {
  const int64_t b = a.size(0), t = a.size(1), d_in = a.size(2), d_out = g.size(2);
  at::Tensor out = at::empty({b}, a.options().dtype(at::kDouble));
  const double e = rounding_gamma(static_cast<double>(t));
  // Per sample: its float64 gradient, float64 copies of its rows and their squares.
  const int64_t chunk = samples_per_chunk(b, 8 * (d_in * d_out + 2 * t * (d_in + d_out + 1)));
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk), c = i1 - i0;
    const at::Tensor a64 = f64(a.slice(0, i0, i1)), g64 = f64(g.slice(0, i0, i1));
    at::Tensor per_sample = at::bmm(g64.transpose(1, 2), a64);  // [c, d_out, d_in], ours
    const at::Tensor q = per_sample.reshape({c, -1}).square_().sum(1);
    const at::Tensor s = (row_norms(a64) * row_norms(g64)).sum(1);
    out.slice(0, i0, i1).copy_(certify_op(q, s, direct_coefficient(e, d_in * d_out + 1),
                                          Step::kDirect, /*f32=*/false, clipped_sum_margin(t)));
  }
  return out;
}

// Note [kept per-sample gradients]
// A bias's or a LayerNorm / RMSNorm weight's per-sample gradient is one d-vector per sample, far
// smaller than the [T, d] rows it is summed from. So besides the norm-only and clipped-sum-only
// ops there are *_per_sample ops that return the per-sample gradients themselves ([B, d] float64,
// formed in float64 exactly as the norm ops form them) together with their certified squared
// norms, and per_sample_clipped_sum, which adds c_i times those very rows. Under book-keeping the
// engine keeps these rows from the backward instead of the layer's input and output gradient:
// one float64 pass over [B, T, d] instead of two (one for the norms, one for the clipped sum).

// Bias per-sample gradients sum_t G_{i,t} and their certified squared norms: ([B, d] float64,
// [B] float64, or float32 rounded up when `f32`). G [B, T, d]. The norms carry the margin of one
// float32 rounding of the sample's contribution (Note [clipped-sum rounding], rows kept in
// float64): S >= the row sum's norm, so (||W|| + kappa_1 S) >= (1 + 2^-24) ||W||. bias_rows_btd
// gives the gradients uncertified with what certifying them takes (kRows's coef plus that
// margin), for a weight's certification to add their bound in its own pass (_certify's
// rest_rows: on the host the bits of bias_per_sample_btd's f32 norms added as rest).
inline KeptRest bias_rows_btd(const at::Tensor& g) {
  auto [grads, s] = row_sums(g);
  const double e = rounding_gamma(static_cast<double>(g.size(1)));
  return {grads, s, direct_coefficient(e, g.size(2) + 1) + clipped_sum_margin(1)};
}

inline std::tuple<at::Tensor, at::Tensor> bias_per_sample_btd(const at::Tensor& g,
                                                              bool f32 = false) {
  const KeptRest rows = bias_rows_btd(g);  // _certify adds coef and margin: the same sum
  return {rows.rows, certify_op(rows.rows, rows.s, rows.coef, Step::kRows, f32)};
}

// Certified ||sum_t G_{i,t}||^2 (a sample's bias gradient is the sum of its output-gradient rows):
// [B] float64. G [B, T, d].
inline at::Tensor bias_sq_norms_btd(const at::Tensor& g) { return std::get<1>(bias_per_sample_btd(g)); }

// Certified [B] float64 (weight, plus bias when `bias`; float32 rounded up when `f32`).
inline at::Tensor linear_sq_norms_btd(const at::Tensor& a, const at::Tensor& g, NormMethod method,
                                      bool bias, bool f32 = false) {
  const bool ghost = use_ghost(method, a.size(1), a.size(2), g.size(2));
  if (!bias && ghost) return ghost_linear_sq_norms(a, g, f32);
  const at::Tensor sq = ghost ? ghost_linear_sq_norms(a, g) : direct_sq_norms(a, g);
  if (!bias) return f32 ? to_f32_up(sq) : sq;
  return certify_op(sq, bias_sq_norms_btd(g), 0.0, Step::kAdd, f32);
}

// Samples [i0, i1) of x (dim 0): x itself when that is all of it (no slice op).
inline at::Tensor sample_range(const at::Tensor& x, int64_t i0, int64_t i1) {
  return i0 == 0 && i1 == x.size(0) ? x : x.slice(0, i0, i1);
}

// out += sum_i c_i G_i^T A_i ([d_out, d_in]) or its transpose ([d_in, d_out]) when `transposed`.
// One float32 GEMM per chunk over K = chunk * T; the narrower operand carries the factors.
// `host`: scale, a and g are on the host (Note [host factors]; host_factors_apply).
inline void add_linear_clipped_sum(at::Tensor& out, const at::Tensor& a, const at::Tensor& g,
                                   const at::Tensor& scale, bool host, bool transposed) {
  const int64_t b = a.size(0), t = a.size(1), d_in = a.size(2), d_out = g.size(2);
  if (b == 0 || t == 0) return;
  if (!host && t >= 2) {
    // The device path: one op over the whole batch, each sample's contribution formed in
    // registers from its 16- or 32-bit rows, the left ones scaled as they are staged (Note [fused
    // sample products] in kernels/cuda/sample_products.cu); no float32 copies, scaled rows or
    // products in memory.
    const at::Tensor& left = transposed ? a : g;  // [B, T, rows of out]
    const at::Tensor& right = transposed ? g : a;  // [B, T, cols of out]
    if (sample_products::fits(out, left, right, scale)) {
      add_scaled_sample_products(out, left, right, scale);
      return;
    }
  }
  // Per sample: float32 copies of its rows and, with T >= 2 on a device, its own contribution
  // (Note [clipped-sum rounding]; the host holds kHostSlabBytes of them for the whole chunk).
  const int64_t chunk = samples_per_chunk(
      b, 8 * t * (d_in + d_out) + (t >= 2 && !host ? 4 * d_in * d_out : 0), /*device=*/!host);
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor c = sample_range(scale, i0, i1);
    at::Tensor ac = f32(sample_range(a, i0, i1)), gc = f32(sample_range(g, i0, i1));
    const bool a_owned = a.scalar_type() != at::kFloat, g_owned = g.scalar_type() != at::kFloat;
    if (host) {
      const std::vector<float> factors = host_factors(c);
      const bool scale_g = d_out <= d_in;
      gc = host_rows(gc, c, factors, /*multiply=*/scale_g, g_owned);
      ac = host_rows(ac, c, factors, /*multiply=*/!scale_g, a_owned);
    } else {  // one pass over each operand: the narrower scaled, the other masked
      const bool scale_g = d_out <= d_in;
      gc = scale_rows(gc, c, /*multiply=*/scale_g);
      ac = scale_rows(ac, c, /*multiply=*/!scale_g);
    }
    if (t >= 2) {  // each sample's contribution alone, then their sum (Note [clipped-sum rounding])
      const at::Tensor left = transposed ? ac : gc, right = transposed ? gc : ac;  // [c, T, .]
      // On the host, each sample's product tile formed in registers and added (no products
      // held; kernels/cpu/sample_products.h).
      if (host && add_sample_products(out, left, right)) continue;
      const int64_t rows = left.size(2), cols = right.size(2);
      // Otherwise on the host, in slabs of output rows whose per-sample products stay within
      // kHostSlabBytes: a product of the whole weight per sample, written to memory and read back
      // to be summed, cost twice the one GEMM's time on 768 x 3072 (experiments/results/
      // private.md); on a device (a destination or dtype the fused op does not take), one
      // batched GEMM (one launch).
      const int64_t slab =
          host ? std::max<int64_t>(1, kHostSlabBytes / (4 * left.size(0) * std::max<int64_t>(cols, 1)))
               : rows;
      for (int64_t r0 = 0; r0 < rows; r0 += slab) {
        const int64_t n = std::min(slab, rows - r0);
        const at::Tensor l = n == rows ? left : left.narrow(2, r0, n);
        at::Tensor dest = n == rows ? out : out.narrow(0, r0, n);
        dest.add_(at::bmm(l.transpose(1, 2), right).sum(0));  // [c, n, cols] -> [n, cols]
      }
      continue;
    }
    const at::Tensor a2 = ac.reshape({-1, d_in}), g2 = gc.reshape({-1, d_out});
    if (transposed) {
      out.addmm_(a2.t(), g2);
    } else {
      out.addmm_(g2.t(), a2);
    }
  }
}

// sum_i c_i sum_t G_{i,t}: [d] float32, summed in float64. G [B, T, d].
inline at::Tensor bias_clipped_sum_btd(const at::Tensor& g, const at::Tensor& scale) {
  const at::Tensor sums = std::get<0>(row_sums(g));  // [B, d] float64
  return f32(scale_rows(sums, scale, /*multiply=*/true).sum(0));
}

// Public: A [B, ..., d_in], G [B, ..., d_out] -> [B] float32.
inline at::Tensor linear_sq_norms(const at::Tensor& A, const at::Tensor& G, bool bias,
                                  int64_t method) {
  constexpr const char* op = "linear_sq_norms";
  const NormMethod m = check_method(op, method);
  check_layer_pair(op, A, "A", G);
  const Fp32MatmulGuard precision;
  return linear_sq_norms_btd(as_btd(op, "A", A), as_btd(op, "G", G), m, bias, /*f32=*/true);
}

// Note [shared inputs]
// Layers that read the same input tensor (a transformer's query, key and value projections; a
// gated MLP's gate and up projections) share the A-side Gram of the ghost norm. linear_sq_norms_multi
// takes A once and each layer's G and returns each layer's certified norm, equal to what
// linear_sq_norms would return for that layer alone (same kernel arithmetic, same margin); on the
// ghost path A's float64 copy and Gram strips (on CUDA: its Gram tiles or strips) are made once
// for all of them (dpzero::_ghost_sq_norms_multi: kernels/cpu/ghost_norm.cpp,
// kernels/cuda/ghost_norm.cu, and a generic loop for other devices).

// _ghost_sq_norms of A against each G, one layer at a time (any device).
inline std::tuple<at::Tensor, at::Tensor> ghost_sq_norms_multi_generic(const at::Tensor& a,
                                                                       at::TensorList gs) {
  TORCH_CHECK(!gs.empty(), "dpzero::_ghost_sq_norms_multi: G must hold at least one tensor");
  std::vector<at::Tensor> values, norms;
  for (const at::Tensor& g : gs) {
    auto [v, n] = ghost_sq_norms(a, g);
    values.push_back(v);
    norms.push_back(n);
  }
  return {at::stack(values), at::stack(norms)};
}

// A [B, ..., d_in], G[l] [B, ..., d_out_l] -> L tensors [B] float32, the certified squared norms
// of each layer (the book takes them apart, so they are not stacked). `rest`, empty or one per
// layer: a defined one is the layer's bias's kept rows (bias_rows_btd), certified and added to
// its weight's norm in the certification's own pass (_certify's rest_rows: on the host, the bits
// of dp::certified_sum of the two norms).
inline std::vector<at::Tensor> linear_sq_norms_each(const at::Tensor& A, at::TensorList G,
                                                    int64_t method,
                                                    const std::vector<KeptRest>& rest = {}) {
  constexpr const char* op = "linear_sq_norms_multi";
  const NormMethod m = check_method(op, method);
  TORCH_CHECK(!G.empty(), "dpzero::", op, ": G must hold at least one tensor");
  for (const at::Tensor& g : G) check_layer_pair(op, A, "A", g);
  TORCH_CHECK(rest.empty() || rest.size() == G.size(), "dpzero::", op, ": rest must hold one "
              "tensor per layer (", G.size(), "), got ", rest.size());
  const auto rest_of = [&](size_t l) { return l < rest.size() ? rest[l] : KeptRest{}; };
  const Fp32MatmulGuard precision;
  const at::Tensor a = as_btd(op, "A", A);
  std::vector<at::Tensor> gs, out(G.size());
  std::vector<size_t> ghost_rows;
  for (size_t l = 0; l < G.size(); ++l) {
    const at::Tensor g = as_btd(op, "G", G[l]);
    if (use_ghost(m, a.size(1), a.size(2), g.size(2))) {
      gs.push_back(g);
      ghost_rows.push_back(l);
    } else {
      out[l] = certify_op(direct_sq_norms(a, g), c10::nullopt, 0.0, Step::kRoundUp,
                          /*f32=*/false, /*margin=*/0.0, c10::nullopt, rest_of(l));  // + rest
    }
  }
  if (!gs.empty()) {
    using Signature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::TensorList);
    static const auto multi = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("dpzero::_ghost_sq_norms_multi", "")
                                  .typed<Signature>();
    const auto [values, s] = multi.call(a, gs);
    for (size_t k = 0; k < gs.size(); ++k) {
      const double c = ghost_error_coefficient(a.size(1), a.size(2), gs[k].size(2));
      out[ghost_rows[k]] = certify_op(values[static_cast<int64_t>(k)], s[static_cast<int64_t>(k)],
                                      2.0 * c, Step::kGhost, /*f32=*/true,
                                      clipped_sum_margin(a.size(1)), c10::nullopt,
                                      rest_of(ghost_rows[k]));
    }
  }
  return out;
}

// Public: A [B, ..., d_in], G[l] [B, ..., d_out_l] -> [L, B] float32 certified squared norms.
inline at::Tensor linear_sq_norms_multi(const at::Tensor& A, at::TensorList G, int64_t method) {
  return at::stack(linear_sq_norms_each(A, G, method));
}

// Note [accumulating clipped sums]
// Each *_clipped_sum op returns a new tensor; the in-place add_*_clipped_sum_ ops add the same sum
// into `self` instead, typically the parameter's slot of the engine's flat gradient buffer (Note
// [private accumulator] in src/zero/unit.h). The arithmetic is the returned op's with self
// in place of the zeros it starts from (the GEMMs run with beta = 1, index_add adds into self), so
// the result equals self + (returned sum) up to float32 rounding order, never more: the same
// clipped contributions, each added once. What it saves is a parameter-sized zero fill, the new
// tensor and the pass that adds it into the buffer (measured: experiments/results/private.md).

// sum_i scale_i G_i^T A_i added into *self, or into new zeros when self is null; returns the
// accumulator. `op` names the public op in the argument checks.
inline at::Tensor linear_clipped_sum_into(const char* op, at::Tensor* self, const at::Tensor& A,
                                          const at::Tensor& G, const at::Tensor& scale,
                                          bool transposed) {
  check_layer_pair(op, A, "A", G);
  const at::Tensor a = as_btd(op, "A", A), g = as_btd(op, "G", G);
  check_scale(op, scale, a.size(0), G);
  const int64_t d_in = a.size(2), d_out = g.size(2);
  const std::vector<int64_t> shape =
      transposed ? std::vector<int64_t>{d_in, d_out} : std::vector<int64_t>{d_out, d_in};
  at::Tensor out;
  if (self == nullptr) {
    out = at::zeros(shape, a.options().dtype(at::kFloat));
  } else {
    check_accumulator(op, *self, shape, A, "A");
    out = *self;
  }
  const Fp32MatmulGuard precision;
  add_linear_clipped_sum(out, a, g, scale, host_factors_apply(scale, a, g), transposed);
  return out;
}

// Public in-place: self [d_out, d_in] float32 (nn.Linear's weight layout), or [d_in, d_out] when
// `transposed` (HF Conv1D: y = x W + b, W [d_in, d_out]), += sum_i scale_i G_i^T A_i. A [B, ...,
// d_in], G [B, ..., d_out], scale [B].
inline at::Tensor& add_linear_clipped_sum_(at::Tensor& self, const at::Tensor& A,
                                           const at::Tensor& G, const at::Tensor& scale,
                                           bool transposed) {
  linear_clipped_sum_into("add_linear_clipped_sum_", &self, A, G, scale, transposed);
  return self;
}

// Public: A [B, ..., d_in], G [B, ..., d_out], scale [B] -> [d_out, d_in] float32 (nn.Linear's
// weight layout) or [d_in, d_out] when `transposed` (HF Conv1D: y = x W + b, W [d_in, d_out]).
inline at::Tensor linear_clipped_sum(const at::Tensor& A, const at::Tensor& G,
                                     const at::Tensor& scale, bool transposed) {
  return linear_clipped_sum_into("linear_clipped_sum", nullptr, A, G, scale, transposed);
}

// Public: G [B, d] or [B, ..., d] (the bias dim last) -> [B] float32.
inline at::Tensor bias_sq_norms(const at::Tensor& G) {
  constexpr const char* op = "bias_sq_norms";
  check_floating(op, "G", G);
  const Fp32MatmulGuard precision;
  return std::get<1>(bias_per_sample_btd(as_btd(op, "G", G), /*f32=*/true));
}

// Public: G [B, ..., d], scale [B] -> [d] float32.
inline at::Tensor bias_clipped_sum(const at::Tensor& G, const at::Tensor& scale) {
  constexpr const char* op = "bias_clipped_sum";
  check_floating(op, "G", G);
  const at::Tensor g = as_btd(op, "G", G);
  check_scale(op, scale, g.size(0), G);
  const Fp32MatmulGuard precision;
  return bias_clipped_sum_btd(g, scale);
}

// Public: G [B, ..., d] -> (per-sample bias gradients [B, d] float64, certified squared norms [B]
// float32) (Note [kept per-sample gradients]).
inline std::tuple<at::Tensor, at::Tensor> bias_per_sample(const at::Tensor& G) {
  constexpr const char* op = "bias_per_sample";
  check_floating(op, "G", G);
  const Fp32MatmulGuard precision;
  return bias_per_sample_btd(as_btd(op, "G", G), /*f32=*/true);
}

// The book's form of it when a weight's certification takes the bias's norm: its rows
// uncertified (bias_rows_btd). G [B, ..., d].
inline KeptRest bias_rows(const at::Tensor& G) {
  constexpr const char* op = "bias_per_sample";
  check_floating(op, "G", G);
  const Fp32MatmulGuard precision;
  return bias_rows_btd(as_btd(op, "G", G));
}

// dest += sum_i c_i grads_i, dest float32 holding prod(grads.shape[1:]) elements (a parameter's
// slot): dpzero::add_per_sample_clipped_sum_ (kernels/cpu/per_sample_sum.cpp,
// kernels/cuda/per_sample_sum.cu), one op whatever the device. The sum is taken in float64 in
// the order of Note [kept sums in chunks] (kernels/per_sample_sum.h), a sample whose factor is 0
// or non-finite contributing exactly nothing even when its row holds NaN/Inf (Note [kept
// per-sample gradients]), and each entry is added to dest by one float32 addition, as ATen's add_
// would add the rounded sum (Note [accumulating clipped sums]).
inline void add_per_sample_clipped_sum_(at::Tensor& dest, const at::Tensor& grads,
                                        const at::Tensor& scale) {
  using Signature = at::Tensor&(at::Tensor&, const at::Tensor&, const at::Tensor&);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::add_per_sample_clipped_sum_", "")
                             .typed<Signature>();
  op.call(dest, grads, scale);
}

// The same for every pair (dests[k], grads[k]) under one scale, in one op
// (dpzero::_add_per_sample_clipped_sums_: one launch on a GPU up to 32 samples, two above), each
// dest's bits add_per_sample_clipped_sum_'s. The dests share memory with no other dest and no
// grads (the op refuses it, naming the pair).
inline void add_per_sample_clipped_sums_(const std::vector<at::Tensor>& dests,
                                         const std::vector<at::Tensor>& grads,
                                         const at::Tensor& scale) {
  using Signature = void(at::TensorList, at::TensorList, const at::Tensor&);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_add_per_sample_clipped_sums_", "")
                             .typed<Signature>();
  op.call(dests, grads, scale);
}

// Public: per-sample gradients [B, ...] (float64 or float32), scale [B] float32 -> sum_i c_i
// grads_i ([...] float32, summed in float64): add_per_sample_clipped_sum_ into zeros.
inline at::Tensor per_sample_clipped_sum(const at::Tensor& grads, const at::Tensor& scale) {
  check_per_sample_clipped_sum_args("per_sample_clipped_sum", grads, scale);
  at::Tensor out = at::zeros(grads.sizes().slice(1), grads.options().dtype(at::kFloat));
  add_per_sample_clipped_sum_(out, grads, scale);
  return out;
}

inline at::Tensor no_bias_grad(const at::Tensor& like) {
  return at::zeros({0}, like.options().dtype(at::kFloat));
}

// The fused clip on the direct path: per chunk of samples, G_i^T A_i is instantiated once in
// float64 and serves both the certified norm and the clipped sum (layer-wise clipping needs no
// other layer's norm), so the chunk costs one batched GEMM plus one pass over its per-sample
// gradients instead of a second GEMM; the per-sample gradients die with the chunk. The clipped
// sum adds c_i times the very gradient whose norm was certified, in float64.
// a [B, T, d_in], g [B, T, d_out].
inline ClipResult linear_clip_direct(const at::Tensor& a, const at::Tensor& g, double max_norm,
                                     c10::string_view mode, double gamma, bool bias,
                                     bool transposed) {
  const int64_t b = a.size(0), t = a.size(1), d_in = a.size(2), d_out = g.size(2);
  const int64_t n = d_out * d_in;
  const auto f64_opts = a.options().dtype(at::kDouble);
  at::Tensor grad_w = at::zeros({1, n}, f64_opts);
  at::Tensor sq = at::empty({b}, f64_opts);
  at::Tensor factors = at::zeros({b}, a.options().dtype(at::kFloat));
  at::Tensor nonfinite = at::zeros({}, a.options().dtype(at::kLong));
  const double e = rounding_gamma(static_cast<double>(t));
  // Per sample: its float64 gradient, float64 copies of its rows and their squares.
  const int64_t chunk = samples_per_chunk(b, 8 * (n + 2 * t * (d_in + d_out + 1)));
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk), c = i1 - i0;
    const at::Tensor gc = g.slice(0, i0, i1);
    const at::Tensor a64 = f64(a.slice(0, i0, i1)), g64 = f64(gc);
    at::Tensor per_sample = at::bmm(g64.transpose(1, 2), a64).reshape({c, n});  // [c, n]
    // sum of squares as a batched dot: no temporary of the gradient's size.
    const at::Tensor q = at::bmm(per_sample.unsqueeze(1), per_sample.unsqueeze(2)).reshape({c});
    at::Tensor sq_c = certify_direct(q, (row_norms(a64) * row_norms(g64)).sum(1), e, n + 1);
    if (bias) sq_c = add_up(sq_c, bias_sq_norms_btd(gc));
    auto [f_c, n_c] = clip_from_sq_norms(sq_c, max_norm, mode, gamma);
    // Factor 0 comes only with a non-finite norm; zero those samples' rows (0 * NaN = NaN). On
    // CPU only when there is one (the count is at hand); on CUDA always (asking would sync).
    if (!host_path(per_sample) || n_c.item<int64_t>() > 0) {
      per_sample = scale_rows(per_sample, f_c, /*multiply=*/false);
    }
    grad_w.addmm_(f64(f_c).unsqueeze(0), per_sample);
    sq.slice(0, i0, i1).copy_(sq_c);
    factors.slice(0, i0, i1).copy_(f_c);
    nonfinite.add_(n_c);
  }
  const at::Tensor w = f32(grad_w).view({d_out, d_in});
  at::Tensor grad_b = bias ? bias_clipped_sum_btd(g, factors) : no_bias_grad(g);
  return {transposed ? w.t().contiguous() : w, grad_b, to_f32_up(sq), factors, nonfinite};
}

// Public fused op: (grad_weight, grad_bias or [0], sq_norms [B], factors [B], non-finite count).
inline ClipResult linear_clip(const at::Tensor& A, const at::Tensor& G, double max_norm,
                              c10::string_view mode, double gamma, bool bias, bool transposed,
                              int64_t method) {
  constexpr const char* op = "linear_clip";
  const NormMethod m = check_method(op, method);
  check_layer_pair(op, A, "A", G);
  check_clip_op_args(op, max_norm, mode, gamma);
  const Fp32MatmulGuard precision;
  const at::Tensor a = as_btd(op, "A", A), g = as_btd(op, "G", G);
  if (!use_ghost(m, a.size(1), a.size(2), g.size(2))) {
    return linear_clip_direct(a, g, max_norm, mode, gamma, bias, transposed);
  }
  const at::Tensor sq = linear_sq_norms_btd(a, g, m, bias);
  auto [factors, nonfinite] = clip_from_sq_norms(sq, max_norm, mode, gamma);
  at::Tensor grad_w = linear_clipped_sum(A, G, factors, transposed);
  at::Tensor grad_b = bias ? bias_clipped_sum_btd(g, factors) : no_bias_grad(G);
  return {grad_w, grad_b, to_f32_up(sq), factors, nonfinite};
}

}  // namespace per_sample
}  // namespace dpzero::kernels
