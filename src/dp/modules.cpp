// src/dp/modules.cpp — see modules.h.
#include "src/dp/modules.h"

#include <cmath>
#include <utility>

#include <torch/autograd.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/init.h>

#include "src/dp/privacy_engine.h"

namespace dpzero::dp {

void DPModule::bind(std::weak_ptr<EngineSession> session, int64_t layer, std::string name) {
  session_ = std::move(session);
  layer_ = layer;
  name_ = std::move(name);
}

bool DPModule::bound() const { return torch::GradMode::is_enabled() && !session_.expired(); }

bool DPModule::probing() const {
  const std::shared_ptr<EngineSession> session = session_.lock();
  return session && session->probing;
}

at::Tensor DPModule::probe_leaf(const at::Tensor& p) {
  return p.defined() ? p.detach().requires_grad_(true) : p;
}

at::Tensor DPModule::probed(const at::Tensor& input, at::Tensor out) const {
  session_.lock()->probe_calls.push_back({name_, input.detach(), out});
  return out;
}

Report DPModule::report(const at::Tensor& x, int64_t min_dim) const {
  const std::shared_ptr<EngineSession> session = session_.lock();
  TORCH_CHECK(session, "dpzero: DP layer '", name_, "': its PrivacyEngine is gone");
  TORCH_CHECK(x.dim() >= min_dim, "dpzero: DP layer '", name_, "' got an input of shape ",
              x.sizes(), "; it needs the examples on dim 0 besides ", min_dim - 1,
              " feature dim(s) (Note [C++ batch dimension] in src/dp/modules.h)");
  Report report;
  report.book = session->book;
  if (!session->handed_out) {
    report.refusal = "DP layer '" + name_ +
                     "' ran with gradients on while no micro-batch was handed out "
                     "(dpzero::dp::PrivacyEngine::hand_out or own_batch): which rows are examples "
                     "is unknown, so its gradient cannot be clipped; hand the batch out before "
                     "the forward, or run it under torch::NoGradGuard";
    return report;
  }
  report.part = session->book->on_forward(layer_);
  session->book->set_verdict(report.part);  // Note [C++ batch dimension]
  report.generation = session->book->generation();
  return report;
}

namespace nn {

// torch::nn::Linear's initialisation (reset_parameters): kaiming_uniform_(a = √5) on the weight,
// U(-1/√in, 1/√in) on the bias.
LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, bool with_bias) {
  TORCH_CHECK(in_features > 0 && out_features > 0, "dpzero::dp::nn::Linear: in_features (",
              in_features, ") and out_features (", out_features, ") must be positive");
  weight = register_parameter("weight", torch::empty({out_features, in_features}));
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (with_bias) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
    bias = register_parameter("bias", torch::empty({out_features}));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

at::Tensor LinearImpl::forward(const at::Tensor& x) {
  if (!bound()) return torch::nn::functional::linear(x, weight, bias);
  if (probing())
    return probed(x, torch::nn::functional::linear(x, probe_leaf(weight), probe_leaf(bias)));
  return dp_linear(x, weight, bias, /*transposed=*/false, report(x, 2));
}

std::shared_ptr<LayerOps> LinearImpl::book_ops(const Trainable& train) const {
  return linear_ops(train, /*transposed=*/false);
}

EmbeddingImpl::EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim) {
  TORCH_CHECK(num_embeddings > 0 && embedding_dim > 0,
              "dpzero::dp::nn::Embedding: num_embeddings (", num_embeddings,
              ") and embedding_dim (", embedding_dim, ") must be positive");
  weight = register_parameter("weight", torch::randn({num_embeddings, embedding_dim}));
}

at::Tensor EmbeddingImpl::forward(const at::Tensor& ids) {
  if (!bound()) return at::embedding(weight, ids);
  if (probing()) return probed(ids, at::embedding(probe_leaf(weight), ids));
  return dp_embedding(ids, weight, std::nullopt, report(ids, 1));
}

std::shared_ptr<LayerOps> EmbeddingImpl::book_ops(const Trainable& train) const {
  return embedding_ops(train, weight.size(0), std::nullopt);
}

LayerNormImpl::LayerNormImpl(int64_t dim, double eps) : eps(eps) {
  TORCH_CHECK(dim > 0, "dpzero::dp::nn::LayerNorm: dim must be positive, got ", dim);
  weight = register_parameter("weight", torch::ones({dim}));
  bias = register_parameter("bias", torch::zeros({dim}));
}

at::Tensor LayerNormImpl::forward(const at::Tensor& x) {
  if (!bound()) return at::layer_norm(x, {weight.size(0)}, weight, bias, eps);
  if (probing())
    return probed(x,
                  at::layer_norm(x, {weight.size(0)}, probe_leaf(weight), probe_leaf(bias), eps));
  return dp_layer_norm(x, {weight.size(0)}, weight, bias, eps, report(x, 2));
}

std::shared_ptr<LayerOps> LayerNormImpl::book_ops(const Trainable& train) const {
  return norm_ops(train, /*rms=*/false, eps, /*normalized_ndim=*/1);
}

}  // namespace nn
}  // namespace dpzero::dp
