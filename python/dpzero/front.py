"""``dpzero.make_private``: the front door over the private engine (``private/``) and, for
``policy="auto"``, the memory planner (``plan/``), which models private steps and so depends on
the engine, never the other way round."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .planner.auto import auto_policy
from .private.config import (DEFAULT_ACCOUNTANT, DEFAULT_AUTOMATIC_GAMMA, DEFAULT_BANDS,
                             DEFAULT_CLIPPING, DEFAULT_ISOLATION, DEFAULT_LOSS_REDUCTION,
                             DEFAULT_OPTIMIZER, DEFAULT_STRATEGY, DEFAULT_ZERO_STAGE, resolve)
from .private.engine import Private, make_private_from_config


def make_private(
    model: nn.Module, *,
    # The data: a dataset, or a DataLoader (its dataset, batch size and collate_fn).
    dataset: Optional[Dataset] = None,
    data_loader: Optional[DataLoader] = None,
    batch_size: Optional[int] = None,
    sample_rate: Optional[float] = None,
    max_physical_batch_size: Optional[int] = None,
    num_workers: int = 0,
    # Privacy.
    noise_multiplier: Optional[float] = None,
    bands: int = DEFAULT_BANDS,
    strategy: str = DEFAULT_STRATEGY,
    target_epsilon: Optional[float] = None,
    target_delta: Optional[float] = None,
    epochs: Optional[float] = None,
    steps: Optional[int] = None,
    max_grad_norm: float,
    clipping: str = DEFAULT_CLIPPING,
    clipping_groups: Optional[Sequence[Sequence[str]]] = None,
    group_weights: Optional[Sequence[float]] = None,
    automatic_gamma: float = DEFAULT_AUTOMATIC_GAMMA,
    isolation: str = DEFAULT_ISOLATION,
    loss_reduction: str = DEFAULT_LOSS_REDUCTION,
    allow_no_noise: bool = False,
    accountant: str = DEFAULT_ACCOUNTANT,
    epsilon_budget: Optional[float] = None,
    budget_delta: Optional[float] = None,
    secure_mode: Optional[bool] = None,
    seed: Optional[int] = None,
    ledger_path: Optional[str] = None,
    run_id: Optional[str] = None,
    diagnostics_path: Optional[str] = None,
    # The engine.
    zero_stage: int = DEFAULT_ZERO_STAGE,
    units: Optional[Sequence[str]] = None,
    process_group=None,
    mixed_precision: Union[None, str, torch.dtype] = None,
    activation_checkpointing=None,
    optimizer: Union[str, torch.optim.Optimizer] = DEFAULT_OPTIMIZER,
    lr: Optional[float] = None,
    policy: Optional[str] = None,
    plan_step: Optional[Callable] = None,
    memory_budget: Optional[float] = None,
    **optimizer_options,
) -> Private:
    """Make ``model`` train with DP-SGD under dpzero's ZeRO sharding.

    Returns ``Private(model, optimizer, data_loader, privacy_engine)``. Arguments:

    dataset / data_loader: the data (a DataLoader gives its dataset, batch size and collate_fn).
    batch_size or sample_rate: the expected logical batch size B (q = B / N) or q itself.
    noise_multiplier, or target_epsilon + target_delta + epochs or steps (σ calibrated by
        ``accountant``). epochs / steps: the run's length, in the private loader's epochs or in
        optimizer steps.
    bands: b >= 1. 1 is DP-SGD; b > 1 correlates the noise across steps (banded matrix
        factorization): the data are split into b fixed partitions, step t samples partition
        t mod b at rate q = B·b/N, and ε is that of DP-SGD with one step in b (docs/user-guide.md,
        Note [banded steps]). The partition is the example's index: keep the dataset's order
        across resumes. Memory: b − 1 noise vectors of each rank's shard.
    strategy: with bands > 1, how the noise is correlated: "sqrt_prefix_sum" (the banded square
        root of the prefix sums) or "optimized" (the banded strategy of least expected error for
        this run's length, which epochs or steps must give; Note [run strategy]). ε is the same.
    max_grad_norm: C. clipping: "flat" | "layer" | "group" (with clipping_groups, a list of lists
        of module-name prefixes, and optional group_weights) | "automatic" (automatic_gamma).
    zero_stage: 0-3; units, process_group as for :func:`dpzero.shard`.
    max_physical_batch_size: micro-batch cap m (the loader splits logical batches).
    policy="auto" (+ plan_step=(model, batch) -> loss, memory_budget bytes per rank): profile
        the model and take the fastest memory policy predicted to fit (dpzero.planner); the choice,
        the ranking and the unit names are in ``privacy_engine.memory_plan`` (a dict).
    activation_checkpointing: recompute these modules' forwards in the backward instead of
        keeping their activations: True (every ZeRO unit but the root), a list of module names,
        or a module class (private/checkpointing.py). Hugging Face's own switch works too.
    mixed_precision: None, "bf16", "fp16" or a dtype (compute dtype; fp32 masters and clipping).
    seed: reproducible Philox noise and sampling; without one, secure mode (ChaCha20 keyed from
        OS entropy, no key in any state dict or checkpoint). secure_mode=True insists on it (no
        seed), False asks for Philox with a drawn seed (Note [secure by default]).
    ledger_path (+ run_id): the privacy ledger (rank 0 writes it; only data-independent figures).
    diagnostics_path: a file for each step's data-dependent diagnostics (realised batch size, samples
        seen and dropped: not covered by ε, Note [released figures]); rank 0 writes it.
    loss_reduction: "mean" (the loss averages over the micro-batch, Opacus's default) or "sum".
    isolation: "detect" (default: one batched forward, and what could mix examples is detected)
        or "strict" (each example's forward and backward computed by itself, so no model code
        can mix them; slower: Note [strict isolation] in private/strict.py, docs/user-guide.md).
    allow_no_noise: needed for noise_multiplier=0 (non-private training through the same path).
    optimizer: "sgd" | "adam" | "adamw" or a torch.optim SGD/Adam/AdamW (its hyperparameters are
        used); lr and ``optimizer_options`` override: the optimizer's hyperparameters (momentum,
        dampening, nesterov, betas, eps, amsgrad, maximize, weight_decay, weight_decay_exempt)
        and the layout's (alignment, shard_boundaries, offload_optimizer, offload_params,
        prefetch, sync_module_states), as for :func:`dpzero.shard`; any other is refused.
    epsilon_budget (+ budget_delta): refuse steps past this ε (BudgetExhausted).
    """
    config = resolve(
        dataset=dataset, data_loader=data_loader, batch_size=batch_size, sample_rate=sample_rate,
        max_physical_batch_size=max_physical_batch_size, num_workers=num_workers,
        noise_multiplier=noise_multiplier, bands=bands, strategy=strategy,
        target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs, steps=steps,
        max_grad_norm=max_grad_norm,
        clipping=clipping, clipping_groups=clipping_groups, group_weights=group_weights,
        automatic_gamma=automatic_gamma, isolation=isolation, loss_reduction=loss_reduction,
        allow_no_noise=allow_no_noise, accountant=accountant, epsilon_budget=epsilon_budget,
        budget_delta=budget_delta, seed=seed, ledger_path=ledger_path, run_id=run_id,
        diagnostics_path=diagnostics_path, zero_stage=zero_stage, units=units,
        process_group=process_group, mixed_precision=mixed_precision,
        activation_checkpointing=activation_checkpointing, optimizer=optimizer, lr=lr,
        **optimizer_options)
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
        if activation_checkpointing is not None or \
                "offload_optimizer" in optimizer_options or "offload_params" in optimizer_options:
            raise ValueError("policy='auto' chooses zero_stage, activation_checkpointing "
                             "and offload_optimizer itself; do not pass those, nor "
                             "offload_params")
        config, plan = auto_policy(model, config, plan_step, memory_budget)
    private = make_private_from_config(model, config, accountant=accountant,
                                       secure_mode=secure_mode)
    private.privacy_engine.memory_plan = plan
    return private
