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
    # Not refused: a weighted sum, and the unweighted mean.
    _step(y, lambda out, ys: F.cross_entropy(out, ys, weight=WEIGHT, reduction="sum"))
    _step(y, lambda out, ys: F.cross_entropy(out, ys))
