"""Private step time and memory: dpzero.make_private against dpzero's own non-private step and
Opacus 1.6, side by side, on one small BERT.

Systems. One BertForSequenceClassification built from a BertConfig (sizes from the flags, dropout
0 so every system computes the same function, eager attention) is trained with plain SGD (lr
--lr, no momentum, no weight decay) in one process on the CPU (torch.set_num_threads(--threads)):
  torch          non-private reference: the model + torch.optim.SGD
  zero0          non-private on our engine: dpzero.shard(model, stage=0, optimizer="sgd",
                 grad_scale=1.0); step = forward + backward + ShardedModule.step (which zeroes)
  dp-flat        dpzero.make_private(model, clipping="flat", zero_stage=0, optimizer="sgd"):
                 noise sigma = --sigma, clip norm C = --clip, loss_reduction="mean"
  dp-layer       the same with clipping="layer" (thresholds C/sqrt(k) for the model's k layers)
  dp-strict      dp-flat with isolation="strict": each example's forward and backward computed
                 by itself (Note [strict isolation] in python/dpzero/private/strict.py)
  dp-flat-stream dp-flat with early norms (each input's norms when its last call has reported,
                 Note [norms when their input is done] in src/dp/book.cpp) queued on a second
                 stream of the device (Note [norms on a side stream] in src/dp/norm_schedule.h;
                 the same arithmetic, so the same results; on the CPU only the order changes)
  opacus-hooks   opacus.PrivacyEngine().make_private(grad_sample_mode="hooks"): per-sample
                 gradients by module hooks, then DPOptimizer clips, sums and adds noise
  opacus-ghost   grad_sample_mode="ghost": Opacus's fast gradient clipping (ghost norms where it
                 has them, two backward passes packed into the wrapped criterion's backward)
  opacus-ew      grad_sample_mode="ew": torch's ExpandedWeights per-sample gradients
  opacus-functorch  grad_sample_mode="functorch": torch.func vmap per-sample gradients
Each private system gets the same sigma, C and expected batch size KB (Opacus: a DataLoader of
batch size KB over a dataset of N = B K max(2, ceil(--batches / K)) rows, a whole number of
logical batches, since Opacus takes N / len(loader) as the expected batch; dpzero: batch_size=KB
over the same dataset), so both normalise the noisy sum by KB. An Opacus mode that fails to build or step here
is listed with its error and left out of the ratios; so is any other system that raises.

Logical batches (--accumulate K, default 1). DP-SGD trains on large logical batches made of
micro-batches that fit in memory; each system accumulates K micro-batches of B rows by its own
mechanism and takes one optimizer step (one noise draw) per logical batch:
  torch, zero0   backward of (mean loss / K) per micro-batch, one step;
  dp-*           backward of each micro-batch's mean loss (the book recovers per-sample
                 gradients, Note [mean loss]), one optimizer.step();
  opacus-*       per micro-batch zero_grad, backward, and step(), with signal_skip_step before
                 every step but the last (what Opacus's BatchMemoryManager does): clipped sums
                 accumulate in summed_grad, the last step adds noise once and divides by KB.
With K = 1 this is one plain step per batch.

Same inputs everywhere. Micro-batch k is rows [kB, (k+1)B) (k cycled over the dataset's
batches) of random token ids and random labels from a fixed generator; logical step s takes
micro-batches sK, ..., sK + K - 1 (real text is not needed for timing). Every system is fed the
same fixed batch directly (no Poisson loader: its batch sizes vary; dpzero takes it through
PrivacyEngine.own_batch, its ledgered opt-out for batches the caller samples), with explicit,
contiguous position_ids and token_type_ids of shape [B, T]. Hugging Face's defaults do not suit
per-sample clipping: position_ids default to a [1, T] buffer slice (one row broadcast over the
batch, which Opacus hooks/functorch/ew fail on, and dpzero refused before its Note [broadcast
positions]), and the default token_type_ids are an expand()ed view that Opacus's ghost embedding
norm cannot .view(). Every model is built after torch.manual_seed(0), so all start from the same
weights.

Correctness, checked before timing, not timed. Each system takes one logical step from the
initial weights on logical batch 0 (sigma = 0), and its update (parameters after minus before) is
compared with a reference computed independently, example by example: KB forward/backward passes
of one example each through a plain float64 copy of the model give the per-sample gradients g_i
(in float32 the reference's own rounding reached 1e-4 of the clipped update at width 768), and the
reference update is -lr/(KB) * sum_i c_i g_i. Two settings:
  no clip   C = inf for dpzero (allow_no_noise=True), C = 1e6 for Opacus (it needs a finite C),
            c_i = 1: every system, private or not, must give the plain mean-gradient SGD step;
  clip C    C = --clip; flat: c_i = min(1, C / (||g_i|| + 1e-6)); layer (dp-layer only): the
            same per layer with threshold C/sqrt(k). Private systems only.
Both take SGD with lr = CHECK_LR (1e3, so that the update read off as float32 parameters after
minus before is not quantised by the parameters' ulps). The error is ||update - reference|| /
||reference|| over all parameters; it must be at most CHECK_RTOL. A system that misses is reported as a MISMATCH in the results, not dropped, and the
benchmark goes on.

Time. All systems that built are stepped interleaved, round by round, the order rotated every
round, so that changes in machine load hit all of them alike. One step = one logical step as
above: zero_grad + K (forward + loss + backward) + optimizer step (dpzero private: optimizer.zero_grad(); loss.backward();
optimizer.step(), which takes a full private step on what was accumulated; Opacus ghost: the
wrapped criterion's backward). After --warmup rounds, --repeats rounds are timed
(time.perf_counter around the step); the table gives each system's median and interquartile
range. Ratios are between medians of the same run. Paired ratios: a round steps every system
once, seconds apart, so the ratio of two systems' steps in the same round cancels whatever slows
the whole machine for longer than a round (on a shared virtual machine, speed drifts by tens of
percent over minutes: throttling, other guests' memory traffic, none of it visible in /proc/stat);
the median and interquartile range of those per-round ratios are reported beside the ratio of
medians. The verdicts use both: DP <= 1.2x needs the ratio of medians and the paired median at or
below 1.2; "faster than Opacus" needs dp-flat faster in at least three rounds of four (paired upper
quartile below 1), and a paired interquartile range around 1 is a tie.
Shared machines. With --threads equal to the core count, another busy process slows a step
several-fold, and not evenly across systems. So the share of the machine's CPU that other
processes use (/proc/stat busy time minus this process's CPU time) is measured over every round;
a timed round in which it exceeds NOISY_OTHER_CPU (10%) is discarded and run again, and before
each round the benchmark waits for the machine to be quiet, both out of a budget of --max-wait
seconds. Once the budget is spent, disturbed rounds are kept, counted and flagged in the results.
The installed dpzero is stamped (file modification times) at the start and the end; if it was
re-synced during the run the results say so.

Autocast. --autocast bf16 (or fp16) runs every system's forward and loss under
torch.autocast(device, dtype), the way PyTorch users train in 16 bits: parameters, optimizers and
every private system's clipping and noise stay float32; torch.amp.GradScaler is not used (it
cannot drive a private step: it scales gradients before clipping). The correctness reference is
then a float32 copy of the model under the same autocast on the CPU, one example at a time,
clipped and summed in float64; autograd's own 16-bit matmuls round the reference's gradients, so
the tolerance is CHECK_RTOL_AUTOCAST (a dtype or scaling mistake is O(1)). The step-time ratios
answer "≤ 1.3x the 16-bit non-private step".

Ghost kernels. --ghost-split-from T makes the CUDA ghost norms take the split tiles (Note
[split tiles] in kernels/cuda/ghost_split_tiles.cu) from sequence length T on, in this process and
its memory runs, so a GPU run can time the step with them before they become the default; the
results' model line says so.

Device. --device cuda runs every system on the GPU (the float64 correctness reference stays on
the CPU): each timed step ends with torch.cuda.synchronize(), and memory is the CUDA caching
allocator's (below; the CSV's rss_* columns then hold its bytes, and its device column says so).
The 1.2x target is a GPU target in the DP-ZeRO paper; experiments/gpu/private_rows.sh runs this
script on a lent GPU.

Memory. Each system runs alone in a fresh process (same flags, same threads) with glibc's mmap
threshold fixed (MALLOC_MMAP_THRESHOLD_=131072), so that a freed large block leaves the resident
set instead of staying in the heap. Before the baseline a throwaway copy of the model takes one
plain SGD step and is freed (one-off library set-up is not charged to any system). Then:
  peak RSS   peak resident set size over --memory-steps steady-state steps (VmHWM, reset through
             /proc/self/clear_refs after two steps) minus the resident size (VmRSS) just before
             the system was built: parameters + gradients + per-sample state (Opacus's
             grad_sample, dpzero's clipping book) + activations + allocator overhead.
  held       VmRSS after the last step minus the same baseline: what the system keeps between
             steps.
On CUDA the same two figures come from torch.cuda.max_memory_allocated (its peak reset after two
steps) and torch.cuda.memory_allocated, against memory_allocated before the system was built.

Usage: .venv/bin/python experiments/private_bench.py [--repeats 21] [--threads 2] ...
[--accumulate K] [--tag NAME: a second configuration in its own section of the same file]
(defaults: 4 layers, hidden 256, 4 heads, intermediate 1024, vocab 8192, T = 128, B = 16; about
5 minutes on 2 idle cores). Writes experiments/results/private.md (the section between its
markers; notes outside them are kept) and experiments/results/private.csv.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bench_common import require_baseline

require_baseline("opacus", "private_bench.py")
import opacus  # noqa: E402
import transformers  # noqa: E402
from opacus import PrivacyEngine as OpacusEngine  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification  # noqa: E402

import dpzero  # noqa: E402
from bench_common import (dpzero_version, paired_ratios, proc_status_bytes, reset_peak_rss,
                          write_csv, write_marked_section)

# Everything above is imported before any measurement: module code is not model memory.

# Opacus warns on every make_private (secure RNG off, full backward hooks); not results.
warnings.filterwarnings("ignore", module=r"opacus(\.|$)")
warnings.filterwarnings("ignore", message=".*(secure|Secure) (RNG|mode).*")
transformers.logging.set_verbosity_error()

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_MD = os.path.join(HERE, "results", "private.md")
SYSTEMS = ["torch", "zero0", "dp-flat", "dp-layer", "dp-strict", "dp-flat-stream", "opacus-hooks",
           "opacus-ghost", "opacus-ew", "opacus-functorch"]
# dp-strict is run when asked for (--systems): several times the others' step at larger widths;
# dp-flat-stream likewise (check.sh asks for it on a GPU; on the CPU it is dp-flat).
DEFAULT_SYSTEMS = [s for s in SYSTEMS if s not in ("dp-strict", "dp-flat-stream")]
OPACUS_MODES = {"opacus-hooks": "hooks", "opacus-ghost": "ghost", "opacus-ew": "ew",
                "opacus-functorch": "functorch"}
PRIVATE = {"dp-flat", "dp-layer", "dp-strict", "dp-flat-stream", *OPACUS_MODES}
OPACUS_NO_CLIP = 1e6  # Opacus needs a finite C; no example's gradient norm comes near it
CHECK_RTOL = 1e-4
CHECK_RTOL_AUTOCAST = 2e-2  # under --autocast (module docstring): 16-bit rounding of the reference
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
CHECK_LR = 1e3  # the correctness check's SGD lr (check(): the update must not drown in ulps)
NOISY_OTHER_CPU = 0.10  # share of the machine's CPU used by other processes that marks a run noisy
MIB = 2.0**20


# ---- model and data ------------------------------------------------------------------------------


def autocast(cfg: dict, device: str | None = None):
    """The forward's autocast context: --autocast's dtype on ``device`` (default the systems'),
    or a disabled one."""
    dtype = AUTOCAST.get(cfg.get("autocast") or "")
    return torch.autocast(torch.device(device or cfg.get("device", "cpu")).type,
                          dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def apply_kernel_settings(cfg: dict) -> None:
    """--ghost-split-from: the process setting behind it (none by default)."""
    if cfg.get("ghost_split_from") is not None:
        torch.ops.dpzero._set_ghost_split_min_rows(cfg["ghost_split_from"])


def check_rtol(cfg: dict) -> float:
    return CHECK_RTOL_AUTOCAST if cfg.get("autocast") else CHECK_RTOL


def make_model(cfg: dict) -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"],
                        num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                        intermediate_size=cfg["intermediate"], max_position_embeddings=cfg["seq"],
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2,
                        attn_implementation="eager")
    return BertForSequenceClassification(config).train()


class Data:
    """--batches batches of B rows (random ids, random labels) and the fixed [B, T] position and
    token-type ids fed to every system."""

    def __init__(self, cfg: dict):
        g = torch.Generator().manual_seed(1234)
        b, t, n = cfg["batch"], cfg["seq"], cfg["batch"] * cfg["batches"]
        self.ids = torch.randint(cfg["vocab"], (n, t), generator=g)
        self.labels = torch.randint(2, (n,), generator=g)
        self.dataset = TensorDataset(self.ids, self.labels)
        self.b, self.k = b, cfg["accumulate"]
        device = torch.device(cfg.get("device", "cpu"))
        # The systems' copies, on their device (the dataset stays on the CPU: only its length is
        # read, for the sampling rate).
        self.ids_dev, self.labels_dev = self.ids.to(device), self.labels.to(device)
        self.position_ids = torch.arange(t, device=device).repeat(b, 1)  # contiguous [B, T]
        self.token_type_ids = torch.zeros(b, t, dtype=torch.long, device=device)

    def batch(self, k: int):
        rows = slice((k % len(self)) * self.b, (k % len(self) + 1) * self.b)
        return self.ids_dev[rows], self.labels_dev[rows]

    def step_batches(self, k: int) -> list:
        """The K micro-batches (ids, labels) of logical step k: batches kK, ..., kK + K - 1."""
        return [self.batch(k * self.k + j) for j in range(self.k)]

    def __len__(self) -> int:
        return len(self.dataset) // self.b

    def logits(self, model, ids):
        n = ids.shape[0]
        # input_ids positionally: Opacus's "ew" wrapper's forward takes its input as `x`; the
        # float64 reference runs on the CPU whatever the systems' device
        return model(ids, position_ids=self.position_ids[:n].to(ids.device),
                     token_type_ids=self.token_type_ids[:n].to(ids.device)).logits


# ---- the systems ---------------------------------------------------------------------------------


class System:
    """step(ids, labels) -> loss; params() -> {canonical name: tensor} after a step."""

    def __init__(self, name: str, cfg: dict, data: Data, sigma: float, clip: float):
        self.name, self.data = name, data
        self.amp = lambda: autocast(cfg)  # the forward's and the loss's (--autocast)
        model = make_model(cfg).to(cfg.get("device", "cpu"))
        self.model = model  # the module whose parameters are trained (Opacus, torch)
        lr = cfg["lr"]
        if name == "torch":
            self.opt = torch.optim.SGD(model.parameters(), lr=lr)
            self._step = self._torch_step
        elif name == "zero0":
            self.sharded = dpzero.shard(model, stage=0, optimizer="sgd", lr=lr, grad_scale=1.0)
            self._step = self._zero_step
        elif name in ("dp-flat", "dp-layer", "dp-strict", "dp-flat-stream"):
            self.private = dpzero.make_private(
                model, dataset=data.dataset, batch_size=data.b * data.k, noise_multiplier=sigma,
                max_grad_norm=clip, clipping="layer" if name == "dp-layer" else "flat",
                zero_stage=0, optimizer="sgd", lr=lr, seed=0, max_physical_batch_size=None,
                loss_reduction="mean", allow_no_noise=sigma == 0.0,
                isolation="strict" if name == "dp-strict" else "detect")
            self._step = self._dp_step
        elif name in OPACUS_MODES:
            mode = OPACUS_MODES[name]
            out = OpacusEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                data_loader=DataLoader(data.dataset, batch_size=data.b * data.k),
                noise_multiplier=sigma,
                max_grad_norm=clip if math.isfinite(clip) else OPACUS_NO_CLIP,
                grad_sample_mode=mode, criterion=nn.CrossEntropyLoss(), loss_reduction="mean")
            if mode == "ghost":
                self.runner, self.opt, self.criterion, _ = out
            else:
                (self.runner, self.opt, _), self.criterion = out, nn.CrossEntropyLoss()
            self._step = self._opacus_step
        else:
            raise ValueError(f"unknown system {name!r}")

    def step(self, batches) -> torch.Tensor:
        """One logical step over ``batches`` (K micro-batches (ids, labels)); the last loss."""
        if self.name != "dp-flat-stream":
            return self._step(batches)
        # process settings: this system's only
        before = dpzero._C.dp._set_early_norms(True), dpzero._C.dp._set_norm_stream(True)
        try:
            return self._step(batches)
        finally:
            dpzero._C.dp._set_early_norms(before[0])
            dpzero._C.dp._set_norm_stream(before[1])

    # Non-private: each micro-batch's mean loss / K, so the gradient is the logical batch's mean.

    def _torch_step(self, batches):
        self.opt.zero_grad(set_to_none=True)
        for ids, labels in batches:
            with self.amp():
                loss = F.cross_entropy(self.data.logits(self.model, ids), labels)
            (loss / len(batches)).backward()
        self.opt.step()
        return loss.detach()

    def _zero_step(self, batches):
        for ids, labels in batches:
            with self.amp():
                loss = F.cross_entropy(self.data.logits(self.sharded, ids), labels)
            (loss / len(batches)).backward()
        self.sharded.step()
        return loss.detach()

    # dpzero private: each micro-batch's mean loss (per-sample gradients are recovered from it,
    # Note [mean loss]); the clipped sums accumulate and the one step() noises and normalises by
    # the expected logical batch K B.

    def _dp_step(self, batches):
        p = self.private
        p.optimizer.zero_grad()
        size = sum(ids.shape[0] for ids, _ in batches)
        for ids, labels in batches:
            # The benchmark's fixed batches come in through own_batch, the ledgered opt-out for
            # batches a caller samples (Note [batch provenance]): every tensor of the batch with
            # one row per example, the position and token type ids included.
            n = ids.shape[0]
            ids, labels, pos, types = p.privacy_engine.own_batch(
                (ids, labels, self.data.position_ids[:n], self.data.token_type_ids[:n]),
                logical_batch_size=size)
            with self.amp():
                logits = p.model(ids, position_ids=pos, token_type_ids=types).logits
                loss = F.cross_entropy(logits, labels)
            loss.backward()
        p.optimizer.step()
        return loss.detach()

    # Opacus: its own accumulation (what BatchMemoryManager does): every micro-batch clips and
    # adds into summed_grad, the steps before the last are signalled as skipped, and the last one
    # adds the noise once and divides by expected_batch_size = K B (the data loader's batch).

    def _opacus_step(self, batches):
        for j, (ids, labels) in enumerate(batches):
            self.opt.zero_grad()
            with self.amp():
                loss = self.criterion(self.data.logits(self.runner, ids), labels)
            loss.backward()
            if j + 1 < len(batches):
                self.opt.signal_skip_step(do_skip=True)
            self.opt.step()
        return loss.detach()

    def params(self) -> dict:
        if hasattr(self, "sharded"):
            return self.sharded.full_parameters()
        if hasattr(self, "private"):
            return self.private.privacy_engine.parameters()
        return {n: p.detach() for n, p in self.model.named_parameters()}


def try_build(name, cfg, data, sigma, clip):
    """(system, None) or (None, error text): a system that cannot be built is reported, not
    fatal."""
    try:
        return System(name, cfg, data, sigma, clip), None
    except Exception as e:  # noqa: BLE001 - reported in the results
        return None, f"build: {type(e).__name__}: {e}"


def error_text(where: str, e: BaseException) -> str:
    return f"{where}: {type(e).__name__}: {e}"


# ---- correctness ---------------------------------------------------------------------------------


def reference_updates(cfg: dict, data: Data, clip: float) -> dict:
    """Reference SGD updates on batch 0 from per-sample gradients (B passes of one example):
    {"none": ..., "flat": ..., "layer": ...} each {name: update}, plus stats. Under --autocast
    the model is a float32 copy run under the same autocast on the CPU (module docstring)."""
    model = make_model(cfg)
    if not cfg.get("autocast"):
        model = model.double()  # float64: the reference's own rounding stays negligible
    names = [n for n, _ in model.named_parameters()]
    owner = {}  # parameter name -> module name (its layer: one clipping component in dpzero)
    for mname, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            owner[f"{mname}.{pname}" if mname else pname] = mname
    layers = sorted(set(owner.values()))
    layer_c = clip / math.sqrt(len(layers))
    ids, labels = (torch.cat(t).cpu() for t in zip(*data.step_batches(0)))
    sums = {k: {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
            for k in ("none", "flat", "layer")}
    norms, clipped_layers = [], 0
    for i in range(ids.shape[0]):
        model.zero_grad(set_to_none=True)
        with autocast(cfg, "cpu"):
            loss = F.cross_entropy(data.logits(model, ids[i:i + 1]), labels[i:i + 1])
        loss.backward()
        g = {n: p.grad.detach().to(torch.float64) for n, p in model.named_parameters()}
        norm = math.sqrt(sum(float(v.square().sum()) for v in g.values()))
        norms.append(norm)
        c_flat = min(1.0, clip / (norm + 1e-6))
        layer_sq = {m: 0.0 for m in layers}
        for n, v in g.items():
            layer_sq[owner[n]] += float(v.square().sum())
        c_layer = {m: min(1.0, layer_c / (math.sqrt(s) + 1e-6)) for m, s in layer_sq.items()}
        clipped_layers += sum(c < 1.0 for c in c_layer.values())
        for n, v in g.items():
            sums["none"][n] += v
            sums["flat"][n] += c_flat * v
            sums["layer"][n] += c_layer[owner[n]] * v
    scale = -cfg["lr"] / ids.shape[0]
    out = {k: {n: scale * s[n] for n in names} for k, s in sums.items()}
    out["stats"] = dict(norm_min=min(norms), norm_median=statistics.median(norms),
                        norm_max=max(norms), clipped=sum(n > clip for n in norms),
                        samples=len(norms), layers=len(layers),
                        layers_clipped_frac=clipped_layers / (len(layers) * len(norms)))
    return out


def relative_error(update: dict, ref: dict) -> float:
    num = sum(float((update[n].to(torch.float64) - r).square().sum()) for n, r in ref.items())
    den = sum(float(r.square().sum()) for r in ref.values())
    return math.sqrt(num / den)


def check(cfg: dict, data: Data, names, clip: float) -> dict:
    """{name: {"none": rel err, "clip": rel err or None, "loss0": float, "error": str|None}}.
    Every system and the reference use lr = CHECK_LR here: an update read off as (parameters
    after - before) in float32 is quantised to the parameters' ulps, which at the timing lr came
    to 1.2e-4 of a clipped update at width 768 for every system alike; SGD's lr only scales it."""
    cfg = dict(cfg, lr=CHECK_LR)
    ref = reference_updates(cfg, data, clip)
    initial = {n: p.detach().clone() for n, p in make_model(cfg).named_parameters()}
    result = {"_stats": ref["stats"]}
    for name in names:
        row = dict(none=None, clip=None, loss0=None, error=None)
        settings = [("none", math.inf)] + ([("clip", clip)] if name in PRIVATE else [])
        for key, c in settings:
            system, err = try_build(name, cfg, data, 0.0, c)
            if system is None:
                row["error"] = row["error"] or f"check ({key}) {err}"
                continue
            try:
                loss = system.step(data.step_batches(0))
                after = system.params()
            except Exception as e:  # noqa: BLE001
                row["error"] = row["error"] or error_text(f"check ({key}) step", e)
                traceback.print_exc()
                continue
            update = {n: after[n].cpu() - initial[n] for n in initial}
            kind = "none" if key == "none" else ("layer" if name == "dp-layer" else "flat")
            row[key] = relative_error(update, ref[kind])
            row["loss0"] = float(loss)
            del system
            gc.collect()
        result[name] = row
        print(f"check {name}: no clip {fmt_err(row['none'])}, clip {fmt_err(row['clip'])}"
              + (f"  [{row['error']}]" if row["error"] else ""), flush=True)
    return result


def fmt_err(x) -> str:
    return "—" if x is None else f"{x:.1e}"


# ---- time ----------------------------------------------------------------------------------------


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine from /proc/stat, CPU seconds of this process)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    t = os.times()
    return busy, t.user + t.system


class OtherLoad:
    """Share of the machine's CPU that other processes used since construction."""

    def __init__(self):
        self.busy, self.own = cpu_seconds()
        self.wall = time.perf_counter()

    def share(self) -> float:
        busy, own = cpu_seconds()
        wall = time.perf_counter() - self.wall
        return max(0.0, (busy - self.busy) - (own - self.own)) / (max(wall, 1e-6) * os.cpu_count())


def wait_for_quiet(budget: float) -> float:
    """Sleeps in 1 s probes until other processes use at most NOISY_OTHER_CPU of the machine or
    `budget` seconds have passed; returns the seconds waited."""
    waited = 0.0
    while waited < budget:
        probe = OtherLoad()
        time.sleep(1.0)
        if probe.share() <= NOISY_OTHER_CPU:
            break
        waited += 1.0
    return waited


def synchronize(cfg: dict) -> None:
    """Waits for the GPU's queued work (--device cuda), so that a step's time is its own."""
    if cfg.get("device", "cpu") == "cuda":
        torch.cuda.synchronize()


def time_interleaved(cfg: dict, data: Data, names, sigma: float, clip: float):
    """({name: [seconds per timed step]}, {name: error}, info) over systems that built and
    stepped. A timed round during which other processes used more than NOISY_OTHER_CPU of the
    machine is discarded and run again while the --max-wait budget lasts (discarded rounds are
    charged to it; before each round the loop also waits, out of the same budget, for the machine
    to be quiet); once it is spent, such rounds are kept and counted. At most warmup + 3 * repeats
    rounds run."""
    systems, errors = {}, {}
    for name in names:
        system, err = try_build(name, cfg, data, sigma, clip)
        if system is None:
            errors[name] = err
        else:
            systems[name] = system
    times = {n: [] for n in systems}
    info = dict(rounds=0, discarded=0, contended_kept=0, waited=0.0, other=[])
    max_rounds = cfg["warmup"] + 3 * cfg["repeats"]
    r = 0
    while r < max_rounds and (r < cfg["warmup"] or min(map(len, times.values()), default=0)
                              < cfg["repeats"]) and systems:
        budget = cfg["max_wait"] - info["waited"]
        if budget > 0:
            info["waited"] += wait_for_quiet(budget)
        batches = data.step_batches(r + 1)
        order = list(systems)
        load = OtherLoad()
        elapsed = {}
        for name in order[r % len(order):] + order[:r % len(order)]:
            synchronize(cfg)
            t0 = time.perf_counter()
            try:
                systems[name].step(batches)
                synchronize(cfg)
            except Exception as e:  # noqa: BLE001 - the system drops out, reported
                errors[name] = error_text(f"timing step (round {r})", e)
                traceback.print_exc()
                del systems[name], times[name]
                continue
            elapsed[name] = time.perf_counter() - t0
        other, round_s = load.share(), time.perf_counter() - load.wall
        if r < cfg["warmup"]:
            verdict = "warm-up"
        elif other > NOISY_OTHER_CPU and info["waited"] < cfg["max_wait"]:
            verdict, info["discarded"] = "discarded", info["discarded"] + 1
            info["waited"] += round_s
        else:
            verdict = "timed"
            if other > NOISY_OTHER_CPU:
                info["contended_kept"] += 1
            info["other"].append(other)
            for name, t in elapsed.items():
                if name in times:
                    times[name].append(t)
        print(f"round {r} ({verdict}, other processes {100 * other:.0f}% CPU): "
              + ", ".join(f"{n} {1e3 * t:.0f} ms" for n, t in elapsed.items()), flush=True)
        r += 1
    info["rounds"] = r
    return times, errors, info


# ---- memory --------------------------------------------------------------------------------------


def memory_child(cfg: dict, name: str, sigma: float, clip: float) -> dict:
    """Runs in a fresh process: {peak, held} bytes of system `name`."""
    torch.set_num_threads(cfg["threads"])
    apply_kernel_settings(cfg)
    data = Data(cfg)
    model = make_model(cfg).to(cfg.get("device", "cpu"))  # warm-up: one-off set-up, not charged
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    ids, labels = data.batch(0)
    F.cross_entropy(data.logits(model, ids), labels).backward()
    opt.step()
    del model, opt, ids, labels
    gc.collect()
    cuda = cfg.get("device", "cpu") == "cuda"
    base = torch.cuda.memory_allocated() if cuda else proc_status_bytes("VmRSS")
    system = System(name, cfg, data, sigma, clip)
    for s in range(2):
        system.step(data.step_batches(s))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak_rss("private_bench")
    for s in range(2, 2 + cfg["memory_steps"]):
        system.step(data.step_batches(s))
    if cuda:
        torch.cuda.synchronize()
        return dict(peak=torch.cuda.max_memory_allocated() - base,
                    held=torch.cuda.memory_allocated() - base)
    return dict(peak=proc_status_bytes("VmHWM") - base, held=proc_status_bytes("VmRSS") - base)


def measure_memory(cfg: dict, names, sigma: float, clip: float) -> dict:
    """{name: {peak, held} or {error}}, each system alone in a fresh process."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    out = {}
    for name in names:
        cmd = [sys.executable, os.path.abspath(__file__), "--_memory-child", name,
               "--_cfg", json.dumps(dict(cfg, sigma=sigma, clip=clip))]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode == 0 and lines:
            out[name] = json.loads(lines[-1][len("RESULT "):])
            print(f"memory {name}: peak {out[name]['peak'] / MIB:.1f} MiB, held "
                  f"{out[name]['held'] / MIB:.1f} MiB", flush=True)
        else:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            out[name] = dict(error=f"memory run (rc {proc.returncode}): {tail}")
            print(f"memory {name}: FAILED {out[name]['error']}", flush=True)
    return out


# ---- report --------------------------------------------------------------------------------------

CSV_FIELDS = ["system", "device", "private", "step_ms", "q1_ms", "q3_ms", "rss_peak", "rss_held",
              "time_vs_zero0", "time_vs_torch", "time_vs_opacus_best", "rss_vs_opacus_best",
              "paired_vs_zero0", "paired_vs_zero0_q1", "paired_vs_zero0_q3",
              "paired_vs_opacus_best", "paired_vs_opacus_best_q1", "paired_vs_opacus_best_q3",
              "check_noclip_rel", "check_clip_rel", "loss0", "error"]


def summarize(names, times, time_errors, memory, checks,
              device: str = "cpu") -> tuple[list[dict], str | None]:
    rows = []
    for n in names:
        # device: where the system ran; on "cuda" the rss_* fields hold CUDA allocator bytes
        row = dict(system=n, device=device, private=n in PRIVATE)
        if n in times:
            t = times[n]
            q1, _, q3 = statistics.quantiles(t, n=4) if len(t) > 1 else (t[0], t[0], t[0])
            row.update(step_ms=1e3 * statistics.median(t), q1_ms=1e3 * q1, q3_ms=1e3 * q3)
        mem = memory.get(n, {})
        if "peak" in mem:
            row.update(rss_peak=mem["peak"], rss_held=mem["held"])
        c = checks.get(n, {})
        row.update(check_noclip_rel=c.get("none"), check_clip_rel=c.get("clip"),
                   loss0=c.get("loss0"))
        errs = [e for e in (time_errors.get(n), mem.get("error"), c.get("error")) if e]
        row["error"] = " | ".join(errs) if errs else None
        rows.append(row)
    by = {r["system"]: r for r in rows}
    opacus_timed = [r for r in rows if r["system"] in OPACUS_MODES and "step_ms" in r]
    best = min(opacus_timed, key=lambda r: r["step_ms"])["system"] if opacus_timed else None
    for r in rows:
        if "step_ms" not in r:
            continue
        for base, key in (("zero0", "time_vs_zero0"), ("torch", "time_vs_torch"),
                          (best, "time_vs_opacus_best")):
            if base in by and "step_ms" in by[base]:
                r[key] = r["step_ms"] / by[base]["step_ms"]
        if best and "rss_peak" in r and by[best].get("rss_peak"):
            r["rss_vs_opacus_best"] = r["rss_peak"] / by[best]["rss_peak"]
        for base, key in (("zero0", "paired_vs_zero0"), (best, "paired_vs_opacus_best")):
            p = paired_ratios(times, r["system"], base) if base else None
            if p is not None:
                r[key], r[key + "_q1"], r[key + "_q3"] = p
    return rows, best


def cell(r, key, fmt):
    v = r.get(key)
    return "—" if v is None else fmt.format(v)


def table(rows: list[dict], best: str | None, device: str = "cpu") -> list[str]:
    mem = "RSS" if device == "cpu" else "CUDA alloc."
    head = ["system", "private", "step ms (median)", "IQR ms", f"peak {mem} Δ MiB",
            f"held {mem} Δ MiB", "time / zero0", "time / torch", f"time / {best or 'best Opacus'}",
            f"peak {mem} / {best or 'best Opacus'}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        iqr = (f"{r['q1_ms']:.0f}–{r['q3_ms']:.0f}" if "q1_ms" in r else "—")
        cells = [r["system"], "yes" if r["private"] else "no", cell(r, "step_ms", "{:.0f}"), iqr,
                 "—" if r.get("rss_peak") is None else f"{r['rss_peak'] / MIB:.0f}",
                 "—" if r.get("rss_held") is None else f"{r['rss_held'] / MIB:.0f}",
                 cell(r, "time_vs_zero0", "{:.2f}"), cell(r, "time_vs_torch", "{:.2f}"),
                 cell(r, "time_vs_opacus_best", "{:.2f}"), cell(r, "rss_vs_opacus_best", "{:.2f}")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def check_table(rows: list[dict], stats: dict, clip: float, rtol: float) -> list[str]:
    lines = ["| system | loss at step 0 | rel. update error, no clip | "
             f"rel. update error, clip C = {clip:g} | verdict |", "|---|---|---|---|---|"]
    for r in rows:
        errs = [x for x in (r["check_noclip_rel"], r["check_clip_rel"]) if x is not None]
        if not errs:
            verdict = "not checked (error)"
        elif all(x <= rtol for x in errs):
            verdict = "ok"
        else:
            verdict = f"**MISMATCH** (> {rtol:g})"
        lines.append(f"| {r['system']} | {cell(r, 'loss0', '{:.6f}')} | "
                     f"{fmt_err(r['check_noclip_rel'])} | {fmt_err(r['check_clip_rel'])} | "
                     f"{verdict} |")
    return lines


# The DP step's target against the non-private one: 1.2x in float32, 1.3x under 16-bit autocast.
TARGET = {None: 1.2, "bf16": 1.3, "fp16": 1.3}


def verdicts(rows: list[dict], best: str | None, device: str = "cpu",
             autocast_name: str | None = None) -> list[str]:
    by = {r["system"]: r for r in rows}
    mem = "peak RSS" if device == "cpu" else "peak CUDA memory"
    out = []
    dp = by.get("dp-flat", {})

    def per_round(r: dict, key: str) -> str:
        return (f"per round {r[key]:.2f} (IQR {r[key + '_q1']:.2f}–{r[key + '_q3']:.2f})"
                if key in r else "per round —")

    target = TARGET[autocast_name]
    if "time_vs_zero0" in dp and "paired_vs_zero0" in dp:
        ok = dp["time_vs_zero0"] <= target and dp["paired_vs_zero0"] <= target
        layer = by.get("dp-layer", {})
        out.append(f"- DP step ≤ {target}× our non-private step: dp-flat / zero0 = "
                   f"{dp['time_vs_zero0']:.2f} (medians), {per_round(dp, 'paired_vs_zero0')} — "
                   f"**{'met' if ok else 'NOT met'}**"
                   + (f" (dp-layer / zero0 = {layer['time_vs_zero0']:.2f}, "
                      f"{per_round(layer, 'paired_vs_zero0')})"
                      if "time_vs_zero0" in layer else "") + ".")
    else:
        out.append(f"- DP step ≤ {target}× non-private: not measured (dp-flat or zero0 missing).")
    if best and "paired_vs_opacus_best" in dp and "rss_vs_opacus_best" in dp:
        # Faster means in at least three rounds of four (the paired ratios' upper quartile below
        # 1); a paired interquartile range around 1 is a tie, not a win.
        fast = dp["paired_vs_opacus_best_q3"] < 1.0
        tie = not fast and dp["paired_vs_opacus_best_q1"] <= 1.0
        lean = dp["rss_vs_opacus_best"] <= 1.0
        verdict = "met" if fast and lean else ("NOT met: a tie within the per-round ratios' "
                                               "interquartile range" if tie else "NOT met")
        out.append(f"- Faster than Opacus at equal or lower memory: dp-flat / {best} (fastest "
                   f"Opacus mode here) = {dp['time_vs_opacus_best']:.2f}× time (medians), "
                   f"{per_round(dp, 'paired_vs_opacus_best')}, "
                   f"{dp['rss_vs_opacus_best']:.2f}× {mem} — **{verdict}**.")
        others = [f"{r['system']} {dp['step_ms'] / r['step_ms']:.2f}× time"
                  + (f", {dp['rss_peak'] / r['rss_peak']:.2f}× {mem}"
                     if r.get("rss_peak") and dp.get("rss_peak") else "")
                  for r in rows if r["system"] in OPACUS_MODES and "step_ms" in r]
        out.append("- dp-flat against every Opacus mode that ran: " + "; ".join(others) + ".")
    else:
        out.append("- Faster than Opacus at equal or lower memory: not measured (no Opacus mode "
                   "or dp-flat missing).")
    stream = by.get("dp-flat-stream", {})
    if "step_ms" in stream and "step_ms" in dp:
        out.append(f"- Norms on a side stream: dp-flat-stream / dp-flat = "
                   f"{stream['step_ms'] / dp['step_ms']:.2f}× time (medians)"
                   + (f"; dp-flat-stream / zero0 = {stream['time_vs_zero0']:.2f}"
                      if "time_vs_zero0" in stream else "") + ".")
    return out


def installed_stamp() -> dict:
    """Modification times of the installed dpzero's files: the package is re-synced from the
    checkout while others work, and a run that straddles a re-sync measures two engines."""
    root = os.path.dirname(dpzero.__file__)
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith((".py", ".so")):
                path = os.path.join(d, f)
                out[os.path.relpath(path, root)] = os.path.getmtime(path)
    return out


def write_markdown(path: str, args, cfg, rows, best, checks, run: dict) -> None:
    """Replaces the section between the private_bench markers in `path` (notes outside kept)."""
    stats = checks["_stats"]
    command = " ".join([".venv/bin/python experiments/private_bench.py", *sys.argv[1:]])
    failed = [f"- {r['system']}: {r['error']}" for r in rows if r["error"]]
    load, timing = run["load"], run["timing"]
    other = statistics.mean(timing["other"]) if timing["other"] else math.nan
    noisy = timing["contended_kept"] > 0 or other > NOISY_OTHER_CPU
    section = "\n".join([
        f"<!-- {args.tag}:begin -->",
        f"Run {datetime.date.today().isoformat()} on {platform.machine()}, {os.cpu_count()} cores, "
        + (f"GPU {torch.cuda.get_device_name()} (every system on it; memory columns: CUDA "
           "allocator), " if cfg["device"] == "cuda" else "")
        + f"{cfg['threads']} torch thread(s); torch {torch.__version__}, transformers "
        f"{transformers.__version__}, opacus {opacus.__version__}, Python "
        f"{platform.python_version()}; {run['version']}. Load average (1 min) {load[0]:.2f} at "
        f"the start, {load[1]:.2f} after timing, {load[2]:.2f} at the end; "
        f"{run['seconds']:.0f} s in all.",
        "",
        f"Machine load during timing: other processes used {100 * other:.0f}% of the machine's "
        "CPU on average over the timed rounds (/proc/stat busy time minus this process's). "
        f"{timing['rounds']} rounds ran; {timing['discarded']} were discarded and re-run because "
        f"other processes took more than {100 * NOISY_OTHER_CPU:.0f}% of the CPU during them, "
        f"{timing['contended_kept']} such rounds were kept after the --max-wait budget "
        f"({cfg['max_wait']:.0f} s) was spent; {timing['waited']:.0f} s went to waiting and "
        "discarded rounds."
        + (" **Other processes were busy on the machine during timed rounds: the interleaving "
           "spreads their effect over all systems, but absolute times, IQRs and even ratios "
           "(2 torch threads on 2 shared cores slow down unevenly) are less reliable than on an "
           "idle machine.**" if noisy else ""),
        *(["", f"**The installed dpzero changed during this run** "
               f"({', '.join(run['resynced'])} re-synced): its figures may mix two engines; "
               "rerun."] if run["resynced"] else []),
        "",
        f"Command: `{command}`",
        "",
        f"Model: BertForSequenceClassification from config, {cfg['layers']} layers, hidden "
        f"{cfg['hidden']}, {cfg['heads']} heads, intermediate {cfg['intermediate']}, vocab "
        f"{cfg['vocab']}, T = {cfg['seq']}, 2 labels, dropout 0, eager attention; "
        f"{run['n_params'] / 1e6:.2f} M parameters (fp32"
        + (f"; forward and loss under {cfg['autocast']} autocast, no GradScaler" if cfg["autocast"]
           else "")
        + (f"; CUDA ghost norms on the split tiles from T = {cfg['ghost_split_from']}"
           if cfg.get("ghost_split_from") is not None else "") + "). "
        + (f"Batch B = {cfg['batch']} sequences" if cfg["accumulate"] == 1 else
           f"Logical batch {cfg['accumulate']} × {cfg['batch']} = "
           f"{cfg['accumulate'] * cfg['batch']} sequences: {cfg['accumulate']} micro-batches of "
           f"B = {cfg['batch']}, gradients accumulated (each system by its own mechanism: "
           "script docstring), one optimizer step and one noise draw per logical batch")
        + "; random ids and labels, the same batches fed to every system; mean cross-entropy, "
        f"SGD lr {cfg['lr']}. Private systems: σ = {args.sigma}, C = {args.clip}, expected "
        f"batch size {cfg['accumulate'] * cfg['batch']}.",
        "",
        f"Time: median and interquartile range of {cfg['repeats']} logical steps per system, "
        "interleaved "
        f"round by round (order rotated) after {cfg['warmup']} warm-up rounds, all systems in one "
        "process. "
        + (f"Peak CUDA alloc. Δ = the CUDA allocator's peak over {cfg['memory_steps']} "
           "steady-state steps minus what it held before the system was built; held CUDA alloc. "
           "Δ = what it holds after the last step minus the same baseline; "
           if cfg["device"] == "cuda" else
           f"Peak RSS Δ = peak resident memory over {cfg['memory_steps']} steady-state steps "
           "minus the resident memory before the system was built; held RSS Δ = resident memory "
           "after the last step minus the same baseline; ")
        + "each system alone in a fresh process (details in the script's docstring). "
        f"Ratios are against zero0 (dpzero non-private), plain torch, and {best or '—'} (the "
        "fastest Opacus mode that ran): in the table, ratios of medians; under Targets also "
        "the per-round (paired) ratios, which cancel the machine's slower drifts (script "
        "docstring).",
        "",
        *table(rows, best, cfg["device"]),
        "",
        "Targets:",
        *verdicts(rows, best, cfg["device"], cfg["autocast"]),
        "",
        f"Correctness (before timing, σ = 0, SGD lr {CHECK_LR:g} so that float32 parameters "
        "do not quantise the update): one logical step from the initial weights on the "
        "first logical batch, "
        "update compared with an independent per-example reference "
        f"({cfg['accumulate'] * cfg['batch']} single-example passes through a "
        + (f"float32 copy of the model under {cfg['autocast']} autocast on the CPU"
           if cfg["autocast"] else "float64 copy of the model")
        + ", clipped and averaged by hand); error = ‖update − reference‖ / ‖reference‖, must be ≤ "
        f"{check_rtol(cfg):g}. Per-example gradient norms at the start: min "
        f"{stats['norm_min']:.3g}, median {stats['norm_median']:.3g}, max {stats['norm_max']:.3g}; "
        f"{stats['clipped']} of {stats['samples']} examples exceed C = {args.clip:g} (flat); "
        f"{100 * stats['layers_clipped_frac']:.0f}% of (example, layer) pairs exceed the layer "
        f"threshold C/√{stats['layers']} (layer).",
        "",
        *check_table(rows, stats, args.clip, check_rtol(cfg)),
        "",
        "Failures:" if failed else "Failures: none (every system built, stepped and was measured).",
        *failed,
        f"<!-- {args.tag}:end -->",
    ])
    title = ("# Private step: dpzero.make_private against non-private and Opacus\n\n"
             "Written by `experiments/private_bench.py`; its docstring says what each column "
             "measures and how.\n")
    write_marked_section(path, args.tag, title, section)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The BERT shape and micro-batch flags (experiments/gpu/profile_step.py takes them too)."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="B, sequences per micro-batch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where every system runs (the correctness reference: the CPU)")
    add_model_arguments(parser)
    parser.add_argument("--accumulate", type=int, default=1,
                        help="K, micro-batches per logical step (gradient accumulation)")
    parser.add_argument("--batches", type=int, default=4, help="distinct batches, cycled")
    parser.add_argument("--autocast", choices=sorted(AUTOCAST), default=None,
                        help="run every forward and loss under torch.autocast to this dtype")
    parser.add_argument("--ghost-split-from", type=int, default=None, metavar="T",
                        help="CUDA ghost norms take the split tiles from this sequence length "
                             "(default: the library's, none)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--sigma", type=float, default=1.0, help="noise multiplier (timing)")
    parser.add_argument("--clip", type=float, default=1.0, help="clip norm C (timing, check)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--max-wait", type=float, default=180.0,
                        help="seconds the timing may spend waiting for / re-running rounds "
                             "disturbed by other processes")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help="comma-separated subset of " + ",".join(SYSTEMS))
    parser.add_argument("--skip-check", action="store_true", help="no correctness check")
    parser.add_argument("--skip-memory", action="store_true", help="no memory runs")
    parser.add_argument("--out", default=RESULTS_MD)
    parser.add_argument("--tag", default="private_bench",
                        help="marker name of this run's section in --out (several configurations "
                             "share one file); the CSV is named after it")
    parser.add_argument("--_memory-child", dest="memory_child", help=argparse.SUPPRESS)
    parser.add_argument("--_cfg", dest="cfg_json", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.memory_child:
        cfg = json.loads(args.cfg_json)
        result = memory_child(cfg, args.memory_child, cfg["sigma"], cfg["clip"])
        print("RESULT " + json.dumps(result), flush=True)
        return

    names = args.systems.split(",")
    unknown = sorted(set(names) - set(SYSTEMS))
    if unknown:
        parser.error(f"--systems: unknown {unknown}; choose from {SYSTEMS}")
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if args.repeats < 2:
        parser.error("--repeats must be at least 2")
    if args.accumulate < 1:
        parser.error(f"--accumulate must be at least 1, got {args.accumulate}")
    if args.ghost_split_from is not None and args.ghost_split_from < 2:
        parser.error(f"--ghost-split-from must be at least 2, got {args.ghost_split_from}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", args.tag):
        parser.error(f"--tag must be letters, digits, '_' or '-', got {args.tag!r}")
    cfg = dict(vocab=args.vocab, seq=args.seq, hidden=args.hidden, heads=args.heads,
               layers=args.layers, intermediate=args.intermediate, batch=args.batch,
               accumulate=args.accumulate,
               # a whole number of logical batches (Opacus's expected batch is N / len(loader))
               batches=args.accumulate * max(2, math.ceil(args.batches / args.accumulate)),
               lr=args.lr, threads=args.threads, device=args.device, autocast=args.autocast,
               warmup=args.warmup, repeats=args.repeats, memory_steps=args.memory_steps,
               max_wait=args.max_wait, ghost_split_from=args.ghost_split_from)
    torch.set_num_threads(args.threads)
    apply_kernel_settings(cfg)
    data = Data(cfg)
    run = dict(n_params=sum(p.numel() for p in make_model(cfg).parameters()),
               version=dpzero_version(), load=[os.getloadavg()[0]])
    stamp = installed_stamp()
    t0 = time.perf_counter()
    checks = {"_stats": dict(norm_min=math.nan, norm_median=math.nan, norm_max=math.nan,
                             clipped=0, samples=0, layers=0, layers_clipped_frac=math.nan)}
    if not args.skip_check:
        checks = check(cfg, data, names, args.clip)
        print(f"check done in {time.perf_counter() - t0:.0f} s", flush=True)
    times, time_errors, run["timing"] = time_interleaved(cfg, data, names, args.sigma, args.clip)
    run["load"].append(os.getloadavg()[0])
    print(f"timing done in {time.perf_counter() - t0:.0f} s", flush=True)
    memory = {} if args.skip_memory else measure_memory(cfg, names, args.sigma, args.clip)
    run["seconds"] = time.perf_counter() - t0
    end_stamp = installed_stamp()
    run["resynced"] = sorted(k for k in set(stamp) | set(end_stamp)
                             if stamp.get(k) != end_stamp.get(k))
    if run["resynced"]:
        print(f"WARNING: the installed dpzero changed during the run: {run['resynced']}")
    run["load"].append(os.getloadavg()[0])
    rows, best = summarize(names, times, time_errors, memory, checks, cfg["device"])
    print("\n".join(table(rows, best, cfg["device"])))
    print("\n".join(verdicts(rows, best, cfg["device"], cfg["autocast"])))
    csv_path = os.path.splitext(args.out)[0] + (
        ".csv" if args.tag == "private_bench" else f"-{args.tag}.csv")
    write_csv(csv_path, rows, CSV_FIELDS)
    write_markdown(args.out, args, cfg, rows, best, checks, run)
    print(f"wrote {args.out} and {csv_path}")


if __name__ == "__main__":
    main()
