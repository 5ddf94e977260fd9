"""Module state the private optimizer does not write: buffers and frozen parameters, fingerprinted
when the model is attached and verified at every step and at every release.

Note [state written from data]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
ε covers the noisy updates of the trainable parameters. Every other tensor a module holds, its
buffers and its frozen parameters, is released with the model too (``state_dict()``,
checkpoints, a Trainer's saves, ``dpzero train``'s model) and is read by every later forward. A
forward that writes something computed from the training batch into such a tensor (an EMA of the
batch mean, VQ-VAE's codebook, BatchNorm's running statistics, a counter of forward calls, which
follows the realised Poisson batch sizes) releases it without noise and lets one example reach
every later step's gradients outside the clipping. Nothing legitimate under DP writes them, so
dpzero holds them fixed:

* when the model is attached, every buffer is copied (buffers are small), and every frozen
  parameter's identity, a fingerprint computed on its device (``fingerprint``) and a digest
  (BLAKE2b of its bytes) are recorded; of each, all of its storage (``_memory``), which torch.save
  writes and a forward can reach past the view (a buffer that views part of a larger tensor),
  unless a trained parameter shares that storage;
* at every private step (``optimizer.step()`` of a logical batch's last micro-batch, before
  anything is charged) the buffers are compared with their copies bit for bit and the frozen
  parameters' fingerprints recomputed: one read of a device flag for all of them. Before each
  micro-batch of a logical batch is handed out, the same comparisons are made on the device,
  OR-ed into flags the step reads with its own (no host read there), and every buffer is put
  back to its copy: a forward that writes one micro-batch into state and a later forward that
  clears it before the step carried data between micro-batches (a review moved a step 3.16C that
  way), and an evaluation on training rows between two steps did the same into the next step's
  first forward (another, 2.6 times the bound over two steps); now the later forward reads the
  fixed value and the step is refused. Values, not
  version counters: a write through ``.data``, numpy or DLPack bumps no version counter (a review
  moved one step's sum 3.27C through a frozen parameter written by ``.data`` in the forward of
  the step's second micro-batch). A change (a fingerprint confirmed by the digest) refuses the
  step, names the module, the tensor and the fix, and the buffers are put back to their copies,
  so nothing of the batch remains in them (a frozen parameter cannot be: the step and every
  release stay refused until it is reloaded or accepted);
* at every release (``state_dict()``, ``dpzero.checkpoint.save``, the Trainer's saves,
  ``PrivacyEngine.detach()``) the buffers again, and every frozen parameter by its digest. A
  change refuses the release, naming the tensor.

The fingerprint reads each frozen word once per micro-batch: on the host in one multi-threaded
pass, on a device in one launch per 96 tensors, eight bytes a term (Note [fingerprint words] in
src/dp/state_guard.h): work of the order of a forward's reads of the same weights (on a GPU at
device bandwidth, not yet measured). On a CPU with many frozen weights and small micro-batches
(adapters on a frozen base) it costs about a forward's matmuls through them at 128 rows
(experiments/results/private.md). The checks of which tensors the model holds read its module
tree once per check, through a snapshot of it while it is unchanged (Note [module tree
snapshots] in python/csrc/module_tree_bindings.cpp).

A buffer or frozen parameter added, removed or replaced by another tensor counts as a change. The
caller's own writes between steps that hold nothing of the training data (a value computed from the
released model, a load) are accepted by name with ``PrivacyEngine.accept_state_change``;
``model.load_state_dict()`` and ``dpzero.checkpoint.load`` accept what they load. The provenance
probe's forward (provenance/probe.py) restores whatever state it writes, copy-on-write, so it leaves
no trace (Note [probe writes]).

The C++ front door holds the same state fixed at its steps and micro-batches with the same
fingerprint (src/dp/state_guard.h); it cannot see a save, so there a release is checked where the
caller asks (``PrivacyEngine::verify_state``).

What this does not see: Python attributes that are not buffers or parameters (``self.last = x``),
globals and files; they are not in the model's state dict, and what a caller copies out of the
batch is the caller's, as in every DP-SGD library (Note [batch provenance]). The trainable
parameters are the engine's.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Set

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _C
from .errors import PrivacyViolation
from .provenance.examples import untag
from .trainable import TrainableSet

# Bytes of a frozen tensor hashed per host copy (a CUDA tensor is copied in pieces this size).
_DIGEST_CHUNK = 64 << 20


def fingerprint(t: torch.Tensor, key: int) -> torch.Tensor:
    """A 0-dim int64 on ``t``'s device: sum mod 2^64 over its words w_j (its elements' bits as
    integers) of a keyed, non-linear mix of (w_j, j) (``state_fingerprint`` in
    src/dp/state_guard.h, which the C++ front door's guard uses too): several changed words cancel
    only by chance, about 2^-64 for a key the model does not know (not a cryptographic hash: the
    digest confirms at releases)."""
    with torch._C.DisableTorchFunctionSubclass():
        return _C.dp.state_fingerprint(t.detach(), key)


def _per_device(ts: Sequence[torch.Tensor], key: int):
    """(positions, their fingerprints as one int64 tensor) for the tensors of ``ts`` on each
    device, in order: one op call per device (a GPU launches once per 96 tensors)."""
    positions: Dict[torch.device, List[int]] = {}
    for i, t in enumerate(ts):
        positions.setdefault(t.device, []).append(i)
    with torch._C.DisableTorchFunctionSubclass():
        for where in positions.values():
            yield where, _C.dp.state_fingerprints([ts[i].detach() for i in where], key)


def fingerprints(ts: Sequence[torch.Tensor], key: int) -> List[torch.Tensor]:
    """``fingerprint`` of each of ``ts`` (0-dim int64 views), one op call per device."""
    out: List[torch.Tensor] = [torch.empty(0)] * len(ts)
    for where, now in _per_device(ts, key):
        for i, f in zip(where, now.unbind()):
            out[i] = f
    return out


def moved(ts: Sequence[torch.Tensor], recorded: Sequence[torch.Tensor],
          key: int) -> List[torch.Tensor]:
    """Per tensor of ``ts``, a 0-dim bool on its device: whether its fingerprint differs from
    ``recorded`` (its own, on the same device); one fingerprint call and one comparison per
    device, no host read."""
    out: List[torch.Tensor] = [torch.empty(0)] * len(ts)
    for where, now in _per_device(ts, key):
        changed = now != torch.stack([recorded[i] for i in where])
        for i, f in zip(where, changed.unbind()):
            out[i] = f
    return out


def digest(t: torch.Tensor) -> bytes:
    """BLAKE2b-128 of ``t``'s bytes in row-major order, with its dtype and shape."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    flat = _bytes(t)
    for start in range(0, flat.numel(), _DIGEST_CHUNK):
        piece = flat[start:start + _DIGEST_CHUNK]
        h.update(piece.cpu().numpy().tobytes() if piece.device.type != "cpu"
                 else memoryview(piece.numpy()))
    return h.digest()


def _memory(t: torch.Tensor, trained: Set[int] = frozenset()) -> torch.Tensor:
    """What of state tensor ``t`` is checked: all of its storage, as a flat tensor of its dtype
    (of bytes where the storage is not a whole number of its elements), which torch.save writes
    and a forward can reach past the view (``set_`` on its storage); but ``t`` itself when a
    trained parameter shares that storage (``trained``: their storages' data pointers; the part
    beyond ``t`` is the optimizer's to write) or it has no storage to view (sparse, meta)."""
    with torch._C.DisableTorchFunctionSubclass():
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        if storage.data_ptr() in trained:
            return t
        dtype = t.dtype if storage.nbytes() % t.element_size() == 0 else torch.uint8
        return torch.empty(0, dtype=dtype, device=t.device).set_(storage)


def _data_ptr(t: torch.Tensor) -> Optional[int]:
    """The data pointer of ``t``'s storage, or None where it has none to give: a ZeRO stage-3
    parameter outside its unit's forward and backward refuses every data access (Note [reading a
    resharded parameter] in src/zero/flat_param.h), and has no memory a state tensor could share."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def _trained_storages(modules: Iterable[nn.Module], trainable: FrozenSet[int]) -> Set[int]:
    """The data pointers of the storages of the trained parameters (ids ``trainable``) of
    ``modules`` (a model's modules), now: storages can move (ZeRO), so each check takes them
    afresh."""
    with torch._C.DisableTorchFunctionSubclass():
        return {_data_ptr(p) for m in modules for p in m._parameters.values()
                if p is not None and id(p) in trainable} - {None}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a flat uint8 tensor (a copy where ``t`` is not contiguous)."""
    with torch._C.DisableTorchFunctionSubclass():
        flat = t.detach().contiguous().reshape(-1)
        return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)


@dataclass
class _Entry:
    """One tensor of the model's state, as the guard fixed it."""

    name: str              # dotted, as in the state dict ("encoder.ema")
    owner: nn.Module
    local: str             # its name in owner._buffers or owner._parameters
    buffer: bool           # a buffer; else a frozen parameter
    tensor: torch.Tensor   # the object fixed
    copy: Optional[torch.Tensor] = None   # a buffer's bytes ([nbytes] uint8)
    digest: Optional[bytes] = None        # a frozen parameter's digest
    fingerprint: Optional[torch.Tensor] = None  # a frozen parameter's, on its device

    @property
    def key(self) -> tuple:
        return (id(self.owner), self.local, self.buffer)

    @property
    def kind(self) -> str:
        return "buffer" if self.buffer else "frozen parameter"

    def current(self) -> Optional[torch.Tensor]:
        return (self.owner._buffers if self.buffer else self.owner._parameters).get(self.local)


def _describe(kind: str, name: str, owner: nn.Module) -> str:
    """"buffer 'enc.ema' of module 'enc' (Encoder)"."""
    module_name = name.rpartition(".")[0]
    return f"{kind} {name!r} of module {module_name or '<model>'!r} ({type(owner).__name__})"


def refusal_text(what: str, items: Sequence[str]) -> str:
    """Why ``what`` is refused: the state ``items`` (described) changed."""
    more = f" (and {len(items) - 6} more)" if len(items) > 6 else ""
    return (f"{what}: the model's state changed since make_private fixed it: "
            f"{'; '.join(items[:6])}{more}. Buffers and frozen parameters are released with the "
            "model (state_dict, checkpoints) without noise and are read by later steps, so "
            "nothing computed from the training data, nor a count of forward calls (it follows "
            "the realised batch sizes), may be written into them (Note [state written from "
            "data]). Compute such a value without the training batch, or keep it out of the "
            "module's state (a local value in the forward); a write that holds nothing of the "
            "training data (computed from public data or the released model) is accepted by "
            "name with privacy_engine.accept_state_change(names)")


class StateGuard:
    """Note [state written from data] for ``model``, whose trainable parameters are ``tree``'s
    (a TrainableSet, whose cached listing of the model's modules the checks read)."""

    def __init__(self, model: nn.Module, tree: TrainableSet, watch_trained: bool,
                 gathered: Optional[tuple] = None) -> None:
        self.model = model
        self._tree = tree
        self.trainable = tree.ids
        self._modules = tree.modules
        self.key = secrets.randbits(62)  # the fingerprints' (Note [state written from data])
        self.entries: List[_Entry] = []
        # Note [trained parameters written outside the step]: the trained (name, parameter)s,
        # record_trained's, and the parameters alone (the C++ readers' argument).
        self.watch_trained = watch_trained
        self._trained_named: List[tuple] = []
        self._trained_params: List[torch.Tensor] = []
        self._named_afresh = True  # take them from the model at the next record_trained
        # The same parameters' versions and places (_C.tree.Places of
        # dp::TensorPlace, src/dp/state_guard.h) when recorded: while both are unchanged no
        # parameter was written in place or pointed at other memory (another storage, or another
        # part of its own: a forward that re-points a bias into its unit's weights leaves every byte
        # and storage as it was), and the memories below are still theirs.
        self._trained_versions: List[int] = []
        self._recorded_places: Optional[_C.tree.Places] = None
        # Note [trained parameters written outside the step]: per memory the trained parameters
        # live in, (their names, the memory as a flat tensor, its data pointer, its fingerprint).
        self._trained_memories: List[tuple] = []
        # What earlier micro-batches of the open logical batch changed (check_micro_batch): one
        # device flag per entry, OR-ed, read with the step's own; and the changes seen without a
        # read (structure, trained versions).
        self._pending: Optional[torch.Tensor] = None
        self._pending_problems: List[str] = []
        # Note [writes to a gathered unit] (src/zero/flat_param.h): at stage 3, (the ZeRO state,
        # each unit's parameter names).
        self._gathered = gathered
        if gathered is not None:
            _C.dp.watch_gathered(gathered[0], self.key)
        # Note [module tree snapshots] (python/csrc/module_tree_bindings.cpp): the tree's
        # snapshot whose dicts _structure() read and found nothing in (None until then, after each
        # _fix, and while an entry's owner is outside the listing); and the trained parameters
        # the listing holds under a snapshot, (snapshot, parameters).
        self._quiet: Optional[_C.tree.Snapshot] = None
        self._trained_listed: Optional[tuple] = None
        self._fix(None)
        self.record_trained()

    # ---- fixing --------------------------------------------------------------------------

    def _walk(self) -> Dict[tuple, _Entry]:
        """Every buffer and frozen parameter of the model now, keyed by (owner id, local name,
        kind), with the first dotted name each is reached by."""
        out: Dict[tuple, _Entry] = {}
        for mname, m in self.model.named_modules(remove_duplicate=False):
            for local, b in m._buffers.items():
                if b is not None:
                    out.setdefault((id(m), local, True), _Entry(
                        f"{mname}.{local}" if mname else local, m, local, True, b))
            for local, p in m._parameters.items():
                if p is not None and id(p) not in self.trainable:
                    out.setdefault((id(m), local, False), _Entry(
                        f"{mname}.{local}" if mname else local, m, local, False, p))
        return out

    def _fix(self, names: Optional[Sequence[str]]) -> None:
        """Fixes the model's state as it is now: all of it (``names`` None), or the named
        tensors (the others keep what was fixed before). Changes an earlier micro-batch of the
        open logical batch made still refuse its step."""
        trained = self._trained_pointers()
        if self._pending is not None and bool(self._pending.any()):
            self._pending_problems.append("module state changed during an earlier micro-batch "
                                          "of this logical batch")
        self._pending = None
        self._quiet = None  # the entries change
        walked = self._walk()
        old = {e.key: e for e in self.entries}
        entries, copies, digests = [], {}, {}
        for key, e in walked.items():
            if names is not None and e.name not in names:
                if key in old:
                    entries.append(old[key])
                continue
            if e.buffer:
                if id(e.tensor) not in copies:
                    copies[id(e.tensor)] = _bytes(_memory(e.tensor, trained)).clone()
                e.copy = copies[id(e.tensor)]
            else:
                if id(e.tensor) not in digests:
                    memory = _memory(e.tensor, trained)
                    digests[id(e.tensor)] = (digest(memory), fingerprint(memory, self.key))
                e.digest, e.fingerprint = digests[id(e.tensor)]
            entries.append(e)
        if names is not None:  # removed since, and not named: still a change
            entries += [e for key, e in old.items() if key not in walked and e.name not in names]
        self.entries = entries

    # Note [trained parameters written outside the step]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # The trainable parameters are the private optimizer's, but a forward can write them too: a
    # functional F.embedding(ids, weight, max_norm=...) renormalises the looked-up rows of a trained
    # table in place, from the batch's ids (a second review read a rare token's row off the released
    # model: norm 1.78 in one neighbour, 1.00 in the other), Glow's ActNorm sets its own trained
    # bias and scale from the first batch's mean and standard deviation through ``param.data.copy_``
    # (a third review released them unclipped and unnoised: 16,855 times the bound), and so can the
    # training loop around it. A write through autograd bumps the parameter's version counter; one
    # through .data, or numpy or DLPack views, does not. So after each update (and at make_private,
    # a load, an acceptance) all three are recorded: the versions; where each parameter's elements
    # are and how they are read (TensorPlace in src/dp/state_guard.h: a forward that re-points a
    # trained bias at part of its unit's weights, or at a negated view, through .data moves no
    # version and no byte, and released other values as the bias in one neighbour only); a load
    # leaves out every memory a parameter left (clean_trained); and on its device the fingerprint of
    # each memory the trained parameters live in (a unit's flat buffer holds all of the unit's: one
    # fingerprint per unit, so that a step's launches grow with its units; a change names the
    # parameters sharing that buffer, a parameter given other memory is named alone); the versions
    # and places are compared at each check and release, the fingerprints with the buffers' flags,
    # before each later micro-batch and at the step (one device read) and at every release. This is
    # at ZeRO stages 0-2; stage 3 frees what it gathers, so there each gathered copy is
    # fingerprinted from its gather to its release instead and a change refuses the step (Note
    # [writes to a gathered unit] in src/zero/flat_param.h). Strict isolation also refuses a write
    # at its forward. A change refuses the step and every release until it is accepted, naming the
    # parameter; a write of the caller's that holds nothing of the training data (a projection of
    # the released parameters) is accepted with accept_state_change() (all of the state: an
    # acceptance by name takes only the buffers and frozen parameters it names). A load records a
    # memory anew only if it held its recorded values before the load (clean_trained), so no load
    # accepts a write it did not make. The fingerprints read every trained word once per micro-batch
    # and once after each update: on the host one multi-threaded pass (state_fingerprint), on a
    # device one launch.
    def clean_trained(self) -> Set[int]:
        """Before a load: the memories (data pointers) whose trained parameters still hold what
        was recorded, fingerprint, versions and places unmoved (one host read; loads are rare). A
        parameter pointed elsewhere leaves its old memory's bytes as they were: the memory is
        not clean, and a load, which copies in place, never makes it so."""
        if not self.watch_trained:
            return set()
        moved = self._read(self._trained_flags())
        kept = {n for (n, _), v, now in zip(self._trained_named, self._trained_versions,
                                             _C.tree.versions(self._trained_params)) if now == v}
        placed = {self._trained_named[i][0]
                  for i in self._recorded_places.moved(self._trained_params)}
        return {ptr for (names, _, ptr, _), m in zip(self._trained_memories, moved)
                if not m and set(names) <= kept and not placed.intersection(names)}

    def record_trained(self, clean: Optional[Set[int]] = None) -> None:
        """The trained parameters' versions and fingerprints now (after an update, an acceptance
        of everything). The parameters are the ones found at make_private (or the last
        acceptance): one that is replaced since is the trainable-set check's to refuse
        (trainable.py). After a load, ``clean`` (clean_trained's, taken before it): only those
        memories are recorded anew, since whatever changed them since is the load's; a memory
        written before the load keeps its refusal (a review laundered a write from the data
        through a load of nothing, a load of another unit, and an acceptance of a buffer)."""
        if not self.watch_trained:
            return
        if clean is not None:
            with torch._C.DisableTorchFunctionSubclass():
                renewed = {n for names, _, ptr, _ in self._trained_memories if ptr in clean
                           for n in names}
                self._trained_versions = [
                    now if n in renewed else v for (n, _), v, now in zip(
                        self._trained_named, self._trained_versions,
                        _C.tree.versions(self._trained_params))]
                self._trained_memories = [
                    (names, memory, ptr, fingerprint(memory, self.key) if ptr in clean else f)
                    for names, memory, ptr, f in self._trained_memories]
            return
        if self._named_afresh:
            self._trained_named = [(n, p) for n, p in self.model.named_parameters()
                                   if id(p) in self.trainable]
            self._trained_params = [p for _, p in self._trained_named]
            self._recorded_places, self._named_afresh = None, False
        self._trained_versions = _C.tree.versions(self._trained_params)
        if self._recorded_places is None or self._recorded_places.moved(self._trained_params):
            # A parameter given other memory, or a storage resized, since the last record: the
            # memories afresh (else each memory tensor still views its parameters' storage, which
            # it keeps alive).
            memories: Dict[int, tuple] = {}  # storage data pointer -> (names, memory)
            with torch._C.DisableTorchFunctionSubclass():
                for n, p in self._trained_named:
                    ptr = p.untyped_storage().data_ptr()
                    if ptr not in memories:
                        memories[ptr] = ([], _memory(p))
                    memories[ptr][0].append(n)
            self._trained_memories = [(names, memory, ptr, None)
                                      for ptr, (names, memory) in memories.items()]
            self._recorded_places = _C.tree.Places(self._trained_params)
        now = fingerprints([memory for _, memory, _, _ in self._trained_memories], self.key) \
            if self._trained_memories else []
        self._trained_memories = [(names, memory, ptr, f) for (names, memory, ptr, _), f
                                  in zip(self._trained_memories, now)]

    @staticmethod
    def _written_text(name: str) -> str:
        return (f"trainable parameter {name!r} was written outside the private optimizer (in "
                "place in the forward, such as F.embedding(..., max_norm=...) renormalising a "
                "trained table, or through .data, such as an initialisation from the batch)")

    def _written_trained(self) -> List[str]:
        if not self._trained_params:
            return []
        versions = _C.tree.versions(self._trained_params)
        moved = self._recorded_places.moved(self._trained_params)
        if versions == self._trained_versions and not moved:
            return []  # no version moved and every parameter is where it was recorded
        return ([self._written_text(n) for (n, _), v, now
                 in zip(self._trained_named, self._trained_versions, versions) if now != v] +
                [f"trainable parameter {self._trained_named[i][0]!r} was given other memory "
                 "outside the private optimizer (its .data replaced)" for i in moved])

    def _trained_flags(self) -> List[torch.Tensor]:
        """One device flag per memory the trained parameters live in (a unit's flat buffer
        holds all of the unit's: one fingerprint each, not one per parameter, so that a step's
        launches grow with its units): its fingerprint moved since record_trained."""
        if not self._trained_memories:
            return []
        return moved([memory for _, memory, _, _ in self._trained_memories],
                     [f for _, _, _, f in self._trained_memories], self.key)

    def stop_watching(self) -> None:
        """The engine let go of the model (detach): stage-3 gathers are no longer fingerprinted."""
        if self._gathered is not None:
            _C.dp.watch_gathered(self._gathered[0], None)
            self._gathered = None

    def _gathered_flags(self) -> List[torch.Tensor]:
        """Note [writes to a gathered unit]: one device flag per stage-3 unit, whether a gathered
        copy of it changed between its gather and its release since the last take (taken: they
        reset)."""
        return [] if self._gathered is None else list(self._gathered[0].take_gathered_written())

    def _gathered_changed(self, flags: Sequence[bool]) -> List[str]:
        """The stage-3 units the read flags (those after the trained memories') name."""
        if self._gathered is None:
            return []
        first = len(self.entries) + len(self._trained_memories)
        out = []
        for names, f in zip(self._gathered[1], flags[first:]):
            if f:
                shown = ", ".join(repr(n) for n in names[:4]) + (
                    f" and {len(names) - 4} more" if len(names) > 4 else "")
                out.append(f"one of the trainable parameters {shown} was written while ZeRO "
                           "stage 3 had it gathered (in place in the forward or the backward, or "
                           "through .data, such as an initialisation from the batch): the rest of "
                           "the micro-batch read the write, so one example reached the others' "
                           "gradients outside the clipping")
        return out

    def _trained_changed(self, flags: Sequence[bool]) -> List[str]:
        """The trained parameters the read flags (those after the entries') name: every one in a
        memory that changed."""
        out = []
        for (names, _, _, _), f in zip(self._trained_memories, flags[len(self.entries):]):
            if f and len(names) == 1:
                out.append(self._written_text(names[0]))
            elif f:
                shown = ", ".join(repr(n) for n in names[:4]) + (
                    f" and {len(names) - 4} more" if len(names) > 4 else "")
                out.append(f"one of the trainable parameters {shown}, which share one buffer, "
                           "was written outside the private optimizer (in place in the forward, "
                           "or through .data, such as an initialisation from the batch)")
        return out

    def accept(self, names: Optional[Sequence[str]] = None) -> None:
        """Takes the model's state now as its own (``names``: only these, dotted as in the state
        dict): for writes that hold nothing of the training data."""
        if names is not None:
            names = [names] if isinstance(names, str) else list(names)
            known = {e.name for e in self._walk().values()} | {e.name for e in self.entries}
            unknown = [n for n in names if n not in known]
            if unknown:
                raise ValueError(f"accept_state_change: {unknown} name no buffer or frozen "
                                 f"parameter of the model (it has {len(known)}, e.g. "
                                 f"{sorted(known)[:3]})")
        self._fix(names)
        if names is None:  # everything, the trained parameters' writes included
            self._named_afresh = True
            self.record_trained()

    # ---- checking ------------------------------------------------------------------------

    def _structure(self) -> List[str]:
        """State added, removed or replaced since it was fixed (names)."""
        modules = self._modules()
        since = self._tree.unchanged_since()
        if since is not None and since is self._quiet:
            return []  # every dict read below holds what it held when nothing had changed
        problems = self._structure_walk({id(m): (m, m._buffers, m._parameters) for m in modules})
        if not problems and since is not None:
            # Recorded from what the snapshot holds, not from the walk above (Note [module tree
            # snapshots]): the owners' dicts among them.
            held = {id(m): (m, dict(buffers), dict(params)) for m, buffers, params in since.items()}
            if all(id(e.owner) in held for e in self.entries) and not self._structure_walk(held):
                self._quiet = since
        return problems

    def _trained_pointers(self) -> Set[int]:
        """_trained_storages of the listing now: the trained parameters it holds are read once
        per snapshot of the tree, off what the snapshot holds, their storages (which can move:
        ZeRO) at each call."""
        modules = self._modules()
        since = self._tree.unchanged_since()
        if since is None:
            return _trained_storages(modules, self.trainable)
        if self._trained_listed is None or self._trained_listed[0] is not since:
            self._trained_listed = (since, [p for _, _, params in since.items() for _, p in params
                                            if p is not None and id(p) in self.trainable])
        return {ptr for ptr in _C.tree.storage_pointers(self._trained_listed[1])
                if ptr is not None}

    def _structure_walk(self, view: Dict[int, tuple]) -> List[str]:
        """_structure's reading of ``view``: per listed module's id, (module, its buffers, its
        parameters) as dicts, live or held; an entry whose owner is not in it is read live."""
        problems = []
        for e in self.entries:
            owner = view.get(id(e.owner))
            now = e.current() if owner is None else \
                (owner[1] if e.buffer else owner[2]).get(e.local)
            if now is None:
                problems.append(f"{_describe(e.kind, e.name, e.owner)} was removed")
            elif now is not e.tensor:
                problems.append(f"{_describe(e.kind, e.name, e.owner)} was replaced by "
                                "another tensor")
        fixed = {e.key for e in self.entries}
        for m, buffers, params in view.values():
            for local, b in buffers.items():
                if b is not None and (id(m), local, True) not in fixed:
                    problems.append(f"buffer {local!r} of a {type(m).__name__} was registered "
                                    "after make_private")
            for local, p in params.items():
                if p is not None and id(p) not in self.trainable and \
                        (id(m), local, False) not in fixed:
                    problems.append(f"frozen parameter {local!r} of a {type(m).__name__} was "
                                    "added after make_private")
        return problems

    def _flags(self) -> List[torch.Tensor]:
        """One device flag per entry (all of them, in order; a replaced or removed tensor's is
        False here, _structure names it): its buffer's bytes differ from the copy, or its frozen
        parameter's fingerprint changed; then one per trained parameter (Note [trained parameters
        written outside the step]). No host read."""
        if not self.entries:
            return self._trained_flags()
        trained = self._trained_pointers()
        flags: List[torch.Tensor] = []
        frozen: List[int] = []  # positions in flags of the frozen parameters, fingerprinted below
        for e in self.entries:
            if e.current() is not e.tensor:
                flags.append(torch.zeros((), dtype=torch.bool, device=e.tensor.device))
            elif e.buffer:
                now = _bytes(_memory(e.tensor, trained))
                flags.append(torch.ones((), dtype=torch.bool, device=now.device)
                             if now.numel() != e.copy.numel() else (now != e.copy).any())
            else:
                frozen.append(len(flags))
                flags.append(_memory(e.tensor, trained))
        if frozen:  # one fingerprint call for all of them (per device)
            entries = [self.entries[i] for i in frozen]
            for i, f in zip(frozen, moved([flags[i] for i in frozen],
                                          [e.fingerprint for e in entries], self.key)):
                flags[i] = f
        return flags + self._trained_flags()

    def step_flags(self, pending: bool = True) -> List[torch.Tensor]:
        """What changed, unread, for the step's one read (Book.read_checks): one flag per entry,
        True where its buffer's bytes or its frozen parameter's fingerprint differ now or
        differed at an earlier micro-batch of this logical batch (check_micro_batch), then one
        per trained parameter whose fingerprint moved, then one per stage-3 unit written while
        gathered (Note [writes to a gathered unit], taken). One [n] bool tensor when the state is
        on one device, else one flag tensor each. (The fingerprint is integer arithmetic: equal
        bytes give equal fingerprints, so a pending flag is a change that was.)
        ``pending=False`` (a release): changes now only, and no stage-3 flags (what was written
        into a gathered copy went with it)."""
        flags = self._flags()
        earlier = self._pending if pending else None
        gathered = self._gathered_flags() if pending else []
        if not flags and not gathered:
            return []
        if len({f.device for f in flags + gathered}) == 1:
            parts = []
            if flags:
                stacked = torch.stack(flags)
                parts.append(stacked if earlier is None else stacked | earlier.to(stacked.device))
            if gathered:
                parts.append(torch.stack(gathered))
            return [parts[0] if len(parts) == 1 else torch.cat(parts)]
        if earlier is not None:  # one per flag of _flags(); the gathered ones have no history
            flags = [f | p.to(f.device) for f, p in zip(flags, earlier)]
        return flags + gathered

    def _changed(self, flags: Sequence[bool], pending: bool) -> List[_Entry]:
        """The entries whose read ``flags`` (one per entry) say they changed: every buffer, and
        the frozen parameters whose digests confirm the fingerprint's verdict (no confirmation
        when the change may have been at an earlier micro-batch, ``pending``)."""
        if not any(flags):
            return []
        trained = self._trained_pointers()
        return [e for e, f in zip(self.entries, flags)
                if f and (e.buffer or pending or e.current() is not e.tensor or
                          digest(_memory(e.tensor, trained)) != e.digest)]

    def _read(self, flags: List[torch.Tensor]) -> List[bool]:
        """``flags`` (step_flags's) read here, for checks outside a step (releases)."""
        return [bool(v) for f in flags for v in f.reshape(-1).tolist()]

    def check_micro_batch(self, first: bool) -> None:
        """Before each micro-batch of a logical batch is handed out: what the earlier ones'
        forwards changed, or what ran since the last step (an evaluation forward), is noted for
        the step (which then refuses), and every buffer is put back to its copy, so that nothing
        of one forward reaches the next one even when that one would clear it before the step.
        No host read: the flags stay on the device until the step reads them with its own."""
        with self._tree.one_listing():  # checks only: the model cannot change between them
            self._pending_problems += self._structure() + self._written_trained()
            if first:  # what was written into a gathered copy before a logical batch's first
                self._gathered_flags()  # micro-batch went with that copy (a dropped batch, an
                # evaluation): it reaches nothing of this batch
            flags = self._flags()
            if flags and len({f.device for f in flags}) == 1:
                flags = torch.stack(flags)
                self._pending = flags if self._pending is None else self._pending | flags
            elif flags:  # state on several devices: one read per tensor, as the step does
                flags = torch.tensor([bool(f) for f in flags])
                self._pending = flags if self._pending is None else self._pending | flags
            self.restore_buffers()

    def clear_pending(self) -> None:
        """The open logical batch was dropped (its buffers were put back at each hand-out)."""
        self._pending, self._pending_problems = None, []

    def _changed_by_digest(self) -> List[_Entry]:
        """The frozen parameters whose digests changed (a release's exact check)."""
        trained = self._trained_pointers()
        return [e for e in self.entries if not e.buffer and e.current() is e.tensor
                and digest(_memory(e.tensor, trained)) != e.digest]

    def _text(self, what: str, problems: List[str], changed: List[_Entry]) -> str:
        return refusal_text(what, problems + [_describe(e.kind, e.name, e.owner)
                                              for e in changed])

    def restore_buffers(self, entries: Optional[Sequence[_Entry]] = None) -> None:
        """Puts the buffers (the given ones, or all) back to their copies, objects and values."""
        buffers = [e for e in (self.entries if entries is None else entries) if e.buffer]
        if not buffers:
            return
        trained = self._trained_pointers()
        for e in buffers:
            if e.owner._buffers.get(e.local) is not e.tensor and e.local in e.owner._buffers:
                e.owner._buffers[e.local] = e.tensor
            untag(e.tensor)
            with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                memory = _bytes(_memory(e.tensor, trained))
                if memory.numel() == e.copy.numel():  # else resized: refused, cannot be put back
                    memory.copy_(e.copy)

    def verify_step(self, flags: Sequence[bool]) -> Optional[str]:
        """At a private step (before anything is charged), given step_flags as the step read
        them: why it is refused, or None. Changed buffers are put back to their copies first."""
        problems = list(dict.fromkeys(self._pending_problems + self._structure() +
                                      self._written_trained() + self._trained_changed(flags) +
                                      self._gathered_changed(flags)))
        pending, self._pending, self._pending_problems = self._pending, None, []
        changed = self._changed(flags, pending is not None)
        if not (problems or changed):
            return None
        self.restore_buffers([e for e in changed if e.buffer] +
                             [e for e in self.entries if e.buffer and e.current() is not e.tensor])
        return self._text("the step is refused", problems, changed)

    def verify_release(self, what: str) -> None:
        """Before ``what`` releases the model's state: raises PrivacyViolation naming every
        buffer or frozen parameter that changed (the buffers are left as they are)."""
        now = self._read(self.step_flags(pending=False))
        problems = list(dict.fromkeys(self._structure() + self._written_trained() +
                                      self._trained_changed(now)))
        changed = [e for e in self._changed(now, False) if e.buffer] + self._changed_by_digest()
        if problems or changed:
            raise PrivacyViolation(self._text(f"{what} is refused", problems, changed))


# Note [probe writes]
# ~~~~~~~~~~~~~~~~~~~
# The provenance probe (provenance/probe.py) runs the model's forward once more on the batch with
# one example repeated. Whatever that forward writes into the model's state must be undone: the
# probe's batch is not a training batch (example 0 counts twice in it), and nothing of it may stay.
# A version counter does not see a write through ``.data``, so the probe runs under a dispatch mode
# that sees every write by construction: each ATen call whose schema marks an argument as written
# (in place, ``out=``, ``_foreach_*_``, ``copy_``), through any view or alias, is checked against
# the storages of the model's buffers and frozen parameters, and the state tensors on a written
# storage are copied, all of their storage (a write may reach past a view), before the first such
# write. Afterwards every copied tensor whose bytes changed is put back (under strict isolation
# every written one counts, also one a later write undid), and so is a buffer or parameter replaced
# by another object; the names of both are returned, and the root forward refuses the call (the same
# forward wrote the same state in the real pass, which the step would refuse anyway: this names it
# at the forward). The trainable parameters are the engine's (stage 3 gathers write their storage),
# so they are not watched here.
class _CopyOnWrite(TorchDispatchMode):
    def __init__(self, watched: Dict[int, List[torch.Tensor]], trained: Set[int]) -> None:
        super().__init__()
        self.watched = watched                      # storage data_ptr -> state tensors on it
        self.trained = trained                      # the trained parameters' storages
        self.saved: Dict[int, torch.Tensor] = {}    # id(state tensor) -> its bytes before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for arg, value in _arguments(func, args, kwargs):
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            for t in (value if isinstance(value, (list, tuple)) else (value,)):
                if isinstance(t, torch.Tensor):
                    self._save(t)
        return func(*args, **kwargs)

    def _save(self, t: torch.Tensor) -> None:
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return
        for state in self.watched.get(ptr, ()):
            if id(state) not in self.saved:  # all of its storage: a write may go past the view
                self.saved[id(state)] = _bytes(_memory(state, self.trained)).clone()


def _arguments(func, args, kwargs):
    """(schema argument, value) of an ATen call."""
    positional = [a for a in func._schema.arguments if not a.kwarg_only]
    for a, v in zip(positional, args):
        yield a, v
    for a in func._schema.arguments:
        if a.name in kwargs:
            yield a, kwargs[a.name]


class ProbeWrites:
    """Note [probe writes] for ``model`` (trainable parameters by id: ``trainable``): a context
    manager that restores every buffer and frozen parameter the forward inside it writes or
    replaces; ``written`` then names them and ``described`` describes them."""

    def __init__(self, model: nn.Module, trainable: Iterable[int],
                 any_write: bool = False) -> None:
        self.model, self.trainable = model, frozenset(trainable)
        # Every write counts, also one a later write undid (strict isolation: an example's
        # forward that writes what the next one reads and clears); else a changed value.
        self.any_write = any_write
        self.written: List[str] = []
        self.described: List[str] = []

    def __enter__(self) -> "ProbeWrites":
        self.slots = []  # (name, owner, local, buffer?, object)
        watched: Dict[int, List[torch.Tensor]] = {}
        for mname, m in self.model.named_modules(remove_duplicate=False):
            for buffer, table in ((True, m._buffers), (False, m._parameters)):
                for local, t in table.items():
                    if t is None or (not buffer and id(t) in self.trainable):
                        continue
                    self.slots.append((f"{mname}.{local}" if mname else local, m, local,
                                       buffer, t))
                    try:
                        ptr = t.untyped_storage().data_ptr()
                    except (RuntimeError, NotImplementedError):
                        continue
                    if ptr:
                        watched.setdefault(ptr, [])
                        if all(t is not s for s in watched[ptr]):
                            watched[ptr].append(t)
        self.mode = _CopyOnWrite(watched, _trained_storages(self.model.modules(), self.trainable))
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)
        written = {}
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            for name, m, local, buffer, t in self.slots:
                table = m._buffers if buffer else m._parameters
                what = _describe("buffer" if buffer else "parameter" if t.requires_grad
                                 else "frozen parameter", name, m)
                if table.get(local) is not t:
                    written[name] = what + " (replaced by another tensor)"
                    table[local] = t
                tainted = type(t) is not torch.Tensor and not isinstance(t, nn.Parameter)
                untag(t)
                before = self.mode.saved.get(id(t))
                memory = _bytes(_memory(t, self.mode.trained))
                if (before is not None and (self.any_write or not torch.equal(memory, before))) \
                        or tainted:
                    if before is not None and memory.numel() == before.numel():
                        memory.copy_(before)
                    written.setdefault(name, what)
        self.written = sorted(written)
        self.described = [written[n] for n in self.written]
