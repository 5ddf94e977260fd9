// src/memory/cpu_tracker.h — live and peak bytes of CPU tensor storage, counted in the allocator
// so that every thread's allocations and frees are seen (what torch.cuda.max_memory_allocated
// is for the CUDA caching allocator).
//
// Note [tracking CPU allocator]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The CPU allocator keeps no statistics. torch's profiler (profile_memory=True) records
// allocations and frees, but only on threads the profiler is enabled on: a tensor allocated by
// the training thread and freed on a Gloo worker thread (the temporaries a Gloo collective holds
// until its work completes, e.g. the input copy of a reduce-scatter, which Gloo implements with an
// all-reduce) is never seen to be freed, and the live-byte curve drifts upward step after step —
// measured on the CPU grid as 3-20 MiB of phantom growth over four steps, different in every run.
//
// The tracker therefore wraps the registered CPU allocator (c10::GetCPUAllocator()) while anyone
// watches: each allocation goes to the wrapped allocator and its size is recorded under its
// pointer; the DataPtr returned carries the tracker's deleter, which — on whichever thread drops
// the last reference — subtracts the size and calls the wrapped allocator's deleter. Counts are
// of storage bytes requested (not allocator slack, not Python objects), from the first watch on:
// tensors allocated before it are invisible, and freeing them changes nothing. A storage
// allocated while watched keeps the tracker's deleter after the last watcher leaves, so live
// bytes stay right across watches.
//
// Watchers (watch/unwatch) each have their own peak, reset independently, so nested measurements
// (a planner profile inside a measured run) do not disturb each other. The wrapped allocator must
// hand out DataPtrs whose context is the data pointer (DefaultCPUAllocator and its profiling
// reporter do); one that does not is left in place and watch() refuses to start.
#pragma once

#include <cstdint>

namespace dpzero::memory {

// Installs the tracker on first use and returns a watcher id whose peak starts at the live bytes
// now. Throws if the registered CPU allocator cannot be wrapped (see the Note).
int64_t watch_cpu();
// Drops watcher `id`; when it was the last, the wrapped allocator is registered again. Throws on
// an unknown id.
void unwatch_cpu(int64_t id);
// Live bytes of storages allocated through the tracker and not yet freed (all threads).
int64_t cpu_live_bytes();
// Most live bytes since watcher `id` started or last reset its peak.
int64_t cpu_peak_bytes(int64_t id);
// Sets watcher `id`'s peak to the live bytes now.
void reset_cpu_peak(int64_t id);

}  // namespace dpzero::memory
