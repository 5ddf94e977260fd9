"""The clipping book's Python side: what needs Python around the C++ book (src/dp/book.h).

The book itself — parts, components and groups, clip factors, clipped sums into each unit's flat
buffer, the hand-over to the engine, padding batches, NaN samples, mean-loss scaling and early
release — is ``dpzero._C.dp.Book``; src/dp/book.h explains it top to bottom. This wrapper keeps
what only Python knows: the root forward's provenance verdicts (Note [batch provenance] in
provenance/root.py), activation checkpointing's recomputed forwards, the generic path's per-sample
gradients (fallback.py), the end-of-backward callback, and the error that makes the step refuse.

Note [recomputed forwards]: under activation checkpointing (torch.utils.checkpoint with
use_reentrant=False, which Hugging Face's activation_checkpointing_enable and make_private's
``activation_checkpointing`` use) a segment's forward runs twice: once in the forward pass, where
its DP layer calls register their parts as usual and their autograd nodes are built, and again
inside the backward, only to regenerate the tensors those nodes saved. The recomputed calls are
recognised (a forward while a backward runs) and matched by count to registered calls of the same
layer; they register nothing, so each layer counts exactly once per micro-batch, and the ORIGINAL
nodes' backwards hand the book the recomputed input A with the true G. Reentrant checkpointing
runs the first forward without autograd and back-propagates the recomputation instead; its
recomputed calls match no registered call and the backward is refused, naming the remedy.

Note [one sample per row]: row i of every part of a micro-batch is example i, which is what makes
the per-sample norm the norm of one example's gradient. That dim 0 holds the examples is decided
from where each input came from (Note [batch provenance] in provenance/examples.py): the model's
root forward hands every part its verdict (``set_verdicts``) before any gradient exists, and the C++
book never clips a part without one. Its row count must also be the micro-batch's (checked there).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import _C
from .errors import PrivacyViolation
from .layers import LayerKind

_dp = _C.dp  # the private step's C++ core (src/dp)



@dataclass
class Slot:
    """Where one trainable parameter's gradient goes: unit u, flat offset, numel, shape."""
    unit: int
    offset: int
    numel: int
    shape: torch.Size


@dataclass
class Layer:
    index: int
    name: str
    module: nn.Module
    kind: LayerKind
    train: Tuple[bool, ...]          # per kind.params: trainable
    slots: List[Optional[Slot]]      # per kind.params
    component: int = -1
    group: int = -1
    routed: bool = False  # Note [subclass forwards] (attach.py): the kernel via super().forward
    # Identities of its trained parameters for the clipping components, where they are not the
    # module's own (a row block of a packed parameter: Note [attention through the kernels]).
    keys: Optional[Tuple[int, ...]] = None


# A part's id as its backward reports it: (the book's generation, part index, layer index).
PartId = Tuple[int, int, int]


class Book:
    def __init__(self, layers: List[Layer], groups: List[List[int]], thresholds: List[float],
                 mode: str, gamma: float, loss_reduction: str, state, unit_numel: List[int],
                 device_of_unit: List[torch.device]) -> None:
        self.layers = layers
        self.mean_loss = loss_reduction == "mean"  # Note [mean loss] (src/dp/book.h)
        self.groups = groups              # group -> component ids
        self.thresholds = thresholds      # C_g (inf: no clipping)
        self._core = _dp.Book(
            [(layer.name, layer.kind.book_ops(layer.module, layer.train),
              [None if s is None else (s.unit, s.offset, s.numel, list(s.shape))
               for s in layer.slots], layer.component, layer.group) for layer in layers],
            [float(t) for t in thresholds], [len(g) for g in groups], mode, gamma,
            loss_reduction == "mean", list(unit_numel), list(device_of_unit), state)
        # A backward queues the core's finish_backward as the autograd engine's final callback.
        self._core.set_queue_finish(True)
        # Set by the engine when the loader (or own_batch) hands out a micro-batch: its token,
        # which the model's inputs must carry (Note [batch provenance]), and its rows (Note [one
        # sample per row]).
        self.token = None
        self._expected_rows: Optional[int] = None
        self.deferred: List[Tuple[torch.Tensor, Callable[[], str]]] = []  # Note [deferred checks]
        # Note [batch provenance] (provenance/root.py): the DP layer calls of the root forward
        # running now (None outside one), the probe running now (None outside it), and the verdicts
        # of every call pattern seen so far (kept for the whole run).
        self.root: Optional[list] = None
        self.probe: Optional[list] = None
        # Why the root forward running now was refused (its DP layers register nothing and
        # their backward raises this), or None.
        self.refusal: Optional[str] = None
        self.verdicts: Dict[tuple, tuple] = {}  # pattern -> (verdicts, Note [premises])
        # Note [state written from data] (state_guard.py), set by the engine: watch_state() is
        # the probe's copy-on-write of the model's state (Note [probe writes]), restore_state()
        # puts its buffers back to the values fixed at make_private.
        self.watch_state: Callable[[], Any] = None  # type: ignore[assignment]
        self.restore_state: Callable[[], None] = lambda: None
        self._generation = -1
        self._micro_batch()

    @property
    def core(self):
        """The C++ clipping book (``dpzero._C.dp.Book``, src/dp/book.h) this one drives."""
        return self._core

    # ---- micro-batch state -------------------------------------------------------------------

    def _micro_batch(self) -> None:
        """Brings this side's state of the micro-batch to the core's: the core closes a
        micro-batch in its end-of-backward callback (or discard), which starts a new generation."""
        generation = self._core.generation
        if generation == self._generation:
            return
        self._generation = generation
        # Note [recomputed forwards]: how many calls of each layer activation checkpointing has
        # recomputed since this micro-batch's forward.
        self.recomputed: Dict[int, int] = {}
        # Note [batch provenance]: per part, its layer (Layer.index), and per part given a
        # verdict, that verdict's dims (the generic path needs them).
        self.part_layers: List[int] = []
        self.in_dims: Dict[int, Optional[tuple]] = {}

    @property
    def error(self) -> Optional[str]:
        """The privacy violation seen (by the core or here); step() refuses until it is
        cleared."""
        return self._core.error

    @error.setter
    def error(self, value: Optional[str]) -> None:
        self._core.error = value

    @property
    def stale(self) -> bool:
        """A logical batch accumulated but never stepped when the next one began (engine.py):
        every backward is refused until zero_grad()."""
        return self._core.stale

    @stale.setter
    def stale(self, value: bool) -> None:
        self._core.stale = bool(value)

    @property
    def padding(self) -> bool:
        """Note [padding batches] in src/dp/book.h: this micro-batch's gradients become zeros."""
        return self._core.padding

    @padding.setter
    def padding(self, value: bool) -> None:
        self._core.set_padding(bool(value))

    @property
    def expected_rows(self) -> Optional[int]:
        return self._expected_rows

    @expected_rows.setter
    def expected_rows(self, rows: Optional[int]) -> None:
        """A micro-batch handed out (its rows) or closed (None): one backward may reach the
        clipping."""
        self._expected_rows = rows
        self._core.set_expected_rows(rows)

    @property
    def open(self) -> bool:
        """A forward registered parts whose backward has not finished."""
        return self._core.open

    @property
    def num_parts(self) -> int:
        return self._core.num_parts

    @property
    def micro_batches(self) -> int:
        """Backward passes that reached the clipping since the last take_stats()."""
        return self._core.micro_batches

    @contextlib.contextmanager
    def probing(self, probe):
        """Note [batch provenance]: while the probe runs, DP layer calls go to ``probe``
        (provenance.Probe), which runs and records them; nothing is registered."""
        self.probe = probe
        try:
            yield probe
        finally:
            self.probe = None

    # ---- forward -----------------------------------------------------------------------------

    def refusal_text(self, layer: Layer) -> str:
        """Note [batch provenance]: why the backward of a DP layer call that may not be clipped
        is refused — its root forward was refused (``refusal``), or it ran outside any call of
        the model. The forward was harmless."""
        return self.refusal or (
            f"DP layer {layer.name!r} ({type(layer.module).__name__}) ran with gradients "
            "outside a call of the model given to make_private (a submodule called directly, or "
            "gradients enabled inside a no_grad call of the model): nothing says which of its "
            "input's rows are examples (Note [batch provenance]); call the whole model")

    def recompute_text(self, layer: Layer) -> str:
        """Note [recomputed forwards]: why a backward through a recomputed call is refused (never
        reached under non-reentrant checkpointing, whose recomputed graph only supplies saved
        tensors; the gradient would be counted twice)."""
        return (f"a backward reached the recomputed forward of DP layer {layer.name!r} (a graph "
                "built during activation recompute was back-propagated); its gradient would be "
                "counted twice")

    def refusing(self, why: str):
        """A backward callback that refuses with ``why`` (recorded as the error)."""
        def refuse(*_args):
            self._core.refuse_backward(why)
        return refuse

    def on_forward(self, layer_index: int, record) -> Tuple[int, int]:
        """Registers one call of layer ``layer_index`` inside the root forward (``record``: its
        inputs' shapes, provenance.CallRecord); returns (generation, part index), what its
        backward reports under. The core refuses it after a backward that stopped partway. Run
        once per DP layer call: kept to the bookkeeping the verdicts need."""
        assert self.root is not None, "a DP layer call outside the root forward registered"
        self._micro_batch()
        index = self._core.on_forward(layer_index)  # first: it may refuse the call
        self.root.append(record)
        self.part_layers.append(layer_index)
        return self._generation, index

    def set_verdicts(self, start: int, verdicts: Sequence) -> None:
        """Note [batch provenance]: the verdicts of the parts registered from ``start`` on by one
        root forward, in call order (refusals were raised by the root forward, on every rank)."""
        assert self.num_parts - start == len(verdicts), \
            "one verdict per DP layer call of the root forward"
        for index, verdict in enumerate(verdicts, start):
            assert verdict.error is None
            self.in_dims[index] = verdict.in_dims
            generic = hasattr(self.layers[self.part_layers[index]].kind, "per_sample_grads")
            if verdict.in_dims is not None and (generic or verdict.in_dims[:1] == (0,)):
                self._core.set_verdict(index)

    def on_recompute(self, layer: Layer) -> None:
        """Note [recomputed forwards]: a forward of ``layer`` inside a backward pass. It must be
        activation checkpointing recomputing a call this micro-batch's forward registered (whose
        own backward node reports, with the recomputed input); anything else is refused."""
        self._micro_batch()
        done = self.recomputed.get(layer.index, 0)
        if done >= self.part_layers.count(layer.index):
            self.error = (
                f"DP layer {layer.name!r} ran a forward inside a backward pass that does not "
                "recompute one of this micro-batch's forward calls: reentrant activation "
                "checkpointing (use_reentrant=True) runs its forward without autograd and "
                "back-propagates the recomputation, which the clipping cannot account for. Use "
                "use_reentrant=False (torch.utils.checkpoint.checkpoint(..., "
                "use_reentrant=False); Hugging Face: activation_checkpointing_enable() with its "
                "default kwargs) or make_private(..., activation_checkpointing=...)")
            raise PrivacyViolation(self.error)
        self.recomputed[layer.index] = done + 1

    # ---- backward ----------------------------------------------------------------------------

    def on_backward(self, pid: PartId, a, g) -> None:
        """The backward of a DP layer call whose autograd function is Python's (layers.py's
        LayerNorm/RMSNorm and Conv; the generic path, fallback.py): its input A (the generic
        path: what its forward saved) and output gradient G (the generic path: one per tapped
        output). Linear and Embedding calls report from their C++ nodes (src/dp/dp_layers.h)."""
        try:
            generation, index, layer_index = pid
            layer = self.layers[layer_index]
            kind = layer.kind
            if not hasattr(kind, "per_sample_grads"):
                self._core.on_backward(generation, index, kind.batch_input(layer.module, a), g)
                return
            # The generic path (fallback.py): its per-sample gradients, computed here.
            self._core.begin_backward(generation, index)
            dims = self.in_dims.get(index)
            g = kind.batch_first(g, dims)  # [B, total]
            multiplier = self._core.take_rows(index, g.shape[0])
            if multiplier == 0:
                g = torch.zeros_like(g)  # Note [padding batches]: exact zeros
            elif multiplier != 1:
                g = g * multiplier  # Note [mean loss]
            grads = kind.per_sample_grads(layer.module, a, g, layer.train, dims,
                                          f"{type(layer.module).__name__} {layer.name!r}",
                                          defer=self.defer)
            self._core.report_per_sample(index, [grads.get(n) for n in kind.params])
        except BaseException as e:
            # Whatever failed, part of this micro-batch may already be in the engine: the step
            # must not run on it (a retried micro-batch would count its examples twice). The
            # core records its own refusals and failures; this records the rest.
            if self.error is None:
                self.error = f"the backward failed in the clipping ({type(e).__name__}: {e})"
            raise

    # Note [deferred checks]
    # ~~~~~~~~~~~~~~~~~~~~~~~~
    # A check the backward makes on values (the generic path's separable recompute) has its
    # verdict on the tensors' device. Reading it there would make the host wait for the device at
    # every such layer (the private backward never waits on a GPU). So the verdict is kept
    # unread, with the text that explains a failure, and the step reads them all, in its one read
    # (Note [host reads of a step] in src/dp/private_step.h), before its transaction
    # (PrivacyEngine._optimizer_step): any failure refuses the step on every rank
    # (its refusal is the step's agreed verdict), so the logical batch is dropped and nothing is
    # charged or released, as if the backward had raised. Until then its gradients only sit in
    # the engine's buffers, like those of any backward that a later check refuses.

    def defer(self, failed: torch.Tensor, text: Callable[[], str]) -> None:
        """Keeps a check's unread verdict (a bool tensor: True when it failed) and the text of its
        failure, for the step (Note [deferred checks])."""
        self.deferred.append((failed, text))

    def read_step_checks(self, state_flags: List[torch.Tensor]):
        """The step's one read of the device (Note [host reads of a step] in
        src/dp/private_step.h): ``state_flags`` (StateGuard.step_flags), every kept verdict and
        the dropped count, in one transfer per device. Forgets the kept verdicts; returns the
        state flags as bools (one per entry, flattened) and the text of the first kept verdict
        that failed, or None."""
        deferred, self.deferred = self.deferred, []
        read = self._core.read_checks(list(state_flags) + [failed for failed, _ in deferred])
        state = [v for flags in read[:len(state_flags)] for v in flags]
        failed = next((text() for (_, text), flags in zip(deferred, read[len(state_flags):])
                       if any(flags)), None)
        return state, failed

    def drop_deferred(self) -> None:
        """Forgets the kept verdicts unread: their logical batch was dropped."""
        self.deferred = []

    def discard(self) -> None:
        """Drops a micro-batch whose backward never ran (zero_grad between forward and backward)."""
        self._core.discard()
        self._micro_batch()

    def take_stats(self):
        """This logical step's dpzero._C.dp.StepStats (samples, dropped, micro_batches), and
        starts the next."""
        return self._core.take_stats()
