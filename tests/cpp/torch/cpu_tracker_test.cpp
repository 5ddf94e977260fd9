// tests/cpp/torch/cpu_tracker_test.cpp — the tracking CPU allocator (Note [tracking CPU
// allocator] in src/memory/cpu_tracker.h): exact byte counts against tensors of known size, frees
// on other threads, independent watchers, and uninstalling.
#include <gtest/gtest.h>

#include <thread>

#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include "src/memory/cpu_tracker.h"

namespace dpzero::memory {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(CpuTracker, CountsTensorsOfKnownSize) {
  const int64_t id = watch_cpu();
  const int64_t start = cpu_live_bytes();
  {
    at::Tensor a = at::empty({kMiB}, at::kFloat);   // 4 MiB
    at::Tensor b = at::empty({kMiB / 2}, at::kDouble);  // 4 MiB
    EXPECT_EQ(cpu_live_bytes() - start, 8 * kMiB);
  }
  at::Tensor c = at::empty({kMiB / 4}, at::kFloat);  // 1 MiB, kept
  EXPECT_EQ(cpu_live_bytes() - start, kMiB);
  EXPECT_EQ(cpu_peak_bytes(id) - start, 8 * kMiB);
  c.reset();
  EXPECT_EQ(cpu_live_bytes(), start);
  unwatch_cpu(id);
}

TEST(CpuTracker, SeesFreesOnOtherThreads) {
  // The case the profiler misses: allocated here, last reference dropped on another thread.
  const int64_t id = watch_cpu();
  const int64_t start = cpu_live_bytes();
  at::Tensor t = at::ones({kMiB}, at::kFloat);
  EXPECT_EQ(cpu_live_bytes() - start, 4 * kMiB);
  std::thread other([moved = std::move(t)]() mutable { moved.reset(); });
  other.join();
  EXPECT_EQ(cpu_live_bytes(), start);
  // ... and allocations made on other threads.
  std::thread maker([] { at::Tensor x = at::empty({kMiB}, at::kFloat); });
  maker.join();
  EXPECT_EQ(cpu_peak_bytes(id) - start, 4 * kMiB);
  EXPECT_EQ(cpu_live_bytes(), start);
  unwatch_cpu(id);
}

TEST(CpuTracker, WatchersKeepTheirOwnPeaks) {
  const int64_t outer = watch_cpu();
  const int64_t start = cpu_live_bytes();
  { at::Tensor big = at::empty({2 * kMiB}, at::kFloat); }  // 8 MiB, freed
  const int64_t inner = watch_cpu();
  { at::Tensor small = at::empty({kMiB / 4}, at::kFloat); }  // 1 MiB, freed
  EXPECT_EQ(cpu_peak_bytes(inner) - start, kMiB);
  EXPECT_EQ(cpu_peak_bytes(outer) - start, 8 * kMiB);
  reset_cpu_peak(outer);
  EXPECT_EQ(cpu_peak_bytes(outer), cpu_live_bytes());
  unwatch_cpu(inner);
  EXPECT_THROW(cpu_peak_bytes(inner), c10::Error);
  unwatch_cpu(outer);
}

TEST(CpuTracker, UninstallsAndStillCountsFreesOfTrackedStorages) {
  c10::Allocator* before = c10::GetCPUAllocator();
  const int64_t id = watch_cpu();
  EXPECT_NE(c10::GetCPUAllocator(), before);
  const int64_t start = cpu_live_bytes();
  at::Tensor kept = at::empty({kMiB}, at::kFloat);
  unwatch_cpu(id);
  EXPECT_EQ(c10::GetCPUAllocator(), before);
  EXPECT_EQ(cpu_live_bytes() - start, 4 * kMiB);
  kept.reset();  // freed through the tracker's deleter after it was uninstalled
  EXPECT_EQ(cpu_live_bytes(), start);
  at::Tensor untracked = at::empty({kMiB}, at::kFloat);
  EXPECT_EQ(cpu_live_bytes(), start);
  EXPECT_THROW(unwatch_cpu(id), c10::Error);
}

}  // namespace
}  // namespace dpzero::memory
