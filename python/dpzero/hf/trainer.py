"""``PrivateTrainer``: ``transformers.Trainer`` with dpzero's private steps.

What changes against the Trainer, and why:

* **Batches.** The expected logical batch is ``per_device_train_batch_size x
  gradient_accumulation_steps x world size`` examples (``torchrun --nproc-per-node N``: each process
  is one of dpzero's ranks, in the process group the Trainer's accelerate set up), Poisson-sampled
  (q = that / N) by dpzero's loader, which splits each logical batch into micro-batches of at most
  ``per_device_train_batch_size`` rows. Under Poisson sampling the number of micro-batches varies
  from step to step, so the Trainer's loop sees one item per optimizer step (a ``LogicalBatch``) and
  ``training_step`` runs its micro-batches; the Trainer's own accumulation count is 1 inside
  (``self.args``), the caller's value lives on in q.
* **Steps and σ.** T = ``max_steps`` when given, else ceil(``num_train_epochs`` x int(1/q)), the
  number of steps the Trainer will run; σ is ``noise_multiplier`` or calibrated so that T steps
  spend ``target_epsilon`` at ``target_delta`` (default min(1e-5, 1/(10 N))). A target ε is also
  the run's budget: training stops cleanly when it is spent.
* **The loss.** Note [trainer loss] (losses.py): each example's own loss, summed.
* **The optimizer.** ``optim`` sgd, adamw_torch or adamw_torch_fused runs as dpzero's sharded
  SGD / AdamW (``learning_rate``, ``adam_beta1/2``, ``adam_epsilon``, ``weight_decay``); the
  parameters the Trainer exempts from weight decay (``get_decay_parameter_names``: biases and
  norm weights) are exempt here too (Note [weight decay runs] in src/zero/optim.h); the Trainer's
  scheduler (``lr_scheduler_type``, warmup) drives its ``param_groups`` as it would torch's.
* **Records.** ε and δ join every log (console, ``trainer_state.json``, TensorBoard) and the
  progress bar; the ledger is ``output_dir/ledger.jsonl``; the report ``dpzero report`` makes is
  written to ``output_dir`` when training ends. A checkpoint holds the privacy state
  (``dpzero_privacy.json``: charges, sampler position, accountant history; never a secure-mode
  key), and ``train(resume_from_checkpoint=...)`` continues from it. With several ranks every
  rank reads the model's and the optimizer's state (a gather of the shards) and the main
  process writes them.
* **Randomness.** Without a ``PrivacyArguments.seed`` the noise and the sampling are secure mode's
  (ChaCha20 keyed from the OS); ``TrainingArguments.seed`` is public (42 by default) and is never
  the noise seed: whoever knows the seed can regenerate the noise.
* **Refused** (ValueError naming the value): DDP / FSDP / DeepSpeed / DataParallel settings
  (dpzero is its own data-parallel engine), a ``max_grad_norm`` in the TrainingArguments that
  contradicts the per-sample one, other optimizers, a dataset without ``__len__``, a collator that
  changes the number of rows, a budget that cannot be met; settings that would couple examples
  (NEFTune, a left-padding tokenizer) or that the private step would ignore
  (``label_smoothing_factor``, ``torch_compile``, ``auto_find_batch_size``, ``compute_loss_func``,
  an overridden ``compute_loss``); ``include_num_input_tokens_seen``, whose count would release the
  realised batch sizes; ``fp16`` (its GradScaler would scale every example's gradient before
  clipping) and ``fp16_full_eval`` / ``bf16_full_eval`` (they cast the parameters),
  ``push_to_hub`` and ``save_only_model``.
* **bf16.** ``bf16=True`` runs the forward and the per-example loss under bf16 autocast, in
  training and evaluation, as a plain Trainer does; parameters, clipping and noise stay float32.

Released: ε, δ, the learning rate, the epoch and the step count, in every log (console,
``trainer_state.json``, TensorBoard) and in ``train()``'s result. What the Trainer would log that
depends on the training data without noise (Note [released figures] in private/engine.py) goes to
``output_dir/private/training.jsonl`` instead, headed as not covered by ε: the training loss,
``train_runtime`` and the throughputs (wall times follow the realised Poisson batch sizes); the
progress bar shows no times or rates for the same reason, and ``total_flos`` is not counted. The
realised batch sizes and dropped samples go to ``output_dir/private/diagnostics.jsonl``, as
``dpzero train`` keeps them. ``PrivacyArguments(release_training_loss=True)`` puts the loss into
the logs anyway, under names that say it is not covered by ε (``loss_not_covered_by_epsilon``).
Evaluation and prediction run the model under ``torch.no_grad()``, where its DP layers are plain
layers: they cost no privacy, and their figures on held-out data are released as usual.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader

from tqdm.auto import tqdm
from transformers import ProgressCallback, Trainer, TrainerCallback
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
from transformers.trainer_utils import TrainOutput, has_length

from .. import _C
from ..accounting import get_noise_multiplier
from ..files import write_atomically
from ..front import make_private
from ..noise import secure_noise
from ..private import BudgetExhausted
from ..private.config import run_rows
from ..private.engine import PrivateLog
from .losses import PerSampleLoss, default_per_sample_loss

PRIVACY_STATE = "dpzero_privacy.json"  # in each checkpoint folder
LEDGER = "ledger.jsonl"  # in output_dir (dpzero report's name for it)
PRIVATE_DIR = "private"  # in output_dir: what ε does not cover (dpzero train's split)

# What the Trainer logs that depends on the training data without noise (Note [released
# figures] in private/engine.py): the loss, and wall times that follow the realised batch sizes.
UNRELEASED = ("loss", "train_loss", "train_runtime", "train_samples_per_second",
              "train_steps_per_second", "train_tokens_per_second")
# The name a loss released on request carries everywhere it appears.
RELEASED_LOSS_SUFFIX = "_not_covered_by_epsilon"

# TrainingArguments.optim -> dpzero's optimizer.
_OPTIMIZERS = {"sgd": "sgd", "adamw_torch": "adamw", "adamw_torch_fused": "adamw"}


@dataclass
class PrivacyArguments:
    """The privacy settings of a ``PrivateTrainer`` run.

    target_epsilon (with target_delta, default min(1e-5, 1/(10 N))), or noise_multiplier: σ given
    or calibrated for the run's steps; with both, the run checks that σ keeps the target.
    max_grad_norm: the per-sample clip norm C. clipping: "flat" | "layer" | "automatic".
    isolation: "detect" | "strict" (each example's forward and backward computed by itself;
    make_private's).
    bands: b >= 1; b > 1 correlates the noise across steps (make_private's ``bands``: step t
    samples partition t mod b of the data, ε is DP-SGD's at one step in b). strategy: with
    bands > 1, "sqrt_prefix_sum" or "optimized" (make_private's: fitted to the run's steps).
    accountant: "prv" | "rdp". zero_stage: 0-3. seed: a Philox seed for reproducible noise and
    sampling; whoever knows it can regenerate the noise and subtract it from a released update,
    so it is a secret, and never TrainingArguments.seed (public, 42 by default). secure_mode:
    ChaCha20 noise and sampling keyed from the OS; the default (None) is secure mode unless a
    seed is given. allow_no_noise: needed for noise_multiplier=0 (training without privacy, ε
    reported as inf). diagnostics_path: a JSON-lines file for each step's realised batch size and
    dropped samples (not covered by ε; default ``output_dir/private/diagnostics.jsonl``, beside
    the training losses). release_training_loss: put the training loss into the Trainer's logs,
    named ``loss_not_covered_by_epsilon`` (it is computed from the training data without noise).
    """

    target_epsilon: Optional[float] = None
    target_delta: Optional[float] = None
    noise_multiplier: Optional[float] = None
    max_grad_norm: float = 1.0
    clipping: str = "flat"
    isolation: str = "detect"
    bands: int = 1
    strategy: str = "sqrt_prefix_sum"
    accountant: str = "prv"
    zero_stage: int = 0
    secure_mode: Optional[bool] = None
    seed: Optional[int] = None
    allow_no_noise: bool = False
    diagnostics_path: Optional[str] = None
    release_training_loss: bool = False


class LogicalBatch:
    """One optimizer step's micro-batches, drawn from the private loader as they are run (the
    engine hands out one micro-batch at a time, Note [batch provenance]). ``count`` is known
    once the first one is out."""

    def __init__(self, micro_batches: Iterator, engine) -> None:
        self._it = micro_batches
        self._engine = engine

    def __iter__(self):
        first = next(self._it)
        yield first
        for _ in range(self._engine.micro_batches_of_step - 1):
            yield next(self._it)


class _LogicalBatches:
    """What the Trainer's loop iterates: one LogicalBatch per step, ``len`` the steps of an
    epoch (int(1/q), as σ was calibrated). An iteration yields no more than ``steps_left()``: a
    resumed run does not skip data (the private loader continues from the sampler's position),
    so the Trainer's loop would otherwise run one step past max_steps before its flow callback
    stops it."""

    def __init__(self, loader, engine, steps_left) -> None:
        self.loader = loader
        self.dataset = loader.dataset
        self._engine = engine
        self._steps_left = steps_left

    def __len__(self) -> int:
        return self.loader.steps_per_epoch

    def __iter__(self):
        it = iter(self.loader)
        for _ in range(min(self.loader.steps_per_epoch, max(0, self._steps_left()))):
            yield LogicalBatch(it, self._engine)


def _rows(batch) -> Optional[int]:
    """dim 0 of the first tensor of a collated batch."""
    values = batch.values() if isinstance(batch, Mapping) else (
        batch if isinstance(batch, (list, tuple)) else [batch])
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.shape[0]
    return None


class _CheckedCollator:
    """The Trainer's collator, refusing a batch whose row count is not the examples' count: a
    collator that drops or adds rows would break the sampled batch's accounting."""

    def __init__(self, collate) -> None:
        self.collate = collate

    def __call__(self, examples: List[Any]):
        batch = self.collate(examples)
        if isinstance(batch, Mapping) and not isinstance(batch, dict):
            batch = dict(batch)  # a BatchEncoding: the loader tags a dict's tensors
        rows = _rows(batch)
        if rows is not None and rows != len(examples):
            raise ValueError(
                "the data collator returned a batch whose dim 0 is not its examples, one row "
                "each; under DP each example must be one row of the batch (a collator that "
                "drops, packs or duplicates examples changes who is in the sampled batch)")
        return batch


class _ReleasedProgress(ProgressCallback):
    """The Trainer's progress bar without times or rates (Note [released figures]: a step's
    wall time follows its realised batch size): the steps, and ε (_PrivacyCallback)."""

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.training_bar = tqdm(total=state.max_steps, dynamic_ncols=True,
                                     bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}{postfix}")
        self.current_step = 0


class _PrivacyCallback(TrainerCallback):
    """ε in the progress bar (at each logging step: the PRV accountant takes milliseconds, more
    as the run grows), and a clean stop when the budget is spent."""

    def __init__(self, trainer: "PrivateTrainer") -> None:
        self.trainer = trainer

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "epsilon" in logs:
            for cb in self.trainer.callback_handler.callbacks:
                bar = getattr(cb, "training_bar", None)
                if bar is not None:
                    bar.set_postfix(epsilon=f"{logs['epsilon']:.3g}", refresh=False)

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        engine = t.privacy_engine
        left = engine.remaining_steps
        if left is not None and left <= 0 and state.global_step < state.max_steps:
            t.budget_stop = (f"the privacy budget ε = {engine.budget[0]} at δ = "
                             f"{engine.budget[1]:.3g} is spent after {engine.charges} steps; "
                             "training stops here")
            if t.is_world_process_zero():
                print(f"[dpzero] {t.budget_stop}")
            control.should_training_stop = True
            control.should_save = True
        return control


class PrivateTrainer(Trainer):
    """A ``transformers.Trainer`` that trains privately (module docstring). Takes the Trainer's
    arguments plus ``privacy_args`` (PrivacyArguments) and, for heads without a built-in
    per-sample loss, ``per_sample_loss(model, outputs, labels) -> [B]`` (Note [trainer loss])."""

    def __init__(self, model=None, args=None, *, privacy_args: Optional[PrivacyArguments] = None,
                 per_sample_loss: Optional[PerSampleLoss] = None, **kwargs) -> None:
        if model is None:
            raise ValueError("PrivateTrainer needs a model (model_init is not supported)")
        if args is None:
            from transformers import TrainingArguments
            args = TrainingArguments(output_dir="trainer_output")
        self.privacy_args = privacy_args if privacy_args is not None else PrivacyArguments()
        _refuse_parallel(args)
        c = self.privacy_args.max_grad_norm
        if args.max_grad_norm not in (0.0, 1.0, c):
            raise ValueError(
                f"TrainingArguments.max_grad_norm={args.max_grad_norm} clips the summed gradient, "
                f"which private training does not do; the per-example clip norm is "
                f"PrivacyArguments.max_grad_norm ({c}). Set that one, and leave "
                "TrainingArguments.max_grad_norm at its default (1.0) or 0")
        _refuse_ignored_or_coupling(args, kwargs, type(self))
        optim = str(getattr(args.optim, "value", args.optim))
        if optim not in _OPTIMIZERS:
            raise ValueError(f"optim={optim!r} is not one dpzero's private optimizer runs; use "
                             f"one of {sorted(_OPTIMIZERS)}")
        self.accumulation_steps = int(args.gradient_accumulation_steps)
        # The loop sees one LogicalBatch per step; data skipping on resume would hand out
        # batches (the private loader continues from the sampler's own position instead).
        inner = copy.copy(args)
        inner.gradient_accumulation_steps = 1
        inner.ignore_data_skip = True
        inner.max_grad_norm = 0.0  # per-sample clipping replaces the Trainer's
        super().__init__(model=model, args=inner, **kwargs)
        self.user_args = args
        self.per_sample_loss = per_sample_loss or default_per_sample_loss(self.model)
        self.budget_stop: Optional[str] = None
        self._private_log: Optional[PrivateLog] = None
        self._attach_private()
        # Steps an earlier run charged to this output_dir's ledger (make_private reopened it).
        self._earlier_charges = self.privacy_engine.charges
        self._trained = False
        self.add_callback(_PrivacyCallback(self))
        if any(isinstance(cb, ProgressCallback) for cb in self.callback_handler.callbacks):
            self.remove_callback(ProgressCallback)
            self.add_callback(_ReleasedProgress)

    # ---- attach ----------------------------------------------------------------------------

    def _attach_private(self) -> None:
        args, p = self.user_args, self.privacy_args
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("PrivateTrainer needs a train_dataset")
        if not has_length(dataset):
            raise ValueError(
                f"the train_dataset ({type(dataset).__name__}) has no __len__: Poisson sampling "
                "needs the dataset size N (q = batch / N), and an iterable dataset cannot be "
                "sampled that way")
        n = len(dataset)
        world = args.world_size  # torchrun's processes: dpzero's ranks
        expected = args.per_device_train_batch_size * self.accumulation_steps * world
        if expected > n:
            raise ValueError(f"the expected logical batch ({expected} = per_device_train_batch_"
                             f"size x gradient_accumulation_steps x {world} processes) exceeds "
                             f"the dataset ({n})")
        bands = p.bands
        if expected * bands > n:
            raise ValueError(f"the expected logical batch ({expected}) with bands={bands} exceeds "
                             f"one of the {bands} partitions of the dataset ({n} examples)")
        # With bands b each step samples one partition of N/b examples (make_private's bands).
        q = expected * bands / n
        steps = args.max_steps if args.max_steps > 0 else \
            run_rows(q, bands, args.num_train_epochs, None)
        from ..train.config import default_delta
        delta = p.target_delta if p.target_delta is not None else default_delta(n)
        self.delta = delta
        sigma = self._noise_multiplier(q, steps, delta, n)
        optimizer = _OPTIMIZERS[str(getattr(args.optim, "value", args.optim))]
        hyper: Dict[str, Any] = {"lr": args.learning_rate, "weight_decay": args.weight_decay}
        if optimizer == "adamw":
            hyper.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
        if args.weight_decay:
            # The Trainer's own split (create_optimizer): what it would not decay, nor do we.
            decayed = set(self.get_decay_parameter_names(self.model))
            hyper["weight_decay_exempt"] = [name for name, param in self.model.named_parameters()
                                            if param.requires_grad and name not in decayed]
        collate = _CheckedCollator(self._get_collator_with_removed_columns(
            self.data_collator, description="training"))
        data = self._remove_unused_columns(dataset, description="training") \
            if _is_datasets_dataset(dataset) else dataset
        loader = DataLoader(data, batch_size=expected, collate_fn=collate)
        os.makedirs(args.output_dir, exist_ok=True)
        secure_noise(p.secure_mode, p.seed)  # its refusal, before any file is made
        budget = {}
        if p.target_epsilon is not None and sigma > 0:
            budget = {"epsilon_budget": p.target_epsilon, "budget_delta": delta}
        self._private = make_private(
            self.model, data_loader=loader, noise_multiplier=sigma, bands=bands,
            strategy=p.strategy, steps=steps,
            max_grad_norm=p.max_grad_norm,
            clipping=p.clipping, isolation=p.isolation, accountant=p.accountant,
            secure_mode=p.secure_mode,
            zero_stage=p.zero_stage, max_physical_batch_size=args.per_device_train_batch_size,
            seed=p.seed,
            ledger_path=os.path.join(args.output_dir, LEDGER),
            run_id=os.path.basename(os.path.abspath(args.output_dir)),
            diagnostics_path=p.diagnostics_path or os.path.join(
                args.output_dir, PRIVATE_DIR, "diagnostics.jsonl"),
            loss_reduction="sum",
            allow_no_noise=p.allow_no_noise, optimizer=optimizer, **hyper, **budget)
        self.privacy_engine = self._private.privacy_engine
        self.optimizer = self._private.optimizer
        self.planned_steps, self.sample_rate, self.noise_multiplier = steps, q, sigma

    def _noise_multiplier(self, q: float, steps: int, delta: float, n: int) -> float:
        p = self.privacy_args
        # the DP-SGD steps the run's privacy equals (accounting/banded.h)
        steps = _C.accounting.equivalent_steps(steps, steps, p.bands)
        if p.noise_multiplier is None and p.target_epsilon is None:
            raise ValueError("PrivacyArguments needs target_epsilon (σ calibrated for the run) "
                             "or noise_multiplier")
        if p.noise_multiplier is not None:
            sigma = float(p.noise_multiplier)
            if p.target_epsilon is not None and sigma > 0:
                from ..accounting import create_accountant
                acc = create_accountant(p.accountant)
                acc.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
                eps = float(acc.get_epsilon(delta))
                if eps > p.target_epsilon:
                    raise ValueError(
                        f"noise_multiplier={sigma} spends ε = {eps:.3g} > target_epsilon="
                        f"{p.target_epsilon} over this run's {steps} steps at q = {q:.4g} "
                        f"(gradient_accumulation_steps={self.accumulation_steps}, "
                        f"per_device_train_batch_size={self.user_args.per_device_train_batch_size}"
                        f", N = {n}); lower the steps or the batch, or raise σ")
            return sigma
        try:
            return get_noise_multiplier(target_epsilon=p.target_epsilon, target_delta=delta,
                                        sample_rate=q, steps=steps, accountant=p.accountant)
        except ValueError as e:
            raise ValueError(
                f"target_epsilon={p.target_epsilon} at target_delta={delta:.3g} cannot be met "
                f"by {steps} steps at q = {q:.4g}: {e}") from e

    # ---- queries ---------------------------------------------------------------------------

    @property
    def private_model(self):
        """The model the private step trains (``make_private``'s): what evaluation runs."""
        return self._private.model

    def epsilon(self) -> float:
        """ε spent so far at this run's δ."""
        return self.privacy_engine.epsilon(self.delta)

    # ---- the loop's hooks ------------------------------------------------------------------

    def get_train_dataloader(self):
        return _LogicalBatches(self._private.data_loader, self.privacy_engine,
                               lambda: self.state.max_steps - self.state.global_step)

    def get_total_train_batch_size(self, args) -> int:
        return (self.user_args.per_device_train_batch_size * self.accumulation_steps
                * self.user_args.world_size)

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        # The private model is its own data-parallel wrapper (no DDP / FSDP around it), in
        # evaluation too: the Trainer prepares a bare self.model with accelerate there, whose
        # .to() under torchrun would give the parameters new storage, cut off from the engine's
        # (the weights would stop changing while every step is still charged).
        return self.private_model

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        return batches, None

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One private step's forward and backward passes: every micro-batch of the logical
        batch ``inputs`` (the optimizer's step then releases the noisy update). Returns the mean
        per-example loss of the batch (not covered by ε)."""
        if not isinstance(inputs, LogicalBatch):
            raise TypeError("PrivateTrainer.training_step runs a LogicalBatch from its own train "
                            f"dataloader, got {type(inputs).__name__}")
        model.train()
        total, rows = torch.zeros((), device=self.args.device), 0
        for micro in inputs:
            padding = self.privacy_engine.is_padding_batch
            if not _on_device(micro, self.args.device):
                micro = self._prepare_inputs(micro)
            micro = dict(micro) if isinstance(micro, Mapping) else micro
            labels = micro.pop("labels", None) if isinstance(micro, dict) else None
            if labels is None:
                raise ValueError(
                    "PrivateTrainer needs the batch's labels under 'labels' (the collator's "
                    f"output has {sorted(micro) if isinstance(micro, dict) else type(micro)}) to "
                    "compute each example's loss; for a model whose forward takes no labels, "
                    "set TrainingArguments(label_names=['labels']) so the Trainer keeps them")
            with self.compute_loss_context_manager():
                outputs = model(**micro)
                losses = self.per_sample_loss(model, outputs, labels)
            losses.sum().backward()
            if not padding:
                with torch._C.DisableTorchFunctionSubclass():
                    total = total + losses.detach().sum()
                    rows += losses.shape[0]
        return total / max(rows, 1)

    def autocast_smart_context_manager(self, cache_enabled: Optional[bool] = True):
        """bf16=True: the forward and the per-example loss run under bf16 autocast, in training
        and in evaluation, as accelerate's wrapped forward runs a plain Trainer's model (the
        private model is not prepared by accelerate: _wrap_model). The parameters stay float32;
        the per-sample norms and clipped sums read autocast's 16-bit operands exactly (Note
        [autocast] in private/layers.py)."""
        if self.user_args.bf16:
            return torch.autocast(self.args.device.type, dtype=torch.bfloat16,
                                  cache_enabled=cache_enabled)
        return super().autocast_smart_context_manager(cache_enabled)

    def floating_point_ops(self, inputs) -> int:
        # Counted from a step's real rows, the Trainer's total_flos (in every trainer_state.json)
        # would release the realised batch sizes, which Poisson sampling keeps private (Note
        # [released figures] in private/engine.py): not counted.
        if isinstance(inputs, LogicalBatch):
            return 0
        return super().floating_point_ops(inputs)

    def log(self, logs: Dict[str, float], start_time: Optional[float] = None) -> None:
        if "loss" in logs or "train_loss" in logs:  # training logs carry what was spent
            # The Trainer's grad_norm reads .grad, which private parameters never have.
            logs.pop("grad_norm", None)
            logs["epsilon"] = self.epsilon()
            logs["delta"] = self.delta
        logs.update(self._unreleased(logs))
        super().log(logs, start_time)

    def _unreleased(self, figures: Dict[str, Any]) -> Dict[str, Any]:
        """Takes the figures ε does not cover (UNRELEASED) out of ``figures`` into the private
        log; returns what may go back, renamed: the loss, if release_training_loss asks."""
        taken = {k: figures.pop(k) for k in UNRELEASED if k in figures}
        if not taken:
            return {}
        self._write_private({"run": "private", "step": self.state.global_step, **taken})
        if not self.privacy_args.release_training_loss:
            return {}
        return {k + RELEASED_LOSS_SUFFIX: v for k, v in taken.items()
                if k in ("loss", "train_loss")}

    def _write_private(self, record: Dict[str, Any]) -> None:
        """One record of ``output_dir/private/training.jsonl`` (the main process writes)."""
        if self.is_world_process_zero():
            if self._private_log is None:
                self._private_log = PrivateLog(os.path.join(self.user_args.output_dir,
                                                            PRIVATE_DIR, "training.jsonl"))
            self._private_log.write(record)

    # ---- checkpoints -----------------------------------------------------------------------

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        # Every rank reads the state dict (with several ranks at stage 3 that is a gather of the
        # sharded parameters, a collective); the main process writes it.
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self._save(output_dir, state_dict=self.model.state_dict())
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # DPOptimizer.state_dict() gathers the engine's shards: every rank calls it (the Trainer
        # calls it on the main process only), the main process writes it.
        optimizer = self.optimizer.state_dict()
        if self.args.should_save:
            torch.save(optimizer, os.path.join(output_dir, OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            state = self.privacy_engine.state_dict()  # no secure-mode key
            saved = {"privacy": state, "delta": self.delta,
                     "ledger": os.path.abspath(os.path.join(self.user_args.output_dir, LEDGER)),
                     "privacy_args": asdict(self.privacy_args)}
            write_atomically(os.path.join(output_dir, PRIVACY_STATE),
                             lambda f: json.dump(saved, f, indent=1), binary=False)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, PRIVACY_STATE)
        if not os.path.exists(path):
            raise ValueError(
                f"{checkpoint} holds no {PRIVACY_STATE}: it is not a complete PrivateTrainer "
                "checkpoint (a run stopped while saving it, or another trainer's); resume from an "
                "earlier checkpoint, since resuming from this one would lose the privacy state")
        with open(path) as f:
            saved = json.load(f)
        ledger = os.path.join(self.user_args.output_dir, LEDGER)
        charged = int(saved["privacy"]["charges"])
        if charged > self.privacy_engine.charges:
            raise ValueError(
                f"{checkpoint} was taken after {charged} charged steps, but the ledger {ledger} "
                f"holds {self.privacy_engine.charges}: resume with the output_dir of the run "
                f"that wrote the checkpoint ({saved.get('ledger', 'its ledger')}), so that its "
                "ledger keeps counting every released step")
        super()._load_optimizer_and_scheduler(checkpoint)
        self.privacy_engine.load_state_dict(saved["privacy"])

    # ---- the end ---------------------------------------------------------------------------

    def train(self, *args, continue_ledger: bool = False, **kwargs):
        """The Trainer's train(). ``continue_ledger``: start without a checkpoint while the
        output_dir's ledger keeps counting an earlier run's steps (``dpzero train --resume``
        after a crash before the first checkpoint); otherwise such a start is refused."""
        engine = self.privacy_engine
        if engine.remaining_steps is not None and engine.remaining_steps <= 0:
            raise BudgetExhausted(
                f"the privacy budget ε = {engine.budget[0]} at δ = {engine.budget[1]:.3g} is "
                f"already spent: {engine.charges} steps are charged in "
                f"{os.path.join(self.user_args.output_dir, LEDGER)}; nothing was trained")
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if self._earlier_charges and not resume and not continue_ledger and not self._trained:
            raise ValueError(
                f"output_dir {self.user_args.output_dir!r} already holds a privacy ledger with "
                f"{self._earlier_charges} charged steps of an earlier run: continue that run with "
                "train(resume_from_checkpoint=...), or give this one a new output_dir (a fresh "
                "start there would count the earlier run's steps against this one)")
        self._trained = True
        output = super().train(*args, **kwargs)
        if self.is_world_process_zero():
            from ..train.report import write_report
            write_report(self.user_args.output_dir, delta=self.delta)
        # What train() returns is shown too (a notebook prints it): released figures only.
        metrics = dict(output.metrics)
        taken = {k: metrics.pop(k) for k in UNRELEASED if k in metrics}
        release = self.privacy_args.release_training_loss
        if release and "train_loss" in taken:
            metrics["train_loss" + RELEASED_LOSS_SUFFIX] = taken["train_loss"]
        return TrainOutput(output.global_step, output.training_loss if release else math.nan,
                           metrics)


def _on_device(batch, device) -> bool:
    """Whether every tensor of a collated batch is already on ``device`` (the Trainer's
    _prepare_inputs would then only add a .to() per tensor through the examples' tag)."""
    values = batch.values() if isinstance(batch, Mapping) else [batch]
    with torch._C.DisableTorchFunctionSubclass():
        return all(v.device == torch.device(device) for v in values
                   if isinstance(v, torch.Tensor))


def _is_datasets_dataset(dataset) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)


def _refuse_ignored_or_coupling(args, kwargs: Dict[str, Any], cls) -> None:
    """Trainer settings the private step would ignore, or that would make one example's gradient
    depend on the others (Note [trainer loss]): refused, naming the setting."""
    if getattr(args, "neftune_noise_alpha", None):
        raise ValueError(
            f"neftune_noise_alpha={args.neftune_noise_alpha}: NEFTune scales its embedding noise "
            "by the micro-batch's padded length, so one example's gradient would depend on the "
            "other examples' lengths; remove it")
    if args.label_smoothing_factor:
        raise ValueError(f"label_smoothing_factor={args.label_smoothing_factor}: the private "
                         "Trainer's per-example losses do not smooth labels; set it to 0")
    if args.torch_compile:
        raise ValueError("torch_compile=True: the private model's DP layers run through "
                         "dpzero's own autograd nodes, which torch.compile does not trace; "
                         "remove it")
    if args.auto_find_batch_size:
        raise ValueError("auto_find_batch_size=True: the micro-batch bound is "
                         "per_device_train_batch_size, and the logical batch (so q and σ) "
                         "depends on it; set it yourself")
    if args.fp16:
        raise ValueError(
            "fp16=True: the Trainer trains fp16 with a GradScaler, whose loss scale multiplies "
            "every example's gradient before clipping (so examples would be clipped at "
            "max_grad_norm / scale); use bf16=True (autocast, no scaler needed), or float32")
    for name in ("fp16_full_eval", "bf16_full_eval"):
        if getattr(args, name):
            raise ValueError(
                f"{name}=True: evaluation would cast the model's parameters to 16 bits, cutting "
                "them off from the private engine's float32 masters; remove it (with bf16=True "
                "evaluation runs under bf16 autocast, as training does)")
    if args.push_to_hub:
        raise ValueError("push_to_hub=True: the Trainer would upload checkpoints (their privacy "
                         "state, and in seeded mode the noise seed) and a model card with the "
                         "training loss, which ε does not cover; push the final model yourself")
    if args.save_only_model:
        raise ValueError("save_only_model=True: checkpoints would hold no optimizer or privacy "
                         "state, so a resume could not continue the accounting; remove it")
    if args.include_num_input_tokens_seen not in ("no", False, None):
        raise ValueError(
            f"include_num_input_tokens_seen={args.include_num_input_tokens_seen!r}: the count "
            "of tokens trained on releases the realised (Poisson) batch sizes, which are "
            "private; remove it")
    if kwargs.get("compute_loss_func") is not None:
        raise ValueError("compute_loss_func: the private Trainer computes one loss per example "
                         "(Note [trainer loss]); pass per_sample_loss=fn, fn(model, outputs, "
                         "labels) -> [B], instead")
    if cls.compute_loss is not Trainer.compute_loss:
        raise ValueError(f"{cls.__name__} overrides compute_loss, which training does not call "
                         "(Note [trainer loss]); pass per_sample_loss=fn instead")
    for holder in (kwargs.get("processing_class"), kwargs.get("data_collator")):
        tokenizer = getattr(holder, "tokenizer", holder)
        if getattr(tokenizer, "padding_side", None) == "left":
            raise ValueError(
                "the tokenizer pads on the left: with position ids counted from the start of the "
                "padded row, an example's positions would depend on the longest example of its "
                "micro-batch; set tokenizer.padding_side = 'right'")


def _refuse_parallel(args) -> None:
    """dpzero's engine is the data-parallel layer: refuse the Trainer's own, naming the
    setting."""
    if args.deepspeed:
        raise ValueError(f"deepspeed={args.deepspeed!r}: PrivateTrainer runs dpzero's own ZeRO "
                         "stages (PrivacyArguments.zero_stage); remove the DeepSpeed config")
    if args.fsdp:
        raise ValueError(f"fsdp={args.fsdp!r}: PrivateTrainer shards with dpzero's own ZeRO stages "
                         "(PrivacyArguments.zero_stage); remove the FSDP setting")
    if args.n_gpu > 1:
        raise ValueError(f"{args.n_gpu} GPUs in one process would use torch.nn.DataParallel; "
                         "run one process per GPU (set CUDA_VISIBLE_DEVICES)")
