// src/dp/dp_layers.cpp — see dp_layers.h.
#include "src/dp/dp_layers.h"

#include <utility>

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

namespace dpzero::dp {
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

std::optional<at::ScalarType> autocast_dtype(const at::Tensor& x) {
  const at::DeviceType device = x.device().type();
  if (!at::autocast::is_autocast_enabled(device)) return std::nullopt;
  return at::autocast::get_autocast_dtype(device);
}

// The backward node of one DP layer call: dL/dx to autograd, (A, G) to the book.
class DPLayerBackward : public Node {
 public:
  DPLayerBackward(std::string name, Report report, at::Tensor weight, bool transposed,
                  bool input_grad, std::optional<at::ScalarType> autocast)
      : name_(std::move(name)), report_(std::move(report)), weight_(std::move(weight)),
        transposed_(transposed), input_grad_(input_grad), autocast_(autocast) {}

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(grads.size() == 1 && grads[0].defined(), "dpzero: ", name_,
                " got no output gradient");
    // G arrives non-contiguous behind a permute (BERT's value projection): made contiguous once
    // here, not once in each of the input gradient's matmul, the norms and the clipped sum.
    const at::Tensor g = grads[0].contiguous();
    const at::Tensor x = x_.unpack();
    variable_list out(num_outputs());
    if (input_grad_ && should_compute_output(0)) {
      // The parameter is read now, not saved: at stage 3 it is gathered again for the backward.
      const at::Tensor w = weight_.to(g.scalar_type());
      out[0] = at::matmul(g, transposed_ ? w.t() : w).to(x.scalar_type());  // Note [autocast]
    }
    const at::Tensor a =
        autocast_ && x.is_floating_point() ? x.to(*autocast_) : x;  // what the matmul saw
    const std::shared_ptr<Book> book = report_.book.lock();
    TORCH_CHECK(book, "dpzero: ", name_, ": the private engine of this forward is gone");
    try {
      if (report_.refusal) book->refuse_backward(*report_.refusal);
      book->on_backward(report_.generation, report_.part, a, g);
    } catch (const PrivacyError& e) {
      rethrow_from_engine(e);  // Note [errors out of the autograd engine] in book.h
    }
    return out;
  }

  std::string name() const override { return name_; }
  void release_variables() override { x_.reset_data(); }

  SavedVariable x_;

 private:
  std::string name_;
  Report report_;
  at::Tensor weight_;  // the parameter itself (its storage is what stage 3 gathers)
  bool transposed_;
  bool input_grad_;    // the input is a float tensor (not ids)
  std::optional<at::ScalarType> autocast_;
};

// Builds the node over inputs (x, weight[, bias]) and attaches it to `out`.
at::Tensor with_backward(at::Tensor out, std::shared_ptr<DPLayerBackward> node,
                         const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& bias) {
  const bool needs = bias.defined() ? torch::autograd::compute_requires_grad(x, weight, bias)
                                    : torch::autograd::compute_requires_grad(x, weight);
  if (!needs) return out;
  node->set_next_edges(bias.defined() ? torch::autograd::collect_next_edges(x, weight, bias)
                                      : torch::autograd::collect_next_edges(x, weight));
  torch::autograd::set_history(out, node);
  node->x_ = SavedVariable(x, /*is_output=*/false);
  return out;
}

}  // namespace

at::Tensor dp_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                     bool transposed, Report report) {
  at::Tensor out;
  {
    const at::AutoGradMode no_grad(false);  // the node below is the only history
    if (transposed) {
      out = at::matmul(x, weight);
      if (bias.defined()) out = out + bias;
    } else {
      out = at::linear(x, weight, bias.defined() ? std::optional<at::Tensor>(bias)
                                                 : std::nullopt);
    }
  }
  auto node = std::shared_ptr<DPLayerBackward>(
      new DPLayerBackward(transposed ? "DPConv1DBackward" : "DPLinearBackward", std::move(report),
                          weight, transposed, /*input_grad=*/true, autocast_dtype(x)),
      torch::autograd::deleteNode);
  return with_backward(std::move(out), std::move(node), x, weight, bias);
}

at::Tensor dp_embedding(const at::Tensor& ids, const at::Tensor& weight,
                        std::optional<int64_t> padding_idx, Report report) {
  at::Tensor out;
  {
    const at::AutoGradMode no_grad(false);
    out = at::embedding(weight, ids, padding_idx.value_or(-1));
  }
  auto node = std::shared_ptr<DPLayerBackward>(
      new DPLayerBackward("DPEmbeddingBackward", std::move(report), weight, false,
                          /*input_grad=*/false, std::nullopt),
      torch::autograd::deleteNode);
  return with_backward(std::move(out), std::move(node), ids, weight, at::Tensor());
}

}  // namespace dpzero::dp
