"""The generic path: per-sample gradients of the parameters of any module through ``torch.func``.

A module with trainable parameters that no layer kind of ``layers.py`` covers takes this path:
one that uses its own parameters directly (ViT's ``cls_token`` and ``position_embeddings``, a
learned temperature on the model's root, GroupNorm, PReLU), a subclass of a kernel layer that
overrides its forward (OPT's learned positions, Gemma's scaled embedding), a recurrent module the
kernels cannot take (``recurrent.generic_reason`` says why), and an ``nn.MultiheadAttention``
the kernels cannot take (``attention.generic_reason``), which uses its ``out_proj`` child's
parameters directly and so is taken whole (``taken_whole``, and ``attach.find_layers``).
Other MultiheadAttention and recurrent modules train through the kernels (Notes [attention
through the kernels] in attention.py, [recurrence through the kernels] in recurrent.py). For
such a module M with trainable parameters P:

* forward: M runs with P swapped for detached copies, so autograd computes no gradient for P;
  every floating tensor of its output (a tensor, a tuple, a dict, a ``ModelOutput``) goes through
  :class:`_Tap`, whose backward passes the output gradients through and hands them to the book.
* backward: the per-sample gradients of P are ``vmap`` over samples of the VJP of M's forward on
  sample i with respect to P, applied to that sample's output gradients (Opacus's functorch
  fallback does the same); where ``vmap`` has no batching rule (GRU, RNN), a loop over samples.
  Child modules run their plain forward there (their own parameters are constants).

Which dim of each input and output holds the examples is the root forward's verdict (Note [batch
provenance]): any one dim per tensor (batch_first=False RNNs hold them on dim 1, an LSTM's h_n
always), or none for tensors shared by the batch; positional and keyword arguments and nested
tuples alike. Per-sample gradients exist as [B, *P.shape] for a moment, so this is meant for small
parameter sets (the big layers have kernels). Norms and clipped sums are computed in float64 from
them; the norm is rounded up so a clip factor never lets a contribution exceed its threshold.

Refused (with the module named): a random op inside M while training (dropout modules, a generic
MHA's or RNN's ``dropout``, or any random draw the recompute meets): the per-sample recompute would draw
other masks than the forward did, so the clipped gradient would belong to another function than
the one the loss was computed with.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from typing import Dict, List, NamedTuple, Sequence, Tuple

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.utils import parametrize
from torch.utils import _pytree as pytree

from .errors import PrivacyViolation
from .layers import LayerKind, original_forward


class _Bypass(threading.local):
    """Per thread, how many fallback recomputes of a forward are running (``depth``): while any
    is, DP layers run their plain forward. Read at every DP layer call, so a plain attribute
    (the class's 0 until a thread sets its own)."""

    depth = 0


BYPASS = _Bypass()


@contextlib.contextmanager
def bypass():
    BYPASS.depth += 1
    try:
        yield
    finally:
        BYPASS.depth -= 1


# Modules whose forward uses their children's parameters directly: the generic path takes them
# whole (their children are not DP layers of their own), as it takes a MultiheadAttention the
# kernels cannot (attach.find_layers). Hugging Face's Mamba mixers read
# dt_proj.bias and conv1d's weight inside their selective scan; OPT's decoder layer folds the
# examples with their positions into dim 0 ([B * T, d]) before its LayerNorm and MLP, a layout
# the probe cannot tell from one that interleaves examples, so the layer is recomputed per
# example whole (and checked, Note [separable recompute]).
SUBTREE_NAMES = frozenset({"MambaMixer", "Mamba2Mixer", "FalconMambaMixer", "OPTDecoderLayer"})


def taken_whole(module: nn.Module) -> bool:
    """Whether the generic path takes ``module`` with its children: the types above, and a
    module with a parametrization (``torch.nn.utils.parametrizations.weight_norm``, orthogonal,
    spectral norm), whose ``weight`` is computed in its forward from parameters held by a child
    (``parametrizations.weight.original0``)."""
    return type(module).__name__ in SUBTREE_NAMES or \
        parametrize.is_parametrized(module)


def _owner(module: nn.Module, name: str) -> Tuple[nn.Module, str]:
    """The module holding parameter ``name`` (dotted for a child's) and its local name."""
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


@contextlib.contextmanager
def swapped(module: nn.Module, values: Dict[str, torch.Tensor]):
    """Temporarily replaces parameters of ``module`` (by name, dotted for a child's) by
    ``values`` (tensors, not Parameters)."""
    owners = {name: _owner(module, name) for name in values}
    old = {name: m._parameters[leaf] for name, (m, leaf) in owners.items()}
    try:
        for name, value in values.items():
            m, leaf = owners[name]
            m._parameters[leaf] = value
        yield
    finally:
        for name, value in old.items():
            m, leaf = owners[name]
            m._parameters[leaf] = value


def _random_op_error(module_name: str) -> str:
    return (f"the per-sample recompute of {module_name} draws random numbers (dropout or "
            "another random op in its forward): it would draw other masks than the forward did, "
            "so the clipped gradient would belong to another function; set its dropout to 0 or "
            "freeze its parameters")


class OutputLayout(NamedTuple):
    """A generic module call's output as the book sees it: ``spec``, the output's pytree spec;
    ``tapped``: the leaf indices of its floating tensors (those the tap passes gradients
    through), and their shapes."""

    spec: object
    tapped: Tuple[int, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    values: Tuple[torch.Tensor, ...] = ()  # the forward's tapped outputs (detached)
    # The version counters of the call's (args, kwargs) leaves at the call (-1: not a tensor).
    versions: Tuple[int, ...] = ()


class FuncKind(LayerKind):
    """A module whose trainable parameters are used directly by its forward (module docstring);
    ``names``: its trainable parameters, dotted for a child's."""

    def __init__(self, names: List[str]) -> None:
        self.names = list(names)

    @property
    def params(self):  # type: ignore[override]
        return tuple(self.names)

    def check(self, module):
        if not module.training:
            return None
        for sub_name, sub in module.named_modules():
            where = f"{sub_name!r} " if sub_name else ""
            if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
                return (f"its dropout {where}(p={sub.p}) would draw a different mask when the "
                        "per-sample gradients are recomputed; set its p to 0")
            p = getattr(sub, "dropout", 0.0)
            if isinstance(sub, (nn.MultiheadAttention, nn.RNNBase)) and \
                    isinstance(p, float) and p > 0 and \
                    (not isinstance(sub, nn.RNNBase) or sub.num_layers > 1):
                return (f"{type(sub).__name__} {where}has dropout={p}, whose mask the "
                        "per-sample recompute would draw again differently; set dropout=0")
        return None

    # ---- the book's interface ----------------------------------------------------------------

    def batch_first(self, grads: Sequence[torch.Tensor], dims) -> torch.Tensor:
        """The output gradients (one per tapped output) as one [B, total] float32 tensor, each
        moved to batch-first and flattened (the verdict ``dims`` = (input dims, output dims))."""
        _, out_dims = dims
        flat = [g.movedim(d, 0).reshape(g.shape[d], -1).float() for g, d in zip(grads, out_dims)]
        return flat[0] if len(flat) == 1 else torch.cat(flat, 1)

    def per_sample_grads(self, module: nn.Module, saved, g: torch.Tensor, train, dims,
                         module_name: str = "the module", defer=None):
        """{name: [B, *shape] float32} for the trainable parameters. ``saved``: (args, kwargs,
        OutputLayout, autocast dtype or None) of the forward call; ``g``: :meth:`batch_first`'s
        [B, total]; ``dims``: the verdict (per (args, kwargs) leaf and per tapped output, the dim
        holding the examples or None). Each example's recomputed output must equal the forward's
        (Note [separable recompute]): ``defer(failed, text)`` gets the check's verdict on the
        device (the book's, read at the step: Note [deferred checks] in book.py); without it a
        failure raises :class:`MixedExamplesError` here."""
        args, kwargs, layout, amp = saved
        in_dims, out_dims = dims
        names = [n for n, t in zip(self.names, train) if t]
        values = {n: module.get_parameter(n).detach() for n in names}
        leaves, spec = pytree.tree_flatten((args, kwargs))
        # The gradient of each tapped output, [B, *per-sample shape] (its examples' dim removed).
        sizes = [math.prod(s) // s[d] for s, d in zip(layout.shapes, out_dims)]
        per_out = [t.reshape(t.shape[0], *[n for k, n in enumerate(s) if k != d])
                   for t, s, d in zip(torch.split(g, sizes, 1), layout.shapes, out_dims)]
        batched = [i for i, d in enumerate(in_dims) if d is not None]

        def sample_out(p, xs):
            full = list(leaves)
            for i, x in zip(batched, xs):
                full[i] = x.unsqueeze(in_dims[i])
            a, k = pytree.tree_unflatten(full, spec)
            with swapped(module, p), bypass():
                y = original_forward(module)(*a, **k)
            ys = pytree.tree_leaves(y)
            return tuple(ys[j].squeeze(d) for j, d in zip(layout.tapped, out_dims))

        def one(gs, xs):
            out, vjp = torch.func.vjp(lambda p: sample_out(p, xs), values)
            return vjp(tuple(gi.to(o.dtype) for gi, o in zip(gs, out)))[0], out

        xs = tuple(leaves[i] for i in batched)
        # The forward's autocast state, re-entered for the recompute (Note [autocast]).
        amp_ctx = torch.autocast(g.device.type, dtype=amp) if amp is not None else \
            contextlib.nullcontext()
        # SDPA's math backend has batching rules (its fused kernels run one sample at a time
        # under vmap); functorch runs other ops without a batching rule (mkldnn RNN layers) one
        # sample at a time and says so; the results are the same.
        with torch.enable_grad(), amp_ctx, warnings.catch_warnings(), \
                sdpa_kernel([SDPBackend.MATH]):
            warnings.filterwarnings("ignore", message="There is a performance drop because")
            try:
                grads, outs = torch.func.vmap(
                    one, in_dims=(0, tuple(in_dims[i] for i in batched)))(tuple(per_out), xs)
            except RuntimeError as e:
                if "random" in str(e):
                    raise RandomOpError(_random_op_error(module_name)) from None
                try:
                    grads, outs = self._loop(one, per_out, xs, [in_dims[i] for i in batched],
                                             module_name)
                except RandomOpError:
                    raise
                except Exception as e:  # noqa: BLE001 - named, with the module
                    raise PrivacyViolation(
                        f"{module_name}: its forward failed when recomputed for one example "
                        f"alone ({type(e).__name__}: {e}); the generic per-sample path runs the "
                        "module on each example by itself, so its forward must accept a batch "
                        "of one and compute each example's output from that example alone (no "
                        "batch statistics)") from None
        # 16-bit arithmetic anywhere in the module (autocast, or 16-bit parameters, inputs or
        # outputs without it) rounds differently between the batch and one example.
        low = amp is not None or any(
            t.dtype in (torch.float16, torch.bfloat16)
            for t in list(values.values()) + list(leaves) + list(layout.values)
            if isinstance(t, torch.Tensor))
        dropped = check_separable(module_name, outs, layout.values, out_dims, low, defer)
        return drop_rows({n: grads[n].float() for n in names}, dropped)

    @staticmethod
    def _loop(one, per_out, xs, dims, module_name):
        """What vmap(one) computes, one sample at a time (modules without batching rules); a
        random draw during it is refused (module docstring)."""
        rows = per_out[0].shape[0]
        state = _rng_states()
        out: Dict[str, List[torch.Tensor]] = {}
        outs: List[List[torch.Tensor]] = []
        try:
            for i in range(rows):
                sample = tuple(x.select(d, i) for x, d in zip(xs, dims))
                grads, y = one(tuple(g[i] for g in per_out), sample)
                for name, t in grads.items():
                    out.setdefault(name, []).append(t)
                outs.append(list(y))
            if not all(torch.equal(a, b) for a, b in zip(state, _rng_states())):
                raise RandomOpError(_random_op_error(module_name))
        finally:
            _set_rng_states(state)
        stacked = tuple(torch.stack([o[j] for o in outs]) for j in range(len(per_out)))
        return {name: torch.stack(ts) for name, ts in out.items()}, stacked

    def book_ops(self, module, train):
        return None  # the book takes this path's per-sample gradients (src/dp/book.h)


class RandomOpError(RuntimeError):
    """A generic module's recompute met a random op (FuncKind docstring)."""


class MixedExamplesError(RuntimeError):
    """A generic module's output for one example depends on others (Note [separable
    recompute])."""


# Note [separable recompute]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# The probe finds the dim of each input and output whose size follows the number of examples;
# it cannot see whether the module mixes examples along that dim. A batch_first=False
# TransformerEncoderLayer, LSTM or MultiheadAttention fed batch-first inputs attends or recurs
# over the examples and still has "one more example" exactly where the probe looks; so does a
# cumulative sum over dim 0. The per-sample recompute runs each example alone, so it computes
# each example's output as if no other example were there: every backward compares that with the
# forward's output row by row and refuses the step when they differ beyond rounding (a looser
# tolerance in 16-bit arithmetic), the tolerance taken from finite entries only and non-finite
# ones compared exactly (a privacy review disabled the check with a masked -inf); an example whose
# output holds a NaN is dropped, as one with a NaN gradient is. A module whose rows each depend on
# their own example only passes; one that mixes examples fails, and so does one that drew random
# numbers (its masks differ). The outputs come for free from the VJP the gradients need. It is a
# check against layouts that mix examples by accident, not against a model written to mix them:
# a mixing term below the tolerance, or a backward that mixes rows while the forward does not,
# passes (isolation="strict" closes that: Note [strict isolation] in strict.py; docs/
# architecture.md, "Threat model").
def check_separable(module_name: str, recomputed, forward, out_dims, low_precision: bool,
                     defer=None) -> torch.Tensor:
    """Note [separable recompute]. Returns the examples to drop ([B] bool: a NaN in their output,
    forward or recomputed); the verdict on the others is computed on the tensors' device, and
    ``defer`` (the book's) takes it unread, so the backward never waits on a GPU (Note [deferred
    checks] in book.py); without it a failure raises here."""
    # Rounding differs between a batch and one example (other kernels, other blockings): 1e-4 of
    # each example's own largest finite output in fp32, 3e-2 in 16-bit arithmetic. Non-finite
    # entries carry no scale: an output holding -inf (a masked class) or finfo.min would make
    # any tolerance taken from it infinite, so they must match exactly (same positions, same
    # values). A NaN equals nothing, so nothing can be checked in an example whose output holds
    # one: that example is dropped like one whose gradient is not finite (its clip factor 0,
    # counted in the data-dependent diagnostics). Refusing the step instead would tell whether the
    # record was sampled: a refusal is seen, a dropped example is not.
    rtol = 3e-2 if low_precision else 1e-4
    dropped = None
    for r, f, d in zip(recomputed, forward, out_dims):
        f = f.movedim(d, 0).to(r.dtype)
        nan = (torch.isnan(f) | torch.isnan(r)).reshape(f.shape[0], -1).any(1)
        dropped = nan if dropped is None else dropped | nan
    for j, (r, f, d) in enumerate(zip(recomputed, forward, out_dims)):
        f = f.movedim(d, 0).to(r.dtype)
        if not f.numel():
            continue
        keep = (~dropped).view(-1, *([1] * (f.dim() - 1)))
        finite = torch.isfinite(f) & torch.isfinite(r)
        big = torch.finfo(f.dtype).max / 4 if f.is_floating_point() else None
        if big is not None:  # finfo.min / max used as -inf / inf (Hugging Face's masks)
            finite &= (f.abs() < big) & (r.abs() < big)
        scale = torch.where(finite, f.abs(), 0).reshape(f.shape[0], -1).amax(1)
        rows = scale.view(-1, *([1] * (f.dim() - 1)))
        diff = torch.where(finite & keep, (r - f).abs(), 0)
        exact = finite | (r == f) | ~keep  # the non-finite (or huge) entries: equal exactly
        failed = (diff > rtol * rows).any() | ~exact.all()

        def text(j=j, diff=diff, exact=exact, scale=scale) -> str:
            if not bool(exact.all()):
                return (f"{module_name}: each example's output recomputed alone differs from the "
                        f"forward's at a non-finite or extreme entry of output {j} (an -inf or "
                        "finfo.min mask that is not the same when the example is alone): the "
                        "module mixes the examples along the dim that holds them. Feed it the "
                        "layout it expects, or freeze its parameters")
            return (f"{module_name}: each example's output recomputed alone differs from the "
                    f"forward's (output {j}, largest difference {float(diff.max()):.3g} at scale "
                    f"{float(scale.max()):.3g}): the module mixes the examples along the dim that "
                    "holds them (a batch_first=False layer fed batch-first inputs attends or "
                    "recurs over the examples), or draws random numbers in its forward. Feed it "
                    "the layout it expects (batch_first=True, or transpose the input), or "
                    "freeze its parameters")

        if defer is not None:
            defer(failed, text)
        elif bool(failed):
            raise MixedExamplesError(text())
    return dropped


def drop_rows(grads: Dict[str, torch.Tensor], dropped: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Per-sample gradients with the ``dropped`` examples' rows made NaN, which the book's clip
    factors turn into 0 and count (privacy/clipping.h: a non-finite norm drops the example)."""
    return {n: torch.where(dropped.view(-1, *([1] * (g.dim() - 1))), math.nan, g)
            for n, g in grads.items()}


def _rng_states() -> List[torch.Tensor]:
    states = [torch.random.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: List[torch.Tensor]) -> None:
    torch.random.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state_all(states[1:])


class _Tap(torch.autograd.Function):
    """outputs -> outputs; backward hands their gradients to ``on_backward`` and passes them
    through. The module's parameters are inputs so the outputs require grad even when no input
    does."""

    @staticmethod
    def forward(ctx, on_backward, n, *tensors):
        ctx.on_backward = on_backward
        ctx.n = n
        ctx.rest = len(tensors) - n
        return tuple(t.clone() for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        ctx.on_backward(grads)
        return (None, None) + tuple(grads) + (None,) * ctx.rest


def tap(on_backward, outputs: Sequence[torch.Tensor], params) -> Tuple[torch.Tensor, ...]:
    return _Tap.apply(on_backward, len(outputs), *outputs, *params)
