"""Which tensors hold the examples: the tag the private loader puts on a micro-batch's tensors.

Note [batch provenance]
~~~~~~~~~~~~~~~~~~~~~~~
Per-sample clipping is private only if every row it clips is one example. Which dimension of a
DP layer's input is the batch is a fact about where the tensor came from, never about its size:
with B = T, a position table's rows and the examples have the same count. dpzero establishes it
in two places, neither of which looks at a size alone:

1. At the model's boundary (this file). The private loader (and ``PrivacyEngine.own_batch``, the
   ledgered opt-out for callers who sample themselves) hands out the micro-batch's tensors as
   :class:`Examples`: a tensor subclass that knows its batch dimension and the micro-batch it
   belongs to (a :class:`MicroBatchToken`). The tag follows the tensor through the few
   operations a training loop applies before calling the model (``.to(device)``, dtype casts,
   ``ids[:, :-1]``, ``x / 255``, ``unsqueeze``, ...) by rules that track the batch dimension
   exactly, and is dropped by every operation it has no rule for, and by any operation that could
   mix rows of different examples (an operand whose slices along the batch dimension differ
   without being the same micro-batch's examples, indexing that selects rows). The same rules
   follow the examples through a model's frozen layers in the probe below (``F.linear``,
   ``F.embedding``, per-example ``matmul``, softmax over other dims, dropout, activations), where
   a shared lookup expanded to the batch must meet them row by row. Whatever is computed from the
   examples without a rule vouching for its rows stays *tainted*: it withdraws the tag of what
   it meets and is refused as a model input (``x - x.mean(0)``). Writes no rule vouches for
   (through another view, ``.data``, numpy, DLPack) withdraw the tag too, checked against the
   version counter before any rule reads a tagged operand and at the model's door. So a model
   input is tagged only if its batch dimension holds the micro-batch's examples, one per row, in
   order, as far as the operations applied to it show: statistics copied out of the batch's
   tensors (``.item()``, ``torch.tensor(stat)``, a module attribute) are beyond this file's
   reach, and are the caller's responsibility, as in every DP-SGD library.

2. Inside the model (``provenance.py``). The model's root forward unwraps the tagged inputs and,
   for each new pattern of DP layer calls, runs the model once more on the same inputs with one
   more example (row 0 repeated along each tagged input's batch dimension; autograd saves
   nothing, the RNG and buffers are restored). A DP layer input whose dim 0 went from B to B + 1
   while its other dimensions stayed holds the examples on dim 0; one whose shape and values did
   not change is shared by the whole batch (a position table, relative-position buckets, prompt
   tokens); anything else has the batch elsewhere. Sizes that coincide (B = T, B = heads,
   B = 1) cannot fool this: a dimension that does not come from the examples does not grow with
   them. What the probe cannot see is listed in provenance.py's docstring.

A call of the model whose inputs carry no tag of the current micro-batch is refused: its batch did
not come from the private loader (or the opt-out), so nothing says it was Poisson-sampled at the
q the accountant is charged with (design.md §2 step 1).
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

__all__ = ["Examples", "MicroBatchToken", "tag", "untagged", "lost_at"]


class MicroBatchToken:
    """One micro-batch handed out by the private loader or ``own_batch``: its tagged tensors name
    it, and only the engine's current token is accepted by the model's forward.

    ``step``: the logical step t; ``index``: the micro-batch's index in it; ``rows``: how many
    examples it holds on this rank (a padding batch holds one, Note [padding batches]);
    ``sampling``: "poisson" (dpzero's sampler) or "caller" (``own_batch``).

    Two records by storage (data pointer; each entry holds the storage, so that no other tensor
    can reuse the address while the token lives): the storages of its tensors handed to code that
    can write them without a version counter seeing it (``escaped``: ``.data``, numpy, DLPack,
    ``data_ptr``), whose contents it no longer vouches for, nor for tensors that share them; and,
    per storage, the version after the last write a rule vouched for (``vouched``), so that a
    vouched write through one view (``x[:, c].sub_(m)``) leaves the other views of that memory
    valid."""

    _serial = itertools.count()

    def __init__(self, step: int, index: int, rows: int, sampling: str) -> None:
        self.serial = next(self._serial)
        self.step, self.index, self.rows, self.sampling = step, index, rows, sampling
        self.escaped: Dict[int, Any] = {}
        self.vouched: Dict[int, Tuple[int, Any]] = {}

    def __repr__(self) -> str:
        return (f"micro-batch {self.index} of step {self.step} ({self.rows} rows, "
                f"{self.sampling} sampling)")


_lost = threading.local()


def lost_at(token: Optional[MicroBatchToken]) -> Optional[str]:
    """The last operation that dropped the tag of ``token``'s tensors on this thread (for error
    messages), or None."""
    op, lost_token = getattr(_lost, "op", (None, None))
    return op if token is not None and lost_token is token else None


def _note_lost(func, args, kwargs) -> None:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    _lost.op = (name, _taint_of(args, kwargs))


class Examples(torch.Tensor):
    """A tensor derived from micro-batch ``_dp_taint``'s examples. While it is *tagged*
    (``_dp_token`` is that micro-batch, ``_dp_version`` its version when tagged), dimension
    ``_dp_bdim`` indexes the examples, one per row, in the loader's order (Note [batch
    provenance]); once an operation may have mixed its rows the tag is withdrawn (``_dp_token``
    None) and it stays *tainted*: combined with tagged tensors it withdraws their tag too (the
    batch's mean, a row of another example). Behaves as a plain tensor; the model's forward
    receives plain tensors (the root unwraps them)."""

    _dp_bdim: int
    _dp_token: Optional[MicroBatchToken]
    _dp_taint: Optional[MicroBatchToken]
    _dp_version: int

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: D105
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.__repr__(self)

    def __format__(self, format_spec: str) -> str:  # f"{loss:.4f}": torch formats plain tensors
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor).__format__(format_spec)

    def __reduce_ex__(self, protocol):
        # Saved (torch.save, pickle, deepcopy) as the plain tensor it is: the tag belongs to
        # this run's micro-batch, and torch.load(weights_only=True) refuses unknown classes.
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            # Operands whose memory changed unseen lose their tag before anything reads them (an
            # in-place write a rule vouches for then never vouches for an earlier unseen one).
            _valid(args, kwargs)
            before = args[0]._version if func in _INPLACE and _is_tagged(args[0]) else None
            out = func(*args, **kwargs)
            if func in _METADATA:
                return out
            return _propagate(func, args, kwargs, out, before)


def _in_dynamo(depth: int = 40) -> bool:
    """Whether torch.compile's tracer is among this call's callers (it reads a graph input's
    storage before tracing)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if "/torch/_dynamo/" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _withdraw(x: "Examples") -> None:
    """Its rows may no longer be the examples: the tag goes, the taint stays."""
    x._dp_token = None


def storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _propagate(func, args, kwargs, out, before: Optional[int] = None):
    """``out`` of ``func(*args, **kwargs)`` with the examples tag where a rule keeps it, tainted
    where the operation touched the examples but no rule vouches for its rows (run with subclass
    dispatch off, so the rules' own tensor accesses are plain). ``before``: the version of a
    tagged in-place target before the write."""
    taint = _taint_of(args, kwargs)
    if taint is None:
        return out
    if func in _ESCAPES:  # memory handed to code whose writes dpzero cannot see
        if _in_dynamo():
            raise RuntimeError(
                "a torch.compile'd function received the private loader's tensors (Note "
                "[compiled private models] in engine.py): compilation reads their memory in "
                "ways the examples' tag cannot follow. Call the private model and the loss "
                "outside the compiled function; torch.compile of the private model itself runs "
                "it eagerly")
        for x in _flat(args, kwargs):
            if isinstance(x, Examples):
                taint.escaped[storage_id(x)] = x.untyped_storage()
                _withdraw(x)
    for x in pytree.tree_leaves(kwargs.get("out")):  # an out= target: whatever was written
        if isinstance(x, Examples):
            _withdraw(x)
        elif isinstance(x, torch.Tensor):
            holds_examples(x, taint)
    target = args[0] if args and isinstance(args[0], torch.Tensor) else None
    name = getattr(func, "__name__", "")
    inplace = func in _INPLACE or (name.endswith("_") and not name.endswith("__"))
    if inplace and target is not None and not isinstance(target, Examples):
        holds_examples(target, taint)  # u.copy_(x), u.add_(x): u now holds example data
    if inplace and args and isinstance(args[0], (list, tuple)):  # _foreach_copy_([u], [x])
        for u in args[0]:
            if isinstance(u, torch.Tensor) and not isinstance(u, Examples):
                holds_examples(u, taint)
    if func is torch.nn.functional.embedding and _embedding_renorms(args, kwargs):
        holds_examples(_argument(args, kwargs, 1, "weight"), taint)
    # An operand computed from the examples without being them (or aliasing memory handed out)
    # makes the result so too, whatever the rule would say (full_like(x, x.mean()), F.pad(x, p,
    # value=x.mean()), x.new_full(s, x.mean())).
    suspect = any(is_suspect(a, taint) for a in _flat(args, kwargs))
    if func in _FACTORIES and not suspect:  # x.new_zeros(...): nothing of x but its dtype
        return out
    rule = _RULES.get(func) if not suspect else None
    if rule is None:
        # An operation without a rule that wrote into a tagged tensor (an in-place method: it
        # returns that tensor) may have mixed its rows: withdrawn.
        for x in pytree.tree_leaves(out):
            if isinstance(x, Examples):
                _withdraw(x)
        if inplace and isinstance(target, Examples):
            _withdraw(target)
        return _tainted(func, args, kwargs, out, taint)
    if func in _INPLACE:  # modifies args[0] (returned, or None for __setitem__)
        if _is_tagged(target):
            if before is not None and _vouches(rule, args, kwargs, target):
                _vouch(target)  # a write the rule vouches for
            else:
                _note_lost(func, args, kwargs)
                _withdraw(target)
        return out
    bdim = _vouches(rule, args, kwargs, out)
    token = _token_of(args, kwargs)
    if isinstance(out, (tuple, list)):
        if bdim is None:
            return _tainted(func, args, kwargs, out, taint)
        return type(out)(wrap(o, b, token) if b is not None and _fits(o, b, token)
                         else taint_only(o, taint) for o, b in zip(out, bdim))
    if not isinstance(out, torch.Tensor):
        return out
    if bdim is None or not _fits(out, bdim, token):
        return _tainted(func, args, kwargs, out, taint)
    return wrap(out, bdim, token)


def _vouches(rule, args, kwargs, out):
    """The rule's answer, or None (no rule vouches) for a call form it does not read (keyword-only
    arguments, an unusual signature)."""
    try:
        return rule(args, kwargs, out)
    except (IndexError, KeyError, TypeError, ValueError):
        return None


def holds_examples(x: torch.Tensor, taint: MicroBatchToken) -> None:
    """A tensor the examples' data was written into while it was no Examples (an ``out=``
    target, ``u.copy_(x)``, a weight ``F.embedding(..., max_norm=)`` renormalised at the
    looked-up rows) carries their data without a tag. A plain tensor becomes a tainted Examples
    in place (its class changes), so whatever is computed from it is tainted too; a Parameter or
    another subclass keeps its class and only its memory is marked like memory handed out, which
    makes it suspect as an operand but not what plain code computes from it (the limit named in
    Note [batch provenance]). The write may have gone through a view (``buf[0].copy_(x)``), so
    the view's base changes class too (views taken from it later are tainted), and the memory is
    marked (views taken from it earlier are suspect as operands)."""
    taint.escaped[storage_id(x)] = x.untyped_storage()
    for t in (x, x._base):
        if type(t) is torch.Tensor:
            t.__class__ = Examples
            t._dp_token, t._dp_bdim, t._dp_taint, t._dp_version = None, -1, taint, -1


def untag(x: torch.Tensor) -> None:
    """Undoes :func:`holds_examples` on a plain tensor turned into a tainted Examples in place
    (module state the probe's forward wrote, restored after it)."""
    if type(x) is Examples:
        x.__class__ = torch.Tensor
        for attr in ("_dp_token", "_dp_bdim", "_dp_taint", "_dp_version"):
            x.__dict__.pop(attr, None)


def _argument(args, kwargs, index: int, name: str):
    return args[index] if len(args) > index else kwargs.get(name)


def _embedding_renorms(args, kwargs) -> bool:
    """F.embedding(input, weight, padding_idx, max_norm, ...) with max_norm renormalises the
    looked-up rows of its weight in place."""
    return _argument(args, kwargs, 3, "max_norm") is not None


def _fits(t, bdim: int, token: Optional[MicroBatchToken]) -> bool:
    """A rule's answer checked against the tensor: the batch dim exists and has the rows."""
    return (token is not None and isinstance(t, torch.Tensor) and 0 <= bdim < t.dim()
            and t.shape[bdim] == token.rows)


def _tainted(func, args, kwargs, out, taint):
    if _tensors_in(out):
        _note_lost(func, args, kwargs)
    return pytree.tree_map(lambda o: taint_only(o, taint), out)


def taint_only(t, taint: MicroBatchToken):
    """``t`` as a tainted Examples (derived from ``taint``'s examples, untagged)."""
    if not isinstance(t, torch.Tensor):
        return t
    if isinstance(t, Examples) and getattr(t, "_dp_taint", None) is not None:
        return t  # an input handed back (an in-place op): already tagged or tainted
    e = t.as_subclass(Examples)
    e._dp_token, e._dp_bdim, e._dp_taint, e._dp_version = None, -1, taint, -1
    return e


def wrap(t: torch.Tensor, bdim: int, token: Optional[MicroBatchToken]) -> torch.Tensor:
    if token is None:
        return t
    e = t.as_subclass(Examples)
    e._dp_bdim, e._dp_token, e._dp_taint, e._dp_version = bdim, token, token, e._version
    return e


def _is_tagged(x) -> bool:
    return isinstance(x, Examples) and getattr(x, "_dp_token", None) is not None


def _intact(x: "Examples") -> bool:
    """A tagged tensor whose memory holds what the tag vouches for: not written since it was
    tagged, or last written by a write a rule vouched for (through any view of the memory), and
    not handed to code that writes unseen."""
    token, storage = x._dp_token, storage_id(x)
    if storage in token.escaped:
        return False
    return x._version == x._dp_version or x._version == token.vouched.get(storage, (None,))[0]


def _vouch(x: "Examples") -> None:
    x._dp_version = x._version
    x._dp_token.vouched[storage_id(x)] = (x._version, x.untyped_storage())


def is_suspect(a, token: MicroBatchToken) -> bool:
    """An operand that carries the examples' data without being them: tainted, or a plain
    tensor aliasing memory of theirs that was handed out (torch.from_numpy(stat.numpy()))."""
    if isinstance(a, Examples):
        return _is_tainted(a)
    return isinstance(a, torch.Tensor) and bool(token.escaped) and storage_id(a) in token.escaped


def _valid(args, kwargs) -> None:
    """Withdraws the tag of every operand that is no longer intact, before a rule reads it: a
    copy must not inherit a tag its source lost (CutMix through a view, then x * 1.0)."""
    for x in _flat(args, kwargs):
        if _is_tagged(x) and not _intact(x):
            _lost.op = ("an in-place write that no rule vouches for, or memory handed to "
                        ".data, numpy or DLPack", x._dp_token)
            _withdraw(x)


def _is_tainted(x) -> bool:
    """Derived from a micro-batch's examples but not (any more) one of its tagged tensors."""
    return isinstance(x, Examples) and getattr(x, "_dp_taint", None) is not None \
        and not _is_tagged(x)


def _taint_of(args, kwargs) -> Optional[MicroBatchToken]:
    return next((x._dp_taint for x in _flat(args, kwargs)
                 if isinstance(x, Examples) and getattr(x, "_dp_taint", None) is not None), None)


def _tensors_in(obj) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(obj))


def _flat(args, kwargs) -> List[Any]:
    return pytree.tree_leaves((args, kwargs))


def _token_of(args, kwargs) -> Optional[MicroBatchToken]:
    tokens = {id(x._dp_token): x._dp_token for x in _flat(args, kwargs) if _is_tagged(x)}
    return next(iter(tokens.values())) if len(tokens) == 1 else None


def tag(batch, token: MicroBatchToken):
    """``batch`` (a tensor or a nested tuple / list / dict of them) with every tensor of at least
    one dimension tagged as the examples of ``token`` on dim 0 (0-dim tensors stay plain)."""
    def one(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            if x.shape[0] != token.rows:
                raise ValueError(f"a tensor of the micro-batch has {x.shape[0]} rows on dim 0, "
                                 f"the micro-batch {token.rows} examples (shape "
                                 f"{list(x.shape)}): every tensor of a batch holds one row per "
                                 "example on dim 0")
            return wrap(x.as_subclass(torch.Tensor), 0, token)
        return x
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        # A Mapping pytree does not know (Hugging Face's BatchEncoding): its entries tagged, in
        # its own class when that can be built from a dict.
        tagged = tag(dict(batch), token)
        try:
            return type(batch)(tagged)
        except Exception:  # noqa: BLE001 - a class without a dict constructor: the dict
            return tagged
    with torch._C.DisableTorchFunctionSubclass():
        return pytree.tree_map(one, batch)


def untagged(tree, token: Optional[MicroBatchToken] = None
             ) -> Tuple[Any, List[Tuple[int, int, Optional[MicroBatchToken]]], Optional[str]]:
    """(``tree`` with every Examples leaf replaced by the plain tensor it wraps, [(leaf index,
    batch dim, token)] of its tagged leaves in ``pytree.tree_leaves`` order, and why a leaf may
    not go into the model, or None). A leaf is refused if it is computed from a micro-batch's
    examples without being tagged (a batch statistic, a mixture of rows), or if its memory was
    written in a way no rule vouches for, or handed to code that writes unseen."""
    leaves, spec = pytree.tree_flatten(tree)
    found, problem = [], None
    with torch._C.DisableTorchFunctionSubclass():
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, Examples):
                continue
            if _is_tagged(leaf) and not _intact(leaf):
                problem = problem or (
                    f"model input {i} was written since the loader handed it out in a way no "
                    "rule vouches for (through another view of its memory, "
                    "x[:, a:].copy_(x[perm, a:]), or through .data, numpy or DLPack)")
                _withdraw(leaf)
            elif _is_tagged(leaf):
                found.append((i, leaf._dp_bdim, leaf._dp_token))
            elif getattr(leaf, "_dp_taint", None) is not None and problem is None:
                problem = (f"model input {i} is computed from the examples of "
                           f"{leaf._dp_taint!r} without being one row per example of the "
                           "current micro-batch (a batch statistic, a selection or mixture of "
                           "rows): every row it touches would carry several examples")
            leaves[i] = leaf.as_subclass(torch.Tensor)
    return pytree.tree_unflatten(leaves, spec), found, problem


# ---- rules: the batch dim of an operation's output, or None (the tag is dropped) --------------

Rule = Callable[[Sequence[Any], Dict[str, Any], Any], Any]
_RULES: Dict[Any, Rule] = {}
_INPLACE: set = set()
# Factories that read nothing of the tensor but its dtype and device: their results are plain.
# (Not new_tensor: it copies its data argument, which may be computed from the examples.)
_FACTORIES = {getattr(torch.Tensor, n) for n in ("new_zeros", "new_ones", "new_full",
                                                  "new_empty")}
# Reads of what a tensor is a view of, handed back as they are (the base tensor object itself):
# wrapping a view's base would make a new view whose base is again wrapped, without end.
_METADATA = {torch.Tensor._base.__get__}
# Operations that hand the tensor's memory to code whose writes bump no version counter dpzero
# sees (``x.data[0] = x.data[1]``, numpy, DLPack, raw pointers): the tag is withdrawn.
# (torch.utils.dlpack.to_dlpack is a C function that bypasses __torch_function__: beyond reach.)
_ESCAPES = {f for f in (torch.Tensor.data.__get__, torch.Tensor.numpy, torch.Tensor.__array__,
                        torch.Tensor.__dlpack__, torch.Tensor.untyped_storage,
                        getattr(torch.Tensor, "_typed_storage", None), torch.Tensor.storage,
                        torch.Tensor.set_, torch.Tensor.data_ptr,
                        getattr(torch.Tensor, "__cuda_array_interface__", None))
            if f is not None}
_ESCAPES = {f.__get__ if isinstance(f, property) else f for f in _ESCAPES}


def _rule(*funcs, inplace: bool = False):
    def register(fn):
        for f in funcs:
            if f is None:
                continue
            _RULES[f] = fn
            if inplace:
                _INPLACE.add(f)
        return fn
    return register


def varies_along(u: torch.Tensor, dim: int, ndim: int) -> bool:
    """Whether ``u``, broadcast (right-aligned) into a result of ``ndim`` dims, holds different
    values along the result's ``dim``: it has that dim, of size above 1, not as a stride-0
    expansion of one value, and its slices along it are not all equal (a causal mask built as
    [B, 1, T, T] from shapes alone)."""
    p = dim - (ndim - u.dim())
    if not (0 <= p < u.dim() and u.shape[p] != 1 and u.stride(p) != 0):
        return False
    with torch._C.DisableTorchFunctionSubclass():
        return not torch.equal(u, u.narrow(p, 0, 1).expand_as(u))


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _variadic(args, kwargs, key: str) -> tuple:
    """The sizes or dims of ``x.permute(0, 2, 1)``, ``x.permute((0, 2, 1))`` or
    ``x.permute(dims=(0, 2, 1))``."""
    values = args[1:] if len(args) > 1 else (kwargs[key],)
    if len(values) == 1 and isinstance(values[0], (tuple, list, torch.Size)):
        values = tuple(values[0])
    return tuple(values)


@_rule(torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.type,
       torch.Tensor.long, torch.Tensor.int, torch.Tensor.short, torch.Tensor.char,
       torch.Tensor.byte, torch.Tensor.bool, torch.Tensor.float, torch.Tensor.double,
       torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.contiguous, torch.Tensor.clone,
       torch.clone, torch.Tensor.detach, torch.detach, torch.Tensor.pin_memory,
       torch.Tensor.type_as, torch.randn_like, torch.rand_like, torch.zeros_like,
       torch.ones_like, torch.full_like, torch.randint_like)
def _same_layout(args, kwargs, out):
    """Copies, casts, device moves and ``*_like`` factories: the same shape, row for row (a
    ``*_like`` tensor's rows hold no other example's data; their other arguments are checked
    before any rule runs; not ``empty_like``, whose memory may hold anything freed)."""
    x = args[0]
    if not _is_tagged(x) or not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return None
    return x._dp_bdim


ELEMENTWISE = [getattr(torch, n, None) for n in (
    "add", "sub", "subtract", "mul", "multiply", "div", "divide", "true_divide", "floor_divide",
    "remainder", "fmod", "pow", "neg", "negative", "abs", "exp", "log", "log1p", "log2", "sqrt",
    "rsqrt", "square", "reciprocal", "sigmoid", "tanh", "relu", "clamp", "clip", "clamp_min",
    "clamp_max", "sign", "round", "floor", "ceil", "trunc", "eq", "ne", "lt", "le", "gt", "ge",
    "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or",
    "bitwise_not", "bitwise_xor", "where", "masked_fill", "minimum", "maximum", "isnan",
    "isfinite", "isinf", "nan_to_num", "lerp")]
ELEMENTWISE += [getattr(torch.Tensor, n, None) for n in (
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod", "pow", "neg",
    "abs", "exp", "log", "log1p", "sqrt", "rsqrt", "square", "reciprocal", "sigmoid", "tanh",
    "relu", "clamp", "clip", "clamp_min", "clamp_max", "sign", "round", "floor", "ceil", "trunc",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not",
    "logical_xor", "bitwise_and", "bitwise_or", "bitwise_not", "bitwise_xor", "where",
    "masked_fill", "minimum", "maximum", "isnan", "isfinite", "isinf", "nan_to_num", "lerp",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__",
    "__rpow__", "__neg__", "__abs__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__",
    "__ge__", "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__invert__")]
# torch.nn.functional's elementwise activations (their own torch functions, not torch's).
ELEMENTWISE += [getattr(torch.nn.functional, n, None) for n in (
    "relu", "relu6", "gelu", "silu", "mish", "sigmoid", "tanh", "hardtanh", "hardsigmoid",
    "hardswish", "leaky_relu", "elu", "selu", "celu", "softplus", "softsign", "logsigmoid",
    "tanhshrink", "threshold")]
ELEMENTWISE_INPLACE = [getattr(torch.Tensor, n, None) for n in (
    "requires_grad_", "detach_", "share_memory_",
    "add_", "sub_", "mul_", "div_", "clamp_", "clip_", "masked_fill_", "pow_", "neg_", "abs_",
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "fill_", "zero_", "nan_to_num_")]


def _broadcast_bdim(args, kwargs, out) -> Optional[int]:
    """The output's batch dim under broadcasting (operands right-aligned), if every tagged operand
    is of one micro-batch and puts its batch dim at that same output position with its own size,
    and every other tensor operand is constant along it (size 1, or a stride-0 expansion) and not
    derived from the batch: an operand that varies along the batch dim without being these
    examples could put another example's data into a row (``x[perm]``, as in mixup), and one
    computed from the batch puts every example's data into every row (``x - x.mean(0)``).
    Constants from elsewhere (normalisation statistics) are the caller's: if they were computed
    from the private data, that is not covered by epsilon."""
    if not isinstance(out, torch.Tensor):
        return None
    leaves = [x for x in _flat(args, kwargs) if isinstance(x, torch.Tensor)]
    tagged = [x for x in leaves if _is_tagged(x)]
    if not tagged or len({id(x._dp_token) for x in tagged}) != 1:
        return None
    b = None
    for x in tagged:
        pos = x._dp_bdim + out.dim() - x.dim()
        if b is not None and pos != b:
            return None
        if pos < 0 or out.shape[pos] != x.shape[x._dp_bdim]:
            return None
        b = pos
    token = tagged[0]._dp_token
    for u in leaves:
        if _is_tagged(u):
            continue
        if is_suspect(u, token):  # from the batch without being it: x - x.mean(0)
            return None
        if varies_along(u, b, out.dim()):
            return None
    return b


_rule(*ELEMENTWISE)(_broadcast_bdim)


@_rule(*ELEMENTWISE_INPLACE, inplace=True)
def _inplace_elementwise(args, kwargs, out) -> bool:
    """In place on a tagged tensor: keeps the tag if the operands are as ``_broadcast_bdim``
    allows (its shape cannot change)."""
    return _broadcast_bdim(args, kwargs, out) == getattr(out, "_dp_bdim", None)


def _index_bdim(x: torch.Tensor, index) -> Optional[int]:
    """Batch dim of ``x[index]``: kept when the batch dim is indexed by a full slice (``:``) and
    no advanced (tensor, list, bool) index is used; dropped otherwise (rows selected or mixed)."""
    idx = index if isinstance(index, tuple) else (index,)
    basic = all(i is None or i is Ellipsis or isinstance(i, (int, slice)) and
                not isinstance(i, bool) for i in idx)
    if not basic:
        return None
    consuming = sum(1 for i in idx if i is not None and i is not Ellipsis)
    if consuming > x.dim() or sum(1 for i in idx if i is Ellipsis) > 1:
        return None
    dim_in, dim_out = 0, 0
    expanded: List[Any] = []
    for i in idx:
        if i is Ellipsis:
            expanded += [slice(None)] * (x.dim() - consuming)
        else:
            expanded.append(i)
    expanded += [slice(None)] * (x.dim() - sum(1 for i in expanded if i is not None))
    for i in expanded:
        if i is None:
            dim_out += 1
            continue
        if dim_in == x._dp_bdim:
            full = isinstance(i, slice) and i == slice(None)
            return dim_out if full else None
        dim_in += 1
        dim_out += 0 if isinstance(i, int) else 1
    return None


@_rule(torch.Tensor.__getitem__)
def _getitem(args, kwargs, out):
    x, index = args[0], args[1]
    if not _is_tagged(x):
        return None
    return _index_bdim(x, index)


@_rule(torch.Tensor.__setitem__, inplace=True)
def _setitem(args, kwargs, out) -> bool:
    """``x[index] = value`` keeps x's tag when no row receives another example's data:

    * no part of the index is computed from the examples (tensors, list entries, slice bounds),
      except x's own elementwise boolean mask as the whole index (``labels[labels == pad]``);
    * the value carries no example's data (a number, a plain tensor: ``-100``, random tokens for
      masked language modelling), at any elements; or it is the same micro-batch's examples,
      written into every row (a full slice on the batch dim) with their batch dim landing on the
      region's (``x[:] = x.t()`` with B = T does not)."""
    x, index, value = args[0], args[1], args[2]
    if not _is_tagged(x):
        return False
    token = x._dp_token
    idx = index if isinstance(index, tuple) else (index,)
    for i in pytree.tree_leaves([[j.start, j.stop, j.step] if isinstance(j, slice) else j
                                 for j in idx]):
        if not isinstance(i, torch.Tensor):
            continue
        if is_suspect(i, token):
            return False
        if _is_tagged(i) and not (len(idx) == 1 and i._dp_token is token and
                                  i.dtype == torch.bool and i.shape == x.shape and
                                  i._dp_bdim == x._dp_bdim):
            return False  # an index from the examples that is not x's own elementwise mask
    if not isinstance(value, torch.Tensor):
        return True
    if is_suspect(value, token):
        return False
    if not _is_tagged(value):
        return True  # data-free values, at any elements
    region_bdim = _index_bdim(x, index)
    return region_bdim is not None and value._dp_token is token and \
        value._dp_bdim + x[index].dim() - value.dim() == region_bdim


@_rule(torch.Tensor.repeat)
def _repeated(args, kwargs, out):
    """``x.repeat(*sizes)`` with factor 1 at the batch dim: each row repeats its own data."""
    x = args[0]
    if not _is_tagged(x):
        return None
    sizes = _variadic(args, kwargs, "repeats")
    b = x._dp_bdim + len(sizes) - x.dim()
    return b if sizes[b] == 1 else None


@_rule(torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.view_as,
       torch.Tensor.reshape_as, torch.Tensor.flatten, torch.flatten, torch.Tensor.unflatten)
def _reshaped(args, kwargs, out):
    """A reshape keeps the logical (row-major) order of elements, so when dim 0 is the batch and
    the output's dim 0 has the same size, output row i holds exactly input row i's elements."""
    x = args[0]
    if not _is_tagged(x) or not isinstance(out, torch.Tensor) or out.dim() == 0:
        return None
    if out.shape == x.shape:
        return x._dp_bdim
    if x._dp_bdim == 0 and out.shape[0] == x.shape[0]:
        return 0
    return None


@_rule(torch.Tensor.unsqueeze, torch.unsqueeze)
def _unsqueezed(args, kwargs, out):
    x = args[0]
    d = args[1] if len(args) > 1 else kwargs["dim"]
    d = _norm_dim(d, out.dim())
    return x._dp_bdim + (1 if d <= x._dp_bdim else 0) if _is_tagged(x) else None


@_rule(torch.Tensor.squeeze, torch.squeeze)
def _squeezed(args, kwargs, out):
    x = args[0]
    if not _is_tagged(x):
        return None
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if dims is None:
        removed = [d for d in range(x.dim()) if x.shape[d] == 1]
    else:
        dims = dims if isinstance(dims, (tuple, list)) else (dims,)
        removed = [_norm_dim(d, x.dim()) for d in dims if x.shape[_norm_dim(d, x.dim())] == 1]
    if x._dp_bdim in removed:
        return None
    return x._dp_bdim - sum(1 for d in removed if d < x._dp_bdim)


@_rule(torch.Tensor.permute, torch.permute)
def _permuted(args, kwargs, out):
    x = args[0]
    if not _is_tagged(x):
        return None
    dims = _variadic(args, kwargs, "dims")
    return [_norm_dim(d, x.dim()) for d in dims].index(x._dp_bdim)


@_rule(torch.Tensor.transpose, torch.transpose, torch.Tensor.swapaxes, torch.swapaxes,
       torch.Tensor.swapdims, torch.swapdims, torch.Tensor.t, torch.t)
def _transposed(args, kwargs, out):
    x = args[0]
    if not _is_tagged(x):
        return None
    if x.dim() < 2:  # t() of a 1-D tensor is itself
        return x._dp_bdim
    if len(args) == 1 and not kwargs:  # t(): dims 0 and 1
        args = (x, 0, 1)
    a = _norm_dim(args[1] if len(args) > 1 else kwargs["dim0"], x.dim())
    b = _norm_dim(args[2] if len(args) > 2 else kwargs["dim1"], x.dim())
    return b if x._dp_bdim == a else a if x._dp_bdim == b else x._dp_bdim


@_rule(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm)
def _matmul(args, kwargs, out):
    """``a @ b`` (both at least 2-D) with the examples on one of the leading dims matmul
    broadcasts, at the same output position for every tagged operand, and an untagged operand
    constant along it (attention's ``q @ k.transpose(-1, -2)`` per example); or on the rows of a
    tagged ``a`` times an untagged matrix ``b`` ([B, d] @ W). Output row i is then example i's
    product alone."""
    a = _argument(args, kwargs, 0, "input")
    b = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
    if not all(isinstance(x, torch.Tensor) and x.dim() >= 2 for x in (a, b, out)):
        return None
    tagged = [x for x in (a, b) if _is_tagged(x)]
    if not tagged or len({id(x._dp_token) for x in tagged}) != 1:
        return None
    token = tagged[0]._dp_token
    if len(tagged) == 1 and tagged[0] is a and a._dp_bdim == a.dim() - 2 and b.dim() == 2:
        return None if is_suspect(b, token) else out.dim() - 2  # rows of a times a matrix
    pos = {x._dp_bdim + out.dim() - x.dim() for x in tagged if x._dp_bdim < x.dim() - 2}
    if len(pos) != 1 or len(tagged) != sum(1 for x in tagged if x._dp_bdim < x.dim() - 2):
        return None
    (p,) = pos
    if any(out.shape[p] != x.shape[x._dp_bdim] for x in tagged):
        return None
    for u in (a, b):
        if not _is_tagged(u) and (is_suspect(u, token) or varies_along(u, p, out.dim())):
            return None
    return p


@_rule(torch.nn.functional.dropout, torch.dropout, torch.nn.functional.dropout1d,
       torch.nn.functional.dropout2d, torch.nn.functional.dropout3d,
       torch.nn.functional.alpha_dropout, torch.alpha_dropout,
       torch.nn.functional.feature_alpha_dropout)
def _dropped(args, kwargs, out):
    """Dropout: each element (or channel) scaled by a mask drawn independently of the data, so
    every output element is its own input element's, row for row."""
    x = args[0]
    if not _is_tagged(x) or not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return None
    return x._dp_bdim


@_rule(torch.nn.functional.linear, torch.nn.functional.embedding)
def _per_row_layer(args, kwargs, out):
    """A frozen layer applied to the examples (a plain ``nn.Linear`` or ``nn.Embedding`` whose
    parameters dpzero does not train): ``linear`` over the last dim and ``embedding`` per id keep
    every other dim row for row, when the weight and bias are not from the batch."""
    x = _argument(args, kwargs, 0, "input")
    if not _is_tagged(x) or not isinstance(out, torch.Tensor):
        return None
    if _embedding_renorms(args, kwargs):
        return None  # the looked-up rows of the weight were rewritten from these ids
    rest = list(args[1:3]) + [kwargs.get(k) for k in ("weight", "bias")]
    if any(_is_tagged(u) or is_suspect(u, x._dp_token) for u in rest
           if isinstance(u, torch.Tensor)):
        return None
    linear = out.dim() == x.dim()
    if linear and x._dp_bdim == x.dim() - 1:
        return None  # the examples on the features: every output mixes them
    return x._dp_bdim


@_rule(torch.Tensor.expand, torch.Tensor.expand_as, torch.broadcast_to,
       torch.Tensor.broadcast_to)
def _expanded(args, kwargs, out):
    x = args[0]
    if not _is_tagged(x):
        return None
    b = x._dp_bdim + out.dim() - x.dim()
    return b if out.shape[b] == x.shape[x._dp_bdim] else None


@_rule(torch.cat, torch.concat, torch.concatenate)
def _catted(args, kwargs, out):
    """Concatenation along another dim than the batch's (prompt tokens before the inputs): the
    other operands must be constant along the batch dim (an expanded shared tensor)."""
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
    tagged = [t for t in tensors if _is_tagged(t)]
    if not tagged or len({id(t._dp_token) for t in tagged}) != 1:
        return None
    b = tagged[0]._dp_bdim
    if any(t._dp_bdim != b for t in tagged) or _norm_dim(dim, out.dim()) == b:
        return None
    for u in tensors:
        if not _is_tagged(u) and is_suspect(u, tagged[0]._dp_token):
            return None
        if not _is_tagged(u) and varies_along(u, b, out.dim()):
            return None
    return b


@_rule(torch.stack)
def _stacked(args, kwargs, out):
    tensors = args[0]
    dim = _norm_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), out.dim())
    if not tensors or not all(_is_tagged(t) for t in tensors):
        return None
    if len({id(t._dp_token) for t in tensors}) != 1 or len({t._dp_bdim for t in tensors}) != 1:
        return None
    b = tensors[0]._dp_bdim
    return b + 1 if dim <= b else b


@_rule(torch.Tensor.split, torch.split, torch.Tensor.chunk, torch.chunk,
       torch.Tensor.tensor_split, torch.tensor_split, torch.Tensor.unbind, torch.unbind)
def _pieces(args, kwargs, out):
    """Pieces along a dim other than the batch's each keep it (unbind removes its dim)."""
    x = args[0]
    if not _is_tagged(x) or not isinstance(out, (tuple, list)) or not out:
        return None
    if out[0].dim() < x.dim():  # unbind(x, dim)
        d = _norm_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), x.dim())
        if d == x._dp_bdim:
            return None
        return [x._dp_bdim - (1 if d < x._dp_bdim else 0)] * len(out)
    d = _norm_dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), x.dim())
    return None if d == x._dp_bdim else [x._dp_bdim] * len(out)


def _reduced(args, kwargs, out):
    """A reduction over dims other than the batch's (``mask.sum(-1)``, ``x.mean(dim=1)``): each
    row of the output is a function of the same row of the input."""
    x = args[0]
    if not _is_tagged(x) or not isinstance(out, torch.Tensor):
        return None
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None or isinstance(dim, (tuple, list)) and not dim:  # dim=() reduces all dims
        return None
    dims = sorted({_norm_dim(d, x.dim()) for d in (dim if isinstance(dim, (tuple, list))
                                                   else (dim,))})
    if x._dp_bdim in dims:
        return None
    keep = kwargs.get("keepdim", args[2] if len(args) > 2 and isinstance(args[2], bool) else False)
    if out.dim() == x.dim() or keep:  # cumulative or keepdim
        return x._dp_bdim
    return x._dp_bdim - sum(1 for d in dims if d < x._dp_bdim)


_rule(*[f for n in ("sum", "mean", "amax", "amin", "any", "all", "cumsum", "cumprod",
                    "softmax", "log_softmax", "argmax", "argmin", "count_nonzero", "logsumexp")
        for f in (getattr(torch, n, None), getattr(torch.Tensor, n, None))],
      torch.nn.functional.softmax, torch.nn.functional.log_softmax)(_reduced)


@_rule(torch.nn.functional.one_hot)
def _one_hot(args, kwargs, out):
    x = args[0]
    return x._dp_bdim if _is_tagged(x) else None


@_rule(torch.nn.functional.pad)
def _padded(args, kwargs, out):
    """F.pad pads the last len(pad) / 2 dims; the batch dim must not be one of them."""
    x = args[0]
    if not _is_tagged(x):
        return None
    pad = args[1] if len(args) > 1 else kwargs["pad"]
    if x._dp_bdim >= x.dim() - len(pad) // 2:
        return None
    return x._dp_bdim
