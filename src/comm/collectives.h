// src/comm/collectives.h — the engine's collectives over one c10d process group (design.md §1,
// `comm/`): sum reductions, gathers and a broadcast, each blocking until done.
//
// Note [sum collectives]
// ~~~~~~~~~~~~~~~~~~~~~~
// Every reduction the engine issues is a SUM, never an average: the private step reduces sums of
// clipped per-example gradients and divides by the expected batch size q·N once, after the noise
// (design.md §2 steps 4–6), and a mean inside the collective would divide by W as well. Whatever
// scaling a caller wants is applied explicitly to the reduced shard (ZeroState's grad_scale), so
// the factor is visible at one place and never hidden in the communication.
//
// The process group comes from Python (torch.distributed's default group, passed through torch's
// own pybind11 caster for c10::intrusive_ptr<c10d::ProcessGroup>) or from a C++ caller. A null
// group means one process without torch.distributed: world size 1, every collective a copy.
//
// Note [work references]
// ~~~~~~~~~~~~~~~~~~~~~~
// A c10d Work keeps the tensors it was given, and with Gloo the worker thread that ran it may drop
// the last reference to the Work after wait() has returned to us. If one of those TensorImpls
// ever had a Python object (the engine returns gathered tensors to Python, and tests expose its
// buffers), destroying it decrefs that object, which needs the GIL — from a Gloo thread, possibly
// while the interpreter is finalizing, where taking the GIL ends the thread and std::terminate
// aborts the process (seen as a rare SIGABRT at exit). So every tensor handed to c10d here is a
// fresh TensorImpl on the same storage (storage_alias), which no Python object has ever wrapped:
// the bytes are shared, the last reference a worker drops is C++-only.
//
// Note [collective failures]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A peer rank that died (its sockets closed) or hangs past the process group's timeout shows up
// as an exception from c10d's Work::wait(), worded by the transport ("Connection reset by peer",
// "Timed out waiting 600000ms for recv operation") and silent on what dpzero was doing. Every wait
// of the engine goes through comm::wait(), which rethrows it as a c10::DistBackendError saying
// which collective failed on which rank and the likely cause, the transport's text kept. The
// timeout is the group's: torch.distributed.init_process_group(timeout=...), or
// dpzero.new_process_group(timeout_s=...).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace dpzero::comm {

// work.wait(), with a failure rethrown as Note [collective failures] says; `what` names the
// collective and the rank ("reduce-scatter of unit 'blocks.0' on rank 1 of 2").
void wait(c10d::Work& work, const std::string& what);

class Collectives {
 public:
  explicit Collectives(c10::intrusive_ptr<c10d::ProcessGroup> process_group);

  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_size_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return pg_; }

  // tensor: [n], contiguous. Every rank ends with the elementwise sum over ranks.
  void all_reduce_sum_(at::Tensor& tensor) const;

  // full: [W * m], contiguous; shard: [m], contiguous, same dtype and device, not overlapping full.
  // Rank r ends with shard = Σ_ranks full[r·m, (r+1)·m).
  void reduce_scatter_sum(at::Tensor& shard, at::Tensor& full) const;

  // reduce_scatter_sum without waiting: the c10d work to wait() on before `shard` is read (null
  // when W = 1, done at once). Neither tensor may be touched until then.
  c10::intrusive_ptr<c10d::Work> reduce_scatter_sum_async(at::Tensor& shard,
                                                          at::Tensor& full) const;

  // shard: [m], contiguous; full: [W * m], contiguous, same dtype and device, not overlapping
  // shard (callers gathering in place copy their shard out first). full[r·m, (r+1)·m) = rank r's
  // shard.
  void all_gather(at::Tensor& full, at::Tensor& shard) const;

  // all_gather without waiting: returns the c10d work to wait() on before `full` is read (null
  // when there is nothing to wait for, W = 1). Neither tensor may be written until then. With
  // NCCL the gather runs on the backend's own stream, with Gloo on its worker threads, so it
  // overlaps whatever the caller computes meanwhile (stage-3 prefetch).
  c10::intrusive_ptr<c10d::Work> all_gather_async(at::Tensor& full, at::Tensor& shard) const;

  // tensor: any contiguous tensor; every rank ends with rank `root`'s values.
  void broadcast_(at::Tensor& tensor, int64_t root) const;

  // Small agreements (a refusal on any rank, the logical batch's figures, rank 0's seed):
  // `values` has the same length on every rank. The values travel in a tensor made here, on the
  // device the backend reduces on (CUDA for NCCL), which no Python object ever wraps (Note [work
  // references]).
  std::vector<int64_t> all_reduce_sum(const std::vector<int64_t>& values) const;
  std::vector<double> all_reduce_sum(const std::vector<double>& values) const;
  std::vector<int64_t> broadcast(const std::vector<int64_t>& values, int64_t root) const;

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int64_t rank_ = 0;
  int64_t world_size_ = 1;
};

}  // namespace dpzero::comm
