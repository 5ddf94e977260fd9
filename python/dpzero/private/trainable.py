"""The trainable set fixed at make_private, and the check at every step that it has not changed.

The engine trains the parameters that were trainable when it attached: one unfrozen since would
get no update (and no guard), one frozen since would still be updated. The step therefore compares
the model's trainable parameters now with that set. Walking the module tree for them
(``model.parameters()``) costs about half a millisecond on a 150-module model, once per step. So
the modules are listed once, together with each one's children; at a step, when every listed
module still has the very same children (a submodule added, inserted, removed or replaced by any
means changes its parent's), the trainable set is read off the listed modules' own parameter dicts,
which sees a parameter frozen, unfrozen, replaced, removed or added exactly as a walk would;
otherwise the tree is walked and listed again. Reading the listed modules' dicts in Python is itself
about a tenth of a millisecond on such a model, twice a step, so once the set was found unchanged
the listing is held in a snapshot (Note [module tree snapshots] in
python/csrc/module_tree_bindings.cpp), and while every listed module holds the very same dicts,
children, parameters and requires_grad flags, neither walk runs.
"""

from __future__ import annotations

import contextlib
import operator
from typing import List, Optional, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .. import _C


# Note [checks alone]
# ~~~~~~~~~~~~~~~~~~~
# The checks compare the model's state with what was recorded, and the record after an update takes
# the update's writes as the optimizer's. Python code that ran in between (a __torch_function__ or
# __torch_dispatch__ mode the caller left active around optimizer.step(), which sees every torch
# call the checks and the update make) could change the state after its check or before its record:
# a write recorded as the update's own is never refused, so a mode could release a row of the batch
# as a trained bias. So the checks, and the step from its checks to its record, run with
# torch-function handling disabled and the Python dispatch modes set aside (they are restored
# after), but for an ``Observer``, a dispatch mode of dpzero's own kind that promises to write
# nothing (the operator counts of tests/python/test_device_path.py subclass it; no library's mode is
# one). Code that is not a mode (a finalizer, another thread, a profile hook, a tensor subclass's
# own __torch_dispatch__) is not excluded: what it changes in the tree or in a parameter's place is
# seen by the next check, which reads both afresh (Note [module tree snapshots]), but a value it
# wrote into a trained parameter during the update would be recorded as the update's.
class Observer(TorchDispatchMode):
    """A dispatch mode that sees the private step's operators and writes nothing: the one kind
    of mode Note [checks alone] keeps inside the checks (for tests that count operators)."""


@contextlib.contextmanager
def checks_alone():
    """Note [checks alone]: no torch-function or Python dispatch mode but an Observer runs
    inside."""
    with torch._C.DisableTorchFunction(), _disable_current_modes() as modes, \
            contextlib.ExitStack() as observers:
        for mode in reversed(modes):  # outermost first, as they were pushed
            if isinstance(mode, Observer):
                observers.enter_context(mode)
        yield


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
        # Note [module tree snapshots]: the listing, its children and parameters as they were when
        # changed() last found the set unchanged; and whether modules() found them so (with
        # _current).
        self._snapshot: Optional[_C.tree.Snapshot] = None
        self._unchanged = False

    @contextlib.contextmanager
    def one_listing(self):
        """A run of checks called one after another (the step's: the module state's flags, its
        verification and the trainable set; those before a micro-batch is handed out), during
        which ``modules()`` checks the listing once for all of them. Inside another run, this one
        is part of it. No torch-function or Python dispatch mode runs inside (Note [checks
        alone]); other Python code that could (a finalizer, a thread) and
        changes the tree is seen by the next check, which reads the listing afresh: no snapshot
        records a state other than the one its verdict read (Note [module tree snapshots])."""
        if self._within:  # inside another run of checks: its listing holds
            yield
            return
        self._within, self._current = True, False
        try:
            with checks_alone():  # Note [checks alone]
                yield
        finally:
            self._within = self._current = False

    def modules(self) -> List[nn.Module]:
        """The model's modules now (the listing is walked again only when some listed module's
        children changed)."""
        if self._current:
            return self._modules
        # The snapshot holds every listed module's children: the same, the listing is current.
        self._unchanged = self._snapshot is not None and self._snapshot.same(self._modules)
        if not self._unchanged and (not self._listed or not all(
                [_same_children(m, children) for m, children in self._listed])):
            self._listed = [(m, tuple(m._modules.values())) for m in self.model.modules()]
            self._modules = [m for m, _ in self._listed]
        self._current = self._within
        return self._modules

    def unchanged_since(self) -> Optional["_C.tree.Snapshot"]:
        """The snapshot whose dicts every listed module still holds, as modules() (called first)
        found them; None if some changed since, or before the first snapshot (Note [module tree
        snapshots]). A check whose answer is a function of those dicts and found nothing while
        they were the snapshot's finds nothing again for as long as this returns that snapshot."""
        return self._snapshot if self._unchanged else None

    def changed(self) -> Optional[str]:
        """Why the model's trainable parameters are no longer the set fixed at construction (the
        refusal of Note [trained set] in src/dp/run.h, naming them), or None. A tensor's Python
        object is its TensorImpl's for as long as either lives, so the set of ids compared here
        differs exactly when the rule's set of tensors does."""
        modules = self.modules()
        if self._unchanged:  # every parameter and requires_grad as when the set was unchanged
            return None
        snapshot = _C.tree.Snapshot(modules)
        if snapshot.complete:  # the verdict is read off what the snapshot holds
            if frozenset(snapshot.trainable()) == self.ids:
                self._snapshot, self._unchanged = snapshot, True
                return None
        else:  # the tree grew during the checks: this one reads it live, the next lists it again
            now = {id(p) for m in modules for p in m._parameters.values()
                   if p is not None and p.requires_grad}
            if now == self.ids:
                return None
        return _C.dp.trained_set_refusal(self.params, list(self.model.named_parameters()))
