// kernels/cpu/embedding_sums.cpp — CPU implementation of dpzero::_add_embedding_sums_ (schema in
// kernels/ops.cpp; the CUDA one is kernels/cuda/embedding_sums.cu): the sums of Note [embedding
// sums] (kernels/embedding_sums.h), each product and addition rounded once (built with
// -ffp-contract=off, as the CUDA kernels round explicitly), so both give the same bits. Each
// sample's tokens are sorted once; then the columns split over the threads, and a column's sums do
// not depend on the split.
#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels/embedding_sums.h"
#include "kernels/per_sample_sum.h"
#include "kernels/sample_products_checks.h"

namespace dpzero::kernels {
namespace {

constexpr int64_t kColumnsPerTask = 64;

// Each kept sample's non-padding tokens as positions sorted by (id, position): tokens[i T, i T +
// count[i]). Refuses an id outside [0, V) (Note [embedding sums]).
void sort_tokens(const int64_t* ids, const float* scale, int64_t b, int64_t t, int64_t v,
                 int64_t pad, std::vector<int64_t>& tokens, std::vector<int64_t>& count) {
  for (int64_t i = 0; i < b; ++i) {
    if (!sample_products::adds(scale[i])) continue;
    const int64_t* id = ids + i * t;
    int64_t* first = tokens.data() + i * t;
    int64_t n = 0;
    for (int64_t k = 0; k < t; ++k) {
      TORCH_CHECK(id[k] == pad || (id[k] >= 0 && id[k] < v), "dpzero::_add_embedding_sums_: ids "
                  "must be in [0, V) = [0, ", v, "), got ", id[k], " (sample ", i, ", token ", k,
                  ")");
      if (id[k] != pad) first[n++] = k;
    }
    std::stable_sort(first, first + n, [&](int64_t x, int64_t y) { return id[x] < id[y]; });
    count[static_cast<size_t>(i)] = n;
  }
}

template <typename scalar_t>
void add_sums(float* out, const int64_t* ids, const scalar_t* g, const float* scale, int64_t b,
              int64_t t, int64_t d, const std::vector<int64_t>& tokens,
              const std::vector<int64_t>& count) {
  at::parallel_for(0, d, kColumnsPerTask, [&](int64_t j0, int64_t j1) {
    const auto w = static_cast<size_t>(j1 - j0);
    std::vector<float> run(w);
    for (int64_t i = 0; i < b; ++i) {
      const float c = scale[i];
      if (!sample_products::adds(c)) continue;
      const int64_t* id = ids + i * t;
      const int64_t* tok = tokens.data() + i * t;
      const int64_t n = count[static_cast<size_t>(i)];
      for (int64_t k = 0; k < n;) {
        const int64_t v = id[tok[k]];
        std::fill(run.begin(), run.end(), 0.0f);
        for (; k < n && id[tok[k]] == v; ++k) {
          const scalar_t* row = g + (i * t + tok[k]) * d + j0;
          for (size_t j = 0; j < w; ++j) run[j] = run[j] + c * static_cast<float>(row[j]);
        }
        float* dest = out + v * d + j0;
        for (size_t j = 0; j < w; ++j) dest[j] = dest[j] + run[j];
      }
    }
  });
}

at::Tensor& add_embedding_sums_cpu_(at::Tensor& self, const at::Tensor& ids_in,
                                    const at::Tensor& g_in, const at::Tensor& scale_in,
                                    int64_t pad) {
  embedding_sums::check_args(self, ids_in, g_in, scale_in, pad);
  const at::Tensor ids = ids_in.contiguous(), g = g_in.contiguous(), scale = scale_in.contiguous();
  at::Tensor out = per_sample_sum::accumulator(self);
  const int64_t b = g.size(0), t = g.size(1), d = g.size(2), v = out.size(0);
  std::vector<int64_t> tokens(static_cast<size_t>(b * t)), count(static_cast<size_t>(b), 0);
  sort_tokens(ids.data_ptr<int64_t>(), scale.data_ptr<float>(), b, t, v, pad, tokens, count);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "add_embedding_sums",
                                  [&] {
                                    add_sums(out.data_ptr<float>(), ids.data_ptr<int64_t>(),
                                             g.data_ptr<scalar_t>(), scale.data_ptr<float>(), b,
                                             t, d, tokens, count);
                                  });
  return per_sample_sum::written_back(self, out);
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CPU, m) {
  m.impl("_add_embedding_sums_", &add_embedding_sums_cpu_);
}

}  // namespace dpzero::kernels
