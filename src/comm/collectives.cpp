// src/comm/collectives.cpp — blocking sum collectives through c10d::ProcessGroup (Note [sum
// collectives] in collectives.h).
#include "src/comm/collectives.h"

#include <string>
#include <vector>

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

namespace dpzero::comm {
namespace {

void check_pair(const char* op, const at::Tensor& shard, const at::Tensor& full,
                int64_t world_size) {
  TORCH_CHECK(shard.dim() == 1 && full.dim() == 1, op, ": shard and full must be 1-D, got shapes ",
              shard.sizes(), " and ", full.sizes());
  TORCH_CHECK(shard.is_contiguous() && full.is_contiguous(), op,
              ": shard and full must be contiguous");
  TORCH_CHECK(full.numel() == shard.numel() * world_size, op, ": full has ", full.numel(),
              " elements, expected world size ", world_size, " x shard size ", shard.numel());
  TORCH_CHECK(shard.scalar_type() == full.scalar_type() && shard.device() == full.device(), op,
              ": shard (", shard.scalar_type(), ", ", shard.device(), ") and full (",
              full.scalar_type(), ", ", full.device(), ") must share dtype and device");
  TORCH_CHECK(at::get_overlap_status(shard, full) == at::MemOverlapStatus::No, op,
              ": shard and full overlap in memory; copy the shard out first");
}

// Note [work references]: a new TensorImpl over `t`'s storage, never seen by Python.
at::Tensor storage_alias(const at::Tensor& t) {
  at::NoGradGuard no_grad;
  return at::empty({0}, t.options()).set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
}

std::string on_rank(const char* op, int64_t rank, int64_t world_size) {
  return std::string(op) + " on rank " + std::to_string(rank) + " of " + std::to_string(world_size);
}

// values: [n] of T, on the device the group's backend reduces on (CUDA for NCCL).
template <typename T>
at::Tensor agreement_tensor(const c10d::ProcessGroup& pg, const std::vector<T>& values) {
  at::Tensor t = at::tensor(values, at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
  return pg.getBackendName() == "nccl" ? t.to(at::kCUDA) : t;
}

template <typename T>
std::vector<T> to_vector(const at::Tensor& t) {
  const at::Tensor host = t.to(at::kCPU).contiguous();
  const T* p = host.data_ptr<T>();
  return std::vector<T>(p, p + host.numel());
}

template <typename T>
std::vector<T> all_reduce_values(const Collectives& comm, const std::vector<T>& values) {
  if (comm.world_size() == 1) return values;
  at::Tensor t = agreement_tensor(*comm.process_group(), values);
  comm.all_reduce_sum_(t);
  return to_vector<T>(t);
}

}  // namespace

void wait(c10d::Work& work, const std::string& what) {
  try {
    work.wait();
  } catch (const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    std::string cause = c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
    const size_t newline = cause.find('\n');
    if (newline != std::string::npos) cause.resize(newline);
    C10_THROW_ERROR(DistBackendError,
                    "dpzero: " + what + " failed: a peer rank died, hung past the process "
                    "group's timeout, or lost its connection (" + cause + ")");
  }
}

Collectives::Collectives(c10::intrusive_ptr<c10d::ProcessGroup> process_group)
    : pg_(std::move(process_group)) {
  if (pg_) {
    rank_ = pg_->getRank();
    world_size_ = pg_->getSize();
  }
}

void Collectives::all_reduce_sum_(at::Tensor& tensor) const {
  TORCH_CHECK(tensor.is_contiguous(), "all_reduce_sum_: tensor must be contiguous, got strides ",
              tensor.strides());
  if (world_size_ == 1) return;
  std::vector<at::Tensor> tensors{storage_alias(tensor)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  wait(*pg_->allreduce(tensors, opts), on_rank("all-reduce", rank_, world_size_));
}

void Collectives::reduce_scatter_sum(at::Tensor& shard, at::Tensor& full) const {
  c10::intrusive_ptr<c10d::Work> work = reduce_scatter_sum_async(shard, full);
  if (work) wait(*work, on_rank("reduce-scatter", rank_, world_size_));
}

c10::intrusive_ptr<c10d::Work> Collectives::reduce_scatter_sum_async(at::Tensor& shard,
                                                                     at::Tensor& full) const {
  check_pair("reduce_scatter_sum", shard, full, world_size_);
  if (world_size_ == 1) {
    shard.copy_(full);
    return {};
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  at::Tensor out = storage_alias(shard);
  at::Tensor in = storage_alias(full);
  return pg_->_reduce_scatter_base(out, in, opts);
}

void Collectives::all_gather(at::Tensor& full, at::Tensor& shard) const {
  check_pair("all_gather", shard, full, world_size_);
  if (world_size_ == 1) {
    full.copy_(shard);
    return;
  }
  wait(*all_gather_async(full, shard), on_rank("all-gather", rank_, world_size_));
}

c10::intrusive_ptr<c10d::Work> Collectives::all_gather_async(at::Tensor& full,
                                                             at::Tensor& shard) const {
  check_pair("all_gather_async", shard, full, world_size_);
  if (world_size_ == 1) {
    full.copy_(shard);
    return {};
  }
  at::Tensor out = storage_alias(full);
  at::Tensor in = storage_alias(shard);
  return pg_->_allgather_base(out, in);
}

void Collectives::broadcast_(at::Tensor& tensor, int64_t root) const {
  TORCH_CHECK(root >= 0 && root < world_size_, "broadcast_: root must be in [0, ", world_size_,
              "), got ", root);
  TORCH_CHECK(tensor.is_contiguous(), "broadcast_: tensor must be contiguous");
  if (world_size_ == 1) return;
  std::vector<at::Tensor> tensors{storage_alias(tensor)};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  wait(*pg_->broadcast(tensors, opts), on_rank("broadcast", rank_, world_size_));
}

std::vector<int64_t> Collectives::all_reduce_sum(const std::vector<int64_t>& values) const {
  return all_reduce_values(*this, values);
}

std::vector<double> Collectives::all_reduce_sum(const std::vector<double>& values) const {
  return all_reduce_values(*this, values);
}

std::vector<int64_t> Collectives::broadcast(const std::vector<int64_t>& values,
                                            int64_t root) const {
  if (world_size_ == 1) return values;
  at::Tensor t = agreement_tensor(*pg_, values);
  broadcast_(t, root);
  return to_vector<int64_t>(t);
}

}  // namespace dpzero::comm
