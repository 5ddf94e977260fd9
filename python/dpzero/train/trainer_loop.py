"""``[training] loop = "trainer"``: one run of a training job through the Hugging Face Trainer.

``train_with_trainer`` is ``runner.train_once`` with ``dpzero.hf.PrivateTrainer`` in place of
dpzero's own loop, and the same run directory (runner.py's module docstring): the ledger is
``ledger.jsonl``, ε per step and the private model's test metrics per epoch go to
``metrics.jsonl``; training losses and wall times to ``private/training.jsonl`` and realised
batch sizes to ``private/diagnostics.jsonl``, never into the Trainer's logs (``_RunTrainer``), so
neither into ``checkpoint-<step>/trainer_state.json`` nor onto the console; the progress bar is
runner's (steps, ε, test accuracy); the result dict is the engine loop's. What the Trainer brings
is its own: the checkpoints (``checkpoint-<step>/`` in the run directory, ``[training]
checkpoint_every`` and ``keep_checkpoints``), the constant-LR schedule and optimizer it builds
from TrainingArguments (weight decay spares what the Trainer spares: biases and norm weights),
and its printed logs (ε, δ, learning rate, epoch). The baseline runs the same Trainer with σ = 0
and C = ∞ into ``private/baseline/`` (its ledger, of unnoised steps, is not the run's).

Where the two loops differ by construction: the Trainer's logical batch is
``max_physical_batch_size × gradient_accumulation_steps × world_size`` (config.py requires
batch_size to be such a multiple), and its step count is ceil(epochs · int(1/q)) against the
engine loop's int(epochs / q). ``--resume`` continues from the newest complete
``checkpoint-<step>/``, or from the start when there is none (Note [resuming a run] in runner.py
holds: the reopened ledger keeps every charged step).
"""

from __future__ import annotations

import functools
import glob
import json
import math
import os
import re
import shutil
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Dataset
from transformers import TrainerCallback, TrainingArguments, default_data_collator
from transformers.trainer import TRAINER_STATE_NAME

from ..hf import PrivacyArguments, PrivateTrainer
from ..hf.trainer import PRIVACY_STATE
from ..private.config import steps_per_epoch
from .config import RunConfig
from .report import PRIVATE_DIR
from .outputs import Progress, atomic_json, atomic_save, final_state
from .task import (autocast, build, device_kind, evaluate, input_names, on_device, ranks_here,
                   rank_world)

# dpzero's optimizer names as the Trainer's `optim` (AdamW with weight_decay 0 is Adam).
_OPTIM = {"adamw": "adamw_torch", "adam": "adamw_torch", "sgd": "sgd"}


class _RunTrainer(PrivateTrainer):
    """PrivateTrainer whose private records (the figures ε does not cover, which PrivateTrainer
    keeps out of its logs) go to the run directory's ``private/training.jsonl`` stream (rank 0's
    ``diagnostics``), labelled with the run (the private one or the baseline)."""

    def __init__(self, *args, diagnostics=None, label: str = "private", **kwargs) -> None:
        self._diagnostics, self._label = diagnostics, label
        super().__init__(*args, **kwargs)

    def _write_private(self, record: Dict) -> None:
        if self._diagnostics is not None:
            self._diagnostics.write(json.dumps({**record, "run": self._label}) + "\n")
            self._diagnostics.flush()


class _Rows(Dataset):
    """A runner dataset's rows as the Trainer's dicts: the model's forward arguments by name
    (``names``, in ``unpack``'s order) and ``labels``."""

    def __init__(self, data: Dataset, unpack, names) -> None:
        self.data, self.unpack, self.names = data, unpack, names

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        inputs, label = self.unpack(self.data[i])
        return dict(zip(self.names, inputs), labels=label)


def _per_example_cross_entropy(model, logits: torch.Tensor, labels: torch.Tensor):
    """The jobs' models return logits [B, classes]; each example's own loss [B]."""
    return F.cross_entropy(logits, labels, reduction="none")


def latest_checkpoint(run_dir: str) -> Optional[str]:
    """The newest complete ``checkpoint-<step>`` directory of the Trainer in ``run_dir``, or
    None. The Trainer writes a checkpoint's files in place, trainer_state.json last (after
    PrivateTrainer's dpzero_privacy.json), so a run killed while saving leaves a directory
    without a readable one: it is passed over for the one before."""
    found = []
    for path in glob.glob(os.path.join(run_dir, "checkpoint-*")):
        m = re.fullmatch(r"checkpoint-(\d+)", os.path.basename(path))
        if m is None or not os.path.exists(os.path.join(path, PRIVACY_STATE)):
            continue
        try:
            with open(os.path.join(path, TRAINER_STATE_NAME)) as f:
                json.load(f)
        except (OSError, ValueError):
            continue
        found.append((int(m.group(1)), path))
    return max(found)[1] if found else None


def train_with_trainer(cfg: RunConfig, private: bool, run_dir: str, metrics, diagnostics,
                       resume: bool = False) -> Dict:
    """One run (private or the baseline) through PrivateTrainer; ``metrics``/``diagnostics``
    as in runner.train_once (rank 0's logs, None elsewhere)."""
    rank, world = rank_world()
    model, train, test, unpack = build(cfg)
    cpu = device_kind(cfg.training.device, ranks_here(cfg)) == "cpu"
    n = len(train)
    delta = cfg.delta_for(n)
    p_cfg, t_cfg = cfg.privacy, cfg.training
    label = "private" if private else "baseline"
    output_dir = run_dir if private else os.path.join(run_dir, PRIVATE_DIR, "baseline")
    if not private:  # a baseline restarts from scratch, its ledger too
        if rank == 0:
            shutil.rmtree(output_dir, ignore_errors=True)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    every = t_cfg.checkpoint_interval(_planned_steps(cfg, n)) if private else 0
    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=t_cfg.max_physical_batch_size,
        gradient_accumulation_steps=t_cfg.batch_size // (t_cfg.max_physical_batch_size * world),
        num_train_epochs=t_cfg.epochs, learning_rate=t_cfg.lr, optim=_OPTIM[t_cfg.optimizer],
        weight_decay=t_cfg.weight_decay, lr_scheduler_type="constant", warmup_steps=0,
        logging_steps=10, report_to=[], save_strategy="steps" if every else "no",
        save_steps=max(every, 1), save_total_limit=t_cfg.keep_checkpoints,
        use_cpu=cpu, bf16=t_cfg.precision == "bf16", seed=t_cfg.seed, disable_tqdm=True,
        dataloader_num_workers=0, label_names=["labels"])
    device = args.device  # the Trainer's: cuda:LOCAL_RANK under the launcher, cuda:0 alone
    if not cpu and not (dist.is_available() and dist.is_initialized()):
        # One rank on a machine of several GPUs: the Trainer would spread the batch over all
        # of them with DataParallel (which PrivateTrainer refuses); the job's one rank takes one.
        args._n_gpu = 1
    on_rank = on_device(unpack, device)
    cast = functools.partial(autocast, cfg, device)
    if private:
        privacy = PrivacyArguments(
            target_epsilon=p_cfg.target_epsilon, target_delta=delta,
            noise_multiplier=p_cfg.noise_multiplier, max_grad_norm=p_cfg.max_grad_norm,
            clipping=p_cfg.clipping, isolation=p_cfg.isolation, accountant=p_cfg.accountant,
            bands=p_cfg.bands, strategy=p_cfg.strategy, zero_stage=t_cfg.zero_stage,
            secure_mode=p_cfg.secure_mode, seed=None if p_cfg.secure_mode else t_cfg.seed,
            diagnostics_path=os.path.join(run_dir, PRIVATE_DIR, "diagnostics.jsonl"))
    else:
        privacy = PrivacyArguments(noise_multiplier=0.0, allow_no_noise=True,
                                   max_grad_norm=math.inf, zero_stage=t_cfg.zero_stage,
                                   accountant=p_cfg.accountant, secure_mode=False,
                                   seed=t_cfg.seed)
    trainer = _RunTrainer(model=model, args=args, train_dataset=_Rows(train, unpack,
                                                                       input_names(cfg)),
                          data_collator=default_data_collator, privacy_args=privacy,
                          per_sample_loss=_per_example_cross_entropy, diagnostics=diagnostics,
                          label=label)
    engine = trainer.privacy_engine
    # The Trainer's printer shows each log (ε, δ, lr, epoch: the unreleased figures are gone);
    # its progress bar would show step times, so runner's bar takes its place.
    checkpoint = latest_checkpoint(run_dir) if private and resume else None
    progress = Progress(trainer.planned_steps - _step_of(checkpoint), label, enabled=rank == 0)
    trainer.add_callback(_RunLogs(trainer, label, private, test, on_rank, cast, metrics,
                                  diagnostics, progress))
    if private and resume and metrics is not None:
        metrics.write(json.dumps({"run": label, "resumed_at_step": _step_of(checkpoint),
                                  "charged_steps": engine.charges}) + "\n")
        metrics.flush()
    try:
        # --resume without a complete checkpoint (a crash before the first) starts over while
        # the ledger keeps every step it charged (Note [resuming a run] in runner.py).
        trainer.train(resume_from_checkpoint=checkpoint, continue_ledger=private and resume)
    finally:
        progress.close()
    final = evaluate(trainer.private_model, test, on_rank, cast)
    params = engine.parameters()  # a collective in stages 1-3
    result = {"run": label, "steps": trainer.state.global_step, "sample_rate": engine.sample_rate,
              "noise_multiplier": engine.noise_multiplier, "max_grad_norm": engine.max_grad_norm,
              "delta": delta, "train_examples": n, "test_examples": len(test),
              "epsilon": engine.epsilon(delta) if private else math.inf,
              "stopped": trainer.budget_stop, "charged_steps": engine.charges if private else 0,
              "zero_stage": engine.sharded.stage, "device": device.type,
              "precision": t_cfg.precision, "policy": "fixed", "loop": "trainer", **final}
    if rank == 0 and private:
        atomic_save(final_state(model, params), os.path.join(run_dir, "model.pt"))
        atomic_json(result, os.path.join(run_dir, "private.json"))
    return result


def _planned_steps(cfg: RunConfig, n: int) -> int:
    """The Trainer's step count for the run (PrivateTrainer's: ceil(epochs · steps_per_epoch))."""
    b = cfg.privacy.bands
    q = min(cfg.training.batch_size * b, n) / n
    return math.ceil(cfg.training.epochs * steps_per_epoch(q, b))


def _step_of(checkpoint: Optional[str]) -> int:
    return int(os.path.basename(checkpoint).split("-")[1]) if checkpoint else 0


class _RunLogs(TrainerCallback):
    """The run directory's logs from the Trainer's events (every rank; rank 0 writes)."""

    def __init__(self, trainer, label: str, private: bool, test, unpack, cast, metrics,
                 diagnostics, progress: Progress) -> None:
        self.trainer, self.label, self.private = trainer, label, private
        self.test, self.unpack, self.cast = test, unpack, cast
        self.metrics, self.diagnostics, self.progress = metrics, diagnostics, progress

    def _write(self, log, record) -> None:
        if log is not None:
            log.write(json.dumps({"run": self.label, **record}) + "\n")
            log.flush()

    def on_step_end(self, args, state, control, **kwargs):
        # ε every 10 steps and at the last one (PRV's ε costs ms), as the engine loop logs it;
        # the last is also a step at which the budget stopped the run.
        eps = None
        if self.private:
            step = state.global_step
            last = step == state.max_steps or self.trainer.budget_stop is not None
            eps = self.trainer.epsilon() if step % 10 == 0 or last else None
            self._write(self.metrics, {"step": step, "epsilon": eps})
        self.progress.update(eps)

    def on_epoch_end(self, args, state, control, **kwargs):
        # A collective.
        ev = evaluate(self.trainer.private_model, self.test, self.unpack, self.cast)
        # The private model on held-out data is released; the baseline's is not private.
        self._write(self.metrics if self.private else self.diagnostics,
                    {"epoch": round(state.epoch), "step": state.global_step, **ev})
        self.progress.update(accuracy=ev["accuracy"] if self.private else None, step=False)
