"""Concatenation, stacking and splitting: the batch dim of the pieces."""

from __future__ import annotations

import torch

from ..examples import is_suspect, is_tagged
from ..registry import norm_dim, register_rule, varies_along


@register_rule(torch.cat, torch.concat, torch.concatenate)
def _catted(args, kwargs, out):
    """Concatenation along another dim than the batch's (prompt tokens before the inputs): the
    other operands must be constant along the batch dim (an expanded shared tensor)."""
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
    tagged = [t for t in tensors if is_tagged(t)]
    if not tagged or len({id(t.dp_token) for t in tagged}) != 1:
        return None
    b = tagged[0].dp_bdim
    if any(t.dp_bdim != b for t in tagged) or norm_dim(dim, out.dim()) == b:
        return None
    for u in tensors:
        if not is_tagged(u) and is_suspect(u, tagged[0].dp_token):
            return None
        if not is_tagged(u) and varies_along(u, b, out.dim()):
            return None
    return b


@register_rule(torch.stack)
def _stacked(args, kwargs, out):
    tensors = args[0]
    dim = norm_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), out.dim())
    if not tensors or not all(is_tagged(t) for t in tensors):
        return None
    if len({id(t.dp_token) for t in tensors}) != 1 or len({t.dp_bdim for t in tensors}) != 1:
        return None
    b = tensors[0].dp_bdim
    return b + 1 if dim <= b else b


@register_rule(torch.Tensor.split, torch.split, torch.Tensor.chunk, torch.chunk,
       torch.Tensor.tensor_split, torch.tensor_split, torch.Tensor.unbind, torch.unbind)
def _pieces(args, kwargs, out):
    """Pieces along a dim other than the batch's each keep it (unbind removes its dim)."""
    x = args[0]
    if not is_tagged(x) or not isinstance(out, (tuple, list)) or not out:
        return None
    if out[0].dim() < x.dim():  # unbind(x, dim)
        d = norm_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), x.dim())
        if d == x.dp_bdim:
            return None
        return [x.dp_bdim - (1 if d < x.dp_bdim else 0)] * len(out)
    d = norm_dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), x.dim())
    return None if d == x.dp_bdim else [x.dp_bdim] * len(out)
