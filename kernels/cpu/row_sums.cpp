// kernels/cpu/row_sums.cpp — CPU implementations of dpzero::_row_sums, dpzero::_norm_row_sums and
// dpzero::_embedding_rows (schemas in kernels/ops.cpp; Note [row sums] and Note [embedding rows]
// in kernels/per_sample/embedding.h, whose generic ATen versions serve the other devices).
//
// One pass over the inputs, a sample per task: each row is read once as float32 (bfloat16 /
// float16 inputs are widened to float32 first, exactly), its entries are added to the sample's
// float64 sums in row order, and its float64 norm to S. LayerNorm / RMSNorm rows are normalised on
// the fly in float64, with the same two-pass variance as the generic version: mean, then the mean
// of squared deviations (RMSNorm: the mean of squares), x̂ = (x - mean) / sqrt(var + eps).
// The generic versions take chunks of float64 copies and a dozen ATen passes; for a [16, 128, 1024]
// bias these took 1.7 ms on 2 cores, this kernel a fraction of that (experiments/results/private.md).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels/cpu/cpu_lanes.h"
#include "kernels/cpu/row_sums_simd.h"
#include "kernels/per_sample_checks.h"

namespace dpzero::kernels {
namespace {

at::Tensor as_f32(const at::Tensor& x) { return as_dtype(x, at::kFloat).contiguous(); }

// sum_k (x[k] - shift) (squared when `square`) over k < d in float64, in four interleaved partial
// sums added pairwise at the end: a single chain of dependent adds made LayerNorm's mean and
// variance passes latency-bound (layer_norm_per_sample on [16, 128, 256]: 0.84 -> 0.44 ms, 2 cores).
inline double sum4(const float* x, int64_t d, double shift, bool square) {
  double p[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t k = 0;
  for (; k + 4 <= d; k += 4) {
    for (int j = 0; j < 4; ++j) {
      const double c = static_cast<double>(x[k + j]) - shift;
      p[j] += square ? c * c : c;
    }
  }
  for (; k < d; ++k) {
    const double c = static_cast<double>(x[k]) - shift;
    p[0] += square ? c * c : c;
  }
  return (p[0] + p[1]) + (p[2] + p[3]);
}

// out[k] += v[k] for k < d (float64), and returns ||v||^2 (float64, four partial sums: the loop is
// then limited by loads, not by one chain of dependent adds). v(k) gives entry k in float64.
template <typename Entry>
inline double add_entries(double* out, int64_t d, const Entry& v) {
  double q[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t k = 0;
  for (; k + 4 <= d; k += 4) {
    for (int j = 0; j < 4; ++j) {
      const double e = v(k + j);
      out[k + j] += e;
      q[j] += e * e;
    }
  }
  for (; k < d; ++k) {
    const double e = v(k);
    out[k] += e;
    q[0] += e * e;
  }
  return (q[0] + q[1]) + (q[2] + q[3]);
}

// Row adders (Note [row sums in lanes] in kernels/cpu/row_sums_simd.h): the AVX2 lanes where the
// CPU has them, else the scalar reference, the same bits either way.
bool lanes() {
  static const bool has = row_sums_simd::available();
  return has;
}

double add_row(double* sums, const float* x, int64_t d) {
  return lanes() ? row_sums_simd::add_row(sums, x, d) : row_sums_scalar::add_row(sums, x, d);
}

// The pass both ops share, over B samples of T rows of d: add(i, sums_i) adds sample i's rows, in
// float64 and in row order, into sums_i [d] and returns S_i = sum_r ||row_r||; -> (sums [B, d],
// S [B]), float64.
template <typename AddSample>
std::tuple<at::Tensor, at::Tensor> sum_rows(const at::TensorOptions& options, int64_t b, int64_t d,
                                            const AddSample& add) {
  // Each sample's row of sums is zeroed and its S written by the task that owns it (no separate
  // fill of the whole output).
  at::Tensor sums = at::empty({b, d}, options.dtype(at::kDouble));
  at::Tensor s = at::empty({b}, options.dtype(at::kDouble));
  double* ps = sums.data_ptr<double>();
  double* pn = s.data_ptr<double>();
  at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::fill(ps + i * d, ps + (i + 1) * d, 0.0);
      pn[i] = add(i, ps + i * d);
    }
  });
  return {sums, s};
}

// G [B, T, d] -> (sums [B, d] float64 = sum_t G_t, S [B] float64 = sum_t ||G_t||).
std::tuple<at::Tensor, at::Tensor> row_sums_cpu(const at::Tensor& g_in) {
  check_floating("_row_sums", "G", g_in);
  TORCH_CHECK(g_in.dim() == 3, "dpzero::_row_sums: G must be [B, T, d], got shape ", g_in.sizes());
  const at::Tensor g = as_f32(g_in);
  const int64_t t = g.size(1), d = g.size(2);
  const float* pg = g.data_ptr<float>();
  const bool simd = lanes();
  return sum_rows(g.options(), g.size(0), d, [&](int64_t i, double* sums) {
    const float* rows = pg + i * t * d;
    return simd ? row_sums_simd::add_rows(sums, rows, t, d)
                : row_sums_scalar::add_rows(sums, rows, t, d);
  });
}

// x, G [B, T, d] -> (sums [B, d] float64 = sum_t G_t ⊙ x̂_t, S [B] float64 = sum_t ||G_t ⊙ x̂_t||).
std::tuple<at::Tensor, at::Tensor> norm_row_sums_cpu(const at::Tensor& x_in, const at::Tensor& g_in,
                                                     double eps, bool rms) {
  check_floating("_norm_row_sums", "x", x_in);
  check_floating("_norm_row_sums", "G", g_in);
  TORCH_CHECK(x_in.dim() == 3 && x_in.sizes() == g_in.sizes(),
              "dpzero::_norm_row_sums: x and G must both be [B, T, d], got ", x_in.sizes(),
              " and ", g_in.sizes());
  const at::Tensor x = as_f32(x_in), g = as_f32(g_in);
  const int64_t t = x.size(1), d = x.size(2);
  const float* px = x.data_ptr<float>();
  const float* pg = g.data_ptr<float>();
  const bool simd = lanes();
  return sum_rows(x.options(), x.size(0), d, [&](int64_t i, double* sums) {
    const float *xs = px + i * t * d, *gs = pg + i * t * d;
    return simd ? row_sums_simd::add_norm_rows(sums, xs, gs, t, d, eps, rms)
                : row_sums_scalar::add_norm_rows(sums, xs, gs, t, d, eps, rms);
  });
}

// Note [embedding rows] (kernels/per_sample/embedding.h): ids [B, T] int64, G [B, T, d] -> (q [B], S
// [B]) float64. Per sample: the non-padding tokens sorted by (id, position), then each run of
// equal ids summed row by row in position order into one [d] float64 accumulator, whose squared
// norm joins q when the run ends. ids are only compared, never used as indices, so an id outside
// [0, num_embeddings) cannot reach memory it should not (the layer ops check the range first).
std::tuple<at::Tensor, at::Tensor> embedding_rows_cpu(const at::Tensor& ids_in,
                                                      const at::Tensor& g_in,
                                                      int64_t num_embeddings, int64_t pad) {
  check_embedding_rows_args(ids_in, g_in, num_embeddings, pad);
  const at::Tensor ids = ids_in.contiguous(), g = as_f32(g_in);
  const int64_t b = g.size(0), t = g.size(1), d = g.size(2);
  at::Tensor q = at::empty({b}, g.options().dtype(at::kDouble));  // written per sample below
  at::Tensor s = at::empty({b}, g.options().dtype(at::kDouble));
  const int64_t* pid = ids.data_ptr<int64_t>();
  const float* pg = g.data_ptr<float>();
  double* pq = q.data_ptr<double>();
  double* ps = s.data_ptr<double>();
  at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> row(static_cast<size_t>(d));
    std::vector<int64_t> order;
    order.reserve(static_cast<size_t>(t));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* id = pid + i * t;
      order.clear();
      for (int64_t r = 0; r < t; ++r) {
        if (id[r] != pad) order.push_back(r);
      }
      std::sort(order.begin(), order.end(), [id](int64_t x, int64_t y) {
        return id[x] != id[y] ? id[x] < id[y] : x < y;
      });
      double q_i = 0.0, s_i = 0.0;
      for (size_t k = 0; k < order.size(); ++k) {
        const float* gr = pg + (i * t + order[k]) * d;
        if (k == 0 || id[order[k]] != id[order[k - 1]]) std::fill(row.begin(), row.end(), 0.0);
        s_i += std::sqrt(add_row(row.data(), gr, d));
        if (k + 1 == order.size() || id[order[k + 1]] != id[order[k]]) {
          double sq = 0.0;
          for (int64_t c = 0; c < d; ++c) sq += row[static_cast<size_t>(c)] * row[static_cast<size_t>(c)];
          q_i += sq;
        }
      }
      pq[i] = q_i;
      ps[i] = s_i;
    }
  });
  return {q, s};
}

}  // namespace

namespace row_sums_simd {
bool available() { return cpu_lanes::avx2(); }
}  // namespace row_sums_simd

namespace row_sums_scalar {
double add_row(double* sums, const float* x, int64_t d) {
  return add_entries(sums, d, [x](int64_t k) { return static_cast<double>(x[k]); });
}

double add_rows(double* sums, const float* x, int64_t t, int64_t d) {
  double s = 0.0;
  for (int64_t r = 0; r < t; ++r) s += std::sqrt(add_row(sums, x + r * d, d));
  return s;
}

double add_norm_rows(double* sums, const float* x, const float* g, int64_t t, int64_t d,
                     double eps, bool rms) {
  const double inv_d = d > 0 ? 1.0 / static_cast<double>(d) : 0.0;
  double s = 0.0;
  for (int64_t r = 0; r < t; ++r) {
    const float *xr = x + r * d, *gr = g + r * d;
    const double mean = rms ? 0.0 : sum4(xr, d, 0.0, false) * inv_d;
    const double var = sum4(xr, d, mean, true);
    const double rstd = 1.0 / std::sqrt(var * inv_d + eps);
    s += std::sqrt(add_entries(sums, d, [&](int64_t k) {
      return static_cast<double>(gr[k]) * ((xr[k] - mean) * rstd);
    }));
  }
  return s;
}
}  // namespace row_sums_scalar

TORCH_LIBRARY_IMPL(dpzero, CPU, m) {
  m.impl("_row_sums", &row_sums_cpu);
  m.impl("_norm_row_sums", &norm_row_sums_cpu);
  m.impl("_embedding_rows", &embedding_rows_cpu);
}

}  // namespace dpzero::kernels
