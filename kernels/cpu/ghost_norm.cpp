// kernels/cpu/ghost_norm.cpp — CPU implementations of dpzero::_ghost_sq_norms and
// dpzero::_token_ghost_sq_norms (schemas in kernels/ops.cpp), the backend kernels behind the
// ghost path of the layer ops (Note [ghost norm] in kernels/per_sample/common.h). T = 1 takes
// the rank-one path (kernels/cpu/rank_one.cpp, Note [rank-one ghost] in
// kernels/per_sample_checks.h).
//
// A chunk of samples at a time: the inputs are copied to float64 (exactly) into a reused scratch
// buffer (Note [cpu scratch]), batched float64 GEMMs build the lower block triangle of each
// [c, T, T] Gram (Note [gram strips]), then at::parallel_for over the chunk's samples reduces
// each sample's Grams to one float64 number, row by row (Note [ghost summation depth] in
// kernels/per_sample_checks.h), and reads S = sum_t ||a_t|| ||g_t|| off the Gram diagonals. Both
// are raw float64 values; the layer ops turn them into a certified upper bound (Note [certified
// norms] in kernels/per_sample/common.h).
//
// Note [gram strips]
// ~~~~~~~~~~~~~~~~~~
// A Gram X X^T is symmetric and the ghost value sum_{s,t} ĜA[s,t] ĜG[s,t] is a sum over a
// symmetric pattern, so only the lower block triangle is formed: the rows are cut into nb blocks
// [r0, r1), and block I's strip is X[r0:r1] X[0:r1]^T ([c, r1 - r0, r1]: the off-diagonal blocks
// left of the diagonal and the whole diagonal block). Row s of a strip contributes
//   2 * (sum_{u < r0} ĜA[s,u] ĜG[s,u]) + sum_{r0 <= u < r1} ĜA[s,u] ĜG[s,u],
// the off-diagonal part standing for itself and its mirror image. Every entry is still the same
// length-d inner product (Note [certified norms] is unchanged: the GEMM computes X[s] . X[u] the
// same way whichever block it lands in, and the entries (s,u) and (u,s) of a full Gram are
// equal), doubling is exact, and a row passes through at most max(r0, r1 - r0) + 1 <= T
// additions before joining the running sum over rows (T - 1 more): depth <= 2T, as Note [ghost
// summation depth] assumes. With nb = 4 blocks at T = 128 the GEMMs do 10/16 of the full Grams'
// work (measured 1.78 -> 0.93 ms for one [16, 128, 256] float64 Gram on 2 cores).
//
// Note [cpu scratch]
// ~~~~~~~~~~~~~~~~~~
// A fresh multi-MiB CPU tensor is fresh pages, and faulting them in costs more than the copy that
// fills them: a [16, 128, 1024] float32 -> float64 copy took 2.2 ms into a new tensor and 0.2 ms
// into an existing one. The ghost kernels therefore carve their float64 copies and Gram strips out
// of one buffer per thread, kept between calls and grown to the largest chunk seen; a chunk is at
// most the per-sample-op chunk budget (64 MiB, kernels/per_sample_checks.h) unless a single sample
// needs more, and a request above the budget gets a one-off tensor instead of growing the buffer.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels/cpu/cpu_lanes.h"
#include "kernels/cpu/gram_simd.h"
#include "kernels/cpu/rank_one.h"
#include "kernels/per_sample_checks.h"

namespace dpzero::kernels {

namespace gram_simd {
bool available() { return cpu_lanes::avx2_fma(); }
bool wide_available() { return cpu_lanes::avx512f(); }
}  // namespace gram_simd

namespace {

// Note [cpu scratch]: `numel` float64 elements of this thread's reused buffer (contents
// undefined), or a new tensor when that would take more than the chunk budget.
at::Tensor scratch_f64(int64_t numel) {
  thread_local at::Tensor buffer;
  if (numel * 8 > chunk_bytes_budget().load() && numel * 8 > kChunkBytes) {
    return at::empty({numel}, at::kDouble);
  }
  if (!buffer.defined() || buffer.numel() < numel) buffer = at::empty({numel}, at::kDouble);
  return buffer.slice(0, 0, numel);
}

// Note [gram strips]: the row blocks [r0, r1) of a length-T sequence. Blocks of >= 32 rows, at
// most 8 of them.
std::vector<std::pair<int64_t, int64_t>> row_blocks(int64_t t) {
  const int64_t nb = std::clamp<int64_t>(t / 32, 1, 8);
  const int64_t rows = (t + nb - 1) / nb;
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (int64_t r0 = 0; r0 < t; r0 += rows) blocks.emplace_back(r0, std::min(t, r0 + rows));
  return blocks;
}

// Elements of one sample's strips: sum over blocks of (r1 - r0) * r1.
int64_t strip_numel(const std::vector<std::pair<int64_t, int64_t>>& blocks) {
  int64_t n = 0;
  for (const auto& [r0, r1] : blocks) n += (r1 - r0) * r1;
  return n;
}

// The strips of x [c, T, d] float64 into `out` (c * strip_numel float64, laid out block after
// block, each [c, r1 - r0, r1] contiguous): strip I = x[:, r0:r1] x[:, 0:r1]^T.
void gram_strips(const at::Tensor& x, const std::vector<std::pair<int64_t, int64_t>>& blocks,
                 const at::Tensor& out) {
  const int64_t c = x.size(0);
  int64_t at_elem = 0;
  for (const auto& [r0, r1] : blocks) {
    const int64_t n = c * (r1 - r0) * r1;
    at::Tensor strip = out.slice(0, at_elem, at_elem + n).view({c, r1 - r0, r1});
    at::bmm_out(strip, x.slice(1, r0, r1), x.slice(1, 0, r1).transpose(1, 2));
    at_elem += n;
  }
}

// sum_{u in [u0, u1)} a[u] g[u] with four interleaved partial sums, added pairwise at the end. A
// product passes through at most (ceil(n / 4) - 1) + min(2, n - 1) <= n - 1 roundings, n = u1 - u0
// (a partial sum's first addition, to 0, is exact; so is adding an empty partial sum), the same
// bound as the plain loop's: the row depth Note [gram strips] counts is unchanged. The four chains
// run in parallel instead of one dependent add at a time.
inline double dot4(const double* a, const double* g, int64_t u0, int64_t u1) {
  double p0 = 0.0, p1 = 0.0, p2 = 0.0, p3 = 0.0;
  int64_t u = u0;
  for (; u + 4 <= u1; u += 4) {
    p0 += a[u] * g[u];
    p1 += a[u + 1] * g[u + 1];
    p2 += a[u + 2] * g[u + 2];
    p3 += a[u + 3] * g[u + 3];
  }
  if (u < u1) p0 += a[u] * g[u];
  if (u + 1 < u1) p1 += a[u + 1] * g[u + 1];
  if (u + 2 < u1) p2 += a[u + 2] * g[u + 2];
  return (p0 + p1) + (p2 + p3);
}

// Per sample i of a chunk of c samples, from the strips of its A and G Grams (Note [gram
// strips]): value[i] = sum_{s,t} ga[s,t] gg[s,t], norms[i] = sum_t sqrt(ga[t,t] gg[t,t]) =
// sum_t ||a_t|| ||g_t||. With ids (the token Gram of an embedding's one-hot inputs, never formed;
// ga == nullptr): the product's A factor is [id_s == id_t], rows and columns of padding tokens
// are skipped (so a NaN in a padding token's G row does not reach the result), and norms[i] =
// sum_{t: id_t != pad} sqrt(gg[t,t]).
void strip_dots(const double* ga, const double* gg, const int64_t* ids, int64_t pad, int64_t c,
                const std::vector<std::pair<int64_t, int64_t>>& blocks, double* value,
                double* norms) {
  at::parallel_for(0, c, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* id = ids == nullptr ? nullptr : ids + i * blocks.back().second;
      double acc = 0.0, s_acc = 0.0;
      int64_t block_start = 0;  // element offset of this block's strips for sample 0
      for (const auto& [r0, r1] : blocks) {
        const int64_t rows = r1 - r0;
        const int64_t base = block_start + i * rows * r1;
        for (int64_t s = r0; s < r1; ++s) {
          if (id != nullptr && id[s] == pad) continue;
          const double* g_row = gg + base + (s - r0) * r1;
          const double* a_row = ga == nullptr ? nullptr : ga + base + (s - r0) * r1;
          double off = 0.0, diag = 0.0;
          if (id == nullptr) {
            off = dot4(a_row, g_row, 0, r0);
            diag = dot4(a_row, g_row, r0, r1);
            s_acc += std::sqrt(a_row[s] * g_row[s]);
          } else {
            for (int64_t u = 0; u < r0; ++u) {
              if (id[u] == id[s]) off += g_row[u];
            }
            for (int64_t u = r0; u < r1; ++u) {
              if (id[u] == id[s]) diag += g_row[u];
            }
            s_acc += std::sqrt(g_row[s]);
          }
          acc += 2.0 * off + diag;
        }
        block_start += c * rows * r1;
      }
      value[i] = acc;
      norms[i] = s_acc;
    }
  });
}

// Note [small ghost]
// ~~~~~~~~~~~~~~~~~~
// For a short sequence of float32 rows (T <= kSmallGhostRows, where Note [gram strips] has one
// block: the whole T x T Gram) the batched float64 GEMMs and the float64 staging above cost more
// than their arithmetic: at B = 4, T = 16, d = 64..256 (experiments/host_overhead.py) the two
// bmm calls took 20-55 us for 65-200 k multiply-adds, and the copies, slices and views around
// them as much again, once per DP layer per step. There, on CPUs with AVX2 + FMA, each sample's
// Grams are formed straight from its float32 rows (gram_simd::gram_f32) into per-thread buffers,
// and strip_dots reduces them over the one block exactly as it reduces the GEMM's strips. Every
// Gram entry is still a length-d inner product of exact float64 products summed in float64
// (within gamma_d, Note [certified norms] in kernels/per_sample/common.h) and strip_dots is
// unchanged, so the depth of Note [ghost summation depth] and the certified margin are the same;
// only the order of the additions inside one entry differs from the GEMM's (which no BLAS
// specifies). Other dtypes, non-contiguous inputs and longer sequences take the path above.
constexpr int64_t kSmallGhostRows = 32;

bool small_ghost_applies(int64_t t, const at::Tensor& g) {
  return t <= kSmallGhostRows && g.scalar_type() == at::kFloat && g.is_contiguous() &&
         gram_simd::available();
}

// gram_simd::gram_f32 in the widest lanes this CPU has (the same bits either way).
void small_gram(const float* x, int64_t t, int64_t d, double* rows, double* gram) {
  if (gram_simd::wide_available()) {
    gram_simd::gram_f32_avx512(x, t, d, rows, gram);
  } else {
    gram_simd::gram_f32(x, t, d, rows, gram);
  }
}

// This thread's float64 buffers for the small path: rows [t, d], and two [t, t] Grams.
struct SmallGhostBuffers {
  std::vector<double> rows, ga, gg;
  void fit(int64_t t, int64_t d) {
    rows.resize(static_cast<size_t>(t * d));
    ga.resize(static_cast<size_t>(t * t));
    gg.resize(static_cast<size_t>(t * t));
  }
};

// Note [small ghost]: value / norms [L, b] float64 (row l at value + l * b) for A [b, t, d_in]
// (or, with ids [b, t], the token Gram of an embedding, `a` then null) and each G_l [b, t,
// d_out_l], all float32 contiguous.
void small_ghost_values(const float* a, int64_t d_in, const int64_t* ids, int64_t pad,
                        at::TensorList gs, int64_t b, int64_t t, double* value, double* norms) {
  int64_t max_d = d_in;
  for (const at::Tensor& g : gs) max_d = std::max(max_d, g.size(2));
  const std::vector<std::pair<int64_t, int64_t>> one_block{{0, t}};
  at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
    thread_local SmallGhostBuffers buf;
    buf.fit(t, max_d);
    for (int64_t i = begin; i < end; ++i) {
      if (a != nullptr) {
        small_gram(a + i * t * d_in, t, d_in, buf.rows.data(), buf.ga.data());
      }
      for (size_t l = 0; l < gs.size(); ++l) {
        const int64_t d_out = gs[l].size(2);
        small_gram(gs[l].data_ptr<float>() + i * t * d_out, t, d_out, buf.rows.data(),
                   buf.gg.data());
        const int64_t at_out = static_cast<int64_t>(l) * b + i;
        strip_dots(a != nullptr ? buf.ga.data() : nullptr, buf.gg.data(),
                   ids != nullptr ? ids + i * t : nullptr, pad, 1, one_block, value + at_out,
                   norms + at_out);
      }
    }
  });
}

// Note [shared inputs]: A [B, T, d_in] and L output gradients G_l [B, T, d_out_l] of layers that
// read the same input -> ([L, B] <A_i A_i^T, G_{l,i} G_{l,i}^T>, [L, B] sum_t ||a_t|| ||g_{l,t}||),
// float64. A's copy and strips are made once per chunk, then each G_l's in turn; L = 1 is
// _ghost_sq_norms, so a layer's value is the same bits whether it is computed alone or with others
// on the same path (Note [small ghost] takes a group only when every G qualifies; either path's
// value is certified the same way). `op` names the calling op in the argument checks.
std::tuple<at::Tensor, at::Tensor> ghost_values(const char* op, const at::Tensor& a,
                                                at::TensorList gs) {
  int64_t max_d_out = 0;
  for (const at::Tensor& g : gs) {
    check_ghost_args(op, a, "A", g);
    max_d_out = std::max(max_d_out, g.size(2));
  }
  const int64_t n_layers = static_cast<int64_t>(gs.size());
  const int64_t b = a.size(0), t = a.size(1), d_in = a.size(2);
  const at::TensorOptions f64 = a.options().dtype(at::kDouble);
  if (b == 0 || t == 0) return {at::zeros({n_layers, b}, f64), at::zeros({n_layers, b}, f64)};
  if (t == 1) return rank_one_values(a, at::Tensor(), -1, gs);  // Note [rank-one ghost]
  // Every entry is written below (strip_dots stores each sample's value and norm).
  at::Tensor value = at::empty({n_layers, b}, f64);
  at::Tensor norms = at::empty({n_layers, b}, f64);
  const bool small = a.scalar_type() == at::kFloat && a.is_contiguous() &&
                     std::all_of(gs.begin(), gs.end(),
                                 [&](const at::Tensor& g) { return small_ghost_applies(t, g); });
  if (small) {  // Note [small ghost]
    small_ghost_values(a.data_ptr<float>(), d_in, nullptr, 0, gs, b, t, value.data_ptr<double>(),
                       norms.data_ptr<double>());
    return {value, norms};
  }
  const auto blocks = row_blocks(t);
  const int64_t strip = strip_numel(blocks);
  // Per sample: float64 copies of its A rows and of one G's rows, and the strips of two Grams.
  const int64_t per_sample = t * (d_in + max_d_out) + 2 * strip;
  const int64_t chunk = samples_per_chunk(b, 8 * per_sample);
  const at::Tensor ws = scratch_f64(chunk * per_sample);
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t c = std::min(b, i0 + chunk) - i0;
    int64_t at_elem = 0;
    const auto take = [&](int64_t n) {
      at::Tensor part = ws.slice(0, at_elem, at_elem + n);
      at_elem += n;
      return part;
    };
    const at::Tensor ac = take(c * t * d_in).view({c, t, d_in}).copy_(a.slice(0, i0, i0 + c));
    const at::Tensor strips_a = take(c * strip), strips_g = take(c * strip);
    gram_strips(ac, blocks, strips_a);
    const at::Tensor g_rows = take(c * t * max_d_out);  // reused by every layer
    for (int64_t l = 0; l < n_layers; ++l) {
      const at::Tensor& g = gs[static_cast<size_t>(l)];
      const int64_t d_out = g.size(2);
      const at::Tensor gc =
          g_rows.slice(0, 0, c * t * d_out).view({c, t, d_out}).copy_(g.slice(0, i0, i0 + c));
      gram_strips(gc, blocks, strips_g);
      strip_dots(strips_a.data_ptr<double>(), strips_g.data_ptr<double>(), nullptr, 0, c, blocks,
                 value.data_ptr<double>() + l * b + i0, norms.data_ptr<double>() + l * b + i0);
    }
  }
  return {value, norms};
}

// A [B, T, d_in], G [B, T, d_out] -> ([B] <A_i A_i^T, G_i G_i^T>, [B] sum_t ||a_t|| ||g_t||),
// float64.
std::tuple<at::Tensor, at::Tensor> ghost_sq_norms_cpu(const at::Tensor& a, const at::Tensor& g) {
  auto [value, norms] = ghost_values("_ghost_sq_norms", a, {g});
  return {value[0], norms[0]};
}

std::tuple<at::Tensor, at::Tensor> ghost_sq_norms_multi_cpu(const at::Tensor& a,
                                                            at::TensorList gs) {
  TORCH_CHECK(!gs.empty(), "dpzero::_ghost_sq_norms_multi: G must hold at least one tensor");
  return ghost_values("_ghost_sq_norms_multi", a, gs);
}

// ids [B, T] int64, G [B, T, d] -> ([B] value, [B] sum_{t: id_t != pad} ||g_t||), float64;
// padding_idx >= 0, or -1 for none.
std::tuple<at::Tensor, at::Tensor> token_ghost_sq_norms_cpu(const at::Tensor& ids,
                                                            const at::Tensor& g,
                                                            int64_t padding_idx) {
  check_token_ghost_args(ids, g, padding_idx);
  const int64_t b = g.size(0), t = g.size(1), d = g.size(2);
  const at::TensorOptions f64 = g.options().dtype(at::kDouble);
  if (b == 0 || t == 0) return {at::zeros({b}, f64), at::zeros({b}, f64)};
  // Every entry is written below (strip_dots stores each sample's value and norm).
  at::Tensor value = at::empty({b}, f64);
  at::Tensor norms = at::empty({b}, f64);
  const at::Tensor ids_c = ids.contiguous();
  if (t == 1) {  // Note [rank-one ghost]
    auto [v, s] = rank_one_values(at::Tensor(), ids_c, padding_idx, {g});
    return {v[0], s[0]};
  }
  if (small_ghost_applies(t, g)) {  // Note [small ghost]
    small_ghost_values(nullptr, 0, ids_c.data_ptr<int64_t>(), padding_idx, {g}, b, t,
                       value.data_ptr<double>(), norms.data_ptr<double>());
    return {value, norms};
  }
  const auto blocks = row_blocks(t);
  const int64_t strip = strip_numel(blocks);
  const int64_t per_sample = t * d + strip;
  const int64_t chunk = samples_per_chunk(b, 8 * per_sample);
  const at::Tensor ws = scratch_f64(chunk * per_sample);
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t c = std::min(b, i0 + chunk) - i0;
    const at::Tensor gc = ws.slice(0, 0, c * t * d).view({c, t, d}).copy_(g.slice(0, i0, i0 + c));
    const at::Tensor strips_g = ws.slice(0, c * t * d, c * t * d + c * strip);
    gram_strips(gc, blocks, strips_g);
    strip_dots(nullptr, strips_g.data_ptr<double>(), ids_c.data_ptr<int64_t>() + i0 * t,
               padding_idx, c, blocks, value.data_ptr<double>() + i0,
               norms.data_ptr<double>() + i0);
  }
  return {value, norms};
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CPU, m) {
  m.impl("_ghost_sq_norms", &ghost_sq_norms_cpu);
  m.impl("_ghost_sq_norms_multi", &ghost_sq_norms_multi_cpu);
  m.impl("_token_ghost_sq_norms", &token_ghost_sq_norms_cpu);
}

}  // namespace dpzero::kernels
