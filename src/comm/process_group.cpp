// src/comm/process_group.cpp — stores and Gloo/NCCL process groups from C++ (process_group.h;
// Note [gloo headers]).
#include "src/comm/process_group.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef DPZERO_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace dpzero::comm {
namespace {

void check_rank(int64_t rank, int64_t world_size) {
  TORCH_CHECK(world_size >= 1, "world_size must be >= 1, got ", world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "rank must be in [0, ", world_size, "), got ",
              rank);
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

}  // namespace

void check_backend(const std::string& backend) {
  TORCH_CHECK(backend == "gloo" || backend == "nccl", "backend must be 'gloo' or 'nccl', got '",
              backend, "'");
#ifndef DPZERO_WITH_NCCL
  TORCH_CHECK(backend != "nccl", "backend 'nccl' needs a dpzero build with CUDA (DPZERO_CUDA=ON); "
                                 "this build has none");
#endif
}

c10::intrusive_ptr<c10d::Store> make_store(const std::string& init_method, int64_t rank,
                                           int64_t world_size, std::chrono::milliseconds timeout) {
  check_rank(rank, world_size);
  if (starts_with(init_method, "file://")) {
    const std::string path = init_method.substr(7);
    TORCH_CHECK(!path.empty() && path[0] == '/', "init method '", init_method,
                "': a file store needs an absolute path, file:///PATH");
    auto store = c10::make_intrusive<c10d::FileStore>(path, static_cast<int>(world_size));
    store->setTimeout(timeout);
    return store;
  }
  if (starts_with(init_method, "tcp://")) {
    const std::string address = init_method.substr(6);
    const size_t colon = address.rfind(':');
    TORCH_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < address.size(),
                "init method '", init_method, "': expected tcp://HOST:PORT");
    const std::string host = address.substr(0, colon);
    const std::string port_text = address.substr(colon + 1);
    size_t used = 0;
    long port = -1;
    try {
      port = std::stol(port_text, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TORCH_CHECK(used == port_text.size() && port > 0 && port < 65536, "init method '",
                init_method, "': port must be an integer in [1, 65535], got '", port_text, "'");
    c10d::TCPStoreOptions options;
    options.port = static_cast<std::uint16_t>(port);
    options.isServer = rank == 0;
    options.numWorkers = static_cast<size_t>(world_size);
    options.waitWorkers = true;
    options.timeout = timeout;
    return c10::make_intrusive<c10d::TCPStore>(host, options);
  }
  TORCH_CHECK(false, "init method must start with tcp:// or file://, got '", init_method, "'");
}

c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(
    const std::string& backend, c10::intrusive_ptr<c10d::Store> store, int64_t rank,
    int64_t world_size, std::chrono::milliseconds timeout) {
  check_rank(rank, world_size);
  check_backend(backend);
  TORCH_CHECK(store, "make_process_group: the store is null");
  TORCH_CHECK(timeout.count() > 0, "timeout must be > 0 ms, got ", timeout.count());
  // Each backend rendezvouses under its own prefix, as torch.distributed does, so one store can
  // carry several groups.
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("dpzero/" + backend, store);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(prefixed, static_cast<int>(rank),
                                                       static_cast<int>(world_size));
  if (backend == "gloo") {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
        prefixed, static_cast<int>(rank), static_cast<int>(world_size), options);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
    group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
    return group;
  }
  if (backend == "nccl") {
#ifdef DPZERO_WITH_NCCL
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
        prefixed, static_cast<int>(rank), static_cast<int>(world_size), options);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
    group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
    return group;
#endif
  }
  TORCH_CHECK(false, "unreachable: check_backend accepted '", backend, "'");
}

}  // namespace dpzero::comm
