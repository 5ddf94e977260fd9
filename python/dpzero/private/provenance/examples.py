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
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from ..losses import check_loss
from .registry import ESCAPES, FACTORIES, INPLACE, METADATA, RULES

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
        # A Poisson micro-batch's row count follows the sampled batch size, which is private
        # (refusals quote this); the caller's own batches' sizes are the caller's.
        rows = f"{self.rows} rows, " if self.sampling == "caller" else ""
        return f"micro-batch {self.index} of step {self.step} ({rows}{self.sampling} sampling)"


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
    """A tensor derived from micro-batch ``dp_taint``'s examples. While it is *tagged*
    (``dp_token`` is that micro-batch, ``dp_version`` its version when tagged), dimension
    ``dp_bdim`` indexes the examples, one per row, in the loader's order (Note [batch
    provenance]); once an operation may have mixed its rows the tag is withdrawn (``dp_token``
    None) and it stays *tainted*: combined with tagged tensors it withdraws their tag too (the
    batch's mean, a row of another example). Behaves as a plain tensor; the model's forward
    receives plain tensors (the root unwraps them)."""

    dp_bdim: int
    dp_token: Optional[MicroBatchToken]
    dp_taint: Optional[MicroBatchToken]
    dp_version: int

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
        check_loss(func, args, kwargs)  # Note [losses that couple examples]
        with torch._C.DisableTorchFunctionSubclass():
            # Operands whose memory changed unseen lose their tag before anything reads them (an
            # in-place write a rule vouches for then never vouches for an earlier unseen one).
            _valid(args, kwargs)
            before = args[0]._version if func in INPLACE and is_tagged(args[0]) else None
            out = func(*args, **kwargs)
            if func in METADATA:
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
    x.dp_token = None


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
    if func in ESCAPES:  # memory handed to code whose writes dpzero cannot see
        if _in_dynamo():
            raise RuntimeError(
                "a torch.compile'd function received the private loader's tensors (Note "
                "[compiled private models] in engine.py): compilation reads their memory in "
                "ways the examples' tag cannot follow. Call the private model and the loss "
                "outside the compiled function; torch.compile of the private model itself runs "
                "it eagerly")
        for x in flat_args(args, kwargs):
            if isinstance(x, Examples):
                taint.escaped[storage_id(x)] = x.untyped_storage()
                _withdraw(x)
    for x in leaves(kwargs.get("out")):  # an out= target: whatever was written
        if isinstance(x, Examples):
            _withdraw(x)
        elif isinstance(x, torch.Tensor):
            holds_examples(x, taint)
    target = args[0] if args and isinstance(args[0], torch.Tensor) else None
    name = getattr(func, "__name__", "")
    inplace = func in INPLACE or (name.endswith("_") and not name.endswith("__"))
    if inplace and target is not None and not isinstance(target, Examples):
        holds_examples(target, taint)  # u.copy_(x), u.add_(x): u now holds example data
    if inplace and args and isinstance(args[0], (list, tuple)):  # _foreach_copy_([u], [x])
        for u in args[0]:
            if isinstance(u, torch.Tensor) and not isinstance(u, Examples):
                holds_examples(u, taint)
    if func is torch.nn.functional.embedding and embedding_renorms(args, kwargs):
        holds_examples(arg_of(args, kwargs, 1, "weight"), taint)
    # An operand computed from the examples without being them (or aliasing memory handed out)
    # makes the result so too, whatever the rule would say (full_like(x, x.mean()), F.pad(x, p,
    # value=x.mean()), x.new_full(s, x.mean())).
    suspect = any(is_suspect(a, taint) for a in flat_args(args, kwargs))
    if func in FACTORIES and not suspect:  # x.new_zeros(...): nothing of x but its dtype
        return out
    rule = RULES.get(func) if not suspect else None
    if rule is None:
        # An operation without a rule that wrote into a tagged tensor (an in-place method: it
        # returns that tensor) may have mixed its rows: withdrawn.
        for x in pytree.tree_leaves(out):
            if isinstance(x, Examples):
                _withdraw(x)
        if inplace and isinstance(target, Examples):
            _withdraw(target)
        return _tainted(func, args, kwargs, out, taint)
    if func in INPLACE:  # modifies args[0] (returned, or None for __setitem__)
        if is_tagged(target):
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
            t.dp_token, t.dp_bdim, t.dp_taint, t.dp_version = None, -1, taint, -1


def untag(x: torch.Tensor) -> None:
    """Undoes :func:`holds_examples` on a plain tensor turned into a tainted Examples in place
    (module state the probe's forward wrote, restored after it)."""
    if type(x) is Examples:
        x.__class__ = torch.Tensor
        for attr in ("dp_token", "dp_bdim", "dp_taint", "dp_version"):
            x.__dict__.pop(attr, None)


def arg_of(args, kwargs, index: int, name: str):
    return args[index] if len(args) > index else kwargs.get(name)


def embedding_renorms(args, kwargs) -> bool:
    """F.embedding(input, weight, padding_idx, max_norm, ...) with max_norm renormalises the
    looked-up rows of its weight in place."""
    return arg_of(args, kwargs, 3, "max_norm") is not None


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
    if isinstance(t, Examples) and getattr(t, "dp_taint", None) is not None:
        return t  # an input handed back (an in-place op): already tagged or tainted
    e = t.as_subclass(Examples)
    e.dp_token, e.dp_bdim, e.dp_taint, e.dp_version = None, -1, taint, -1
    return e


def wrap(t: torch.Tensor, bdim: int, token: Optional[MicroBatchToken]) -> torch.Tensor:
    if token is None:
        return t
    e = t.as_subclass(Examples)
    e.dp_bdim, e.dp_token, e.dp_taint, e.dp_version = bdim, token, token, e._version
    return e


def is_tagged(x) -> bool:
    return isinstance(x, Examples) and getattr(x, "dp_token", None) is not None


def _intact(x: "Examples") -> bool:
    """A tagged tensor whose memory holds what the tag vouches for: not written since it was
    tagged, or last written by a write a rule vouched for (through any view of the memory), and
    not handed to code that writes unseen."""
    token, storage = x.dp_token, storage_id(x)
    if storage in token.escaped:
        return False
    return x._version == x.dp_version or x._version == token.vouched.get(storage, (None,))[0]


def _vouch(x: "Examples") -> None:
    x.dp_version = x._version
    x.dp_token.vouched[storage_id(x)] = (x._version, x.untyped_storage())


def is_suspect(a, token: MicroBatchToken) -> bool:
    """An operand that carries the examples' data without being them: tainted, or a plain
    tensor aliasing memory of theirs that was handed out (torch.from_numpy(stat.numpy()))."""
    if isinstance(a, Examples):
        return _is_tainted(a)
    return isinstance(a, torch.Tensor) and bool(token.escaped) and storage_id(a) in token.escaped


def _valid(args, kwargs) -> None:
    """Withdraws the tag of every operand that is no longer intact, before a rule reads it: a
    copy must not inherit a tag its source lost (CutMix through a view, then x * 1.0)."""
    for x in flat_args(args, kwargs):
        if is_tagged(x) and not _intact(x):
            _lost.op = ("an in-place write that no rule vouches for, or memory handed to "
                        ".data, numpy or DLPack", x.dp_token)
            _withdraw(x)


def _is_tainted(x) -> bool:
    """Derived from a micro-batch's examples but not (any more) one of its tagged tensors."""
    return isinstance(x, Examples) and getattr(x, "dp_taint", None) is not None \
        and not is_tagged(x)


def _taint_of(args, kwargs) -> Optional[MicroBatchToken]:
    return next((x.dp_taint for x in flat_args(args, kwargs)
                 if isinstance(x, Examples) and getattr(x, "dp_taint", None) is not None), None)


def _tensors_in(obj) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in leaves(obj))


def flat_args(args, kwargs) -> List[Any]:
    return leaves((args, kwargs))


# Note [flat arguments]
# ~~~~~~~~~~~~~~~~~~~~~
# Every operation on a tagged tensor asks for its arguments' leaves (which hold the examples, which
# are tainted), so ``leaves`` decides which operands the rules see: a tensor it missed would be an
# operand whose examples no rule looked at. It returns pytree's leaves (``tree_leaves``: the same
# walk of tuples, lists, sizes, dicts, namedtuples and every registered node, in the same order),
# with one difference: a list or tuple subclass that pytree does not know is a leaf to pytree, but
# torch reads it as the list of tensors it holds (``torch.stack(MyList([x]))``, ``torch.cat``), so
# ``leaves`` opens it too: otherwise a batch statistic computed in the training loop as
# ``torch.stack(MyList([x])).mean(1)`` would come out neither tagged nor tainted, and the model
# would take it as an input shared by the batch. (``tag`` refuses a batch holding tensors in such
# a class, whose rows it could not tag.) The walk of the common containers is its own, cheaper
# than pytree's generic one on a path every op on the examples takes; every other node is
# flattened by pytree's own flatten function for it.
# tests/python/test_provenance.py compares ``leaves`` with pytree's on every kind of node.
_LEAF_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, complex, str,
                         type(None), type(...), slice, torch.dtype, torch.device, torch.layout,
                         torch.memory_format})
assert not _LEAF_TYPES & set(pytree.SUPPORTED_NODES)
_SEQUENCES = (tuple, list, torch.Size)  # pytree flattens each to its elements, in order
assert pytree.tree_leaves(torch.Size([2, 3])) == [2, 3]


def leaves(tree) -> List[Any]:
    """``pytree.tree_leaves(tree)``, list and tuple subclasses opened (Note [flat arguments])."""
    out: List[Any] = []
    _flatten(tree, out)
    return out


def _flatten(x, out: List[Any]) -> None:
    t = type(x)
    if t in _LEAF_TYPES or t is Examples:
        out.append(x)
    elif t in _SEQUENCES:
        for v in x:
            _flatten(v, out)
    elif t is dict:
        for v in x.values():
            _flatten(v, out)
    else:
        node = pytree._get_node_type(x)  # a namedtuple's or structseq's kind, else its type
        if node in pytree.SUPPORTED_NODES:
            for v in pytree.SUPPORTED_NODES[node].flatten_fn(x)[0]:
                _flatten(v, out)
        elif isinstance(x, (list, tuple)):  # a sequence pytree would keep whole
            for v in x:
                _flatten(v, out)
        else:
            out.append(x)


def _token_of(args, kwargs) -> Optional[MicroBatchToken]:
    tokens = {id(x.dp_token): x.dp_token for x in flat_args(args, kwargs) if is_tagged(x)}
    return next(iter(tokens.values())) if len(tokens) == 1 else None


def tag(batch, token: MicroBatchToken):
    """``batch`` (a tensor or a nested tuple / list / dict of them) with every tensor of at least
    one dimension tagged as the examples of ``token`` on dim 0 (0-dim tensors stay plain)."""
    def one(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            if x.shape[0] != token.rows:
                # No sizes: a Poisson micro-batch's row count is private (Note [released
                # figures]); the caller's own batch sizes are the caller's.
                sizes = (f" ({x.shape[0]} rows for {token.rows} examples)"
                         if token.sampling == "caller" else "")
                raise ValueError(f"a tensor of the micro-batch ({x.dim()} dims) does not have "
                                 f"one row per example on dim 0{sizes}: every tensor of a batch "
                                 "holds one row per example on dim 0")
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
    # Note [flat arguments]: a list or tuple subclass pytree keeps whole would carry its tensors
    # past the tag untagged; the rows of what they hold could not be followed.
    hidden = sorted({type(leaf).__name__ for leaf in pytree.tree_leaves(batch)
                     if isinstance(leaf, (list, tuple))
                     and any(isinstance(v, torch.Tensor) for v in leaves(leaf))})
    if hidden:
        raise ValueError(f"the batch holds tensors inside {', '.join(hidden)}, a list or tuple "
                         "subclass that torch.utils._pytree keeps whole, so they could not be "
                         "tagged as the examples; return plain tuples, lists or dicts from the "
                         "collate function (or register the class with torch.utils._pytree)")
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
            if is_tagged(leaf) and not _intact(leaf):
                problem = problem or (
                    f"model input {i} was written since the loader handed it out in a way no "
                    "rule vouches for (through another view of its memory, "
                    "x[:, a:].copy_(x[perm, a:]), or through .data, numpy or DLPack)")
                _withdraw(leaf)
            elif is_tagged(leaf):
                found.append((i, leaf.dp_bdim, leaf.dp_token))
            elif getattr(leaf, "dp_taint", None) is not None and problem is None:
                problem = (f"model input {i} is computed from the examples of "
                           f"{leaf.dp_taint!r} without being one row per example of the "
                           "current micro-batch (a batch statistic, a selection or mixture of "
                           "rows): every row it touches would carry several examples")
            leaves[i] = leaf.as_subclass(torch.Tensor)
    return pytree.tree_unflatten(leaves, spec), found, problem
