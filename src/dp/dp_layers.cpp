// src/dp/dp_layers.cpp — see dp_layers.h.
#include "src/dp/dp_layers.h"

#include <tuple>
#include <utility>
#include <vector>

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include "kernels/per_sample_checks.h"  // as_dtype
#include "src/dp/norm_schedule.h"

namespace dpzero::dp {
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// A possibly undefined tensor as ATen's optional argument.
std::optional<at::Tensor> if_defined(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

std::optional<at::ScalarType> autocast_dtype(const at::Tensor& x) {
  const at::DeviceType device = x.device().type();
  if (!at::autocast::is_autocast_enabled(device)) return std::nullopt;
  return at::autocast::get_autocast_dtype(device);
}

// The backward node of one DP layer call: dL/dx to autograd, (A, G) to the book. A kind says how
// to get the input gradient and A.
class DPLayerBackward : public Node {
 public:
  DPLayerBackward(std::string name, Report report)
      : name_(std::move(name)), report_(std::move(report)) {}

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(grads.size() == 1, "dpzero: ", name_, " got ", grads.size(),
                " output gradients");
    // G arrives non-contiguous behind a permute (BERT's value projection): made contiguous once
    // here, not once in each of the input gradient's matmul, the norms and the clipped sum. An
    // undefined G (the output did not reach the loss) is zeros, as for a Python Function.
    const at::Tensor g =
        grads[0].defined() ? grads[0].contiguous() : input_metadata(0).zeros_like();
    const at::Tensor x = x_.unpack();
    variable_list out(num_outputs());
    if (should_compute_output(0)) out[0] = input_grad(x, g);
    const std::shared_ptr<Book> book = report_.book.lock();
    TORCH_CHECK(book, "dpzero: ", name_, ": the private engine of this forward is gone");
    try {
      if (report_.refusal) book->refuse_backward(*report_.refusal);
      book->on_backward(report_.generation, report_.part, batch_input(x), g);
    } catch (const PrivacyError& e) {
      rethrow_from_engine(e);  // Note [errors out of the autograd engine] in book.h
    }
    return out;
  }

  std::string name() const override { return name_; }
  void release_variables() override { x_.reset_data(); }

  SavedVariable x_;

 protected:
  // dL/dx from G, in x's dtype (an undefined tensor where x has no gradient).
  virtual at::Tensor input_grad(const at::Tensor& x, const at::Tensor& g) = 0;
  // A as the book's ops take it.
  virtual at::Tensor batch_input(const at::Tensor& x) { return x; }

 private:
  std::string name_;
  Report report_;
};

class LinearBackward final : public DPLayerBackward {
 public:
  LinearBackward(Report report, at::Tensor weight, bool transposed,
                 std::optional<at::ScalarType> autocast)
      : DPLayerBackward(transposed ? "DPConv1DBackward" : "DPLinearBackward", std::move(report)),
        weight_(std::move(weight)),
        transposed_(transposed),
        autocast_(autocast) {}

 protected:
  at::Tensor input_grad(const at::Tensor& x, const at::Tensor& g) override {
    // The parameter is read now, not saved: at stage 3 it is gathered again for the backward.
    // Note [autocast]: in the dtype autocast's matmul would use.
    const at::Tensor gc = autocast_ ? g.to(*autocast_) : g;
    const at::Tensor w = kernels::as_dtype(weight_, gc.scalar_type());
    return kernels::as_dtype(at::matmul(gc, transposed_ ? w.t() : w), x.scalar_type());
  }
  at::Tensor batch_input(const at::Tensor& x) override {  // what the forward's matmul saw
    return autocast_ && x.is_floating_point() ? x.to(*autocast_) : x;
  }

 private:
  at::Tensor weight_;  // the parameter itself (its storage is what stage 3 gathers)
  bool transposed_;
  std::optional<at::ScalarType> autocast_;
};

class EmbeddingBackward final : public DPLayerBackward {
 public:
  explicit EmbeddingBackward(Report report)
      : DPLayerBackward("DPEmbeddingBackward", std::move(report)) {}

 protected:
  at::Tensor input_grad(const at::Tensor&, const at::Tensor&) override {
    return at::Tensor();  // ids have no gradient
  }
};

// nn.LayerNorm. Without autocast the input gradient is ATen's layer-norm backward on the forward's
// own x, parameters, mean and 1/std, as ATen's layer-norm node computes it (a mixed forward, 16-bit
// x with float32 parameters, included). Under autocast layer_norm runs in float32 (autocast's fp32
// list): G arrives in the output's dtype, and the input gradient is that of the forward in G's
// dtype, its statistics recomputed there, cast back to x's. A is x itself (the per-sample ops read
// 16-bit inputs and compute in float64).
class LayerNormBackward final : public DPLayerBackward {
 public:
  LayerNormBackward(Report report, std::vector<int64_t> normalized_shape, at::Tensor weight,
                    at::Tensor bias, double eps)
      : DPLayerBackward("DPLayerNormBackward", std::move(report)),
        shape_(std::move(normalized_shape)),
        weight_(std::move(weight)),
        bias_(std::move(bias)),
        eps_(eps) {}

  void release_variables() override {
    DPLayerBackward::release_variables();
    mean_.reset_data();
    rstd_.reset_data();
  }

  SavedVariable mean_, rstd_;  // the forward's statistics (undefined under autocast)

 protected:
  at::Tensor input_grad(const at::Tensor& x, const at::Tensor& g) override {
    const at::Tensor mean = mean_.unpack();
    if (mean.defined()) {  // no autocast: the forward's own statistics and parameters
      return std::get<0>(at::native_layer_norm_backward(g, x, shape_, mean, rstd_.unpack(),
                                                        if_defined(weight_), if_defined(bias_),
                                                        {true, false, false}));
    }
    const at::ScalarType dtype = g.scalar_type();
    const at::Tensor xc = x.to(dtype);
    const auto w = if_defined(weight_.defined() ? weight_.to(dtype) : at::Tensor());
    const auto b = if_defined(bias_.defined() ? bias_.to(dtype) : at::Tensor());
    const auto [y, stat_mean, stat_rstd] = at::native_layer_norm(xc, shape_, w, b, eps_);
    const auto [gx, gw, gb] = at::native_layer_norm_backward(g, xc, shape_, stat_mean, stat_rstd,
                                                             w, b, {true, false, false});
    return gx.to(x.scalar_type());
  }

 private:
  std::vector<int64_t> shape_;
  at::Tensor weight_, bias_;  // the parameters themselves (read in the backward, as Linear's)
  double eps_;
};

// Attaches `node` to `out` when x or a parameter requires grad. Its one edge is x's: the
// parameters get no edge (Note [no parameter edges] in dp_layers.h).
at::Tensor with_backward(at::Tensor out, std::shared_ptr<DPLayerBackward> node, const at::Tensor& x,
                         const at::Tensor& weight, const at::Tensor& bias) {
  const bool needs = bias.defined() ? torch::autograd::compute_requires_grad(x, weight, bias)
                                    : torch::autograd::compute_requires_grad(x, weight);
  if (!needs) return out;
  node->set_next_edges(torch::autograd::collect_next_edges(x));
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
    if (transposed && bias.defined()) {  // HF Conv1D's own forward: one addmm over the rows
      std::vector<int64_t> shape = x.sizes().vec();
      shape.back() = weight.size(1);
      out = at::addmm(bias, x.reshape({-1, x.size(-1)}), weight).view(shape);
    } else if (transposed) {
      out = at::matmul(x, weight);
    } else {
      out = at::linear(x, weight, if_defined(bias));
    }
  }
  const std::optional<at::ScalarType> autocast = autocast_dtype(x);
  const Report noted = report;
  auto node = std::shared_ptr<DPLayerBackward>(
      new LinearBackward(std::move(report), weight, transposed, autocast),
      torch::autograd::deleteNode);
  out = with_backward(std::move(out), std::move(node), x, weight, bias);
  // Note [norms when their input is done] in book.cpp, when asked for: the tensor the backward
  // reports as A (under autocast a cast made in the backward, which no other call shares).
  if (early_norms() && !autocast && !noted.refusal && out.grad_fn() && x.has_storage()) {
    if (const std::shared_ptr<Book> book = noted.book.lock()) {
      book->note_input(noted.generation, noted.part, x);
    }
  }
  return out;
}

at::Tensor dp_embedding(const at::Tensor& ids, const at::Tensor& weight,
                        std::optional<int64_t> padding_idx, Report report) {
  at::Tensor out;
  {
    const at::AutoGradMode no_grad(false);
    out = at::embedding(weight, ids, padding_idx.value_or(-1));
  }
  auto node = std::shared_ptr<DPLayerBackward>(new EmbeddingBackward(std::move(report)),
                                               torch::autograd::deleteNode);
  return with_backward(std::move(out), std::move(node), ids, weight, at::Tensor());
}

at::Tensor dp_layer_norm(const at::Tensor& x, std::vector<int64_t> normalized_shape,
                         const at::Tensor& weight, const at::Tensor& bias, double eps,
                         Report report) {
  TORCH_CHECK(weight.defined(), "dpzero::dp::dp_layer_norm: a DP LayerNorm has a weight");
  at::Tensor out, mean, rstd;
  {
    const at::AutoGradMode no_grad(false);
    if (autocast_dtype(x)) {  // autocast's layer_norm entry casts to float32 (Note [autocast])
      out = at::layer_norm(x, normalized_shape, weight, if_defined(bias), eps);
    } else {  // what at::layer_norm computes, with the statistics the backward needs
      std::tie(out, mean, rstd) =
          at::native_layer_norm(x, normalized_shape, weight, if_defined(bias), eps);
    }
  }
  auto node = std::shared_ptr<LayerNormBackward>(
      new LayerNormBackward(std::move(report), std::move(normalized_shape), weight, bias, eps),
      torch::autograd::deleteNode);
  LayerNormBackward* const attached = node.get();
  out = with_backward(std::move(out), std::move(node), x, weight, bias);
  if (mean.defined() && out.grad_fn().get() == attached) {  // saved only for a node in the graph
    attached->mean_ = SavedVariable(mean, /*is_output=*/false);
    attached->rstd_ = SavedVariable(rstd, /*is_output=*/false);
  }
  return out;
}

}  // namespace dpzero::dp
