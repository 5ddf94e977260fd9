"""The probe: the root forward run again with example 0 repeated at the end of each tagged
input's batch dim, recording every DP layer call, autograd saving nothing and the model's state
restored, and the shared lookups it follows until they meet the batch row by row (root.py's
docstring says what is concluded from it)."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..state_guard import refusal_text
from .examples import Examples, MicroBatchToken, is_suspect, wrap
from .registry import varies_along
from .rules.elementwise import ELEMENTWISE, ELEMENTWISE_INPLACE
from .records import BATCHED, CallRecord, LookupCheck, follows, follows_dim, record


# ---- the probe -------------------------------------------------------------------------------

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
            same = tuple(same_values(a, b) for a, b in zip(real.tensors, rec.tensors))
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


def same_values(a, b, depth: int = 4) -> Optional[bool]:
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
            return same_values(vars(a), vars(b), depth - 1)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and depth > 0:
            if type(a) is not type(b) or len(a) != len(b):
                return False
            verdicts = [same_values(x, y, depth - 1) for x, y in zip(a, b)]
            return None if None in verdicts else all(verdicts)
        if isinstance(a, dict) and isinstance(b, dict) and depth > 0:
            if a.keys() != b.keys():
                return False
            verdicts = [same_values(a[k], b[k], depth - 1) for k in a]
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
