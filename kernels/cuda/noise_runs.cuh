// kernels/cuda/noise_runs.cuh — the coordinate-run table that the CUDA noise kernels
// (kernels/cuda/noise.cu, kernels/cuda/secure_noise.cu) take by value, and the launch geometry
// they share.
//
// Note [noise launches]
// ~~~~~~~~~~~~~~~~~~~~~
// A rank's shard of a unit holds its global coordinates as a few runs, one per parameter (fewer
// where parameters sit back to back in both numberings, src/dp/step_noise.cpp merges those).
// One launch per run cost a kernel launch (~3-5 µs of host time on the step's critical path) for
// every parameter of every unit, while the draws themselves are microseconds at most for the
// small runs (biases, norms). dpzero::add_noise_runs_ / add_secure_noise_runs_ (schemas in
// kernels/ops.cpp) take the runs' table, (local, length, global) triples, and draw all of them
// in one launch per kNoiseRunsPerLaunch runs: the table rides in the kernel's parameter space
// (__grid_constant__, so threads read it in place, no device copy, no allocation, no host
// sync), block row blockIdx.y serves run blockIdx.y, and its blocks grid-stride over the run's
// draw blocks exactly as the one-run kernel did. A run's values are the per-run call's: the draw
// of a coordinate is a pure function of (seed or key, step, global index) (Note [noise ownership]
// in privacy/noise.h), and each run is drawn with the same per-thread code, on the same device.
// The single-offset ops add_noise_ / add_secure_noise_ are the one-run table (0, numel, offset).
// The CPU implementations draw run after run with the one-run code (kernels/cpu/noise.cpp,
// kernels/cpu/secure_noise.cpp). Runs are disjoint in self (kernels/noise_checks.h checks it), so
// no element is drawn twice and nothing outside the runs (padding) is touched.
#pragma once

#include <algorithm>
#include <cstdint>

#include <ATen/cuda/CUDAContext.h>
#include <c10/util/ArrayRef.h>

namespace dpzero::kernels {

// 128 runs x 3 int64 = 3 KiB: with the other arguments, under the 4 KiB of kernel parameters that
// every architecture and driver accepts.
constexpr int kNoiseRunsPerLaunch = 128;

// Up to kNoiseRunsPerLaunch runs of one launch; entries [0, count) are set, all with length >= 1.
struct NoiseRuns {
  int64_t local[kNoiseRunsPerLaunch];   // first element of run r in self
  int64_t length[kNoiseRunsPerLaunch];  // its element count
  int64_t global[kNoiseRunsPerLaunch];  // the global coordinate of its first element
  int count = 0;
};

// Calls launch(table, max_length) for each batch of up to kNoiseRunsPerLaunch non-empty runs of
// the checked flat table runs [3 R] (triples (local, length, global)), in order.
template <typename Launch>
void for_each_noise_run_batch(c10::IntArrayRef runs, Launch&& launch) {
  NoiseRuns table;
  int64_t max_length = 0;
  for (size_t r = 0; r < runs.size() / 3; ++r) {
    const int64_t length = runs[3 * r + 1];
    if (length == 0) continue;
    table.local[table.count] = runs[3 * r];
    table.length[table.count] = length;
    table.global[table.count] = runs[3 * r + 2];
    ++table.count;
    max_length = std::max(max_length, length);
    if (table.count == kNoiseRunsPerLaunch) {
      launch(table, max_length);
      table.count = 0;
      max_length = 0;
    }
  }
  if (table.count > 0) launch(table, max_length);
}

constexpr int kNoiseThreads = 256;

// grid = (blocks per run, runs): enough blocks of kNoiseThreads threads for the longest run's
// `max_units` draw units (Philox blocks or ChaCha20 pairs), at most ~32 blocks per SM over all
// runs; every kernel grid-strides, so any grid.x >= 1 draws every unit once.
inline dim3 noise_grid(int64_t max_units, int count) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t cap = std::max<int64_t>(1, sms * 32 / count);
  const int64_t wanted = (max_units + kNoiseThreads - 1) / kNoiseThreads;
  return dim3(static_cast<unsigned>(std::clamp<int64_t>(wanted, 1, cap)),
              static_cast<unsigned>(count));
}

}  // namespace dpzero::kernels
