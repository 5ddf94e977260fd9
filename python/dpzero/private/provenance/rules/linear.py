"""Matrix products, per-row layers (F.linear, F.embedding), dropout and one-hot: row by row or
not at all."""

from __future__ import annotations

import torch

from ..examples import arg_of, embedding_renorms, is_suspect, is_tagged
from ..registry import register_rule, varies_along


@register_rule(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm)
def _matmul(args, kwargs, out):
    """``a @ b`` (both at least 2-D) with the examples on one of the leading dims matmul
    broadcasts, at the same output position for every tagged operand, and an untagged operand
    constant along it (attention's ``q @ k.transpose(-1, -2)`` per example); or on the rows of a
    tagged ``a`` times an untagged matrix ``b`` ([B, d] @ W). Output row i is then example i's
    product alone."""
    a = arg_of(args, kwargs, 0, "input")
    b = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
    if not all(isinstance(x, torch.Tensor) and x.dim() >= 2 for x in (a, b, out)):
        return None
    tagged = [x for x in (a, b) if is_tagged(x)]
    if not tagged or len({id(x.dp_token) for x in tagged}) != 1:
        return None
    token = tagged[0].dp_token
    if len(tagged) == 1 and tagged[0] is a and a.dp_bdim == a.dim() - 2 and b.dim() == 2:
        return None if is_suspect(b, token) else out.dim() - 2  # rows of a times a matrix
    pos = {x.dp_bdim + out.dim() - x.dim() for x in tagged if x.dp_bdim < x.dim() - 2}
    if len(pos) != 1 or len(tagged) != sum(1 for x in tagged if x.dp_bdim < x.dim() - 2):
        return None
    (p,) = pos
    if any(out.shape[p] != x.shape[x.dp_bdim] for x in tagged):
        return None
    for u in (a, b):
        if not is_tagged(u) and (is_suspect(u, token) or varies_along(u, p, out.dim())):
            return None
    return p


@register_rule(torch.nn.functional.dropout, torch.dropout, torch.nn.functional.dropout1d,
       torch.nn.functional.dropout2d, torch.nn.functional.dropout3d,
       torch.nn.functional.alpha_dropout, torch.alpha_dropout,
       torch.nn.functional.feature_alpha_dropout)
def _dropped(args, kwargs, out):
    """Dropout: each element (or channel) scaled by a mask drawn independently of the data, so
    every output element is its own input element's, row for row."""
    x = args[0]
    if not is_tagged(x) or not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return None
    return x.dp_bdim


@register_rule(torch.nn.functional.linear, torch.nn.functional.embedding)
def _per_row_layer(args, kwargs, out):
    """A frozen layer applied to the examples (a plain ``nn.Linear`` or ``nn.Embedding`` whose
    parameters dpzero does not train): ``linear`` over the last dim and ``embedding`` per id keep
    every other dim row for row, when the weight and bias are not from the batch."""
    x = arg_of(args, kwargs, 0, "input")
    if not is_tagged(x) or not isinstance(out, torch.Tensor):
        return None
    if embedding_renorms(args, kwargs):
        return None  # the looked-up rows of the weight were rewritten from these ids
    rest = list(args[1:3]) + [kwargs.get(k) for k in ("weight", "bias")]
    if any(is_tagged(u) or is_suspect(u, x.dp_token) for u in rest
           if isinstance(u, torch.Tensor)):
        return None
    linear = out.dim() == x.dim()
    if linear and x.dp_bdim == x.dim() - 1:
        return None  # the examples on the features: every output mixes them
    return x.dp_bdim


@register_rule(torch.nn.functional.one_hot)
def _one_hot(args, kwargs, out):
    x = args[0]
    return x.dp_bdim if is_tagged(x) else None
