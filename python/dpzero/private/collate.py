"""The collate function under the model's contract: each example's row of the collated batch is
that example collated alone.

Note [separable collate]
~~~~~~~~~~~~~~~~~~~~~~~~
The private loader tags a micro-batch's tensors as the examples, one per row (Note [batch
provenance] in provenance/examples.py), after the collate function made them. Whatever that function
does across examples is invisible to the tag: per-batch standardisation ``(x - x.mean(0)) /
x.std(0)`` puts every example into every row, and a privacy review measured it at 3.80C (N = 16) and
8.80C (N = 64) against the replace-one bound 2C. So the loader holds every collated batch of a
collate function it cannot vouch for to what the tag assumes: row i of every tensor equals example i
collated alone, bit for bit, and so does every other per-example field (a list of strings, numbers).
Beyond the extent of the example alone (dynamic padding to the longest example)
each tensor holds one constant per field, the same in every row and in every batch of the run
(the padding value: a pad id, 0 in an attention mask, -100 in labels). Padding goes after the
example (right padding); an example moved by the others' lengths (left padding) is refused. A
batch that breaks any of this is refused before the loader hands it out, naming the collate
function, the field and the row. torch's ``default_collate`` and dpzero's own stack the examples
(one row each by construction) and are not checked.

The check holds for a function of its arguments alone, so it makes the collate function one:
every call gets copies of the examples (a collate function that changes the examples it is
given, say subtracting the batch's mean in place after stacking, would otherwise change the
dataset that later batches read), each example is collated alone first, and the collate
function's own state must be the same after every call, each example's alone and the batch's, as
before the batch (one that fits statistics on a batch and applies them to the next carries one
batch's examples into another's rows; one whose state one example's call changes and the next
one's reads couples the rows the batch then reproduces). Its state is what ``_state`` reaches: the
function's attributes and slots, the cells and globals it reads, and so on down through the
helper functions, classes and modules of the caller's own code and the globals their methods
read; containers, tensors (and attributes set on them), arrays, byte buffers, generators' frames
and weak references' referents by their contents; state more than eight levels down by its
pickled bytes where it pickles. Objects of compiled libraries without Python attributes,
unpicklable state below eight levels and what Python cannot show (an lru_cache's entries) are
the library's or out of reach, and summarised by identity. Hugging Face
tokenizers' record of the warnings they gave once is not state: it holds fixed names, whatever
the data. A collate function that draws random numbers for the batch (masked language
modelling's masks) gives each example draws that depend on the others' number and lengths; it
fails the row check, and the refusal says to draw per example instead.

What remains of dynamic padding: the padded length itself is the longest example's, so a model
that reads the padding positions (pools over all positions without the mask, or gives positions
a meaning relative to the padded end) lets one example's length reach the others' outputs. Use
the attention mask everywhere the model reduces over positions, or pad to a fixed length.
"""

from __future__ import annotations

import array
import collections
import copy
import functools
import hashlib
import io
import logging
import os
import pickle
import random
import sys
import sysconfig
import types
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Dict, Optional, Sequence

import torch
from torch.utils import _pytree as pytree
from torch.utils.data._utils.collate import default_collate

from .errors import PrivacyViolation

# Levels of the collate function's state ``_state`` walks; deeper state is pickled.
_DEPTH = 8


def _copy_example(example: Any) -> Any:
    """A deep copy of one example whose tensors are copied element by element. copy.deepcopy of
    a tensor that views a larger one copies the whole storage: an example sliced from a dataset
    held in one tensor (TensorDataset, an image array) would copy the dataset once per example
    and batch."""
    memo: Dict[int, Any] = {}
    for leaf in pytree.tree_leaves(example):
        if isinstance(leaf, torch.Tensor) and id(leaf) not in memo:
            memo[id(leaf)] = leaf.detach().clone().requires_grad_(leaf.requires_grad)
    return copy.deepcopy(example, memo)


class SeparableCollate:
    """``collate`` with every batch checked by Note [separable collate] (picklable, for
    DataLoader workers). ``vouched``: a collate function that stacks by construction (not
    checked)."""

    def __init__(self, collate: Callable, vouched: bool = False) -> None:
        self.collate = collate
        self.vouched = vouched or collate is default_collate
        self.pads: Dict[str, Any] = {}  # field path -> its padding value, the first one seen

    def __call__(self, examples: Sequence[Any]):
        if self.vouched:
            return self.collate(examples)
        before = _state(self.collate)
        # Every call, the batch's too, gets copies: what the function writes into its
        # arguments stays in them, never in the dataset that later batches read.
        if len(examples) <= 1:  # its row is the example collated alone; its state must hold
            batch = self.collate([_copy_example(e) for e in examples])
            if _state(self.collate) != before:
                raise PrivacyViolation(self._learned())
            return batch
        alone = []
        for e in examples:
            alone.append(self.collate([_copy_example(e)]))
            # After each call, not only after the batch: state changed by one example's call
            # and read by the next one's would couple the rows the batch then reproduces.
            if _state(self.collate) != before:
                raise PrivacyViolation(self._learned())
        drawn = torch.random.get_rng_state(), random.getstate()
        batch = self.collate([_copy_example(e) for e in examples])
        draws = not (torch.equal(drawn[0], torch.random.get_rng_state()) and
                     drawn[1] == random.getstate())
        name = self._name()
        if _state(self.collate) != before:
            raise PrivacyViolation(self._learned())
        for i, one in enumerate(alone):
            problem = self._row(batch, one, i, len(examples), "batch")
            if problem is not None:
                raise PrivacyViolation(
                    f"the collate function {name!r} couples the examples of a batch: {problem} "
                    "(Note [separable collate]). Each example's row must be that example "
                    "collated alone (padding after it excepted), or the examples' data reaches "
                    "each other's rows before the model: make per-example transforms part of "
                    "the dataset, and batch-wide ones (normalisation statistics) constants "
                    "computed without the training data" + (
                        ". It draws random numbers for the whole batch (masking, augmentation), "
                        "so an example's draws depend on the others (their number and lengths): "
                        "draw them per example, in the dataset's __getitem__ or in the training "
                        "loop (torch.rand_like on the batch)" if draws else ""))
        return batch

    def _name(self) -> str:
        return getattr(self.collate, "__qualname__", None) or type(self.collate).__name__

    def _learned(self) -> str:
        return (f"the collate function {self._name()!r} changed its own state while collating "
                "a batch (Note [separable collate]): a collate function that learns from one "
                "batch (normalisation statistics, a vocabulary) carries its examples into the "
                "rows of the next. Fit such state before training, without the training data")

    def _row(self, batch, alone, i: int, rows: int, path: str) -> Optional[str]:
        """Why row ``i`` of ``batch`` is not ``alone`` (example i collated alone), or None."""
        if isinstance(batch, torch.Tensor):
            if not isinstance(alone, torch.Tensor):
                return f"{path} is a tensor in the batch but not for the example alone"
            return self._tensor_row(batch, alone, i, rows, path)
        if isinstance(batch, Mapping):
            if not isinstance(alone, Mapping) or set(batch) != set(alone):
                return f"{path} has other fields for the example alone"
            for key in batch:
                problem = self._row(batch[key], alone[key], i, rows, f"{path}[{key!r}]")
                if problem is not None:
                    return problem
            return None
        if isinstance(batch, (list, tuple)):
            if not isinstance(alone, (list, tuple)):
                return f"{path} is a sequence in the batch but not for the example alone"
            if len(batch) == len(alone):  # fields
                for k, (b, a) in enumerate(zip(batch, alone)):
                    problem = self._row(b, a, i, rows, f"{path}[{k}]")
                    if problem is not None:
                        return problem
                return None
            if len(batch) == rows and len(alone) == 1:  # one entry per example
                return self._row(batch[i], alone[0], i, rows, f"{path}[{i}]")
            return (f"{path} does not hold one entry per example ({len(alone)} for an example "
                    "alone)")
        try:
            same = bool(batch == alone)
        except Exception:  # noqa: BLE001 - objects without a usable ==
            same = batch is alone
        return None if same else (f"{path} differs between the batch and example {i} alone (a "
                                  "value computed from the whole batch)")

    def _tensor_row(self, batch: torch.Tensor, alone: torch.Tensor, i: int, rows: int,
                    path: str) -> Optional[str]:
        with torch._C.DisableTorchFunctionSubclass():
            if batch.dim() == 0 and alone.dim() == 0:  # a value of the batch as a whole
                return None if _same(batch, alone) else (
                    f"{path} differs between the batch and example {i} alone (a value computed "
                    "from the whole batch)")
            if batch.dim() == 0 or batch.shape[0] != rows or alone.dim() != batch.dim() or \
                    alone.shape[0] != 1:
                return (f"{path} ({batch.dim()} dims) is not one row per example: its dim 0 "
                        "must hold the examples, and an example collated alone must give dim 0 "
                        "of size 1")
            if any(a > b for a, b in zip(alone.shape[1:], batch.shape[1:])):
                return (f"{path} of example {i} alone is larger than its row in the batch (cut "
                        "by the other examples)")
            row, own = batch[i], alone[0]
            region = tuple(slice(0, n) for n in own.shape)
            if not _same(row[region], own):
                return (f"row {i} of {path} differs from example {i} collated alone (per-batch "
                        "statistics, or padding before the example)")
            if own.shape == row.shape:
                return None
            pad = torch.ones(row.shape, dtype=torch.bool, device=row.device)
            pad[region] = False
            values = row[pad].unique()
            if values.numel() != 1:
                return (f"row {i} of {path} holds several different values past example {i}'s "
                        "own extent; padding is one constant")
            value = values.item()
            first = self.pads.setdefault(path, value)
            if not (first == value or (first != first and value != value)):  # NaN pads
                return (f"{path} is padded with another value here than before; a padding "
                        "value that changes follows the data")
            return None


def _state(obj, depth: int = _DEPTH, memo: Optional[Dict[int, int]] = None):
    """A comparable summary of the state ``obj`` carries from call to call: for a function, its
    closure cells, defaults and the globals it reads (through the caller's own helper functions
    and classes); for a bound method, its object too; for an object, its attributes and slots
    (and, for a class of the caller's own code, its class's data attributes and the globals its
    methods read); tensors, arrays and ``array.array`` by their bytes, deques as sequences;
    objects of compiled libraries without attributes by identity. An object met again (a cycle,
    a shared helper) is summarised by the order it was first met in. State nested more than
    ``depth`` levels down is summarised by its pickled bytes, or refused."""
    if isinstance(obj, torch.Tensor):
        with torch._C.DisableTorchFunctionSubclass():
            extra = getattr(obj, "__dict__", None)  # attributes set on the tensor
            return ("tensor", str(obj.dtype), tuple(obj.shape),
                    hashlib.blake2b(obj.detach().cpu().contiguous().numpy().tobytes()
                                    if obj.dtype != torch.bfloat16 else
                                    obj.detach().cpu().float().numpy().tobytes(),
                                    digest_size=16).hexdigest(),
                    _state(extra, depth - 1, memo) if extra and depth > 0 else None)
    if isinstance(obj, (str, bytes, int, float, complex, bool, type(None))):
        return obj
    if isinstance(obj, (logging.Logger, logging.Manager, logging.PlaceHolder)):
        # By name: a logger's state is its configuration and a cache of which levels are enabled
        # (filled by the first check of a level, whatever the data), not anything of a batch.
        return ("logger", getattr(obj, "name", type(obj).__name__))
    if isinstance(obj, (bytearray, memoryview)):
        return (type(obj).__name__, hashlib.blake2b(bytes(obj), digest_size=16).hexdigest())
    if isinstance(obj, io.BytesIO):
        return ("BytesIO", hashlib.blake2b(obj.getvalue(), digest_size=16).hexdigest(),
                obj.tell())
    if getattr(obj, "dtype", None) is not None and getattr(obj.dtype, "hasobject", False):
        return ("object array", getattr(obj, "shape", ()),  # tobytes would give pointers
                _state(obj.tolist(), depth - 1, memo) if depth > 0 else _pickled(obj))
    if hasattr(obj, "tobytes") and (hasattr(obj, "dtype") or isinstance(obj, array.array)):
        return ("array", str(getattr(obj, "dtype", getattr(obj, "typecode", None))),
                getattr(obj, "shape", ()), hashlib.blake2b(obj.tobytes(),
                                                           digest_size=16).hexdigest())
    if depth == 0:
        return _pickled(obj)
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return ("met", memo[id(obj)])
    memo[id(obj)] = len(memo)

    def inner(x, down: int = 1):
        return _state(x, depth - down, memo)

    if isinstance(obj, (dict, list, tuple)) and len(obj) > 64:
        kinds = set(map(type, obj)) | (set(map(type, obj.values())) if isinstance(obj, dict)
                                       else set())
        if kinds <= _PLAIN:  # a vocabulary: summarised at C speed
            return (type(obj).__name__, len(obj),
                    hash(tuple(obj.items()) if isinstance(obj, dict) else tuple(obj)))
    if isinstance(obj, dict):
        return tuple((repr(k), inner(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        return (type(obj).__name__, tuple(inner(v) for v in items))
    if isinstance(obj, types.MethodType):
        return (inner(obj.__func__, 0), inner(obj.__self__))
    if isinstance(obj, types.FunctionType):
        cells = tuple(inner(c.cell_contents) if c.cell_contents is not None else None
                      for c in (obj.__closure__ or ()))
        read = [(n, obj.__globals__[n]) for n in sorted(_names(obj.__code__))
                if n in obj.__globals__]
        read = [(n, v) for n, v in read if not isinstance(v, (types.ModuleType, type,
                                                                types.FunctionType)) or
                _users(v)]  # a helper or class of the caller's own code is followed
        return ("function", obj.__qualname__, cells, inner(obj.__defaults__),
                tuple((n, inner(v)) for n, v in read))
    if isinstance(obj, types.ModuleType):  # a module of the caller's own code: its globals
        if not _users(obj):
            return ("module", obj.__name__)  # a library's: its own to keep
        return ("module", obj.__name__, tuple(
            (n, inner(v)) for n, v in sorted(vars(obj).items()) if not n.startswith("__") and
            (not isinstance(v, (types.ModuleType, type, types.FunctionType)) or _users(v))))
    if isinstance(obj, types.GeneratorType):  # its suspended frame's locals
        frame = obj.gi_frame
        return ("generator", obj.__qualname__, inner(dict(frame.f_locals)) if frame else None)
    if isinstance(obj, weakref.ref):
        return ("weakref", inner(obj()), inner(getattr(obj, "key", None)))
    if isinstance(obj, functools.partial):
        return ("partial", inner(obj.func, 0), inner(obj.args), inner(obj.keywords))
    if isinstance(obj, type):  # a class of the caller's own code: data and methods' globals
        own = [k for k in obj.__mro__ if _users(k)]
        return ("class", obj.__qualname__, tuple(
            (k.__qualname__, n, inner(v)) for k in own
            for n, v in vars(k).items() if not n.startswith("__") and not callable(v) and
            not isinstance(v, (property, staticmethod, classmethod))), tuple(
            (k.__qualname__, n, inner(f, 0)) for k in own
            for n, v in vars(k).items() for f in _functions(v)))
    try:  # past a __getattribute__ that hides it
        state = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        state = None
    if isinstance(state, dict) and type(obj).__module__.startswith("transformers.") and \
            "deprecation_warnings" in state:
        # Hugging Face tokenizers record the warnings they gave once (fixed names in
        # transformers' code, True once given): the first padding call adds one, whatever the data.
        state = {k: v for k, v in state.items() if k != "deprecation_warnings"}
    slots = [n for k in type(obj).__mro__ for n in _slots(k) if hasattr(obj, n)]
    if not isinstance(state, dict) and not slots:
        return (type(obj).__qualname__, id(obj))
    return (type(obj).__qualname__, inner(state) if isinstance(state, dict) else None,
            tuple((n, inner(getattr(obj, n))) for n in slots),
            inner(type(obj)) if _users(type(obj)) else None)


_PLAIN = {str, bytes, int, float, bool, type(None)}


def _functions(v) -> Sequence[types.FunctionType]:
    """The functions a class attribute holds (a method, a static or class method, a property's
    accessors)."""
    if isinstance(v, (staticmethod, classmethod)):
        v = v.__func__
    if isinstance(v, property):
        return [f for f in (v.fget, v.fset, v.fdel) if isinstance(f, types.FunctionType)]
    return [v] if isinstance(v, types.FunctionType) else []


def _pickled(obj):
    """State nested deeper than ``_state`` walks: its pickled bytes, which hold all of it; by
    identity if it cannot be pickled (a lock, a logger's handlers: library machinery)."""
    try:
        data = pickle.dumps(obj, protocol=4)
    except Exception:  # noqa: BLE001 - whatever pickling an arbitrary object raises
        return (type(obj).__qualname__, id(obj))
    return ("pickled", type(obj).__qualname__, hashlib.blake2b(data, digest_size=16).hexdigest())


def _slots(cls: type) -> Sequence[str]:
    names = cls.__dict__.get("__slots__", ())
    names = (names,) if isinstance(names, str) else names
    return [n for n in names if n not in ("__dict__", "__weakref__")]


def _names(code: types.CodeType) -> set:
    """The global names ``code`` and the functions nested in it read."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return names


_LIBRARIES = tuple(os.path.realpath(p) + os.sep for p in {
    sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def _users(obj) -> bool:
    """Whether the function or class ``obj`` is the caller's own code (not the standard library
    or an installed package): its state is followed, a library's is not (it is the library's to
    keep per call, and following torch's would cost more than the collate)."""
    if isinstance(obj, types.ModuleType):
        return _users_module(obj.__name__)
    if not isinstance(obj, (type, types.FunctionType)):
        return False
    return _users_module(getattr(obj, "__module__", None) or "")


@functools.lru_cache(maxsize=None)
def _users_module(name: str) -> bool:
    if name == "dpzero" or name.startswith("dpzero."):
        return False  # a library too, wherever it is installed from
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if module is None or path is None:
        return name == "__main__"
    return not os.path.realpath(path).startswith(_LIBRARIES)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values bit for bit (NaN where NaN)."""
    if a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        both_nan = torch.isnan(a) & torch.isnan(b)
        return bool(((a == b) | both_nan).all())
    return torch.equal(a, b)
