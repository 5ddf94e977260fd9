"""``dpzero.make_private``: the front door over the private engine (``private/``) and, for
``policy="auto"``, the memory planner (``plan/``), which models private steps and so depends on
the engine, never the other way round."""

from __future__ import annotations

from typing import Callable, Optional

from torch import nn

from .plan.auto import auto_policy
from .private.config import resolve
from .private.engine import Private, make_private_from_config


def make_private(model: nn.Module, *, optimizer="sgd", accountant: str = "prv",
                 secure_mode: Optional[bool] = None, policy: Optional[str] = None,
                 plan_step: Optional[Callable] = None, memory_budget: Optional[float] = None,
                 **kwargs) -> Private:
    """Make ``model`` train with DP-SGD under dpzero's ZeRO sharding.

    Returns ``Private(model, optimizer, data_loader, privacy_engine)``. Arguments:

    dataset / data_loader: the data (a DataLoader gives its dataset, batch size and collate_fn).
    batch_size or sample_rate: the expected logical batch size B (q = B / N) or q itself.
    noise_multiplier, or target_epsilon + target_delta + epochs (σ calibrated by ``accountant``).
    max_grad_norm: C. clipping: "flat" | "layer" | "group" (with clipping_groups, a list of lists
        of module-name prefixes, and optional group_weights) | "automatic" (automatic_gamma).
    zero_stage: 0-3; units, process_group as for :func:`dpzero.shard`.
    max_physical_batch_size: micro-batch cap m (the loader splits logical batches).
    policy="auto" (+ plan_step=(model, batch) -> loss, memory_budget bytes per rank): profile
        the model and take the fastest memory policy predicted to fit (dpzero.plan); the choice,
        the ranking and the unit names are in ``privacy_engine.plan`` (a dict).
    activation_checkpointing: recompute these modules' forwards in the backward instead of
        keeping their activations: True (every ZeRO unit but the root), a list of module names,
        or a module class (private/checkpointing.py). Hugging Face's own switch works too.
    mixed_precision: None, "bf16", "fp16" or a dtype (compute dtype; fp32 masters and clipping).
    seed: reproducible Philox noise and sampling; without one, secure mode (ChaCha20 keyed from
        OS entropy, no key in any state dict or checkpoint). secure_mode=True insists on it (no
        seed), False asks for Philox with a drawn seed (Note [secure by default]).
    ledger_path (+ run_id): the privacy ledger (rank 0 writes it; only data-independent figures).
    diagnostics_path: a file for each step's private diagnostics (realised batch size, samples
        seen and dropped: not covered by ε, Note [released figures]); rank 0 writes it.
    loss_reduction: "mean" (the loss averages over the micro-batch, Opacus's default) or "sum".
    isolation: "detect" (default: one batched forward, and what could mix examples is detected)
        or "strict" (each example's forward and backward computed by itself, so no model code
        can mix them; slower: Note [strict isolation] in private/strict.py, docs/user-guide.md).
    allow_no_noise: needed for noise_multiplier=0 (non-private training through the same path).
    optimizer: "sgd" | "adam" | "adamw" or a torch.optim SGD/Adam/AdamW (its hyperparameters are
        used); lr and further optimizer keywords (momentum, betas, weight_decay, ...) override.
    """
    config = resolve(accountant=accountant, optimizer=optimizer, **kwargs)
    plan = None
    if policy is not None:
        if policy != "auto":
            raise ValueError(f"policy must be None or 'auto', got {policy!r}")
        if plan_step is None:
            raise ValueError("policy='auto' profiles the model and needs plan_step: a "
                             "function (model, batch) -> loss for one micro-batch")
        if config.isolation == "strict":
            raise ValueError("policy='auto' plans the default (isolation='detect') step; give "
                             "zero_stage yourself with isolation='strict'")
        if kwargs.get("activation_checkpointing") is not None or \
                "offload_optimizer" in kwargs or "offload_params" in kwargs:
            raise ValueError("policy='auto' chooses zero_stage, activation_checkpointing "
                             "and offload_optimizer itself; do not pass those, nor "
                             "offload_params")
        config, plan = auto_policy(model, config, plan_step, memory_budget)
    private = make_private_from_config(model, config, accountant=accountant,
                                       secure_mode=secure_mode)
    private.privacy_engine.plan = plan
    return private
