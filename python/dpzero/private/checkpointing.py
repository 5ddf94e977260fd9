"""Activation checkpointing under DP: ``make_private(..., activation_checkpointing=...)``.

A checkpointed module keeps no activations from its forward; its forward is run again inside the
backward to regenerate them (``torch.utils.checkpoint.checkpoint`` with ``use_reentrant=False``,
dropout masks reproduced from the saved RNG state). What makes that correct under DP is the
book's side: the recomputed calls of DP layers register nothing and the original autograd nodes
report the recomputed inputs (Note [recomputed forwards] in book.py). Hugging Face models can use
their own switch instead (``model.activation_checkpointing_enable()``, non-reentrant by default);
a reentrant configuration is refused up front by :func:`check_reentrant`.

Which modules: ``True`` checkpoints every ZeRO unit but the root (a transformer block each, with
dpzero's default units); a list of module names checkpoints those; a module class (or a tuple of
classes) checkpoints every module of that class (as ``torch.distributed``'s
``apply_activation_checkpointing`` with ``check_fn=lambda m: isinstance(m, cls)``).
"""

from __future__ import annotations

import functools
from typing import List, Sequence, Union

import torch
import torch.utils.checkpoint
from torch import nn

Spec = Union[None, bool, Sequence[str], type, tuple]


def _checkpointed_forward(original, *args, **kwargs):
    # Inside a backward (a recompute of an enclosing checkpoint) or without autograd there is
    # nothing to save: run the forward as it is.
    if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
        return original(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(original, *args, use_reentrant=False, **kwargs)


def resolve(model: nn.Module, spec: Spec, unit_names: Sequence[str]) -> List[str]:
    """The names of the modules ``spec`` selects (checked, errors name the bad value)."""
    if spec is None or spec is False:
        return []
    if spec is True:
        names = [u for u in unit_names if u != "<root>"]
        if not names:
            raise ValueError("activation_checkpointing=True checkpoints every ZeRO unit but the "
                             "root, and this model has no other unit; pass module names or a "
                             "module class (or units=[...])")
        return names
    if isinstance(spec, type) or (isinstance(spec, tuple) and spec
                                  and all(isinstance(c, type) for c in spec)):
        names = [n for n, m in model.named_modules() if n and isinstance(m, spec)]
        if not names:
            raise ValueError(f"activation_checkpointing={spec!r}: the model has no module of "
                             "that class")
        return names
    if isinstance(spec, str) or not isinstance(spec, Sequence):
        raise ValueError("activation_checkpointing must be True, a list of module names or a "
                         f"module class, got {spec!r}")
    known = dict(model.named_modules())
    for name in spec:
        if name not in known or name == "":
            raise ValueError(f"activation_checkpointing: the model has no submodule {name!r}")
    nested = sorted(a for a in spec for b in spec if a != b and a.startswith(b + "."))
    if nested:
        raise ValueError(f"activation_checkpointing: {nested} lie inside other modules of the "
                         "list; checkpoint the outer ones only")
    return list(spec)


def apply(model: nn.Module, names: Sequence[str]) -> List[nn.Module]:
    """Wraps each named module's forward (after the DP layers are patched); returns the modules
    for :func:`remove`."""
    # A Hugging Face key/value cache would grow again in the recompute; the private model runs
    # without one (Note [no key/value cache] in attach.py, applied before this).
    modules = []
    for name in names:
        module = model.get_submodule(name)
        original = module.forward
        module._dp_checkpoint_original = module.__dict__.get("forward")
        module.forward = functools.partial(_checkpointed_forward, original)
        modules.append(module)
    return modules


def remove(modules: Sequence[nn.Module]) -> None:
    for module in modules:
        previous = module.__dict__.pop("_dp_checkpoint_original", None)
        if previous is not None:
            module.forward = previous
        else:
            module.__dict__.pop("forward", None)


def check_reentrant(model: nn.Module) -> None:
    """Hugging Face modules set up for reentrant checkpointing (``use_reentrant=True`` in their
    ``_gradient_checkpointing_func``) cannot train under DP (Note [recomputed forwards] in
    book.py): refused before anything is attached, naming the module and the remedy."""
    for name, module in model.named_modules():
        fn = getattr(module, "_gradient_checkpointing_func", None)
        if not getattr(module, "gradient_checkpointing", False) or fn is None:
            continue
        keywords = getattr(fn, "keywords", None) or {}
        if keywords.get("use_reentrant", False):
            raise ValueError(
                f"module {name or '<model>'!r} ({type(module).__name__}) uses reentrant "
                "activation checkpointing (use_reentrant=True), which DP training cannot "
                "account for; enable it with activation_checkpointing_kwargs="
                "{'use_reentrant': False} (the default), or use make_private(..., "
                "activation_checkpointing=...)")
