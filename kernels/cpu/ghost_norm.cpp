// kernels/cpu/ghost_norm.cpp — CPU implementations of dpzero::_ghost_sq_norms and
// dpzero::_token_ghost_sq_norms (schemas in kernels/ops.cpp), the backend kernels behind the
// ghost path of the layer ops in kernels/per_sample_ops.h (Note [ghost norm] there).
//
// A chunk of samples at a time: the inputs are converted to float64 (exactly), batched float64
// GEMMs build the [c, T, T] Grams, then at::parallel_for over the chunk's samples reduces each
// sample's Grams to one float64 number, row by row (Note [ghost summation depth] in
// kernels/per_sample_checks.h), and reads S = sum_t ||a_t|| ||g_t|| off the Gram diagonals. Both
// are raw float64 values; the layer ops turn them into a certified upper bound (Note [certified
// norms] in kernels/per_sample_ops.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels/per_sample_checks.h"

namespace dpzero::kernels {
namespace {

// Per sample i of [c, T, T] Grams: value[i] = sum_s (sum_t ga[i,s,t] * gg[i,s,t]), and
// norms[i] = sum_t sqrt(ga[i,t,t] * gg[i,t,t]) = sum_t ||a_t|| ||g_t|| from the Gram diagonals.
void frobenius_dots(const at::Tensor& ga,  // [c, T, T] float64, contiguous
                    const at::Tensor& gg,  // [c, T, T] float64, contiguous
                    double* value,         // [c]
                    double* norms) {       // [c]
  const int64_t c = gg.size(0), t = gg.size(1);
  const double* pa = ga.data_ptr<double>();
  const double* pg = gg.data_ptr<double>();
  at::parallel_for(0, c, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      double acc = 0.0, s_acc = 0.0;
      for (int64_t s = 0; s < t; ++s) {
        const double* a = pa + (i * t + s) * t;
        const double* g = pg + (i * t + s) * t;
        double row = 0.0;
        for (int64_t u = 0; u < t; ++u) row += a[u] * g[u];
        acc += row;
        s_acc += std::sqrt(a[s] * g[s]);
      }
      value[i] = acc;
      norms[i] = s_acc;
    }
  });
}

// Per sample i: value[i] = sum_{s: id_s != pad} (sum_{t: id_t = id_s} gg[i,s,t]) (the
// token-equality Gram of an embedding's one-hot inputs, never formed), and norms[i] =
// sum_{t: id_t != pad} sqrt(gg[i,t,t]) = sum_{t: id_t != pad} ||g_t||. Entries of a padding
// token's row or column are never read, so a NaN in a padding token's G row does not reach them.
void token_dots(const at::Tensor& ids,  // [c, T] int64, contiguous
                const at::Tensor& gg,   // [c, T, T] float64, contiguous
                int64_t pad, double* value, double* norms) {
  const int64_t c = gg.size(0), t = gg.size(1);
  const int64_t* pid = ids.data_ptr<int64_t>();
  const double* pg = gg.data_ptr<double>();
  at::parallel_for(0, c, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* id = pid + i * t;
      const double* g = pg + i * t * t;
      double acc = 0.0, s_acc = 0.0;
      for (int64_t s = 0; s < t; ++s) {
        if (id[s] == pad) continue;
        double row = 0.0;
        for (int64_t u = 0; u < t; ++u) {
          if (id[u] == id[s]) row += g[s * t + u];
        }
        acc += row;
        s_acc += std::sqrt(g[s * t + s]);
      }
      value[i] = acc;
      norms[i] = s_acc;
    }
  });
}

// A [B, T, d_in], G [B, T, d_out] -> ([B] <A_i A_i^T, G_i G_i^T>, [B] sum_t ||a_t|| ||g_t||),
// float64.
std::tuple<at::Tensor, at::Tensor> ghost_sq_norms_cpu(const at::Tensor& a, const at::Tensor& g) {
  check_ghost_args("_ghost_sq_norms", a, "A", g);
  const int64_t b = g.size(0), t = g.size(1);
  at::Tensor value = at::zeros({b}, g.options().dtype(at::kDouble));
  at::Tensor norms = at::zeros({b}, g.options().dtype(at::kDouble));
  // Per sample: two float64 Grams and float64 copies of its rows.
  const int64_t chunk = samples_per_chunk(b, 8 * (2 * t * t + t * (a.size(2) + g.size(2))));
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor ac = a.slice(0, i0, i1).to(at::kDouble);
    const at::Tensor gc = g.slice(0, i0, i1).to(at::kDouble);
    const at::Tensor gram_a = at::bmm(ac, ac.transpose(1, 2)).contiguous();  // [c, T, T]
    const at::Tensor gram_g = at::bmm(gc, gc.transpose(1, 2)).contiguous();  // [c, T, T]
    frobenius_dots(gram_a, gram_g, value.data_ptr<double>() + i0, norms.data_ptr<double>() + i0);
  }
  return {value, norms};
}

// ids [B, T] int64, G [B, T, d] -> ([B] value, [B] sum_{t: id_t != pad} ||g_t||), float64;
// padding_idx >= 0, or -1 for none.
std::tuple<at::Tensor, at::Tensor> token_ghost_sq_norms_cpu(const at::Tensor& ids,
                                                            const at::Tensor& g,
                                                            int64_t padding_idx) {
  check_token_ghost_args(ids, g, padding_idx);
  const int64_t b = g.size(0), t = g.size(1);
  at::Tensor value = at::zeros({b}, g.options().dtype(at::kDouble));
  at::Tensor norms = at::zeros({b}, g.options().dtype(at::kDouble));
  const int64_t chunk = samples_per_chunk(b, 8 * (t * t + t * g.size(2)));
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor gc = g.slice(0, i0, i1).to(at::kDouble);
    const at::Tensor gram_g = at::bmm(gc, gc.transpose(1, 2)).contiguous();  // [c, T, T]
    token_dots(ids.slice(0, i0, i1).contiguous(), gram_g, padding_idx,
               value.data_ptr<double>() + i0, norms.data_ptr<double>() + i0);
  }
  return {value, norms};
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CPU, m) {
  m.impl("_ghost_sq_norms", &ghost_sq_norms_cpu);
  m.impl("_token_ghost_sq_norms", &token_ghost_sq_norms_cpu);
}

}  // namespace dpzero::kernels
