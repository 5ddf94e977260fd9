// src/dp/modules.h — the DP layers as torch::nn modules, for LibTorch programs that train privately
// with no Python (dp::PrivacyEngine, privacy_engine.h). Each is the torch::nn module of the same
// name with the same parameters, initialisation and forward; once a PrivacyEngine has taken the
// model, a call with gradients on goes through the C++ autograd function of dp_layers.h, whose
// backward hands the call's input A and output gradient G to the clipping book (book.h) and gives
// autograd no weight gradient.
//
// Note [C++ batch dimension]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// The book clips row i of every part as example i (Note [one sample per row] in
// python/dpzero/private/book.py). The Python front door decides that dim 0 holds the examples
// from where each input came from (Note [batch provenance] in python/dpzero/private/provenance/examples.py); a C++ program has no
// such tracing. Here the layout is the module's contract, stated by its type and never guessed:
// each DP module's input is batch-first, x [B, ...] with B the micro-batch's rows, as Opacus's
// batch_first. PrivacyEngine::check_batch_first tests the contract once before training (the
// steps are refused until it passed, unless PrivacyOptions::trust_batch_first). In a batch-first
// model without ops across examples, row i of every DP layer's input A and output depends on
// example i alone, and example i's loss on those rows alone. So the check runs P = 3 examples,
// then P more times with example j replaced by another (the random streams rewound, so dropout
// draws alike): every DP call's rows other than j must come out bit for bit the same (an input
// mixed across the batch, x - x.mean(0), changes them: the per-row gradient G_iᵀ A_i would carry
// every example and its clip would bound nothing); and it back-propagates each example's loss
// alone, which must give every DP layer's output a gradient zero outside its own row (a layer
// whose dim 0 is not the examples, [T, B, d], or a loss across the batch fails this). What it
// cannot see: behaviour that changes with the batch size (it tries 3 rows) or with the data
// (branches), a model changed after the check, and a loss_of that is not the training forward. What
// is checked on every call catches some layout errors, not all: a call made while no micro-batch is
// handed out (PrivacyEngine::hand_out) is refused in its backward, the book refuses a call whose
// dim 0 is not the micro-batch's row count, and a Linear or LayerNorm input needs a batch dim
// besides its features. A model that moves the examples off dim 0 before a DP layer (a
// sequence-first [T, B, d] layout when T equals the micro-batch's rows) or mixes rows along dim 0
// (x - x.mean(0)) passes these checks and is clipped per row, not per example: such a model breaks
// the contract and must be written batch-first, without ops across examples.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "src/dp/dp_layers.h"
#include "src/dp/layer_ops.h"

namespace dpzero::dp {

class PrivacyEngine;
struct EngineSession;

// What every DP module offers the PrivacyEngine that takes its model.
class DPModule {
 public:
  virtual ~DPModule() = default;
  // The parameters in the kind's order (weight first); an undefined tensor where absent.
  virtual std::vector<at::Tensor> dp_parameters() const = 0;
  // The book's ops for this layer, `train` per dp_parameters().
  virtual std::shared_ptr<LayerOps> book_ops(const Trainable& train) const = 0;

  // Set by PrivacyEngine: calls register as the book's layer `layer` of `session`.
  void bind(std::weak_ptr<EngineSession> session, int64_t layer, std::string name);
  // Whether a live PrivacyEngine holds this module.
  bool taken() const { return !session_.expired(); }

 protected:
  // Whether this call goes through the book (an engine holds the model and gradients are on).
  bool bound() const;
  // PrivacyEngine::check_batch_first runs: the call runs plain on probe_leaf(parameters) and
  // hands its input and output to probed().
  bool probing() const;
  static at::Tensor probe_leaf(const at::Tensor& p);
  at::Tensor probed(const at::Tensor& input, at::Tensor out) const;
  // Registers this call with the book: its part, or the refusal its backward raises. `x`: the
  // call's input, which needs at least `min_dim` dims (examples on dim 0).
  Report report(const at::Tensor& x, int64_t min_dim) const;

 private:
  std::weak_ptr<EngineSession> session_;
  int64_t layer_ = -1;
  std::string name_;
};

namespace nn {

// torch::nn::Linear: x [B, ..., in] -> x Wᵀ + b, W [out, in], b [out].
class LinearImpl : public torch::nn::Module, public DPModule {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool bias = true);
  at::Tensor forward(const at::Tensor& x);
  std::vector<at::Tensor> dp_parameters() const override { return {weight, bias}; }
  std::shared_ptr<LayerOps> book_ops(const Trainable& train) const override;

  at::Tensor weight, bias;
};
TORCH_MODULE(Linear);

// torch::nn::Embedding: ids [B, ...] int64 -> W[ids], W [num, dim] ~ N(0, 1).
class EmbeddingImpl : public torch::nn::Module, public DPModule {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim);
  at::Tensor forward(const at::Tensor& ids);
  std::vector<at::Tensor> dp_parameters() const override { return {weight}; }
  std::shared_ptr<LayerOps> book_ops(const Trainable& train) const override;

  at::Tensor weight;
};
TORCH_MODULE(Embedding);

// torch::nn::LayerNorm over the last dim: x [B, ..., dim] -> normalised · w + b.
class LayerNormImpl : public torch::nn::Module, public DPModule {
 public:
  explicit LayerNormImpl(int64_t dim, double eps = 1e-5);
  at::Tensor forward(const at::Tensor& x);
  std::vector<at::Tensor> dp_parameters() const override { return {weight, bias}; }
  std::shared_ptr<LayerOps> book_ops(const Trainable& train) const override;

  at::Tensor weight, bias;
  double eps;
};
TORCH_MODULE(LayerNorm);

}  // namespace nn
}  // namespace dpzero::dp
