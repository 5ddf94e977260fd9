"""Indexing: the batch dim survives a full slice and no advanced index; writes through an index
keep the tag only when they cannot mix rows."""

from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch.utils import _pytree as pytree

from ..examples import is_suspect, is_tagged
from ..registry import register_rule


def _index_bdim(x: torch.Tensor, index) -> Optional[int]:
    """Batch dim of ``x[index]``: kept when the batch dim is indexed by a full slice (``:``) and
    no advanced (tensor, list, bool) index is used; dropped otherwise (rows selected or mixed)."""
    idx = index if isinstance(index, tuple) else (index,)
    basic = all(i is None or i is Ellipsis or isinstance(i, (int, slice)) and
                not isinstance(i, bool) for i in idx)
    if not basic:
        return None
    consuming = sum(1 for i in idx if i is not None and i is not Ellipsis)
    if consuming > x.dim() or sum(1 for i in idx if i is Ellipsis) > 1:
        return None
    dim_in, dim_out = 0, 0
    expanded: List[Any] = []
    for i in idx:
        if i is Ellipsis:
            expanded += [slice(None)] * (x.dim() - consuming)
        else:
            expanded.append(i)
    expanded += [slice(None)] * (x.dim() - sum(1 for i in expanded if i is not None))
    for i in expanded:
        if i is None:
            dim_out += 1
            continue
        if dim_in == x.dp_bdim:
            full = isinstance(i, slice) and i == slice(None)
            return dim_out if full else None
        dim_in += 1
        dim_out += 0 if isinstance(i, int) else 1
    return None


@register_rule(torch.Tensor.__getitem__)
def _getitem(args, kwargs, out):
    x, index = args[0], args[1]
    if not is_tagged(x):
        return None
    return _index_bdim(x, index)


@register_rule(torch.Tensor.__setitem__, inplace=True)
def _setitem(args, kwargs, out) -> bool:
    """``x[index] = value`` keeps x's tag when no row receives another example's data:

    * no part of the index is computed from the examples (tensors, list entries, slice bounds),
      except x's own elementwise boolean mask as the whole index (``labels[labels == pad]``);
    * the value carries no example's data (a number, a plain tensor: ``-100``, random tokens for
      masked language modelling), at any elements; or it is the same micro-batch's examples,
      written into every row (a full slice on the batch dim) with their batch dim landing on the
      region's (``x[:] = x.t()`` with B = T does not)."""
    x, index, value = args[0], args[1], args[2]
    if not is_tagged(x):
        return False
    token = x.dp_token
    idx = index if isinstance(index, tuple) else (index,)
    for i in pytree.tree_leaves([[j.start, j.stop, j.step] if isinstance(j, slice) else j
                                 for j in idx]):
        if not isinstance(i, torch.Tensor):
            continue
        if is_suspect(i, token):
            return False
        if is_tagged(i) and not (len(idx) == 1 and i.dp_token is token and
                                  i.dtype == torch.bool and i.shape == x.shape and
                                  i.dp_bdim == x.dp_bdim):
            return False  # an index from the examples that is not x's own elementwise mask
    if not isinstance(value, torch.Tensor):
        return True
    if is_suspect(value, token):
        return False
    if not is_tagged(value):
        return True  # data-free values, at any elements
    region_bdim = _index_bdim(x, index)
    return region_bdim is not None and value.dp_token is token and \
        value.dp_bdim + x[index].dim() - value.dim() == region_bdim
