// src/zero/flat_param.h — one unit's trainable parameters as one flat fp32 buffer that the
// parameters' .data are views into (DESIGN.md §2 steps 2 and 7; layout from UnitLayout).
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
// be freed. While a unit is resharded its parameters keep their shapes but have no storage:
// reading them (state_dict(), printing values) is an error; ZeroState::full_parameters() gathers
// a copy.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "src/comm/collectives.h"
#include "src/zero/shard_plan.h"

namespace dpzero::zero {

class FlatParam {
 public:
  // params: the unit's trainable parameters in canonical order, fp32, one device, each
  //   params[i].numel() == layout.params()[i].numel; names: their canonical names (for errors).
  // Copies their values into a new full buffer; with `sync`, broadcasts rank 0's buffer so every
  // rank starts from the same values; sets each .data to its view. With `shard_params` (stage 3)
  // the owned slice is copied into its own tensor (the fp32 master shard) and the full buffer's
  // storage freed; otherwise the shard is a view of the full buffer.
  FlatParam(std::vector<at::Tensor> params, std::vector<std::string> names, UnitLayout layout,
            const comm::Collectives& comm, bool sync, bool shard_params);

  // The checks the constructor makes on `params` (fp32, one device, trainable), without touching
  // them: callers building several units check them all before flattening any.
  static void check_params(const std::vector<at::Tensor>& params,
                           const std::vector<std::string>& names);

  const UnitLayout& layout() const { return layout_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  const std::vector<std::string>& names() const { return names_; }
  bool shards_params() const { return shard_params_; }
  int64_t rank() const { return rank_; }

  // [padded_numel]; its storage has 0 bytes while the unit is resharded (stage 3).
  at::Tensor& full() { return full_; }
  // [shard_numel]: the coordinates this rank owns (the optimizer's master weights).
  at::Tensor& shard() { return shard_; }
  // Whether full() holds the current values of every coordinate.
  bool unsharded() const;

  // Stage 3: re-allocates full()'s storage and all-gathers every rank's shard into it; no-op when
  // already unsharded or when parameters are not sharded.
  void unshard(const comm::Collectives& comm);
  // Stage 3: frees full()'s storage; no-op when parameters are not sharded.
  void reshard();
  // Stages 1–2: after the optimizer updated shard() (a view of full()), all-gathers every rank's
  // updated shard into full().
  void all_gather_params(const comm::Collectives& comm);

  // The slice of a flat tensor ([padded_numel]) that parameter i occupies, with its shape.
  at::Tensor param_view(const at::Tensor& flat, size_t i) const;

  // Stages 0–1: makes every parameter's .grad the view of flat_grad ([padded_numel]) at its slice.
  // With keep_values, a .grad that is already that view is kept (autograd accumulated into it in
  // place), one that was replaced (by the user, or by autograd under create_graph) is copied into
  // the slice, and an undefined one (module.zero_grad() sets None) zeroes the slice; without, the
  // views are attached and the slices left as they are.
  void attach_grad_views(at::Tensor& flat_grad, bool keep_values);
  // Stages 2–3: a new [padded_numel] tensor with each parameter's .grad at its slice (zeros for
  // padding and for parameters without a gradient); resets every .grad to undefined.
  at::Tensor take_grads();
  // Resets every parameter's .grad to undefined.
  void drop_grads();

  // Bytes of parameter storage this unit holds now: the full buffer's storage plus, in stage 3,
  // the master shard.
  int64_t param_bytes() const;
  // Bytes the full buffer occupies when allocated.
  int64_t full_bytes() const;

 private:
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  UnitLayout layout_;
  int64_t rank_;
  bool shard_params_;
  at::Tensor full_;   // [padded_numel] every coordinate of the unit; parameters are views of it
  at::Tensor shard_;  // [shard_numel] owned coordinates: view of full_ (stages 0–2) or own storage
};

}  // namespace dpzero::zero
