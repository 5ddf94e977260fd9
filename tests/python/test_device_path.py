"""The private step on the path a GPU takes, counted on this machine (Note [device path] in
kernels/per_sample_checks.h): ``dpzero::_set_device_path(True)`` sends CPU tensors down the
branches a GPU takes wherever the per-sample ops choose by device for speed, so the operators a
step dispatches and the host reads it makes can be counted without a GPU.

A GPU step is slow when its work is many small launches, or when the host waits on the device.
So, on a real Hugging Face BERT from its config:
* the operators one private step dispatches (forward, backward, optimizer step) do not grow with
  the batch: the same count at B = 4 and B = 24 (no loop over samples);
* they stay within the non-private step's count plus a fixed number per DP layer (the reference:
  the same model trained by plain torch);
* the backward makes no host read, and the step only those listed in docs/architecture.md
  ("Host reads of a private step").
Counted with a dispatch mode, which sees every ATen call, also those made from dpzero's C++.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

import dpzero
from dpzero.private.trainable import Observer

transformers = pytest.importorskip("transformers")

READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
         torch.ops.aten.item.default}
# Operators a private step may add per DP layer beyond the non-private step's (docs/architecture.md,
# "Launches of a private step"; experiments/device_ops.py counts them): the layer's norm kernels
# and their certification (one _certify each), its share of the group's clip, its clipped sums.
PER_LAYER = 13
# Host reads the optimizer step makes (Note [host reads of a step] in src/dp/private_step.h): one
# transfer of the check flags and the dropped count.
STEP_READS = 1


class _Count(Observer):  # kept inside the step's checks (Note [checks alone])
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.host_copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        # A copy to the CPU: a device-to-host read on the path a GPU takes. (A .cpu() of a CPU
        # tensor copies nothing and dispatches nothing: the reads the Note lists copy explicitly.)
        if func is torch.ops.aten._to_copy.default and \
                torch.device((kwargs or {}).get("device") or "meta").type == "cpu":
            self.host_copies += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def reads(self) -> int:
        return sum(self.ops[f] for f in READS) + self.host_copies


@pytest.fixture
def device_path():
    previous = torch.ops.dpzero._set_device_path(True)
    yield
    torch.ops.dpzero._set_device_path(previous)


def _bert():
    # Sizes chosen apart from the batch sizes below: a dim equal to the row count makes the probe
    # run again at every call (it cannot tell that dim from the examples').
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def _batch(b: int, t: int = 16):
    g = torch.Generator().manual_seed(b)
    return torch.randint(0, 100, (b, t), generator=g), torch.randint(0, 2, (b,), generator=g)


def _private_step(b: int):
    """The second private step's (forward, backward, optimizer step) counts (the first probes)."""
    model = _bert()
    ids, y = _batch(b)
    p = dpzero.make_private(model, dataset=torch.utils.data.TensorDataset(ids, y),
                            sample_rate=0.5, noise_multiplier=1.0, max_grad_norm=1.0, seed=0,
                            optimizer="sgd", lr=0.1)
    for _ in range(2):
        x, labels = p.privacy_engine.own_batch((ids, y), logical_batch_size=b)
        with _Count() as forward:
            loss = F.cross_entropy(p.model(input_ids=x).logits, labels)
        with _Count() as backward:
            loss.backward()
        with _Count() as step:
            p.optimizer.step()
        p.optimizer.zero_grad()
    layers = sum(1 for m in model.modules()
                 if isinstance(m, (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm)))
    return forward, backward, step, layers


def _plain_step(b: int) -> int:
    model = _bert()
    ids, y = _batch(b)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        with _Count() as count:
            F.cross_entropy(model(input_ids=ids).logits, y).backward()
            opt.step()
        opt.zero_grad()
    return count.total


def test_a_private_step_dispatches_as_many_operators_at_every_batch_size(device_path):
    small, large = _private_step(4), _private_step(24)
    for name, a, b in zip(("forward", "backward", "step"), small[:3], large[:3]):
        assert a.total == b.total, (f"the private {name} dispatches {a.total} operators at B = 4 "
                                    f"and {b.total} at B = 24: a loop over samples?",
                                    {k: (a.ops[k], b.ops[k]) for k in set(a.ops) | set(b.ops)
                                     if a.ops[k] != b.ops[k]})


def test_a_private_step_adds_at_most_a_fixed_number_of_operators_per_layer(device_path):
    forward, backward, step, layers = _private_step(8)
    private = forward.total + backward.total + step.total
    plain = _plain_step(8)
    assert plain < private <= plain + PER_LAYER * layers, (private, plain, layers)


def test_the_private_backward_reads_nothing_on_the_host(device_path):
    forward, backward, step, _ = _private_step(8)
    assert forward.reads == 0 and backward.reads == 0, (forward.reads, backward.reads)
    assert step.reads == STEP_READS, step.reads
