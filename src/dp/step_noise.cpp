// src/dp/step_noise.cpp — noise on a rank's shard through the dpzero::add_noise_runs_ op (or
// its secure twin), one call for all of the shard's coordinate runs.
#include "src/dp/step_noise.h"

#include <cmath>
#include <utility>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

namespace dpzero::dp {

namespace {

using zero::CoordinateRun;

// Adds the noise of `runs` (offsets into `flat`) to `flat` in one op call (Note [noise
// launches] in kernels/cuda/noise_runs.cuh: one CUDA launch per 128 runs).
int64_t add_runs_noise_(at::Tensor& flat, const std::vector<CoordinateRun>& runs, double stddev,
                        const NoiseKey& key, int64_t step) {
  static const auto philox_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpzero::add_noise_runs_", "")
          .typed<at::Tensor&(at::Tensor&, double, int64_t, int64_t, c10::IntArrayRef)>();
  static const auto secure_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpzero::add_secure_noise_runs_", "")
          .typed<at::Tensor&(at::Tensor&, double, c10::IntArrayRef, int64_t, c10::IntArrayRef)>();
  // Runs that continue each other both here and in the global numbering (parameters packed
  // back to back) become one run of the table: the draw of a coordinate depends on its global
  // index only (Note [noise ownership] in privacy/noise.h), so the values are the same.
  std::vector<int64_t> table;  // (local, length, global) triples
  int64_t noised = 0;
  for (const CoordinateRun& run : runs) {
    noised += run.length;
    const size_t n = table.size();
    if (n > 0 && table[n - 3] + table[n - 2] == run.local_offset &&
        table[n - 1] + table[n - 2] == run.global_offset) {
      table[n - 2] += run.length;
      continue;
    }
    table.insert(table.end(), {run.local_offset, run.length, run.global_offset});
  }
  if (table.empty()) return 0;
  if (key.secure) {
    secure_op.call(flat, stddev, key.key, step, table);
  } else {
    philox_op.call(flat, stddev, key.seed, step, table);
  }
  return noised;
}

}  // namespace

int64_t add_shard_noise_(at::Tensor& shard, const UnitLayout& layout, int64_t rank, double stddev,
                         const NoiseKey& key, int64_t step) {
  TORCH_CHECK(shard.dim() == 1 && shard.numel() == layout.shard_numel(),
              "add_shard_noise_: shard must be 1-D with ", layout.shard_numel(),
              " elements (the layout's shard size), got shape ", shard.sizes());
  return add_runs_noise_(shard, layout.runs_for_rank(rank), stddev, key, step);
}

int64_t add_unit_noise_(at::Tensor& full, const UnitLayout& layout, double stddev,
                        const NoiseKey& key, int64_t step) {
  TORCH_CHECK(full.dim() == 1 && full.numel() == layout.padded_numel(),
              "add_unit_noise_: the unit's flat tensor must be 1-D with ", layout.padded_numel(),
              " elements, got shape ", full.sizes());
  return add_runs_noise_(full, layout.runs(), stddev, key, step);
}

StepNoise::StepNoise(double stddev, NoiseKey key, int64_t step)
    : stddev_(stddev), key_(std::move(key)), step_(step) {
  TORCH_CHECK(std::isfinite(stddev_) && stddev_ >= 0.0,
              "noise stddev (sigma * C) must be finite and >= 0, got ", stddev_);
  TORCH_CHECK(step_ >= 0, "noise step (the ledger charge index) must be >= 0, got ", step_);
  TORCH_CHECK(!key_.secure || key_.key.size() == 8, "a secure noise key has 8 32-bit words, got ",
              key_.key.size());
}

void StepNoise::add_(at::Tensor& grad, int64_t /*unit*/, const UnitLayout& layout, int64_t rank,
                     bool whole) {
  if (stddev_ == 0.0) return;
  if (whole) {
    add_unit_noise_(grad, layout, stddev_, key_, step_);
  } else {
    add_shard_noise_(grad, layout, rank, stddev_, key_, step_);
  }
}

}  // namespace dpzero::dp
