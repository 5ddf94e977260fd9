"""The trainable set fixed at make_private, and the check at every step that it has not changed.

The engine trains the parameters that were trainable when it attached: one unfrozen since would
get no update (and no guard), one frozen since would still be updated. The step therefore compares
the model's trainable parameters now with that set. Walking the module tree for them
(``model.parameters()``) costs about half a millisecond on a 150-module model, once per step. So
the modules are listed once, together with each one's children; at a step, when every listed
module still has the very same children (a submodule added, inserted, removed or replaced by any
means changes its parent's), the trainable set is read off the listed modules' own parameter dicts,
which sees a parameter frozen, unfrozen, replaced, removed or added exactly as a walk would;
otherwise the tree is walked and listed again.
"""

from __future__ import annotations

import contextlib
import operator
from typing import List, Optional, Tuple

import torch
from torch import nn

from .. import _C


def _same_children(module: nn.Module, children: tuple) -> bool:
    """Whether ``module`` still has exactly these children, by identity (a module's own __eq__
    plays no part)."""
    now = module._modules.values()
    return len(now) == len(children) and all(map(operator.is_, now, children))


class TrainableSet:
    """The parameters ``model`` trains privately (``params``: those with requires_grad when
    make_private began, in ``model.parameters()`` order)."""

    def __init__(self, model: nn.Module, params: List[torch.Tensor]) -> None:
        self.model = model
        self.params = list(params)
        self.ids = frozenset(id(p) for p in self.params)
        self._listed: List[Tuple[nn.Module, tuple]] = []  # (module, its children when listed)
        self._modules: List[nn.Module] = []
        self._within = False   # inside one_listing()
        self._current = False  # and the listing was checked there

    @contextlib.contextmanager
    def one_listing(self):
        """A run of checks that no user code interleaves (the step's: the module state's flags,
        its verification and the trainable set, called one after another): the model cannot
        change between them, so ``modules()`` checks the listing once for all of them."""
        self._within, self._current = True, False
        try:
            yield
        finally:
            self._within = self._current = False

    def modules(self) -> List[nn.Module]:
        """The model's modules now (the listing is walked again only when some listed module's
        children changed)."""
        if self._current:
            return self._modules
        if not self._listed or not all([_same_children(m, children)
                                        for m, children in self._listed]):
            self._listed = [(m, tuple(m._modules.values())) for m in self.model.modules()]
            self._modules = [m for m, _ in self._listed]
        self._current = self._within
        return self._modules

    def changed(self) -> Optional[str]:
        """Why the model's trainable parameters are no longer the set fixed at construction (the
        refusal of Note [trained set] in src/dp/run.h, naming them), or None. A tensor's Python
        object is its TensorImpl's for as long as either lives, so the set of ids compared here
        differs exactly when the rule's set of tensors does."""
        now = {id(p) for m in self.modules() for p in m._parameters.values()
               if p is not None and p.requires_grad}
        if now == self.ids:
            return None
        return _C.dp.trained_set_refusal(self.params, list(self.model.named_parameters()))
