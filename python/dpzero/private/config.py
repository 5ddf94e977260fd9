"""What a private run was asked for, checked and resolved before anything is attached.

:func:`resolve` turns ``make_private``'s keywords into a :class:`PrivateConfig`: the data (a
dataset or a DataLoader's), the sample rate q, σ (calibrated from a target ε when one is given),
C, the clipping, the budget, the optimizer and the engine's layout. Every bad value is a
``ValueError`` or ``TypeError`` naming it, raised before the model is touched. The model-dependent
checks (its layers, tied parameters, clipping groups) come later, at attach (engine.py).
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
from torch.utils.data import DataLoader, Dataset

from .. import _C
from ..accounting import get_noise_multiplier
from . import checkpointing

CLIPPING = ("flat", "layer", "group", "automatic")

# dpzero.shard keywords make_private passes through (optimizer hyperparameters and layout); the
# others (reduce_dtype, grad_scale, param_dtype, grad_hooks) are fixed by the private path: a
# 16-bit reduction would round clipped sums past their threshold (design.md §4).
PASS_THROUGH = frozenset({"momentum", "dampening", "nesterov", "betas", "eps", "amsgrad",
                          "maximize", "weight_decay", "weight_decay_exempt", "alignment",
                          "shard_boundaries", "offload_optimizer", "offload_params", "prefetch",
                          "sync_module_states"})

_OPTIMIZERS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}

# The defaults every front door's signature shows (dpzero.make_private, resolve and through it
# PrivacyEngine.make_private). Those the C++ front door shares are the run's rules' own
# (RunSettings in src/dp/run.h); the rest are Python's alone.
_RUN_DEFAULTS = _C.dp.RunSettings()
DEFAULT_ACCOUNTANT = _RUN_DEFAULTS.accountant
DEFAULT_CLIPPING = _RUN_DEFAULTS.clipping
DEFAULT_AUTOMATIC_GAMMA = _RUN_DEFAULTS.automatic_gamma
DEFAULT_LOSS_REDUCTION = _RUN_DEFAULTS.loss_reduction
DEFAULT_ZERO_STAGE = _RUN_DEFAULTS.zero_stage
DEFAULT_BANDS = _RUN_DEFAULTS.bands
DEFAULT_STRATEGY = _RUN_DEFAULTS.strategy
DEFAULT_OPTIMIZER = "sgd"
DEFAULT_ISOLATION = "detect"

# How the examples of a micro-batch are kept apart: "detect" (one batched forward; what could
# mix them is detected, Note [batch provenance]) or "strict" (each example computed by itself,
# Note [strict isolation] in strict.py).
ISOLATION = ("detect", "strict")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class PrivateConfig:
    """A private run's settings, checked and resolved (:func:`resolve`)."""

    # The data: what the private loader (loader.py) samples from.
    dataset: Dataset
    collate_fn: Optional[Callable]
    num_workers: int
    max_physical_batch_size: Optional[int]  # the micro-batch cap m (None: the whole batch)
    # Privacy.
    sample_rate: float                      # q = B·b / N, in (0, 1]: each example's rate at
                                            # the steps of its partition (all steps at b = 1)
    noise_multiplier: float                 # σ >= 0 (0 only with allow_no_noise: ε = inf)
    bands: int                              # b >= 1: banded correlated noise (1: DP-SGD)
    strategy: str                           # bands > 1: "sqrt_prefix_sum" | "optimized"
    strategy_rows: int                      # "optimized": the run's rows it is fitted to; else 0
    allow_no_noise: bool
    max_grad_norm: float                    # C > 0 (inf: no clipping, only without noise)
    clipping: str                           # one of CLIPPING
    clipping_groups: Optional[Sequence[Sequence[str]]]
    group_weights: Optional[Sequence[float]]
    automatic_gamma: float
    loss_reduction: str                     # "mean" | "sum"
    isolation: str                          # "detect" | "strict" (Note [strict isolation])
    epsilon_budget: Optional[float]         # the budget guard's ε (None: no guard)
    budget_delta: Optional[float]
    seed: Optional[int]
    ledger_path: Optional[str]
    run_id: Optional[str]
    diagnostics_path: Optional[str]
    # The engine.
    zero_stage: int
    units: Optional[Sequence[str]]
    process_group: Any
    mixed_precision: Optional[torch.dtype]  # the compute dtype (None: float32)
    activation_checkpointing: checkpointing.Spec
    optimizer: str                          # "sgd" | "adam" | "adamw"
    optimizer_options: Dict[str, Any] = field(default_factory=dict)  # dpzero.shard keywords
    # The torch optimizer's parameters weight decay skips (its weight_decay=0 groups).
    decay_exempt: Tuple[torch.nn.Parameter, ...] = ()
    torch_optimizer: Optional[torch.optim.Optimizer] = None  # the caller's, if one was given

    @property
    def dataset_size(self) -> int:
        return len(self.dataset)

    @property
    def param_dtype(self) -> torch.dtype:
        return self.mixed_precision or torch.float32

    def replace(self, **changes) -> "PrivateConfig":
        return replace(self, **changes)


def run_rows(sample_rate: float, bands: int, epochs: Optional[float],
             steps: Optional[int]) -> int:
    """The run's length in steps (rows, one per logical batch): ``steps`` itself, or ``epochs``
    of the private loader's epochs (steps_per_epoch), rounded up."""
    if steps is not None:
        return int(steps)
    return math.ceil(epochs * steps_per_epoch(sample_rate, bands))


def steps_per_epoch(sample_rate: float, bands: int) -> int:
    """The steps of one epoch at rate q with b bands: b × int(1/q), so that whole epochs never
    exceed the steps σ was calibrated for (int(epochs / q) equivalent steps, Opacus's count; with
    bands each equivalent step is b steps, one per partition)."""
    return bands * max(1, int(1.0 / sample_rate))


def delta_warning(name: str, delta: float, n: int) -> str:
    """Why δ >= 1/N is no guarantee: a mechanism that publishes one random record of N in full
    is (0, 1/N)-DP. Practice, and the published results dpzero compares with, take δ well below
    1/N (1e-5, 1/N^1.1)."""
    return (f"{name}={delta:.3g} is >= 1/N = {1.0 / n:.3g} (N = {n}): at such a δ even releasing "
            "one random example in full is 'differentially private'. Use δ well below 1/N, "
            f"e.g. min(1e-5, 1/(10 N)) = {min(1e-5, 0.1 / n):.3g}")


def optimizer_settings(optimizer) -> tuple:
    """(engine name, kwargs for dpzero.shard, the parameters exempt from weight decay) from a
    name or a torch optimizer.

    A torch optimizer may have several parameter groups when they differ only in weight_decay
    and at most one nonzero value occurs (the usual decay / no-decay split of biases and norm
    weights): the groups with weight_decay 0 are exempt (Note [weight decay runs] in
    src/zero/optim.h). Anything else differing between groups is refused, naming it."""
    if isinstance(optimizer, str):
        if optimizer not in ("sgd", "adam", "adamw"):
            raise ValueError(f"optimizer must be 'sgd', 'adam', 'adamw' or a torch.optim "
                             f"SGD/Adam/AdamW, got {optimizer!r}")
        return optimizer, {}, ()
    name = _OPTIMIZERS.get(type(optimizer))
    if name is None:
        raise ValueError(f"optimizer {type(optimizer).__name__} is not supported under DP; use "
                         "torch.optim.SGD, Adam or AdamW (or their names)")
    groups = optimizer.param_groups
    g = groups[0]
    keys = (("lr", "momentum", "dampening", "nesterov", "maximize") if name == "sgd"
            else ("lr", "betas", "eps", "amsgrad", "maximize"))
    for i, other in enumerate(groups[1:], start=1):
        for key in keys:
            if not _same_value(other[key], g[key]):
                raise ValueError(
                    f"optimizer.param_groups[{i}][{key!r}] = {other[key]!r} differs from "
                    f"param_groups[0][{key!r}] = {g[key]!r}: dpzero's sharded optimizer applies "
                    "one value of every hyperparameter but weight_decay; give the groups the "
                    "same one")
    exempt, decays = decay_groups(groups)
    kw = {key: (tuple(g[key]) if key == "betas" else g[key]) for key in keys}
    kw["weight_decay"] = decays
    return name, kw, tuple(p for i in exempt for p in groups[i]["params"])


def _same_value(a, b) -> bool:
    """Hyperparameter equality, a list of betas equal to the same tuple."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return tuple(a) == tuple(b)
    return a == b


def decay_groups(groups) -> tuple:
    """(indices of the groups weight decay skips, the one weight_decay of the others) for
    torch param_groups; ValueError naming two different nonzero values."""
    values = [float(group["weight_decay"]) for group in groups]
    nonzero = sorted({v for v in values if v != 0.0})
    if len(nonzero) > 1:
        raise ValueError(f"optimizer.param_groups have weight_decay values {nonzero}: dpzero's "
                         "sharded optimizer decays with one value, exempting groups with "
                         "weight_decay=0; give every decaying group the same one")
    if not nonzero:
        return (), 0.0
    return tuple(i for i, v in enumerate(values) if v == 0.0), nonzero[0]


def resolve(*, accountant: str, optimizer=DEFAULT_OPTIMIZER, dataset: Optional[Dataset] = None,
            data_loader: Optional[DataLoader] = None, batch_size: Optional[int] = None,
            sample_rate: Optional[float] = None, noise_multiplier: Optional[float] = None,
            target_epsilon: Optional[float] = None, target_delta: Optional[float] = None,
            epochs: Optional[float] = None, steps: Optional[int] = None, max_grad_norm: float,
            clipping: str = DEFAULT_CLIPPING,
            clipping_groups: Optional[Sequence[Sequence[str]]] = None,
            group_weights: Optional[Sequence[float]] = None,
            automatic_gamma: float = DEFAULT_AUTOMATIC_GAMMA,
            zero_stage: int = DEFAULT_ZERO_STAGE, max_physical_batch_size: Optional[int] = None,
            mixed_precision: Union[None, str, torch.dtype] = None, seed: Optional[int] = None,
            ledger_path: Optional[str] = None, run_id: Optional[str] = None,
            loss_reduction: str = DEFAULT_LOSS_REDUCTION, process_group=None, units=None,
            allow_no_noise: bool = False, lr: Optional[float] = None,
            activation_checkpointing: checkpointing.Spec = None,
            epsilon_budget: Optional[float] = None, budget_delta: Optional[float] = None,
            num_workers: int = 0, diagnostics_path: Optional[str] = None,
            isolation: str = DEFAULT_ISOLATION, bands: int = DEFAULT_BANDS,
            strategy: str = DEFAULT_STRATEGY, **optimizer_kwargs) -> PrivateConfig:
    """make_private's keywords (its docstring, front.py) as a PrivateConfig; σ is calibrated
    with ``accountant`` when ``target_epsilon`` is given."""
    max_grad_norm = float(max_grad_norm)
    if isolation not in ISOLATION:
        raise ValueError(f"isolation must be one of {ISOLATION}, got {isolation!r}")
    if isolation == "strict":  # Note [strict isolation] (strict.py) says why each
        if clipping not in ("flat", "automatic"):
            raise ValueError(f"clipping={clipping!r} with isolation='strict': strict isolation "
                             "clips each example's whole gradient; use clipping='flat' or "
                             "'automatic'")
        if zero_stage == 3:
            raise ValueError("zero_stage=3 with isolation='strict': stage 3 gathers the "
                             "parameters in every forward, and a strict forward runs in as many "
                             "pieces as each rank's examples need; use zero_stage 0-2")
        if activation_checkpointing is not None:
            raise ValueError("activation_checkpointing with isolation='strict': a strict "
                             "backward recomputes each example's forward anyway (it keeps no "
                             "activations from the forward); remove it")

    # The data.
    if (dataset is None) == (data_loader is None):
        raise ValueError("give exactly one of dataset and data_loader")
    collate_fn = None
    if data_loader is not None:
        dataset = data_loader.dataset
        collate_fn = data_loader.collate_fn
        if batch_size is None and sample_rate is None:
            if data_loader.batch_size is None:
                raise ValueError("data_loader has no batch_size; pass batch_size or "
                                 "sample_rate")
            batch_size = data_loader.batch_size
        num_workers = num_workers or data_loader.num_workers
    n = len(dataset)
    if n <= 0:
        raise ValueError(f"the dataset is empty ({n} examples)")
    if (batch_size is None) == (sample_rate is None):
        raise ValueError(f"give exactly one of batch_size and sample_rate, got "
                         f"batch_size={batch_size}, sample_rate={sample_rate}")
    if batch_size is not None and not 0 < batch_size <= n:
        raise ValueError(f"batch_size must be in [1, {n}] (the dataset's size), got {batch_size}")
    if not isinstance(bands, numbers.Integral) or isinstance(bands, bool):
        raise ValueError(f"bands must be an integer, got {bands!r}")
    bands = int(bands)  # its range is the run's rules' (check_run_settings)
    if batch_size is not None and batch_size * bands > n:
        raise ValueError(f"batch_size={batch_size} with bands={bands}: each step samples one of "
                         f"{bands} partitions of the {n} examples, so the expected batch is at "
                         f"most {n // bands}; lower batch_size or bands")
    # With bands b each step samples one partition of N/b examples (Note [cyclic poisson] in
    # privacy/poisson.h): a batch_size of B is the rate B·b/N within it.
    q = float(sample_rate) if sample_rate is not None else float(batch_size) * bands / n

    # The run's length: epochs or steps (σ's calibration and the optimized strategy read it).
    if epochs is not None and steps is not None:
        raise ValueError(f"give at most one of epochs and steps, got epochs={epochs}, "
                         f"steps={steps}")
    if epochs is not None and (not isinstance(epochs, numbers.Real) or isinstance(epochs, bool)
                               or not math.isfinite(epochs) or epochs <= 0):
        raise ValueError(f"epochs must be a finite number > 0, got {epochs!r}")
    if steps is not None and (not isinstance(steps, numbers.Integral) or isinstance(steps, bool)
                              or not 1 <= steps < 2**63):
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    # Note [run strategy] (src/dp/run.h): the optimized strategy is fitted to the run's rows
    # (without a length they stay 0, which the run's rules refuse).
    if not isinstance(strategy, str):
        raise ValueError(f"strategy must be 'sqrt_prefix_sum' or 'optimized', got {strategy!r}")
    strategy_rows = 0
    if strategy == "optimized" and (epochs is not None or steps is not None):
        strategy_rows = run_rows(q, bands, epochs, steps)
        if strategy_rows >= 2**63:
            raise ValueError(f"epochs={epochs!r} is {strategy_rows} steps at q={q:g}: more than "
                             "any run takes")

    # σ, given or calibrated.
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError("give exactly one of noise_multiplier and target_epsilon")
    if target_epsilon is not None:
        if target_delta is None or (epochs is None and steps is None):
            raise ValueError("target_epsilon needs target_delta and epochs (or steps)")
        noise_multiplier = get_noise_multiplier(
            target_epsilon=target_epsilon, target_delta=target_delta, sample_rate=q,
            epochs=epochs, accountant=accountant, steps=None if steps is None else
            # the DP-SGD steps a banded run's steps equal (Note [amplified banded accounting])
            _C.accounting.equivalent_steps(int(steps), int(steps), bands))
    sigma = float(noise_multiplier)

    # The compute dtype and the optimizer.
    if isinstance(mixed_precision, str):
        if mixed_precision not in _DTYPES:
            raise ValueError(f"mixed_precision must be 'bf16', 'fp16', 'fp32' or a dtype, "
                             f"got {mixed_precision!r}")
        mixed_precision = _DTYPES[mixed_precision]
    name, options, decay_exempt = optimizer_settings(optimizer)
    planner = sorted({"policy", "plan_step", "memory_budget"} & set(optimizer_kwargs))
    if planner:
        raise TypeError(f"{planner}: the memory planner (policy='auto') is dpzero.make_private's; "
                        "PrivacyEngine.make_private takes zero_stage, activation_checkpointing "
                        "and offload_optimizer as given")
    bad = sorted(set(optimizer_kwargs) - PASS_THROUGH)
    if bad:
        raise TypeError(f"make_private got unexpected keyword arguments {bad}; allowed "
                        f"besides its own: {sorted(PASS_THROUGH)}")
    groups = [] if isinstance(optimizer, str) else optimizer.param_groups
    if len(groups) > 1 and "weight_decay" in optimizer_kwargs:
        raise ValueError(f"weight_decay={optimizer_kwargs['weight_decay']} with an optimizer of "
                         f"{len(groups)} parameter groups, whose own weight_decay values decide "
                         "which parameters decay: set them in the optimizer's groups instead")
    options.update(optimizer_kwargs)
    if lr is not None:
        options["lr"] = lr
    options.setdefault("lr", 1e-3)

    # The budget.
    for which, d in (("target_delta", target_delta), ("budget_delta", budget_delta)):
        if d is not None and d >= 1.0 / n:
            warnings.warn(delta_warning(which, d, n), UserWarning, stacklevel=3)
    if epsilon_budget is None and target_epsilon is not None:
        epsilon_budget, budget_delta = target_epsilon, target_delta

    config = PrivateConfig(
        dataset=dataset, collate_fn=collate_fn, num_workers=num_workers,
        max_physical_batch_size=max_physical_batch_size, sample_rate=q, noise_multiplier=sigma,
        bands=bands, strategy=strategy, strategy_rows=strategy_rows,
        allow_no_noise=bool(allow_no_noise),
        max_grad_norm=max_grad_norm, clipping=clipping, clipping_groups=clipping_groups,
        group_weights=group_weights, automatic_gamma=automatic_gamma,
        loss_reduction=loss_reduction, isolation=isolation,
        epsilon_budget=None if epsilon_budget is None else float(epsilon_budget),
        budget_delta=None if budget_delta is None else float(budget_delta), seed=seed,
        ledger_path=ledger_path, run_id=run_id, diagnostics_path=diagnostics_path,
        zero_stage=zero_stage, units=units, process_group=process_group,
        mixed_precision=mixed_precision, activation_checkpointing=activation_checkpointing,
        optimizer=name, optimizer_options=options, decay_exempt=decay_exempt,
        torch_optimizer=None if isinstance(optimizer, str) else optimizer)
    # The rules every front door shares (src/dp/run.h), before the model is touched.
    _C.dp.check_run_settings(run_settings(config, accountant, None))
    return config


def run_settings(config: PrivateConfig, accountant: str,
                 secure_mode: Optional[bool]) -> "_C.dp.RunSettings":
    """``config`` as the run's rules read it (Note [one set of rules] in src/dp/run.h)."""
    s = _C.dp.RunSettings()
    s.noise_multiplier, s.allow_no_noise = config.noise_multiplier, config.allow_no_noise
    s.max_grad_norm, s.sample_rate = config.max_grad_norm, config.sample_rate
    s.dataset_size = config.dataset_size
    s.max_physical_batch_size = config.max_physical_batch_size
    s.loss_reduction, s.clipping = config.loss_reduction, config.clipping
    s.automatic_gamma, s.accountant = config.automatic_gamma, accountant
    s.zero_stage, s.bands = config.zero_stage, config.bands
    s.strategy, s.strategy_rows = config.strategy, config.strategy_rows
    s.epsilon_budget, s.budget_delta = config.epsilon_budget, config.budget_delta
    s.seed = None if config.seed is None else int(config.seed) & ((1 << 64) - 1)
    s.secure_mode = secure_mode
    s.ledger_path = "" if config.ledger_path is None else os.fspath(config.ledger_path)
    s.run_id = config.run_id or ""
    return s
