// experiments/cpp_api/models.h — the two models of the C++ API example (private_train.cpp) and of
// its tests, written with dpzero's DP modules (src/dp/modules.h), batch-first throughout (Note
// [C++ batch dimension]). tests/python/test_cpp_api.py builds the same models in Python, with the
// same parameter names in the same order, and checks that both front doors take the same step.
#pragma once

#include <cmath>
#include <cstdint>

#include <torch/torch.h>

#include "src/dp/modules.h"

namespace dpzero::example {

namespace dpnn = dpzero::dp::nn;

// x [B, in] -> logits [B, classes]: fc1, ReLU, fc2.
struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t in, int64_t hidden, int64_t classes)
      : fc1(register_module("fc1", dpnn::Linear(in, hidden))),
        fc2(register_module("fc2", dpnn::Linear(hidden, classes))) {}

  at::Tensor forward(const at::Tensor& x) { return fc2(torch::relu(fc1(x))); }

  dpnn::Linear fc1, fc2;
};
TORCH_MODULE(Mlp);

// One pre-norm transformer block over token ids [B, T] (vocabulary `vocab`, T <= max_len), mean
// pooled into logits [B, classes]:
//   h = tok(ids) + pos(positions);  h += proj(attention(ln1(h)));  h += fc2(gelu(fc1(ln2(h))));
//   logits = head(mean_T(lnf(h))).
// Attention is bidirectional over `heads` heads of width d / heads.
struct TransformerImpl : torch::nn::Module {
  TransformerImpl(int64_t vocab, int64_t max_len, int64_t d, int64_t heads, int64_t classes)
      : heads(heads),
        tok(register_module("tok", dpnn::Embedding(vocab, d))),
        pos(register_module("pos", dpnn::Embedding(max_len, d))),
        ln1(register_module("ln1", dpnn::LayerNorm(d))),
        qkv(register_module("qkv", dpnn::Linear(d, 3 * d))),
        proj(register_module("proj", dpnn::Linear(d, d))),
        ln2(register_module("ln2", dpnn::LayerNorm(d))),
        fc1(register_module("fc1", dpnn::Linear(d, 4 * d))),
        fc2(register_module("fc2", dpnn::Linear(4 * d, d))),
        lnf(register_module("lnf", dpnn::LayerNorm(d))),
        head(register_module("head", dpnn::Linear(d, classes))) {}

  at::Tensor forward(const at::Tensor& ids) {
    const int64_t b = ids.size(0), t = ids.size(1);
    // Positions [B, T]: every row its own copy (a DP layer's input is batch-first).
    const at::Tensor positions = torch::arange(t, ids.options()).expand({b, t});
    at::Tensor h = tok(ids) + pos(positions);
    const int64_t d = h.size(2), dh = d / heads;
    const auto split = qkv(ln1(h)).view({b, t, 3, heads, dh}).permute({2, 0, 3, 1, 4});
    const at::Tensor q = split[0], k = split[1], v = split[2];  // [B, H, T, dh]
    const at::Tensor att = torch::softmax(
        torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(dh)), -1);
    h = h + proj(torch::matmul(att, v).transpose(1, 2).reshape({b, t, d}));
    h = h + fc2(torch::gelu(fc1(ln2(h))));
    return head(lnf(h).mean(1));
  }

  int64_t heads;
  dpnn::Embedding tok, pos;
  dpnn::LayerNorm ln1;
  dpnn::Linear qkv, proj;
  dpnn::LayerNorm ln2;
  dpnn::Linear fc1, fc2;
  dpnn::LayerNorm lnf;
  dpnn::Linear head;
};
TORCH_MODULE(Transformer);

}  // namespace dpzero::example
