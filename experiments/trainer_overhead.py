"""Per-step overhead of the private Trainer: dpzero.hf.PrivateTrainer against
dpzero.make_private driven by a plain loop, on the same model, batches and optimizer.

Model: GPT-2 (transformers' GPT2LMHeadModel from a config) of 2 layers, width 64, 4 heads,
vocabulary 256; causal-LM data of N = 512 random sequences of T = 32 tokens. Both systems:
expected logical batch 16 (micro-batches of at most 8: per_device_train_batch_size = 8,
gradient_accumulation_steps = 2), σ = 1, C = 1, SGD at a constant learning rate, ZeRO stage 0,
one torch thread, the same seed (so the same Poisson batches), each example's loss from
dpzero.hf.losses (the Trainer's own).

  make_private   for batch in data_loader: loss.backward(); optimizer.step(); scheduler.step()
  trainer        PrivateTrainer(...).train() with logging every 10 steps, no progress bar, no
                 checkpoints (a callback timestamps each step's end)

Timing: a step is the time between consecutive ends of optimizer steps (everything the loop does
per step: data, forward, backward, the private step, the scheduler, callbacks and logs). Rounds
alternate the two systems, each on a fresh model. Both draw the same Poisson batches, so step i
has the same realised batch in both: the ratio is taken step by step (trainer / make_private),
and the table gives its median over every step of every round with the IQR, beside each
system's median step time.

    .venv/bin/python experiments/trainer_overhead.py            # writes results/trainer.md
    .venv/bin/python experiments/trainer_overhead.py --rounds 2 --steps 10 --no-write
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dpzero  # noqa: E402
import transformers  # noqa: E402
from bench_common import dpzero_version, write_marked_section  # noqa: E402
from dpzero.hf import PrivacyArguments, PrivateTrainer  # noqa: E402
from dpzero.hf.losses import token_losses  # noqa: E402

N, T, VOCAB, PER_DEVICE, ACCUMULATION, LR, SEED = 512, 32, 256, 8, 2, 0.05, 7
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "trainer.md")


def model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=64, n_layer=2,
                                  n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def data():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(N):
        ids = torch.randint(0, VOCAB, (T,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def run_make_private(steps: int, dataset) -> list:
    p = dpzero.make_private(
        model(), data_loader=torch.utils.data.DataLoader(
            dataset, batch_size=PER_DEVICE * ACCUMULATION,
            collate_fn=transformers.default_data_collator),
        noise_multiplier=1.0, max_grad_norm=1.0, max_physical_batch_size=PER_DEVICE, seed=SEED,
        loss_reduction="sum", optimizer="sgd", lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(p.optimizer, lambda _: 1.0)
    ends = []
    while len(ends) < steps:
        for batch in p.data_loader:
            labels = batch.pop("labels")
            token_losses(p.model(**batch).logits, labels, shift=True).sum().backward()
            if p.optimizer.step():
                scheduler.step()
                ends.append(time.perf_counter())
            p.optimizer.zero_grad()
            if len(ends) == steps:
                break
    return ends


class _StepEnds(transformers.TrainerCallback):
    def __init__(self):
        self.ends = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def run_trainer(steps: int, dataset, out: str) -> list:
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=ACCUMULATION, learning_rate=LR, optim="sgd",
        lr_scheduler_type="constant", max_steps=steps, logging_steps=10, report_to=[],
        save_strategy="no", use_cpu=True, seed=SEED, disable_tqdm=True)
    ends = _StepEnds()
    trainer = PrivateTrainer(model=model(), args=args, train_dataset=dataset,
                             privacy_args=PrivacyArguments(noise_multiplier=1.0, seed=SEED),
                             callbacks=[ends])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # quiet, still logs
    trainer.train()
    return ends.ends


def step_times(ends: list) -> list:
    return [b - a for a, b in zip(ends, ends[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-write", action="store_true")
    a = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    dataset = data()
    times = {"make_private": [], "trainer": []}
    ratios = []
    for r in range(a.rounds):
        with tempfile.TemporaryDirectory() as out:
            t = step_times(run_trainer(a.steps, dataset, out))
        gc.collect()
        m = step_times(run_make_private(a.steps, dataset))
        gc.collect()
        times["trainer"] += t
        times["make_private"] += m
        ratios += [x / y for x, y in zip(t, m)]  # step i: the same realised batch in both
        print(f"round {r}: make_private {1e3 * statistics.median(m):.1f} ms, trainer "
              f"{1e3 * statistics.median(t):.1f} ms", flush=True)
    q = sorted(ratios)
    lo, hi = q[len(q) // 4], q[(3 * len(q)) // 4]
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    section = "\n".join([
        "<!-- trainer:begin -->",
        f"Written by `experiments/trainer_overhead.py` ({a.rounds} rounds of {a.steps} steps "
        f"per system; {dpzero_version()}; {os.cpu_count()} CPU cores, one torch thread).",
        "",
        f"GPT-2, 2 layers, width 64, T = {T}, N = {N}; expected logical batch "
        f"{PER_DEVICE * ACCUMULATION} in micro-batches of at most {PER_DEVICE}; σ = 1, C = 1, "
        "SGD.",
        "",
        "| system | median step (ms) | × make_private (median of paired steps, IQR) |",
        "|---|---|---|",
        f"| make_private loop | {med['make_private']:.1f} | 1.00 |",
        f"| PrivateTrainer | {med['trainer']:.1f} | {statistics.median(ratios):.3f} "
        f"({lo:.3f}–{hi:.3f}) |",
        "<!-- trainer:end -->",
    ])
    print(section)
    if not a.no_write:
        write_marked_section(RESULTS, "trainer", "# The private Trainer's per-step overhead\n",
                             section)


if __name__ == "__main__":
    main()
