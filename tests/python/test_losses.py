"""Note [losses that couple examples] (dpzero/private/losses.py): a class-weighted mean
cross-entropy on the private loader's examples is refused, naming the fix, and the fix keeps the
sensitivity bound.

The reference is the definition of replace-one sensitivity: D and D' differ in one example's
label (to a class of weight 1000), no noise, q = 1, SGD: the two steps' parameters differ by at
most 2 C lr / N. The refused call moved them 9.6 times that in a privacy review."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import dpzero

N, C, LR = 64, 3.0, 1.0
WEIGHT = torch.tensor([1.0, 1.0, 1000.0])


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 5, generator=g), torch.zeros(N, dtype=torch.long)


def _step(labels, loss_fn, isolation="detect", micro=None):
    x, _ = _data()
    torch.manual_seed(0)
    p = dpzero.make_private(nn.Sequential(nn.Linear(5, 3)), dataset=TensorDataset(x, labels),
                            batch_size=N, noise_multiplier=0.0, allow_no_noise=True,
                            max_grad_norm=C, lr=LR, seed=0, isolation=isolation,
                            max_physical_batch_size=micro)
    for xs, ys in p.data_loader:
        loss_fn(p.model(xs), ys).backward()
        p.optimizer.step()
        p.optimizer.zero_grad()
    return p.privacy_engine.parameters()


REFUSED = {
    "cross_entropy": lambda out, y: F.cross_entropy(out, y, weight=WEIGHT),
    "positional_weight": lambda out, y: F.cross_entropy(out, y, WEIGHT),
    "module": lambda out, y: nn.CrossEntropyLoss(weight=WEIGHT)(out, y),
    "nll_loss": lambda out, y: F.nll_loss(F.log_softmax(out, -1), y, weight=WEIGHT),
    "legacy_size_average": lambda out, y: F.nll_loss(F.log_softmax(out, -1), y, weight=WEIGHT,
                                                     size_average=True),
    "elementwise_mean": lambda out, y: nn.CrossEntropyLoss(weight=WEIGHT,
                                                           reduction="elementwise_mean")(out, y),
    "aten": lambda out, y: torch.ops.aten.cross_entropy_loss(out, y, WEIGHT),
    "c_nn": lambda out, y: torch._C._nn.nll_loss(F.log_softmax(out, -1), y, WEIGHT),
}


@pytest.mark.parametrize("isolation", ["detect", "strict"])
@pytest.mark.parametrize("name", list(REFUSED))
def test_a_class_weighted_mean_on_the_loaders_examples_is_refused_naming_the_fix(name, isolation):
    _, y = _data()
    with pytest.raises(dpzero.PrivacyViolation, match=r"reduction='none'\)\.mean\(\)"):
        _step(y, REFUSED[name], isolation)


@pytest.mark.parametrize("micro", [None, 16])
def test_the_per_example_weighted_loss_keeps_the_bound_and_other_losses_run(micro):
    _, y = _data()
    y2 = y.clone()
    y2[0] = 2  # the heavy class
    fixed = lambda out, ys: F.cross_entropy(out, ys, weight=WEIGHT,  # noqa: E731
                                            reduction="none").mean()
    a, b = _step(y, fixed, micro=micro), _step(y2, fixed, micro=micro)
    moved = math.sqrt(sum(((a[k] - b[k]).double() ** 2).sum().item() for k in a))
    bound = 2 * C * LR / N
    assert 0 < moved <= bound * (1 + 1e-5), f"one label moved the step {moved / bound:.2f}x"
    # Not refused: a weighted sum, the unweighted mean, and class probabilities as targets
    # (divided by the row count, whatever the weights).
    _step(y, lambda out, ys: F.cross_entropy(out, ys, weight=WEIGHT, reduction="sum"))
    _step(y, lambda out, ys: F.cross_entropy(out, ys))
    _step(y, lambda out, ys: F.cross_entropy(out, F.one_hot(ys, 3).float(), weight=WEIGHT))


transformers = pytest.importorskip("transformers")


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=40, n_positions=8, n_embd=16, n_layer=1, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    return transformers.GPT2LMHeadModel(cfg)  # untied: a tied table's norm is a bound (the sum
    # of its two uses' norms, Note [certified group norms]), the reference's the exact one


def _lm_data():
    """8 sequences of 8 tokens with 1 to 7 labelled tokens each (the rest -100): the examples'
    token counts differ, so a loss averaged over the batch's tokens weights them by the others'."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 40, (8, 8), generator=g)
    labels = ids.clone()
    for i in range(8):
        labels[i, 1 + i % 7 + 1:] = -100
    return ids, labels


@pytest.mark.parametrize("reduction,return_dict", [("mean", True), ("sum", True),
                                                   ("mean", False)])
def test_a_language_models_own_loss_trains_each_example_by_its_own_tokens(reduction,
                                                                           return_dict):
    """Note [a model's own loss under make_private] (dpzero/hf/losses.py): the ordinary loop
    ``model(input_ids=x, labels=y).loss.backward()`` takes one private step equal to DP-SGD's
    with each example's own loss (the mean over its own labelled next tokens): the reference is a
    loop over the examples, each alone through a plain copy of the model, clipped flat at C, summed
    and applied by SGD (q = 1, no noise). GPT-2's own loss averages over the batch's tokens, which
    differs here (the examples' counts differ)."""
    ids, labels = _lm_data()
    n, c, lr = len(ids), 4.0, 1.0  # C between the examples' norms (2.4 to 8.3): some clipped
    plain = _gpt2()
    params = [p for p in plain.parameters() if p.requires_grad]
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for i in range(n):
        own = plain(input_ids=ids[i:i + 1], labels=labels[i:i + 1]).loss  # alone: its own mean
        grads = torch.autograd.grad(own, params)
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
        factor = min(1.0, c / (norm + 1e-6))
        for t, g in zip(total, grads):
            t += factor * g.double()
    scale = 1.0 / n  # the sum over the expected batch size q N = n
    want = {name: p.detach().double() - lr * scale * t
            for (name, p), t in zip(((nm, p) for nm, p in plain.named_parameters()
                                     if p.requires_grad), total)}

    model = _gpt2()
    p = dpzero.make_private(model, dataset=TensorDataset(ids, labels), sample_rate=1.0,
                            noise_multiplier=0.0, allow_no_noise=True, max_grad_norm=c,
                            optimizer="sgd", lr=lr, seed=0, loss_reduction=reduction)
    for x, y in p.data_loader:
        out = p.model(input_ids=x, labels=y, return_dict=return_dict)
        (out.loss if return_dict else out[0]).backward()  # a tuple: (loss, logits, ...)
        assert p.optimizer.step()
    got = p.privacy_engine.parameters()
    for name, w in want.items():
        assert torch.allclose(got[name].double(), w, rtol=1e-4, atol=1e-6), name
