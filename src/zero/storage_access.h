// src/zero/storage_access.h — giving a stage-3 unit's gathered storage memory and taking it away,
// so that a view of it read while the memory is away raises an error instead of reading address 0.
//
// Note [views kept across a reshard]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A tensor made from a stage-3 parameter while its unit is gathered (`m.weight.data`,
// `m.weight.detach()`, `m.weight.view(-1)` kept by a hook or a module) is a view of the unit's
// full_ storage, not of the parameter's TensorImpl, so the refusing storage of Note [reading a
// resharded parameter] never reaches it. When the unit is resharded full_'s storage loses its
// memory, and torch does not check a storage's size when a kernel reads a view: the kernel got
// address 0 plus the view's offset (SIGSEGV on the CPU; on a GPU an illegal address, which ends
// the CUDA context). So full_'s storage refuses every data access while it has no memory, with a
// message naming the unit, and accepts them again when a gather gives it memory. The views
// autograd saved in forward (W.t() for addmm) are only read in the unit's backward, after its
// backward gather, and are unaffected.
//
// c10::StorageImpl can be set to refuse (release_data_and_set_meta_custom_data_ptr_error_msg_),
// but torch offers no way to make it accept again: the flag is private. give_memory() clears it
// through the one access C++ allows to a private member, an explicit instantiation that names
// it ([temp.spec.general]: access is not checked there), written once in storage_access.cpp. If
// torch renames or retypes the member, that file stops compiling; nothing can drift silently.
// The write order keeps torch's cached check consistent: the flag first, then
// set_data_ptr_noswap, which recomputes the check from every flag.
#pragma once

#include <cstddef>
#include <string>

#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>

namespace dpzero::zero::storage_access {

// Frees `storage`'s memory (its size becomes 0) and makes every later data access of it, or of
// any tensor viewing it, raise `message`. No-op on a storage that already has no memory.
void take_memory(c10::StorageImpl& storage, const std::string& message);

// Gives `storage` the memory `data` of `nbytes` bytes and accepts data accesses again.
void give_memory(c10::StorageImpl& storage, at::DataPtr&& data, size_t nbytes);

}  // namespace dpzero::zero::storage_access
