// tests/cpp/torch/ranks.h — ranks as threads for the multi-rank GoogleTests: each thread gets a
// real Gloo process group made by comm::make_process_group over one shared HashStore (Note [gloo
// headers] in src/comm/process_group.h), the same groups C++ callers use.
#pragma once

#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "src/comm/process_group.h"

namespace dpzero::testing {

// c10d's flight recorder is one per process and its bookkeeping is not safe against several
// process groups enqueueing at once, which is what ranks as threads do (a real run has one group
// per process): a race in FlightRecorder::recordWithResetEnabled crashed these tests now and then.
// A buffer size of 0 turns the recorder off; it reads the variable once, when first used, so it
// is set before main() runs.
[[maybe_unused]] inline const bool kFlightRecorderOff = [] {
  setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0);
  return true;
}();

// Runs body(rank, its process group) on `world_size` threads; an exception on any rank fails the
// test, naming the rank. `timeout`: the groups' collective timeout.
inline void run_ranks(
    int world_size, std::chrono::milliseconds timeout,
    const std::function<void(int, c10::intrusive_ptr<c10d::ProcessGroup>)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  std::vector<std::string> errors(world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        body(rank, comm::make_process_group("gloo", store, rank, world_size, timeout));
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int rank = 0; rank < world_size; ++rank) EXPECT_EQ(errors[rank], "") << "rank " << rank;
}

}  // namespace dpzero::testing
