"""Which DP layer inputs hold the examples on dim 0: the model's root forward and its probe.

Note [batch provenance] (examples.py) says why; this file and its two helpers (records.py, the
calls and their verdicts; probe.py, the probe) are its second half. The model given to
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

import functools
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import PrivacyViolation
from .examples import lost_at, untagged
from .probe import ProbeRefused, run_probe, same_values
from .records import CallRecord, Verdict, ambiguous, classify, pattern, spread_inputs


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
    if "labels" in kwargs:  # Note [a model's own loss under make_private] (dpzero/hf/losses.py)
        from ...hf.losses import per_example_model_loss
        out = per_example_model_loss(module, kwargs, out, book.mean_loss)
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
        elif v.in_dims and len(v.in_dims) > 1:  # a kernel call's context (Note [call context])
            shared = [j for j, d in enumerate(v.in_dims) if j > 0 and d is None]
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
        elif isinstance(now, torch.Tensor) or same_values(now, then) is not True:
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


@functools.cache
def compiled_out_root_forward() -> Callable:
    """:func:`root_forward` excluded from compilation (Note [compiled private models] in
    engine.py). Made at the first make_private, not at import: ``torch.compiler.disable``
    imports torch._dynamo, which a process using only the accountants, the CLI or
    ``dpzero.shard`` need not load (experiments/results/build.md)."""
    return torch.compiler.disable(root_forward)
