"""Clip thresholds rounded toward zero (privacy/clipping.h): the clip factors are
computed against float32 thresholds, and float32(C) rounded to nearest is above C for most C
(0.1 -> 0.100000001490116...). Every clipped contribution, recomputed in float64 from the op's
factors and per-sample gradients formed here (not by the kernels), must be at most the float64
C; the group thresholds' squares must sum to at most C^2, checked in exact rational arithmetic.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from torch import nn

import dpzero
from clip_margin import linear_s, with_margin
from dpzero import _C

ops = torch.ops.dpzero
CS = [0.1, 0.3, 1.0 / 3.0, 1e-3]  # none of them a float32


def _big(shape, g):
    """Random values large enough that every sample is clipped."""
    return 10.0 * torch.randn(*shape, generator=g)


@pytest.mark.parametrize("c", CS)
@pytest.mark.parametrize("mode", ["flat", "automatic"])
@pytest.mark.parametrize("method", [1, 2])  # ghost, direct
def test_every_clipped_linear_contribution_is_at_most_c(c, mode, method):
    g = torch.Generator().manual_seed(round(1 / c))
    a, gr = _big((200, 5, 6), g), _big((200, 5, 4), g)
    *_, factors, _ = ops.linear_clip(a, gr, c, mode, 0.01, True, False, method)
    per_sample_w = torch.einsum("bto,bti->boi", gr.double(), a.double())
    per_sample_b = gr.double().sum(1)
    norms = torch.sqrt(per_sample_w.flatten(1).pow(2).sum(1) + per_sample_b.pow(2).sum(1))
    contributions = factors.double() * norms
    assert (contributions <= c).all(), (contributions.max().item() - c,
                                        int((contributions > c).sum()))
    if mode == "flat":  # not vacuous: clipped to within float32 rounding of C, not far below
        # (the ghost path's norm adds the clipped sum's rounding margin, clip_margin.py)
        bound = with_margin(per_sample_w.flatten(1).pow(2).sum(1), *linear_s(a, gr)) + \
            per_sample_b.pow(2).sum(1) if method == 1 else norms ** 2
        assert (contributions * bound.sqrt() / norms).max() > c * (1 - 1e-6)


@pytest.mark.parametrize("c", CS)
def test_every_clipped_embedding_norm_and_conv_contribution_is_at_most_c(c):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 9, (100, 6), generator=g)
    gr = _big((100, 6, 4), g)
    _, _, factors, _ = ops.embedding_clip(ids, gr, 9, c, "flat", 0.01, None, 0)
    rows = torch.zeros(100, 9, 4, dtype=torch.float64)  # each sample's gradient of the table
    for i in range(100):
        rows[i].index_add_(0, ids[i], gr[i].double())
    contributions = factors.double() * rows.flatten(1).norm(dim=1)
    assert (contributions <= c).all(), contributions.max().item() - c

    x, gc = _big((50, 3, 8), g), _big((50, 4, 6), g)  # Conv1d 3 -> 4, kernel 3, no padding
    *_, factors, _ = ops.conv_clip(x, gc, [3], [1], [0], [1], 1, c, "flat", 0.01, True, 0)
    windows = x.double().unfold(2, 3, 1)  # [B, C_in, L_out, k]
    per_sample = torch.einsum("bol,bilk->boik", gc.double(), windows)
    norms = torch.sqrt(per_sample.flatten(1).pow(2).sum(1) + gc.double().sum(2).pow(2).sum(1))
    assert ((factors.double() * norms) <= c).all()


@pytest.mark.parametrize("c", CS)
@pytest.mark.parametrize("k", [3, 5, 7, 11])
def test_group_thresholds_never_exceed_the_budget_exactly(c, k):
    """Σ C_g² ≤ C² in exact rationals, for the values the clipping really uses (float32), and
    each C_g ≤ its float64 value C sqrt(1 / k) — at nearest rounding 11 groups overshot by
    1.8e-8."""
    t = _C.privacy.group_thresholds(c, k)
    assert all(float(torch.tensor(x, dtype=torch.float32)) == x for x in t)  # float32 values
    assert sum(Fraction(x) ** 2 for x in t) <= Fraction(c) ** 2
    assert all(x <= c * math.sqrt(1.0 / k) * (1 + 2e-16) for x in t)
    assert sum(Fraction(x) ** 2 for x in t) > Fraction(c) ** 2 * Fraction(999999, 1000000)


@pytest.mark.parametrize("c", CS)
def test_the_engine_clips_against_thresholds_rounded_down(c):
    """What make_private hands the kernels: C itself (flat) and C_g per layer group, each a
    float32 no larger than the float64 value."""
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(11)])
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randint(0, 3, (8,)))
    for clipping, k in (("flat", 1), ("layer", 11)):
        p = dpzero.make_private(model, dataset=data, batch_size=4, noise_multiplier=1.0,
                                max_grad_norm=c, clipping=clipping)
        t = p.privacy_engine.book.thresholds
        assert len(t) == k
        assert sum(Fraction(x) ** 2 for x in t) <= Fraction(c) ** 2
        assert all(float(torch.tensor(x, dtype=torch.float32)) == x for x in t)
        p.privacy_engine.detach()
