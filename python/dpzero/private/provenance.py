"""Which DP layer inputs hold the examples on dim 0: the model's root forward and its probe.

Note [batch provenance] (examples.py) says why; this file is its second half. The model given to
``make_private`` gets a root forward (:func:`root_forward`, patched like the DP layers) that

1. refuses a call whose inputs carry no tag of the engine's current micro-batch (the batch did not
   come from the private loader or ``own_batch``): the forward runs, registering nothing, and a
   backward through it raises (so an evaluation on other data without ``torch.no_grad()`` is
   harmless);
2. unwraps the tagged inputs and runs the model; every DP layer call records the shapes of its
   inputs (:class:`CallRecord`) with the part it registers in the book;
3. looks the call pattern up (:func:`pattern`: the tagged inputs' layout and the sequence of DP
   layer calls with their inputs' ranks); for a new one, runs the probe (:func:`run_probe`: the
   same forward on the same inputs plus one example, saving nothing for a backward, RNG and
   buffers restored)
   and classifies each input of each call (:func:`classify`);
4. hands each part its verdict (``Part.in_dims``) or refuses the call with the module's name and
   the fix, before any of the micro-batch's gradients exists.

A pattern's verdicts are reused for every later call with the same pattern, so the probe runs once
per pattern (typically once per run; under activation checkpointing, recomputed calls take the
verdict of the call they recompute). At stage 3 the probe's forward gathers units, so every rank
probes when any rank must (``agree``, a collective; at stages 0-2 the forward has none).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .examples import lost_at, untagged

Shape = Tuple[int, ...]

BATCHED, SHARED = "batched", "shared"


class CallRecord(NamedTuple):
    """One call of a DP layer as the probe compares it: ``layer`` (Layer.index); ``inputs``: the
    shapes of the call's tensor arguments, positional first (None for a non-tensor), then
    ``kw_inputs`` likewise for keyword arguments (sorted by name); ``output``: the output's shape
    for generic (torch.func) modules, whose output rows the book clips, else None."""

    layer: int
    inputs: Tuple[Optional[Shape], ...]
    kw_inputs: Tuple[Tuple[str, Optional[Shape]], ...] = ()
    output: Optional[Shape] = None

    def ranks(self) -> tuple:
        """The record without sizes: what the call pattern compares."""
        r = lambda s: None if s is None else len(s)  # noqa: E731
        return (self.layer, tuple(r(s) for s in self.inputs),
                tuple((k, r(s)) for k, s in self.kw_inputs), r(self.output))


def record(layer: int, args: Sequence, kwargs: Dict, output=None) -> CallRecord:
    shape = lambda x: tuple(x.shape) if isinstance(x, torch.Tensor) else None  # noqa: E731
    return CallRecord(layer, tuple(shape(a) for a in args),
                      tuple((k, shape(kwargs[k])) for k in sorted(kwargs)),
                      None if output is None else shape(output))


def follows(real: Optional[Shape], probe: Optional[Shape], rows: int) -> str:
    """How a tensor of shape ``real`` (micro-batch of ``rows`` examples) relates to the examples,
    given its shape ``probe`` with one example more: BATCHED (dim 0 grew from rows to rows + 1,
    nothing else changed), SHARED (unchanged: it does not come from the examples' count), or a
    description of where the batch went instead."""
    if real is None or probe is None:
        return SHARED if real == probe else "not a tensor in one of the two runs"
    if real == probe:
        return SHARED
    if len(real) == len(probe) and real[0] == rows and probe[0] == rows + 1 \
            and real[1:] == probe[1:]:
        return BATCHED
    if len(real) != len(probe):
        return f"its rank changed from {len(real)} to {len(probe)} with one more example"
    grown = [d for d, (a, b) in enumerate(zip(real, probe)) if a != b]
    return (f"dims {grown} of its shape {list(real)} change with the number of examples (to "
            f"{list(probe)} with one more), so its dim 0 is not one row per example")


class Verdict(NamedTuple):
    """For one DP layer call: ``in_dims`` per positional tensor input (0: its dim 0 holds the
    examples, None: shared by all of them), or ``error``, the refusal."""

    in_dims: Tuple[Optional[int], ...] = ()
    error: Optional[str] = None


def classify(layers, real: Sequence[CallRecord], probe: Sequence[CallRecord],
             rows: int) -> List[Verdict]:
    """Verdicts for the calls of one root forward (``layers``: the book's Layer list)."""
    from .fallback import FuncKind
    from .layers import EmbeddingKind

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
        verdicts = [follows(a, b, rows) for a, b in zip(r.inputs, p.inputs)]
        if isinstance(layer.kind, FuncKind):
            out.append(_generic_verdict(name, r, p, verdicts, rows))
            continue
        v, shape = verdicts[0], list(r.inputs[0])
        if v == BATCHED:
            out.append(Verdict((0,)))
        elif v == SHARED and isinstance(layer.kind, EmbeddingKind) and len(shape) > 1 \
                and shape[0] == 1:
            out.append(Verdict((0,)))  # Note [broadcast positions]: expanded to the batch
        elif v == SHARED:
            out.append(Verdict(error=_shared_error(name, layer, shape)))
        else:
            out.append(Verdict(error=(
                f"{name}: its input {v}. DP layers need the examples on dim 0 ([B, ...]); "
                "transpose batch-second (seq-first) inputs to batch-first, and keep examples "
                "out of dim 0's other factors (no [B * T, d] flattening)")))
    return out


def _shared_error(name: str, layer, shape: List[int]) -> str:
    from .layers import EmbeddingKind

    head = (f"{name}: its input of shape {shape} does not come from the examples (it has the "
            "same shape with one more example: a table or tensor shared by the whole batch), "
            "so its gradient cannot be split by example. ")
    if isinstance(layer.kind, EmbeddingKind) and len(shape) == 1:
        return head + ("Give it ids with a batch dim of 1 (e.g. wpe(pos.unsqueeze(0)) for "
                       "positions), which dpzero expands to the batch, or freeze it "
                       "(requires_grad_(False))")
    if isinstance(layer.kind, EmbeddingKind):
        return head + ("Ids shared by the batch beyond [1, ...] (e.g. relative-position buckets "
                       "[T, T]) cannot be expanded without changing the model's shapes: freeze "
                       "the module (requires_grad_(False)) or compute its ids per example")
    return head + ("Expand its input to the batch first (x.expand(B, *x.shape[1:]) for a "
                   "[1, ...] input) or freeze it (requires_grad_(False))")


def _generic_verdict(name, r: CallRecord, p: CallRecord, verdicts: List[str],
                     rows: int) -> Verdict:
    bad = [(i, v) for i, v in enumerate(verdicts) if v not in (BATCHED, SHARED)]
    if bad:
        i, v = bad[0]
        return Verdict(error=f"{name}: its positional input {i} {v}; the generic per-sample "
                             "path needs the examples on dim 0 of its inputs")
    for (k, a), (_, b) in zip(r.kw_inputs, p.kw_inputs):
        v = follows(a, b, rows)
        if v != SHARED:
            return Verdict(error=(
                f"{name} uses its parameters directly and got keyword argument {k!r} that "
                f"{'holds the examples' if v == BATCHED else v}; the generic per-sample path "
                "takes the examples as positional arguments only"))
    out = follows(r.output, p.output, rows)
    if out != BATCHED:
        why = ("is shared by the whole batch" if out == SHARED else out)
        return Verdict(error=(
            f"{name} uses its parameters directly and its output {why}; the generic "
            "per-sample path needs an output with one row per example on dim 0 (expand shared "
            "tensors to the batch inside the module, or freeze its parameters)"))
    if BATCHED not in verdicts:
        return Verdict(error=(
            f"{name} uses its parameters directly and none of its positional inputs holds the "
            "examples; the generic per-sample path recomputes the module per example from "
            "them"))
    return Verdict(tuple(0 if v == BATCHED else None for v in verdicts))


def pattern(tagged: Sequence[Tuple[int, int, object]], spec, real: Sequence[CallRecord]) -> tuple:
    """What a root call's verdicts depend on besides sizes: the inputs' structure, which of them
    hold the examples on which dim, and the sequence of DP layer calls with their inputs'
    ranks."""
    return (str(spec), tuple((i, bdim) for i, bdim, _ in tagged),
            tuple(r.ranks() for r in real))


@contextlib.contextmanager
def _buffers_kept(module: nn.Module):
    """Restores every buffer the probe's forward changed (a step counter, a cache): the probe
    must leave no trace in the model."""
    saved = [(b, b._version, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, version, copy in saved:
                if b._version != version:
                    b.copy_(copy)


def _saved_nothing(_tensor):
    return None


def _never_unpacked(_packed):
    raise RuntimeError("the provenance probe's graph is never back-propagated")


def run_probe(module: nn.Module, forward: Callable, args, kwargs,
              tagged: Sequence[Tuple[int, int, object]], book, devices) -> List[CallRecord]:
    """The DP layer calls of ``forward(*args, **kwargs)`` (plain inputs) with one more example:
    row 0 repeated at the end of each tagged input's batch dim. Runs in the grad mode of the real
    forward (so the calls the probe records are the ones that register parts there: a segment
    the model runs without gradients, such as reentrant checkpointing's first pass, registers
    none), with autograd saving no tensor (the probe's graph is dropped, never back-propagated),
    and the RNG state and the module's buffers restored afterwards."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    for i, bdim, _ in tagged:
        x = leaves[i]
        leaves[i] = torch.cat([x, x.narrow(bdim, 0, 1)], dim=bdim)
    p_args, p_kwargs = pytree.tree_unflatten(leaves, spec)
    with torch.autograd.graph.saved_tensors_hooks(_saved_nothing, _never_unpacked), \
            torch.random.fork_rng(devices=devices), _buffers_kept(module), \
            book.probing() as records:
        forward(*p_args, **p_kwargs)
    return records


def root_forward(book_ref, agree: Callable[[bool], bool], devices, module: nn.Module, original,
                 *args, **kwargs):
    """The model's forward under DP (steps 1-4 of this file's docstring)."""
    from .book import PrivacyViolation

    book = book_ref()
    if book is None or book.probe is not None or book.root is not None \
            or not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
        # No gradient (evaluation), the probe, a nested call or a recompute: nothing to clip.
        (args, kwargs), _ = untagged((args, kwargs))
        return original(*args, **kwargs)
    (args, kwargs), tagged = untagged((args, kwargs))
    token = book.token
    problem = None
    if not tagged:
        lost = lost_at(token)
        problem = ("the model was called on inputs that do not come from the private data "
                   "loader: iterate the data_loader that make_private returned (or, if you "
                   "Poisson-sample batches yourself at the engine's sample rate, pass each one "
                   "through privacy_engine.own_batch(batch, logical_batch_size=...), which is "
                   "recorded in the ledger)"
                   + (f". If its tensors did come from that loader, dpzero lost track of them at "
                      f"{lost!r}, which it cannot follow (Note [batch provenance]); apply such "
                      "operations in the dataset or collate_fn" if lost else ""))
    elif token is None or any(t is not token for _, _, t in tagged):
        problem = ("the model was called on tensors of a micro-batch that is not the current "
                   f"one ({next(t for _, _, t in tagged if t is not token)!r}; current: "
                   f"{token!r}): each micro-batch the loader yields is used in its own turn")
    if problem is not None:
        # Refused lazily: the forward runs (an evaluation without torch.no_grad() on other data
        # is harmless), but its DP layers register nothing and a backward through any of them
        # raises with this message (book.refused_backward).
        book.refusal = problem
        try:
            return original(*args, **kwargs)
        finally:
            book.refusal = None
    leaves, spec = pytree.tree_flatten((args, kwargs))
    start = len(book.parts)
    book.root = []
    try:
        out = original(*args, **kwargs)
    finally:
        real, book.root = book.root, None
    key = pattern(tagged, spec, real)
    verdicts = book.verdicts.get(key)
    if agree(verdicts is None):
        try:
            probe = run_probe(module, original, args, kwargs, tagged, book, devices)
        except Exception as e:  # noqa: BLE001 - named, and chained
            book.error = (
                "dpzero could not run the model's forward once more on the same inputs with "
                "one more example (the probe that finds which DP layer inputs "
                f"hold the examples, Note [batch provenance]): {type(e).__name__}: {e}. A "
                "forward must accept any batch size, and forward hooks run in the probe too")
            raise PrivacyViolation(book.error) from e
        fresh = classify(book.layers, real, probe, token.rows)
        verdicts = book.verdicts.setdefault(key, fresh)
    book.set_verdicts(start, verdicts)
    return out
