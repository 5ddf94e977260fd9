"""Sharded checkpoints of a :class:`dpzero.ShardedModule`: ``save`` and ``load``.

Every rank writes the coordinates it owns (master parameters and optimizer state) into its own
file; rank 0 commits them with a manifest, atomically (a crash mid-save leaves the previous
checkpoint and ``ROOT/latest`` as they were). A checkpoint loads into any world size, ZeRO stage,
alignment or unit choice of the same model. The engine's side is C++ (``src/checkpoint/``; Notes
[checkpoint format], [checkpoint commit], [checkpoint resharding], [checkpoint extras]); this
module adds what only Python knows: the model's buffers and frozen parameters (saved from rank 0,
restored on every rank), torch's RNG states (saved per rank), and JSON metadata.

Both functions are collectives: every rank of the module's process group calls them, with the
same path. The checkpoint root must be one directory every rank sees (a shared file system when
ranks run on several machines). Save between steps (after ``step()``): accumulated gradients are
not saved, and ``load`` drops them.
"""

from __future__ import annotations

import json
import os

import torch

from ._C import checkpoint as _checkpoint
from .zero import ShardedModule

__all__ = ["load", "resolve", "save"]

# Keys of the per-rank ``extra`` this module fills itself.
_RNG_CPU = "dpzero.rng.cpu"
_RNG_CUDA = "dpzero.rng.cuda."  # + device index
_BUFFER = "buffer."
_FROZEN = "frozen."


def _shared_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Rank-independent state the engine does not hold: every buffer, and every parameter that
    does not require grad, by name."""
    out = {_BUFFER + name: buf for name, buf in module.named_buffers()}
    for name, param in module.named_parameters():
        if not param.requires_grad:
            out[_FROZEN + name] = param.data
    return out


def save(
    sharded: ShardedModule,
    path: str | os.PathLike,
    *,
    step: int | None = None,
    extra: dict[str, torch.Tensor] | None = None,
    metadata: dict | None = None,
    keep_last: int | None = None,
) -> str:
    """Write a checkpoint of ``sharded`` to ``path/step-NNNNNNNN`` and point ``path/latest`` at it.

    step: the checkpoint's step (its directory name); ``None`` takes the engine's step counter.
        A committed step is never overwritten: saving the same step twice is an error.
    extra: this rank's own tensors (each rank passes its own; returned by ``load`` on the same
        rank when the world size allows, see ``load``). torch's CPU RNG state, and each CUDA
        device's when CUDA is initialised, are added under ``"dpzero.rng.*"``.
    metadata: JSON-serialisable, rank-independent (rank 0's is stored in the manifest).
    keep_last: after committing, keep this many committed steps up to this one and delete older
        ones; ``None`` keeps all.

    Returns the step directory. Raises ``RuntimeError`` on every rank if any rank fails (the
    message names the rank, the path and the reason).
    """
    if not isinstance(sharded, ShardedModule):
        raise TypeError(f"save: expected a dpzero.ShardedModule, got {type(sharded).__name__}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    tensors = dict(extra or {})
    for key in tensors:
        if key.startswith("dpzero."):
            raise ValueError(f"extra: keys starting with 'dpzero.' are reserved, got {key!r}")
    if sharded.rng_states is not None:
        # A private model: never the live states (Note [the model's own randomness] in
        # src/dp/generators.h).
        states = sharded.rng_states()
        tensors[_RNG_CPU] = states["cpu"]
        for index, state in enumerate(states["cuda"]):
            tensors[f"{_RNG_CUDA}{index}"] = state
    else:
        tensors[_RNG_CPU] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for index, state in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"{_RNG_CUDA}{index}"] = state
    metadata_json = json.dumps({} if metadata is None else metadata)
    if sharded.release_check is not None:  # a private model (Note [state written from data])
        sharded.release_check("dpzero.checkpoint.save")
    return _checkpoint.save(sharded.zero_state, os.fspath(path), -1 if step is None else int(step),
                            tensors, _shared_tensors(sharded.module), metadata_json,
                            0 if keep_last is None else int(keep_last))


def load(sharded: ShardedModule, path: str | os.PathLike, *, restore_rng: bool = True) -> dict:
    """Load a checkpoint into ``sharded``: ``path`` is a checkpoint root (its ``latest`` is used)
    or a step directory. The world size, stage, alignment and units may differ from the run that
    wrote it; the model (parameter names, shapes, order, buffers, frozen parameters) and the
    optimizer kind must be the same. Other optimizer hyperparameters are the engine's own (the
    saved ones are returned under ``"optimizer"``).

    Everything is read and verified (sizes, CRC-32s, model match) before the engine or the model
    is changed; a failure on any rank raises ``RuntimeError`` on every rank.

    Returns a dict: ``path`` (the step directory), ``step``, ``engine_steps``, ``world_size`` and
    ``stage`` (of the writing run), ``optimizer`` (its kind and hyperparameters), ``metadata``,
    ``extra`` (this rank's tensors passed to ``save``, without the ``dpzero.*`` ones) and
    ``extra_rank``: rank r gets the extra old rank r saved when r < the old world size, else
    none (``extra == {}``, ``extra_rank is None``). With ``restore_rng`` the RNG states found in
    that extra are restored too.
    """
    if not isinstance(sharded, ShardedModule):
        raise TypeError(f"load: expected a dpzero.ShardedModule, got {type(sharded).__name__}")
    out = _checkpoint.load(sharded.zero_state, os.fspath(path), _shared_tensors(sharded.module))
    if sharded.state_loaded is not None:  # the loaded buffers are the private model's state now
        sharded.state_loaded()
    extra = dict(out.pop("extra"))
    if restore_rng:
        if _RNG_CPU in extra:
            torch.set_rng_state(extra[_RNG_CPU])
        cuda = sorted((int(k[len(_RNG_CUDA):]), v) for k, v in extra.items()
                      if k.startswith(_RNG_CUDA))
        if cuda and torch.cuda.is_available():
            for index, state in cuda:
                if index < torch.cuda.device_count():
                    torch.cuda.set_rng_state(state, index)
    out["extra"] = {k: v for k, v in extra.items() if not k.startswith("dpzero.")}
    out["optimizer"] = json.loads(out.pop("optimizer_json"))
    out["metadata"] = json.loads(out.pop("metadata_json"))
    return out


def resolve(path: str | os.PathLike) -> str:
    """The step directory ``path`` denotes: ``path`` if it holds ``manifest.json``, else the one
    ``path/latest`` names."""
    return _checkpoint.resolve(os.fspath(path))
