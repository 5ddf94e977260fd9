// kernels/per_sample/embedding.h — the per-sample ops of Embedding (Note [per-sample ops] in
// kernels/per_sample_ops.h; schemas in kernels/ops.cpp).
#pragma once

#include "kernels/per_sample/common.h"

namespace dpzero::kernels {
namespace per_sample {

// ---- Embedding: ids [B, ...], G [B, ..., d], weight [V, d] --------------------------------------

// Note [embedding rows]
// The direct path of an embedding: the rows sample i touches, r_v = sum_{t: id_t = v} G_{i,t} for
// each distinct v != pad, summed in float64; ||g_i||^2 = sum_v ||r_v||^2 and S_i = sum_{t: id_t !=
// pad} ||G_{i,t}|| (Note [certified norms]: each entry of r_v is a sum of at most T terms, e =
// gamma_T, and q sums at most T d squares). dpzero::_embedding_rows returns (q, S), raw float64.
// Its generic version (any device; registered in per_sample.cpp) builds the rows of a chunk of
// samples by one index_add over the runs of sorted (sample, token) keys, with no host read (the
// private backward never waits on the device: tests/python/test_sync_free.py); the CPU kernel
// (kernels/cpu/row_sums.cpp), and on CUDA kernels/cuda/row_sums.cu, sort each
// sample's tokens by id and stream each run of equal ids through one [d] float64 accumulator
// (per column, on CUDA), so they hold no [c, U, d] rows and do T d work per sample: less than the
// ghost path's 2 T^2 d in both time and memory, and the CPU takes this path whatever the shape
// (Note [ghost or direct]: embedding_uses_ghost). A padding token's row is skipped, never read into a
// sum, so a NaN there reaches nothing.

// ids [B, T] int64, G [B, T, d] -> (q [B], S [B]) float64 (Note [embedding rows]); pad >= 0, or
// -1 for none.
inline std::tuple<at::Tensor, at::Tensor> embedding_rows_generic(const at::Tensor& ids,
                                                                 const at::Tensor& g,
                                                                 int64_t num_embeddings,
                                                                 int64_t pad) {
  check_embedding_rows_args(ids, g, num_embeddings, pad);
  const int64_t b = g.size(0), t = g.size(1), d = g.size(2);
  at::Tensor q = at::empty({b}, g.options().dtype(at::kDouble));
  at::Tensor s = at::empty({b}, g.options().dtype(at::kDouble));
  const int64_t chunk = samples_per_pass_chunk(b, 8 * (4 * t * d + 2 * t) + 48 * t, host_path(g));
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk), c = i1 - i0;
    const at::Tensor id = ids.slice(0, i0, i1);                            // [c, T]
    const at::Tensor real = id != pad;                                     // [c, T]
    const at::Tensor sample = at::arange(c, id.options()).unsqueeze(1);    // [c, 1]
    const at::Tensor keys = (sample * num_embeddings + id).reshape({-1});  // [c*T]
    // A select, not a multiply: a padding token's G row may hold NaN.
    const at::Tensor g64 = at::where(real.unsqueeze(-1), f64(g.slice(0, i0, i1)), 0);
    // Runs of equal keys in sorted order are the rows r_v; their number is never asked for (a
    // unique() would wait on the device for it): there are at most c*T, and the unused ones stay
    // zero. The segment of each sorted token: the count of run starts up to it, minus one.
    const auto [sorted, order] = keys.sort();
    const at::Tensor starts = at::ones_like(sorted, sorted.options().dtype(at::kLong));
    starts.slice(0, 1).copy_(sorted.slice(0, 1) != sorted.slice(0, 0, -1));
    const at::Tensor segment = starts.cumsum(0) - 1;  // [c*T]
    const at::Tensor rows = at::zeros({c * t, d}, g64.options())
                                .index_add_(0, segment, g64.reshape({-1, d}).index_select(0, order));
    // Every token of a run has the run's sample: its owner, written once per token.
    const at::Tensor owner = at::zeros({c * t}, segment.options())
                                 .scatter_(0, segment, sorted.div(num_embeddings, "trunc"));
    q.slice(0, i0, i1).copy_(
        at::zeros({c}, g64.options()).index_add_(0, owner, rows.square().sum(1)));
    s.slice(0, i0, i1).copy_(row_norms(g64).sum(1));
  }
  return {q, s};
}

inline std::tuple<at::Tensor, at::Tensor> embedding_rows(const at::Tensor& ids,
                                                         const at::Tensor& g,
                                                         int64_t num_embeddings, int64_t pad) {
  using Signature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                       int64_t, int64_t);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_embedding_rows", "")
                             .typed<Signature>();
  return op.call(ids, g, num_embeddings, pad);
}

// Certified direct path (Note [embedding rows]). ids [B, T] int64, G [B, T, d] -> [B] float64.
inline at::Tensor embedding_direct_sq_norms(const at::Tensor& ids, const at::Tensor& g,
                                            int64_t num_embeddings, int64_t pad) {
  const auto [q, s] = embedding_rows(ids, g, num_embeddings, pad);
  return certify_op(q, s,
                    direct_coefficient(rounding_gamma(static_cast<double>(g.size(1))),
                                       g.size(1) * g.size(2) + 1),
                    Step::kDirect, /*f32=*/false, clipped_sum_margin(g.size(1)));
}

// ids [B, ...] -> [B, T] int64; checks the id range on CPU (on CUDA that would cost a device sync
// in the backward pass; the forward's embedding lookup has already checked the same ids).
inline at::Tensor flat_ids(const char* op, const at::Tensor& ids, int64_t num_embeddings) {
  int64_t t = 1;
  for (int64_t k = 1; k < ids.dim(); ++k) t *= ids.size(k);
  at::Tensor flat = ids.reshape({ids.size(0), t}).to(at::kLong);
  if (host_path(ids) && flat.numel() > 0) {
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

// Certified [B] float64 (the checks done).
inline at::Tensor embedding_sq_norms_f64(const char* op, const at::Tensor& ids, const at::Tensor& G,
                                         int64_t num_embeddings,
                                         std::optional<int64_t> padding_idx, NormMethod method) {
  check_embedding_args(op, ids, G, num_embeddings);
  const int64_t pad = normalize_padding_idx(op, padding_idx, num_embeddings);
  const at::Tensor id = flat_ids(op, ids, num_embeddings);
  const at::Tensor g = embedding_grad_btd(G, id);
  const int64_t t = g.size(1), d = g.size(2);
  if (embedding_uses_ghost(method, t, num_embeddings, d, host_path(g))) {
    const auto [value, s] = token_ghost_sq_norms(id, g, pad);
    return certify_op(value, s, 2.0 * ghost_error_coefficient(t, 0, d), Step::kGhost,
                      /*f32=*/false, clipped_sum_margin(t));
  }
  return embedding_direct_sq_norms(id, g, num_embeddings, pad);
}

// Public: ids [B, ...], G [B, ..., d] -> [B] float32. padding_idx as in torch.nn.Embedding:
// padding tokens get no gradient.
inline at::Tensor embedding_sq_norms(const at::Tensor& ids, const at::Tensor& G,
                                     int64_t num_embeddings, std::optional<int64_t> padding_idx,
                                     int64_t method) {
  constexpr const char* op = "embedding_sq_norms";
  const NormMethod m = check_method(op, method);
  const Fp32MatmulGuard precision;
  return to_f32_up(embedding_sq_norms_f64(op, ids, G, num_embeddings, padding_idx, m));
}

// out [V, d] float32 += each kept sample's rows summed per id under its factor, padding tokens
// (id `pad`, -1 for none) skipped: dpzero::_add_embedding_sums_ (Note [embedding sums] in
// kernels/embedding_sums.h; kernels/cpu/embedding_sums.cpp, kernels/cuda/embedding_sums.cu), one
// op on every path. ids [B, T] int64, g [B, T, d], scale [B] float32.
inline void add_embedding_sums(at::Tensor& out, const at::Tensor& ids, const at::Tensor& g,
                               const at::Tensor& scale, int64_t pad) {
  using Signature = at::Tensor&(at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, int64_t);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_add_embedding_sums_", "")
                             .typed<Signature>();
  op.call(out, ids, g, scale, pad);
}

// The embedding clipped sum added into *self, or into new zeros when self is null; returns the
// accumulator. `op` names the public op in the argument checks. The padding row gets nothing.
// Each sample's rows are summed per id before they meet another sample's (Note [clipped-sum
// rounding]), by add_embedding_sums.
inline at::Tensor embedding_clipped_sum_into(const char* op, at::Tensor* self,
                                             const at::Tensor& ids, const at::Tensor& G,
                                             const at::Tensor& scale, int64_t num_embeddings,
                                             std::optional<int64_t> padding_idx) {
  check_embedding_args(op, ids, G, num_embeddings);
  const int64_t pad = normalize_padding_idx(op, padding_idx, num_embeddings);
  const at::Tensor id = flat_ids(op, ids, num_embeddings);
  const at::Tensor g = embedding_grad_btd(G, id);
  check_scale(op, scale, g.size(0), G);
  at::Tensor out;
  if (self == nullptr) {
    out = at::zeros({num_embeddings, g.size(2)}, G.options().dtype(at::kFloat));
  } else {
    check_accumulator(op, *self, {num_embeddings, g.size(2)}, G, "G");
    out = *self;
  }
  add_embedding_sums(out, id, g, scale, pad);
  return out;
}

// Public in-place: self [V, d] float32 += sum_i scale_i (embedding gradient of sample i); ids
// [B, ...], G [B, ..., d], scale [B].
inline at::Tensor& add_embedding_clipped_sum_(at::Tensor& self, const at::Tensor& ids,
                                              const at::Tensor& G, const at::Tensor& scale,
                                              int64_t num_embeddings,
                                              std::optional<int64_t> padding_idx) {
  embedding_clipped_sum_into("add_embedding_clipped_sum_", &self, ids, G, scale, num_embeddings,
                             padding_idx);
  return self;
}

// Public: ids [B, ...], G [B, ..., d], scale [B] -> [V, d] float32 (the padding row stays 0).
inline at::Tensor embedding_clipped_sum(const at::Tensor& ids, const at::Tensor& G,
                                        const at::Tensor& scale, int64_t num_embeddings,
                                        std::optional<int64_t> padding_idx) {
  return embedding_clipped_sum_into("embedding_clipped_sum", nullptr, ids, G, scale,
                                    num_embeddings, padding_idx);
}

// Public fused op: (grad_weight [V, d], sq_norms [B], factors [B], non-finite count).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> embedding_clip(
    const at::Tensor& ids, const at::Tensor& G, int64_t num_embeddings, double max_norm,
    c10::string_view mode, double gamma, std::optional<int64_t> padding_idx, int64_t method) {
  constexpr const char* op = "embedding_clip";
  const NormMethod m = check_method(op, method);
  check_clip_op_args(op, max_norm, mode, gamma);
  const Fp32MatmulGuard precision;
  const at::Tensor sq = embedding_sq_norms_f64(op, ids, G, num_embeddings, padding_idx, m);
  auto [factors, nonfinite] = clip_from_sq_norms(sq, max_norm, mode, gamma);
  at::Tensor grad_w = embedding_clipped_sum(ids, G, factors, num_embeddings, padding_idx);
  return {grad_w, to_f32_up(sq), factors, nonfinite};
}

}  // namespace per_sample
}  // namespace dpzero::kernels
