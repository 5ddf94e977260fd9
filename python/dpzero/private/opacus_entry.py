"""Opacus's ``PrivacyEngine`` signature, argument by argument, and the objects it returns that
dpzero's own entry does not: the criterion of ``grad_sample_mode="ghost"``, the hooks object of
``wrap_model=False``, and ``save_checkpoint`` / ``load_checkpoint``.

Note [Opacus's arguments]
~~~~~~~~~~~~~~~~~~~~~~~~~
An Opacus script switches to dpzero by its import, so ``PrivacyEngine.make_private`` and
``make_private_with_epsilon`` take every argument Opacus 1.6 names. Each one is either honoured
or refused before anything is touched, naming the value and the fix; none is silently dropped:

- ``grad_sample_mode``: how Opacus computes per-sample gradients. dpzero computes each example's
  clipped contribution by its own kernels whatever the mode (ghost norms or direct ones, whichever
  costs less: Note [ghost or direct]), so "hooks", "functorch", "ew" and "ghost" train alike; with
  "ghost" the call also returns the criterion, as Opacus does (4 values instead of 3). Modes tied
  to a sharding dpzero replaces ("ghost_fsdp", "ghost_tp") and "no_op" (the caller computes the
  per-sample gradients) are refused.
- ``criterion``: used by "ghost" alone, as in Opacus (``PrivateCriterion``).
- ``batch_first``: True only. dpzero checks that dim 0 of every collated tensor holds the
  examples (Note [separable collate]); it does not take a batch dimension on the caller's word.
- ``loss_reduction``, ``poisson_sampling``, ``clipping``: as in Opacus, except the clippings
  dpzero does not offer ("per_layer": one threshold per parameter tensor; "adaptive", whose
  noised count of unclipped examples has no sensitivity bound in batched floating point:
  docs/reliability.md), which are refused naming dpzero's nearest ones.
- ``noise_generator``: a seeded ``torch.Generator`` makes the run reproducible, as in Opacus;
  dpzero's noise is counter-based (each rank draws only the coordinates it owns), so the
  generator gives the run's seed (63 bits drawn from it) instead of the draws themselves, and
  the seed drives the sampling too. Refused with ``secure_mode=True``, as in Opacus, and at
  torch's default seed (a Generator never seeded), which would make the noise public.
- ``wrap_model=False``: the caller keeps calling its own model, which dpzero patches in place
  anyway; the first value returned is a ``PrivateHooks`` whose ``cleanup()`` detaches.
- ``rand_on_empty``: either value. dpzero never hands the model an empty micro-batch: an empty
  one is a row of example 0 whose gradient the book makes exact zeros (Note [padding batches] in
  src/dp/book.h), so there is nothing random to put in its place.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, Optional

import torch
from torch import nn

from ..files import write_atomically

GRAD_SAMPLE_MODES = ("hooks", "functorch", "ew", "ghost")
_TORCH_DEFAULT_SEED = torch.Generator().initial_seed()  # what an unseeded Generator starts from
_LOSS_REDUCTIONS = ("mean", "sum")


def check_arguments(*, batch_first: bool, grad_sample_mode: str, clipping: str,
                    wrap_model: bool, rand_on_empty: bool) -> None:
    """Note [Opacus's arguments]: raises ValueError naming an argument dpzero cannot honour."""
    if grad_sample_mode in ("ghost_fsdp", "ghost_tp"):
        raise ValueError(
            f"grad_sample_mode={grad_sample_mode!r}: dpzero shards the model itself (ZeRO); give "
            "make_private the plain (unwrapped) model with grad_sample_mode='ghost', and shard "
            "with dpzero.make_private(zero_stage=1..3) instead of FSDP or tensor parallelism")
    if grad_sample_mode == "no_op":
        raise ValueError(
            "grad_sample_mode='no_op': dpzero computes and clips each example's gradient itself "
            "and has no per-sample gradients for the caller to supply; use 'hooks' or 'ghost'")
    if grad_sample_mode not in GRAD_SAMPLE_MODES:
        raise ValueError(f"grad_sample_mode must be one of {GRAD_SAMPLE_MODES}, got "
                         f"{grad_sample_mode!r}")
    if batch_first is not True:
        raise ValueError(
            f"batch_first={batch_first!r}: dpzero hands the model the collated batch with the "
            "examples in dim 0, and checks it (Note [separable collate]); collate batch-first "
            "(pad_sequence(..., batch_first=True)) and transpose inside the model's forward")
    if clipping == "per_layer":
        raise ValueError(
            "clipping='per_layer' (Opacus: one threshold per parameter tensor) is not "
            "implemented: dpzero clips a layer call's weight and bias together; use "
            "clipping='layer' (each layer at C/sqrt(L)), or dpzero.make_private(clipping="
            "'group', clipping_groups=..., group_weights=...) for thresholds of your choice")
    if clipping == "adaptive":
        raise ValueError(
            "clipping='adaptive' (a clip bound tracking a quantile of the norms) is not offered: "
            "its released count of unclipped examples assumes each example's norm is its own, "
            "which batched floating point does not keep (docs/reliability.md); use "
            "clipping='flat' with a fixed max_grad_norm, or 'automatic' (each gradient "
            "normalised, no threshold to tune)")
    if not isinstance(wrap_model, bool):
        raise ValueError(f"wrap_model must be True or False, got {wrap_model!r}")
    if not isinstance(rand_on_empty, bool):
        raise ValueError(f"rand_on_empty must be True or False, got {rand_on_empty!r}")


def seed_from_generator(noise_generator: Optional[torch.Generator],
                        secure_mode: Optional[bool], seed: Optional[int]) -> Optional[int]:
    """The run's seed from Opacus's ``noise_generator`` (Note [Opacus's arguments]): 63 bits
    drawn from it, so that a generator seeded alike gives a run drawn alike. None without one."""
    if noise_generator is None:
        return seed
    if not isinstance(noise_generator, torch.Generator):
        raise ValueError(f"noise_generator must be a torch.Generator, got "
                         f"{type(noise_generator).__name__}")
    if secure_mode:
        raise ValueError("noise_generator with secure_mode=True: a seeded generator makes the "
                         "noise reproducible, which secure mode forbids; drop one of them")
    if seed is not None:
        raise ValueError(f"both noise_generator and seed={seed} were given; the seed is drawn "
                         "from the generator, so give one of them")
    if noise_generator.initial_seed() == _TORCH_DEFAULT_SEED:
        raise ValueError(
            f"noise_generator has torch's default seed {_TORCH_DEFAULT_SEED}, which everyone "
            "knows, so the noise and the batches would be public; seed it (manual_seed) for a "
            "reproducible run, or leave noise_generator out for secure mode (OS entropy)")
    return int(torch.randint(0, 2**63 - 1, (1,), generator=noise_generator,
                             device=noise_generator.device).item())


class PrivateCriterion:
    """The criterion ``make_private(..., grad_sample_mode="ghost")`` returns, as Opacus's
    ``DPLossFastGradientClipping``: ``criterion(outputs, targets)`` is the loss to call
    ``backward()`` on, the per-example losses reduced by the run's ``loss_reduction``.

    The wrapped criterion is called with ``reduction="none"`` (set for the call, then put back),
    so one example's loss never depends on another's targets (a class-weighted mean divides by
    the batch's summed weights). ``shape=[B, T, ...]`` (the logits' shape before they were
    flattened to B·T rows) makes each example's loss its own token mean, over the tokens whose
    target is not ``ignore_index``, or its token sum under ``loss_reduction="sum"``, as Opacus
    does for sequence models. Opacus returns a tensor-like object whose ``backward()`` runs two
    passes; dpzero clips in one backward, so this returns the loss tensor itself. A criterion
    whose unreduced output mixes the examples (each row computed from others' outputs) is the
    model code Note [losses that couple examples] is about: ``isolation`` decides what holds."""

    def __init__(self, criterion, loss_reduction: str) -> None:
        if not callable(criterion):
            raise ValueError(f"criterion must be callable, got {type(criterion).__name__}")
        if loss_reduction not in _LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {_LOSS_REDUCTIONS}, got "
                             f"{loss_reduction!r}")
        reduction = getattr(criterion, "reduction", loss_reduction)
        if reduction != loss_reduction:
            raise ValueError(
                f"criterion {type(criterion).__name__} has reduction={reduction!r} but "
                f"loss_reduction={loss_reduction!r}; give make_private the same reduction in "
                "both (Opacus asserts this too)")
        self.criterion = criterion
        self.loss_reduction = loss_reduction

    def __call__(self, *args, shape=None, **kwargs) -> torch.Tensor:
        had = hasattr(self.criterion, "reduction")
        before = getattr(self.criterion, "reduction", None)
        self.criterion.reduction = "none"
        try:
            per_row = self.criterion(*args, **kwargs)
        finally:
            if had:
                self.criterion.reduction = before
            else:
                del self.criterion.reduction
        if not isinstance(per_row, torch.Tensor) or per_row.dim() == 0:
            raise ValueError(
                f"criterion {type(self.criterion).__name__} with reduction='none' returned "
                f"{'a 0-dim tensor' if isinstance(per_row, torch.Tensor) else type(per_row)}; "
                "it must return one loss per row")
        per_example = per_row  # [B] (or [B·T] with shape=): one loss per row
        if per_row.dim() > 1:  # [B, *] (MSELoss, BCE on several outputs): each row's own mean
            per_example = (per_row.flatten(1).sum(dim=1) if self.loss_reduction == "sum"
                           else per_row.flatten(1).mean(dim=1))
        elif shape is not None and per_row.shape[0] == shape[0] * shape[1]:
            per_row = per_row.reshape(shape[0], shape[1])  # [B, T]
            ignore = getattr(self.criterion, "ignore_index", None)
            targets = kwargs.get("target", args[1] if len(args) > 1 else None)
            if self.loss_reduction == "sum":
                per_example = per_row.sum(dim=1)
            elif ignore is not None and isinstance(targets, torch.Tensor):
                # Each example's own labelled tokens: [B]
                kept = (targets.reshape(shape[0], shape[1]) != ignore).sum(dim=1)
                per_example = per_row.sum(dim=1) / kept.clamp(min=1)
            else:
                per_example = per_row.mean(dim=1)
        if self.loss_reduction == "sum":
            return per_example.sum(dim=0)
        return per_example.mean(dim=0)

    def __repr__(self) -> str:
        return (f"PrivateCriterion({self.criterion!r}, "
                f"loss_reduction={self.loss_reduction!r})")


class PrivateHooks:
    """What ``make_private(..., wrap_model=False)`` returns in the model's place, as Opacus's
    ``GradSampleHooks``: the caller goes on calling its own model (patched in place), and
    ``cleanup()`` makes it a plain model again (``PrivacyEngine.detach``)."""

    def __init__(self, engine, module: nn.Module) -> None:
        self._engine = engine
        self.module = module

    def cleanup(self) -> None:
        self._engine.detach()

    remove_hooks = cleanup


def save_checkpoint(engine, *, path, module: nn.Module, optimizer=None,
                    noise_scheduler=None, grad_clip_scheduler=None,
                    checkpoint_dict: Optional[Dict[str, Any]] = None,
                    module_state_dict_kwargs: Optional[Dict[str, Any]] = None,
                    torch_save_kwargs: Optional[Dict[str, Any]] = None) -> None:
    """Opacus's ``PrivacyEngine.save_checkpoint``: the module's, the optimizer's and the privacy
    engine's state dicts in one ``torch.save`` file. A collective under several ranks, as the
    state dicts are (call it on every rank); rank 0 writes. A path is written whole or not at
    all (``files.write_atomically``)."""
    _refuse_schedulers(noise_scheduler, grad_clip_scheduler)
    checkpoint = dict(checkpoint_dict or {})
    checkpoint["module_state_dict"] = module.state_dict(**(module_state_dict_kwargs or {}))
    if optimizer is not None:
        checkpoint["optimizer_state_dict"] = optimizer.state_dict()
    checkpoint["privacy_engine_state_dict"] = engine.state_dict()
    if engine.rank != 0:
        return
    kwargs = torch_save_kwargs or {}
    if isinstance(path, (str, os.PathLike)):
        write_atomically(path, lambda f: torch.save(checkpoint, f, **kwargs))
    else:  # a file object of the caller's
        torch.save(checkpoint, path, **kwargs)


def load_checkpoint(engine, *, path, module: nn.Module, optimizer=None, noise_scheduler=None,
                    grad_clip_scheduler=None,
                    module_load_dict_kwargs: Optional[Dict[str, Any]] = None,
                    torch_load_kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Opacus's ``PrivacyEngine.load_checkpoint`` of a file ``save_checkpoint`` wrote: the module,
    the optimizer, then the privacy engine (its charges and sampler position, so that ε counts
    every step and no noise or batch is drawn twice), whose state is checked before anything is
    loaded. Returns what else the file holds. ``torch.load`` runs with ``weights_only=True``
    unless ``torch_load_kwargs`` says otherwise (for a ``checkpoint_dict`` holding other
    objects). A file without the privacy engine's state (one Opacus wrote) is refused: its
    accountant alone does not say which noise and batches the run already drew."""
    _refuse_schedulers(noise_scheduler, grad_clip_scheduler)
    checkpoint = torch.load(path, **{"weights_only": True, **(torch_load_kwargs or {})})
    if "privacy_engine_state_dict" not in checkpoint:
        raise ValueError(
            f"load_checkpoint: {path!r} holds no 'privacy_engine_state_dict' (keys: "
            f"{sorted(checkpoint)}); an Opacus checkpoint's accountant does not say which noise "
            "and batches its run drew, so a dpzero run cannot continue it. Load its weights with "
            "model.load_state_dict(checkpoint['module_state_dict']) and start a new run")
    # The engine's state is checked before the model and optimizer are touched: a refused file
    # leaves all three as they were.
    load_engine = engine.checked_load(checkpoint.pop("privacy_engine_state_dict"))
    module.load_state_dict(checkpoint.pop("module_state_dict"),
                           **(module_load_dict_kwargs or {}))
    optimizer_state = checkpoint.pop("optimizer_state_dict", None)
    if optimizer is not None and optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    elif (optimizer is None) != (optimizer_state is None):  # as Opacus: a warning
        holds = "holds" if optimizer_state is not None else "lacks"
        given = "None" if optimizer is None else "given"
        warnings.warn(f"load_checkpoint: the file {holds} an optimizer state, and optimizer is "
                      f"{given}; no optimizer state was loaded", RuntimeWarning, stacklevel=3)
    load_engine()
    return checkpoint


def _refuse_schedulers(noise_scheduler, grad_clip_scheduler) -> None:
    if noise_scheduler is not None or grad_clip_scheduler is not None:
        raise ValueError(
            "noise_scheduler / grad_clip_scheduler: dpzero runs at one σ and one C, which its "
            "ledger and accountant hold for every step; pass None")
