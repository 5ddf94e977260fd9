"""Reshapes, squeezes, permutations, transposes, repeats, expansions and padding: where the batch
dim goes."""

from __future__ import annotations

import torch

from ..examples import is_tagged
from ..registry import norm_dim, register_rule, variadic


@register_rule(torch.Tensor.repeat)
def _repeated(args, kwargs, out):
    """``x.repeat(*sizes)`` with factor 1 at the batch dim: each row repeats its own data."""
    x = args[0]
    if not is_tagged(x):
        return None
    sizes = variadic(args, kwargs, "repeats")
    b = x.dp_bdim + len(sizes) - x.dim()
    return b if sizes[b] == 1 else None


@register_rule(torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.view_as,
       torch.Tensor.reshape_as, torch.Tensor.flatten, torch.flatten, torch.Tensor.unflatten)
def _reshaped(args, kwargs, out):
    """A reshape keeps the logical (row-major) order of elements, so when dim 0 is the batch and
    the output's dim 0 has the same size, output row i holds exactly input row i's elements."""
    x = args[0]
    if not is_tagged(x) or not isinstance(out, torch.Tensor) or out.dim() == 0:
        return None
    if out.shape == x.shape:
        return x.dp_bdim
    if x.dp_bdim == 0 and out.shape[0] == x.shape[0]:
        return 0
    return None


@register_rule(torch.Tensor.unsqueeze, torch.unsqueeze)
def _unsqueezed(args, kwargs, out):
    x = args[0]
    d = args[1] if len(args) > 1 else kwargs["dim"]
    d = norm_dim(d, out.dim())
    return x.dp_bdim + (1 if d <= x.dp_bdim else 0) if is_tagged(x) else None


@register_rule(torch.Tensor.squeeze, torch.squeeze)
def _squeezed(args, kwargs, out):
    x = args[0]
    if not is_tagged(x):
        return None
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if dims is None:
        removed = [d for d in range(x.dim()) if x.shape[d] == 1]
    else:
        dims = dims if isinstance(dims, (tuple, list)) else (dims,)
        removed = [norm_dim(d, x.dim()) for d in dims if x.shape[norm_dim(d, x.dim())] == 1]
    if x.dp_bdim in removed:
        return None
    return x.dp_bdim - sum(1 for d in removed if d < x.dp_bdim)


@register_rule(torch.Tensor.permute, torch.permute)
def _permuted(args, kwargs, out):
    x = args[0]
    if not is_tagged(x):
        return None
    dims = variadic(args, kwargs, "dims")
    return [norm_dim(d, x.dim()) for d in dims].index(x.dp_bdim)


@register_rule(torch.Tensor.transpose, torch.transpose, torch.Tensor.swapaxes, torch.swapaxes,
       torch.Tensor.swapdims, torch.swapdims, torch.Tensor.t, torch.t)
def _transposed(args, kwargs, out):
    x = args[0]
    if not is_tagged(x):
        return None
    if x.dim() < 2:  # t() of a 1-D tensor is itself
        return x.dp_bdim
    if len(args) == 1 and not kwargs:  # t(): dims 0 and 1
        args = (x, 0, 1)
    a = norm_dim(args[1] if len(args) > 1 else kwargs["dim0"], x.dim())
    b = norm_dim(args[2] if len(args) > 2 else kwargs["dim1"], x.dim())
    return b if x.dp_bdim == a else a if x.dp_bdim == b else x.dp_bdim


@register_rule(torch.Tensor.expand, torch.Tensor.expand_as, torch.broadcast_to,
       torch.Tensor.broadcast_to)
def _expanded(args, kwargs, out):
    x = args[0]
    if not is_tagged(x):
        return None
    b = x.dp_bdim + out.dim() - x.dim()
    return b if out.shape[b] == x.shape[x.dp_bdim] else None


@register_rule(torch.nn.functional.pad)
def _padded(args, kwargs, out):
    """F.pad pads the last len(pad) / 2 dims; the batch dim must not be one of them."""
    x = args[0]
    if not is_tagged(x):
        return None
    pad = args[1] if len(args) > 1 else kwargs["pad"]
    if x.dp_bdim >= x.dim() - len(pad) // 2:
        return None
    return x.dp_bdim
