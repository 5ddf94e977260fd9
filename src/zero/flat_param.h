// src/zero/flat_param.h — one unit's trainable parameters as one flat fp32 buffer that the
// parameters' .data are views into (design.md §2 steps 2 and 7; layout from UnitLayout).
//
// Note [flat views]
// ~~~~~~~~~~~~~~~~~
// The unit's full flat buffer `full` ([padded_numel]) holds parameter i at flat offset
// layout.flat_offsets()[i] (aligned; padding zero). At construction each parameter's .data is set
// once to the view full[offset_i, offset_i + numel_i).view(shape_i): the parameter stays the same
// Python object and autograd leaf (same AccumulateGrad node, same version counter), only its
// storage changes. The optimizer writes the buffer, never the parameters, so no version bumps.
//
// Stage 3 frees the buffer by shrinking its *storage* to 0 bytes and re-allocates it before use.
// The parameter views, and every view autograd saved in forward (addmm saves W.t(), a view of W),
// share that one StorageImpl: freeing it frees the memory under all of them, and the all-gather
// that refills it makes all of them valid again. Re-pointing .data at a new buffer on every gather
// would instead leave the views saved in forward holding the old buffer, which could then never
// be freed. While a unit is resharded its parameters keep their shapes but have no memory, and
// reading them is an error naming the parameter (Note [reading a resharded parameter]);
// ZeroState::full_parameters() gathers a copy.
//
// Note [reading a resharded parameter]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch does not check a storage's size when a kernel reads a tensor: a view of a freed storage
// hands the kernel a null pointer plus its offset, and the process died of SIGSEGV (or numpy read
// whatever lay at that address) when anything read a stage-3 parameter outside its unit: another
// module's forward reading it through .data, a print, a state_dict() saved by hand. So while the
// unit is resharded each parameter's TensorImpl is pointed at a storage of its own that holds no
// memory and refuses every data access (StorageImpl's throw-on-access, with a message that names
// the parameter and the fix); the gather that completes points it back at full_'s storage. Each
// pointing also sets the parameter's offset, shape, strides and dtype to its place in the layout,
// so the device, requires_grad, the version counter and the AccumulateGrad node never change, and
// `next(model.parameters()).device`, shapes and parameter counts read as before. A parameter whose
// .data was replaced since the last pointing (another storage or another place: the forward would
// read the replacement, and the next gather would have pointed it into the wrong part of full_)
// is pointed back like the others and then refused, naming it: in a private run a replacement
// computed from the batch would reach the other examples' outputs outside the clipping, and the
// fingerprints of Note [writes to a gathered unit] read full_, not the replacement (unrefused,
// such a replacement moves a step several times the bound). The views autograd saved in forward
// (W.t() for addmm) were made from full_'s storage while the unit was gathered, keep it, and are
// freed and refilled with it as before; a parameter autograd saved itself (a leaf is saved as the
// same TensorImpl) is read in the unit's backward, after its backward gather re-pointed it.
// One reader is not ours to fix: torch's C function behind UntypedStorage.is_shared (and so
// Tensor.is_shared) reads the pointer without translating a C++ exception, so the refusal ended
// the process there; in stage 3 dpzero.shard puts a Python is_shared before it that reads the
// pointer through torch's error handling first (_raise_from_is_shared in python/dpzero/zero.py).
//
// Note [gathers land apart]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A prefetch (unshard_async) all-gathers into memory of its own, not into full_'s storage, and
// full_'s storage adopts that memory only when the gather is waited for, when the gathered copy is
// also fingerprinted (Note [writes to a gathered unit]). Gathering into full_ itself would make
// full_'s memory live from the issue to the wait: a write through a view of full_ kept from an
// earlier gather (a tensor a module stored in an earlier forward), made once the gather had landed
// and before the wait, would become part of the fingerprinted baseline and never be refused, moving
// a step past the bound. Gathering apart, such a write raises until the wait, as at any time the
// unit is resharded (Note [views kept across a reshard]). Views of full_ reach no parameter of the
// user's (Note [reading a resharded parameter] gives each its own storage while resharded).
//
// Note [master weights]
// ~~~~~~~~~~~~~~~~~~~~~
// The optimizer updates fp32 *master* values (ZeRO's "fp32 parameter copy"; Micikevicius et al.
// 2018, §3.1): the whole unit in stage 0, the owned shard in stages 1–3. With fp32 compute the
// master is the parameter storage itself (full() in stage 0, shard() otherwise) and nothing is
// copied. With bf16/fp16 compute (param_dtype) the parameters are views of a param_dtype full()
// buffer, and the master is its own fp32 tensor; after each update publish_master() rounds it
// into the compute copy (shard(), which stages 0–2 view inside full() and stage 3 keeps as its own
// param_dtype tensor so gathers move 16-bit values and memory matches ZeRO's 2Ψ/W parameter
// term), and stages 1–2 all-gather it. Checkpoints and full_parameters() read the master, never
// the rounded copy. Optimizer offload (ZeRO-Offload, Ren et al. 2021) is the same arrangement
// with the separate master — and so the optimizer state the optimizer creates like it — on the
// host: the reduced gradient shard goes to the host, the step runs there, and publish_master()
// copies the result back (pinned host memory when the parameters are on a GPU).
//
// Note [parameter offload]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Stage 3 can keep the owned shard itself in host memory (ZeRO-Infinity's parameter tier, Rajbhandari
// et al. 2021; FSDP2's CPUOffloadPolicy): between uses the device holds none of the unit. A
// gather copies the shard to the device (non-blocking from pinned memory, on the current stream,
// so the copy and the all-gather that reads it are ordered) and all-gathers from that copy; the
// copy lives until the gather is waited for. A prefetch is issued from the running unit's
// pre-forward hook, before that unit's kernels are queued: its copy runs ahead of them on the
// compute stream (pΨ_u/W bytes over the host link, not overlapped) and its all-gather overlaps
// them on the communication stream. A side copy stream would overlap the copy too; not built. The optimizer runs on the host (offload_master is implied): the update is written
// into the host shard, so nothing goes back to the device after a step. With fp32 compute the
// host shard is the master itself; with 16-bit compute publish_master() rounds the fp32 master
// into it. Before the host shard is written, the last host-to-device copy that read it must be
// done: a stream-ordered copy may still be queued when the host moves on, so it is fenced with an
// event (host_read_done_). The values are those of the run without offload, bit for bit: the same
// numbers are gathered, and the optimizer arithmetic is the same on either side (as for
// optimizer offload). On a CPU device the host shard is the device shard and only the master
// aliasing is new.
//
// Note [writes to a gathered unit]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under DP the stage-3 gathered copy is read-only to everything but the gather itself: the
// optimizer writes the owned shard (or the master) and frees full(), so a write into full()
// between its gather and its release is the forward's or the backward's (an initialisation from
// the batch through .data, F.embedding(..., max_norm=) renormalising a trained table). It does
// not outlive the release, but until then every later read of the parameters in the same
// micro-batch, the other examples' included, sees it: one example's data reaching the others'
// gradients outside the clipping. At stages 0–2 such a write persists and the private front
// door's fingerprints of the trained memories see it at the next check; at stage 3 there is nothing
// to see by then. So, when watched (watch_gathered, with the front door's fingerprint), each
// gathered copy is fingerprinted on its device when its gather completes and again just before its
// release, and a difference is OR-ed into a device flag (no host read) that the front door takes
// with the step's own read (take_gathered_written). Every release goes through reshard()
// (publish_master calls it first), so no gathered copy is freed unchecked. Bytes alone miss a write
// that a later one undoes before the release (a batch value put in, the layer run, the old value
// put back moves a step several times the bound), so the parameters' version counters are noted
// with the fingerprint and any move counts as a write (the gathers' own pointing moves none; a
// write through .data moves none either, and stays the fingerprint's to see). full_'s storage
// cannot be resized (only this class gives it memory or takes it away): a resize through a view
// would leave the copy with nothing to compare, and a copy whose memory is not the gathered size at
// its release counts as written.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "src/comm/collectives.h"
#include "src/zero/shard_plan.h"

namespace dpzero::zero {

// How a unit is held, by stage (stage.h) and precision.
struct FlatParamOptions {
  bool shard_params = false;            // stage 3: full() freed except around use
  bool master_full = false;             // stage 0: the master covers every coordinate
  at::ScalarType param_dtype = at::kFloat;  // compute dtype: kFloat, kBFloat16 or kHalf
  bool offload_master = false;          // keep the master (and optimizer state) on the CPU
  // Stage 3 only (Note [parameter offload]): the owned shard lives in host memory and is copied
  // to the device for each gather. Implies offload_master.
  bool offload_params = false;
};

class FlatParam {
 public:
  // params: the unit's trainable parameters in canonical order, fp32, one device, each
  //   params[i].numel() == layout.params()[i].numel; names: their canonical names (for errors).
  // Copies their values into a new fp32 buffer; with `sync`, broadcasts rank 0's buffer so every
  // rank starts from the same values; builds the master and the compute copies from it (Note
  // [master weights]) and sets each parameter's .data to its view of full() — in param_dtype,
  // so the parameters change dtype under mixed precision. With shard_params (stage 3) the owned
  // slice gets its own tensor and full()'s storage is freed; otherwise shard() is a view of full().
  FlatParam(std::vector<at::Tensor> params, std::vector<std::string> names, UnitLayout layout,
            const comm::Collectives& comm, bool sync, FlatParamOptions options);

  // The checks the constructor makes on `params` (fp32, one device, trainable), without touching
  // them: callers building several units check them all before flattening any.
  static void check_params(const std::vector<at::Tensor>& params,
                           const std::vector<std::string>& names);
  // Throws naming `dtype` unless it is float32, bfloat16 or float16.
  static void check_param_dtype(at::ScalarType dtype);

  const UnitLayout& layout() const { return layout_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  const std::vector<std::string>& names() const { return names_; }
  bool shards_params() const { return options_.shard_params; }
  int64_t rank() const { return rank_; }
  at::ScalarType param_dtype() const { return options_.param_dtype; }
  // Whether the master is a separate fp32 tensor (mixed precision or offload).
  bool separate_master() const {
    return options_.param_dtype != at::kFloat || options_.offload_master;
  }
  // Note [parameter offload]: the owned shard is kept in host memory.
  bool offloads_params() const { return options_.offload_params; }
  // Whether master() is shard() itself (fp32 compute with parameter offload).
  bool master_is_shard() const { return options_.offload_params && options_.param_dtype == at::kFloat; }

  // [padded_numel] param_dtype; its storage has 0 bytes while the unit is resharded (stage 3).
  at::Tensor& full() { return full_; }
  // [shard_numel] param_dtype: the owned coordinates' compute values, the all-gather source
  // (in host memory under parameter offload, then copied to full()'s device for each gather).
  at::Tensor& shard() { return shard_; }
  const at::Tensor& shard() const { return shard_; }
  // fp32 master values the optimizer updates (Note [master weights]): [padded_numel] with
  // master_full (stage 0), else [shard_numel].
  at::Tensor& master() { return master_; }
  const at::Tensor& master() const { return master_; }
  // After the optimizer updated master(): rounds it into the compute copy (mixed precision) and
  // makes the parameters current — stages 1–2 all-gather (a collective), stage 3 frees full().
  void publish_master(const comm::Collectives& comm);
  // Whether full() holds the current values of every coordinate.
  bool unsharded() const;
  // Before master() is written: when it is the shard (Note [parameter offload]), frees the
  // gathered copy (stale after the write) and waits for the host-to-device copies reading it.
  void prepare_master_write();

  // Stage 3: re-allocates full()'s storage and all-gathers every rank's shard into it (or waits
  // for the gather unshard_async started); no-op when already unsharded or when parameters are
  // not sharded.
  void unshard(const comm::Collectives& comm);
  // Stage 3 prefetch (Note [stage-3 prefetch] in state.h): starts the gather without waiting;
  // unshard() or reshard() waits for it. No-op when unsharded, pending or not sharded.
  void unshard_async(const comm::Collectives& comm);
  // Stage 3: frees full()'s storage (after waiting for a pending gather); no-op when parameters
  // are not sharded.
  void reshard();

  // Note [writes to a gathered unit] (stage 3). `fingerprint` maps a tensor to a 0-dim device
  // tensor that moves with any change of its bytes (the private front door's
  // state_fingerprint); an empty function stops the watch.
  using Fingerprint = std::function<at::Tensor(const at::Tensor&)>;
  void watch_gathered(Fingerprint fingerprint);
  // A 0-dim bool on full()'s device: whether a gathered copy changed between its gather and its
  // release since the last take (false when none did or nothing is watched); resets it.
  at::Tensor take_gathered_written();

  // The slice of a flat tensor ([padded_numel]) that parameter i occupies, with its shape.
  at::Tensor param_view(const at::Tensor& flat, size_t i) const;

  // Stages 0–1: makes every parameter's .grad the view of flat_grad ([padded_numel]) at its slice.
  // With keep_values, a .grad that is already that view is kept (autograd accumulated into it in
  // place), one that was replaced (by the user, or by autograd under create_graph) is copied into
  // the slice, and an undefined one (module.zero_grad() sets None) zeroes the slice; without, the
  // views are attached and the slices left as they are.
  void attach_grad_views(at::Tensor& flat_grad, bool keep_values);
  // A new [padded_numel] tensor of `dtype` with each parameter's .grad at its slice (zeros for
  // padding and for parameters without a gradient); resets every .grad to undefined.
  at::Tensor take_grads(at::ScalarType dtype);
  // Resets every parameter's .grad to undefined.
  void drop_grads();

  // Bytes of parameter storage this unit holds now on the parameters' device: the full buffer's
  // storage plus, in stage 3, the owned shard unless it is offloaded to the host; the fp32
  // master only where it is the parameter storage itself.
  int64_t param_bytes() const;
  // Bytes of the owned shard in host memory under parameter offload (on an accelerator), else 0.
  int64_t host_param_bytes() const;
  // Bytes of a separate fp32 master (mixed precision or offload; not when it is the shard), else 0.
  int64_t master_bytes() const;
  // The device the parameters are computed on (full()'s).
  c10::Device device() const { return full_.device(); }
  // Bytes the full buffer occupies when allocated.
  int64_t full_bytes() const;

 private:
  // Waits for the gather unshard_async started, if any; returns whether there was one.
  bool wait_gather();
  // A gather into full_ has completed: the parameters point at it again (Note [reading a
  // resharded parameter]) and the copy is fingerprinted (Note [writes to a gathered unit]).
  void complete_gather();
  // Note [writes to a gathered unit]: a gather completed (fingerprint it), a release is due
  // (compare).
  void note_gathered();
  void check_gathered();
  // The all-gather source on full()'s device: shard_ itself, or under parameter offload its copy
  // (kept in staged_ until the gather is waited for; Note [parameter offload]).
  at::Tensor& gather_source();

  std::vector<at::Tensor> params_;
  std::vector<std::vector<int64_t>> shapes_;  // each parameter's shape when flattened
  std::vector<std::string> names_;
  UnitLayout layout_;
  int64_t rank_;
  FlatParamOptions options_;
  at::Tensor full_;    // [padded_numel] param_dtype, every coordinate; parameters are views of it
  at::Tensor shard_;   // [shard_numel] param_dtype, owned: view of full_ (stages 0–2) or own (3)
  at::Tensor master_;  // fp32, Note [master weights]: aliases full_/shard_ unless separate_master()
  // A gather unshard_async started and nobody waited for yet, and the memory it writes
  // (Note [gathers land apart]): full_ adopts it at the wait (adopt_incoming).
  c10::intrusive_ptr<c10d::Work> pending_;
  at::Tensor incoming_;
  void adopt_incoming();
  // Note [parameter offload]: blocks until the last host-to-device copy of shard_ has run.
  void wait_host_reads();
  // Note [parameter offload]: the device copy of the host shard a gather reads, and the event
  // after the last such copy (recorded on the device's current stream).
  at::Tensor staged_;
  std::optional<c10::Event> host_read_done_;
  // Note [reading a resharded parameter]: points every parameter at full_'s storage (`gathered`),
  // or at its own storage that refuses every data access, at its place in the layout; returns the
  // names of those whose .data had been replaced.
  std::vector<std::string> point_params(bool gathered);
  // Throws naming `replaced` (point_params's) unless it is empty; under the watch the step is
  // refused too (the gathered-written flag).
  void refuse_replaced(const std::vector<std::string>& replaced);
  // Frees full_'s memory and points the parameters at their refusing storages (refusing any
  // replaced since).
  void release_full();
  // Note [writes to a gathered unit]: ORs `changed` (a 0-dim bool on the device) into the flag.
  void note_written(const at::Tensor& changed);
  // Note [writes to a gathered unit]: each parameter's version counter when the copy was noted.
  std::vector<int64_t> gathered_versions_;
  // One per parameter, naming it: the storage it has while the unit is resharded (stage 3).
  std::vector<c10::Storage> resharded_;
  // Note [views kept across a reshard]: what a view of full_ raises while the unit is resharded.
  std::string freed_message_;
  // Note [writes to a gathered unit]: the watch's fingerprint, that of the copy gathered now
  // (undefined when none is), and the OR of the differences found since the last take.
  Fingerprint fingerprint_;
  at::Tensor gathered_fingerprint_;
  at::Tensor gathered_written_;
};

}  // namespace dpzero::zero
