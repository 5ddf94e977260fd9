// kernels/cpu/noise.cpp — CPU implementation of dpzero::add_noise_ (schema in kernels/ops.cpp).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels/noise_checks.h"
#include "privacy/noise.h"

namespace dpzero::kernels {
namespace {

at::Tensor& add_noise_cpu_(at::Tensor& self, double stddev, int64_t seed, int64_t step,
                           int64_t offset) {
  check_add_noise_args("dpzero::add_noise_", self, stddev, step, offset);
  const int64_t n = self.numel();
  if (n == 0) return self;
  const auto useed = static_cast<uint64_t>(seed);
  const auto ustep = static_cast<uint32_t>(step);
  const float fstddev = static_cast<float>(stddev);
  // Work in Philox blocks of kNoiseLanes global coordinates (Note [noise ownership]); the first
  // and last block may be partial when offset or offset + n is not a multiple of kNoiseLanes.
  constexpr int64_t kLanes = privacy::kNoiseLanes;
  const int64_t first_block = offset / kLanes;
  const int64_t last_block = (offset + n - 1) / kLanes;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, self.scalar_type(), "add_noise_cpu_", [&] {
    scalar_t* data = self.data_ptr<scalar_t>();
    at::parallel_for(first_block, last_block + 1, 2048, [&](int64_t begin, int64_t end) {
      for (int64_t block = begin; block < end; ++block) {
        float z[kLanes];
        privacy::normal2(useed, ustep, privacy::kNoiseStream, static_cast<uint64_t>(block), z);
        for (int64_t lane = 0; lane < kLanes; ++lane) {
          const int64_t i = block * kLanes + lane - offset;  // local index
          if (i < 0 || i >= n) continue;
          data[i] = static_cast<scalar_t>(static_cast<float>(data[i]) + fstddev * z[lane]);
        }
      }
    });
  });
  return self;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CPU, m) { m.impl("add_noise_", &add_noise_cpu_); }

}  // namespace dpzero::kernels
