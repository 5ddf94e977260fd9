"""When the private backward computes each layer's norms (Note [norms when their input is done] in
src/dp/book.cpp, Note [norms on a side stream] in src/dp/side_stream.h).

With flat clipping every Linear call keeps its A and G until the group's factors are known, and
the calls that read one input share one norm op (Note [shared inputs]). That op now runs as soon
as the last call on its input has reported, while autograd goes on to the earlier layers, not
at the end of the backward. On a GPU it may run on a second stream. Neither changes a value: the
CPU test checks the order of the operators, the GPU tests check that the side stream gives the
one-stream run's bits and makes the host wait nowhere.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import dpzero

transformers = pytest.importorskip("transformers")

NORMS = "dpzero._ghost_sq_norms_multi"
GEMMS = {"aten.mm", "aten.bmm", "aten.addmm", "aten.matmul"}


class _Order(TorchDispatchMode):
    """The packet name of every operator dispatched, in order."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _bert(seed: int = 0):
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=3,
                                  attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(cfg)


def _batch(n: int = 6, t: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(1, 64, (n, t), generator=g), torch.randint(0, 3, (n,), generator=g))


def _private(model, batch, device="cpu"):
    ids, y = batch
    return dpzero.make_private(model.to(device), dataset=torch.utils.data.TensorDataset(ids, y),
                               batch_size=len(ids), noise_multiplier=1.0, max_grad_norm=0.5,
                               clipping="flat", lr=0.1, seed=3)


def test_an_inputs_norms_run_before_the_earlier_layers_backward():
    """A 2-layer BERT under flat clipping: one norm op per finished input (the query, key and
    value projections share one), each before the backward GEMMs of the layers under it. With
    every norm deferred to the end of the backward, no backward GEMM would lie between the first
    and the last norm op."""
    model = _bert()
    batch = _batch()
    p = _private(model, batch)
    engine = p.privacy_engine
    for step in range(2):  # step 0 runs the first call's probe; step 1 is counted
        ids, y = engine.own_batch(batch, logical_batch_size=len(batch[0]))
        loss = F.cross_entropy(p.model(ids).logits, y)
        order = _Order()
        with order if step == 1 else contextlib.nullcontext():
            loss.backward()
        p.optimizer.step()
        p.optimizer.zero_grad()
    names = order.names
    norms = [i for i, name in enumerate(names) if name == NORMS]
    # Per BERT layer: query/key/value (one input), attention output, intermediate, output; then
    # the pooler and the classifier.
    assert len(norms) == 2 * 4 + 2, names
    between = [name for name in names[norms[0]:norms[-1]] if name in GEMMS]
    assert len(between) >= 2 * 4, (
        "the norm ops ran together after the backward's GEMMs, not as each input finished: "
        f"{between}")


class _WritesItsOutputInBackward(torch.autograd.Function):
    """y = x * 1, whose backward then writes y in place: a buggy custom Function."""

    @staticmethod
    def forward(ctx, x):
        y = x * 1.0
        ctx.y = y
        return y

    @staticmethod
    def backward(ctx, g):
        ctx.y.mul_(100.0)
        return g


class _TwoLayers(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        if kind == "linear":  # the second's norm: when its input is done
            self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)
        else:  # a Conv1d keeps (A, G) and computes its norm in its own backward
            self.first = torch.nn.Conv1d(4, 4, 3, padding=1)
            self.second = torch.nn.Conv1d(4, 3, 3, padding=1)
        self.kind = kind

    def forward(self, x):
        out = self.second(_WritesItsOutputInBackward.apply(self.first(x)))
        return out if self.kind == "linear" else out.mean(-1)


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_an_input_written_after_its_layer_reported_is_refused(kind):
    """Note [kept inputs stay unwritten]: the second layer reports its input and its norm is
    computed at once; then the earlier Function's backward multiplies that input by 100 in place.
    Summed from it, the clipped gradient would be 100x what its norm allowed. The step is
    refused, naming the layer, and nothing is applied."""
    torch.manual_seed(0)
    x = torch.randn(8, 4) if kind == "linear" else torch.randn(8, 4, 5)
    y = torch.randint(0, 3, (8,))
    model = _TwoLayers(kind)
    p = dpzero.make_private(model, dataset=torch.utils.data.TensorDataset(x, y), batch_size=8,
                            noise_multiplier=0.0, allow_no_noise=True, max_grad_norm=1.0,
                            clipping="flat", lr=1.0, seed=3)
    before = [t.detach().clone() for t in model.parameters()]
    xb, yb = p.privacy_engine.own_batch((x, y), logical_batch_size=8)
    loss = F.cross_entropy(p.model(xb), yb)
    with pytest.raises(dpzero.PrivacyViolation, match="input of DP layer 'second' was written"):
        loss.backward()
        p.optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def needs_gpu(test):
    skip = pytest.mark.skipif(not (torch.cuda.is_available() and dpzero._C.with_cuda),
                              reason="needs a GPU and dpzero built with its CUDA kernels")
    return pytest.mark.gpu(skip(test))


def _trained(side_stream: bool, autocast: bool = False):
    """Two private steps of the BERT on CUDA, σ = 1 from seed 3, with the side stream on or off;
    step 1's backward with every synchronising CUDA call an error. -> the trained parameters."""
    previous = dpzero._C.dp._set_norm_stream(side_stream)
    try:
        model = _bert()
        batch = tuple(t.cuda() for t in _batch(n=24, t=12))
        p = _private(model, batch, device="cuda")
        engine = p.privacy_engine
        for step in range(2):
            ids, y = engine.own_batch(batch, logical_batch_size=len(batch[0]))
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = F.cross_entropy(p.model(ids).logits, y)
            previous_mode = torch.cuda.get_sync_debug_mode()
            if step == 1:
                torch.cuda.set_sync_debug_mode("error")
            try:
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode(previous_mode)
            p.optimizer.step()
            p.optimizer.zero_grad()
        torch.cuda.synchronize()
        return [t.detach().cpu() for t in model.parameters()]
    finally:
        dpzero._C.dp._set_norm_stream(previous)


@needs_gpu
@pytest.mark.parametrize("autocast", [False, True])
def test_gpu_norms_on_a_side_stream_give_the_one_stream_bits(autocast):
    """Note [norms on a side stream]: the same kernels on the same inputs, so the trained model is
    bitwise the one-stream run's; a missing wait (the factors read before the norms are written)
    or a block handed back to the allocator too early would change it."""
    one = _trained(False, autocast)
    two = _trained(True, autocast)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
