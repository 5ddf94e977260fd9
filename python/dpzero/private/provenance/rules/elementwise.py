"""Copies, casts, device moves, ``*_like`` factories and elementwise operations: the batch dim
of the (broadcast) result."""

from __future__ import annotations

from typing import Optional

import torch

from ..examples import flat_args, is_suspect, is_tagged
from ..registry import register_rule, varies_along


@register_rule(torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.type,
       torch.Tensor.long, torch.Tensor.int, torch.Tensor.short, torch.Tensor.char,
       torch.Tensor.byte, torch.Tensor.bool, torch.Tensor.float, torch.Tensor.double,
       torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.contiguous, torch.Tensor.clone,
       torch.clone, torch.Tensor.detach, torch.detach, torch.Tensor.pin_memory,
       torch.Tensor.type_as, torch.randn_like, torch.rand_like, torch.zeros_like,
       torch.ones_like, torch.full_like, torch.randint_like)
def _same_layout(args, kwargs, out):
    """Copies, casts, device moves and ``*_like`` factories: the same shape, row for row (a
    ``*_like`` tensor's rows hold no other example's data; their other arguments are checked
    before any rule runs; not ``empty_like``, whose memory may hold anything freed)."""
    x = args[0]
    if not is_tagged(x) or not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return None
    return x.dp_bdim


ELEMENTWISE = [getattr(torch, n, None) for n in (
    "add", "sub", "subtract", "mul", "multiply", "div", "divide", "true_divide", "floor_divide",
    "remainder", "fmod", "pow", "neg", "negative", "abs", "exp", "log", "log1p", "log2", "sqrt",
    "rsqrt", "square", "reciprocal", "sigmoid", "tanh", "relu", "clamp", "clip", "clamp_min",
    "clamp_max", "sign", "round", "floor", "ceil", "trunc", "eq", "ne", "lt", "le", "gt", "ge",
    "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or",
    "bitwise_not", "bitwise_xor", "where", "masked_fill", "minimum", "maximum", "isnan",
    "isfinite", "isinf", "nan_to_num", "lerp")]
ELEMENTWISE += [getattr(torch.Tensor, n, None) for n in (
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod", "pow", "neg",
    "abs", "exp", "log", "log1p", "sqrt", "rsqrt", "square", "reciprocal", "sigmoid", "tanh",
    "relu", "clamp", "clip", "clamp_min", "clamp_max", "sign", "round", "floor", "ceil", "trunc",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not",
    "logical_xor", "bitwise_and", "bitwise_or", "bitwise_not", "bitwise_xor", "where",
    "masked_fill", "minimum", "maximum", "isnan", "isfinite", "isinf", "nan_to_num", "lerp",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__",
    "__rpow__", "__neg__", "__abs__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__",
    "__ge__", "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__invert__")]
# torch.nn.functional's elementwise activations (their own torch functions, not torch's).
ELEMENTWISE += [getattr(torch.nn.functional, n, None) for n in (
    "relu", "relu6", "gelu", "silu", "mish", "sigmoid", "tanh", "hardtanh", "hardsigmoid",
    "hardswish", "leaky_relu", "elu", "selu", "celu", "softplus", "softsign", "logsigmoid",
    "tanhshrink", "threshold")]
ELEMENTWISE_INPLACE = [getattr(torch.Tensor, n, None) for n in (
    "requires_grad_", "detach_", "share_memory_",
    "add_", "sub_", "mul_", "div_", "clamp_", "clip_", "masked_fill_", "pow_", "neg_", "abs_",
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "fill_", "zero_", "nan_to_num_")]


def _broadcast_bdim(args, kwargs, out) -> Optional[int]:
    """The output's batch dim under broadcasting (operands right-aligned), if every tagged operand
    is of one micro-batch and puts its batch dim at that same output position with its own size,
    and every other tensor operand is constant along it (size 1, or a stride-0 expansion) and not
    derived from the batch: an operand that varies along the batch dim without being these
    examples could put another example's data into a row (``x[perm]``, as in mixup), and one
    computed from the batch puts every example's data into every row (``x - x.mean(0)``).
    Constants from elsewhere (normalisation statistics) are the caller's: if they were computed
    from the private data, that is not covered by epsilon."""
    if not isinstance(out, torch.Tensor):
        return None
    leaves = [x for x in flat_args(args, kwargs) if isinstance(x, torch.Tensor)]
    tagged = [x for x in leaves if is_tagged(x)]
    if not tagged or len({id(x.dp_token) for x in tagged}) != 1:
        return None
    b = None
    for x in tagged:
        pos = x.dp_bdim + out.dim() - x.dim()
        if b is not None and pos != b:
            return None
        if pos < 0 or out.shape[pos] != x.shape[x.dp_bdim]:
            return None
        b = pos
    token = tagged[0].dp_token
    for u in leaves:
        if is_tagged(u):
            continue
        if is_suspect(u, token):  # from the batch without being it: x - x.mean(0)
            return None
        if varies_along(u, b, out.dim()):
            return None
    return b


register_rule(*ELEMENTWISE)(_broadcast_bdim)


@register_rule(*ELEMENTWISE_INPLACE, inplace=True)
def _inplace_elementwise(args, kwargs, out) -> bool:
    """In place on a tagged tensor: keeps the tag if the operands are as ``_broadcast_bdim``
    allows (its shape cannot change)."""
    return _broadcast_bdim(args, kwargs, out) == getattr(out, "dp_bdim", None)
