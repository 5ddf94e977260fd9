// kernels/cpu/per_sample_sum.cpp — CPU implementation of dpzero::add_per_sample_clipped_sum_
// and of its list form _add_per_sample_clipped_sums_, pair by pair (schemas in kernels/ops.cpp;
// the CUDA ones are in kernels/cuda/per_sample_sum.cu): self[j] += float32(sum_i c_i grads[i, j])
// over the kept samples, in the order of Note [kept sums in chunks] (kernels/per_sample_sum.h),
// each product and addition rounded once (built with -ffp-contract=off, as the CUDA kernels round
// explicitly), so both give the same bits. Entries split over the threads; an entry's sum does
// not depend on the split.
#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels/per_sample_checks.h"
#include "kernels/per_sample_sum.h"
#include "kernels/sample_products_checks.h"

namespace dpzero::kernels {
namespace {

constexpr int64_t kEntriesPerTask = 4096;

// out [d] += the sums of grads [b, d] (contiguous) under scale [b].
template <typename scalar_t>
void add_sums(float* out, const scalar_t* grads, const float* scale, int64_t b, int64_t d) {
  at::parallel_for(0, d, kEntriesPerTask, [&](int64_t j0, int64_t j1) {
    const auto n = static_cast<size_t>(j1 - j0);
    std::vector<double> total(n, 0.0), part(n);
    for (int64_t k = 0; k < per_sample_sum::chunks(b); ++k) {
      std::fill(part.begin(), part.end(), 0.0);
      const int64_t i1 = std::min(b, (k + 1) * per_sample_sum::kSamplesPerChunk);
      for (int64_t i = k * per_sample_sum::kSamplesPerChunk; i < i1; ++i) {
        if (!sample_products::adds(scale[i])) continue;
        const double c = scale[i];
        const scalar_t* row = grads + i * d + j0;
        for (size_t j = 0; j < n; ++j) part[j] += c * static_cast<double>(row[j]);
      }
      for (size_t j = 0; j < n; ++j) total[j] += part[j];
    }
    for (size_t j = 0; j < n; ++j) out[j0 + j] = out[j0 + j] + static_cast<float>(total[j]);
  });
}

// One pair, its arguments checked.
void add_checked(const at::Tensor& self, const at::Tensor& grads, const at::Tensor& s) {
  const at::Tensor g = grads.contiguous();
  at::Tensor out = per_sample_sum::accumulator(self);
  const int64_t b = g.size(0), d = out.numel();
  if (g.scalar_type() == at::kDouble) {
    add_sums(out.data_ptr<float>(), g.data_ptr<double>(), s.data_ptr<float>(), b, d);
  } else {
    add_sums(out.data_ptr<float>(), g.data_ptr<float>(), s.data_ptr<float>(), b, d);
  }
  at::Tensor target = self;
  per_sample_sum::written_back(target, out);
}

at::Tensor& add_per_sample_clipped_sum_cpu_(at::Tensor& self, const at::Tensor& grads,
                                            const at::Tensor& scale) {
  check_add_per_sample_clipped_sum(self, grads, scale);
  add_checked(self, grads, scale.contiguous());
  return self;
}

void add_per_sample_clipped_sums_cpu_(at::TensorList self, at::TensorList grads,
                                      const at::Tensor& scale) {
  check_add_per_sample_clipped_sums(self, grads, scale);  // every pair before any is written
  const at::Tensor s = scale.contiguous();
  for (size_t k = 0; k < self.size(); ++k) add_checked(self[k], grads[k], s);
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CPU, m) {
  m.impl("add_per_sample_clipped_sum_", &add_per_sample_clipped_sum_cpu_);
  m.impl("_add_per_sample_clipped_sums_", &add_per_sample_clipped_sums_cpu_);
}

}  // namespace dpzero::kernels
