"""The private backward never waits on the GPU.

A DP layer's backward node, the clipping book and the end-of-backward callback run while the GPU
is still working on earlier kernels. A host read of a device value there (``.item()``, a
``bool()`` of a comparison, ``nonzero``, a copy to the host) makes the host wait for the whole
queue at every layer, which is what makes a private backward slow on a GPU. So every decision the
clipping takes from data (dropped samples, non-finite norms, clip factors) must stay on the
device until the optimizer step. Checks the backward makes on values keep their verdict on the
device for the step to read (Note [deferred checks] in private/book.py: the generic path's
separable recompute); the embedding's direct norm builds its rows without asking how many
there are (Note [embedding rows] in kernels/per_sample/embedding.h).

``torch.cuda.set_sync_debug_mode("error")`` makes each synchronising CUDA call raise. The tests
run a warm-up step (the batch-provenance probe of the first forward compares values on purpose,
Note [batch provenance] in private/provenance/examples.py), then the next micro-batch's backward in that
mode, on every DP layer kind and the generic torch.func path, for flat, layer, group and
automatic clipping, ZeRO stages 0-3, with and without bf16 autocast, through the loader with
several micro-batches per step (a sum loss, padding on a short step), and a tiny GPT-2.

They need a GPU and are skipped without one; ``experiments/gpu/check.sh`` runs them on a lent
machine. Without a GPU, :func:`test_host_reads_of_the_backward_are_cpu_only` audits the sources
the backward runs: every host read of a tensor value there is behind ``is_cpu()`` (the clip
factors read on the host, Note [host factors] in kernels/per_sample/linear.h, and the id range check
of ``flat_ids``), so the device branch of each makes none. It reads text, so it cannot see a
read hidden in a helper; the GPU tests can.
"""

from __future__ import annotations

import contextlib
import pathlib
import re

import pytest
import torch
import torch.nn.functional as F

import dpzero
from test_private import SeqNet, seq_data

def needs_gpu(test):
    """The gpu tier's mark, and a skip where there is no GPU or no CUDA build."""
    skip = pytest.mark.skipif(not (torch.cuda.is_available() and dpzero._C.with_cuda),
                              reason="needs a GPU and dpzero built with its CUDA kernels")
    return pytest.mark.gpu(skip(test))

ROOT = pathlib.Path(__file__).resolve().parents[2]
# What a private backward runs in C++: the DP layers' nodes, the book, the layer ops, the kernels'
# entry points and CUDA kernels, and the engine's hand-over (the step's noise and update too).
BACKWARD_SOURCES = ["src/dp/dp_layers.cpp", "src/dp/book.cpp", "src/dp/layer_ops.cpp",
                    "src/dp/layer_ops.h", "src/dp/clip_group.cpp", "src/dp/clip_group.h",
                    "kernels/per_sample/common.h", "kernels/per_sample/conv.h",
                    "kernels/per_sample/embedding.h", "kernels/per_sample/linear.h",
                    "kernels/per_sample/norm.h", "kernels/per_sample_checks.h",
                    "kernels/cuda/ghost_norm.cu", "kernels/cuda/row_sums.cu",
                    "kernels/ghost_gemm.cpp",
                    "kernels/cuda/clip_factors.cu", "kernels/cuda/noise.cu",
                    "kernels/cuda/secure_noise.cu", "kernels/cuda/noise_runs.cuh",
                    "src/zero/state.cpp", "src/zero/unit.cpp", "src/dp/step_noise.cpp"]
# A value read on the host, or an output whose size depends on values (the host must wait for
# it): item, cpu, tolist, nonzero, unique, masked_select, equal, a copy to kCPU, a synchronize.
HOST_READ = re.compile(r"\.item\s*[<(]|\.cpu\(\)|\.tolist\(|\bnonzero\(|\.is_nonzero\(|"
                       r"\bequal\(|\b_?unique\w*\(|\bmasked_select\(|Synchronize\(|"
                       r"\.to\(\s*(?:at::|torch::)?kCPU")
# The read happens only on the host: `x.is_cpu() && <read>`, or `!x.is_cpu() || <read>`, or the
# same with host_path(x) (Note [device path] in kernels/per_sample_checks.h).
CPU_GUARD = re.compile(r"!\s*(?:[\w.]+\.is_cpu\(\)|host_path\([\w.]+\))\s*\|\||"
                       r"(?<![!\w.])(?:[\w.]+\.is_cpu\(\)|host_path\([\w.]+\))\s*&&")
# Reads the step may make (after the backward, before the update; Note [host reads of a step] in
# src/dp/private_step.h): the check flags with the dropped-sample count, or the count alone.
STEP_READS = {("src/dp/book.cpp", "at::cat(parts).to(at::kCPU"),
              ("src/dp/book.cpp", "stats.dropped += dropped_.item<int64_t>()")}


@contextlib.contextmanager
def sync_is_an_error():
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def run_backward_without_sync(model, loss_of, batch, **kwargs):
    """make_private on CUDA; step 0 in full (the warm-up), then step 1's backward with every
    synchronising CUDA call an error; then step 1's optimizer step (allowed to synchronise)."""
    p = dpzero.make_private(model.cuda(), dataset=torch.utils.data.TensorDataset(*batch),
                            batch_size=len(batch[0]), noise_multiplier=1.0, max_grad_norm=0.5,
                            lr=0.1, seed=3, **kwargs)
    engine = p.privacy_engine
    for step in range(2):
        x, y = engine.own_batch(tuple(t.cuda() for t in batch),
                                logical_batch_size=len(batch[0]))
        loss = loss_of(p.model(x), y)
        with sync_is_an_error() if step == 1 else contextlib.nullcontext():
            loss.backward()
        p.optimizer.step()
        p.optimizer.zero_grad()
    torch.cuda.synchronize()
    return p


def test_host_reads_of_the_backward_are_cpu_only():
    """Each host read in the backward's sources is behind a CPU guard in its statement (its line
    or the two before: ``x.is_cpu() &&`` or ``!x.is_cpu() ||``), or is one of the step's reads.
    Comments are not code. A text audit: a read inside a helper of another file it does not
    list is the GPU tests' to find."""
    found, unguarded = 0, []
    for rel in BACKWARD_SOURCES:
        lines = [line.split("//")[0] for line in (ROOT / rel).read_text().splitlines()]
        for n, code in enumerate(lines):
            if not HOST_READ.search(code):
                continue
            found += 1
            if any(r == rel and read in code for r, read in STEP_READS):
                continue
            if not CPU_GUARD.search(" ".join(lines[max(0, n - 2):n + 1])):
                unguarded.append(f"{rel}:{n + 1}: {code.strip()}")
    assert found > 0, "the audit found no host read at all: has the code moved?"
    assert not unguarded, "host reads in the private backward's device branch:\n" + \
        "\n".join(unguarded)


@needs_gpu
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("clipping", ["flat", "layer", "group", "automatic"])
def test_every_layer_kind_backward_without_sync(clipping, stage):
    torch.manual_seed(0)
    ids, y = seq_data(n=8).tensors
    groups = [["emb", "pos", "out"], ["conv", "ln"], ["proj", "rms", "head"]]
    extra = {"clipping_groups": groups} if clipping == "group" else {}
    run_backward_without_sync(SeqNet(tied=True, depth=True), F.cross_entropy, (ids, y),
                              clipping=clipping, zero_stage=stage, **extra)


@needs_gpu
def test_autocast_backward_without_sync():
    torch.manual_seed(0)
    ids, y = seq_data(n=8).tensors
    run_backward_without_sync(SeqNet(), F.cross_entropy, (ids, y), mixed_precision="bf16")


@needs_gpu
def test_loader_micro_batches_backward_without_sync():
    """The loader's Poisson batches in micro-batches of 3 rows (the last may be a padding batch
    on a short step), a sum loss: every micro-batch's backward in sync-error mode after the
    first step."""
    torch.manual_seed(0)
    p = dpzero.make_private(SeqNet().cuda(), dataset=seq_data(n=40), sample_rate=0.2,
                            noise_multiplier=1.0, max_grad_norm=0.5, lr=0.1, seed=3,
                            max_physical_batch_size=3, loss_reduction="sum")
    engine = p.privacy_engine
    for ids, y in p.data_loader:  # one epoch: 5 logical batches, each in micro-batches
        loss = F.cross_entropy(p.model(ids.cuda()), y.cuda(), reduction="sum")
        with sync_is_an_error() if engine.steps_taken > 0 else contextlib.nullcontext():
            loss.backward()
        p.optimizer.step()  # only accumulates before a logical batch's last micro-batch
        p.optimizer.zero_grad()
    torch.cuda.synchronize()
    assert engine.steps_taken == 5


@needs_gpu
def test_gpt2_backward_without_sync():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = transformers.GPT2LMHeadModel(cfg)

        def forward(self, x):
            return self.m(x).logits

    ids = torch.randint(0, 64, (4, 16))

    def lm_loss(logits, targets):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())

    run_backward_without_sync(Logits(), lm_loss, (ids, ids))
