"""A convolutional network with GroupNorm, the DP image model's usual shape: GroupNorm's per-sample
gradients in closed form (Note [group norm in closed form] in python/dpzero/private/group_norm.py)
and the convolutions' kept per-sample gradients (Note [kept conv gradients] in
kernels/per_sample/conv.h).

Reference: a float64 copy of the unpatched model, one example at a time through torch's autograd,
each example's whole gradient clipped (private_reference.py); σ = 0, every example clipped.
"""

import copy

import pytest
import torch
from torch import nn

import dpzero
from dpzero.private.group_norm import GroupNormKind
from private_reference import first_step_error
from sensitivity import refused_or_bounded

C, LR, N, K = 1e-3, 1000.0, 24, 5


def _data(shape=(3, 12, 12)):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(N, *shape, generator=g),
                                          torch.randint(0, K, (N,), generator=g))


def _cnn(groups=4, affine=True):
    """Three convolutions, each followed by GroupNorm: the first two at 12 x 12 (144 positions:
    their norms take the direct path and the book keeps their per-sample gradients), the last
    strided, with a depthwise one between."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(groups, 8, affine=affine), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.GroupNorm(2, 8, affine=affine), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.GroupNorm(4, 16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, K))


class _Sequence(nn.Module):
    """GroupNorm over [B, C, T] and over [B, C] (no spatial dims)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(4, 6, 3)
        self.norm = nn.GroupNorm(3, 6)
        self.flat = nn.GroupNorm(2, 6, eps=1e-3)
        self.head = nn.Linear(6, K)

    def forward(self, x):
        h = torch.tanh(self.norm(self.conv(x))).mean(2)  # [B, 6]
        return self.head(self.flat(h))


@pytest.mark.parametrize("make,shape", [
    (_cnn, (3, 12, 12)),
    (lambda: _cnn(groups=1), (3, 12, 12)),
    (lambda: _frozen(_cnn(), "1.weight", "4.bias"), (3, 12, 12)),
    (_Sequence, (4, 9)),
])
def test_the_step_clips_each_examples_whole_gradient(make, shape):
    model = make()
    start = copy.deepcopy(model)
    p = dpzero.make_private(model, dataset=_data(shape), batch_size=8, noise_multiplier=0.0,
                            max_grad_norm=C, allow_no_noise=True, lr=LR, seed=1)
    kinds = {type(layer.module).__name__: type(layer.kind).__name__
             for layer in p.privacy_engine.layers}
    assert kinds["GroupNorm"] == "GroupNormKind", kinds
    error = first_step_error(p, start, max_grad_norm=C, lr=LR, expected_batch=8.0)
    assert error <= 1e-5, error


def _frozen(model, *names):
    for name in names:
        model.get_parameter(name).requires_grad_(False)
    return model


@pytest.mark.parametrize("clipping", ["flat", "layer"])
def test_one_example_moves_the_sum_by_at_most_2c(clipping):
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 3, 12, 12, generator=g), torch.randint(0, K, (8,), generator=g)
    assert refused_or_bounded(_cnn, [x], y, clipping=clipping) == "bounded"


class _OwnNorm(nn.GroupNorm):
    pass


def test_what_is_not_torchs_groupnorm_keeps_the_recompute():
    """A subclass (its methods are its own), and torch's module without affine parameters (no
    layer at all): only torch's own module with parameters takes the closed form."""
    model = _cnn()
    model[1] = _OwnNorm(4, 8)
    p = dpzero.make_private(model, dataset=_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=C, seed=1)
    kinds = {layer.name: type(layer.kind) for layer in p.privacy_engine.layers}
    assert kinds["1"] is not GroupNormKind and kinds["1"].__name__ == "FuncKind"
    assert kinds["7"] is GroupNormKind
    p = dpzero.make_private(_cnn(affine=False), dataset=_data(), batch_size=8,
                            noise_multiplier=1.0, max_grad_norm=C, seed=1)
    assert "1" not in {layer.name for layer in p.privacy_engine.layers}


class _Overwritten(nn.Module):
    """GroupNorm on a copy of the input that the forward then overwrites with example 0's rows:
    x̂ recomputed from the saved input would carry example 0 into every example's gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.head = nn.GroupNorm(2, 4), nn.Linear(4, K)

    def forward(self, x):
        x = x.clone()
        h = torch.tanh(self.norm(x))
        x.copy_(x[0:1].expand_as(x).clone())
        return self.head(h.flatten(2).mean(2))


def test_an_input_written_after_the_call_is_refused():
    """A review moved the sum by 8 x 2C this way before the input's version was checked."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 4, 6, 6, generator=g), torch.randint(0, K, (8,), generator=g)
    assert refused_or_bounded(_Overwritten, [x], y) == "refused"
    p = dpzero.make_private(_Overwritten(), dataset=torch.utils.data.TensorDataset(x, y),
                            sample_rate=1.0, noise_multiplier=1.0, max_grad_norm=C, seed=1)
    xb, yb = next(iter(p.data_loader))
    with pytest.raises(dpzero.private.PrivacyViolation,
                       match=r"GroupNorm 'norm': its input was written in place after the call "
                             r"\(its version moved from 0 to 1\)"):
        torch.nn.functional.cross_entropy(p.model(xb), yb).backward()
    with pytest.raises(dpzero.private.PrivacyViolation):
        p.optimizer.step()
    assert p.privacy_engine.charges == 0
