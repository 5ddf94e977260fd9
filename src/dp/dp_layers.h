// src/dp/dp_layers.h — DP layers as C++ autograd functions: the forward of a Linear (or HF
// Conv1D), Embedding or LayerNorm call, whose backward node returns the gradient with respect to
// the layer's INPUT only and hands the layer's input A and output gradient G to the clipping book
// (book.h). Autograd never forms the weight gradient of a DP layer (design.md §2 step 3).
//
// Note [no parameter edges]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The node's only edge is to x. The output requires grad when x or a parameter does (token ids
// with a trained table), but autograd has no path from a DP layer to its parameters: their
// AccumulateGrad nodes run only for a use of the parameter outside a DP layer, which is what the
// escape hooks (python/dpzero/private/attach.py guard_hooks, PrivacyEngine's in C++) catch.
// With an edge per parameter, every backward ran each parameter's AccumulateGrad, and its hook,
// with an undefined gradient (148 of each per step of a 12-layer GPT-2). A consequence:
// torch.autograd.grad(loss, tensors) or backward(inputs=tensors) runs only the DP layers on a
// path to those tensors (autograd prunes the rest, and with parameters as the tensors every C++
// DP layer whose input leads to none of them). Clipping some layers and not others would make a
// step of part of the model, so the book refuses any DP layer's backward in such a pruned pass
// (Book::begin_backward): the loss is back-propagated whole, or not at all.
//
// Note [autocast] (python/dpzero/private/layers.py): under torch.autocast the forward's ops cast
// as autocast decides and G arrives in the output's dtype. Autograd runs a backward without
// autocast, so the node computes a Linear's input gradient in autocast's dtype, as autocast's
// matmul would (LayerNorm's in G's, autocast's float32), and returns it in x's dtype; A is x cast
// to the dtype the forward's matmul saw.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "src/dp/book.h"

namespace dpzero::dp {

// Who a DP layer call's backward reports to.
struct Report {
  std::weak_ptr<Book> book;
  int64_t generation = 0;  // the book's micro-batch, when the call registered
  int64_t part = -1;       // the call's part (Book::on_forward)
  // Set: the call may not be clipped (a refused root forward, a call outside the model, a
  // recomputed forward that a backward should never reach); the backward refuses with this text.
  std::optional<std::string> refusal;
};

// x [B, ..., d_in] -> x Wᵀ + b (nn.Linear, weight [d_out, d_in]) or, `transposed`, x W + b (HF
// Conv1D, weight [d_in, d_out]); `bias` [d_out] or undefined.
at::Tensor dp_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                     bool transposed, Report report);
// ids [B, ...] int -> weight[ids] (nn.Embedding [V, d]); padding_idx as nn.Embedding's.
at::Tensor dp_embedding(const at::Tensor& ids, const at::Tensor& weight,
                        std::optional<int64_t> padding_idx, Report report);
// x [B, ..., *normalized_shape] -> nn.LayerNorm's output (F.layer_norm); `bias` may be undefined.
at::Tensor dp_layer_norm(const at::Tensor& x, std::vector<int64_t> normalized_shape,
                         const at::Tensor& weight, const at::Tensor& bias, double eps,
                         Report report);

}  // namespace dpzero::dp
