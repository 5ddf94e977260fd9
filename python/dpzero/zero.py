"""``dpzero.shard``: ZeRO stages 0-3 for any ``torch.nn.Module`` (the non-private path).

The engine is C++ (``src/zero/``, ``src/comm/``); this module only walks the model, decides the
units, registers the hooks and forwards each hook to one call into ``dpzero._C.zero.ZeroState``
(design.md §1: model traversal and hook registration live in Python, hook bodies in C++).

Units. By default every direct child of the model that holds trainable parameters is a unit;
``nn.ModuleList`` and ``nn.ModuleDict`` children are looked through, so a transformer's blocks
(``model.blocks = nn.ModuleList([...])``) become one unit each, and so are PEFT's tuner wrappers
(their forward is bypassed by PeftModel's). Parameters not inside any unit
(held by the model itself, or by children that are not units) form the root unit. ``units=[names]``
overrides the choice; a parameter belongs to the innermost listed module that contains it.

Coordinates. The model's trainable parameters in ``named_parameters()`` order (tied ones once)
are numbered 0..D-1 (design.md §2.5); a unit's parameters keep that order inside its flat
buffer and keep their global coordinates, whatever unit they land in, and the C++ ShardPlan
checks that the units cover [0, D) exactly once.

Mixed precision (``param_dtype=torch.bfloat16`` or ``torch.float16``), as FSDP2's
``MixedPrecisionPolicy``: the module's parameters become views of a 16-bit buffer and forward and
backward run in that dtype; frozen floating-point parameters are cast to it in place (they have
no master); floating-point inputs of the model and of every unit are cast to it;
the optimizer updates fp32 master weights (Note [master weights] in src/zero/flat_param.h).
Gradients are reduced and accumulated in ``reduce_dtype`` (fp32 by default; the param dtype
halves gradient memory and traffic, ZeRO's 16-bit setting). fp16 has no dynamic loss scaling (a
scaled-then-clipped gradient would change DP clipping, design.md §4): multiply the loss by a
fixed scale and fold its inverse into ``grad_scale``.

Scaling. Gradients are reduced as sums (Note [sum collectives] in src/comm/collectives.h) and
multiplied by ``grad_scale`` before the optimizer. Its default 1/W gives DDP's average over ranks
when each rank's loss is a mean over its own part of the batch; pass 1.0 when the loss is
already normalised globally. Micro-batch gradients accumulate (sum) until ``step()``, which
applies them and zeroes them.
"""

from __future__ import annotations

import functools
import os
import sys
import weakref
from collections.abc import Iterable
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from . import lifetime
from ._C import zero as _zero

__all__ = ["ShardedModule", "default_units", "new_process_group", "shard"]

# Containers without a forward of their own: their children are units, not they.
_LOOK_THROUGH = (nn.ModuleList, nn.ModuleDict)




def _peft_tuner() -> tuple:
    """PEFT's tuner wrapper class (LoraModel, ... are BaseTuners), or () when peft's tuners are
    not imported: then no module can be one. Importing peft here would import transformers and
    torch._dynamo with it in every process that shards a model (experiments/results/build.md)."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    return (tuners.BaseTuner,) if tuners is not None else ()


def _look_through(module: nn.Module) -> bool:
    """Whether default_units makes ``module``'s children units instead of it: containers
    without a forward, and PEFT's tuner wrappers, whose forward PeftModel bypasses (it calls
    ``base_model.model`` directly), so a stage-3 gather hook on the tuner would never fire."""
    return isinstance(module, _LOOK_THROUGH + _peft_tuner())

_DEFAULT_WEIGHT_DECAY = {"sgd": 0.0, "adam": 0.0, "adamw": 1e-2}  # torch.optim's defaults

ROOT_UNIT = _zero.ROOT_UNIT  # the unit of parameters no named unit holds


def new_process_group(backend: str, init_method: str, rank: int, world_size: int,
                      timeout_s: float = 1800.0):
    """A c10d process group created by dpzero's C++ (src/comm/process_group.h), for programs that
    do not call ``torch.distributed.init_process_group``: ``backend`` ``"gloo"`` or ``"nccl"``,
    ``init_method`` ``"tcp://HOST:PORT"`` (rank 0 serves) or ``"file:///PATH"``. Pass it to
    :func:`shard` as ``process_group``. Collectives slower than ``timeout_s`` fail."""
    return _zero.new_process_group(backend, init_method, rank, world_size, timeout_s)


def default_process_group(caller: str):
    """The process group a front door uses when none is given: torch.distributed's default group
    if one is initialised, else None (one process).

    Note [launched without a process group]: a launcher (torchrun, ``torch.distributed.run``,
    SLURM scripts that export torch's variables) states the job's size in ``WORLD_SIZE``. With
    WORLD_SIZE > 1 and no process group, every rank would train alone on its own data, draw its
    own noise and (at rank 0 of each) write its own ledger: W one-rank runs, not one run. That is
    refused, naming the fix, rather than guessed around; the launcher's own variable is the
    statement of intent, not an inference from sizes."""
    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_group()
    world = os.environ.get("WORLD_SIZE", "")
    if not world.strip():
        return None
    try:
        launched = int(world) > 1
    except ValueError:
        raise ValueError(f"{caller}: the environment's WORLD_SIZE={world!r} is not an integer; "
                         "unset it or set the job's number of ranks") from None
    if launched:
        raise RuntimeError(
            f"{caller}: this process is rank {os.environ.get('RANK', '?')} of WORLD_SIZE={world} "
            "(set by torchrun or another launcher), but torch.distributed has no process group, "
            "so each rank would train alone. Call torch.distributed.init_process_group(backend="
            "'gloo' on CPUs or 'nccl' on GPUs) before it, or pass process_group=; to run one "
            "process, start it without the launcher")
    return None


def default_units(model: nn.Module) -> list[str]:
    """The module names that ``shard`` makes units by default (Note [default units] in
    src/zero/default_units.h, the rule both front doors call; this is Python's walk)."""
    walk: list = []

    def visit(prefix: str, module: nn.Module, depth: int) -> None:
        for name, child in module.named_children():
            walk.append((prefix + name, depth, any(p.requires_grad for p in child.parameters()),
                         _look_through(child)))
            visit(prefix + name + ".", child, depth + 1)

    visit("", model, 1)
    return _zero.default_units(walk)


def _plan_units(model: nn.Module, unit_names: list[str], explicit: bool):
    """[(unit name, [(param name, param, global offset)])] in plan order, and the total count."""
    for name in unit_names:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"units: the model has no module named {name!r}") from None
    members: dict[str, list] = {}
    offset = 0
    for name, param in model.named_parameters():  # canonical order, tied parameters once
        if not param.requires_grad:
            continue
        members.setdefault(_zero.owner_unit(name, unit_names), []).append((name, param, offset))
        offset += param.numel()
    if explicit:
        for name in unit_names:
            if name not in members:
                raise ValueError(
                    f"units: module {name!r} holds no trainable parameters of its own (a tied "
                    "parameter belongs to the unit of its first occurrence in named_parameters())"
                )
    order = sorted(members, key=lambda unit: members[unit][0][2])  # by first global coordinate
    return [(unit, members[unit]) for unit in order], offset


class ShardedModule:
    """A model trained under a ZeRO stage. Built by :func:`shard`.

    ``wrapper(*args)`` / ``wrapper.forward(*args)`` run the model (the hooks do the gathering and
    reducing); ``step()`` reduces what is left, scales, updates the owned shard, re-gathers
    parameters (stages 1-2) and zeroes the gradients; ``zero_grad()`` drops accumulated gradients.
    In stage 3 the parameters are only materialised while their unit runs; read them with
    ``full_parameters()`` (a collective: call it on every rank), not ``module.state_dict()``.
    """

    def __init__(self, module: nn.Module, state, units, hook_handles, optimizer_bytes_per_param):
        self.module = module
        self._state = state
        self._units = units
        self._handles = hook_handles
        self._optimizer_bytes = optimizer_bytes_per_param
        # Set by a private engine (Note [state written from data] in private/state_guard.py):
        # release_check(what) raises before a checkpoint releases changed module state;
        # state_loaded() takes what a checkpoint load wrote into the module as its state.
        self.release_check: Optional[Callable[[str], None]] = None
        self.state_loaded: Optional[Callable[[], None]] = None
        # Set by a private engine (Note [the model's own randomness] in src/dp/generators.h):
        # rng_states() gives the generator states a checkpoint saves in place of the live ones.
        self.rng_states: Optional[Callable[[], dict]] = None

    def __del__(self):
        # The hooks reach the engine through weak references (see _hooks_ref); without the
        # wrapper they have nothing to call, so they go with it.
        for handle in getattr(self, "_handles", ()):
            handle.remove()

    def _release_at_exit(self) -> None:
        """Note [ending a script] (lifetime.py): the hooks reach the state through weak
        references, so without it they do nothing."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._state = None

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def step(self) -> None:
        self._state.step()

    def zero_grad(self) -> None:
        self._state.zero_grad()

    @property
    def stage(self) -> int:
        return self._state.stage

    @property
    def rank(self) -> int:
        return self._state.rank

    @property
    def world_size(self) -> int:
        return self._state.world_size

    @property
    def grad_scale(self) -> float:
        return self._state.grad_scale

    @property
    def units(self) -> list[str]:
        """Unit names in plan order (``"<root>"`` for the root unit)."""
        return [name for name, _ in self._units]

    @property
    def unit_members(self) -> list:
        """Each unit's (name, members) in plan order; a member is (canonical name, parameter,
        its other names), in the order of the unit's flat layout (``plan.units[u]``)."""
        return self._units

    @property
    def zero_state(self):
        """The ZeRO state this wraps (``dpzero._C.zero.ZeroState``: the flat units, this rank's
        shards and optimizer state). Its ``step()`` releases gradients without noise: a private
        engine owns it."""
        return self._state

    @property
    def optimizer_bytes_per_param(self) -> int:
        """The optimizer state's bytes per trained coordinate (0 for SGD without momentum)."""
        return self._optimizer_bytes

    @property
    def plan(self):
        """The ``dpzero._C.shard.ShardPlan`` (units' layouts and global coordinates)."""
        return self._state.plan

    @property
    def lr(self) -> float:
        return self._state.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._state.set_lr(float(value))

    @property
    def steps(self) -> int:
        return self._state.steps

    @property
    def param_dtype(self) -> torch.dtype:
        return self._state.param_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self._state.reduce_dtype

    def memory(self) -> dict:
        """Bytes this rank holds now: ``params`` (parameter buffers in the compute dtype, plus
        the owned shards in stage 3), ``master_params`` (separate fp32 master weights under mixed
        precision, else 0), ``grads`` (gradient buffers: full in stages 0-1; in stages 2-3 the owned
        shard, held only from a step's first reduction until the step), ``optimizer_state``; and
        peaks since construction: ``peak_grads`` (gradient buffers held at once, the figure ZeRO's
        formulas count), ``peak_params`` (parameter bytes held at once) and
        ``peak_comm_buffers`` (the largest set of short-lived buffers one unit allocated for a
        collective or a dtype change); and ``host`` (the master, optimizer state and, under
        ``offload_params``, owned parameter shards in host memory while parameters are computed
        on a GPU; on a CPU device ``params`` keeps counting the shards). Autograd's
        per-parameter gradients, which live until their
        unit's backward completes, are not counted. Compare with :func:`predicted_memory`."""
        return self._state.memory()

    def predicted_memory(self) -> dict:
        """ZeRO's model-state bytes per rank for this model, stage, world size and precision
        (src/zero/memory.h): ``params``, ``grads``, ``optimizer`` (fp32 master included), and
        ``total``. ``memory()`` measures the same terms; they differ only by padding — without
        offload: under ``offload_params`` / ``offload_optimizer`` on a GPU, ``memory()`` counts
        the offloaded terms under ``host``, not on the device."""
        elt = lambda dtype: torch.empty((), dtype=dtype).element_size()  # noqa: E731
        return _zero.predict_model_state_bytes(
            self.stage, self.plan.total_coordinates, self.world_size, elt(self.param_dtype),
            elt(self.reduce_dtype), self._optimizer_bytes)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter by canonical name: a fp32 copy of the master weights
        (all-gathers where the master is sharded, stages 1-3: call it on every rank)."""
        out = {}
        for u, (_, members) in enumerate(self._units):
            flat = self._state.full_parameters(u)
            layout = self._state.plan.units[u]
            for (name, param, _), start in zip(members, layout.flat_offsets):
                out[name] = flat[start:start + param.numel()].view(param.shape).clone()
        return out


def _decay_exempt(model: nn.Module, names: Iterable[str] | None) -> set[int]:
    """ids of the trainable parameters named in ``names`` (aliases of tied parameters count);
    ValueError naming one that is not a trainable parameter of ``model``."""
    if names is None:
        return set()
    if isinstance(names, str):
        raise TypeError(f"weight_decay_exempt must be a collection of parameter names, got the "
                        f"string {names!r}")
    by_name = dict(model.named_parameters(remove_duplicate=False))
    out = set()
    for name in names:
        param = by_name.get(name)
        if param is None or not param.requires_grad:
            raise ValueError(f"weight_decay_exempt: {name!r} is not a trainable parameter of "
                             f"the model ({'frozen' if param is not None else 'no such name'})")
        out.add(id(param))
    return out


def _sync_other_state(module: nn.Module, process_group) -> None:
    """Broadcast rank 0's buffers and frozen parameters (the engine syncs the trainable ones)."""
    for tensor in list(module.buffers()) + [p for p in module.parameters() if not p.requires_grad]:
        with torch.no_grad():
            dist.broadcast(tensor.data, src=dist.get_global_rank(process_group, 0),
                           group=process_group)


def shard(
    model: nn.Module,
    *,
    stage: int,
    optimizer: str = "adamw",
    lr: float = 1e-3,
    weight_decay: float | None = None,
    weight_decay_exempt: Iterable[str] | None = None,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    amsgrad: bool = False,
    maximize: bool = False,
    process_group=None,
    units: list[str] | None = None,
    alignment: int = 4,
    grad_scale: float | None = None,
    sync_module_states: bool = True,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    shard_boundaries: str = "even",
    offload_optimizer: bool = False,
    prefetch: bool = True,
    grad_hooks: bool = True,
    offload_params: bool = False,
) -> ShardedModule:
    """Shard ``model`` under ZeRO ``stage`` 0-3 with an optimizer that runs on the owned shard.

    optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"``, with torch.optim's hyperparameters and
        defaults (``weight_decay=None`` means torch's default: 0 for SGD and Adam, 0.01 for AdamW).
    weight_decay_exempt: names (as ``model.named_parameters()`` gives them, or a tied alias) of
        trainable parameters weight decay skips: torch.optim's usual second parameter group
        with ``weight_decay=0`` for biases and norm weights (Note [weight decay runs] in
        src/zero/optim.h).
    process_group: a ``torch.distributed`` process group; ``None`` takes the default group when
        torch.distributed is initialised, else runs as a single rank.
    units: module names to make units (see the module docstring); ``None`` for the default.
    alignment: each parameter's flat offset is a multiple of this many elements.
    grad_scale: factor applied to the summed gradient before the optimizer; ``None`` means 1/W.
    sync_module_states: start every rank from rank 0's parameters and buffers.
    param_dtype: compute dtype of the parameters (float32, bfloat16 or float16; see the module
        docstring on mixed precision); the optimizer always updates fp32 master weights.
    reduce_dtype: dtype gradients are reduced and accumulated in: float32 or ``param_dtype``.
    shard_boundaries: ``"even"`` (equal shards that may cut a parameter) or ``"parameters"``
        (the ragged plan: every parameter lies wholly in one rank's shard, for optimizers and
        quantisers that work on whole tensors; Note [ragged plans] in src/zero/shard_plan.h).
    offload_optimizer: keep the fp32 master weights and the optimizer state in host memory and
        run the optimizer there (ZeRO-Offload); results are identical to no offload.
    offload_params: stage 3 only: keep each rank's parameter shards in host memory too (pinned
        on a GPU), copied to the device for each gather (ZeRO-Infinity's parameter tier, FSDP2's
        CPUOffloadPolicy); implies ``offload_optimizer``; results are identical to no offload
        (Note [parameter offload] in src/zero/flat_param.h).
    prefetch: stage 3: gather the next unit while the current one computes, in forward and in
        backward (Note [stage-3 prefetch] in src/zero/state.h).
    grad_hooks: take gradients from autograd (post-accumulate-grad hooks). The private path
        (``dpzero.make_private``) passes False: it hands the engine clipped sums itself (Note
        [private gradients] in src/zero/unit.h).

    Trainable parameters must be float32 and on one device per unit. Parameters that get no
    gradient in a backward count as zero gradient (torch.optim would skip them).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard: model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer not in _DEFAULT_WEIGHT_DECAY:
        raise ValueError(f"optimizer must be 'sgd', 'adam' or 'adamw', got {optimizer!r}")
    if process_group is None:
        process_group = default_process_group("dpzero.shard")
    world_size = 1 if process_group is None else process_group.size()
    if grad_scale is None:
        grad_scale = 1.0 / world_size
    if weight_decay is None:
        weight_decay = _DEFAULT_WEIGHT_DECAY[optimizer]

    explicit = units is not None
    unit_names = list(units) if explicit else default_units(model)
    planned, total = _plan_units(model, unit_names, explicit)
    exempt = _decay_exempt(model, weight_decay_exempt)
    if process_group is not None and sync_module_states:
        _sync_other_state(model, process_group)
    state = _zero.ZeroState(
        [
            (unit, [p for _, p, _ in members], [n for n, _, _ in members],
             [g for _, _, g in members])
            for unit, members in planned
        ],
        total,
        stage,
        optimizer,
        lr,
        weight_decay,
        maximize,
        momentum,
        dampening,
        nesterov,
        tuple(betas),
        eps,
        amsgrad,
        process_group,
        alignment,
        grad_scale,
        sync_module_states,
        param_dtype,
        reduce_dtype,
        shard_boundaries,
        offload_optimizer,
        prefetch,
        offload_params,
    )
    if exempt:
        for u, (_, members) in enumerate(planned):
            state.set_decay_exempt(u, [id(p) in exempt for _, p, _ in members])
    handles = []
    if param_dtype != torch.float32:
        _cast_frozen(model, param_dtype)
        handles += _register_input_casts(model, planned, param_dtype)
    if grad_hooks and state.needs_grad_hooks:
        handles += _register_grad_hooks(_hooks_ref(state), planned)
    if stage == 3:
        _raise_from_is_shared()
        handles += _register_gather_hooks(model, _hooks_ref(state), planned)
    k = _zero.optimizer_bytes_per_param(
        optimizer, momentum=momentum, amsgrad=amsgrad,
        # a separate fp32 master, unless parameter offload makes the fp32 host shard the master
        mixed=param_dtype != torch.float32 or (offload_optimizer and not offload_params))
    sharded = ShardedModule(model, state, planned, handles, k)
    lifetime.track(sharded, ShardedModule._release_at_exit)  # Note [ending a script]
    return sharded


_TORCH_IS_SHARED = torch.UntypedStorage.is_shared


def _is_shared(storage: torch.UntypedStorage) -> bool:
    """torch's ``UntypedStorage.is_shared``, except that a storage refusing data access raises
    its message as a RuntimeError instead of ending the process (Notes [reading a resharded
    parameter] in src/zero/flat_param.h and [views kept across a reshard] in
    src/zero/storage_access.h)."""
    if storage.device.type != "cuda":  # torch answers True for CUDA before reading the pointer
        storage.data_ptr()  # raises, with torch's error handling, where is_shared would abort
    return _TORCH_IS_SHARED(storage)


def _raise_from_is_shared() -> None:
    """Stage 3: ``tensor.is_shared()`` on a resharded parameter, or on a view of its unit kept
    across the reshard, reaches a C function of torch's that reads the storage's pointer without
    translating a C++ exception, so the refusal called std::terminate there. Installed once per
    process, it changes nothing for a storage that has memory."""
    if torch.UntypedStorage.is_shared is not _is_shared:
        torch.UntypedStorage.is_shared = _is_shared


def _cast_frozen(model: nn.Module, dtype: torch.dtype) -> None:
    """Mixed precision: every frozen floating-point parameter takes the compute dtype, in place
    (the layers that read it compute in that dtype, and it has no master to keep, as FSDP2's
    param_dtype casts every parameter of the modules it manages); a frozen float32 weight would
    meet 16-bit activations and fail. Buffers keep their dtype."""
    with torch.no_grad():
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None and not p.requires_grad and p.is_floating_point() \
                        and p.dtype != dtype:
                    p.data = p.data.to(dtype)


def _cast_inputs(dtype: torch.dtype, _module, args, kwargs):
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return pytree.tree_map(cast, args), pytree.tree_map(cast, kwargs)


def _register_input_casts(model: nn.Module, planned, dtype: torch.dtype):
    """Mixed precision: cast floating-point inputs of the model and of every unit's module to the
    compute dtype (FSDP2's cast_forward_inputs), so fp32 activations or masks created between
    units do not meet 16-bit weights."""
    modules = [model] + [model.get_submodule(unit) for unit, _ in planned if unit != ROOT_UNIT]
    cast = functools.partial(_cast_inputs, dtype)
    return [m.register_forward_pre_hook(cast, with_kwargs=True) for m in modules]


def _hooks_ref(state):
    """What the hooks hold: a weak reference to the engine. The engine holds the parameters (in
    C++, which keeps their Python objects alive) and the parameters hold the hooks, so a strong
    reference would make a cycle the garbage collector cannot see through: the engine, its
    buffers, optimizer state and process group would outlive the wrapper forever."""
    return weakref.ref(state)


def _grad_ready(state_ref, unit: int, index: int, _param) -> None:
    state = state_ref()
    if state is not None:
        state.grad_ready(unit, index)


def _register_grad_hooks(state_ref, planned):
    """Stages 2-3 (and 0-1 when gradients are reduced in another dtype than the parameters'):
    each parameter's post-accumulate-grad hook tells the engine its gradient of this backward is
    final (Note [gradient buffers] in src/zero/unit.h)."""
    handles = []
    for u, (_, members) in enumerate(planned):
        for i, (_, param, _) in enumerate(members):
            handles.append(
                param.register_post_accumulate_grad_hook(
                    functools.partial(_grad_ready, state_ref, u, i))
            )
    return handles


def _pre_forward(state_ref, unit: int, _module, _args) -> None:
    state = state_ref()
    if state is not None:
        state.pre_forward(unit)


def _pre_backward(state_ref, unit: int, _grad) -> None:
    state = state_ref()
    if state is not None:
        state.pre_backward(unit)


def _post_forward(state_ref, unit: int, _module, _args, output) -> None:
    state = state_ref()
    if state is None:
        return
    state.post_forward(unit)
    hook = functools.partial(_pre_backward, state_ref, unit)
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            leaf.register_hook(hook)


def _register_gather_hooks(model: nn.Module, state_ref, planned):
    """Stage 3 (Note [stage-3 gathers] in src/zero/unit.h): gather a unit before the forward
    of every module that uses its parameters and before that module's backward; free it after
    the forward. A unit's own module covers everything inside it; a module outside it that holds
    one of its parameters (a tied output head) is hooked for that unit too."""
    unit_of = {}
    for u, (_, members) in enumerate(planned):
        for _, param, _ in members:
            unit_of[id(param)] = u
    hooked: list[tuple[nn.Module, int]] = []
    inside: list[set[int]] = []
    for unit, _ in planned:
        module = model if unit == ROOT_UNIT else model.get_submodule(unit)
        hooked.append((module, len(inside)))
        inside.append({id(m) for m in module.modules()})
    for module in model.modules():
        users = {unit_of[id(p)] for p in module._parameters.values()
                 if p is not None and id(p) in unit_of}
        for u in sorted(users):
            if id(module) not in inside[u]:
                hooked.append((module, u))
    handles = []
    for module, u in hooked:
        handles.append(
            module.register_forward_pre_hook(functools.partial(_pre_forward, state_ref, u)))
        handles.append(
            module.register_forward_hook(functools.partial(_post_forward, state_ref, u)))
    return handles
