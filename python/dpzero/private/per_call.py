"""Outputs of a strictly isolated model with one value per call: what may be done with them.

Note [per-call outputs]
~~~~~~~~~~~~~~~~~~~~~~~
Under strict isolation (Note [strict isolation] in strict.py) an output with one value per call
(a loss the model computes itself, ``outputs.loss``, an auxiliary loss) is the mean of the
examples' own values, and the gradient G that reaches it is passed to every example alike. So G
must be a constant, not a function of the batch: a learned temperature returned beside the logits
and divided into them makes G the whole batch's loss (a review: 8.94C against 2C), and so does a
weight read off the batch, ``aux * (aux.detach() - 3)`` (7.80C), ``aux / aux.detach()`` (2.79C)
or ``aux * logits.detach().std()`` (7.19C).

Such an output is a :class:`PerCall` tensor. It is a *source*, and every tensor computed from it
by an operation linear in it with constant weights is a PerCall too, carrying per source k its
coefficients ``C_k`` (float64, ``[n_k, *shape]`` for a source of n_k elements: the derivative of
each of its elements with respect to each of the source's): sums with anything (the other
terms' values do not reach G), products and quotients with constants, reductions, shape operations,
indexing, stacking, casts. A *constant* is a Python number, or a tensor that needs no gradient and
carries nothing of the batch: not the loader's tensors or anything computed from them, not the
model's outputs (tagged as the examples, Note [batch provenance] in provenance/examples.py), not a
read of a PerCall (``aux.detach()``, a comparison: these come back tainted). Any other operation
that carries a gradient is refused at once, naming it.

That is for clear errors; the guarantee is a check. ``backward()`` on a PerCall registers, per
source, the gradient its coefficients promise (``sum(gradient * C_k)`` over the root's
elements, with a constant root gradient), and the tap's backward (strict.py) holds the G that
arrived at the source to it, on the tensors' device, read at the step, which it refuses. A use
the rules never saw (an autograd Function's apply, reentrant checkpointing, ``as_subclass``, a
hook on the tensor) makes G differ from the promise, or arrive with none registered (a backward
rooted elsewhere), and the step is refused. What neither sees is a weight copied out of the
batch where the examples' tag cannot follow (``.item()``, ``.tolist()``, ``.numpy().copy()``, a
pickle round trip, a copy into an ``nn.Parameter``, ``torch.tensor(x)``, ``as_subclass``,
assigning ``.data``, a gradient accumulated into a leaf, a copy of the storage, DLPack): the
limit Note [batch provenance] names for every copy of the batch's statistics. (A copy into a
plain tensor, a view of one or a list of them, ``_foreach_copy_``, taints it and its base.)
"""

from __future__ import annotations

import itertools
from typing import Callable, Dict, Optional

import torch
from torch.utils import _pytree as pytree

from .errors import PrivacyViolation
from .provenance.examples import Examples, MicroBatchToken, holds_examples, storage_id, taint_only

SOURCES = itertools.count()
_MOST_FOLLOWED = 1024  # elements of a per-call output whose coefficients are followed
_PROMISED: Dict[int, torch.Tensor] = {}  # source -> the gradient backward() promised, [n_k]

T = torch.Tensor
# (operand positions) of operations that add their operands: the other operands' values do not
# reach a PerCall operand's gradient, so they count as zeros in its coefficients.
_ADDITIVE = {f: (0, 1) for f in (
    T.__add__, T.__radd__, T.__iadd__, T.add, T.add_, torch.add, T.__sub__, T.__rsub__,
    T.__isub__, T.sub, T.sub_, torch.sub, torch.subtract)}
_ADDITIVE.update({f: (0,) for f in (torch.stack, torch.cat, torch.concat, torch.concatenate,
                                     torch.hstack, torch.vstack)})
# Operations with one PerCall operand (the first), linear in it, whose other arguments are
# constants or not operands at all (dims, shapes, indices).
_UNARY = {T.__neg__, T.neg, torch.neg, T.sum, torch.sum, T.mean, torch.mean, T.view, T.reshape,
          torch.reshape, T.view_as, T.reshape_as, T.squeeze, torch.squeeze, T.unsqueeze,
          torch.unsqueeze, T.flatten, torch.flatten, T.expand, T.expand_as, T.__getitem__,
          T.select, torch.select, T.narrow, torch.narrow, T.t, T.transpose, torch.transpose,
          T.permute, torch.permute, T.movedim, torch.movedim, T.repeat, T.clone, torch.clone,
          T.contiguous, T.nansum, torch.nansum}
_SHAPE_ONLY = {T.view_as, T.reshape_as, T.expand_as}  # their tensor argument gives a shape
# Casts: the coefficients stay as they are (float64), on the result's device.
_CASTS = {T.to, T.float, T.double, T.half, T.bfloat16, T.cpu, T.cuda, T.type_as, T.type}
# Products with one PerCall operand and a constant other; quotients with a PerCall dividend.
_PRODUCTS = {T.__mul__, T.__rmul__, T.__imul__, T.mul, T.mul_, torch.mul, torch.multiply}
_QUOTIENTS = {T.__truediv__, T.__itruediv__, T.div, T.div_, torch.div, torch.true_divide,
              torch.divide}
_IN_PLACE = {T.__iadd__, T.add_, T.__isub__, T.sub_, T.__imul__, T.mul_, T.__itruediv__,
             T.div_}
_BACKWARD = {T.backward, torch.autograd.backward}


# In-place operations, as the out-of-place ones their coefficients are computed with (which
# must not write into a tensor's coefficients: another tensor may share them).
_OUT_OF_PLACE = {T.__iadd__: torch.add, T.add_: torch.add, T.__isub__: torch.sub,
                 T.sub_: torch.sub}


def constant(x, batch: Optional[MicroBatchToken]) -> bool:
    """A Python number, or a tensor that needs no gradient and carries nothing of the batch
    ``batch`` (not an Examples, not memory of its handed to numpy or DLPack) (Note [per-call
    outputs])."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return True
    if not isinstance(x, torch.Tensor) or isinstance(x, Examples) or x.requires_grad:
        return False
    return batch is None or not batch.escaped or storage_id(x) not in batch.escaped


def _f64(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros(x.shape, dtype=torch.float64, device=x.device)


def _each(c: torch.Tensor, one: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """``one(i)`` for each of a source's n_k coefficient slices, stacked: [n_k, *result]."""
    return torch.stack([one(i).to(torch.float64) for i in range(c.shape[0])])


def _coefficients(func, args, kwargs, out, batch) -> Optional[Dict[int, torch.Tensor]]:
    """The coefficients of ``out = func(*args, **kwargs)`` per source when it is linear in its
    PerCall operands with constant weights (Note [per-call outputs]); else None."""
    if kwargs.get("out") is not None or not isinstance(out, torch.Tensor):
        return None
    func = _OUT_OF_PLACE.get(func, func)
    leaves = pytree.tree_leaves((args, kwargs))
    per_call = [x for x in leaves if isinstance(x, PerCall)]
    if any(c is None for x in per_call for c in x._dp_coef.values()):
        return None  # a source too large to follow
    sources: Dict[int, torch.Tensor] = {}
    for x in per_call:
        for k, c in x._dp_coef.items():
            sources.setdefault(k, c)
    with torch._C.DisableTorchFunctionSubclass():
        if func in _CASTS and isinstance(args[0], PerCall):
            return {k: c.to(out.device) for k, c in args[0]._dp_coef.items()}
        if func in _UNARY and isinstance(args[0], PerCall) and len(per_call) == 1:
            rest = args[1:]
            if func not in _SHAPE_ONLY and not all(
                    constant(x, batch) for x in pytree.tree_leaves((rest, kwargs))
                    if isinstance(x, torch.Tensor)):
                return None  # an index or a size computed from the batch selects from it
            return {k: _each(c, lambda i, c=c: func(c[i], *rest, **kwargs))
                    for k, c in args[0]._dp_coef.items()}
        if func in _ADDITIVE:
            if kwargs.get("alpha") is not None and not constant(kwargs["alpha"], batch):
                return None
            positions = _ADDITIVE[func]

            def one(k: int, i: int) -> torch.Tensor:
                def operand(x):
                    if isinstance(x, PerCall):
                        c = x._dp_coef.get(k)
                        return c[i] if c is not None else _f64(x)
                    return _f64(x) if isinstance(x, torch.Tensor) else 0.0
                new = list(args)
                for p in positions:
                    if p < len(new):
                        new[p] = pytree.tree_map(operand, new[p])
                kw = {n: pytree.tree_map(operand, v) if n in ("other", "tensors") else v
                      for n, v in kwargs.items()}
                return func(*new, **kw)
            return {k: _each(c, lambda i, k=k: one(k, i)) for k, c in sources.items()}
        if func in _PRODUCTS or func in _QUOTIENTS:
            a, b = args[0], args[1] if len(args) > 1 else kwargs.get("other")
            if func in _QUOTIENTS and (not isinstance(a, PerCall) or
                                       kwargs.get("rounding_mode") is not None):
                return None
            x, w = (a, b) if isinstance(a, PerCall) else (b, a)
            if isinstance(w, PerCall) or not constant(w, batch):
                return None
            if func in _QUOTIENTS:
                return {k: _each(c, lambda i, c=c: c[i] / w) for k, c in x._dp_coef.items()}
            return {k: _each(c, lambda i, c=c: c[i] * w) for k, c in x._dp_coef.items()}
    return None


def _promise(args, kwargs, batch) -> None:
    """backward() on PerCall roots: the gradient each source is promised (Note [per-call
    outputs]). A root gradient that is not a constant is refused."""
    roots = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
    given = kwargs.get("gradient", kwargs.get("grad_tensors",
                                               args[1] if len(args) > 1 else None))
    given = given if isinstance(given, (list, tuple)) else [given] * len(roots)
    with torch._C.DisableTorchFunctionSubclass():
        for root, g in zip(roots, given):
            if not isinstance(root, PerCall):
                continue
            if g is not None and not constant(g, batch):
                raise PrivacyViolation(
                    "backward() of a per-call output of a model under isolation='strict' with a "
                    "gradient that is computed from the batch or needs one itself (Note "
                    "[per-call outputs] in per_call.py): pass a number, or nothing")
            g = torch.ones((), dtype=torch.float64) if g is None else \
                torch.as_tensor(g, dtype=torch.float64)
            for k, c in root._dp_coef.items():
                if c is None:  # the source itself, unfollowed: promised the gradient given
                    add = g.to(root.device).expand(root.shape).reshape(-1)
                else:
                    add = (c * g.to(c.device)).reshape(c.shape[0], -1).sum(1)
                _PROMISED[k] = _PROMISED[k].to(add.device) + add if k in _PROMISED else add


class PerCall(Examples):
    """Note [per-call outputs]: a tensor computed from the per-call outputs of a strict model
    (``_dp_coef``: source -> coefficients [n_k, *shape], float64), and the micro-batch it came
    from (``_dp_batch``: what its reads are tainted with). A subclass of Examples, so that its
    rules run first where both meet."""

    _dp_coef: Dict[int, torch.Tensor]
    _dp_batch: Optional[MicroBatchToken]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        batch = next((x._dp_batch for x in pytree.tree_leaves((args, kwargs))
                      if isinstance(x, PerCall)), None)
        if func in _BACKWARD:
            _promise(args, kwargs, batch)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if not any(isinstance(o, torch.Tensor) and o.requires_grad
                   for o in pytree.tree_leaves(out)):
            # A read (detach, a comparison, a value without a gradient): the batch's, tainted.
            if func in _IN_PLACE and type(args[0]) is torch.Tensor:
                holds_examples(args[0], batch)
            return pytree.tree_map(lambda o: _read(o, batch), out)
        coef = _coefficients(func, args, kwargs, out, batch)
        if coef is None:
            raise PrivacyViolation(
                f"{getattr(func, '__name__', func)} on a per-call output of a model under "
                "isolation='strict' (one value for the whole micro-batch, such as a loss the "
                "model computes itself): its gradient would reach every example, so it may only "
                "be back-propagated, added to other values, reshaped, and scaled by constants, "
                "not by anything computed from the batch (Note [per-call outputs] in "
                "per_call.py). Return per-example values instead (a loss per example, a "
                "parameter used inside the model), and combine them with the examples' outputs "
                "there")
        if func in _IN_PLACE:
            target = args[0]
            if isinstance(target, PerCall):
                target._dp_coef = coef
                return target
            if type(target) not in (torch.Tensor, Examples):
                raise PrivacyViolation(
                    f"{func.__name__} writes a per-call output of a model under "
                    f"isolation='strict' into a {type(target).__name__}, whose uses dpzero "
                    "cannot follow (Note [per-call outputs]): add it out of place")
            target.__class__ = PerCall
            _mark(target, coef, batch)
            return target
        return _mark(out.as_subclass(PerCall), coef, batch)

    @staticmethod
    def source(t: torch.Tensor, source: int, batch: MicroBatchToken) -> "PerCall":
        """``t`` (a per-call output of the model) as source ``source``: its coefficients are the
        identity, or None past ``_MOST_FOLLOWED`` elements (then it may only be
        back-propagated as it is)."""
        n = t.numel()
        eye = None if n > _MOST_FOLLOWED else \
            torch.eye(n, dtype=torch.float64, device=t.device).reshape(n, *t.shape)
        return _mark(t.as_subclass(PerCall), {source: eye}, batch)


def _mark(p: PerCall, coef: Dict[int, torch.Tensor], batch) -> PerCall:
    p._dp_coef, p._dp_batch = coef, batch
    p.dp_token, p.dp_taint, p.dp_bdim, p.dp_version = None, None, -1, -1
    return p


def _read(o, batch: Optional[MicroBatchToken]):
    if not isinstance(o, torch.Tensor):
        return o
    o = o.as_subclass(torch.Tensor) if isinstance(o, PerCall) else o
    return taint_only(o, batch) if batch is not None else o


def hold_to_promise(book, source: int, g: Optional[torch.Tensor], like: torch.Tensor) -> None:
    """Defers the check that the gradient ``g`` that reached per-call output ``source`` (shaped
    like ``like``) is what its uses promised (Note [per-call outputs]); read at the step, which
    it refuses."""
    promised = _PROMISED.pop(source, None)
    with torch._C.DisableTorchFunctionSubclass():
        if promised is None:
            promised = torch.zeros(like.numel(), dtype=torch.float64)
        promised = promised.to(like.device).reshape(like.shape)
        if g is None:
            failed = (promised != 0).any()
        else:
            failed = ((g.double() - promised).abs() >
                      1e-6 * promised.abs().clamp(min=1.0)).any()

    def text() -> str:
        return ("the gradient that reached a per-call output of the model (isolation='strict': "
                "a loss the model computes itself) is not what its uses promised: it went "
                "through an operation dpzero cannot follow (an autograd Function, reentrant "
                "checkpointing, as_subclass, a hook on the tensor), which could put the whole "
                "batch into every example's gradient (Note [per-call outputs] in per_call.py). "
                "Compute the loss from per-example outputs, or use the model's loss only "
                "through backward(), sums and constants")
    book.defer(failed, text)
