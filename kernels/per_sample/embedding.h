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
// (kernels/cpu/row_sums.cpp), and on CUDA kernels/cuda/row_sums.cu for T <= 2048, sort each
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

// The embedding clipped sum added into *self, or into new zeros when self is null; returns the
// accumulator. `op` names the public op in the argument checks. The padding row gets nothing.
// out [V, d] float32 (contiguous) += each sample's rows [c, T, d] float32 summed per id, sample by
// sample (Note [clipped-sum rounding]): on the host, one loop that sorts a sample's tokens by id
// and adds each run of one id into a row of its own before out, with no ATen calls (the
// per-sample sums of the device path cost a dozen of them, which at small sizes is most of the
// layer's time). Padding tokens (id `pad`) are skipped.
inline void add_embedding_rows_per_sample(at::Tensor& out, const at::Tensor& ids,
                                          const at::Tensor& rows, int64_t pad) {
  const at::Tensor r = rows.contiguous(), id = ids.contiguous();
  const int64_t c = r.size(0), t = r.size(1), d = r.size(2);
  const float* pr = r.data_ptr<float>();
  const int64_t* pi = id.data_ptr<int64_t>();
  float* po = out.data_ptr<float>();
  std::vector<int64_t> order(static_cast<size_t>(t));
  std::vector<float> acc(static_cast<size_t>(d));
  for (int64_t i = 0; i < c; ++i) {
    const int64_t* ids_i = pi + i * t;
    for (int64_t k = 0; k < t; ++k) order[static_cast<size_t>(k)] = k;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t x, int64_t y) { return ids_i[x] < ids_i[y]; });
    for (int64_t k = 0; k < t;) {
      const int64_t v = ids_i[order[static_cast<size_t>(k)]];
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (; k < t && ids_i[order[static_cast<size_t>(k)]] == v; ++k) {
        const float* row = pr + (i * t + order[static_cast<size_t>(k)]) * d;
        for (int64_t j = 0; j < d; ++j) acc[static_cast<size_t>(j)] += row[j];
      }
      if (v == pad) continue;  // padding tokens get no gradient
      float* dest = po + v * d;
      for (int64_t j = 0; j < d; ++j) dest[j] += acc[static_cast<size_t>(j)];
    }
  }
}

inline at::Tensor embedding_clipped_sum_into(const char* op, at::Tensor* self,
                                             const at::Tensor& ids, const at::Tensor& G,
                                             const at::Tensor& scale, int64_t num_embeddings,
                                             std::optional<int64_t> padding_idx) {
  check_embedding_args(op, ids, G, num_embeddings);
  const int64_t pad = normalize_padding_idx(op, padding_idx, num_embeddings);
  const at::Tensor id = flat_ids(op, ids, num_embeddings);
  const at::Tensor g = embedding_grad_btd(G, id);
  const int64_t b = g.size(0), t = g.size(1), d = g.size(2);
  check_scale(op, scale, b, G);
  at::Tensor out;
  if (self == nullptr) {
    out = at::zeros({num_embeddings, d}, G.options().dtype(at::kFloat));
  } else {
    check_accumulator(op, *self, {num_embeddings, d}, G, "G");
    out = *self;
  }
  const Fp32MatmulGuard precision;
  const bool host = host_factors_apply(scale, G, G);
  // Per sample: float32 copies of its rows, and (T >= 2) its per-id sums.
  const int64_t chunk = samples_per_chunk(b, 8 * t * d + (t >= 2 ? 4 * t * d + 32 * t : 0));
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor idc = id.slice(0, i0, i1);
    const at::Tensor c = scale.slice(0, i0, i1), gc = f32(g.slice(0, i0, i1));
    at::Tensor rows = host ? host_rows(gc, c, host_factors(c), /*multiply=*/true,
                                       /*owned=*/false)  // Note [host factors]
                           : scale_rows(gc, c, /*multiply=*/true);
    if (t >= 2 && host && out.is_contiguous()) {
      add_embedding_rows_per_sample(out, idc, rows, pad);
      continue;
    }
    rows.masked_fill_((idc == pad).unsqueeze(-1), 0);  // padding tokens get no gradient
    if (t < 2) {
      out.index_add_(0, idc.reshape({-1}), rows.reshape({-1, d}));
      continue;
    }
    // Note [clipped-sum rounding]: each sample's rows summed per id alone (the key sample * V +
    // id names one sample's id), then the per-sample sums added into the rows of their ids.
    // Without a host read (torch.unique would wait for the device to size its result): the keys
    // sorted, each token numbered by its run of equal keys, the runs summed into n = c T rows (the
    // rows past the last run stay zero, and adding them to row 0 changes nothing).
    const at::Tensor sample = at::arange(i1 - i0, idc.options()).unsqueeze(1);
    const at::Tensor keys = (sample * num_embeddings + idc).reshape({-1});  // [n]
    const auto [sorted, order] = at::sort(keys);
    const at::Tensor starts = at::ones_like(sorted, sorted.options().dtype(at::kLong));
    starts.slice(0, 1).copy_(sorted.slice(0, 1) != sorted.slice(0, 0, -1));
    const at::Tensor run_sorted = starts.cumsum(0) - 1;  // [n]: the run of each sorted token
    const at::Tensor run = at::empty_like(run_sorted).scatter_(0, order, run_sorted);
    at::Tensor sums = at::zeros({keys.size(0), d}, rows.options());
    sums.index_add_(0, run, rows.reshape({-1, d}));
    const at::Tensor run_key = at::zeros_like(sorted).scatter_(0, run_sorted, sorted);
    out.index_add_(0, run_key.remainder(num_embeddings), sums);
  }
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
