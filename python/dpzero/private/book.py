"""The clipping book: per micro-batch, from each DP layer's (A, G) to clipped sums in the engine.

Terms. A *part* is one forward call of a DP layer in the current micro-batch. A *component* is a
set of layers that share a parameter (a tied embedding and output head) — its per-sample norm is
bounded by the triangle inequality, the sum of its parts' norms (DESIGN.md §2 step 3), which can
only over-estimate; a layer called twice is a component of two parts likewise. A *clipping group*
is a set of components clipped together with threshold C_g, the thresholds satisfying
sum_g C_g^2 = C^2 (privacy/clipping.h):

* flat / automatic: one group, C_g = C;
* layer: one group per component, equal weights;
* group: the groups the caller names (e.g. one per transformer block).

Within a group, the per-sample norm is sqrt(sum over components of n_c^2), the components being
disjoint parameter sets. A sample's whole clipped gradient then has norm <= sqrt(sum_g C_g^2) = C:
the sensitivity contract (DESIGN.md §3).

Flow. The patched forward of a layer registers a part (``on_forward``), which also counts, per
group and per unit, the contributions the backward will bring. In backward each part reports its
input and output gradient (``on_backward``): its per-sample squared norms are computed at once.
When a group has all its parts it is *complete*: factors c_i from its norms (clip_factors), then
each part's clipped sum sum_i c_i g_i is added into its unit's flat fp32 buffer. A singleton group
(layer clipping, untied layer) does all of that in one fused op inside the layer's backward.
In stages 0-1 that buffer is the engine's own gradient buffer (Note [private accumulator] in
src/zero/param_group.h), which the step reduces: nothing is handed over. Otherwise, when a unit
has every contribution of the micro-batch it is handed to the engine (``ZeroState.add_unit_grad``)
— its reduce-scatter starts while the backward goes on (layer and group clipping) or at the end of
the backward (flat: book-keeping, Bu et al. 2023). A final
autograd callback completes what the backward did not reach (a layer whose output did not
influence the loss contributes nothing) and closes the micro-batch.

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
from where each input came from (Note [batch provenance] in examples.py): the model's root
forward hands every part its verdict (``set_verdicts``) before any gradient exists, and a part
without one is never clipped. Its row count must also be the micro-batch's (checked).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import _C
from .layers import (Kept, LayerKind, LinearKind, add_into, add_kept_clipped_sums,
                     certified_sum)

_ops = torch.ops.dpzero
_dp = _C.dp  # the private step's C++ core (src/dp)


class PrivacyViolation(RuntimeError):
    """A gradient would escape clipping or be counted twice, or the model cannot be trained
    privately as built."""


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


@dataclass
class Part:
    layer: Layer
    a: object = None      # A (or the fallback's per-sample gradients) once the backward ran
    g: object = None
    sq: Optional[torch.Tensor] = None  # [B] float32 certified squared norms
    done: bool = False
    # Note [shared inputs]: a Linear weight's norm waits for the group's other layers on the same
    # input; what the rest of the layer (its bias) contributed meanwhile.
    pending: bool = False
    other_sq: Optional[torch.Tensor] = None
    # Note [batch provenance]: per positional tensor input, 0 if its dim 0 holds the examples,
    # None if it is shared by all of them; None until the root forward's verdict.
    in_dims: Optional[Tuple[Optional[int], ...]] = None


@dataclass
class GroupState:
    parts: List[int] = field(default_factory=list)
    received: int = 0
    complete: bool = False


class StepStats:
    """What one logical step's micro-batches produced on this rank."""

    def __init__(self) -> None:
        self.samples = 0        # rows seen by the DP layers (this rank; padding excluded)
        self.dropped = 0        # samples with a NaN/Inf norm (factor 0), this rank
        self.micro_batches = 0  # backward passes that reached the clipping


class Book:
    def __init__(self, layers: List[Layer], groups: List[List[int]], thresholds: List[float],
                 mode: str, gamma: float, loss_reduction: str, state, unit_numel: List[int],
                 device_of_unit: List[torch.device]) -> None:
        self.layers = layers
        self.groups = groups              # group -> component ids
        self.thresholds = thresholds      # C_g (inf: no clipping)
        self.mode = mode                  # "flat" | "automatic" for clip_factors
        self.gamma = gamma
        self.loss_reduction = loss_reduction
        self.state = state
        self.unit_numel = unit_numel
        self.unit_device = device_of_unit
        self.components: Dict[int, List[Layer]] = {}
        for layer in layers:
            self.components.setdefault(layer.component, []).append(layer)
        # Note [early release]
        # ~~~~~~~~~~~~~~~~~~~~
        # At stage 3 a unit is gathered for its backward and must be freed once no autograd node
        # still reads its parameters. The engine frees it when its gradient is handed over, but
        # with flat (or group) clipping that is the end of the backward, when the clipping
        # factors of the whole group are known: every unit would stay gathered through the
        # backward, the whole model at once, which stage 3 exists to avoid (measured: gathered
        # parameters peaked at 100% of the model's bytes, gpt-4x256 flat, two ranks). What the
        # clipped sums need later is the stored A and G, never the parameters (their shapes stay
        # readable on a freed unit, Note [flat views]). So the book counts, per unit, the DP
        # layer calls of this micro-batch that use its parameters and have not run their backward;
        # a call's backward has computed its input gradient when it reports (layers.py), and when
        # the count reaches zero the unit is freed (ZeroState::release_params). Units of generic
        # (fallback) modules, whose own backward nodes run after the report, are excluded below.
        # Note [fallback units]: a generic-path module hands over its gradient from a tap on its
        # OUTPUT, before its own backward nodes (which may read its parameters, e.g. the x in
        # x * scale) have run; a stage-3 unit holding such parameters stays gathered until the
        # end of the backward instead of being freed when its gradient is handed over.
        self.keep_gathered = {slot.unit for layer in layers
                              if hasattr(layer.kind, "per_sample_grads")
                              for slot in layer.slots if slot is not None}
        self.stats = StepStats()
        self.padding = False  # Note [padding batches] in loader.py: gradients become zeros
        # Set by the engine when the loader (or own_batch) hands out a micro-batch: its token,
        # which the model's inputs must carry (Note [batch provenance]), its rows (Note [one
        # sample per row]) and how many backward passes reached the clipping since.
        self.token = None
        self.expected_rows: Optional[int] = None
        self.micro_backwards = 0
        # Note [batch provenance] (provenance.py): the DP layer calls of the root forward running
        # now (None outside one), the probe running now (None outside it), and the verdicts of
        # every call pattern seen so far (kept for the whole run).
        self.root: Optional[list] = None
        self.probe: Optional[list] = None
        # Why the root forward running now was refused (its DP layers register nothing and
        # their backward raises this), or None.
        self.refusal: Optional[str] = None
        self.verdicts: Dict[tuple, list] = {}
        # A logical batch accumulated but never stepped when the next one began (engine.py).
        self.stale = False
        self.error: Optional[str] = None  # a privacy violation seen; step() refuses until cleared
        self._reset_micro_batch()

    # ---- micro-batch state -------------------------------------------------------------------

    def _reset_micro_batch(self) -> None:
        # Part ids are (generation, index): a backward that reaches a part of an earlier
        # micro-batch (a second backward through one graph) is recognised and refused.
        self.generation = getattr(self, "generation", 0) + 1
        self.parts: List[Part] = []
        self.group_state: Dict[int, GroupState] = {}
        self.unit_expected: Dict[int, int] = {}
        # Note [early release]: per unit, DP layer calls (x their slots in the unit) of this
        # micro-batch's forward whose backward has not run yet.
        self.unit_uses: Dict[int, int] = {}
        # Per unit: the flat fp32 buffer its clipped sums are added into — the engine's own
        # gradient buffer where it offers one (Note [private accumulator] in
        # src/zero/param_group.h: stages 0-1; those units are in `direct`), else a zeroed buffer
        # of this micro-batch that add_unit_grad takes over.
        self.unit_buf: Dict[int, torch.Tensor] = {}
        self.direct: set = set()
        self.handed: set = set()  # units handed to the engine in this micro-batch
        self.batch: Optional[int] = None
        self.dropped_mask: Optional[torch.Tensor] = None
        self.callback_queued = False
        # Note [recomputed forwards]: calls of each layer registered by this micro-batch's
        # forward, and how many of them activation checkpointing has recomputed since.
        self.calls: Dict[int, int] = {}
        self.recomputed: Dict[int, int] = {}

    @property
    def open(self) -> bool:
        """A forward registered parts whose backward has not finished."""
        return bool(self.parts)

    @contextlib.contextmanager
    def probing(self, probe):
        """Note [batch provenance]: while the probe runs, DP layer calls go to ``probe``
        (provenance.Probe), which runs and records them; nothing is registered."""
        self.probe = probe
        try:
            yield probe
        finally:
            self.probe = None

    def refused_backward(self, layer: Layer):
        """Note [batch provenance]: the backward callback of a DP layer call that may not be
        clipped — its root forward was refused (``refusal``), or it ran outside any call of the
        model. The forward was harmless; a backward through it is refused."""
        why = self.refusal or (
            f"DP layer {layer.name!r} ({type(layer.module).__name__}) ran with gradients "
            "outside a call of the model given to make_private (a submodule called directly, or "
            "gradients enabled inside a no_grad call of the model): nothing says which of its "
            "input's rows are examples (Note [batch provenance]); call the whole model")

        def refuse(*_args):
            self.error = why
            raise PrivacyViolation(why)
        return refuse

    def on_forward(self, layer: Layer, record) -> Tuple[int, int]:
        """Registers one call of ``layer`` inside the root forward (``record``: its inputs'
        shapes, provenance.CallRecord); returns the part id its backward reports under."""
        assert self.root is not None, "a DP layer call outside the root forward registered"
        if self.callback_queued:
            # A backward reached the clipping but never finished (an exception in some backward
            # node, so its end-of-backward callback never ran): what it already clipped stays
            # accumulated, and running the micro-batch again would count its examples twice.
            self.error = ("a backward pass stopped partway after part of it was clipped; its "
                          "clipped sums are still accumulated, so a new forward would count "
                          "those examples twice: call zero_grad() to drop the micro-batch")
            raise PrivacyViolation(self.error)
        self.root.append(record)
        pid = (self.generation, len(self.parts))
        self.calls[layer.index] = self.calls.get(layer.index, 0) + 1
        self.parts.append(Part(layer))
        self.group_state.setdefault(layer.group, GroupState()).parts.append(pid[1])
        for slot in layer.slots:
            if slot is not None:
                self.unit_expected[slot.unit] = self.unit_expected.get(slot.unit, 0) + 1
                self.unit_uses[slot.unit] = self.unit_uses.get(slot.unit, 0) + 1
        return pid

    def set_verdicts(self, start: int, verdicts: Sequence) -> None:
        """Note [batch provenance]: the verdicts of the parts registered from ``start`` on by one
        root forward, in call order (refusals were raised by the root forward, on every rank)."""
        parts = self.parts[start:]
        assert len(parts) == len(verdicts), "one verdict per DP layer call of the root forward"
        for part, verdict in zip(parts, verdicts):
            assert verdict.error is None
            part.in_dims = verdict.in_dims

    def _release_if_done(self, layer: Layer) -> None:
        """Note [early release]: after one call of ``layer`` ran its backward, frees every
        stage-3 unit none of whose parameters a DP layer call of this micro-batch still has to
        back-propagate through."""
        for slot in layer.slots:
            if slot is None:
                continue
            left = self.unit_uses[slot.unit] = self.unit_uses[slot.unit] - 1
            if left == 0 and slot.unit not in self.keep_gathered:
                self.state.release_params(slot.unit)

    def on_recompute(self, layer: Layer) -> None:
        """Note [recomputed forwards]: a forward of ``layer`` inside a backward pass. It must be
        activation checkpointing recomputing a call this micro-batch's forward registered (whose
        own backward node reports, with the recomputed input); anything else is refused."""
        done = self.recomputed.get(layer.index, 0)
        if done >= self.calls.get(layer.index, 0):
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

    def recomputed_backward(self, layer: Layer):
        """The backward callback of a recomputed call: never reached under non-reentrant
        checkpointing (the recomputed graph only supplies saved tensors); if a backward ever
        reaches it, the gradient would be counted twice, so it is refused."""
        def refuse(*_args):
            self.error = (f"a backward reached the recomputed forward of DP layer "
                          f"{layer.name!r} (a graph built during activation recompute was "
                          "back-propagated); its gradient would be counted twice")
            raise PrivacyViolation(self.error)
        return refuse

    def stale_error(self) -> Optional[str]:
        if self.stale:
            return ("a new logical batch began while the previous one's gradients were still "
                    "accumulated (step() was not called for it); they would be released together")
        return None

    def on_backward(self, pid: Tuple[int, int], a, g: torch.Tensor) -> None:
        try:
            self._on_backward(pid, a, g)
            self._release_if_done(self.parts[pid[1]].layer)
        except BaseException as e:
            # Whatever failed, part of this micro-batch may already be in the engine: the step
            # must not run on it (a retried micro-batch would count its examples twice).
            if self.error is None:
                self.error = f"the backward failed in the clipping ({type(e).__name__}: {e})"
            raise

    def _on_backward(self, pid: Tuple[int, int], a, g: torch.Tensor) -> None:
        if self.stale:
            self.error = self.stale_error()
            raise RuntimeError(self.error + "; call zero_grad() first")
        generation, index = pid
        if generation != self.generation or self.parts[index].done or \
                self.parts[index].a is not None:
            self.error = ("a backward reached a DP layer call whose gradient was already taken "
                          "(a second backward through the same forward, or a graph kept across "
                          "zero_grad()); each forward may be back-propagated once")
            raise RuntimeError(self.error)
        part = self.parts[index]
        layer = part.layer
        self._queue_finish()
        if part.in_dims is None or part.in_dims[:1] != (0,) and \
                not hasattr(layer.kind, "per_sample_grads"):
            self.error = (f"layer {layer.name!r} has no verdict on which of its rows are examples "
                          "(Note [batch provenance]); it is not clipped")
            raise RuntimeError(self.error)
        if hasattr(layer.kind, "batch_first"):  # the generic path's outputs, as [B, total]
            g = layer.kind.batch_first(g, part.in_dims)
        b = g.shape[0]
        if self.expected_rows is not None and b != self.expected_rows:
            self.error = (f"layer {layer.name!r} saw a batch of {b} rows in a micro-batch of "
                          f"{self.expected_rows} examples: DP layers need the batch on dim 0 "
                          "(Note [one sample per row]): transpose batch_first=False inputs, and "
                          "expand inputs shared by the batch ([1, ...] broadcast) to the batch")
            raise RuntimeError(self.error)
        if self.batch is None:
            self.batch = b
            self.dropped_mask = torch.zeros(b, dtype=torch.bool, device=g.device)
        elif b != self.batch:
            self.error = (f"layer {layer.name!r} saw a batch of {b} rows where other layers of the "
                          f"same micro-batch saw {self.batch}: DP layers need the batch on dim 0 "
                          "(Note [one sample per row]): transpose batch_first=False inputs, and "
                          "expand inputs shared by the batch ([1, ...] broadcast) to the batch")
            raise RuntimeError(self.error)
        if self.padding:
            g = torch.zeros_like(g)  # exact zeros: the padding row contributes nothing
        kind = layer.kind
        gs = self.group_state[layer.group]
        threshold = self.thresholds[layer.group]
        fused = (len(gs.parts) == 1 and len(self.groups[layer.group]) == 1
                 and math.isfinite(threshold))
        if fused and self.loss_reduction == "mean" and b > 0 and not self.padding:
            g = g * b  # per-sample gradients of a mean loss (the book path: Note [mean loss])
        if hasattr(kind, "per_sample_grads"):
            a = kind.per_sample_grads(layer.module, a, g, layer.train, part.in_dims,
                                      f"{type(layer.module).__name__} {layer.name!r}")
            g = None
        else:
            a = kind.batch_input(layer.module, a)
        gs.received += 1
        if fused:
            # A singleton group: norm, factors and clipped sum in one fused op, in this backward.
            grads, sq, factors = kind.clip(layer.module, a, g, threshold, self.mode, self.gamma,
                                           layer.train)
            self._note_factors(factors)
            part.done = True
            gs.complete = True
            add_into(self._dests(layer), grads)
            self._delivered(layer)
            return
        if math.isfinite(threshold) and isinstance(kind, LinearKind) and layer.train[0]:
            # Note [shared inputs]: the weight's norm is computed when the group completes,
            # together with the other layers that read the same input.
            part.a, part.g, part.other_sq = kind.keep_for_shared_norms(layer.module, a, g,
                                                                       layer.train)
            part.pending = True
        else:
            part.a, part.g = kind.keep(layer.module, a, g, layer.train,
                                       math.isfinite(threshold))
            if isinstance(part.a, Kept):
                part.sq = part.a.sq
            elif math.isfinite(threshold):
                part.sq = kind.sq_norms(layer.module, a, g, layer.train)
            part.sq = self._scaled_sq(part.sq)
        if gs.received == len(gs.parts):
            self._complete(layer.group)

    # ---- completion --------------------------------------------------------------------------

    def _scaled_sq(self, sq: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Note [mean loss]: squared norms of G as delivered -> of the per-sample gradients."""
        return None if sq is None else _dp.mean_scaled_sq(sq, self._mean_scale())

    def _shared_norms(self, pids: List[int]) -> None:
        """Note [shared inputs] in kernels/per_sample_ops.h: the pending Linear weight norms of
        these parts, one linear_sq_norms_multi call per distinct input tensor."""
        by_input: Dict[tuple, List[Part]] = {}
        for pid in pids:
            part = self.parts[pid]
            if not part.pending:
                continue
            a = part.a.a if isinstance(part.a, Kept) else part.a
            key = (a.data_ptr(), tuple(a.shape), tuple(a.stride()), a.dtype, a.device,
                   a._version)
            by_input.setdefault(key, []).append(part)
        for parts in by_input.values():
            first = parts[0].a.a if isinstance(parts[0].a, Kept) else parts[0].a
            gs = [p.a.g if isinstance(p.a, Kept) else p.g for p in parts]
            weights = _ops.linear_sq_norms_multi(first, gs)  # [L, B] certified
            for part, sq in zip(parts, weights):
                total = sq if part.other_sq is None else certified_sum([sq, part.other_sq])
                part.sq, part.other_sq, part.pending = self._scaled_sq(total), None, False

    def _group_norms(self, group: int, pids: List[int]) -> torch.Tensor:
        """[B] float32 certified per-sample norm over the group (triangle bound for components
        of several parts)."""
        by_component: Dict[int, List[torch.Tensor]] = {}
        for pid in pids:
            part = self.parts[pid]
            if part.sq is not None:
                by_component.setdefault(part.layer.component, []).append(part.sq)
        if not by_component:
            return torch.zeros(0)
        return _dp.group_norms(list(by_component.values()))  # Note [certified group norms]

    def _complete(self, group: int) -> None:
        gs = self.group_state[group]
        if gs.complete:
            return
        gs.complete = True
        pids = [pid for pid in gs.parts if self.parts[pid].a is not None]
        if not pids:
            return
        threshold = self.thresholds[group]
        if math.isfinite(threshold):
            self._shared_norms(pids)
            norms = self._group_norms(group, pids)
            factors, _ = _ops.clip_factors(norms, threshold, self.mode, self.gamma)
            self._note_factors(factors)
        else:  # C = inf: no clipping (non-private training through the same path)
            factors = torch.ones(self.batch or 0, dtype=torch.float32,
                                 device=self.dropped_mask.device)
        factors = _dp.mean_scaled_factors(factors, self._mean_scale())  # Note [mean loss]
        for pid in pids:
            part = self.parts[pid]
            layer = part.layer
            dests = self._dests(layer)
            if isinstance(part.a, Kept):
                add_kept_clipped_sums(layer.kind, layer.module, part.a, factors, layer.train,
                                      dests)
            else:
                layer.kind.add_clipped_sums(layer.module, part.a, part.g, factors, layer.train,
                                            dests)
            part.a = part.g = None  # book-keeping ends here for this part
            part.done = True
            self._delivered(layer)

    def _mean_scale(self) -> int:
        """Note [mean loss]: b for a micro-batch of b real rows under loss_reduction="mean", else 1.

        Under a mean loss the per-sample gradients are b times the gradients autograd delivers.
        The fused (singleton-group) path multiplies G by b; the book path does not copy G:
        it scales the squared norms by b^2 (rounded up) and the factors by b (rounded down:
        round_down_f32(c_i * b) * ||g_i|| <= c_i * ||b g_i|| <= C, c_i * b exact in float64),
        which is the same clip of the same per-sample gradients."""
        if self.loss_reduction == "mean" and not self.padding and self.batch:
            return self.batch
        return 1

    def _note_factors(self, factors: torch.Tensor) -> None:
        if factors.numel() == 0:
            return
        self.dropped_mask |= factors == 0

    def _unit_buffer(self, unit: int) -> torch.Tensor:
        """The flat fp32 buffer unit ``unit``'s clipped sums of this micro-batch are added into."""
        buf = self.unit_buf.get(unit)
        if buf is None:
            buf = self.state.grad_accumulator(unit)  # Note [private accumulator]
            if buf is None:
                buf = torch.zeros(self.unit_numel[unit], dtype=torch.float32,
                                  device=self.unit_device[unit])
            else:
                self.direct.add(unit)
            self.unit_buf[unit] = buf
        return buf

    def _dests(self, layer: Layer) -> List[Optional[torch.Tensor]]:
        """Per parameter of ``layer``: its slot in its unit's buffer (the parameter's shape), or
        None where it is not trained."""
        out: List[Optional[torch.Tensor]] = []
        for slot in layer.slots:
            if slot is None:
                out.append(None)
            else:
                buf = self._unit_buffer(slot.unit)
                out.append(buf[slot.offset:slot.offset + slot.numel].view(slot.shape))
        return out

    def _delivered(self, layer: Layer) -> None:
        """One call of ``layer`` has added its clipped sums: hands over each unit that now has
        every contribution of the micro-batch."""
        for slot in layer.slots:
            if slot is None:
                continue
            self.unit_expected[slot.unit] -= 1
            if self.unit_expected[slot.unit] == 0:
                self._hand_over(slot.unit)

    def _hand_over(self, unit: int) -> None:
        buf = self.unit_buf.pop(unit)
        self.unit_expected.pop(unit, None)
        self.handed.add(unit)
        if unit in self.direct:
            return  # already in the engine's buffer (Note [private accumulator])
        self.state.add_unit_grad(unit, buf, release_params=unit not in self.keep_gathered,
                                 donated=True)  # popped above: nothing else holds buf

    # ---- end of backward ---------------------------------------------------------------------

    def _queue_finish(self) -> None:
        if self.callback_queued:
            return
        torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
        self.callback_queued = True

    def finish_backward(self) -> None:
        """Final callback of a backward: completes the groups the backward did not finish, hands
        every unit over that the backward did not (zeros where no part of it ran: every rank
        issues the same reductions whatever its data, Note [collective order]), and closes the
        micro-batch."""
        try:
            self.micro_backwards += 1
            if self.expected_rows is not None and self.micro_backwards > 1:
                self.error = ("a second backward pass reached the clipping within one "
                              "micro-batch of the loader (two forwards on one batch, or an "
                              "input-gradient pass): its examples would be counted twice")
                raise PrivacyViolation(self.error)
            for group in sorted(self.group_state):
                self._complete(group)
            for unit in range(len(self.unit_numel)):
                if unit not in self.handed:
                    self._unit_buffer(unit)  # zeros where no part of it ran
                    self._hand_over(unit)
            if self.batch is not None and not self.padding:  # padding rows count nowhere
                self.stats.samples += self.batch
                self.stats.dropped += int(self.dropped_mask.sum())
            self.stats.micro_batches += 1
        except BaseException as e:
            if self.error is None:
                self.error = f"the end of the backward failed ({type(e).__name__}: {e})"
            raise
        finally:
            self._reset_micro_batch()

    def discard(self) -> None:
        """Drops a micro-batch whose backward never ran (zero_grad between forward and backward)."""
        self._reset_micro_batch()

    def take_stats(self) -> StepStats:
        stats, self.stats = self.stats, StepStats()
        return stats

