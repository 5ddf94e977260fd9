// src/zero/storage_access.cpp — Note [views kept across a reshard] (storage_access.h).
#include "src/zero/storage_access.h"

#include <utility>

namespace dpzero::zero::storage_access {
namespace {

// The member that makes StorageImpl::data() and mutable_data() throw.
struct RefuseFlag {
  using type = bool c10::StorageImpl::*;
  friend type member(RefuseFlag);
};

template <typename Tag, typename Tag::type Member>
struct Grant {
  friend typename Tag::type member(Tag) { return Member; }
};

// An explicit instantiation may name a private member (access is not checked in it).
template struct Grant<RefuseFlag, &c10::StorageImpl::throw_on_immutable_data_ptr_>;

}  // namespace

void take_memory(c10::StorageImpl& storage, const std::string& message) {
  if (storage.nbytes() == 0) return;
  storage.set_data_ptr_noswap(at::DataPtr(nullptr, storage.device()));
  storage.set_nbytes(0);
  storage.release_data_and_set_meta_custom_data_ptr_error_msg_(message);
}

void give_memory(c10::StorageImpl& storage, at::DataPtr&& data, size_t nbytes) {
  storage.*member(RefuseFlag{}) = false;
  storage.set_data_ptr_noswap(std::move(data));  // recomputes the cached check from the flags
  storage.set_nbytes(nbytes);
}

}  // namespace dpzero::zero::storage_access
