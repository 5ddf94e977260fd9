"""Which DP layer inputs hold the examples on dim 0: the model's root forward and its probe.

Note [batch provenance] (examples.py) says why; this file is its second half. The model given to
``make_private`` gets a root forward (:func:`root_forward`, patched like the DP layers) that

1. refuses a call whose inputs carry no tag of the engine's current micro-batch (the batch did not
   come from the private loader or ``own_batch``): the forward runs, registering nothing, and a
   backward through it raises (so an evaluation on other data without ``torch.no_grad()`` is
   harmless);
2. unwraps the tagged inputs and runs the model; every DP layer call records its inputs
   (:class:`CallRecord`) with the part it registers in the book;
3. looks the call pattern up (:func:`pattern`: the inputs' structure and non-tensor values, which
   of them hold the examples, the sequence of DP layer calls with their inputs' ranks); for a new
   one, or when a size of some layer input coincides with the batch size, runs the probe
   (:func:`run_probe`) and classifies each input of each call (:func:`classify`);
4. hands each part its verdict (``Part.in_dims``) or refuses the call with the module's name and
   the fix, before any of the micro-batch's gradients exists.

The probe is the same forward on the same inputs with example 0 repeated at the end of each
tagged input's batch dim: B + 1 rows, the first B as in the real call (so branches on the
examples' values go the same way), autograd saving nothing, RNG state and buffers restored
(:class:`Probe` runs and records its calls). A layer input

* whose dim 0 went from B to B + 1, other dims unchanged, holds the examples (BATCHED);
* whose shape and values did not change is shared by the whole batch (SHARED): Embedding ids of
  shape [1, ...] are expanded to the batch in both runs (Note [broadcast positions]), which is
  sound only if the model combines the lookup with the batch row by row — the probe follows the
  expanded lookup (:class:`_Lookup`) until an elementwise operation meets a batched tensor, and
  anything else it is used in first (``.mean(0)``, ``[0]``) refuses the call — and only if the
  ids are not computed from particular examples (``ids[:1]``): a second probe, with the examples
  rotated (example 1 first), must see the same ids. Other shared inputs are refused with the fix
  (give ids a batch dim of 1, expand, or freeze);
* whose shape stayed but whose values changed is computed from the examples (a batch mean), and
  any other change puts the batch elsewhere (seq-first [T, B, d], flattened [B T, d]): refused.

A pattern's verdicts are reused for later calls with the same pattern (typically the probe runs
once per run; under activation checkpointing, recomputed calls take the verdict of the call they
recompute), each call held to the shared values they rest on (Note [premises]), except that a
call where some layer input has a dimension other than dim 0 equal to the batch size is probed
again: there a cached verdict could stand for another layout (B = T and
a seq-first branch). Verdicts from one-example batches are not cached (rotating one example
changes nothing). What the probe cannot see: a model whose branches on the data feed one layer
call, at the same place in the same pattern, the examples on some steps and a shared tensor with
as many rows as the batch on others, or whose branch on a batch aggregate (a sum over the
examples) changes the layout when one example is added while a dimension equals the batch
size; a model that mixes examples across rows itself (batch statistics, in-batch negatives:
BatchNorm is refused by type); and one that permutes the examples between layers (sorting by
length) — dim 0 still holds the examples, in another order, which flat clipping would pair
wrongly across layers (clipping="layer" bounds each layer's rows on their own, so it stays
within C). At stage 3 the probe's forward gathers units, so every rank probes when any rank
must (:class:`Ranks`: two collectives after every forward with gradients), and with several
ranks, at any stage, every rank refuses a forward when any rank does (one more).
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import PrivacyViolation
from ..state_guard import refusal_text
from .examples import Examples, MicroBatchToken, is_suspect, lost_at, untagged, wrap
from .registry import varies_along
from .rules.elementwise import ELEMENTWISE, ELEMENTWISE_INPLACE

Shape = Tuple[int, ...]

BATCHED, SHARED = "batched", "shared"


class CallRecord(NamedTuple):
    """One call of a DP layer as the probe compares it: ``layer`` (Layer.index); ``inputs``: the
    shapes of the call's tensor arguments, positional first (None for a non-tensor), then
    ``kw_inputs`` likewise for keyword arguments (sorted by name); ``output``: None (a kernel
    layer). Not compared
    by the pattern: ``tensors``, the real call's tensor arguments in that order (held until the
    probe compared them); ``same``, per argument, whether the probe's equals the real one where
    the shapes agree (None where they do not); ``lookup``, the probe's check of an expanded
    [1, ...] Embedding lookup. For a generic module (fallback.py) ``inputs`` are the shapes of
    the leaves of (args, kwargs) in pytree order and ``output`` those of its floating output
    tensors."""

    layer: int
    inputs: Tuple[Optional[Shape], ...]
    kw_inputs: Tuple[Tuple[str, Optional[Shape]], ...] = ()
    output: Optional[Tuple[Shape, ...]] = None
    tensors: Tuple[Any, ...] = ()
    same: Tuple[Optional[bool], ...] = ()
    lookup: Optional["LookupCheck"] = None

    def ranks(self) -> tuple:
        """The record without sizes: what the call pattern compares."""
        if len(self.inputs) == 1 and self.output is None and not self.kw_inputs:
            s = self.inputs[0]  # a kernel layer's one input (every step, every call: kept short)
            return (self.layer, (None if s is None else len(s),), (), None)
        r = lambda s: None if s is None else len(s)  # noqa: E731
        return (self.layer, tuple(r(s) for s in self.inputs),
                tuple((k, r(s)) for k, s in self.kw_inputs),
                None if self.output is None else tuple(r(s) for s in self.output))

    def shapes(self) -> List[Optional[Shape]]:
        return list(self.inputs) + [s for _, s in self.kw_inputs]


def _arguments(args: Sequence, kwargs: Dict) -> List[Any]:
    return list(args) + [kwargs[k] for k in sorted(kwargs)]


def input_record(layer: int, x) -> CallRecord:
    """The record of a kernel layer's call on its one input ``x``: made at every DP layer call,
    so kept to one construction."""
    return CallRecord(layer, (tuple(x.shape) if isinstance(x, torch.Tensor) else None,), (), None,
                      (x,))


def record(layer: int, args: Sequence, kwargs: Dict,
           outputs: Optional[Sequence[torch.Tensor]] = None) -> CallRecord:
    """The real call's record (it keeps the call's tensor arguments for the probe); ``outputs``:
    a generic module's floating output tensors (its inputs are then recorded leaf by leaf)."""
    if outputs is None and not kwargs and len(args) == 1:  # a kernel layer's call
        return input_record(layer, args[0])
    shape = lambda x: tuple(x.shape) if isinstance(x, torch.Tensor) else None  # noqa: E731
    if outputs is not None:
        leaves = pytree.tree_leaves((args, kwargs))
        return CallRecord(layer, tuple(shape(a) for a in leaves), (),
                          tuple(tuple(o.shape) for o in outputs), tensors=tuple(leaves))
    return CallRecord(layer, tuple(shape(a) for a in args),
                      tuple((k, shape(kwargs[k])) for k in sorted(kwargs)),
                      tensors=tuple(_arguments(args, kwargs)))


def follows_dim(real: Optional[Shape], probe: Optional[Shape], rows: int,
                same: Optional[bool] = True) -> Tuple[str, Optional[int]]:
    """(BATCHED, d) when exactly dim d grew from ``rows`` to ``rows + 1`` with one more example
    and nothing else changed; else (:func:`follows`' verdict, None)."""
    if real is not None and probe is not None and len(real) == len(probe):
        grown = [d for d, (a, b) in enumerate(zip(real, probe)) if a != b]
        if len(grown) == 1 and real[grown[0]] == rows and probe[grown[0]] == rows + 1:
            return BATCHED, grown[0]
    return follows(real, probe, rows, same), None


def follows(real: Optional[Shape], probe: Optional[Shape], rows: int,
            same: Optional[bool] = True) -> str:
    """How a tensor of shape ``real`` (micro-batch of ``rows`` examples) relates to the examples,
    given its shape ``probe`` with the examples rotated and one more, and whether its values
    stayed (``same``): BATCHED (dim 0 grew from rows to rows + 1, nothing else changed), SHARED
    (shape and values unchanged), or a description of what it is instead."""
    if real is None or probe is None:
        if real != probe:
            return "is a tensor in only one of the two runs"
        return SHARED if same is not False else (
            "is a value (not a tensor) that changes with the examples: it is computed from "
            "them (a batch statistic through .item()), so every row would carry several "
            "examples")
    if real == probe:
        return SHARED if same is not False else (
            f"of shape {list(real)} keeps its shape with one more example but its values "
            "change: it is computed from the examples (a batch statistic, ids[:1]), so every "
            "row would carry several examples")
    if len(real) == len(probe) and real[0] == rows and probe[0] == rows + 1 \
            and real[1:] == probe[1:]:
        return BATCHED
    if len(real) != len(probe):
        return f"changed its rank from {len(real)} to {len(probe)} with one more example"
    grown = [d for d, (a, b) in enumerate(zip(real, probe)) if a != b]
    return (f"dims {grown} of its shape {list(real)} change with the number of examples (to "
            f"{list(probe)} with one more), so its dim 0 is not one row per example")


class Verdict(NamedTuple):
    """For one DP layer call: ``in_dims`` per positional tensor input (0: its dim 0 holds the
    examples, None: shared by all of them), or ``error``, the refusal; ``expanded``: shared
    [1, ...] Embedding ids, expanded to the batch (their values must not depend on the
    examples: checked by the rotated probe)."""

    in_dims: Tuple[Optional[int], ...] = ()
    error: Optional[str] = None
    expanded: bool = False


def classify(layers, real: Sequence[CallRecord], probe: Sequence[CallRecord], rows: int,
             rotated: Optional[Sequence[CallRecord]] = None) -> List[Verdict]:
    """Verdicts for the calls of one root forward (``layers``: the book's Layer list) from the
    probe's records; ``rotated``: the rotated probe's, which expanded ids must pass too."""
    from ..fallback import FuncKind
    from ..layers import EmbeddingKind

    if [r.ranks() for r in real] != [p.ranks() for p in probe]:
        mismatch = next((i for i, (r, p) in enumerate(zip(real, probe))
                         if r.ranks() != p.ranks()), min(len(real), len(probe)))
        where = (f"call {mismatch} is of {layers[real[mismatch].layer].name!r}"
                 if mismatch < len(real) else f"{len(real)} calls")
        other = (f"{layers[probe[mismatch].layer].name!r}" if mismatch < len(probe)
                 else f"{len(probe)} calls")
        return [Verdict(error=(
            "the model calls its DP layers differently when the batch has one more example "
            f"({where} in the real forward, {other} in the probe), so dpzero cannot tell which "
            "layer inputs hold the examples (Note [batch provenance]); make the forward's "
            "layer calls independent of the batch size"))] * len(real)
    out = []
    for r, p in zip(real, probe):
        layer = layers[r.layer]
        name = f"{type(layer.module).__name__} {layer.name!r}"
        same = p.same or (True,) * len(r.shapes())
        if isinstance(layer.kind, FuncKind):
            out.append(_generic_verdict(name, r, p, same, rows))
            continue
        verdicts = [follows(a, b, rows, s) for a, b, s in zip(r.inputs, p.inputs, same)]
        v, shape = verdicts[0], list(r.inputs[0])
        if v == BATCHED:
            out.append(Verdict((0,)))
        elif v == SHARED and isinstance(layer.kind, EmbeddingKind) and len(shape) > 1 \
                and shape[0] == 1:
            problem = p.lookup.problem() if p.lookup is not None else None
            if problem is None and rotated is not None:
                q = rotated[len(out)] if len(rotated) == len(real) else None
                if q is None or q.ranks() != r.ranks() or q.same[:1] != (True,):
                    problem = ("its ids change when the examples are rotated: they are computed "
                               "from particular examples")
            out.append(Verdict((0,), expanded=True) if problem is None else Verdict(error=(
                f"{name}: its ids of shape {shape} are shared by the batch, so dpzero expands "
                "them to the batch (Note [broadcast positions]), which is sound only if the "
                f"model adds the lookup to a batched tensor row by row; {problem}. Use the "
                "lookup as it comes (h = tok_emb + wpe(pos.unsqueeze(0))) or freeze the "
                "module (requires_grad_(False))")))
        elif v == SHARED:
            out.append(Verdict(error=_shared_error(name, layer, shape)))
        else:
            out.append(Verdict(error=(
                f"{name}: its input {v}. DP layers need the examples on dim 0 ([B, ...]), one "
                "per row in the loader's order; transpose batch-second (seq-first) inputs to "
                "batch-first, and keep examples out of dim 0's other factors (no [B * T, d] "
                "flattening)")))
    return out


def _shared_error(name: str, layer, shape: List[int]) -> str:
    from ..layers import EmbeddingKind

    head = (f"{name}: its input of shape {shape} does not come from the examples (it has the "
            "same shape with one more example: a table or tensor shared by the whole batch), "
            "so its gradient cannot be split by example. ")
    if isinstance(layer.kind, EmbeddingKind) and len(shape) == 1:
        return head + ("Give it ids with a batch dim of 1 (e.g. wpe(pos.unsqueeze(0)) for "
                       "positions, added to the token embeddings as it comes), which dpzero "
                       "expands to the batch, or freeze it (requires_grad_(False))")
    if isinstance(layer.kind, EmbeddingKind):
        return head + ("Ids shared by the batch beyond [1, ...] (e.g. relative-position buckets "
                       "[T, T]) cannot be expanded without changing the model's shapes (dpzero "
                       "does it only for the Hugging Face T5 family's relative bias, Note "
                       "[relative position bias]): freeze the module (requires_grad_(False)) or "
                       "give it ids per example ([B, T, T], its output combined row by row)")
    return head + ("Expand its input to the batch first (x.expand(B, *x.shape[1:]) for a "
                   "[1, ...] input) or freeze it (requires_grad_(False))")


def _generic_verdict(name, r: CallRecord, p: CallRecord, same: Sequence[Optional[bool]],
                     rows: int) -> Verdict:
    """A generic module call's verdict: in_dims = (per (args, kwargs) leaf, the dim holding the
    examples or None for a leaf shared by the batch; per floating output, its examples' dim)."""
    in_dims: List[Optional[int]] = []
    for i, (a, b, s) in enumerate(zip(r.inputs, p.inputs, same)):
        v, d = follows_dim(a, b, rows, s)
        leaf = r.tensors[i] if i < len(r.tensors) else None
        if v not in (BATCHED, SHARED) and a is None and b is None and \
                not isinstance(leaf, (bool, int, float, complex, str, type(None))):
            v = (f"is a {type(leaf).__name__} whose state changes with the examples (an object "
                 "the forward writes them into, such as a key/value cache: call the model with "
                 "use_cache=False)")
        if v not in (BATCHED, SHARED):
            return Verdict(error=f"{name}: its input {i} (in the order of its arguments) {v}; "
                                 "the generic per-sample path needs each input either shared "
                                 "by the batch or with the examples along one dim")
        in_dims.append(d)
    out_dims: List[int] = []
    for j, (a, b) in enumerate(zip(r.output, p.output)):
        v, d = follows_dim(a, b, rows)
        if v != BATCHED:
            why = "is shared by the whole batch" if v == SHARED else v
            return Verdict(error=(
                f"{name}: its output tensor {j} {why}; the generic per-sample path needs "
                "every floating output with the examples along one dim (a module that reduces "
                "over the batch mixes examples: freeze its parameters)"))
        out_dims.append(d)
    if all(d is None for d in in_dims) and r.inputs:
        return Verdict(error=(
            f"{name} uses its parameters directly and none of its inputs holds the examples; "
            "the generic per-sample path recomputes the module per example from them"))
    return Verdict((tuple(in_dims), tuple(out_dims)))


def _leaf_value(v) -> str:
    """A non-tensor argument as the pattern sees it: flags, integers, strings and enums by value
    (a flag that switches the model's layout must start a new pattern), floats and other objects
    by type (a float that changes every step must not make every call new)."""
    if v is None or isinstance(v, (bool, int, str, enum.Enum)):
        return repr(v)
    return type(v).__qualname__


def pattern(tagged: Sequence[Tuple[int, int, object]], spec, leaves: Sequence,
            real: Sequence[CallRecord]) -> tuple:
    """What a root call's verdicts depend on besides sizes: the inputs' structure and non-tensor
    values, which of them hold the examples on which dim, and the sequence of DP layer calls
    with their inputs' ranks."""
    values = tuple(_leaf_value(v) for v in leaves if not isinstance(v, torch.Tensor))
    return (str(spec), values, tuple((i, bdim) for i, bdim, _ in tagged),
            tuple(r.ranks() for r in real))


# Note [spread inputs]
# ~~~~~~~~~~~~~~~~~~~
# Opacus asks for position ids with a batch dim, so its users write them as
# torch.arange(T).expand(B, -1) in the training loop and pass them to the model beside the
# batch. Such a tensor is no example's data and carries no tag, so the probe (B + 1 examples)
# used to call the model with B rows of it and failed. A model input whose dim 0 has stride 0 is
# one row spread over dim 0 by construction (every row is the same memory), so it is the same
# tensor for any number of rows: the probe spreads it over B + 1 rows too. Its values come from
# no example (a tensor computed from the batch is tainted and refused at the door, Note [batch
# provenance]), and the DP layers reading it are judged like any other: an input that grows
# with the examples holds them row by row. Only dim 0's size says that it goes with the batch,
# so should the probe fail with it spread (dim 0 was something else that happened to have B
# entries), it runs once more with the input as it came, which is how it was treated before.
def spread_inputs(leaves: Sequence, tagged: Sequence[Tuple[int, int, object]],
                  rows: int) -> Tuple[int, ...]:
    """Leaf indices of the plain model inputs that are one row spread over ``rows`` rows."""
    taken = {i for i, _, _ in tagged}
    return tuple(i for i, x in enumerate(leaves)
                 if i not in taken and rows > 1 and isinstance(x, torch.Tensor)
                 and not isinstance(x, Examples) and x.dim() > 0 and x.shape[0] == rows
                 and x.stride(0) == 0)


def ambiguous(real: Sequence[CallRecord], rows: int) -> bool:
    """Whether some layer input, or some output of a generic module, has a dimension other than
    dim 0 of the batch's size: a cached verdict could then stand for another layout of the same
    shapes (B = T, seq-first)."""
    if rows <= 1:
        return False
    for r in real:
        for s in r.inputs:
            if s is not None and rows in s[1:]:
                return True
        for _, s in r.kw_inputs:
            if s is not None and rows in s[1:]:
                return True
        for s in r.output or ():
            if rows in s[1:]:
                return True
    return False


# ---- the probe -------------------------------------------------------------------------------

class LookupCheck:
    """What the probe saw of one expanded [1, ...] Embedding lookup ([rows, ...]): whether an
    elementwise operation met it with a batched tensor (``met``), and the first other operation it
    was used in (``failure``)."""

    def __init__(self, rows: int) -> None:
        self.rows, self.met, self.failure = rows, False, None

    def problem(self) -> Optional[str]:
        if self.failure is not None:
            return f"the model uses it in {self.failure} first"
        if not self.met:
            return "the model never adds it to a batched tensor"
        return None


# Operations that leave the lookup's layout as it is (checked: the same shape out as in).
_LOOKUP_SAME = {torch.Tensor.to, torch.Tensor.type_as, torch.Tensor.contiguous,
                torch.Tensor.clone, torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16,
                torch.Tensor.double, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.squeeze,
                torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.view_as,
                torch.Tensor.reshape_as, torch.nn.functional.dropout, torch.dropout}
_LOOKUP_ELEMENTWISE = set(f for f in ELEMENTWISE + ELEMENTWISE_INPLACE if f is not None)
# Permutations that keep the rows on dim 0 (T5's relative bias: [rows, q, k, heads] to [rows,
# heads, q, k], Note [relative position bias]); and scaled-dot-product attention with the lookup
# as its additive attn_mask.
_LOOKUP_PERMUTES = {torch.Tensor.permute, torch.permute}
_SDPA = torch.nn.functional.scaled_dot_product_attention


def _permuted_dims(args, kwargs) -> Tuple[int, ...]:
    dims = kwargs.get("dims", args[1:])
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = dims[0]
    return tuple(int(d) % args[0].dim() for d in dims) or (0,)


def _attends_row_by_row(args, kwargs, out, b: int, token) -> bool:
    """Whether query, key and value are each these examples with their batch dim at ``b`` of the
    output, or constant along it (as ``_broadcast_bdim`` asks of an elementwise operation's
    operands): then output row i attends only within example i."""
    for i, name in enumerate(("query", "key", "value")):
        u = args[i] if len(args) > i else kwargs.get(name)
        if not isinstance(u, torch.Tensor):
            return False
        if isinstance(u, Examples) and getattr(u, "dp_token", None) is not None:
            if u.dp_token is not token or u.dp_bdim + out.dim() - u.dim() != b:
                return False
        elif is_suspect(u, token) or varies_along(u, b, out.dim()):
            return False
    return True


def _only_the_mask(args, kwargs, marked) -> bool:
    """Whether the marked lookup is scaled_dot_product_attention's attn_mask and nothing else."""
    mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    return len(marked) == 1 and mask is marked[0] and \
        not any(isinstance(a, _Lookup) for a in args[:3])


class _Lookup(Examples):
    """In the probe: an expanded [1, ...] lookup ([rows, ...]). Every use of it is checked: a
    copy, cast, dropout or no-op reshape keeps it marked, an elementwise operation with constants
    (scalars, size-1 or stride-0 operands) too, and an elementwise operation with a tensor the
    probe tracks as the examples (the probe's inputs and the outputs of DP layers whose input
    holds the examples, tagged as Examples and followed by the tag's rules) combines it with the
    batch row by row: the check passes, and the result is that batch. Anything else, before or
    after (``.mean(0)``, ``[0]``, an elementwise operation with a tensor of unknown rows), fails
    the check. A subclass of Examples so that its checks run first when both meet."""

    _dp_check: LookupCheck

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            leaves = pytree.tree_leaves((args, kwargs))
            marked = [a for a in leaves if isinstance(a, _Lookup)]
            if not marked:
                return out
            check = marked[0]._dp_check
            if not isinstance(out, torch.Tensor) and func not in _LOOKUP_ELEMENTWISE \
                    and func is not torch.Tensor.__setitem__:
                return out  # .shape, .dim(), ...: reads nothing row by row
            if func in _LOOKUP_SAME and out.shape == args[0].shape and \
                    isinstance(args[0], _Lookup):
                return _Lookup.mark(out, check)
            if func in _LOOKUP_PERMUTES and isinstance(args[0], _Lookup) and \
                    len(marked) == 1 and _permuted_dims(args, kwargs)[0] == 0:
                return _Lookup.mark(out, check)  # the rows stay on dim 0
            if func is _SDPA and _only_the_mask(args, kwargs, marked):
                # softmax(q kᵀ scale + attn_mask) v: the mask is added to the scores elementwise
                # (torch's documented semantics), so it meets the batch where the query holds it
                met = _meets_the_batch(out, leaves, marked, check.rows)
                if met is not None and _attends_row_by_row(args, kwargs, out, *met):
                    check.met = True
                    return wrap(out, met[0], met[1])
            if func in _LOOKUP_ELEMENTWISE:
                target = args[0] if func in ELEMENTWISE_INPLACE else out
                met = _meets_the_batch(target, leaves, marked, check.rows)
                if met is not None:
                    check.met = True
                    return out if func in ELEMENTWISE_INPLACE else \
                        wrap(out, met[0], met[1])
                if _constants_only(target, leaves, marked):
                    return out if func in ELEMENTWISE_INPLACE else _Lookup.mark(out, check)
            if check.failure is None:
                check.failure = getattr(func, "__qualname__", None) or repr(func)
            return out

    @staticmethod
    def mark(t: torch.Tensor, check: LookupCheck) -> torch.Tensor:
        m = t.as_subclass(_Lookup)
        m._dp_check = check
        m.dp_token, m.dp_taint, m.dp_bdim, m.dp_version = None, None, -1, -1
        return m


def _meets_the_batch(target, leaves, marked, rows):
    """(bdim, token) of the result if a tagged operand (the examples, as the probe tracks them)
    puts its batch dim where the marked lookups have their rows; else None."""
    pos = {target.dim() - m.dim() for m in marked}
    if len(pos) != 1 or target.shape[next(iter(pos))] != rows:
        return None
    (b,) = pos
    for u in leaves:
        if isinstance(u, Examples) and not isinstance(u, _Lookup) and \
                getattr(u, "dp_token", None) is not None and \
                u.dp_bdim + target.dim() - u.dim() == b:
            return b, u.dp_token
    return None


def _constants_only(target, leaves, marked) -> bool:
    """Whether every operand besides the marked lookups is constant along the lookups' rows."""
    b = target.dim() - marked[0].dim()
    for u in leaves:
        if not isinstance(u, torch.Tensor) or isinstance(u, _Lookup) or u.dim() == 0:
            continue
        if isinstance(u, Examples) and getattr(u, "dp_taint", None) is not None:
            return False
        if varies_along(u, b, target.dim()):
            return False
    return True


class Probe:
    """The DP layer calls of the probe's forward (``rows`` examples), each compared, argument by
    argument, with the real forward's call at the same place (``real``). ``token``: the probe's
    own micro-batch token: its inputs, and the outputs of DP layers whose input holds the
    examples, are tagged with it, for the expanded lookups' checks."""

    def __init__(self, rows: int, real: Sequence[CallRecord]) -> None:
        self.rows, self.real = rows, real
        self.token = MicroBatchToken(-1, -1, rows, "probe")
        self.records: List[CallRecord] = []

    def call(self, layer, original, args, kwargs):
        """Runs one DP layer call of the probe (expanding [1, ...] Embedding ids as the real
        forward does) and records it."""
        from ..fallback import FuncKind
        from ..layers import EmbeddingKind

        generic = isinstance(layer.kind, FuncKind)
        x = args[0] if args and not generic else None
        check = None
        if isinstance(layer.kind, EmbeddingKind) and isinstance(x, torch.Tensor) and \
                x.dim() > 1 and x.shape[0] == 1 and self.rows > 1:
            check = LookupCheck(self.rows)
            out = _Lookup.mark(original(x.expand(self.rows, *x.shape[1:])), check)
        else:
            out = original(*args, **kwargs)
        leaves, spec = pytree.tree_flatten(out)
        floating = [i for i, t in enumerate(leaves)
                    if isinstance(t, torch.Tensor) and t.is_floating_point()]
        rec = record(layer.index, args, kwargs, [leaves[i] for i in floating] if generic else None)
        j = len(self.records)
        real = self.real[j] if j < len(self.real) and self.real[j].layer == layer.index else None
        same = ()
        if real is not None:
            same = tuple(_equal(a, b) for a, b in zip(real.tensors, rec.tensors))
            if generic and real.output is not None and len(real.output) == len(floating):
                for i, a, b in zip(floating, real.output, rec.output):
                    v, d = follows_dim(a, b, self.rows - 1)
                    if v == BATCHED:  # the examples, along dim d
                        leaves[i] = wrap(leaves[i].as_subclass(torch.Tensor), d, self.token)
                out = pytree.tree_unflatten(leaves, spec)
            elif not generic and check is None and isinstance(out, torch.Tensor) and \
                    follows(real.inputs[0] if real.inputs else None,
                            rec.inputs[0] if rec.inputs else None, self.rows - 1) == BATCHED:
                out = wrap(out.as_subclass(torch.Tensor), 0, self.token)  # the examples
        self.records.append(rec._replace(tensors=(), same=same, lookup=check))
        return out


def _equal(a, b, depth: int = 4) -> Optional[bool]:
    """Whether two arguments hold the same values (None where their shapes differ). Non-tensor
    arguments by value (a float computed from the batch must not pass); an object whose class
    has no value equality of its own (a cache, a config) by its state, the tensors it holds
    compared like tensor arguments: two runs that each made a fresh, empty one pass, and one
    holding the examples (its tensors grew with them) does not."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return None
        if type(a) is type(b) and type(a).__eq__ is object.__eq__ and a is not b and \
                hasattr(a, "__dict__") and depth > 0:
            return _equal(vars(a), vars(b), depth - 1)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and depth > 0:
            if type(a) is not type(b) or len(a) != len(b):
                return False
            verdicts = [_equal(x, y, depth - 1) for x, y in zip(a, b)]
            return None if None in verdicts else all(verdicts)
        if isinstance(a, dict) and isinstance(b, dict) and depth > 0:
            if a.keys() != b.keys():
                return False
            verdicts = [_equal(a[k], b[k], depth - 1) for k in a]
            return None if None in verdicts else all(verdicts)
        try:
            return bool(a == b)
        except Exception:  # noqa: BLE001 - objects without a usable ==
            return a is b
    if a.shape != b.shape:
        return None
    return bool(torch.equal(a, b))


def _saved_nothing(_tensor):
    return None


def _never_unpacked(_packed):
    raise RuntimeError("the provenance probe's graph is never back-propagated")


class ProbeRefused(RuntimeError):
    """What the probe's forward did refuses the call: it wrote into the model's buffers or frozen
    parameters (Note [probe writes] in state_guard.py; the state is restored), or normalised with
    batch statistics (BatchStatistics)."""


def _rows(x: torch.Tensor, bdim: int, rotated: bool) -> torch.Tensor:
    """A probe's examples: 0, ..., B-1, 0 (extended), or 1, ..., B-1, 0, 1 (rotated)."""
    b = x.shape[bdim]
    order = list(range(b)) + [0] if not rotated else list(range(1, b)) + [0, 1 % b]
    return x.index_select(bdim, torch.tensor(order, device=x.device))


def run_probe(module: nn.Module, forward: Callable, args, kwargs,
              tagged: Sequence[Tuple[int, int, object]], book, devices,
              real: Sequence[CallRecord], rows: int, rotated: bool = False,
              spread: Sequence[int] = ()) -> List[CallRecord]:
    """The DP layer calls of ``forward(*args, **kwargs)`` (plain inputs) with one more example
    in each tagged input (:func:`_rows`). Runs in the grad mode of the real forward (so the
    calls it records are the ones that register parts there: a segment the model runs without
    gradients, such as reentrant checkpointing's first pass, registers none), with autograd
    saving no tensor (the probe's graph is dropped, never back-propagated), and the RNG state
    and the module's buffers and frozen parameters restored afterwards (Note [probe writes] in
    state_guard.py). ``rows`` 0: the same inputs, only to issue the
    same collectives as the ranks that probe."""
    probe = Probe(rows + 1 if rows > 0 else 0, real)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if rows > 0:
        for i, bdim, _ in tagged:
            leaves[i] = wrap(_rows(leaves[i], bdim, rotated), bdim, probe.token)
        for i in spread:  # Note [spread inputs]: one row, spread over one more example
            leaves[i] = leaves[i][:1].expand(rows + 1, *leaves[i].shape[1:])
    p_args, p_kwargs = pytree.tree_unflatten(leaves, spec)
    with torch.autograd.graph.saved_tensors_hooks(_saved_nothing, _never_unpacked), \
            torch.random.fork_rng(devices=devices), book.watch_state() as state, \
            BatchStatistics(module) as statistics, book.probing(probe):
        forward(*p_args, **p_kwargs)
    if statistics.found is not None:
        raise ProbeRefused(statistics.found)
    if state.written:
        raise ProbeRefused(refusal_text("the forward is refused (its probe saw it write into "
                                        "the model's state)", state.described))
    return probe.records


# Functions that normalise with statistics of the whole batch when training=True (their 6th
# argument): nn.BatchNorm is refused by type (attach.py); these are the same inside any forward.
_BATCH_NORMS = {f for f in (torch.nn.functional.batch_norm, torch.batch_norm,
                            getattr(torch, "native_batch_norm", None)) if f is not None}


class BatchStatistics(torch.overrides.TorchFunctionMode):
    """In the probe: the first call of a batch norm with batch statistics (``training=True``),
    by the innermost module running it (``found``: the refusal, or None). Every example's output
    of such a call depends on the whole batch, so no clipping of one example's gradient bounds
    anything. It runs with the probe, once per call pattern (Note [batch provenance]): a branch
    on the data into such a call later in the same pattern is beyond it, as any mixing the model
    does itself (strict isolation closes it)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.root, self.names = model, {id(m): n for n, m in model.named_modules()}
        self.stack: List[nn.Module] = []
        self.found: Optional[str] = None

    def __enter__(self):
        from torch.nn.modules import module as mod
        def enter(m, args) -> None:
            self.stack.append(m)

        def leave(m, args, out) -> None:
            if self.stack:
                self.stack.pop()

        self.handles = [mod.register_module_forward_pre_hook(enter),
                        mod.register_module_forward_hook(leave, always_call=True)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BATCH_NORMS and self.found is None and \
                bool(args[5] if len(args) > 5 else kwargs.get("training", False)):
            # The probe calls the model's own forward (no hook for the root itself).
            owner = next((m for m in reversed(self.stack) if id(m) in self.names), self.root)
            where = f"module {self.names[id(owner)] or '<model>'!r} ({type(owner).__name__})"
            self.found = (
                f"{where} calls {getattr(func, '__name__', func)} with batch statistics "
                "(training=True): it normalises every example with the mean and variance of the "
                "whole batch, so each example's output, and so every gradient, depends on the "
                "others, and per-sample clipping bounds nothing. Use GroupNorm, LayerNorm or "
                "InstanceNorm, or fixed statistics (training=False with running_mean and "
                "running_var computed without the training data)")
        return func(*args, **kwargs)


class Ranks(NamedTuple):
    """How a root forward agrees with the other ranks. ``probe(flag)``: whether any rank must
    probe (stage 3, where the probe's forward gathers units; else this rank's flag);
    ``refusals(flag)``: how many ranks refuse this forward (a collective whenever there are
    several ranks: a rank that refused alone would otherwise skip collectives the others run in
    their backward); ``world``: the number of ranks."""

    probe: Callable[[bool], bool]
    refusals: Callable[[bool], int]
    world: int


def admitted(book, args, kwargs):
    """Step 1 of this file's docstring: (args, kwargs) unwrapped, their tagged leaves [(leaf
    index, batch dim, token)], and why the call may not train (None: it may)."""
    token = book.token
    (args, kwargs), tagged, problem = untagged((args, kwargs), token)
    if problem is None and not tagged:
        lost = lost_at(token)
        problem = ("the model was called on inputs that do not come from the private data "
                   "loader: iterate the data_loader that make_private returned (or, if you "
                   "Poisson-sample batches yourself at the engine's sample rate, pass each one "
                   "through privacy_engine.own_batch(batch, logical_batch_size=...), which is "
                   "recorded in the ledger)"
                   + (f". If its tensors did come from that loader, dpzero lost track of them at "
                      f"{lost!r}, which it cannot follow or which could mix examples (Note "
                      "[batch provenance]); apply such an operation to each example in the "
                      "dataset (its __getitem__ or a per-example transform), where it cannot "
                      "mix examples"
                      if lost else ""))
    elif problem is None and (token is None or any(t is not token for _, _, t in tagged)):
        problem = ("the model was called on tensors of a micro-batch that is not the current "
                   f"one ({next(t for _, _, t in tagged if t is not token)!r}; current: "
                   f"{token!r}): each micro-batch the loader yields is used in its own turn")
    return args, kwargs, tagged, problem


@torch.compiler.disable  # Note [compiled private models] in engine.py
def root_forward(book_ref, ranks: Ranks, devices, module: nn.Module, original, *args, **kwargs):
    """The model's forward under DP (steps 1-4 of this file's docstring). Every forward with
    gradients on every rank makes the same agreements in the same order (the probe, its retry
    without spread inputs, the rotated probe, the refusals), whatever this rank's verdict."""
    book = book_ref()
    if book is None or book.probe is not None or book.root is not None \
            or book.refusal is not None or not torch.is_grad_enabled() \
            or torch._C._current_graph_task_id() != -1:
        # No gradient (evaluation), the probe, a call nested in a root forward (refused or not)
        # or a recompute: nothing to clip or to agree on here.
        (args, kwargs), _, _ = untagged((args, kwargs))
        return original(*args, **kwargs)
    args, kwargs, tagged, problem = admitted(book, args, kwargs)
    if problem is not None:
        # Refused lazily: the forward runs (an evaluation without torch.no_grad() on other data
        # is harmless), but its DP layers register nothing and a backward through any of them
        # raises with this message (book.refusal_text). Unless other ranks did not refuse
        # it: then every rank raises now, before their backwards' collectives part ways.
        book.refusal = problem
        try:
            out = original(*args, **kwargs)
        finally:
            book.refusal = None
        for _ in range(3):  # the others' probe, its retry and the rotated probe
            if ranks.probe(False):
                _mirror(book, module, original, args, kwargs, devices)
        if ranks.refusals(True) < ranks.world:
            book.error = problem
            raise PrivacyViolation(problem)
        return out
    leaves, spec = pytree.tree_flatten((args, kwargs))
    start = book.num_parts
    book.root = []
    try:
        out = original(*args, **kwargs)
    finally:
        real, book.root = book.root, None
    rows = book.token.rows
    spread = spread_inputs(leaves, tagged, rows)
    key = pattern(tagged, spec, leaves, real) + (spread,)
    verdicts, premise = book.verdicts.get(key, (None, ()))
    # Note [premises]: a cached verdict stands only while the values it found shared still are.
    if verdicts is not None and not premise_holds(premise, real, book):
        verdicts = None
    probe, error = None, None
    first = ranks.probe(verdicts is None or ambiguous(real, rows))
    if first:
        if rows == 0:  # nothing to add an example to: mirror the others, keep what is known
            _mirror(book, module, original, args, kwargs, devices)
        else:
            probe, error = _probed(module, original, args, kwargs, tagged, book, devices, real,
                                   rows, spread=spread)
    # Note [spread inputs]: a probe that failed with them spread runs once more without (an
    # agreement every forward makes, so that every rank makes the same ones).
    retry = first and probe is None and bool(spread)
    if ranks.probe(retry):
        if retry:
            spread = ()
            probe, error = _probed(module, original, args, kwargs, tagged, book, devices, real,
                                   rows)
        else:
            _mirror(book, module, original, args, kwargs, devices)
    if probe is not None:
        verdicts = classify(book.layers, real, probe, rows)
    expanded = probe is not None and rows > 1 and any(v.expanded for v in verdicts)
    if ranks.probe(expanded):  # the rotated probe, for ids expanded to the batch
        if expanded:
            rotated, error = _probed(module, original, args, kwargs, tagged, book, devices,
                                     real, rows, rotated=True, spread=spread)
            if rotated is not None:
                verdicts = classify(book.layers, real, probe, rows, rotated)
        else:
            _mirror(book, module, original, args, kwargs, devices)
    if probe is not None and rows > 1 and error is None:  # one example rotated is itself
        if len(book.verdicts) >= _PATTERNS_KEPT:
            book.verdicts.clear()
        book.verdicts[key] = (verdicts, premise_of(verdicts, real))
    if error is None and verdicts is None:
        error = ("an empty micro-batch called the model in a pattern of DP layer calls not seen "
                 "before, so nothing tells which layer inputs hold the examples (Note [batch "
                 "provenance]); skip the forward of an empty batch (step() alone takes its "
                 "step)")
    if error is None:
        error = next((v.error for v in verdicts if v.error is not None), None)
    if ranks.refusals(error is not None):  # every rank refuses, or none
        book.error = error or ("another rank refused this forward (its error says why); no "
                               "rank runs its backward")
        raise PrivacyViolation(book.error)
    book.set_verdicts(start, verdicts)
    return out


# Note [premises]
# ~~~~~~~~~~~~~~~
# A pattern's verdicts are cached (the probe runs once per pattern), and some rest on values the
# probe saw: an expanded [1, ...] Embedding lookup is sound only while its ids are not computed
# from the examples (the rotated probe checked that once), and a generic module's input found
# shared by the batch (the same values with one more example) must stay a value of the batch as
# a whole. A model whose ids or shared inputs come from the examples only from some step on (a
# branch on a counter, on the data) would keep a verdict whose premise no longer holds. So the
# cache keeps, with the verdicts, those values as the probe saw them, and every later call of
# the pattern is held to them: a shared input of another shape, type or non-tensor value is
# probed again (the probe and the rotated probe then judge the new values); one of the same
# shape is compared on its device and the verdict read at the step (Note [deferred checks] in
# book.py): values that changed at the same shape refuse the step, naming the layer. Values of
# the batch as a whole (positions arange(T), a causal mask, RoPE tables) are the same at every
# call of a given shape.
def premise_of(verdicts: Sequence[Verdict], real: Sequence[CallRecord]) -> tuple:
    """(call index, argument index, its value then) for each input the verdicts found shared:
    the ids of an expanded lookup, and a generic module's shared leaves (tensors cloned)."""
    out = []
    for i, (v, r) in enumerate(zip(verdicts, real)):
        if v.expanded:
            shared = [0]
        elif v.in_dims and isinstance(v.in_dims[0], tuple):  # a generic module's verdict
            shared = [j for j, d in enumerate(v.in_dims[0]) if d is None]
        else:
            continue
        for j in shared:
            x = r.tensors[j] if j < len(r.tensors) else None
            out.append((i, j, x.detach().clone() if isinstance(x, torch.Tensor) else x))
    return tuple(out)


def premise_holds(premise: tuple, real: Sequence[CallRecord], book) -> bool:
    """Whether the calls ``real`` still have the shapes and non-tensor values of ``premise``
    (premise_of); their tensors' values are compared on the device and the verdicts deferred to
    the step (Note [premises])."""
    checks = []
    for i, j, then in premise:
        now = real[i].tensors[j] if i < len(real) and j < len(real[i].tensors) else None
        if isinstance(then, torch.Tensor):
            if not isinstance(now, torch.Tensor) or now.shape != then.shape or \
                    now.dtype != then.dtype or now.device != then.device:
                return False
            checks.append((i, j, now, then))
        elif isinstance(now, torch.Tensor) or _equal(now, then) is not True:
            return False
    for i, j, now, then in checks:
        with torch._C.DisableTorchFunctionSubclass():
            failed = (now.detach() != then).any()
        layer = book.layers[real[i].layer]

        def text(layer=layer, j=j) -> str:
            return (f"{type(layer.module).__name__} {layer.name!r}: its input {j}, found shared "
                    "by the whole batch when the model was first probed in this pattern of calls, "
                    "changed its values at the same shape (Note [premises]): it may be computed "
                    "from the examples (ids[:1], a batch statistic), which would put several "
                    "examples into every row. Compute it from public values only (positions, "
                    "masks from shapes)")
        book.defer(failed, text)
    return True


# Call patterns whose verdicts a book keeps (a run has a handful; a model called with a
# different argument value every step would otherwise grow the table without bound).
_PATTERNS_KEPT = 256


def _mirror(book, module, original, args, kwargs, devices) -> None:
    """Stage 3: another rank probes, so this one runs the forward once more too (the same
    inputs, nothing recorded), issuing the same gathers."""
    run_probe(module, original, args, kwargs, (), book, devices, (), 0)


def _probed(module, original, args, kwargs, tagged, book, devices, real, rows,
            rotated: bool = False, spread: Sequence[int] = ()
            ) -> Tuple[Optional[List[CallRecord]], Optional[str]]:
    """(run_probe's records, None), or (None, why it failed): a failure is refused like a
    verdict, after every rank agreed."""
    try:
        return run_probe(module, original, args, kwargs, tagged, book, devices, real, rows,
                         rotated, spread), None
    except ProbeRefused as e:
        book.restore_state()  # what the real forward wrote before the probe (Note [probe writes])
        return None, str(e)
    except Exception as e:  # noqa: BLE001 - named in the refusal
        return None, (
            "dpzero could not run the model's forward once more with one more example (the "
            "probe that finds which DP layer inputs hold the examples, Note [batch "
            f"provenance]): {type(e).__name__}: {e}. The forward must accept any batch size, "
            "and every model input with one row per example must come from the loader's "
            "batch (torch.ones_like(x), not torch.ones(x.shape)); forward hooks run in the "
            "probe too")
