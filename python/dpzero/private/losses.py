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
refuses that call when its target (or input) derives from the private loader's tensors, naming
the fix: ``reduction="none"`` and then ``.mean()`` or ``.sum()``, which weights each example by
its own class and divides by the row count, as ``loss_reduction`` says.

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

_WEIGHTED_MEANS = {F.cross_entropy: inspect.signature(F.cross_entropy),
                   F.nll_loss: inspect.signature(F.nll_loss)}


def check_loss(func, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """Raises PrivacyViolation for a call of ``func`` (a torch function called with the private
    loader's tensors among its operands) whose reduction couples the examples (Note [losses that
    couple examples])."""
    signature = _WEIGHTED_MEANS.get(func)
    if signature is None:
        return
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return  # torch raises its own error for the call
    given = bound.arguments
    if given.get("weight") is None:
        return
    reduction = given.get("reduction", "mean")
    if given.get("size_average") is not None or given.get("reduce") is not None:
        reduction = torch.nn._reduction.legacy_get_string(given.get("size_average"),
                                                           given.get("reduce"), emit_warning=False)
    if reduction != "mean":
        return
    raise PrivacyViolation(
        f"{func.__name__}(..., weight=..., reduction='mean') on the private loader's examples "
        "divides the loss by the sum of the batch's class weights, so one example's label "
        "rescales every other example's gradient before it is clipped (Note [losses that couple "
        f"examples] in dpzero/private/losses.py). Use {func.__name__}(..., weight=..., "
        "reduction='none').mean() (or .sum()): each example weighted by its own class, divided "
        "by the row count")
