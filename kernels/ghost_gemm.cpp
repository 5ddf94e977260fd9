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

std::tuple<at::Tensor, at::Tensor> ghost_values_gemm(const at::Tensor& a, const at::Tensor& ids,
                                                     const at::Tensor& g, int64_t pad) {
  const bool tokens = !a.defined();
  const int64_t b = g.size(0), t = g.size(1), d_out = g.size(2);
  const int64_t d_in = tokens ? 0 : a.size(2);
  const at::TensorOptions f64 = g.options().dtype(at::kDouble);
  at::Tensor value = at::zeros({b}, f64);
  at::Tensor s = at::zeros({b}, f64);
  if (b == 0 || t == 0) return {value, s};
  const auto blocks = gemm_row_blocks(t);
  int64_t strip = 0;
  for (const auto& [r0, r1] : blocks) strip = std::max(strip, (r1 - r0) * r1);
  // Per sample: float64 rows of A and G, and (for the largest block) two strips and their
  // product, plus the [T] row values and diagonal terms.
  const int64_t per_sample = 8 * (t * (d_in + d_out) + 3 * strip + 2 * t);
  const int64_t chunk = samples_per_chunk(b, per_sample);
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk), c = i1 - i0;
    const at::Tensor g64 = g.slice(0, i0, i1).to(at::kDouble);  // [c, T, d_out]
    const at::Tensor a64 = tokens ? at::Tensor() : a.slice(0, i0, i1).to(at::kDouble);
    const at::Tensor id = tokens ? ids.slice(0, i0, i1) : at::Tensor();  // [c, T]
    at::Tensor row_values = at::empty({c, t}, f64);
    at::Tensor diagonal_terms = at::empty({c, t}, f64);
    for (const auto& [r0, r1] : blocks) {
      const int64_t rows = r1 - r0;
      const at::Tensor sg = at::bmm(g64.slice(1, r0, r1), g64.slice(1, 0, r1).transpose(1, 2));
      const at::Tensor dg = sg.diagonal(r0, 1, 2);  // [c, rows]: ĜG[s, s], s in [r0, r1)
      at::Tensor product, diag_term;
      if (tokens) {
        const at::Tensor id_s = id.slice(1, r0, r1).unsqueeze(2);  // [c, rows, 1]
        const at::Tensor kept_s = id_s != pad;
        product = at::where(at::logical_and(id_s == id.slice(1, 0, r1).unsqueeze(1), kept_s), sg,
                            0.0);
        diag_term = at::where(kept_s.squeeze(2), dg.sqrt(), 0.0);
      } else {
        const at::Tensor sa = at::bmm(a64.slice(1, r0, r1), a64.slice(1, 0, r1).transpose(1, 2));
        product = sa * sg;
        diag_term = (sa.diagonal(r0, 1, 2) * dg).sqrt();
      }
      const at::Tensor off = product.narrow(2, 0, r0).sum(2);       // [c, rows]
      const at::Tensor on = product.narrow(2, r0, rows).sum(2);     // [c, rows]
      row_values.narrow(1, r0, rows).copy_(off * 2.0 + on);
      diagonal_terms.narrow(1, r0, rows).copy_(diag_term);
    }
    value.slice(0, i0, i1).copy_(row_values.sum(1));
    s.slice(0, i0, i1).copy_(diagonal_terms.sum(1));
  }
  return {value, s};
}

}  // namespace dpzero::kernels
