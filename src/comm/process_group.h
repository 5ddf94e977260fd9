// src/comm/process_group.h — c10d process groups created from C++ (design.md §1 `comm/`), for
// callers that are not launched through Python's torch.distributed: a store from an init method
// and a Gloo (CPU) or NCCL (GPU) group on it. From Python the engine normally takes
// torch.distributed's default group instead (collectives.h).
//
// Note [gloo headers]
// ~~~~~~~~~~~~~~~~~~~
// torch's wheel ships ProcessGroupGloo.hpp but not the gloo headers it includes; we compile it
// against Debian's libgloo-dev headers (scripts/setup.sh installs them), while the code that runs
// is the gloo torch linked into libtorch_cpu. That is sound because this file calls only
// entry points that libtorch exports — ProcessGroupGloo::Options::create,
// ProcessGroupGloo::createDefaultDevice and ProcessGroupGloo's constructor — and gloo types appear
// in those declarations only behind std::shared_ptr, whose layout does not depend on the gloo
// version. We never call a gloo function or touch a gloo object ourselves, so no inline gloo code
// from the older headers is compiled into dpzero. The GoogleTest engine tests (ranks as threads
// over one HashStore) run on these groups, so a mismatch would show there first.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace dpzero::comm {

// A store from an init method, as torch.distributed spells them:
//   "tcp://HOST:PORT" — rank 0 runs the TCP server, the others connect;
//   "file:///PATH"   — a file on a filesystem every rank sees (removed by the last user).
// Throws naming the init method when its scheme, host or port is malformed.
c10::intrusive_ptr<c10d::Store> make_store(const std::string& init_method, int64_t rank,
                                           int64_t world_size, std::chrono::milliseconds timeout);

// Throws naming `backend` unless it is "gloo" or "nccl" (and, for "nccl", this build has CUDA).
void check_backend(const std::string& backend);

// A process group of `world_size` ranks on `store` with one backend for every collective:
// "gloo" (CPU tensors) or "nccl" (CUDA tensors; only in builds with CUDA kernels, otherwise an
// error saying so). Collectives that do not finish within `timeout` fail with c10d's error.
// Blocks until every rank has joined.
c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(
    const std::string& backend, c10::intrusive_ptr<c10d::Store> store, int64_t rank,
    int64_t world_size, std::chrono::milliseconds timeout);

}  // namespace dpzero::comm
