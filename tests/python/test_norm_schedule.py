"""When the private backward computes each layer's norms (Note [norms when their input is done] and
Note [kept inputs stay unwritten] in src/dp/book.cpp, Note [norms on a side stream] in
src/dp/norm_schedule.h).

With flat clipping every Linear call keeps its A and G until the group's factors are known, and
the calls that read one input share one norm op (Note [shared inputs]). By default that op runs
when the group completes, right before the clipped sums read the same A and G. With early norms
asked for it runs as soon as the last call on its input has reported, while autograd goes on to
the earlier layers, and on a GPU it may run on a second stream. Neither changes a value: the CPU
test checks the order of the operators, the GPU tests check that the side stream gives the
one-stream run's bits and makes the host wait nowhere. A write into a kept tensor in place is
refused; one that bypasses the version counter (through .data) cannot move the bound by default,
and is the premise early norms add.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import dpzero
from dpzero.private.trainable import Observer
from test_sync_free import needs_gpu

transformers = pytest.importorskip("transformers")

NORMS = "dpzero._ghost_sq_norms_multi"


@contextlib.contextmanager
def schedule(early: bool, stream: bool = False):
    """The process settings of src/dp/norm_schedule.h, restored after."""
    before = dpzero._C.dp._set_early_norms(early), dpzero._C.dp._set_norm_stream(stream)
    try:
        yield
    finally:
        dpzero._C.dp._set_early_norms(before[0])
        dpzero._C.dp._set_norm_stream(before[1])
GEMMS = {"aten.mm", "aten.bmm", "aten.addmm", "aten.matmul"}


class _Order(Observer):  # kept inside the step's checks (Note [checks alone])
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


def _private(model, batch, device="cpu", **kwargs):
    ids, y = batch
    return dpzero.make_private(model.to(device), dataset=torch.utils.data.TensorDataset(ids, y),
                               batch_size=len(ids), noise_multiplier=1.0, max_grad_norm=0.5,
                               clipping="flat", lr=0.1, seed=3, **kwargs)


@pytest.mark.parametrize("early", [False, True])
def test_an_inputs_norms_run_when_the_schedule_says(early):
    """A 2-layer BERT under flat clipping: one norm op per input (the query, key and value
    projections share one). By default every one runs when the group completes, after the
    backward's GEMMs, with none of them between the first and the last norm op; with early norms,
    each runs before the backward GEMMs of the layers under it."""
    model = _bert()
    batch = _batch()
    with schedule(early):
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
    if early:
        assert len(between) >= 2 * 4, (
            f"the norm ops ran together, not as each input finished: {between}")
    else:
        assert between == [], "a norm op ran before its group completed"


_stash: dict = {}


class _Writes(torch.autograd.Function):
    """Identity whose backward, which runs after the second layer's, writes what _stash holds in
    place (``how``: "tracked", an ATen op; "untracked", through .data, which moves no version
    counter): a buggy custom Function."""

    how = "tracked"

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        for t in _stash.pop("written", []):
            if _Writes.how == "tracked":
                t.mul_(1000.0)
            else:
                t.data.mul_(1000.0)
        return g


class _Keeps(torch.autograd.Function):
    """Identity that stashes its output (the second layer's input, ``where="A"``) or, in its
    backward, its output gradient (the second layer's, ``where="G"``)."""

    where = "A"

    @staticmethod
    def forward(ctx, x):
        y = x * 1.0
        if _Keeps.where == "A":
            _stash.setdefault("written", []).append(y)
        return y

    @staticmethod
    def backward(ctx, g):
        if _Keeps.where == "G":
            _stash.setdefault("written", []).append(g)
        return g


class _TwoLayers(torch.nn.Module):
    """first -> _Writes -> second -> head; the second's input (A) or output gradient (G) is what
    _Writes writes into."""

    def __init__(self, kind: str, where: str):
        super().__init__()
        if kind == "linear":  # the second's norm: from A and G pending (Note [shared inputs])
            self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        else:  # a Conv1d keeps (A, G) for its norm and its clipped sum
            self.first = torch.nn.Conv1d(4, 4, 3, padding=1)
            self.second = torch.nn.Conv1d(4, 4, 3, padding=1)
        if kind == "conv_bias":  # its bias alone trained (BitFit): per-sample rows are kept
            self.second.weight.requires_grad_(False)
        self.head = torch.nn.Linear(4, 3)
        self.kind, self.where = kind, where

    def forward(self, x):
        h = _Writes.apply(self.first(x))
        if self.where == "A":
            out = self.second(_Keeps.apply(h))
        else:
            out = _Keeps.apply(self.second(h))
        return self.head(out if self.kind == "linear" else out.mean(-1))


def _clipped_sum(kind, where, x, y, how):
    """One σ = 0 step of SGD at lr 1 under a sum loss, flat clipping at C = 1: the released sum of
    clipped gradients (the update, times the expected batch by which the step divides)."""
    _Writes.how, _Keeps.where = how, where
    _stash.clear()
    torch.manual_seed(0)
    model = _TwoLayers(kind, where)
    before = [t.detach().clone() for t in model.parameters()]
    p = dpzero.make_private(model, dataset=torch.utils.data.TensorDataset(x, y),
                            batch_size=len(x), noise_multiplier=0.0, allow_no_noise=True,
                            max_grad_norm=1.0, clipping="flat", lr=1.0, optimizer="sgd",
                            loss_reduction="sum", seed=3)
    xb, yb = p.privacy_engine.own_batch((x.clone(), y), logical_batch_size=len(x))
    F.cross_entropy(p.model(xb), yb, reduction="sum").backward()
    p.optimizer.step()
    return len(x) * torch.cat([(b - a.detach()).flatten().double()
                               for b, a in zip(before, model.parameters())])


def _data(kind):
    torch.manual_seed(1)
    x = 5 * (torch.randn(2, 4) if kind == "linear" else torch.randn(2, 4, 5))
    return x, torch.tensor([0, 1])


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("where", ["A", "G"])
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_a_kept_tensor_written_in_place_after_its_layer_reported_is_refused(kind, where, early):
    """Note [kept inputs stay unwritten]: the second layer reports its input and its output
    gradient, then an earlier Function's backward multiplies one of them by 1000 in place. The
    step is refused, naming the layer, on either schedule, and nothing is applied."""
    x, y = _data(kind)
    what = "input" if where == "A" else "output gradient"
    with schedule(early), pytest.raises(dpzero.PrivacyViolation,
                                        match=f"{what} of DP layer 'second' was written"):
        _clipped_sum(kind, where, x, y, "tracked")


@pytest.mark.parametrize("where", ["A", "G"])
@pytest.mark.parametrize("kind", ["linear", "conv", "conv_bias"])
def test_a_write_the_version_counter_misses_cannot_move_the_bound(kind, where):
    """Note [kept inputs stay unwritten]: the same write through .data, which no check sees. By
    default every norm read from A and G is computed when the group completes, from the values
    the clipped sum then reads, and a bias trained alone keeps its per-sample rows: dropping one
    example moves the released sum by at most C. (With the norm computed at the report and the
    sum at completion, as early norms do for a Linear, the write moves it by hundreds of C:
    docs/reliability.md.)"""
    x, y = _data(kind.split("_")[0])
    both = _clipped_sum(kind, where, x, y, "untracked")
    one = _clipped_sum(kind, where, x[1:], y[1:], "untracked")
    # The example is large: clipped, it moves the sum by C itself, and by no more.
    assert 0.999 <= (both - one).norm() <= 1.0 + 1e-5


class _BitFitConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Conv1d(4, 4, 3, padding=1)
        self.second = torch.nn.Conv1d(4, 4, 3, padding=1)
        self.second.weight.requires_grad_(False)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.second(torch.tanh(self.first(x))).mean(-1))


@pytest.mark.parametrize("clipping", ["flat", "layer"])
def test_a_conv_training_its_bias_alone_keeps_its_rows_and_equals_the_reference(clipping):
    """A Conv whose weight is frozen keeps its bias's per-sample rows, not its input, and its
    step is the float64 per-example reference's (flat: a group of three layers; layer: its own
    fused clip)."""
    from private_reference import first_private_step, naive_dp_sgd_step

    torch.manual_seed(3)
    model = _BitFitConv()
    reference = copy.deepcopy(model)
    data = torch.utils.data.TensorDataset(5 * torch.randn(24, 4, 6), torch.randint(0, 3, (24,)))
    loss = lambda out, t: F.cross_entropy(out, t)  # noqa: E731
    p, x, y = first_private_step(model, data, loss, sample_rate=0.5, noise_multiplier=0.7,
                                 max_grad_norm=0.5, clipping=clipping, seed=7, lr=0.3,
                                 max_physical_batch_size=4)
    want = naive_dp_sgd_step(reference, loss, x, y, max_grad_norm=0.5, noise_multiplier=0.7,
                             seed=7, noise_index=0, lr=0.3, expected_batch=0.5 * len(data),
                             clipping=clipping)
    got = p.privacy_engine.parameters()
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=2e-5, rtol=1e-4)


def _trained(early: bool, stream: bool, stage: int):
    """Two private steps of the BERT on CUDA at ZeRO stage `stage`, σ = 1 from seed 3, on the
    given schedule; step 1's backward with every synchronising CUDA call an error. -> the
    trained parameters."""
    with schedule(early, stream):
        model = _bert()
        batch = tuple(t.cuda() for t in _batch(n=24, t=12))
        p = _private(model, batch, device="cuda", zero_stage=stage)
        engine = p.privacy_engine
        for step in range(2):
            ids, y = engine.own_batch(batch, logical_batch_size=len(batch[0]))
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
        return [t.detach().cpu() for t in p.privacy_engine.parameters().values()]


@needs_gpu
@pytest.mark.parametrize("stage", [0, 3])
def test_gpu_norms_on_a_side_stream_give_the_one_stream_bits(stage):
    """Note [norms on a side stream]: the same kernels on the same inputs, so the trained model is
    bitwise the default schedule's, with early norms and with them on a side stream; a missing
    wait (the factors read before the norms are written) or a block handed back to the allocator
    too early would change it."""
    reference = _trained(False, False, stage)
    for early, stream in ((True, False), (True, True)):
        trained = _trained(early, stream, stage)
        assert len(trained) == len(reference)
        for a, b in zip(reference, trained):
            assert torch.equal(a, b), (early, stream)
