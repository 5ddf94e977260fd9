// src/memory/cpu_tracker.cpp — the tracking wrapper around the CPU allocator (Note [tracking CPU
// allocator] in cpu_tracker.h).
#include "src/memory/cpu_tracker.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

namespace dpzero::memory {
namespace {

struct Entry {
  size_t bytes;
  c10::DeleterFnPtr deleter;  // the wrapped allocator's deleter for this pointer
};

// Never destroyed: storages allocated through the tracker may be freed during interpreter
// shutdown, after static destructors have run.
struct State {
  std::mutex mutex;
  std::unordered_map<void*, Entry> entries;
  int64_t live = 0;
  std::map<int64_t, int64_t> peaks;  // watcher id -> peak live bytes
  int64_t next_id = 0;
  bool installed = false;
  // The allocator the tracker forwards to: the one registered when it was installed. Kept after
  // uninstalling, since a thread may still be inside TrackingAllocator::allocate then.
  std::atomic<c10::Allocator*> wrapped{nullptr};
};

State& state() {
  static State* s = new State;
  return *s;
}

// The deleter of every DataPtr the tracker hands out, and its raw_deleter(). Code that frees raw
// allocations through the registered allocator's raw_deleter() may pass null, or a pointer the
// wrapped allocator made before the tracker was installed: those go to the wrapped allocator.
void tracked_delete(void* data) {
  if (data == nullptr) return;
  State& s = state();
  c10::DeleterFnPtr deleter = nullptr;
  bool ours = false;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.entries.find(data);
    if (it != s.entries.end()) {
      ours = true;
      deleter = it->second.deleter;
      s.live -= static_cast<int64_t>(it->second.bytes);
      s.entries.erase(it);
    }
  }
  if (!ours) {
    c10::Allocator* wrapped = s.wrapped.load();
    deleter = wrapped != nullptr ? wrapped->raw_deleter() : nullptr;
    TORCH_INTERNAL_ASSERT(deleter != nullptr, "dpzero cpu tracker: freeing ", data,
                          ", which neither it nor the wrapped allocator can free");
  }
  if (deleter != nullptr) deleter(data);
}

class TrackingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    State& s = state();
    c10::Allocator* inner = s.wrapped.load();
    TORCH_INTERNAL_ASSERT(inner != nullptr, "dpzero cpu tracker: allocate before install");
    c10::DataPtr dp = inner->allocate(nbytes);
    void* data = dp.get();
    if (data == nullptr) return dp;  // zero bytes: nothing to count
    TORCH_INTERNAL_ASSERT(dp.get_context() == data,
                          "dpzero cpu tracker: the wrapped allocator's context is not its data");
    const c10::DeleterFnPtr deleter = dp.get_deleter();
    const c10::Device device = dp.device();
    dp.release_context();  // ownership passes to the entry below
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      auto [it, fresh] = s.entries.try_emplace(data, Entry{nbytes, deleter});
      if (!fresh) {
        // The wrapped allocator handed out this address again, so the storage recorded under it
        // was freed without the tracker's deleter (a raw allocation freed through the wrapped
        // allocator's raw_deleter() after an uninstall): stop counting it.
        s.live -= static_cast<int64_t>(it->second.bytes);
        it->second = Entry{nbytes, deleter};
      }
      s.live += static_cast<int64_t>(nbytes);
      for (auto& [id, peak] : s.peaks) peak = std::max(peak, s.live);
    }
    return {data, data, &tracked_delete, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &tracked_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

TrackingAllocator& tracker() {
  static TrackingAllocator* t = new TrackingAllocator;
  return *t;
}

}  // namespace

int64_t watch_cpu() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.installed) {
    c10::Allocator* current = c10::GetCPUAllocator();
    // Probe the wrapped allocator's DataPtr shape before installing (Note [tracking CPU
    // allocator]: the context must be the data pointer).
    {
      c10::DataPtr probe = current->allocate(64);
      TORCH_CHECK(probe.get() != nullptr && probe.get_context() == probe.get(),
                  "dpzero: the registered CPU allocator cannot be tracked (its DataPtr context is "
                  "not its data pointer)");
    }
    s.wrapped.store(current);
    c10::SetCPUAllocator(&tracker(), /*priority=*/0);
    if (c10::GetCPUAllocator() != &tracker()) {
      TORCH_CHECK(false, "dpzero: could not register the tracking CPU allocator (another "
                  "allocator was registered with a higher priority)");
    }
    s.installed = true;
  }
  const int64_t id = s.next_id++;
  s.peaks[id] = s.live;
  return id;
}

void unwatch_cpu(int64_t id) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(s.peaks.erase(id) == 1, "dpzero: no CPU memory watcher with id ", id);
  if (s.peaks.empty() && s.installed) {
    // Only if nobody registered another allocator over the tracker meanwhile.
    if (c10::GetCPUAllocator() == &tracker()) c10::SetCPUAllocator(s.wrapped.load(), 0);
    s.installed = false;
  }
}

int64_t cpu_live_bytes() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.live;
}

int64_t cpu_peak_bytes(int64_t id) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.peaks.find(id);
  TORCH_CHECK(it != s.peaks.end(), "dpzero: no CPU memory watcher with id ", id);
  return it->second;
}

void reset_cpu_peak(int64_t id) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.peaks.find(id);
  TORCH_CHECK(it != s.peaks.end(), "dpzero: no CPU memory watcher with id ", id);
  it->second = s.live;
}

}  // namespace dpzero::memory
