// src/dp/layer_ops.cpp — see layer_ops.h.
#include "src/dp/layer_ops.h"

#include <algorithm>
#include <limits>
#include <utility>

#include <c10/util/Exception.h>

#include "kernels/per_sample_ops.h"
#include "src/dp/clip_group.h"

namespace dpzero::dp {
namespace {

namespace ps = kernels::per_sample;

constexpr int64_t kAuto = 0;  // the ops' `method`: ghost or direct, whichever is cheaper

// A fused *_clip op's result: its weight's and (`bias`) bias's sums added into dests; -> factors.
at::Tensor added(const ps::ClipResult& result, bool bias, const std::vector<at::Tensor>& dests) {
  const auto& [gw, gb, sq, factors, nonfinite] = result;
  add_into(dests[0], gw);
  if (bias) add_into(dests[1], gb);
  return factors;
}

// Factors from certified squared norms (privacy/clipping.h through dpzero::clip_factors).
at::Tensor factors_of(const at::Tensor& sq, double max_norm, const std::string& mode,
                      double gamma) {
  return std::get<0>(ps::clip_from_sq_norms(kernels::as_dtype(sq, at::kDouble), max_norm, mode, gamma));
}

class LinearOps final : public LayerOps {
 public:
  LinearOps(Trainable train, bool transposed)
      : LayerOps(std::move(train)), transposed_(transposed) {}

  at::Tensor sq_norms(const at::Tensor& a, const at::Tensor& g) const override {
    if (trains(0)) return ps::linear_sq_norms(a, g, trains(1), kAuto);
    return ps::bias_sq_norms(g);
  }

  void add_clipped_sums(const at::Tensor& a, const at::Tensor& g, const at::Tensor& scale,
                        const Trainable& which,
                        const std::vector<at::Tensor>& dests) const override {
    if (which[0]) {
      at::Tensor dest = dests[0];
      ps::add_linear_clipped_sum_(dest, a, g, scale, transposed_);
    }
    if (which.size() > 1 && which[1]) add_into(dests[1], ps::bias_clipped_sum(g, scale));
  }

  Kept keep(const at::Tensor& a, const at::Tensor& g, bool norms) const override {
    if (!trains(1)) return LayerOps::keep(a, g, norms);
    auto [gb, sq_b] = ps::bias_per_sample(g);
    Kept kept;
    kept.grads = {at::Tensor(), gb};
    if (trains(0)) {
      kept.a = a;
      kept.g = g;
    }
    // Note [kept inputs stay unwritten] in book.cpp: a trained weight's norm is read from a and g
    // when the group completes, so with norms asked for the book keeps them pending instead.
    TORCH_CHECK(!(norms && trains(0)), "dpzero::dp::LinearOps::keep: a trained weight's norm is "
                "computed from A and G at its group's completion (keep_pending)");
    if (norms) kept.sq = sq_b;
    return kept;
  }

  bool shares_input() const override { return trains(0); }

  Kept keep_pending(const at::Tensor& a, const at::Tensor& g) const override {
    Kept kept;
    kept.grads = {at::Tensor(), at::Tensor()};
    kept.a = a;
    kept.g = g;
    kept.pending = true;
    if (trains(1)) {
      const ps::KeptRest rest = ps::bias_rows(g);
      kept.grads[1] = kept.rest_rows = rest.rows;
      kept.rest_s = rest.s;
      kept.rest_coef = rest.coef;
    }
    return kept;
  }

  at::Tensor clip_into(const at::Tensor& a, const at::Tensor& g, double max_norm,
                       const std::string& mode, double gamma,
                       const std::vector<at::Tensor>& dests) const override {
    if (!trains(0)) return LayerOps::clip_into(a, g, max_norm, mode, gamma, dests);
    return added(ps::linear_clip(a, g, max_norm, mode, gamma, trains(1), transposed_, kAuto),
                 trains(1), dests);
  }

 private:
  bool transposed_;
};

class EmbeddingOps final : public LayerOps {
 public:
  EmbeddingOps(Trainable train, int64_t num_embeddings, std::optional<int64_t> padding_idx)
      : LayerOps(std::move(train)), num_embeddings_(num_embeddings), padding_idx_(padding_idx) {}

  at::Tensor sq_norms(const at::Tensor& ids, const at::Tensor& g) const override {
    return ps::embedding_sq_norms(ids, g, num_embeddings_, padding_idx_, kAuto);
  }

  void add_clipped_sums(const at::Tensor& ids, const at::Tensor& g, const at::Tensor& scale,
                        const Trainable& which,
                        const std::vector<at::Tensor>& dests) const override {
    if (!which[0]) return;
    at::Tensor dest = dests[0];
    ps::add_embedding_clipped_sum_(dest, ids, g, scale, num_embeddings_, padding_idx_);
  }

  at::Tensor clip_into(const at::Tensor& ids, const at::Tensor& g, double max_norm,
                       const std::string& mode, double gamma,
                       const std::vector<at::Tensor>& dests) const override {
    auto [gw, sq, factors, nonfinite] = ps::embedding_clip(ids, g, num_embeddings_, max_norm,
                                                           mode, gamma, padding_idx_, kAuto);
    add_into(dests[0], gw);
    return factors;
  }

 private:
  int64_t num_embeddings_;
  std::optional<int64_t> padding_idx_;
};

class NormOps final : public LayerOps {
 public:
  NormOps(Trainable train, bool rms, std::optional<double> eps, int64_t normalized_ndim)
      : LayerOps(std::move(train)), rms_(rms), eps_(eps), nd_(normalized_ndim) {}

  at::Tensor sq_norms(const at::Tensor& x, const at::Tensor& g) const override {
    if (trains(0)) return ps::layer_norm_sq_norms(x, g, eps(x), rms_, trains(1), nd_);
    return ps::bias_sq_norms(flat(g));
  }

  void add_clipped_sums(const at::Tensor& x, const at::Tensor& g, const at::Tensor& scale,
                        const Trainable& which,
                        const std::vector<at::Tensor>& dests) const override {
    if (which[0]) add_into(dests[0], ps::layer_norm_clipped_sum(x, g, scale, eps(x), rms_, nd_));
    if (which.size() > 1 && which[1]) add_into(dests[1], ps::bias_clipped_sum(flat(g), scale));
  }

  // The weight's and the bias's certified norms summed as certified_sum of the two would: the
  // bias's rows certified and added in the weight's certification pass (_certify's rest_rows).
  Kept keep(const at::Tensor& x, const at::Tensor& g, bool norms) const override {
    Kept kept;
    kept.grads.resize(train().size());
    at::Tensor sq;
    if (!trains(0)) {
      if (trains(1)) std::tie(kept.grads[1], sq) = ps::bias_per_sample(flat(g));
    } else {
      const ps::KeptRest rest = trains(1) ? ps::bias_rows(flat(g)) : ps::KeptRest{};
      if (trains(1)) kept.grads[1] = rest.rows;
      std::tie(kept.grads[0], sq) = ps::layer_norm_per_sample_plus(x, g, eps(x), rms_, nd_, rest);
    }
    if (norms) kept.sq = sq;
    return kept;
  }

  at::Tensor clip_into(const at::Tensor& x, const at::Tensor& g, double max_norm,
                       const std::string& mode, double gamma,
                       const std::vector<at::Tensor>& dests) const override {
    if (!trains(0)) return LayerOps::clip_into(x, g, max_norm, mode, gamma, dests);
    return added(ps::layer_norm_clip(x, g, eps(x), max_norm, mode, gamma, rms_, trains(1), nd_),
                 trains(1), dests);
  }

 private:
  // nn.RMSNorm(eps=None) uses torch.finfo(input dtype).eps.
  double eps(const at::Tensor& x) const {
    if (eps_) return *eps_;
    switch (x.scalar_type()) {
      case at::kDouble: return std::numeric_limits<double>::epsilon();
      case at::kHalf: return 0.0009765625;     // 2^-10
      case at::kBFloat16: return 0.0078125;    // 2^-7
      default: return std::numeric_limits<float>::epsilon();
    }
  }
  // G with the normalized dims flattened into one (the bias's dim last).
  at::Tensor flat(const at::Tensor& g) const { return nd_ > 1 ? g.flatten(-nd_) : g; }

  bool rms_;
  std::optional<double> eps_;
  int64_t nd_;
};

class ConvOps final : public LayerOps {
 public:
  ConvOps(Trainable train, std::vector<int64_t> kernel_size, std::vector<int64_t> stride,
          std::vector<int64_t> padding, std::vector<int64_t> dilation, int64_t groups)
      : LayerOps(std::move(train)), kernel_(std::move(kernel_size)), stride_(std::move(stride)),
        padding_(std::move(padding)), dilation_(std::move(dilation)), groups_(groups) {}

  at::Tensor sq_norms(const at::Tensor& x, const at::Tensor& g) const override {
    if (trains(0)) {
      return ps::conv_sq_norms(x, g, kernel_, stride_, padding_, dilation_, groups_, trains(1),
                               kAuto);
    }
    return ps::bias_sq_norms(g.movedim(1, -1));
  }

  void add_clipped_sums(const at::Tensor& x, const at::Tensor& g, const at::Tensor& scale,
                        const Trainable& which,
                        const std::vector<at::Tensor>& dests) const override {
    if (which[0]) {
      add_into(dests[0], ps::conv_clipped_sum(x, g, scale, kernel_, stride_, padding_, dilation_,
                                              groups_));
    }
    if (which.size() > 1 && which[1]) {
      add_into(dests[1], ps::bias_clipped_sum(g.movedim(1, -1), scale));
    }
  }

  // A trained bias alone (the weight frozen, as BitFit trains): its per-sample rows and their
  // norms, not the input x (Note [kept per-sample gradients]). A trained weight whose norms take
  // the direct path: its per-sample gradients too, where they are no bigger than x and g (Note
  // [kept conv gradients] in kernels/per_sample/conv.h).
  Kept keep(const at::Tensor& x, const at::Tensor& g, bool norms) const override {
    Kept kept;
    kept.grads.resize(train().size());
    at::Tensor sq;
    if (trains(0)) {
      auto rows = ps::conv_per_sample(x, g, kernel_, stride_, padding_, dilation_, groups_,
                                      trains(1));
      if (!rows) return LayerOps::keep(x, g, norms);
      std::tie(kept.grads[0], kept.grads[1], sq) = *rows;
    } else {
      std::tie(kept.grads[1], sq) = ps::bias_per_sample(g.movedim(1, -1));
    }
    if (norms) kept.sq = sq;
    return kept;
  }

  at::Tensor clip_into(const at::Tensor& x, const at::Tensor& g, double max_norm,
                       const std::string& mode, double gamma,
                       const std::vector<at::Tensor>& dests) const override {
    if (!trains(0)) return LayerOps::clip_into(x, g, max_norm, mode, gamma, dests);
    return added(ps::conv_clip(x, g, kernel_, stride_, padding_, dilation_, groups_, max_norm,
                               mode, gamma, trains(1), kAuto),
                 trains(1), dests);
  }

 private:
  std::vector<int64_t> kernel_, stride_, padding_, dilation_;
  int64_t groups_;
};

}  // namespace

void add_into(const at::Tensor& dest, const at::Tensor& sum) {
  at::Tensor(dest).add_(sum.sizes() == dest.sizes() ? sum : sum.view(dest.sizes()));
}

void KeptSums::gather(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& dests) {
  size_t first = dests_.size();  // this gather's first pair still waiting
  for (size_t p = 0; p < grads.size(); ++p) {
    if (!grads[p].defined()) continue;
    const bool meets = std::any_of(dests_.begin() + first, dests_.end(), [&](const auto& dest) {
      return !kernels::sample_products::disjoint(dest, dests[p]);
    });
    if (meets) {  // the earlier pair's sum lands first, as one op per pair added it
      add();
      first = 0;
    }
    dests_.push_back(dests[p]);
    grads_.push_back(grads[p]);
  }
}

void KeptSums::add() {
  if (!dests_.empty()) ps::add_per_sample_clipped_sums_(dests_, grads_, scale_);
  dests_.clear();
  grads_.clear();
}

void add_per_sample_clipped_sums(const std::vector<at::Tensor>& grads, const at::Tensor& scale,
                                 const std::vector<at::Tensor>& dests) {
  KeptSums sums(scale);
  sums.gather(grads, dests);
  sums.add();
}

at::Tensor clip_factors(const at::Tensor& norms, double max_norm, const std::string& mode,
                        double gamma) {
  using Signature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, double,
                                                      c10::string_view, double);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::clip_factors", "")
                             .typed<Signature>();
  return std::get<0>(op.call(norms, max_norm, mode, gamma));
}

Kept LayerOps::keep(const at::Tensor& a, const at::Tensor& g, bool norms) const {
  Kept kept;
  kept.grads.resize(train_.size());
  kept.a = a;
  kept.g = g;
  kept.deferred = norms;  // Note [kept inputs stay unwritten] in book.cpp
  return kept;
}

Kept LayerOps::keep_pending(const at::Tensor&, const at::Tensor&) const {
  TORCH_CHECK(false, "dpzero::dp::LayerOps: this layer kind computes its own norms (no shared "
              "input)");
}

at::Tensor LayerOps::clip_into(const at::Tensor& a, const at::Tensor& g, double max_norm,
                               const std::string& mode, double gamma,
                               const std::vector<at::Tensor>& dests) const {
  const at::Tensor factors = factors_of(sq_norms(a, g), max_norm, mode, gamma);
  add_clipped_sums(a, g, factors, train_, dests);
  return factors;
}

std::shared_ptr<LayerOps> linear_ops(Trainable train, bool transposed) {
  TORCH_CHECK(train.size() == 2, "dpzero::dp::linear_ops: (weight, bias) expected, got ",
              train.size(), " parameters");
  return std::make_shared<LinearOps>(std::move(train), transposed);
}

std::shared_ptr<LayerOps> embedding_ops(Trainable train, int64_t num_embeddings,
                                              std::optional<int64_t> padding_idx) {
  TORCH_CHECK(train.size() == 1, "dpzero::dp::embedding_ops: (weight) expected, got ",
              train.size(), " parameters");
  return std::make_shared<EmbeddingOps>(std::move(train), num_embeddings, padding_idx);
}

std::shared_ptr<LayerOps> norm_ops(Trainable train, bool rms, std::optional<double> eps,
                                         int64_t normalized_ndim) {
  TORCH_CHECK(train.size() == (rms ? 1u : 2u), "dpzero::dp::norm_ops: ",
              rms ? "(weight)" : "(weight, bias)", " expected, got ", train.size(),
              " parameters");
  TORCH_CHECK(normalized_ndim >= 1, "dpzero::dp::norm_ops: normalized_ndim must be >= 1, got ",
              normalized_ndim);
  return std::make_shared<NormOps>(std::move(train), rms, eps, normalized_ndim);
}

std::shared_ptr<LayerOps> conv_ops(Trainable train, std::vector<int64_t> kernel_size,
                                         std::vector<int64_t> stride,
                                         std::vector<int64_t> padding,
                                         std::vector<int64_t> dilation, int64_t groups) {
  TORCH_CHECK(train.size() == 2, "dpzero::dp::conv_ops: (weight, bias) expected, got ",
              train.size(), " parameters");
  return std::make_shared<ConvOps>(std::move(train), std::move(kernel_size), std::move(stride),
                                   std::move(padding), std::move(dilation), groups);
}

at::Tensor per_sample_sq_norms(const std::vector<at::Tensor>& grads) {
  return ps::kept_rows_sq_norms(grads);
}

}  // namespace dpzero::dp
