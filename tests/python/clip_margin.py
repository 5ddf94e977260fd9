"""The rounding margin of clipped sums formed in float32 from a layer's inputs and output
gradients (Note [clipped-sum rounding] in kernels/per_sample/common.h), from the Note's formula, not
from the kernels: the certified squared norm of such a layer is (||W_i|| + m S_i)^2."""

from __future__ import annotations

import torch

U32 = 2.0 ** -24  # float32's unit roundoff


def clip_margin(t: int) -> float:
    """m for T = t rows per sample: 2 ((1 + u)(1 + gamma_T) - 1), u = 2^-24."""
    nu = max(t, 1) * U32
    return 2 * ((1 + U32) * (1 + nu / (1 - nu)) - 1)


def with_margin(sq: torch.Tensor, s: torch.Tensor, t: int) -> torch.Tensor:
    """(sqrt(sq) + m S)^2: exact squared norms sq [B], S = s [B], T = t."""
    return (sq.sqrt() + clip_margin(t) * s) ** 2


def linear_s(A: torch.Tensor, G: torch.Tensor):
    """(S_i = sum_t ||a_t|| ||g_t|| [B] float64, T) of a Linear's inputs A [B, ..., d_in] and
    output gradients G [B, ..., d_out] (Note [certified norms])."""
    a, g = A.detach().cpu().double(), G.detach().cpu().double()
    if a.dim() == 2:
        a, g = a.unsqueeze(1), g.unsqueeze(1)
    a, g = a.flatten(1, -2), g.flatten(1, -2)
    return (a.norm(dim=-1) * g.norm(dim=-1)).sum(1), a.shape[1]
