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

import os
import sys

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "experiments"))
import device_ops  # noqa: E402  (the model, the step and the counting, written once)
import torch  # noqa: E402

# Operators a private step may add per DP layer beyond the non-private step's (docs/architecture.md,
# "Launches of a private step"; experiments/device_ops.py writes the counts): the layer's norm
# kernels and their certification (one _certify each), its share of the group's clip, its clipped
# sums (the kept rows of a whole group in one op). The step adds about 3.5.
PER_LAYER = 4
# Host reads the optimizer step makes (Note [host reads of a step] in src/dp/private_step.h): one
# transfer of the check flags and the dropped count.
STEP_READS = 1


@pytest.fixture
def device_path():
    previous = torch.ops.dpzero._set_device_path(True)
    yield
    torch.ops.dpzero._set_device_path(previous)


def test_a_private_step_dispatches_as_many_operators_at_every_batch_size(device_path):
    (small, _), (large, _) = device_ops.private_step(4), device_ops.private_step(24)
    for name, a, b in zip(("forward", "backward", "step"), small, large):
        assert a.total == b.total, (f"the private {name} dispatches {a.total} operators at B = 4 "
                                    f"and {b.total} at B = 24: a loop over samples?",
                                    {k: (a.ops[k], b.ops[k]) for k in set(a.ops) | set(b.ops)
                                     if a.ops[k] != b.ops[k]})


def test_a_private_step_adds_at_most_a_fixed_number_of_operators_per_layer(device_path):
    (forward, backward, step), layers = device_ops.private_step(8)
    private = forward.total + backward.total + step.total
    plain = device_ops.plain_step(8).total
    assert plain < private <= plain + PER_LAYER * layers, (private, plain, layers)


def test_the_private_backward_reads_nothing_on_the_host(device_path):
    (forward, backward, step), _ = device_ops.private_step(8)
    assert forward.reads == 0 and backward.reads == 0, (forward.reads, backward.reads)
    assert step.reads == STEP_READS, step.reads
