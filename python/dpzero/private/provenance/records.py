"""The DP layer calls a root forward records, and what they are found to hold: each input of
each call is the examples on dim 0 (BATCHED), shared by the whole batch (SHARED), or neither
(:func:`classify`), from the real call against the probe's (Note [batch provenance] in
examples.py; root.py runs both; probe.py is the probe)."""

from __future__ import annotations

import enum
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

from .examples import Examples


Shape = Tuple[int, ...]

BATCHED, SHARED = "batched", "shared"


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
    lookup: Optional[LookupCheck] = None

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
        context = _context_verdict(name, verdicts[1:])
        if v == BATCHED and isinstance(context, str):
            out.append(Verdict(error=context))
        elif v == BATCHED:
            out.append(Verdict((0,) + context))
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


# Note [call context]
# ~~~~~~~~~~~~~~~~~~~
# Some tensors reach a DP layer's output without being any DP layer's input: MultiheadAttention's
# masks decide which of an example's positions its attention mixes (attention.py), and no kernel
# reads them. On the generic path they were arguments of the module's call, which the probe
# judged with the others; on the kernels they ride with one projection's call as its *context*
# (extra positional arguments of a kind with ``context``, which the layer ignores), and the probe
# judges each as it judges the call's input:
#   * one whose dim 0 grew from B to B + 1 with one more example, nothing else changing, holds
#     the examples (a key padding mask [B, S]);
#   * one whose shape and values did not change is shared by the batch (a causal [L, S] mask),
#     and becomes a premise of the cached verdict (Note [premises] in root.py), as a generic
#     module's shared input does;
#   * anything else is refused, naming the layer and the input: a shared mask computed from the
#     batch (its values change), and a [B * H, L, S] mask, whose dim 0 folds the examples with
#     the heads (it grows by H), as the generic path refused it.
# What the probe cannot see here is what it cannot see of any input: rows computed from other
# examples (a mask rolled along the batch), the model mixing examples itself (Note [batch
# provenance], root.py).
def _context_verdict(name: str, verdicts: Sequence[str]):
    """Note [call context]: per context input its dim (0: the examples, None: shared), or the
    refusal."""
    dims: List[Optional[int]] = []
    for j, v in enumerate(verdicts, 1):
        if v not in (BATCHED, SHARED):
            return (f"{name}: its context input {j} (an attention mask) {v}. A mask must be "
                    "shared by the whole batch (an [L, S] mask computed from shapes, not from "
                    "the examples) or hold one row per example on dim 0 (a key_padding_mask "
                    "[B, S]); a 3D attn_mask [B * H, L, S] folds the heads into dim 0, so give "
                    "per-example padding as a key_padding_mask instead")
        dims.append(0 if v == BATCHED else None)
    return tuple(dims)


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
