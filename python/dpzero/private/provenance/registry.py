"""The rules' registry: for each operation the tag follows, the function that gives the batch
dim of its output, or None (the tag is dropped). Note [batch provenance] in examples.py; the
rules themselves are in rules/, one file per family of operations."""

from __future__ import annotations

from typing import Any, Callable, Dict, Sequence

import torch


# ---- rules: the batch dim of an operation's output, or None (the tag is dropped) --------------

Rule = Callable[[Sequence[Any], Dict[str, Any], Any], Any]
RULES: Dict[Any, Rule] = {}
INPLACE: set = set()
# Factories that read nothing of the tensor but its dtype and device: their results are plain.
# (Not new_tensor: it copies its data argument, which may be computed from the examples.)
FACTORIES = {getattr(torch.Tensor, n) for n in ("new_zeros", "new_ones", "new_full",
                                                  "new_empty")}
# Reads of what a tensor is a view of, handed back as they are (the base tensor object itself):
# wrapping a view's base would make a new view whose base is again wrapped, without end.
METADATA = {torch.Tensor._base.__get__}
# Operations that hand the tensor's memory to code whose writes bump no version counter dpzero
# sees (``x.data[0] = x.data[1]``, numpy, DLPack, raw pointers): the tag is withdrawn.
# (torch.utils.dlpack.to_dlpack is a C function that bypasses __torch_function__: beyond reach.)
ESCAPES = {f for f in (torch.Tensor.data.__get__, torch.Tensor.numpy, torch.Tensor.__array__,
                        torch.Tensor.__dlpack__, torch.Tensor.untyped_storage,
                        getattr(torch.Tensor, "_typed_storage", None), torch.Tensor.storage,
                        torch.Tensor.set_, torch.Tensor.data_ptr,
                        getattr(torch.Tensor, "__cuda_array_interface__", None))
            if f is not None}
ESCAPES = {f.__get__ if isinstance(f, property) else f for f in ESCAPES}


def register_rule(*funcs, inplace: bool = False):
    def register(fn):
        for f in funcs:
            if f is None:
                continue
            RULES[f] = fn
            if inplace:
                INPLACE.add(f)
        return fn
    return register


def varies_along(u: torch.Tensor, dim: int, ndim: int) -> bool:
    """Whether ``u``, broadcast (right-aligned) into a result of ``ndim`` dims, holds different
    values along the result's ``dim``: it has that dim, of size above 1, not as a stride-0
    expansion of one value, and its slices along it are not all equal (a causal mask built as
    [B, 1, T, T] from shapes alone)."""
    p = dim - (ndim - u.dim())
    if not (0 <= p < u.dim() and u.shape[p] != 1 and u.stride(p) != 0):
        return False
    with torch._C.DisableTorchFunctionSubclass():
        return not torch.equal(u, u.narrow(p, 0, 1).expand_as(u))


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def variadic(args, kwargs, key: str) -> tuple:
    """The sizes or dims of ``x.permute(0, 2, 1)``, ``x.permute((0, 2, 1))`` or
    ``x.permute(dims=(0, 2, 1))``."""
    values = args[1:] if len(args) > 1 else (kwargs[key],)
    if len(values) == 1 and isinstance(values[0], (tuple, list, torch.Size)):
        values = tuple(values[0])
    return tuple(values)
