"""Losses whose reduction couples the examples, refused where the private loader's tensors meet them.

Note [losses that couple examples]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Clipping bounds each example's gradient only if that gradient is a function of the example
alone, so the loss must be a sum, or a mean over the micro-batch's rows (Note [mean loss] in
src/dp/book.h), of per-example losses. A reduction that divides by something computed from the
whole batch scales every example's gradient by it before the clip: one example then moves all the
others' contributions. PyTorch's own losses do this in one common case: ``cross_entropy`` and
``nll_loss`` with class ``weight`` and ``reduction="mean"`` divide by the sum of the batch's
target weights, so one example's label rescales every other example's gradient (a privacy review
moved a step by 9.6 times its bound with a class of weight 1000, in both isolation modes). dpzero
refuses that call when its class-index target derives from the private loader's tensors (the
functional form, the loss modules, torch's old name "elementwise_mean", and the ATen operators
they call, torch._C._nn.* and torch.ops.aten.*), naming the fix: ``reduction="none"`` and then
``.mean()`` or ``.sum()``, which weights each example by its own class and divides by the row
count, as ``loss_reduction`` says. Class-probability targets are divided by the row count, and
pass. Under isolation="detect" the model's outputs are plain tensors, so targets that do not come
from the loader (pseudo-labels from the outputs, labels rebuilt through numpy) are not seen;
isolation="strict" refuses those losses (its Note [strict isolation]).

What this cannot see: a normaliser the training loop computes itself (``loss.sum() /
weights.sum()``, a loss divided by the batch's detached total), and a mean over all tokens of a
batch of sequences (``ignore_index`` padding: the divisor is the batch's token count); the user
guide's section on losses says so. Those are the caller's, as in every DP-SGD library.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Tuple

import torch
import torch.nn.functional as F

from .errors import PrivacyViolation

_FUNCTIONAL = {F.cross_entropy: inspect.signature(F.cross_entropy),
               F.nll_loss: inspect.signature(F.nll_loss)}
# The ATen forms (torch._C._nn.*, torch.ops.aten.*): (self, target, weight, reduction as an
# integer, ignore_index[, label_smoothing]); reduction 1 is the mean.
_ATEN = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")
_ATEN_NAMES = {"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d"}
_ATEN_MEAN = 1


def _aten_name(func) -> str:
    """The ATen operator's name of a torch._C._nn function or a torch.ops.aten operator, else
    ""."""
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        qualified = getattr(func, "_qualified_op_name", None) or func._schema.name
        return qualified.partition("::")[2] if qualified.startswith("aten::") else ""
    if getattr(func, "__module__", None) == "torch._C._nn":
        return getattr(func, "__name__", "")
    return ""


def _weighted_mean(func, args: Tuple[Any, ...], kwargs: Dict[str, Any]):
    """(the call's name, its target) when ``func(*args, **kwargs)`` is a class-weighted mean of
    a cross-entropy or negative log-likelihood, else None."""
    signature = _FUNCTIONAL.get(func)
    if signature is not None:
        try:
            given = signature.bind(*args, **kwargs).arguments
        except TypeError:
            return None  # torch raises its own error for the call
        reduction = given.get("reduction", "mean")
        if given.get("size_average") is not None or given.get("reduce") is not None:
            reduction = torch.nn._reduction.legacy_get_string(
                given.get("size_average"), given.get("reduce"), emit_warning=False)
        mean = reduction in ("mean", "elementwise_mean")  # the second: torch's old name
        return (func.__name__, given.get("target")) if mean and \
            given.get("weight") is not None else None
    name = _aten_name(func)
    if name not in _ATEN_NAMES:
        return None
    given = dict(zip(_ATEN, args))
    given.update(kwargs)
    mean = given.get("reduction", _ATEN_MEAN) == _ATEN_MEAN
    return (name, given.get("target")) if mean and given.get("weight") is not None else None


def check_loss(func, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """Raises PrivacyViolation for a call of ``func`` (a torch function called with the private
    loader's tensors among its operands) whose reduction couples the examples (Note [losses that
    couple examples])."""
    found = _weighted_mean(func, args, kwargs)
    if found is None:
        return
    name, target = found
    if isinstance(target, torch.Tensor) and target.is_floating_point():
        return  # class probabilities: torch divides by the row count, not by the weights
    raise PrivacyViolation(
        f"{name}(..., weight=..., reduction='mean') on the private loader's examples divides the "
        "loss by the sum of the batch's class weights, so one example's label rescales every "
        "other example's gradient before it is clipped (Note [losses that couple examples] in "
        "dpzero/private/losses.py). Use F.cross_entropy(..., weight=..., "
        "reduction='none').mean() (or .sum()): each example weighted by its own class, divided "
        "by the row count")
