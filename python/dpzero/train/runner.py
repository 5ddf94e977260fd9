"""One rank of a training job: data, model, make_private, the loop, evaluation, the run directory.

``run_job(cfg)`` runs on every rank (single process, or the ranks ``launch.py`` starts). It trains
privately, then (``[training] baseline``) the same model and settings without privacy — σ = 0 and
C = ∞ through the same engine path — and rank 0 writes the run directory. What is released (Note
[released figures] in private/engine.py: data-independent, or computed from the private model
alone) is kept apart from what is not:

    config.json     the parsed config            ledger.jsonl   the privacy ledger (durable)
    metrics.jsonl   ε per step, test metrics     result.json    the private run: test accuracy,
                    of the private model per                    ε, δ, σ, q, C, steps
                    epoch
    model.pt        the trained model (private)  report.md, report.json, *.png  (report.py)
    checkpoints/    sharded checkpoints of the private run (``[training] checkpoint_every``;
                    with ``loop = "trainer"`` the Trainer's checkpoint-<step>/, trainer_loop.py)
    private.json    the private run's result, once it has finished
    private/        NOT covered by ε, not to be shared: diagnostics.jsonl (each step's realised
                    batch size and dropped samples, from the engine), training.jsonl (training
                    losses, wall times; the baseline's evaluations), baseline.json (the
                    non-private model's results), diagnostics.md and loss.png (report.py)

Note [resuming a run]
~~~~~~~~~~~~~~~~~~~~~
``dpzero train CONFIG --resume`` continues a run that was killed (any rank, or all of them, at
any moment). The model, optimizer and RNG states come from the last committed checkpoint; the
privacy state comes from the ledger, which is written before every update and may be ahead of
the checkpoint. Every step the ledger holds stays charged: the steps between the checkpoint and
the crash are trained again and charged again (``PrivacyEngine.load_state_dict`` keeps the
ledger's higher charge count, so their noise indices and sampler steps are never reused), and
the budget guard counts both. ``result.json`` gives ``steps`` (the updates the final model went
through) and ``charged_steps`` (what ε is computed from). A finished private run
(``private.json``) is not run again; the non-private baseline is not checkpointed and restarts.
Without ``--resume`` a run directory that already holds a ledger is refused, so that a second
run never silently continues (or appears to restart) the budget of the first.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from typing import Dict, Optional

import torch.distributed as dist

from .. import checkpoint as ckpt
from ..front import make_private
from ..private import BudgetExhausted
from .config import ConfigError, RunConfig
from .outputs import Progress, atomic_json, atomic_save, final_state
from .report import PRIVATE_DIR
from .task import autocast, build, evaluate, loss, on_device, rank_device, rank_world


def train_once(cfg: RunConfig, private: bool, run_dir: str, metrics, diagnostics,
               resume: bool = False) -> Dict:
    """One run (private or the baseline). ``metrics``: rank 0's released log (metrics.jsonl);
    ``diagnostics``: rank 0's private one (private/training.jsonl); None on other ranks."""
    rank, world = rank_world()
    model, train, test, rows_of = build(cfg)
    device = rank_device(cfg)
    model.to(device)
    unpack = on_device(rows_of, device)
    cast = functools.partial(autocast, cfg, device)
    n = len(train)
    delta = cfg.delta_for(n)
    p_cfg, t_cfg = cfg.privacy, cfg.training
    common = dict(dataset=train, batch_size=min(t_cfg.batch_size, n), zero_stage=t_cfg.zero_stage,
                  max_physical_batch_size=t_cfg.max_physical_batch_size,
                  optimizer=t_cfg.optimizer, lr=t_cfg.lr, weight_decay=t_cfg.weight_decay,
                  accountant=p_cfg.accountant,
                  **({"momentum": t_cfg.momentum} if t_cfg.optimizer == "sgd" else {}))
    # The loop's length: b rows for each equivalent step of int(epochs / q) (q = B·b/N, as
    # make_private computes it), what σ is calibrated for and the optimized strategy is fitted
    # to (Note [run strategy]).
    bands = p_cfg.bands if private else 1
    rows = bands * int(t_cfg.epochs / (common["batch_size"] * bands / n))
    if private:
        kw = dict(max_grad_norm=p_cfg.max_grad_norm, clipping=p_cfg.clipping,
                  isolation=p_cfg.isolation, secure_mode=p_cfg.secure_mode, bands=p_cfg.bands,
                  # [training] seed seeds the noise only without secure mode (Note [secure by
                  # default] in privacy/entropy.h), as it does the Trainer loop's.
                  seed=None if p_cfg.secure_mode else t_cfg.seed,
                  ledger_path=os.path.join(run_dir, "ledger.jsonl"),
                  run_id=os.path.basename(os.path.abspath(run_dir)),
                  diagnostics_path=os.path.join(run_dir, PRIVATE_DIR, "diagnostics.jsonl"))
        kw.update(strategy=p_cfg.strategy, steps=rows)
        if p_cfg.target_epsilon is not None:
            kw.update(target_epsilon=p_cfg.target_epsilon, target_delta=delta)
        else:
            kw.update(noise_multiplier=p_cfg.noise_multiplier)
    else:
        kw = dict(noise_multiplier=0.0, max_grad_norm=math.inf, allow_no_noise=True,
                  seed=t_cfg.seed)
    if t_cfg.policy == "auto":
        budget = t_cfg.memory_budget_gib * 2.0**30 if t_cfg.memory_budget_gib else None
        kw.update(policy="auto", memory_budget=budget,
                  plan_step=lambda m, batch: loss(m, unpack(batch), cast))
    p = make_private(model, **common, **kw)
    engine = p.privacy_engine
    label = "private" if private else "baseline"
    taken, epoch = _restore(p, run_dir, metrics) if private and resume else (0, 0)
    total_steps = rows
    if engine.remaining_steps is not None:
        if engine.remaining_steps == 0:
            raise BudgetExhausted(f"the ε budget of the ledger in {run_dir} is already spent "
                                  f"({engine.charges} steps charged); refusing to start")
        total_steps = min(total_steps, taken + engine.remaining_steps)
    every = t_cfg.checkpoint_interval(total_steps) if private else 0
    progress = Progress(total_steps - taken, label, enabled=rank == 0)
    start = time.time()
    step_loss, step_rows = 0.0, 0
    stopped = None
    try:
        while taken < total_steps:
            for batch in p.data_loader:
                inputs, y = unpack(batch)
                p.optimizer.zero_grad()
                batch_loss = loss(p.model, (inputs, y), cast)
                batch_loss.backward()
                if not engine.is_padding_batch:  # Note [padding batches]: not a real row
                    step_loss += batch_loss.item() * len(y)
                    step_rows += len(y)
                if not p.optimizer.step():
                    continue
                taken += 1
                # This rank's mean loss over its rows of the logical batch: computed from the
                # training data without noise, so a data-dependent diagnostic (Note [released figures]).
                mean_loss = step_loss / max(step_rows, 1)
                step_loss, step_rows = 0.0, 0
                eps = engine.epsilon(delta) if private and (
                    taken % 10 == 0 or taken == total_steps) else None
                progress.update(eps)
                if rank == 0:
                    diagnostics.write(json.dumps({"run": label, "step": taken,
                                                  "loss": mean_loss}) + "\n")
                    diagnostics.flush()
                    if private:
                        metrics.write(json.dumps({"run": label, "step": taken,
                                                  "epsilon": eps}) + "\n")
                        metrics.flush()
                if taken == total_steps:
                    break
                if every and taken % every == 0:
                    _save(p, run_dir, taken, epoch, t_cfg.keep_checkpoints)
            epoch += 1
            ev = evaluate(p.model, test, unpack, cast)
            progress.update(accuracy=ev["accuracy"] if private else None, step=False)
            if rank == 0:
                # The private model on held-out data: released. The baseline: not private.
                log = metrics if private else diagnostics
                log.write(json.dumps({"run": label, "epoch": epoch, "step": taken, **ev}) + "\n")
                log.flush()
    except BudgetExhausted as e:  # the engine's guard: stop cleanly, say why
        stopped = str(e)
    finally:
        progress.close()
    seconds = time.time() - start
    final = evaluate(p.model, test, unpack, cast)
    params = engine.parameters()  # a collective in stages 1-3
    if rank == 0:  # the wall time follows the realised batch sizes: a data-dependent diagnostic
        diagnostics.write(json.dumps({"run": label, "seconds": seconds}) + "\n")
        diagnostics.flush()
    result = {"run": label, "steps": taken, "sample_rate": engine.sample_rate,
              "noise_multiplier": engine.noise_multiplier, "max_grad_norm": engine.max_grad_norm,
              "delta": delta, "train_examples": n, "test_examples": len(test),
              "epsilon": engine.epsilon(delta) if private else math.inf, "stopped": stopped,
              "charged_steps": engine.charges if private else 0,
              "zero_stage": engine.sharded.stage, "device": device.type,
              "precision": t_cfg.precision,
              "policy": (engine.memory_plan["chosen"].policy.label(len(engine.memory_plan["units"]))
                         if engine.memory_plan else "fixed"), **final}
    if rank == 0 and private:
        atomic_save(final_state(model, params), os.path.join(run_dir, "model.pt"))
        atomic_json(result, os.path.join(run_dir, "private.json"))
    return result


def _checkpoints(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def _save(p, run_dir: str, taken: int, epoch: int, keep: int) -> None:
    """A sharded checkpoint after ``taken`` steps (a collective; atomic, see dpzero.checkpoint).
    The privacy engine's state rides in the manifest: JSON, without seed or key in secure mode
    (``PrivacyEngine.state_dict``)."""
    ckpt.save(p.privacy_engine.sharded, _checkpoints(run_dir), step=taken, keep_last=keep,
              metadata={"taken": taken, "epoch": epoch,
                        "privacy_engine": p.privacy_engine.state_dict()})


def _restore(p, run_dir: str, metrics) -> tuple:
    """Note [resuming a run]: load the last committed checkpoint, if any, into the freshly built
    private run (whose ledger, reopened by make_private, already counts every charged step).
    Returns (steps taken, epochs finished) at the checkpoint."""
    engine = p.privacy_engine
    root = _checkpoints(run_dir)
    taken, epoch = 0, 0
    newest = _newest_committed(root)
    if newest is not None:
        info = ckpt.load(engine.sharded, newest)
        meta = info["metadata"]
        engine.load_state_dict(meta["privacy_engine"])
        taken, epoch = int(meta["taken"]), int(meta["epoch"])
    if metrics is not None:
        metrics.write(json.dumps({"run": "private", "resumed_at_step": taken,
                                  "charged_steps": engine.charges}) + "\n")
        metrics.flush()
    return taken, epoch


def _newest_committed(root: str) -> Optional[str]:
    """The newest committed step directory under the checkpoint root (one with its manifest),
    or None. Not ROOT/latest: a crash between a step directory's commit and the update of latest
    leaves the newest complete checkpoint unnamed (Note [checkpoint commit] in
    src/checkpoint/checkpoint.h), and resuming from the one before would retrain up to that step
    and then refuse to overwrite it."""
    if not os.path.isdir(root):
        return None
    steps = [name for name in os.listdir(root) if name.startswith("step-")
             and name[5:].isdigit() and os.path.exists(os.path.join(root, name, "manifest.json"))]
    return os.path.join(root, max(steps, key=lambda name: int(name[5:]))) if steps else None


def check_run_dir(cfg: RunConfig, resume: bool) -> None:
    """Note [resuming a run]: a run directory with a ledger is continued only on request."""
    ledger = os.path.join(cfg.output.dir, "ledger.jsonl")
    if not resume and os.path.exists(ledger):
        raise ConfigError(f"the run directory {cfg.output.dir!r} already holds a privacy ledger "
                          f"({ledger}); pass --resume to continue that run, or set [output] dir "
                          "to a new directory")


def _cut_torn_tail(path: str) -> Optional[Dict]:
    """A kill -9 during a ledger append leaves a torn last line (Note [torn tail] in
    accounting/ledger.h). Its step was never applied — every rank waits for the completed record
    before updating — so resuming cuts it off, says so on stderr and logs it in metrics.jsonl.
    Returns {"line", "bytes"} of what was cut, or None."""
    if not os.path.exists(path):
        return None
    from ..accounting import Ledger

    ledger = Ledger.open(path, truncate_torn_tail=True)
    cut = {"line": ledger.torn_tail_line, "bytes": ledger.torn_tail.decode("utf-8", "replace")} \
        if ledger.torn_tail_line else None
    ledger.close()
    if cut is not None:
        print(f"[dpzero train] {path}: line {cut['line']} was torn by the crash (its step was "
              f"never applied) and is cut off: {cut['bytes']!r}", file=sys.stderr)
    return cut


def run_job(cfg: RunConfig, resume: bool = False) -> Dict:
    """Every rank calls this; rank 0 returns the results (others an empty dict)."""
    from .report import write_report

    check_run_dir(cfg, resume)
    rank, _ = rank_world()
    run_dir = cfg.output.dir
    torn = None
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        atomic_json(cfg.to_dict(), os.path.join(run_dir, "config.json"))
        if resume:
            torn = _cut_torn_tail(os.path.join(run_dir, "ledger.jsonl"))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    results = {}
    done = os.path.join(run_dir, "private.json")
    metrics = diagnostics = None
    if rank == 0:
        os.makedirs(os.path.join(run_dir, PRIVATE_DIR), exist_ok=True)
        metrics = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        diagnostics = open(os.path.join(run_dir, PRIVATE_DIR, "training.jsonl"), "a")
    if torn is not None:
        metrics.write(json.dumps({"run": "private", "ledger_torn_tail_cut": torn}) + "\n")
    loop = train_once
    if cfg.training.loop == "trainer":
        from .trainer_loop import train_with_trainer as loop
    try:
        if resume and os.path.exists(done):
            with open(done) as f:
                results["private"] = json.load(f)
        else:
            results["private"] = loop(cfg, True, run_dir, metrics, diagnostics, resume=resume)
        if cfg.training.baseline:
            results["baseline"] = loop(cfg, False, run_dir, metrics, diagnostics)
    finally:
        for f in (metrics, diagnostics):
            if f is not None:
                f.close()
    if rank != 0:
        return {}
    atomic_json({"private": results["private"]}, os.path.join(run_dir, "result.json"))
    if "baseline" in results:  # a model trained without privacy: none of it is released
        atomic_json(results["baseline"], os.path.join(run_dir, PRIVATE_DIR, "baseline.json"))
    write_report(run_dir)
    return results
