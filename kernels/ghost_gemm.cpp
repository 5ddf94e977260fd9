// kernels/ghost_gemm.cpp — see ghost_gemm.h.
//
// Per chunk of c samples (the chunk budget of kernels/per_sample_checks.h): exact float64 copies
// of the rows, then per row block [r0, r1) of gemm_row_blocks the strip X[:, r0:r1] X[:, 0:r1]^T
// of each Gram ([c, rows, r1], batched DGEMM: cuBLAS on CUDA) and its entrywise product P (the
// token Gram: P = G's strip where id_s = id_u != pad, else 0, a select, so a padding row's NaN
// never enters). Row s of a block (Note [gram strips] in kernels/cpu/ghost_norm.cpp) contributes
//   row_s = 2 * sum_{u < r0} P[s, u] + sum_{r0 <= u < r1} P[s, u]
// (the off-diagonal part stands for its mirror image too); the T row values of a sample are
// gathered into one [c, T] tensor and summed once. Depth: max(r0, rows) - 1 <= T - 1 additions
// inside a row, one to join the two parts (doubling is exact), T - 1 over the rows: <= 2T (Note
// [ghost summation depth]), whatever order ATen's reductions take. S is read off the strips'
// diagonals, sqrt(ĜA[t,t] ĜG[t,t]), like every other ghost path.
#include "kernels/ghost_gemm.h"

#include <algorithm>
#include <vector>

#include <ATen/ATen.h>

#include "kernels/per_sample_checks.h"

namespace dpzero::kernels {

std::vector<std::pair<int64_t, int64_t>> gemm_row_blocks(int64_t T) {
  const int64_t nb = std::clamp<int64_t>((T + 127) / 128, 1, 8);
  const int64_t rows = (T + nb - 1) / nb;
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (int64_t r0 = 0; r0 < T; r0 += rows) blocks.emplace_back(r0, std::min(T, r0 + rows));
  return blocks;
}

namespace {

// The bytes of float64 workspace one sample takes: its rows (`features` = d_in + one G's d_out),
// three strips of the largest row block live at once (an A or token strip, a G strip, their
// product) and the [T] row values and diagonal terms of one result.
int64_t bytes_per_sample(int64_t t, int64_t features,
                         const std::vector<std::pair<int64_t, int64_t>>& blocks) {
  int64_t strip = 0;
  for (const auto& [r0, r1] : blocks) strip = std::max(strip, (r1 - r0) * r1);
  return 8 * (t * features + 3 * strip + 2 * t);
}

// One row block's share of a sample's value and S (Note [gram strips]): product [c, rows, r1] the
// entrywise product of the two strips, diag_term [c, rows]; written into the [c, T] row values
// and diagonal terms at rows [r0, r1).
void add_block(const at::Tensor& product, const at::Tensor& diag_term, int64_t r0, int64_t rows,
               at::Tensor& row_values, at::Tensor& diagonal_terms) {
  const at::Tensor off = product.narrow(2, 0, r0).sum(2);    // [c, rows]
  const at::Tensor on = product.narrow(2, r0, rows).sum(2);  // [c, rows]
  row_values.narrow(1, r0, rows).copy_(off * 2.0 + on);
  diagonal_terms.narrow(1, r0, rows).copy_(diag_term);
}

// x [c, T, d] float64 -> the strip x[:, r0:r1] x[:, 0:r1]^T [c, r1 - r0, r1].
at::Tensor strip_of(const at::Tensor& x, int64_t r0, int64_t r1) {
  return at::bmm(x.slice(1, r0, r1), x.slice(1, 0, r1).transpose(1, 2));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> ghost_values_gemm(const at::Tensor& a, const at::Tensor& ids,
                                                     const at::Tensor& g, int64_t pad) {
  if (a.defined()) {
    auto [value, s] = ghost_values_gemm_multi(a, {g});
    return {value[0], s[0]};
  }
  // Tokens: the A-Gram is the indicator [id_s = id_u != pad], a select on G's strip.
  const int64_t b = g.size(0), t = g.size(1), d_out = g.size(2);
  const at::TensorOptions f64 = g.options().dtype(at::kDouble);
  at::Tensor value = at::zeros({b}, f64);
  at::Tensor s = at::zeros({b}, f64);
  if (b == 0 || t == 0) return {value, s};
  const auto blocks = gemm_row_blocks(t);
  const int64_t chunk = samples_per_chunk(b, bytes_per_sample(t, d_out, blocks));
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk), c = i1 - i0;
    const at::Tensor g64 = g.slice(0, i0, i1).to(at::kDouble);  // [c, T, d_out]
    const at::Tensor id = ids.slice(0, i0, i1);                  // [c, T]
    at::Tensor row_values = at::empty({c, t}, f64);
    at::Tensor diagonal_terms = at::empty({c, t}, f64);
    for (const auto& [r0, r1] : blocks) {
      const at::Tensor sg = strip_of(g64, r0, r1);
      const at::Tensor id_s = id.slice(1, r0, r1).unsqueeze(2);  // [c, rows, 1]
      const at::Tensor kept_s = id_s != pad;
      const at::Tensor product =
          at::where(at::logical_and(id_s == id.slice(1, 0, r1).unsqueeze(1), kept_s), sg, 0.0);
      const at::Tensor diag_term =
          at::where(kept_s.squeeze(2), sg.diagonal(r0, 1, 2).sqrt(), 0.0);
      add_block(product, diag_term, r0, r1 - r0, row_values, diagonal_terms);
    }
    value.slice(0, i0, i1).copy_(row_values.sum(1));
    s.slice(0, i0, i1).copy_(diagonal_terms.sum(1));
  }
  return {value, s};
}

std::tuple<at::Tensor, at::Tensor> ghost_values_gemm_multi(const at::Tensor& a,
                                                           at::TensorList gs) {
  const int64_t b = a.size(0), t = a.size(1), d_in = a.size(2);
  const int64_t outputs = static_cast<int64_t>(gs.size());
  const at::TensorOptions f64 = a.options().dtype(at::kDouble);
  at::Tensor value = at::zeros({outputs, b}, f64);
  at::Tensor s = at::zeros({outputs, b}, f64);
  if (b == 0 || t == 0 || outputs == 0) return {value, s};
  int64_t max_d_out = 0;
  for (const at::Tensor& g : gs) max_d_out = std::max(max_d_out, g.size(2));
  const auto blocks = gemm_row_blocks(t);
  // Per sample: A's float64 rows and its strips of every row block, kept while one G at a time
  // is converted and its strips formed (bytes_per_sample's one-layer workspace at the widest G,
  // plus A's strips).
  int64_t a_strips = 0;
  for (const auto& [r0, r1] : blocks) a_strips += (r1 - r0) * r1;
  const int64_t chunk = samples_per_chunk(
      b, bytes_per_sample(t, d_in + max_d_out, blocks) + 8 * a_strips);
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk), c = i1 - i0;
    std::vector<at::Tensor> sa, da;  // per row block: A's strip and its diagonal, once
    {
      const at::Tensor a64 = a.slice(0, i0, i1).to(at::kDouble);  // [c, T, d_in]
      for (const auto& [r0, r1] : blocks) {
        sa.push_back(strip_of(a64, r0, r1));
        da.push_back(sa.back().diagonal(r0, 1, 2));
      }
    }
    for (int64_t l = 0; l < outputs; ++l) {
      const at::Tensor g64 = gs[l].slice(0, i0, i1).to(at::kDouble);  // [c, T, d_out_l]
      at::Tensor row_values = at::empty({c, t}, f64);
      at::Tensor diagonal_terms = at::empty({c, t}, f64);
      for (size_t k = 0; k < blocks.size(); ++k) {
        const auto [r0, r1] = blocks[k];
        const at::Tensor sg = strip_of(g64, r0, r1);
        add_block(sa[k] * sg, (da[k] * sg.diagonal(r0, 1, 2)).sqrt(), r0, r1 - r0, row_values,
                  diagonal_terms);
      }
      value[l].slice(0, i0, i1).copy_(row_values.sum(1));
      s[l].slice(0, i0, i1).copy_(diagonal_terms.sum(1));
    }
  }
  return {value, s};
}

}  // namespace dpzero::kernels
