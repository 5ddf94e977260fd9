// src/dp/layer_ops.h — what the clipping book does with one DP layer call's input A and output
// gradient G: certified per-sample squared norms, what to keep until the group's clip factors are
// known, the clipped sums added into the engine's gradient slots, and the fused clip of a
// singleton group. One class per layer kind, each a thin dispatch to the kernels' per-sample ops
// (kernels/per_sample_ops.h, Note [per-sample ops]); the book (book.h) calls nothing else.
//
// Shapes (Note [per-sample ops]): A [B, ..., d_in] (Conv: [B, C_in, *spatial], already padded;
// Embedding: ids [B, ...]), G [B, ..., d_out]; every norm is [B] float32, certified (never below
// the exact value, Note [certified norms]); a scale/factor is [B] float32.
//
// `dests`: per parameter of the layer (its kind's order, weight first), the parameter's slot in
// its unit's flat float32 gradient buffer viewed in the parameter's shape, or an undefined tensor
// where the parameter is not trained.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace dpzero::dp {

// Per parameter of a layer (its kind's order): whether it is trained.
using Trainable = std::vector<bool>;

// Note [kept per-sample gradients] in kernels/per_sample/linear.h: what the book keeps of one layer
// call between its backward and its group's clip factors.
struct Kept {
  // Per parameter: its per-sample gradients [B, *shape] (float64 or float32), or undefined (not
  // trained, or summed later from `a` and `g`).
  std::vector<at::Tensor> grads;
  at::Tensor a, g;  // what the parameters without kept rows need; undefined when none does
  // [B] float32 certified squared norms of the call's whole gradient; undefined when no clipping
  // needs them, or (`pending`) until the group computes the weight's norm.
  at::Tensor sq;
  // Note [shared inputs]: the weight's norm waits for the group's other layers on the same input
  // `a`; the rest of the layer (its bias) contributes its kept rows `rest_rows` [B, d] float64,
  // their S `rest_s` and the coefficient that certifies them (kernels' KeptRest), or nothing.
  bool pending = false;
  at::Tensor rest_rows, rest_s;
  double rest_coef = 0.0;
  // Note [kept inputs stay unwritten] (book.cpp): `sq` is computed from `a` and `g` when the group
  // completes, by sq_norms, right before the clipped sums read the same a and g.
  bool deferred = false;
};

class LayerOps {
 public:
  explicit LayerOps(Trainable train) : train_(std::move(train)) {}
  virtual ~LayerOps() = default;

  const Trainable& train() const { return train_; }
  int64_t num_params() const { return static_cast<int64_t>(train_.size()); }

  // [B] float32 certified squared norms of the trained parameters' per-sample gradients.
  virtual at::Tensor sq_norms(const at::Tensor& a, const at::Tensor& g) const = 0;
  // dests[p] += Σ_i scale_i ∇_p ℓ_i for each parameter p with which[p] (Note [accumulating
  // clipped sums]); a sample with a zero or non-finite scale adds nothing.
  virtual void add_clipped_sums(const at::Tensor& a, const at::Tensor& g, const at::Tensor& scale,
                                const Trainable& which,
                                const std::vector<at::Tensor>& dests) const = 0;
  // What the book keeps until the factors are known: (a, g) by default, their norms deferred to
  // the group's completion (Kept::deferred); a kind with small per-sample gradients keeps those
  // rows instead, and their norms. `norms`: the norms are needed.
  virtual Kept keep(const at::Tensor& a, const at::Tensor& g, bool norms) const;
  // Note [shared inputs]: whether the weight's norm may be computed later, together with the
  // group's other layers reading the same input (Linear with a trained weight), and what to keep
  // meanwhile (Kept::pending).
  virtual bool shares_input() const { return false; }
  virtual Kept keep_pending(const at::Tensor& a, const at::Tensor& g) const;
  // A singleton group's fused clip with threshold `max_norm`: norms, factors (privacy/clipping.h,
  // `mode` "flat" or "automatic" with `gamma`) and clipped sums added into `dests`. -> [B] float32
  // factors (0 for a sample with a non-finite norm).
  virtual at::Tensor clip_into(const at::Tensor& a, const at::Tensor& g, double max_norm,
                               const std::string& mode, double gamma,
                               const std::vector<at::Tensor>& dests) const;

 protected:
  bool trains(size_t p) const { return p < train_.size() && train_[p]; }

 private:
  Trainable train_;
};

// nn.Linear (weight [d_out, d_in]) and, `transposed`, Hugging Face Conv1D (weight [d_in, d_out]).
std::shared_ptr<LayerOps> linear_ops(Trainable train, bool transposed);
// nn.Embedding [V, d]: A holds the ids; `padding_idx` rows get no gradient.
std::shared_ptr<LayerOps> embedding_ops(Trainable train, int64_t num_embeddings,
                                              std::optional<int64_t> padding_idx);
// nn.LayerNorm (rms = false: weight, bias), nn.RMSNorm and HF RMSNorms (rms = true: weight) over
// the last `normalized_ndim` dims. `eps`: nullopt means torch.finfo(A's dtype).eps
// (nn.RMSNorm(eps=None)).
std::shared_ptr<LayerOps> norm_ops(Trainable train, bool rms, std::optional<double> eps,
                                         int64_t normalized_ndim);
// nn.Conv1d / nn.Conv2d (weight [C_out, C_in / groups, *kernel_size]); A arrives padded when the
// module pads otherwise than with zeros (its `padding` here is then 0).
std::shared_ptr<LayerOps> conv_ops(Trainable train, std::vector<int64_t> kernel_size,
                                         std::vector<int64_t> stride,
                                         std::vector<int64_t> padding,
                                         std::vector<int64_t> dilation, int64_t groups);

// dest += sum, `sum` viewed in dest's shape (a parameter's slot in its unit's buffer).
void add_into(const at::Tensor& dest, const at::Tensor& sum);

// Kept per-sample gradients (Kept::grads): dests[p] += Σ_i scale_i grads[p]_i for every defined
// grads[p] (kernels' per_sample_clipped_sum: a zero or non-finite scale adds nothing), in one op.
void add_per_sample_clipped_sums(const std::vector<at::Tensor>& grads, const at::Tensor& scale,
                                 const std::vector<at::Tensor>& dests);

// The same, gathered from several layers under one scale and added by one op
// (dpzero::_add_per_sample_clipped_sums_), whose pairs may not share memory: a pair whose dest
// meets another dest of the same gather (a parameter a layer holds twice) has the pairs waiting
// added first. Dests of different gathers are the caller's to keep apart (Note [a group's kept
// rows in one add] in book.cpp).
class KeptSums {
 public:
  explicit KeptSums(at::Tensor scale) : scale_(std::move(scale)) {}
  // Gathers the pairs (dests[p], grads[p]) whose grads[p] is defined.
  void gather(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& dests);
  // Adds every pair waiting, under scale [B] float32; then none waits.
  void add();

 private:
  at::Tensor scale_;
  std::vector<at::Tensor> dests_, grads_;
};

// [B] float32 clip factors from [B] float32 certified norms (privacy/clipping.h through the
// dpzero::clip_factors op): 0 for a non-finite norm, norm * factor <= max_norm.
at::Tensor clip_factors(const at::Tensor& norms, double max_norm, const std::string& mode,
                        double gamma);

// The generic path (python/dpzero/private/fallback.py) reports per-sample gradients directly.
// [B] float32 certified squared norms of a call's per-sample gradients (per parameter [B, ...],
// undefined for a parameter not trained; at least one defined).
at::Tensor per_sample_sq_norms(const std::vector<at::Tensor>& grads);

}  // namespace dpzero::dp
