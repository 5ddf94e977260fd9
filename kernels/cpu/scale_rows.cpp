// kernels/cpu/scale_rows.cpp — CPU implementation of dpzero::_scale_rows (schema in
// kernels/ops.cpp): one pass that writes each row of x times its sample's factor, or as it is,
// and a dropped sample's row (factor 0 or non-finite) as zeros, never multiplied by 0 (which
// would keep a NaN). Samples split over the threads.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels/certify_checks.h"

namespace dpzero::kernels {
namespace {

template <typename scalar_t>
void scale_rows_loop(const scalar_t* x, const float* scale, scalar_t* out, int64_t b, int64_t n,
                     bool multiply) {
  at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float f = scale[i];
      const scalar_t* xi = x + i * n;
      scalar_t* oi = out + i * n;
      if (!std::isfinite(f) || f == 0.0f) {
        std::fill(oi, oi + n, scalar_t(0));
      } else if (multiply) {
        const auto c = static_cast<scalar_t>(f);  // exact: a float32 in float32 or float64
        for (int64_t j = 0; j < n; ++j) oi[j] = xi[j] * c;
      } else {
        std::copy(xi, xi + n, oi);
      }
    }
  });
}

at::Tensor scale_rows_cpu(const at::Tensor& x, const at::Tensor& scale, bool multiply) {
  certify::check_scale_rows(x, scale);
  const at::Tensor xc = x.contiguous(), s = scale.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t b = xc.size(0), n = b == 0 ? 0 : xc.numel() / b;
  if (xc.scalar_type() == at::kDouble) {
    scale_rows_loop(xc.data_ptr<double>(), s.data_ptr<float>(), out.data_ptr<double>(), b, n,
                    multiply);
  } else {
    scale_rows_loop(xc.data_ptr<float>(), s.data_ptr<float>(), out.data_ptr<float>(), b, n,
                    multiply);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CPU, m) { m.impl("_scale_rows", &scale_rows_cpu); }

}  // namespace dpzero::kernels
