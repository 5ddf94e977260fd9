"""The trainable set fixed at make_private, and the check at every step that it has not changed.

The engine trains the parameters that were trainable when it attached: one unfrozen since would
get no update (and no guard), one frozen since would still be updated. The step therefore compares
the model's trainable parameters now with that set. Walking the module tree for them
(``model.parameters()``) costs about half a millisecond on a 150-module model, once per step; so
the modules are listed once, and listed again only after some module in the process registered a
submodule (torch's global module-registration hook counts those). Between registrations the set is
read off that list's own parameter dicts: a parameter frozen, unfrozen, replaced, removed or added
on a listed module is seen exactly as a walk would see it.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

_registrations = 0  # submodules registered anywhere in the process since import


def _count_registration(module, name, submodule) -> None:
    global _registrations
    _registrations += 1


torch.nn.modules.module.register_module_module_registration_hook(_count_registration)


class TrainableSet:
    """The parameters ``model`` trains privately (``params``: those with requires_grad when
    make_private began, in ``model.parameters()`` order)."""

    def __init__(self, model: nn.Module, params: List[torch.Tensor]) -> None:
        self.model = model
        self.params = list(params)
        self.ids = frozenset(id(p) for p in self.params)
        self._listed_at = -1
        self._modules: List[nn.Module] = []

    def _trainable_ids_now(self) -> frozenset:
        if self._listed_at != _registrations:
            self._modules = list(self.model.modules())
            self._listed_at = _registrations
        return frozenset(id(p) for m in self._modules for p in m._parameters.values()
                         if p is not None and p.requires_grad)

    def changed(self) -> Optional[str]:
        """Why the model's trainable parameters are no longer the set fixed at construction (an
        error text naming them), or None."""
        if self._trainable_ids_now() == self.ids:
            return None
        names = [n for n, p in self.model.named_parameters()
                 if p.requires_grad != (id(p) in self.ids)]
        return (f"the trainable parameters changed since make_private ({names[:5]}...); "
                "freeze or unfreeze before make_private")
