// kernels/cpu/rank_one.cpp — see rank_one.h (Note [rank-one ghost] in kernels/per_sample_checks.h).
#include "kernels/cpu/rank_one.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

namespace dpzero::kernels {
namespace {

// out[i] = sum_k x[i, 0, k]^2 in float64 for x [B, 1, d]: each square is exact (a float32 /
// bfloat16 / float16 value squared fits float64's significand), the d squares are added in four
// interleaved partial sums (an order like any other for the gamma_d bound of Note [rank-one
// ghost]).
void row_sq_norms(const at::Tensor& x, double* out) {
  const at::Tensor xc = x.reshape({x.size(0), x.size(2)}).contiguous();  // [B, d]
  const int64_t b = xc.size(0), d = xc.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "rank_one_values", [&] {
    const scalar_t* p = xc.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, d));
    at::parallel_for(0, b, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* row = p + i * d;
        double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
        int64_t k = 0;
        for (; k + 4 <= d; k += 4) {
          const double x0 = static_cast<double>(row[k]);
          const double x1 = static_cast<double>(row[k + 1]);
          const double x2 = static_cast<double>(row[k + 2]);
          const double x3 = static_cast<double>(row[k + 3]);
          s0 += x0 * x0;
          s1 += x1 * x1;
          s2 += x2 * x2;
          s3 += x3 * x3;
        }
        for (; k < d; ++k) {
          const double xk = static_cast<double>(row[k]);
          s0 += xk * xk;
        }
        out[i] = (s0 + s1) + (s2 + s3);
      }
    });
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rank_one_values(const at::Tensor& a, const at::Tensor& ids,
                                                   int64_t pad, at::TensorList gs) {
  const int64_t n_layers = static_cast<int64_t>(gs.size());
  const int64_t b = gs.empty() ? 0 : gs[0].size(0);
  const at::TensorOptions f64 = at::TensorOptions().dtype(at::kDouble);
  at::Tensor value = at::empty({n_layers, b}, f64);
  at::Tensor norms = at::empty({n_layers, b}, f64);
  at::Tensor qa = at::empty({b}, f64), qg = at::empty({b}, f64);
  const bool tokens = !a.defined();
  if (!tokens) row_sq_norms(a, qa.data_ptr<double>());
  const at::Tensor id = tokens ? ids.reshape({b}).contiguous() : at::Tensor();
  for (int64_t l = 0; l < n_layers; ++l) {
    row_sq_norms(gs[static_cast<size_t>(l)], qg.data_ptr<double>());
    const double* pa = qa.data_ptr<double>();
    const double* pg = qg.data_ptr<double>();
    double* pv = value.data_ptr<double>() + l * b;
    double* ps = norms.data_ptr<double>() + l * b;
    for (int64_t i = 0; i < b; ++i) {
      if (tokens) {
        // A select: a padding token's G row may hold anything, NaN included.
        const bool kept = id.data_ptr<int64_t>()[i] != pad;
        pv[i] = kept ? pg[i] : 0.0;
        ps[i] = kept ? std::sqrt(pg[i]) : 0.0;
      } else {
        pv[i] = pa[i] * pg[i];
        ps[i] = std::sqrt(pv[i]);
      }
    }
  }
  return {value, norms};
}

}  // namespace dpzero::kernels
