"""Reductions and cumulative operations: kept when they reduce other dims than the batch's."""

from __future__ import annotations

import torch

from ..examples import is_tagged
from ..registry import norm_dim, register_rule


def _reduced(args, kwargs, out):
    """A reduction over dims other than the batch's (``mask.sum(-1)``, ``x.mean(dim=1)``): each
    row of the output is a function of the same row of the input."""
    x = args[0]
    if not is_tagged(x) or not isinstance(out, torch.Tensor):
        return None
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None or isinstance(dim, (tuple, list)) and not dim:  # dim=() reduces all dims
        return None
    dims = sorted({norm_dim(d, x.dim()) for d in (dim if isinstance(dim, (tuple, list))
                                                   else (dim,))})
    if x.dp_bdim in dims:
        return None
    keep = kwargs.get("keepdim", args[2] if len(args) > 2 and isinstance(args[2], bool) else False)
    if out.dim() == x.dim() or keep:  # cumulative or keepdim
        return x.dp_bdim
    return x.dp_bdim - sum(1 for d in dims if d < x.dp_bdim)


register_rule(*[f for n in ("sum", "mean", "amax", "amin", "any", "all", "cumsum", "cumprod",
                    "softmax", "log_softmax", "argmax", "argmin", "count_nonzero", "logsumexp")
        for f in (getattr(torch, n, None), getattr(torch.Tensor, n, None))],
      torch.nn.functional.softmax, torch.nn.functional.log_softmax)(_reduced)
