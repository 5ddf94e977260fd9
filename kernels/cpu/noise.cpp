// kernels/cpu/noise.cpp — CPU implementation of dpzero::add_noise_ (schema in kernels/ops.cpp).
// The draws come from AVX2 or AVX-512 lanes where the CPU has them (Note [cpu noise lanes] in
// kernels/cpu/noise_simd.h; the dispatch between the two widths is here), from the scalar
// privacy::normal2 otherwise.
#include <algorithm>
#include <atomic>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels/cpu/cpu_lanes.h"
#include "kernels/cpu/noise_simd.h"
#include "kernels/noise_checks.h"
#include "privacy/noise.h"

namespace dpzero::kernels {

namespace noise_simd {
namespace {
std::atomic<bool>& enabled_flag() {
  static std::atomic<bool> enabled{true};
  return enabled;
}
}  // namespace

bool wide_available() { return cpu_lanes::avx512f_dq() && available(); }

bool available() {
  return cpu_lanes::avx2_fma() && enabled_flag().load();
}

bool set_enabled(bool enabled) { return enabled_flag().exchange(enabled); }

void philox_normal_blocks(uint64_t seed, uint32_t step, uint32_t stream, uint64_t first_block,
                          float* z) {
  if (cpu_lanes::avx512f_dq()) {
    philox_normal_blocks_avx512(seed, step, stream, first_block, z);
  } else {
    philox_normal_blocks_avx2(seed, step, stream, first_block, z);
  }
}

void secure_normal_pairs(const uint32_t* key, uint32_t step, uint32_t stream, uint64_t first_pair,
                         double* z) {
  if (cpu_lanes::avx512f_dq()) {
    secure_normal_pairs_avx512(key, step, stream, first_pair, z);
  } else {
    secure_normal_pairs_avx2(key, step, stream, first_pair, z);
  }
}
}  // namespace noise_simd

namespace {

// data[i] += stddev * z(seed, step, offset + i) for i in [0, n), n >= 1: the body of
// add_noise_cpu_ and of each run of add_noise_runs_cpu_ (the same draws either way).
template <typename scalar_t>
void add_philox_noise(scalar_t* data, int64_t n, int64_t offset, uint64_t seed, uint32_t step,
                      float stddev) {
  // Work in Philox blocks of kNoiseLanes global coordinates (Note [noise ownership]); the first
  // and last block may be partial when offset or offset + n is not a multiple of kNoiseLanes.
  constexpr int64_t kLanes = privacy::kNoiseLanes;
  const int64_t first_block = offset / kLanes;
  const int64_t last_block = (offset + n - 1) / kLanes;
  const bool lanes = noise_simd::available();
  // Groups of noise_simd::kBlocks blocks from first_block; on the scalar path a group is drawn
  // block by block. Blocks past last_block in the final group are drawn and not used.
  constexpr int64_t kGroup = noise_simd::kBlocks;
  const int64_t groups = (last_block - first_block) / kGroup + 1;
  at::parallel_for(0, groups, 256, [&](int64_t begin, int64_t end) {
    float z[kGroup * kLanes];
    for (int64_t group = begin; group < end; ++group) {
      const int64_t block0 = first_block + group * kGroup;
      if (lanes) {
        noise_simd::philox_normal_blocks(seed, step, privacy::kNoiseStream,
                                         static_cast<uint64_t>(block0), z);
      } else {
        for (int64_t k = 0; k < kGroup; ++k) {
          privacy::normal2(seed, step, privacy::kNoiseStream, static_cast<uint64_t>(block0 + k),
                           z + k * kLanes);
        }
      }
      // Local indices of the group's coordinates that this tensor holds.
      // (start >= -1: offset may fall inside the first block.)
      const int64_t start = block0 * kLanes - offset;
      const int64_t lo = std::max<int64_t>(0, start);
      const int64_t hi = std::min<int64_t>(n, start + kGroup * kLanes);
      for (int64_t i = lo; i < hi; ++i) {
        const float draw = z[i - start];
        data[i] = static_cast<scalar_t>(static_cast<float>(data[i]) + stddev * draw);
      }
    }
  });
}

at::Tensor& add_noise_cpu_(at::Tensor& self, double stddev, int64_t seed, int64_t step,
                           int64_t offset) {
  check_add_noise_args("dpzero::add_noise_", self, stddev, step, offset);
  const int64_t n = self.numel();
  if (n == 0) return self;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, self.scalar_type(), "add_noise_cpu_", [&] {
    add_philox_noise(self.data_ptr<scalar_t>(), n, offset, static_cast<uint64_t>(seed),
                     static_cast<uint32_t>(step), static_cast<float>(stddev));
  });
  return self;
}

// Note [noise launches] (kernels/cuda/noise_runs.cuh): each run is drawn as add_noise_cpu_ draws
// self[local : local + length] at offset `global`, so the values are the per-run call's bits.
at::Tensor& add_noise_runs_cpu_(at::Tensor& self, double stddev, int64_t seed, int64_t step,
                                c10::IntArrayRef runs) {
  constexpr const char* op = "dpzero::add_noise_runs_";
  check_add_noise_args(op, self, stddev, step, /*offset=*/0);
  const int64_t num_runs = check_noise_runs(op, self, runs);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, self.scalar_type(), "add_noise_runs_cpu_", [&] {
    scalar_t* data = self.data_ptr<scalar_t>();
    for (int64_t r = 0; r < num_runs; ++r) {
      const int64_t local = runs[3 * r], length = runs[3 * r + 1], global = runs[3 * r + 2];
      if (length == 0) continue;
      add_philox_noise(data + local, length, global, static_cast<uint64_t>(seed),
                       static_cast<uint32_t>(step), static_cast<float>(stddev));
    }
  });
  return self;
}

// Tests only: Note [cpu noise lanes] on (where the CPU has them) or off; returns the previous
// setting.
bool set_noise_lanes_op(bool enabled) { return noise_simd::set_enabled(enabled); }

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CPU, m) {
  m.impl("add_noise_", &add_noise_cpu_);
  m.impl("add_noise_runs_", &add_noise_runs_cpu_);
}

// No tensor arguments, so no backend key: CompositeImplicitAutograd serves every call.
TORCH_LIBRARY_IMPL(dpzero, CompositeImplicitAutograd, m) {
  m.impl("_set_noise_lanes", &set_noise_lanes_op);
}

}  // namespace dpzero::kernels
