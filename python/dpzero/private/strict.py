"""Strict isolation: each example's forward and backward computed by itself.

Note [strict isolation]
~~~~~~~~~~~~~~~~~~~~~~~
By default dpzero runs one batched forward and keeps examples apart by detection: the probe finds
which rows of each DP layer's input are examples (Note [batch provenance]), the separable
recompute checks generic modules (Note [separable recompute]), and what a model does between
its layers is trusted. Detection has gaps a model can fall into without any error: a batch mean
whose forward value cancels (``h + h.mean(0) - h.mean(0).detach()``) but whose gradient mixes
rows, a custom autograd function whose backward alone mixes them, mixing below a tolerance, rows
permuted between layers. ``isolation="strict"`` removes the class instead of detecting its
members:

* the whole model is one generic part (fallback.py) whose parameters are every trainable one;
  no layer inside it is patched;
* forward: the model runs once per example, on a batch of one (``torch.func.vmap`` over the
  examples with the model's own forward as the function, or a loop over the examples where vmap
  cannot run the model), with the parameters detached; the examples' outputs are stacked along
  the dim that holds the examples (found by growing a batch of one to two, once per call
  pattern, and held at every call), and a tap passes the loss's gradient back;
* backward: each example's parameter gradient is the VJP of its own forward, recomputed by
  itself, applied to its own rows of the output gradient; it is clipped (flat or automatic, in
  float64, the book's certified norms) and summed into the engine's buffers a few examples at a
  time (``Book.report_per_sample_rows``), so that at most ``_PER_SAMPLE_BYTES`` of per-example
  gradients exist at once;
* random ops (dropout) draw per example; the forward keeps the random state at the start of
  each piece of examples and the backward's recompute restores it, so each example's gradient
  belongs to the function its loss was computed with (checked: the recomputed outputs must equal
  the forward's, Note [separable recompute]).

So example i's output is a function of its own inputs and the parameters, and its gradient a
function of its own inputs, the parameters and its own rows of the output gradient: whatever the
model's tensor code does (batch statistics, hooks on submodules, custom autograd functions,
in-place writes, permutations), it runs on one example. What makes that hold, each found by a
privacy review of the first version (2C broken by 4.5C to 8.9C without them):

* each example gets its own copy of its inputs, and every call its own copy of the shared ones,
  so nothing reaches another example through a view's base or an in-place write;
* an autograd Function with its own ``vmap`` rule would see the whole piece under vmap: such a
  Function sends the model to the loop, where no vmap rule runs (``_no_custom_vmap``);
* hooks on the model itself (or on the PrivateModule, or global module hooks) run on the whole
  micro-batch, outside the per-example function: refused at the forward (hooks on submodules
  run per example);
* a model input that is an object holding tensors (at any depth, in ``__slots__`` too) would
  reach every example whole: refused, naming it;
* a forward that writes into the model's parameters or buffers would hand one example's write to
  the next one's forward: every piece of the forward and the backward's recompute runs under
  ProbeWrites (state_guard.py), which sees every write, puts it back and refuses the forward;
* an output with one value per call (a loss the model computes itself, ``outputs.loss``) is the
  mean of the examples' own values, and its gradient reaches every example alike, so it must
  be a constant: such an output is a ``PerCall`` tensor, whose uses are held to that (Note
  [per-call outputs] in per_call.py: a learned temperature returned beside the logits and
  divided into them would otherwise pass the whole batch's loss into every example); the
  examples' own outputs come back tagged as the examples, so nothing computed from them counts
  as a constant;
* one call of the model per micro-batch (a second one is refused: two calls would be two parts).

What strict isolation cannot isolate: the loss must be a sum or mean of per-example losses (as
in every DP-SGD library: a loss that couples the outputs of different examples couples their
output gradients); Python state persists between calls and, on the loop path, between the
examples of one call (a module attribute written by one example's forward and read by the next
is beyond any library, as globals and files are; buffers and parameters are held fixed, above);
a number read off the batch (``.item()``) and used as a weight of the loss reaches every
example's gradient; and a model that unwraps functorch's batched tensors through torch's private
``_C._functorch`` API reaches the whole piece.

Settings it does not take (config.py refuses them, naming them): layer and group clipping (one
part, the whole model: flat or automatic), ZeRO stage 3 (it gathers parameters in every forward,
and each rank's forward runs in as many pieces as its examples need), activation checkpointing
(nothing of the forward is kept). It costs a second forward per example and per-example
gradients of every parameter: docs/user-guide.md says when to use it, and
experiments/results/private.md what it costs.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import types
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import _pytree as pytree

from .attach import cache_off, rejection
from .book import Layer
from .errors import PrivacyViolation
from .provenance.examples import wrap
from .fallback import FuncKind, check_separable, drop_rows, swapped, tap
from .per_call import SOURCES, PerCall, hold_to_promise
from .provenance.records import CallRecord, Verdict, spread_inputs
from .provenance.root import Ranks, admitted

# Per-example gradients held at once (float32): examples are clipped this many bytes at a time.
_PER_SAMPLE_BYTES = 256 << 20


def find_layer(model: nn.Module, slot_of: Dict[int, Any]) -> List[Layer]:
    """The one part of a strict model: the model itself, with every trainable parameter. Raises
    PrivacyViolation naming the modules that write their state from the data (BatchNorm's
    running statistics and the like, attach.py's rejections)."""
    problems = [f"{name or '<model>'} ({type(module).__name__}): {rejection(module)}"
                for name, module in model.named_modules() if rejection(module) is not None]
    if problems:
        raise PrivacyViolation("these modules cannot be trained privately:\n  " +
                               "\n  ".join(problems))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    kind = FuncKind(names)
    slots = [slot_of[id(model.get_parameter(n))] for n in names]
    return [Layer(0, "", model, kind, (True,) * len(names), slots)]


class _Layout(NamedTuple):
    """How a strict forward's outputs are assembled: per tensor output, the dim holding the
    examples (None: one value per call, the mean of the examples'); the output's pytree spec and
    its non-tensor leaves (None where a tensor goes)."""

    dims: Tuple[Optional[int], ...]
    spec: Any
    constants: Tuple[Any, ...]


class _Saved(NamedTuple):
    """What a strict forward leaves its backward."""

    leaves: List[Any]
    spec: Any
    batched: Tuple[int, ...]        # leaf indices of the example inputs
    dims: Tuple[int, ...]           # their example dims
    pieces: List[Tuple[int, int]]   # row ranges, in order
    states: List[List[torch.Tensor]]  # the RNG states at each piece's start
    outputs: List[Tuple[torch.Tensor, ...]]  # each piece's stacked outputs [n, *per example]
    looped: bool                    # the loop ran instead of vmap


class Strict:
    """Note [strict isolation] for ``model`` (its own forward: ``original``; its one part:
    ``layer``); ``devices``: the CUDA devices whose random state the recompute restores."""

    def __init__(self, model: nn.Module, original, layer: Layer, devices) -> None:
        self.model, self.original, self.layer, self.devices = model, original, layer, devices
        self.names = list(layer.kind.params)
        # Every name each trained parameter has (a tied table is reached as emb.weight and as
        # head.weight): all are swapped for its value, so each use reaches its gradient.
        canonical = {id(model.get_parameter(n)): n for n in self.names}
        self.aliases = {alias: canonical[id(p)]
                        for alias, p in model.named_parameters(remove_duplicate=False)
                        if id(p) in canonical}
        numel = sum(model.get_parameter(n).numel() for n in self.names)
        self.piece = max(1, _PER_SAMPLE_BYTES // (4 * numel))
        self.layouts: Dict[tuple, _Layout] = {}
        self.vmap = True  # until vmap fails on this model: then the loop, for good
        self.outer: Optional[nn.Module] = None  # the PrivateModule around the model (engine.py)

    def values(self) -> Dict[str, torch.Tensor]:
        return {n: self.model.get_parameter(n).detach() for n in self.names}

    def every_name(self, values: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``values`` (by canonical name) under every name of each parameter."""
        return {alias: values[name] for alias, name in self.aliases.items()}

    # ---- one example's forward ---------------------------------------------------------------

    def _function(self, leaves, spec, batched, dims, captured: list, floating: bool = False):
        """f(values, *xs) -> the tensor outputs (``floating``: the floating ones) of the model on
        one example (xs: its slices of the example inputs, example dim removed; run as a batch
        of one)."""
        def f(values, *xs):
            # Shared inputs copied for each call: a forward that writes into one must not pass
            # it on to the next example.
            full = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
            for i, x, d in zip(batched, xs, dims):
                full[i] = x.unsqueeze(d)
            args, kwargs = pytree.tree_unflatten(full, spec)
            with swapped(self.model, self.every_name(values)):
                out = self.original(*args, **kwargs)
            out_leaves, out_spec = pytree.tree_flatten(out)
            captured[:] = [out_spec, tuple(None if isinstance(t, torch.Tensor) else t
                                           for t in out_leaves)]
            return tuple(t for t in out_leaves if isinstance(t, torch.Tensor) and
                         (not floating or t.is_floating_point()))
        return f

    def _run(self, f, values, xs, dims, looped: bool) -> Tuple[torch.Tensor, ...]:
        """f on each example of ``xs`` (pieces of the example inputs along ``dims``), stacked:
        [n, *per example] per output."""
        if not looped:
            return torch.func.vmap(f, in_dims=(None, *dims), randomness="different")(values, *xs)
        rows = xs[0].shape[dims[0]]
        # Each example's own copy: a view would reach the others through its base.
        outs = [f(values, *(x.select(d, i).clone() for x, d in zip(xs, dims)))
                for i in range(rows)]
        return tuple(torch.stack([o[j] for o in outs]) for j in range(len(outs[0])))

    def forward(self, book, ranks: Ranks, args, kwargs, tagged, rows: int):
        """The strict forward of one micro-batch (``tagged``: its example inputs, admitted):
        the outputs, tapped for the backward."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        spread = spread_inputs(leaves, tagged, rows)
        batched = tuple(i for i, _, _ in tagged) + spread
        dims = tuple(d for _, d, _ in tagged) + (0,) * len(spread)
        if any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves):
            raise PrivacyViolation(
                "a model input requires grad: under isolation='strict' the model's inputs are "
                "data, and every trained parameter is the model's")
        hidden = [i for i, x in enumerate(leaves)
                  if not isinstance(x, torch.Tensor) and _holds_tensor(x)]
        if hidden:
            raise PrivacyViolation(
                f"model input {hidden[0]} ({type(leaves[hidden[0]]).__name__}) holds tensors "
                "inside an object, which would reach every example's forward whole (the batch's "
                "or anything computed from it): pass tensors to the model as arguments (tuples, "
                "lists and dicts of them are followed, one row per example or shared)")
        if book.num_parts:
            raise PrivacyViolation(
                "the model was called a second time in one micro-batch: isolation='strict' "
                "computes each example's gradient from one call of the model per micro-batch "
                "(a loss over two passes of the same examples, such as R-Drop, needs "
                "isolation='detect')")
        values = self.values()
        captured: list = []
        f = self._function(leaves, spec, batched, dims, captured)
        pieces = [(b, min(rows, b + self.piece)) for b in range(0, rows, self.piece)]
        states, outputs, looped = self._pieces(f, values, leaves, batched, dims, pieces)
        out_spec, constants = captured
        key = (str(spec), tuple(tuple(o.shape[1:]) for o in outputs[0]), str(out_spec))
        layout = self.layouts.get(key)
        if layout is None:
            layout = self._layout(values, leaves, spec, batched, dims, outputs[0], out_spec,
                                  constants)
            self.layouts[key] = layout
        stacked = [torch.cat([o[j] for o in outputs]) if len(outputs) > 1 else outputs[0][j]
                   for j in range(len(outputs[0]))]
        tensors = [_assemble(s, d) for s, d in zip(stacked, layout.dims)]
        floating = [j for j, t in enumerate(tensors) if t.is_floating_point()]
        saved = _Saved(leaves, spec, batched, dims, pieces, states, outputs, looped)
        start = book.num_parts
        book.root = []
        try:
            generation, index = book.on_forward(self.layer.index, CallRecord(self.layer.index, ()))
        finally:
            book.root = None
        book.set_verdicts(start, [Verdict(in_dims=("strict",))])
        params = [self.model.get_parameter(n) for n in self.names]
        sources = {j: next(SOURCES) for j in floating if layout.dims[j] is None}
        tapped = tap(functools.partial(self.backward, book, generation, index, saved, layout,
                                       floating, sources), [tensors[j] for j in floating], params)
        for j, t in zip(floating, tapped):
            tensors[j] = t if j not in sources else PerCall.source(t, sources[j], book.token)
        # The examples' outputs are the examples (Note [batch provenance]), so nothing computed
        # from them counts as a constant (Note [per-call outputs]).
        tensors = [t if d is None else wrap(t, d, book.token)
                   for t, d in zip(tensors, layout.dims)]
        it = iter(tensors)
        out_leaves = [next(it) if c is None else c for c in layout.constants]
        return pytree.tree_unflatten(out_leaves, layout.spec)

    def _pieces(self, f, values, leaves, batched, dims, pieces):
        """(RNG state at each piece's start, each piece's stacked outputs, whether the loop ran):
        vmap, or the loop where vmap cannot run the model (then for good, once the loop ran)."""
        start = _rng_states(self.devices)
        for looped in ((False, True) if self.vmap else (True,)):
            _set_rng_states(start, self.devices)
            states, outputs = [], []
            try:
                with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]), \
                        warnings.catch_warnings(), self._unwritten():
                    warnings.filterwarnings("ignore", message="There is a performance drop")
                    for b, e in pieces:
                        xs = _piece(leaves, batched, dims, b, e)
                        states.append(_rng_states(self.devices))
                        with _no_custom_vmap() if not looped else contextlib.nullcontext():
                            outputs.append(self._run(f, values, xs, dims, looped))
            except PrivacyViolation:
                raise
            except Exception as error:  # noqa: BLE001 - vmap cannot run this model: the loop
                if looped:
                    raise PrivacyViolation(_failed(error)) from error
                continue
            self.vmap = self.vmap and not looped
            return states, outputs, looped
        raise AssertionError("unreachable")

    def _layout(self, values, leaves, spec, batched, dims, one, out_spec, constants) -> _Layout:
        """Per output, the dim whose size follows the number of examples: the model on a batch
        of two (example 0 twice) against its per-example shape (a batch of one). Runs without
        gradients and leaves no trace in the model's state or random streams."""
        full = list(leaves)
        for i, d in zip(batched, dims):
            first = leaves[i].narrow(d, 0, 1)
            full[i] = torch.cat([first, first], d)
        args, kwargs = pytree.tree_unflatten(full, spec)
        from .state_guard import ProbeWrites

        trained = {id(self.model.get_parameter(n)) for n in self.names}
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=self.devices), \
                    ProbeWrites(self.model, trained), \
                    swapped(self.model, self.every_name(values)):
                two = [t for t in pytree.tree_leaves(self.original(*args, **kwargs))
                       if isinstance(t, torch.Tensor)]
        except Exception as error:  # noqa: BLE001 - named in the refusal
            raise PrivacyViolation(_failed(error)) from error
        out_dims = []
        for j, (a, b) in enumerate(zip(one, two)):
            single, double = tuple(a.shape[1:]), tuple(b.shape)
            grown = [k for k, (x, y) in enumerate(zip(single, double)) if x != y] \
                if len(single) == len(double) else None
            if grown == [] and a.is_floating_point():
                out_dims.append(None)  # one value per call (a loss over the batch): the mean
            elif grown is not None and len(grown) == 1 and single[grown[0]] == 1 and \
                    double[grown[0]] == 2:
                out_dims.append(grown[0])
            else:
                raise PrivacyViolation(
                    f"the model's output {j} has shape {list(single)} for one example and "
                    f"{list(double)} for two: isolation='strict' needs each output with one dim "
                    "that follows the examples (or a floating value per call, such as a loss)")
        return _Layout(tuple(out_dims), out_spec, constants)

    # ---- the backward ------------------------------------------------------------------------

    def backward(self, book, generation: int, index: int, saved: _Saved, layout: _Layout,
                 floating: List[int], sources: Dict[int, int], grads) -> None:
        """The tap's callback: each example's clipped gradient, piece by piece, into the book;
        the gradients of per-call outputs held to what backward() promised them (Note
        [per-call outputs])."""
        core = book.core
        try:
            for j, g in zip(floating, grads):
                if j in sources:
                    hold_to_promise(book, sources[j], g, saved.outputs[0][j][0])
            core.begin_backward(generation, index)
            rows = saved.pieces[-1][1]
            multiplier = core.take_rows(index, rows)
            # Only the floating outputs carry gradients (and are recomputed).
            per_example = [_per_example(g, layout.dims[j], rows, saved.outputs[0][j])
                           for j, g in zip(floating, grads)]
            if multiplier == 0:  # Note [padding batches]: exact zeros
                zeros = [torch.zeros(rows, *self.model.get_parameter(n).shape,
                                     device=self.model.get_parameter(n).device)
                         for n in self.names]
                core.report_per_sample_rows(index, 0, zeros)
                return
            values = self.values()
            captured: list = []
            f = self._function(saved.leaves, saved.spec, saved.batched, saved.dims, captured,
                               floating=True)
            name = f"{type(self.model).__name__} (isolation='strict')"
            for (b, e), state, piece_out in zip(saved.pieces, saved.states, saved.outputs):
                forward = [piece_out[j] for j in floating]
                xs = _piece(saved.leaves, saved.batched, saved.dims, b, e)
                gs = [p[b:e] * multiplier if multiplier != 1 else p[b:e] for p in per_example]
                with torch.random.fork_rng(devices=self.devices), torch.enable_grad(), \
                        sdpa_kernel([SDPBackend.MATH]), warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="There is a performance drop")
                    piece, outs = self._recompute(f, values, xs, saved, gs, state)
                dropped = check_separable(name, outs, forward, [0] * len(outs),
                                           any(t.dtype in (torch.float16, torch.bfloat16)
                                               for t in forward), book.defer)
                piece = drop_rows({n: piece[n].float() for n in self.names}, dropped)
                core.report_per_sample_rows(index, b, [piece[n] for n in self.names])
        except BaseException as e:
            if book.error is None:
                book.error = f"the backward failed in the clipping ({type(e).__name__}: {e})"
            raise

    def _recompute(self, f, values, xs, saved: _Saved, gs, state):
        """One piece's per-example gradients and recomputed outputs, by the forward's way (vmap
        or the loop) from its random state; should vmap fail here where the forward's ran (the
        transform of a VJP takes less than a plain forward), by the loop, whose outputs the
        recompute check then holds to the forward's (a random draw taken differently fails
        it)."""
        _set_rng_states(state, self.devices)
        with self._unwritten():
            if saved.looped:
                return self._vjp(f, values, xs, saved.dims, gs, True)
            try:
                with _no_custom_vmap():
                    return self._vjp(f, values, xs, saved.dims, gs, False)
            except PrivacyViolation:
                raise
            except Exception:  # noqa: BLE001 - the loop runs what vmap's transforms cannot
                self.vmap = False
                _set_rng_states(state, self.devices)
                return self._vjp(f, values, xs, saved.dims, gs, True)

    @contextlib.contextmanager
    def _unwritten(self):
        """The model's parameters (trained and frozen) and buffers are not written by a strict
        forward: one example's forward writing state that the next reads would carry it past
        the isolation (a second review: a buffer accumulated example by example and reset before
        the step moved the sum 4.96C; a trained table renormalised in place by F.embedding's
        max_norm). Every write is seen by construction (Note [probe writes] in state_guard.py),
        undone, and refuses the call, naming the tensors."""
        from .state_guard import ProbeWrites, refusal_text

        watch = ProbeWrites(self.model, (), any_write=True)
        with watch:
            yield
        if watch.written:
            raise PrivacyViolation(refusal_text(
                "the strict forward is refused (it wrote into the model's parameters or "
                "buffers, which another example's forward would read)", watch.described))

    def _vjp(self, f, values, xs, dims, gs, looped: bool):
        """({name: [n, *shape]} per-example gradients, the recomputed outputs) of one piece."""
        def one(g, *x):
            # Copied inside the transform: a forward that writes into its input writes its copy.
            out, vjp = torch.func.vjp(lambda p: f(p, *(t.clone() for t in x)), values)
            return vjp(tuple(gi.to(o.dtype) for gi, o in zip(g, out)))[0], out

        if not looped:
            return torch.func.vmap(one, in_dims=(0, *dims), randomness="different")(
                tuple(gs), *xs)
        rows = gs[0].shape[0]
        grads: Dict[str, List[torch.Tensor]] = {}
        outs: List[Tuple[torch.Tensor, ...]] = []
        for i in range(rows):
            x = [t.select(d, i).clone() for t, d in zip(xs, dims)]
            g, out = _autograd_vjp(f, values, x, tuple(t[i] for t in gs))
            for n, t in g.items():
                grads.setdefault(n, []).append(t)
            outs.append(out)
        return ({n: torch.stack(ts) for n, ts in grads.items()},
                tuple(torch.stack([o[j] for o in outs]) for j in range(len(outs[0]))))


def _piece(leaves, batched, dims, b: int, e: int) -> List[torch.Tensor]:
    """Rows [b, e) of each example input, copied: the model may write into its inputs, which
    must not reach the loader's batch (nor the next piece)."""
    return [leaves[i].narrow(d, b, e - b).clone() for i, d in zip(batched, dims)]


def _failed(error: Exception) -> str:
    return (f"the model failed on one example by itself ({type(error).__name__}: {error}): under "
            "isolation='strict' the forward runs on each example alone, so it must accept a "
            "batch of one, and every model input with one row per example must come from the "
            "loader's batch (torch.ones_like(x), not torch.ones(x.shape))")


class _CustomVmap(RuntimeError):
    """A custom autograd Function with its own vmap rule ran under vmap."""


@contextlib.contextmanager
def _no_custom_vmap():
    """Under vmap, an autograd Function's own ``vmap`` staticmethod sees the whole piece of
    examples at once (physically batched), so its rule could mix them; such a Function stops
    vmap here, and the model takes the loop, where no vmap rule runs. (A Function without one,
    or with generate_vmap_rule, runs its forward per example under vmap's semantics.)"""
    base = torch.autograd.Function
    original = base.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if cls.vmap is not base.vmap:
            raise _CustomVmap(f"{cls.__qualname__} has its own vmap rule")
        return original.__func__(cls, *args, **kwargs)

    base.apply = classmethod(apply)
    try:
        yield
    finally:
        base.apply = original


def _autograd_vjp(f, values, x, g):
    """One example's VJP through plain autograd (the loop: hooks, custom autograd functions
    and Python control flow that functorch cannot transform all run here)."""
    leaves = {n: v.detach().requires_grad_(True) for n, v in values.items()}
    out = f(leaves, *x)
    pairs = [(o, gi.to(o.dtype)) for o, gi in zip(out, g) if o.requires_grad]
    grads = torch.autograd.grad([o for o, _ in pairs], list(leaves.values()),
                                [gi for _, gi in pairs], allow_unused=True) if pairs else \
        [None] * len(leaves)
    return ({n: torch.zeros_like(v) if t is None else t
             for (n, v), t in zip(leaves.items(), grads)},
            tuple(o.detach() for o in out))


def _holds_tensor(obj, limit: int = 100_000) -> bool:
    """Whether a tensor is reachable from a non-pytree object (its attributes, slots, items,
    elements, at any depth; types, modules and functions not followed): such an object would
    reach every example's forward whole. More than ``limit`` objects to look through counts as
    holding one (it cannot be checked)."""
    seen, todo = set(), [obj]
    while todo:
        o = todo.pop()
        if isinstance(o, torch.Tensor):
            return True
        if id(o) in seen or isinstance(o, (type, types.ModuleType, types.FunctionType,
                                           types.BuiltinFunctionType, types.CodeType, str,
                                           bytes, int, float, complex, bool, type(None))):
            continue
        seen.add(id(o))
        if len(seen) > limit:
            return True
        todo.extend(gc.get_referents(o))
    return False


def _assemble(stacked: torch.Tensor, d: Optional[int]) -> torch.Tensor:
    """[B, *per example] -> the batch's output: the examples along ``d`` (where the example has
    its batch of one), or their mean (one value per call)."""
    if d is None:
        return stacked.mean(0)
    return stacked.squeeze(d + 1).movedim(0, d)


def _per_example(g: Optional[torch.Tensor], d: Optional[int], rows: int,
                 like: torch.Tensor) -> torch.Tensor:
    """The gradient of an assembled output as [B, *per example] (zeros where it has none)."""
    shape = (rows, *like.shape[1:])
    if g is None:
        return torch.zeros(shape, dtype=like.dtype if like.is_floating_point() else
                           torch.float32, device=like.device)
    if d is None:  # the mean's backward
        return (g / rows).expand(shape).contiguous()
    return g.movedim(d, 0).unsqueeze(d + 1).contiguous()


def _rng_states(devices) -> List[torch.Tensor]:
    return [torch.random.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in devices]


def _set_rng_states(states: List[torch.Tensor], devices) -> None:
    torch.random.set_rng_state(states[0])
    for d, s in zip(devices, states[1:]):
        torch.cuda.set_rng_state(s, d)


def strict_forward(book_ref, ranks: Ranks, strict: Strict, module: nn.Module, original, *args,
                   **kwargs):
    """The model's forward under isolation='strict' (Note [strict isolation])."""
    book = book_ref()
    if book is None or not torch.is_grad_enabled() or \
            torch._C._current_graph_task_id() != -1:
        from .provenance.examples import untagged
        (args, kwargs), _, _ = untagged((args, kwargs))
        return original(*args, **kwargs)  # evaluation: nothing to clip
    args, kwargs, tagged, problem = admitted(book, args, kwargs)
    if problem is None:
        problem = _outer_hooks(module, strict.outer)
    if problem is not None:
        # Refused lazily, as provenance.root_forward does: the forward runs with the parameters
        # detached (an evaluation on other data without torch.no_grad() is harmless), and a
        # backward through it raises; unless some rank did not refuse it: then all raise now.
        with swapped(module, strict.every_name(strict.values())):
            out = original(*args, **kwargs)
        leaves, spec = pytree.tree_flatten(out)
        floating = [i for i, t in enumerate(leaves)
                    if isinstance(t, torch.Tensor) and t.is_floating_point()]
        params = [module.get_parameter(n) for n in strict.names]
        for i, t in zip(floating, tap(book.refusing(problem), [leaves[i] for i in floating],
                                      params)):
            leaves[i] = t
        if ranks.refusals(True) < ranks.world:
            book.error = problem
            raise PrivacyViolation(problem)
        return pytree.tree_unflatten(leaves, spec)
    error, out = None, None
    try:
        out = strict.forward(book, ranks, args, kwargs, tagged, book.token.rows)
    except PrivacyViolation as e:
        error = str(e)
    if ranks.refusals(error is not None):  # every rank refuses, or none
        book.error = error or ("another rank refused this forward (its error says why); no "
                               "rank runs its backward")
        raise PrivacyViolation(book.error)
    return out


_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks",
                 "_global_backward_pre_hooks", "_global_backward_hooks")


def _outer_hooks(model: nn.Module, outer: Optional[nn.Module]) -> Optional[str]:
    """Why hooks around the model's whole call break strict isolation, or None: hooks on the
    model itself (or the PrivateModule around it) and global module hooks run on the whole
    micro-batch, outside the per-example forward, where they could mix examples' outputs or
    gradients; hooks on submodules run inside it, per example."""
    from torch.nn.modules import module as torch_module

    found = [f"{name} of {type(m).__name__}" for m in (model, outer) if m is not None
             for name in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
                          "_backward_hooks") if getattr(m, name, None)]
    found += [name for name in _GLOBAL_HOOKS if getattr(torch_module, name, None)]
    if not found:
        return None
    return (f"hooks around the whole model ({', '.join(found)}) run on the whole micro-batch, "
            "outside the per-example forward of isolation='strict', where they could mix the "
            "examples: register them on a submodule instead (they then run per example)")


def patch(model: nn.Module, strict_of, book_ref, ranks: Ranks) -> Strict:
    """Routes the model's forward through strict_forward; returns its Strict."""
    cache_off(model)  # Note [no key/value cache] in attach.py
    original = model.forward
    strict = strict_of(original)
    model._dp_root_previous = model.__dict__.get("forward")
    model.forward = functools.partial(strict_forward, book_ref, ranks, strict, model, original)
    return strict


def unpatch(model: nn.Module) -> None:
    for config in model.__dict__.pop("_dp_use_cache", ()):
        config.use_cache = True
    previous = model.__dict__.pop("_dp_root_previous", None)
    if previous is not None:
        model.forward = previous
    else:
        model.__dict__.pop("forward", None)
