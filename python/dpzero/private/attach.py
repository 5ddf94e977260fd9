"""Walking a model: which modules become DP layers, validation, and the patched forwards.

``attach(model, sharded, book_factory)`` finds every module with trainable parameters of its own,
gives it a layer kind (``layers.py``) or the generic path (``fallback.py``), checks that nothing
escapes clipping (design.md §3 "No silent non-privacy"), groups tied layers into components, and
replaces each DP module's ``forward`` (an instance attribute, removed by ``detach``) by one that
routes the call through the clipping book, and the model's own forward by the root forward that
decides which layer inputs hold the examples (provenance/root.py, Note [batch provenance]).
"""

from __future__ import annotations

import collections
import functools
import types
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .. import _C
from . import attention, group_norm, recurrent, relative_bias
from .book import Layer, Slot
from .errors import PrivacyViolation
from .fallback import BYPASS, FuncKind, OutputLayout, swapped, taken_whole, tap
from .group_norm import GroupNormKind
from .layers import (ORIGINAL_FORWARD, EmbeddingKind, LayerKind, LinearKind, autocast_dtype,
                     calls_base_forward, dp_apply, layer_kind, overridden_base)
from .provenance.records import input_record, record
from .provenance.root import compiled_out_root_forward

# Module types that cannot run under DP, with the reason the error gives.
_REJECTED = (
    (nn.modules.batchnorm._BatchNorm,
     "BatchNorm normalises each example with statistics of the whole batch, so one example's "
     "gradient depends on the others and per-sample clipping bounds nothing; use GroupNorm, "
     "LayerNorm or InstanceNorm without running stats"),
    (nn.modules.instancenorm._InstanceNorm, None),  # only with running stats: checked below
)


def _dynamic_rope(module: nn.Module) -> bool:
    """A Hugging Face rotary embedding that rewrites its inv_freq buffer from the batch's
    longest position (rope_type "dynamic" or "longrope", transformers' dynamic_rope_update)."""
    kinds = getattr(module, "rope_type", None)
    kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
    return "inv_freq" in module._buffers and any(
        isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in kinds)


def rejection(module: nn.Module) -> Optional[str]:
    if _dynamic_rope(module):
        return (f"rope_type {getattr(module, 'rope_type')!r} recomputes the rotary frequencies "
                "(its inv_freq buffer) from the longest sequence of the batch, so the model's "
                "state, and whether a step is refused for writing it, would follow the training "
                "examples' lengths; use a fixed rope_type (default, linear, yarn, llama3)")
    if isinstance(module, nn.Embedding) and module.max_norm is not None:
        return (f"max_norm={module.max_norm} renormalises the looked-up rows of the weight in "
                "place during the forward, so the table (trained or frozen) comes to depend on "
                "which ids the training examples hold, without noise, and carries that into "
                "later steps and the released model; set max_norm=None (renormalise the table "
                "once before make_private if you need bounded rows)")
    for cls, why in _REJECTED:
        if isinstance(module, cls):
            if cls is nn.modules.instancenorm._InstanceNorm:
                if module.track_running_stats:
                    return ("InstanceNorm with track_running_stats=True averages statistics "
                            "of the training examples into buffers that are released with the "
                            "model, without noise; use track_running_stats=False")
                continue
            return why
    return None


def find_layers(model: nn.Module, slot_of: Dict[int, Slot]) -> List[Layer]:
    """Every module holding trainable parameters of its own, as a Layer. Raises
    PrivacyViolation naming every module that cannot be covered."""
    problems: List[str] = []
    layers: List[Layer] = []
    whole: List[str] = []  # modules the generic path takes with their children (taken_whole)
    owners = collections.Counter(id(p) for m in model.modules()
                                 for p in m._parameters.values() if p is not None)
    for name, module in model.named_modules():
        if any(w == "" or name.startswith(w + ".") for w in whole):  # "": the root, whole
            continue
        why = rejection(module)
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if p is not None]
        trainable_own = [n for n, p in own if p.requires_grad]
        # Running statistics, and an Embedding's rows renormalised by max_norm, are state
        # written from the training data without noise and released with the model: refused
        # even when the module has nothing to train.
        written_from_data = isinstance(module, nn.modules.batchnorm._BatchNorm) or (
            isinstance(module, nn.modules.instancenorm._InstanceNorm)
            and module.track_running_stats) or (
            isinstance(module, nn.Embedding) and module.max_norm is not None) or \
            _dynamic_rope(module)
        if why is not None and (trainable_own or written_from_data):
            problems.append(f"{name or '<model>'} ({type(module).__name__}): {why}")
            continue
        # Note [attention through the kernels] (attention.py)
        kernel_attention = isinstance(module, nn.MultiheadAttention) and \
            not taken_whole(module) and attention.generic_reason(module, owners) is None
        if taken_whole(module) or (isinstance(module, nn.MultiheadAttention) and
                                   not kernel_attention):
            whole.append(name)
            own = [(n, p) for n, p in module.named_parameters() if p is not None]
            trainable_own = [n for n, p in own if p.requires_grad]
        if not trainable_own:
            continue
        if kernel_attention:
            layers.extend(_projection_layers(
                [(attention.name_of(name, p.which), p) for p in attention.projections(module)],
                attention.ProjectionKind, slot_of, len(layers), blocks=True))
            continue
        # Note [recurrence through the kernels] (recurrent.py)
        if isinstance(module, nn.RNNBase) and not taken_whole(module) and \
                recurrent.generic_reason(module) is None:
            layers.extend(_projection_layers(
                [(recurrent.name_of(name, suffix, part), p)
                 for (suffix, part), p in recurrent.projections(module).items()],
                lambda: LinearKind(transposed=False), slot_of, len(layers), blocks=False))
            continue
        # No kernel (a module using its parameters directly, the model's root, a subclass of a
        # kernel layer overriding its forward without calling the base's, taken_whole): the
        # generic path (fallback.py). Note [subclass forwards]: one that calls the base's
        # forward keeps the kernel.
        routed = overridden_base(module) is not None and calls_base_forward(module) \
            and not taken_whole(module)
        kind = None if taken_whole(module) else layer_kind(module, through_super=routed)
        if kind is None:
            # Note [group norm in closed form] (group_norm.py)
            kind = (GroupNormKind if group_norm.closed_form(module) else FuncKind)(
                [n for n, _ in own])
        computed = [n for n in kind.params if not isinstance(kind, FuncKind) and
                    isinstance(getattr(module, n, None), torch.Tensor) and
                    getattr(module, n).requires_grad and module._parameters.get(n) is None]
        if computed:
            # A tensor the kernel would read as a parameter, computed from parameters outside the
            # forward (the deprecated torch.nn.utils.weight_norm's pre-hook): its gradient is not
            # the one the kernel computes, and a per-example recompute would skip the hook.
            problems.append(f"{name} ({type(module).__name__}): its {computed} are computed "
                            "from other parameters before its forward (a forward pre-hook, "
                            "e.g. the deprecated torch.nn.utils.weight_norm), which per-sample "
                            "clipping cannot follow; use torch.nn.utils.parametrizations."
                            "weight_norm (a parametrization), or freeze the module")
            continue
        extra = [n for n in trainable_own if n not in kind.params]
        if extra:
            problems.append(f"{name} ({type(module).__name__}): parameters {extra} are not "
                            "covered by its per-sample ops")
            continue
        reason = kind.check(module)
        if reason is not None:
            problems.append(f"{name} ({type(module).__name__}): {reason}")
            continue
        train, slots = [], []
        for pname in kind.params:
            p = module.get_parameter(pname) if isinstance(kind, FuncKind) else \
                getattr(module, pname, None)
            trainable = isinstance(p, torch.Tensor) and p.requires_grad
            train.append(trainable)
            slots.append(slot_of[id(p)] if trainable else None)
        layers.append(Layer(len(layers), name, module, kind, tuple(train), slots,
                            routed=routed and not isinstance(kind, FuncKind)))
    if problems:
        error = PrivacyViolation(
            "these modules cannot be trained privately (every trainable parameter must be "
            "covered by a DP layer; frozen parameters are fine):\n  " + "\n  ".join(problems))
        error.problems = problems  # one "name (Type): reason and fix" each (validators.py)
        raise error
    return layers


def _projection_layers(named: List[Tuple[str, nn.Module]], kind: Callable[[], LayerKind],
                       slot_of: Dict[int, Slot], first: int, blocks: bool) -> List[Layer]:
    """Projections (``(layer name, projection)``: a module's linear maps whose ``weight`` and
    ``bias`` are its parameters or, with ``blocks``, contiguous row blocks of them,
    ``source(name)`` the parameter each lies in) as DP layers of ``kind``, each with the slots
    of its blocks (Note [attention through the kernels] in attention.py, Note [recurrence
    through the kernels] in recurrent.py); a projection with nothing trainable is no layer.
    Its clipping component: its own, for blocks (disjoint rows of one parameter); else that of
    its parameters, shared with every layer that holds one of them (a tied weight)."""
    layers: List[Layer] = []
    for name, proj in named:
        train, slots = [], []
        for pname in ("weight", "bias"):
            source = proj.source(pname)
            trainable = isinstance(source, torch.Tensor) and source.requires_grad
            train.append(trainable)
            if not trainable:
                slots.append(None)
                continue
            whole, block = slot_of[id(source)], getattr(proj, pname)  # contiguous rows
            slots.append(None if whole is None else  # None: validators.py lists no slots
                         Slot(whole.unit,
                              whole.offset + block.storage_offset() - source.storage_offset(),
                              block.numel(), block.shape))
        if any(train):
            keys = (id(proj),) if blocks else tuple(
                id(proj.source(n)) for n, t in zip(("weight", "bias"), train) if t)
            layers.append(Layer(first + len(layers), name, proj, kind(), tuple(train), slots,
                                keys=keys))
    return layers


def assign_components(layers: List[Layer]) -> int:
    """Layers sharing a trained parameter form one component (``layer_components`` in
    src/dp/run.h); sets each layer's ``component`` and returns how many there are."""
    params = [list(layer.keys) if layer.keys is not None else
              [id(layer.module.get_parameter(name))
               for name, trained in zip(layer.kind.params, layer.train) if trained]
              for layer in layers]
    components = _C.dp.layer_components(params)
    for layer, component in zip(layers, components):
        layer.component = component
    return max(components) + 1 if components else 0


def _patched_forward(book_ref, layer: Layer, original, *args, **kwargs):
    # Runs at every call of every DP layer: the common case (a kernel layer inside the root
    # forward) reads as few attributes and makes as few calls as it can.
    book = book_ref()
    if book is None or BYPASS.depth or not torch.is_grad_enabled():
        return original(*args, **kwargs)
    if book.probe is not None:  # Note [batch provenance]: run and record, register nothing
        return book.probe.call(layer, original, args, kwargs)
    # Note [recomputed forwards] in book.py: a forward inside a backward is a recompute.
    recompute = torch._C._current_graph_task_id() != -1
    if recompute:
        book.on_recompute(layer)
    kind = layer.kind
    refused = not recompute and book.root is None  # Note [batch provenance]
    if isinstance(kind, FuncKind):
        return _fallback_forward(book, layer, original, _trainable_params(layer), args, kwargs,
                                 recompute, refused)
    if (len(args) != 1 and not (kind.context and args)) or kwargs:
        raise PrivacyViolation(
            f"DP layer {layer.name!r} ({type(layer.module).__name__}) was called with "
            f"{len(args)} positional and {sorted(kwargs)} keyword arguments; DP layers take one "
            "input")
    x = args[0]
    if refused:
        # Note [batch provenance]: a refused forward (other data, evaluated with gradients on)
        # keeps the model's own shapes.
        return _refused_call(book, layer, x, book.refusal_text(layer))
    if isinstance(kind, EmbeddingKind) and x.dim() > 1 and x.shape[0] == 1:
        rows = book.expected_rows or 1
        if rows > 1:
            # Note [broadcast positions]: position ids are often one row [1, T] whose embedding
            # is broadcast over the batch (GPT-2's and BERT's position_ids). Their gradient then
            # sums every sample's; expanded to [B, T] the lookup gives the same values after the
            # broadcast, and each row's gradient is that sample's own. The root forward's
            # verdict confirms the ids are shared by the batch (Note [batch provenance]). The
            # record keeps the call's own [1, T] (what the probe compares).
            x = x.expand(rows, *x.shape[1:])
    if recompute:
        # A recomputed call runs the same ops on the same inputs (expanded as the original
        # call's were), so that it saves the tensors the original call saved (Note [recomputed
        # forwards] in book.py).
        return _refused_call(book, layer, x, book.recompute_text(layer))
    # The record is of the call as made (before any expansion): what the probe compares, with
    # its context if it has one (Note [call context] in provenance/records.py).
    generation, part = book.on_forward(
        layer.index, input_record(layer.index, args[0]) if len(args) == 1 else
        record(layer.index, args, {}))
    if hasattr(kind, "dp_call"):  # the C++ autograd function (src/dp/dp_layers.h)
        return kind.dp_call(layer.module, x, book.core, generation, part, None)
    pid = (generation, part, layer.index)
    return dp_apply(kind, layer.module, functools.partial(book.on_backward, pid), x,
                    _trainable_params(layer))


def _refused_call(book, layer: Layer, x, refusal: str):
    """A kernel layer's call that registers nothing (refused, or a recompute): its backward, if
    it ever runs, raises ``refusal``."""
    if hasattr(layer.kind, "dp_call"):
        return layer.kind.dp_call(layer.module, x, book.core, 0, -1, refusal)
    return dp_apply(layer.kind, layer.module, book.refusing(refusal), x, _trainable_params(layer))


def _trainable_params(layer: Layer) -> list:
    """The layer's trainable parameters, read from its module at the call."""
    return [layer.module.get_parameter(n) for n, t in zip(layer.kind.params, layer.train) if t]


def _fallback_forward(book, layer, original, params, args, kwargs, recompute=False,
                      refused=False):
    """The generic path's forward (fallback.py): the module with its trainable parameters
    detached, every floating tensor of its output tapped for the book."""
    module = layer.module
    detached = {n: p.detach() for n, p in zip(
        [n for n, t in zip(layer.kind.params, layer.train) if t], params)}
    with swapped(module, detached):
        out = original(*args, **kwargs)
    leaves, spec = pytree.tree_flatten(out)
    tapped = tuple(i for i, t in enumerate(leaves)
                   if isinstance(t, torch.Tensor) and t.is_floating_point())
    if not tapped:
        raise PrivacyViolation(
            f"module {layer.name!r} ({type(module).__name__}) uses its parameters directly and "
            f"returned no floating tensor ({type(out).__name__}); nothing carries its gradient")
    outputs = [leaves[i] for i in tapped]
    if recompute:
        new = tap(book.refusing(book.recompute_text(layer)), outputs, params)
    elif refused:
        new = tap(book.refusing(book.refusal_text(layer)), outputs, params)
    else:
        pid = (*book.on_forward(layer.index, record(layer.index, args, kwargs, outputs)),
               layer.index)
        detach = lambda a: a.detach() if isinstance(a, torch.Tensor) else a  # noqa: E731
        device = outputs[0].device.type
        versions = tuple(t._version if isinstance(t, torch.Tensor) else -1
                         for t in pytree.tree_leaves((args, kwargs)))
        saved = (pytree.tree_map(detach, args), pytree.tree_map(detach, kwargs),
                 OutputLayout(spec, tapped, tuple(tuple(t.shape) for t in outputs),
                              tuple(t.detach() for t in outputs), versions),
                 autocast_dtype(device))

        def on_backward(grads, pid=pid, saved=saved):
            book.on_backward(pid, saved, list(grads))

        new = tap(on_backward, outputs, params)
    for i, t in zip(tapped, new):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, spec)


def patch(model: nn.Module, layers: List[Layer], book_ref, ranks, devices) -> None:
    """Routes every DP layer's forward through the book, then the model's own forward through
    the root forward (Note [batch provenance]); ``ranks`` (provenance.Ranks) and ``devices``
    are the probe's."""
    for layer in layers:
        module = layer.module
        if layer.routed:  # Note [subclass forwards]
            base = overridden_base(module)
            original = types.MethodType(base.forward, module)
            module.__dict__[ORIGINAL_FORWARD] = original
            module._dp_route = functools.partial(_patched_forward, book_ref, layer, original)
            module.__class__ = _routed_class(type(module), base)
            continue
        original = module.forward
        module.__dict__[ORIGINAL_FORWARD] = original
        module.forward = functools.partial(_patched_forward, book_ref, layer, original)
    attention.patch(model, layers)  # Note [attention through the kernels]
    recurrent.patch(model, layers)  # Note [recurrence through the kernels]
    relative_bias.install(model)  # Note [relative position bias]
    cache_off(model)  # Note [no key/value cache]
    original = model.forward
    model._dp_root_previous = model.__dict__.get("forward")
    model.forward = functools.partial(compiled_out_root_forward(), book_ref, ranks, devices,
                                      model, original)


# Note [subclass forwards]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A vetted subclass of a kernel layer that overrides forward and calls super().forward
# (layers.ROUTED_SUBCLASSES: BART's and OPT's learned positions compute their ids first, BART's
# and Gemma's scaled embeddings multiply the lookup after) keeps the kernel: its own forward runs
# as written, and only the base class's forward, which super() reaches, is routed through the DP
# layer. Any other overriding subclass takes the generic path: what an unvetted forward does
# around super().forward could mix examples, which only the generic recompute checks. The
# instance's class becomes a subclass of it whose MRO puts a routing class between it and the
# base (type(module).forward is still the user's; super(UserClass, self).forward is the
# router's), restored by unpatch. What the overriding forward does around the call is ordinary
# autograd: G includes a scale applied after, and ids computed before (positions) are judged by
# the probe like any ids (Note [batch provenance]). Should that forward also use the weight
# directly, autograd gives it a gradient and the guard (guard_hooks) stops the backward.
# Subclasses that never call super().forward take the generic path.
_ROUTED: Dict[Tuple[type, type], type] = {}


def _routed_class(cls: type, base: type) -> type:
    key = (cls, base)
    if key not in _ROUTED:
        router = type(f"DP{base.__name__}", (base,), {
            "forward": lambda self, *args, **kwargs: self.__dict__["_dp_route"](*args, **kwargs),
            "__module__": __name__})
        _ROUTED[key] = type(cls.__name__, (cls, router),
                            {"__module__": cls.__module__, "_dp_unrouted": cls})
    return _ROUTED[key]


# Note [no key/value cache]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# A Hugging Face decoder with use_cache=True (OPT's default) builds a key/value cache in every
# forward, training too: one object, written by each layer with every example's keys and values
# and handed to the next layers. It is state written from the examples that the layers read, and
# the generic path's per-example recompute of a layer would read and extend it again. Training
# never reads it back, and a model's outputs are the same without it (past_key_values is None),
# so the private model runs with its config's use_cache off (restored by detach). A cache passed
# explicitly (use_cache=True in the call) is refused where the probe sees its state grow with the
# examples (provenance._equal).
def cache_off(model: nn.Module) -> None:
    """Turns use_cache off in the config of every module that has one (a Hugging Face backbone
    inside the model too), keeping the configs it changed for unpatch."""
    changed = {}
    for m in model.modules():
        config = m.__dict__.get("config")
        if getattr(config, "use_cache", None) is True and id(config) not in changed:
            config.use_cache = False
            changed[id(config)] = config
    model.__dict__["_dp_use_cache"] = list(changed.values())


def unpatch(model: nn.Module, layers: List[Layer]) -> None:
    for config in model.__dict__.pop("_dp_use_cache", ()):
        config.use_cache = True
    relative_bias.remove(model)
    previous = model.__dict__.pop("_dp_root_previous", None)
    if previous is not None:
        model.forward = previous
    else:
        model.__dict__.pop("forward", None)
    attention.unpatch(model)  # after the root's, whose previous forward may be attention's
    recurrent.unpatch(model)
    for layer in layers:
        module = layer.module
        if "forward" in module.__dict__:
            del module.forward
        module.__dict__.pop(ORIGINAL_FORWARD, None)
        if module.__dict__.pop("_dp_route", None) is not None:
            module.__class__ = type(module)._dp_unrouted


def guard_hooks(model: nn.Module, book_ref) -> List:
    """A trainable parameter that autograd gives a gradient escaped its DP layer (used outside
    it, e.g. ``F.linear(h, self.wte.weight)``): that gradient is unclipped. A gradient hook on the
    parameter sees it before AccumulateGrad adds it anywhere, records the violation (the optimizer
    step then refuses until zero_grad) and raises, which stops the backward. A C++ DP layer's node
    has no edge to its parameters (Note [no parameter edges] in src/dp/dp_layers.h); the Python
    autograd functions and the generic path's tap give theirs no gradient, so the hook sees
    None."""
    handles = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue

        def hook(grad, name=name):
            if grad is None:
                return None
            msg = (f"parameter {name!r} received a gradient from autograd: it is used outside "
                   "its DP layer, so that gradient would escape clipping")
            book = book_ref()
            if book is not None:
                book.error = msg
            raise PrivacyViolation(msg)

        handles.append(p.register_hook(hook))
    return handles


def param_slots(sharded) -> Tuple[Dict[int, Slot], List[int], List[torch.device]]:
    """id(param) -> Slot, each unit's padded numel and device, from the engine's plan."""
    slot_of: Dict[int, Slot] = {}
    numel, devices = [], []
    for u, (_, members) in enumerate(sharded.unit_members):
        layout = sharded.plan.units[u]
        numel.append(layout.padded_numel)
        devices.append(members[0][1].device)
        for (_, param, _), offset in zip(members, layout.flat_offsets):
            slot_of[id(param)] = Slot(u, offset, param.numel(), param.shape)
    return slot_of, numel, devices
