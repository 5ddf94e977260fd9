// kernels/cpu/secure_noise.cpp — CPU implementation of dpzero::add_secure_noise_ (schema in
// kernels/ops.cpp; the draw is Note [secure noise] in privacy/secure_noise.h).
// The draws come from AVX2 or AVX-512 lanes where the CPU has them (Note [cpu noise lanes] in
// kernels/cpu/noise_simd.h), from the scalar privacy::secure_normal2 otherwise.
#include <algorithm>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels/cpu/noise_simd.h"
#include "kernels/noise_checks.h"
#include "privacy/secure_noise.h"

namespace dpzero::kernels {
namespace {

// data[i] += stddev * z_secure(key, step, offset + i) for i in [0, n), n >= 1: the body of
// add_secure_noise_cpu_ and of each run of add_secure_noise_runs_cpu_.
template <typename scalar_t>
void add_chacha_noise(scalar_t* data, int64_t n, int64_t offset, const privacy::ChaCha20Key& k,
                      uint32_t step, double stddev) {
  // One ChaCha20 block serves a pair of global coordinates (2p, 2p + 1).
  const int64_t first_pair = offset / 2;
  const int64_t last_pair = (offset + n - 1) / 2;
  const bool lanes = noise_simd::available();
  // Groups of noise_simd::kBlocks pairs from first_pair, as in add_noise_cpu_.
  constexpr int64_t kGroup = noise_simd::kBlocks;
  const int64_t groups = (last_pair - first_pair) / kGroup + 1;
  at::parallel_for(0, groups, 64, [&](int64_t begin, int64_t end) {
    double z[kGroup * 2];
    for (int64_t group = begin; group < end; ++group) {
      const int64_t pair0 = first_pair + group * kGroup;
      if (lanes) {
        noise_simd::secure_normal_pairs(k.w, step, privacy::kNoiseStream,
                                        static_cast<uint64_t>(pair0), z);
      } else {
        for (int64_t p = 0; p < kGroup; ++p) {
          privacy::secure_normal2(k, step, static_cast<uint64_t>(pair0 + p), z + 2 * p);
        }
      }
      const int64_t start = pair0 * 2 - offset;  // >= -1
      const int64_t lo = std::max<int64_t>(0, start);
      const int64_t hi = std::min<int64_t>(n, start + kGroup * 2);
      for (int64_t i = lo; i < hi; ++i) {
        const double draw = z[i - start];
        data[i] = static_cast<scalar_t>(static_cast<double>(data[i]) + stddev * draw);
      }
    }
  });
}

at::Tensor& add_secure_noise_cpu_(at::Tensor& self, double stddev, c10::IntArrayRef key,
                                  int64_t step, int64_t offset) {
  check_add_noise_args("dpzero::add_secure_noise_", self, stddev, step, offset, /*allow_double=*/true);
  const privacy::ChaCha20Key k = secure_key_from(key);
  const int64_t n = self.numel();
  if (n == 0) return self;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, self.scalar_type(), "add_secure_noise_cpu_", [&] {
    add_chacha_noise(self.data_ptr<scalar_t>(), n, offset, k, static_cast<uint32_t>(step), stddev);
  });
  return self;
}

// Note [noise launches] (kernels/cuda/noise_runs.cuh): each run drawn as add_secure_noise_cpu_
// draws self[local : local + length] at offset `global`.
at::Tensor& add_secure_noise_runs_cpu_(at::Tensor& self, double stddev, c10::IntArrayRef key,
                                       int64_t step, c10::IntArrayRef runs) {
  constexpr const char* op = "dpzero::add_secure_noise_runs_";
  check_add_noise_args(op, self, stddev, step, /*offset=*/0, /*allow_double=*/true);
  const privacy::ChaCha20Key k = secure_key_from(key, op);
  const int64_t num_runs = check_noise_runs(op, self, runs);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, self.scalar_type(), "add_secure_noise_runs_cpu_", [&] {
    scalar_t* data = self.data_ptr<scalar_t>();
    for (int64_t r = 0; r < num_runs; ++r) {
      const int64_t local = runs[3 * r], length = runs[3 * r + 1], global = runs[3 * r + 2];
      if (length == 0) continue;
      add_chacha_noise(data + local, length, global, k, static_cast<uint32_t>(step), stddev);
    }
  });
  return self;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CPU, m) {
  m.impl("add_secure_noise_", &add_secure_noise_cpu_);
  m.impl("add_secure_noise_runs_", &add_secure_noise_runs_cpu_);
}

}  // namespace dpzero::kernels
