// kernels/cpu/ghost_norm.cpp — CPU implementations of dpzero::_ghost_sq_norms and
// dpzero::_token_ghost_sq_norms (schemas in kernels/ops.cpp), the backend kernels behind the
// ghost path of the layer ops in kernels/per_sample_ops.h (Note [ghost norm] there).
//
// A chunk of samples at a time: batched GEMMs build the [c, T, T] Grams in float32, then
// at::parallel_for over the chunk's samples reduces each sample's Grams to one number (in double,
// so a long sequence's T^2 terms do not lose the small ones).
#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels/per_sample_checks.h"

namespace dpzero::kernels {
namespace {

// Per sample i of [c, T, T] Grams: out[i] = sum_{s,t} ga[i,s,t] * gg[i,s,t].
void frobenius_dots(const at::Tensor& ga,  // [c, T, T] float32, contiguous
                    const at::Tensor& gg,  // [c, T, T] float32, contiguous
                    float* out) {          // [c]
  const int64_t c = gg.size(0), tt = gg.size(1) * gg.size(2);
  const float* pa = ga.data_ptr<float>();
  const float* pg = gg.data_ptr<float>();
  at::parallel_for(0, c, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* a = pa + i * tt;
      const float* g = pg + i * tt;
      double acc = 0.0;
      for (int64_t k = 0; k < tt; ++k) acc += static_cast<double>(a[k]) * g[k];
      out[i] = static_cast<float>(acc);
    }
  });
}

// Per sample i: out[i] = sum_{s,t: id_s = id_t != pad} gg[i,s,t] (the token-equality Gram of an
// embedding's one-hot inputs, never formed).
void token_dots(const at::Tensor& ids,  // [c, T] int64, contiguous
                const at::Tensor& gg,   // [c, T, T] float32, contiguous
                int64_t pad, float* out) {
  const int64_t c = gg.size(0), t = gg.size(1);
  const int64_t* pid = ids.data_ptr<int64_t>();
  const float* pg = gg.data_ptr<float>();
  at::parallel_for(0, c, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* id = pid + i * t;
      const float* g = pg + i * t * t;
      double acc = 0.0;
      for (int64_t s = 0; s < t; ++s) {
        if (id[s] == pad) continue;
        for (int64_t u = 0; u < t; ++u) {
          if (id[u] == id[s]) acc += g[s * t + u];
        }
      }
      out[i] = static_cast<float>(acc);
    }
  });
}

// A [B, T, d_in], G [B, T, d_out] -> [B] float32: <A_i A_i^T, G_i G_i^T>.
at::Tensor ghost_sq_norms_cpu(const at::Tensor& a, const at::Tensor& g) {
  check_ghost_args("_ghost_sq_norms", a, "A", g);
  const int64_t b = g.size(0), t = g.size(1);
  at::Tensor out = at::zeros({b}, g.options().dtype(at::kFloat));
  const int64_t chunk = samples_per_chunk(b, 4 * (2 * t * t + t * (a.size(2) + g.size(2))));
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor ac = a.slice(0, i0, i1).to(at::kFloat);
    const at::Tensor gc = g.slice(0, i0, i1).to(at::kFloat);
    const at::Tensor gram_a = at::bmm(ac, ac.transpose(1, 2)).contiguous();  // [c, T, T]
    const at::Tensor gram_g = at::bmm(gc, gc.transpose(1, 2)).contiguous();  // [c, T, T]
    frobenius_dots(gram_a, gram_g, out.data_ptr<float>() + i0);
  }
  return out;
}

// ids [B, T] int64, G [B, T, d] -> [B] float32; padding_idx >= 0, or -1 for none.
at::Tensor token_ghost_sq_norms_cpu(const at::Tensor& ids, const at::Tensor& g,
                                    int64_t padding_idx) {
  check_ghost_args("_token_ghost_sq_norms", ids, "ids", g);
  TORCH_CHECK(ids.scalar_type() == at::kLong,
              "dpzero::_token_ghost_sq_norms: ids must be int64, got ", ids.scalar_type());
  TORCH_CHECK(padding_idx >= -1,
              "dpzero::_token_ghost_sq_norms: padding_idx must be >= 0 or -1 "
              "(none), got ",
              padding_idx);
  const int64_t b = g.size(0), t = g.size(1);
  at::Tensor out = at::zeros({b}, g.options().dtype(at::kFloat));
  const int64_t chunk = samples_per_chunk(b, 4 * (t * t + t * g.size(2)));
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor gc = g.slice(0, i0, i1).to(at::kFloat);
    const at::Tensor gram_g = at::bmm(gc, gc.transpose(1, 2)).contiguous();  // [c, T, T]
    token_dots(ids.slice(0, i0, i1).contiguous(), gram_g, padding_idx, out.data_ptr<float>() + i0);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CPU, m) {
  m.impl("_ghost_sq_norms", &ghost_sq_norms_cpu);
  m.impl("_token_ghost_sq_norms", &token_ghost_sq_norms_cpu);
}

}  // namespace dpzero::kernels
