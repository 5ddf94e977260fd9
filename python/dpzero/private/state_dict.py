"""``model.state_dict()`` and ``model.load_state_dict()`` of a private model, as torch's.

Note [module state dicts]
~~~~~~~~~~~~~~~~~~~~~~~~~
An ordinary script saves ``model.state_dict()`` and resumes with ``model.load_state_dict()``.
Where the trainable parameters' storage is the engine's master (fp32 compute, stages 0–2, no
offload: Note [master weights] in src/zero/flat_param.h) torch's own functions are right as they
are: the module's parameters ARE the master, and each rank loading the same values writes its
own shard. Elsewhere they are not:

* stage 3 frees the parameters' storage outside the forward (torch would read or write freed
  memory);
* with 16-bit compute or offload, the master is a separate fp32 tensor (a loaded value would be
  overwritten by the next step, from the old master).

There, hooks on the model make the state dict hold the fp32 master values (gathered: a
collective with several ranks, as FSDP's full state dict: every rank calls ``state_dict()``, not
rank 0 alone) and make loading write the master, from which the engine publishes the parameters.
``state_dict(keep_vars=True)`` asks for the Parameter objects themselves and gathers nothing.
Only trainable parameters are the engine's; buffers and frozen parameters are torch's as usual.

Every ``state_dict()`` is a release of the model's buffers and frozen parameters, so it first
verifies them (Note [state written from data] in state_guard.py): every rank refuses when one
does where the call is a collective anyway (the gathering hooks above), otherwise each rank
checks its own. ``load_state_dict()`` makes the loaded buffers and frozen parameters the
model's fixed state.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from .slots import Slots
from .state_guard import StateGuard


def engine_holds_values(sharded) -> bool:
    """Whether the trainable parameters' values live only in the engine (module docstring)."""
    state = sharded.zero_state
    return (sharded.stage == 3 or state.param_dtype != torch.float32
            or state.offload_optimizer or state.offload_params)


def register(model: nn.Module, *, sharded, slots: Slots, guard: StateGuard,
             verify_release: Callable[..., None]) -> List:
    """The hooks of this module's docstring on ``model``, a private engine's: ``sharded`` its
    ZeRO model, ``slots`` where the trained parameters live, ``guard`` the model's fixed state
    (Note [state written from data]), ``verify_release(what, collective=)`` its check before a
    release. Returns the hooks' handles."""
    gathers = engine_holds_values(sharded)
    # Every name a trainable parameter has in the state dict (tied ones under each name).
    names = {name: p for name, p in model.named_parameters(remove_duplicate=False) if p in slots}
    # Loaded values by state-dict key, from the pre-hook to the post-hook.
    pending: Dict[str, Tuple[nn.Parameter, torch.Tensor]] = {}
    # Buffers and frozen parameters offered by the load, by name, with the values offered, from
    # the pre-hook to the post-hook.
    loaded_state: Dict[str, object] = {}
    clean: list = []  # [StateGuard.clean_trained() before the load]

    def gathered() -> Dict[int, torch.Tensor]:
        zero = sharded.zero_state
        return {u: zero.full_parameters(u) for u in range(zero.num_units)}  # collective

    keep_vars = []  # the state_dict() call's keep_vars, from the pre-hook to the post-hook

    def save_pre(module, prefix, keep):
        keep_vars.append(keep)

    def save_post(module, state_dict, prefix, local_metadata):
        keep = keep_vars.pop() if keep_vars else False
        # A collective where the call gathers (Note [module state dicts]); else this rank's own.
        verify_release("model.state_dict()", collective=gathers and not keep)
        if keep or not gathers:
            return  # the Parameter objects asked for, or the module's parameters are the master
        flats = gathered()
        # A tied parameter is one tensor under each of its names, as in torch's own state dict:
        # savers that keep shared tensors once (torch.save, Hugging Face's safetensors writer)
        # then write it once.
        values: Dict[int, torch.Tensor] = {}
        for name, p in names.items():
            if prefix + name in state_dict:
                if id(p) not in values:
                    values[id(p)] = slots.read(flats[slots.unit(p)], p).clone()
                state_dict[prefix + name] = values[id(p)]

    def load_pre(module, state_dict, prefix, local_metadata, strict, missing, unexpected,
                 errors):
        loaded_state.clear()
        loaded_state.update((key[len(prefix):], value) for key, value in state_dict.items()
                            if key.startswith(prefix) and key[len(prefix):] not in names)
        if not gathers:  # (a gathering load asks per unit: Slots.load_unit)
            clean[:] = [guard.clean_trained()]  # what the load may re-record after it
            return
        # Taken out before torch copies them into the (freed or stale) parameters.
        for name, p in names.items():
            key = prefix + name
            if key not in state_dict:
                continue
            v = state_dict.pop(key)
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(p.shape):
                errors.append(f"size mismatch for {key}: copying a param with shape "
                              f"{tuple(getattr(v, 'shape', ()))} from checkpoint, the shape in "
                              f"current model is {tuple(p.shape)}.")
                continue
            pending[key] = (p, v.detach())

    def load_post(module, incompatible):
        state = guard
        known = {e.name for e in state.entries}
        # Only what the load really wrote becomes the model's state: torch reports a tensor it
        # could not copy (a shape mismatch) after this hook, and the tensor keeps its old value,
        # which may have been written from the data.
        tensors = dict(module.named_buffers())
        tensors.update(module.named_parameters())
        accepted = [n for n, v in loaded_state.items()
                    if n in known and _holds(tensors.get(n), v)]
        loaded_state.clear()
        if accepted:
            state.accept(accepted)  # what the caller loaded is the model's state now
        if not gathers:
            # torch copied the loaded values into the parameters: the memories that held their
            # recorded values before the load are recorded anew
            state.record_trained(clean=clean.pop() if clean else set())
            return
        taken = list(pending.values())
        # The keys taken out above were loaded, not missing.
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys
                                        if k not in pending]
        pending.clear()
        slots.load_parameters(taken)

    return [model.register_state_dict_pre_hook(save_pre),
            model.register_state_dict_post_hook(save_post),
            model.register_load_state_dict_pre_hook(load_pre),
            model.register_load_state_dict_post_hook(load_post)]


def _holds(current, value) -> bool:
    """Whether the module's tensor ``current`` now holds ``value`` exactly (NaN where the value
    has NaN)."""
    if not isinstance(value, torch.Tensor) or not isinstance(current, torch.Tensor) \
            or current.shape != value.shape:
        return False
    current = current.detach()
    value = value.detach().to(device=current.device, dtype=current.dtype)
    same = current == value
    if current.is_floating_point() or current.is_complex():
        same = same | (current.isnan() & value.isnan())
    return bool(same.all())
