// src/zero/flat_param.cpp — building the flat buffer, the parameter views, and freeing /
// re-allocating the buffer's storage (Note [flat views]).
#include "src/zero/flat_param.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <c10/util/strides.h>

#include "src/zero/storage_access.h"

namespace dpzero::zero {
namespace {

// Note [reading a resharded parameter]: a storage of `nbytes` (so that views of it pass torch's
// bounds checks) on `device` with no memory, whose every data access throws `message`.
c10::Storage refusing_storage(size_t nbytes, c10::Device device, std::string message) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, at::DataPtr(nullptr, device),
                       /*allocator=*/nullptr, /*resizable=*/false);
  storage.unsafeGetStorageImpl()->release_data_and_set_meta_custom_data_ptr_error_msg_(
      std::move(message));
  return storage;
}

}  // namespace

FlatParam::FlatParam(std::vector<at::Tensor> params, std::vector<std::string> names,
                     UnitLayout layout, const comm::Collectives& comm, bool sync,
                     FlatParamOptions options)
    : params_(std::move(params)),
      names_(std::move(names)),
      layout_(std::move(layout)),
      rank_(comm.rank()),
      options_(options) {
  TORCH_CHECK(!params_.empty(), "a flat parameter needs at least one parameter, got 0");
  TORCH_CHECK(layout_.params().size() == params_.size(), "the layout has ",
              layout_.params().size(), " parameters, got ", params_.size());
  TORCH_CHECK(layout_.world_size() == comm.world_size(), "the layout is for world size ",
              layout_.world_size(), " but the process group has ", comm.world_size(), " ranks");
  check_param_dtype(options_.param_dtype);
  TORCH_CHECK(!(options_.shard_params && options_.master_full),
              "a flat parameter cannot be both sharded (stage 3) and fully owned (stage 0)");
  TORCH_CHECK(!options_.offload_params || options_.shard_params,
              "parameter offload needs sharded parameters (ZeRO stage 3)");
  if (options_.offload_params) options_.offload_master = true;  // Note [parameter offload]
  check_params(params_, names_);
  for (const at::Tensor& p : params_) shapes_.push_back(p.sizes().vec());
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK(params_[i].numel() == layout_.params()[i].numel, "parameter '", names_[i],
                "' has ", params_[i].numel(), " elements, the layout says ",
                layout_.params()[i].numel);
  }
  const int64_t m = layout_.shard_numel();
  // [padded_numel] fp32: the starting values, identical on every rank after the broadcast.
  at::Tensor values = at::zeros({layout_.padded_numel()}, params_[0].options().requires_grad(false));
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) param_view(values, i).copy_(params_[i].detach());
  }
  if (sync) comm.broadcast_(values, 0);
  at::Tensor owned_values = values.narrow(0, rank_ * m, m);
  if (separate_master()) {
    full_ = values.to(options_.param_dtype, /*non_blocking=*/false, /*copy=*/true);
    at::Tensor master_values = options_.master_full ? values : owned_values;
    if (options_.offload_master) {
      // Pinned when the parameters live on a GPU, so host<->device copies can be asynchronous.
      master_ = at::empty({master_values.numel()},
                          master_values.options().device(at::kCPU).pinned_memory(
                              master_values.is_cuda()));
      master_.copy_(master_values);
    } else {
      master_ = options_.master_full ? values : owned_values.clone();
    }
  } else {
    full_ = values;
  }
  // Only this class gives full_'s storage memory or takes it away: a resize through a view
  // (untyped_storage().resize_()) would leave a gathered copy no fingerprint could compare.
  full_.storage().unsafeGetStorageImpl()->set_resizable(false);
  for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(param_view(full_, i));
  at::Tensor owned = full_.narrow(0, rank_ * m, m);
  if (options_.offload_params) {
    // Note [parameter offload]: pinned when the parameters live on a GPU.
    shard_ = at::empty({m}, owned.options().device(at::kCPU).pinned_memory(owned.is_cuda()));
    shard_.copy_(owned);
  } else {
    shard_ = options_.shard_params ? owned.clone() : owned;
  }
  if (!separate_master() || master_is_shard()) master_ = options_.master_full ? full_ : shard_;
  if (options_.shard_params) {
    for (const std::string& name : names_) {
      resharded_.push_back(refusing_storage(
          static_cast<size_t>(full_bytes()), full_.device(),
          "parameter '" + name + "' has no memory here: ZeRO stage 3 gathers a unit's parameters "
          "only around that unit's own forward and backward, and frees them after (Note [reading "
          "a resharded parameter]). Read the model's values with model.full_parameters() (a "
          "collective: every rank calls it), or put the modules that read this parameter in one "
          "unit (units=[...])"));
    }
    freed_message_ =
        "this tensor views the gathered memory of the ZeRO stage 3 unit holding parameter '" +
        names_[0] + "'" +
        (names_.size() > 1 ? " (and " + std::to_string(names_.size() - 1) + " more)" : "") +
        ", which is freed after the unit's forward and backward and has no memory here (Note "
        "[views kept across a reshard]). A view (.data, .detach(), .view()) of a stage-3 "
        "parameter is valid only while its unit is gathered: keep a copy (.clone()) instead, or "
        "read the model's values with model.full_parameters() (a collective: every rank calls it)";
    release_full();  // the parameters were views of full_ until now
  }
}

void FlatParam::release_full() {
  storage_access::take_memory(*full_.storage().unsafeGetStorageImpl(), freed_message_);
  refuse_replaced(point_params(false));
}

void FlatParam::note_written(const at::Tensor& changed) {
  gathered_written_ = gathered_written_.defined() ? gathered_written_.logical_or(changed) : changed;
}

std::vector<std::string> FlatParam::point_params(bool gathered) {
  const c10::StorageImpl* full = full_.storage().unsafeGetStorageImpl();
  std::vector<std::string> replaced;
  for (size_t i = 0; i < params_.size(); ++i) {
    c10::TensorImpl* impl = params_[i].unsafeGetTensorImpl();
    const c10::StorageImpl* now = impl->storage().unsafeGetStorageImpl();
    const int64_t offset = layout_.flat_offsets()[i];
    if ((now != full && now != resharded_[i].unsafeGetStorageImpl()) ||
        impl->storage_offset() != offset || impl->sizes() != at::IntArrayRef(shapes_[i]) ||
        !impl->is_contiguous() || impl->dtype() != full_.dtype()) {
      replaced.push_back("'" + names_[i] + "'");
    }
    impl->set_storage_and_dtype(gathered ? full_.storage() : resharded_[i], full_.dtype());
    impl->set_sizes_and_strides(shapes_[i], c10::contiguous_strides(shapes_[i]), offset);
  }
  return replaced;
}

void FlatParam::refuse_replaced(const std::vector<std::string>& replaced) {
  if (replaced.empty()) return;
  // Under the watch the open logical batch's step is refused too (Note [writes to a gathered
  // unit]): whatever read the replacement before now may have carried the batch, and a caller who
  // catches the error below must not find the step taken.
  if (fingerprint_) note_written(at::ones({}, full_.options().dtype(at::kBool)));
  TORCH_CHECK(false, "parameter", replaced.size() > 1 ? "s " : " ", c10::Join(", ", replaced),
              replaced.size() > 1 ? " were" : " was",
              " given other memory (.data replaced) while ZeRO stage 3 held its unit: stage 3 keeps "
              "a unit's values in its own flat buffer, which the forward and the optimizer read, so "
              "the replacement is undone here and refused (in a private run, a value computed from "
              "the batch would reach the other examples' outputs outside the clipping, and the "
              "step is refused). Load values with model.load_state_dict() or "
              "dpzero.checkpoint.load");
}

void FlatParam::check_param_dtype(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "param_dtype must be float32, bfloat16 or float16, got ", dtype);
}

void FlatParam::check_params(const std::vector<at::Tensor>& params,
                             const std::vector<std::string>& names) {
  TORCH_CHECK(names.size() == params.size(), "got ", params.size(), " parameters but ",
              names.size(), " names");
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.defined(), "parameter '", names[i], "' is undefined");
    TORCH_CHECK(p.scalar_type() == at::kFloat, "parameter '", names[i],
                "' must be float32 (fp32 master weights), got ", p.scalar_type());
    TORCH_CHECK(p.device() == params[0].device(), "parameter '", names[i], "' is on ",
                p.device(), " but '", names[0], "' of the same unit is on ", params[0].device());
    TORCH_CHECK(p.requires_grad(), "parameter '", names[i],
                "' does not require grad; only trainable parameters are flattened");
  }
}

bool FlatParam::unsharded() const {
  if (pending_) return false;
  return !options_.shard_params || full_.storage().nbytes() == static_cast<size_t>(full_bytes());
}

int64_t FlatParam::full_bytes() const {
  return layout_.padded_numel() * static_cast<int64_t>(full_.element_size());
}

at::Tensor FlatParam::param_view(const at::Tensor& flat, size_t i) const {
  return flat.narrow(0, layout_.flat_offsets()[i], layout_.params()[i].numel).view(shapes_[i]);
}

bool FlatParam::wait_gather() {
  if (!pending_) return false;
  comm::wait(*pending_, "all-gather of the unit of parameter '" +
                            (names_.empty() ? std::string("?") : names_.front()) + "' on rank " +
                            std::to_string(rank_));  // Note [collective failures]
  pending_.reset();
  adopt_incoming();
  complete_gather();
  return true;
}

void FlatParam::watch_gathered(Fingerprint fingerprint) {
  fingerprint_ = std::move(fingerprint);
  gathered_fingerprint_ = at::Tensor();
  if (fingerprint_ && unsharded()) note_gathered();  // a copy gathered before the watch began
}

void FlatParam::note_gathered() {
  if (!fingerprint_ || !options_.shard_params) return;
  at::NoGradGuard no_grad;
  gathered_fingerprint_ = fingerprint_(full_);
  gathered_versions_.clear();
  for (const at::Tensor& p : params_) gathered_versions_.push_back(p._version());
}

void FlatParam::check_gathered() {
  if (!gathered_fingerprint_.defined()) return;
  at::NoGradGuard no_grad;
  bool moved = false;  // a version counter: an in-place write, even one undone since
  for (size_t i = 0; i < params_.size(); ++i)
    moved = moved || params_[i]._version() != gathered_versions_[i];
  // Or full_'s memory is no longer the gathered copy's: nothing to compare.
  note_written(moved || !unsharded() ? at::ones({}, full_.options().dtype(at::kBool))
                                     : fingerprint_(full_).ne(gathered_fingerprint_));
  gathered_fingerprint_ = at::Tensor();
}

at::Tensor FlatParam::take_gathered_written() {
  at::Tensor out = gathered_written_.defined()
                       ? gathered_written_
                       : at::zeros({}, full_.options().dtype(at::kBool));
  gathered_written_ = at::Tensor();
  return out;
}

at::Tensor& FlatParam::gather_source() {
  if (shard_.device() == full_.device()) return shard_;
  // Note [parameter offload]: host -> device, ordered before the gather on the current stream.
  staged_ = shard_.to(full_.device(), /*non_blocking=*/true);
  c10::impl::VirtualGuardImpl guard(full_.device().type());
  if (!host_read_done_) host_read_done_.emplace(full_.device().type());
  host_read_done_->record(guard.getStream(full_.device()));
  return staged_;
}

void FlatParam::wait_host_reads() {
  if (host_read_done_) host_read_done_->synchronize();
}

void FlatParam::prepare_master_write() {
  if (!master_is_shard()) return;
  reshard();
  wait_host_reads();
}

void FlatParam::unshard(const comm::Collectives& comm) {
  if (wait_gather()) return;
  if (unsharded()) return;
  c10::StorageImpl* storage = full_.storage().unsafeGetStorageImpl();
  const auto nbytes = static_cast<size_t>(full_bytes());
  TORCH_CHECK(storage->allocator() != nullptr,
              "flat parameter storage has no allocator to re-allocate ", nbytes, " bytes from");
  storage_access::give_memory(*storage, storage->allocator()->allocate(nbytes), nbytes);
  comm.all_gather(full_, gather_source());
  complete_gather();
}

void FlatParam::complete_gather() {
  staged_ = at::Tensor();  // stream-ordered: a later kernel cannot reuse it before the gather
  const std::vector<std::string> replaced = point_params(true);
  note_gathered();  // first: a caller who catches the refusal still finds the copy watched
  refuse_replaced(replaced);
}

void FlatParam::unshard_async(const comm::Collectives& comm) {
  if (pending_ || unsharded()) return;
  // Note [gathers land apart]: into memory of its own, which full_ adopts when the gather is
  // waited for.
  at::Tensor incoming = at::empty({layout_.padded_numel()}, full_.options());
  pending_ = comm.all_gather_async(incoming, gather_source());
  incoming_ = incoming;  // only once the gather is issued: a failed one leaves nothing to adopt
  // One rank gathers by a copy, done when the call returns, with no work to wait for: its gather
  // completes here, or no wait would ever point the parameters back or fingerprint the copy.
  if (!pending_) {
    adopt_incoming();
    complete_gather();
  }
}

void FlatParam::adopt_incoming() {
  c10::StorageImpl* from = incoming_.storage().unsafeGetStorageImpl();
  c10::StorageImpl* to = full_.storage().unsafeGetStorageImpl();
  storage_access::give_memory(*to, from->set_data_ptr(at::DataPtr(nullptr, from->device())),
                              from->nbytes());
  incoming_ = at::Tensor();
}

void FlatParam::reshard() {
  wait_gather();  // the gather writes into full_: let it finish before freeing the memory
  if (!options_.shard_params) return;
  check_gathered();  // Note [writes to a gathered unit]
  release_full();
}

void FlatParam::publish_master(const comm::Collectives& comm) {
  at::NoGradGuard no_grad;
  reshard();  // stage 3: a pending prefetch still reads shard_, which is about to change
  // Note [parameter offload]: no queued host-to-device copy may still read the host shard that
  // is about to be written (with fp32 compute the optimizer wrote it already, after
  // prepare_master_write()).
  wait_host_reads();
  if (separate_master() && !master_is_shard()) {
    (options_.master_full ? full_ : shard_).copy_(master_);
  }
  if (options_.shard_params) {
    release_full();  // any gathered copy is stale now
  } else if (!options_.master_full && comm.world_size() > 1) {
    at::Tensor mine = shard_.clone();  // all_gather's input may not overlap its output
    comm.all_gather(full_, mine);
  }
}

void FlatParam::attach_grad_views(at::Tensor& flat_grad, bool keep_values) {
  TORCH_CHECK(flat_grad.dim() == 1 && flat_grad.numel() == layout_.padded_numel(),
              "attach_grad_views: flat_grad must have shape [", layout_.padded_numel(), "], got ",
              flat_grad.sizes());
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor view = param_view(flat_grad, i);
    at::Tensor& grad = params_[i].mutable_grad();
    const bool is_view = grad.defined() && grad.data_ptr() == view.data_ptr() &&
                         grad.sizes() == view.sizes() && grad.strides() == view.strides();
    if (is_view) continue;  // autograd accumulated into it in place
    if (keep_values) {
      if (grad.defined()) {
        view.copy_(grad);
      } else {
        view.zero_();
      }
    }
    grad = view;
  }
}

at::Tensor FlatParam::take_grads(at::ScalarType dtype) {
  // on the compute device (full_'s: under parameter offload shard_ is on the host)
  at::Tensor flat = at::zeros({layout_.padded_numel()}, full_.options().dtype(dtype));
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& grad = params_[i].mutable_grad();
    if (!grad.defined()) continue;
    param_view(flat, i).copy_(grad);
    grad.reset();
  }
  return flat;
}

void FlatParam::drop_grads() {
  for (at::Tensor& p : params_) p.mutable_grad().reset();
}

int64_t FlatParam::param_bytes() const {
  int64_t bytes = static_cast<int64_t>(full_.storage().nbytes());
  if (incoming_.defined()) bytes += full_bytes();  // a gather in flight (Note [gathers land apart])
  if (options_.shard_params && shard_.device() == full_.device()) {
    bytes += shard_.numel() * static_cast<int64_t>(shard_.element_size());
  }
  return bytes;
}

int64_t FlatParam::host_param_bytes() const {
  if (shard_.device() == full_.device()) return 0;
  return shard_.numel() * static_cast<int64_t>(shard_.element_size());
}

int64_t FlatParam::master_bytes() const {
  if (!separate_master() || master_is_shard()) return 0;
  return master_.numel() * static_cast<int64_t>(master_.element_size());
}

}  // namespace dpzero::zero
