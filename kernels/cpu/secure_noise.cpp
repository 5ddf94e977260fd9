// kernels/cpu/secure_noise.cpp — CPU implementation of dpzero::add_secure_noise_ (schema in
// kernels/ops.cpp; the draw is Note [secure noise] in privacy/secure_noise.h).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels/noise_checks.h"
#include "privacy/secure_noise.h"

namespace dpzero::kernels {
namespace {

at::Tensor& add_secure_noise_cpu_(at::Tensor& self, double stddev, c10::IntArrayRef key,
                                  int64_t step, int64_t offset) {
  check_add_noise_args("dpzero::add_secure_noise_", self, stddev, step, offset, /*allow_double=*/true);
  const privacy::ChaCha20Key k = secure_key_from(key);
  const int64_t n = self.numel();
  if (n == 0) return self;
  const auto ustep = static_cast<uint32_t>(step);
  // One ChaCha20 block serves a pair of global coordinates (2p, 2p + 1).
  const int64_t first_pair = offset / 2;
  const int64_t last_pair = (offset + n - 1) / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, self.scalar_type(), "add_secure_noise_cpu_", [&] {
    scalar_t* data = self.data_ptr<scalar_t>();
    at::parallel_for(first_pair, last_pair + 1, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t pair = begin; pair < end; ++pair) {
        double z[2];
        privacy::secure_normal2(k, ustep, static_cast<uint64_t>(pair), z);
        for (int lane = 0; lane < 2; ++lane) {
          const int64_t i = pair * 2 + lane - offset;
          if (i < 0 || i >= n) continue;
          data[i] = static_cast<scalar_t>(static_cast<double>(data[i]) + stddev * z[lane]);
        }
      }
    });
  });
  return self;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CPU, m) { m.impl("add_secure_noise_", &add_secure_noise_cpu_); }

}  // namespace dpzero::kernels
