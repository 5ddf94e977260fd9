"""The clipped sums' float32 rounding stays inside each example's clip (Note [clipped-sum rounding]
in kernels/per_sample/common.h).

An example whose rows are huge and cancel among themselves (inputs M v times w_t at its four
positions, weighted +1, -1, +1, -1 by the model, with w_1 - w_2 + w_3 - w_4 = 0 exactly) has an
exact weight gradient of 0, so its clip lets it through whole. Two float32 roundings can then
carry it past C: one float32 sum over the rows of many examples lets its terms absorb the other
examples' partial sums (w = 1, 1, 1, 1: adding such an example to a dataset moved the clipped
sum by 14 C), and its own products round by about 2^-24 M (w = 1, 1.5, 3, 2.5, all exact), which
its norm, 0, does not cover. The
reference is the definition of add-one sensitivity: with D' = D plus that example, no noise, a
summed loss and SGD with lr = N, the two steps' parameter movements (the sums of clipped
per-example gradients) differ by at most C, whatever the example. Checked for a Linear on the
direct and the ghost norm path, an Embedding (the example's tokens all one id) and a Conv1d, with
flat and automatic clipping, on the host path, on the path a GPU takes (CPU tensors sent down it)
and on a GPU itself where there is one, with the forward in
float32, under bf16 autocast (the Linear's and the Conv1d's A and G then reach the kernels in
bf16), and with bf16 or float16 parameters (mixed_precision=: every layer's A and G in 16 bits).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpzero

T, K, B = 4, 3, 32
SIGN = torch.tensor([1.0, -1.0, 1.0, -1.0])
SPREADS = {"equal": torch.tensor([1.0, 1.0, 1.0, 1.0]),   # the rows themselves cancel
           "spread": torch.tensor([1.0, 1.5, 3.0, 2.5])}  # 1 - 1.5 + 3 - 2.5 = 0


def _cancelled(h, sign, dim):
    """sum over positions of sign * h in the backward, with h's own value taken out of the
    forward (exactly 0 there), so that a huge example's logits stay finite and its loss keeps a
    gradient; its layer sees the output gradient sign_t * (the head's)."""
    return ((h - h.detach()) * sign.to(h.device)).sum(dim)


class _Linear(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin, self.head = nn.Linear(d, d), nn.Linear(d, K)

    def forward(self, x):  # x [B, T, d]
        return self.head(_cancelled(self.lin(x), SIGN[:, None], 1))


class _Embedding(nn.Module):
    def __init__(self, d, spread):
        super().__init__()
        self.emb, self.head = nn.Embedding(50, d), nn.Linear(d, K)
        self.register_buffer("spread", spread)

    def forward(self, ids, w):  # ids [B, T], w [B]: the example's own weight of its tokens
        sign = SIGN.to(w.device)
        weight = torch.where(w[:, None] == 1, sign, w[:, None] * sign * self.spread)
        return self.head(_cancelled(self.emb(ids), weight[..., None], 1))


class _Conv(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.conv, self.head = nn.Conv1d(d, d, kernel_size=1), nn.Linear(d, K)

    def forward(self, x):  # x [B, d, T]
        return self.head(_cancelled(self.conv(x), SIGN, 2))


# precision -> (make_private's mixed_precision, bf16 autocast around the forward, the output's
# dtype): float32; bf16 autocast (float32 parameters); 16-bit parameters and compute with float32
# masters (mixed_precision=), where the whole forward and backward run in 16 bits.
PRECISIONS = {"fp32": (None, False, torch.float32), "bf16": (None, True, torch.bfloat16),
              "bf16-params": ("bf16", False, torch.bfloat16),
              "fp16-params": ("fp16", False, torch.float16)}


PATHS = ["host", "device-path", "cuda"]


def _clipped_sum(make, inputs, y, clipping, path, precision="fp32"):
    """One step's sum of clipped per-example gradients (no noise, sum loss, lr = N) at one of
    PRECISIONS (under bf16 autocast or 16-bit parameters the layers' A and G reach the kernels in
    16 bits), on one of PATHS."""
    mixed, autocast, out_dtype = PRECISIONS[precision]
    device = "cuda" if path == "cuda" else "cpu"
    torch.manual_seed(0)
    model = make().to(device)
    inputs, y = tuple(x.to(device) for x in inputs), y.to(device)
    before = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    previous = torch.ops.dpzero._set_device_path(path == "device-path")
    try:
        p = dpzero.make_private(model, dataset=torch.utils.data.TensorDataset(*inputs, y),
                                sample_rate=1.0, noise_multiplier=0.0, allow_no_noise=True,
                                max_grad_norm=1.0, optimizer="sgd", lr=float(len(y)),
                                loss_reduction="sum", clipping=clipping, seed=0,
                                mixed_precision=mixed)
        *xs, yb = p.privacy_engine.own_batch((*inputs, y), logical_batch_size=len(y))
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = p.model(*xs)
        assert out.dtype == out_dtype
        # one label per example, or per position ([B, T] labels, [B, T, K] logits)
        F.cross_entropy(out.float().reshape(-1, K), yb.reshape(-1), reduction="sum").backward()
        assert p.optimizer.step()
    finally:
        torch.ops.dpzero._set_device_path(previous)
    after = {k: v.cpu() for k, v in p.privacy_engine.parameters().items()}
    return torch.cat([(before[k] - after[k]).flatten().double() for k in sorted(after)])


def _cases():
    g = torch.Generator().manual_seed(1)
    m = 2.0 ** 33
    for name, spread in SPREADS.items():
        # M v w_t exactly: v's entries are small integers, w_t has two significant bits
        for d, path in ((4, "direct"), (16, "ghost")):  # ghost iff 2 T^2 <= d_in d_out
            x = torch.randn(B, T, d, generator=g)
            v = torch.randint(1, 8, (1, 1, d), generator=g).float()
            yield f"linear-{path}-{name}", (lambda d=d: _Linear(d)), (x,), \
                (m * v * spread[None, :, None],)
        ids = torch.randint(0, 50, (B, T), generator=g)
        yield f"embedding-{name}", (lambda spread=spread: _Embedding(8, spread)), \
            (ids, torch.ones(B)), (torch.full((1, T), 7), torch.full((1,), m))
        x = torch.randn(B, 16, T, generator=g)
        v = torch.randint(1, 8, (1, 16, 1), generator=g).float()
        yield f"conv1d-{name}", (lambda: _Conv(16)), (x,), (m * v * spread,)


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("clipping", ["flat", "automatic"])
@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_one_example_of_cancelling_rows_moves_the_sum_by_at_most_c(case, clipping, path,
                                                                   precision):
    """Under bf16 autocast the Linear and Conv1d layers' A and G reach the kernels in bf16, and
    with 16-bit parameters every layer's do (the huge example's values are exact in bf16, and in
    float16 once scaled by 2^-24 into its range: M = 2^9), which the certification and the
    clipped sums must bound just the same."""
    _, make, inputs, extra = case
    if path == "cuda" and not (torch.cuda.is_available() and dpzero._C.with_cuda):
        pytest.skip("needs a GPU and dpzero built with its CUDA kernels")
    if precision == "fp16-params":
        extra = tuple(e * 2.0 ** -24 if e.is_floating_point() else e for e in extra)
    y = torch.randint(0, K, (B,), generator=torch.Generator().manual_seed(3))
    base = _clipped_sum(make, inputs, y, clipping, path, precision)
    added = _clipped_sum(make, tuple(torch.cat([a, b]) for a, b in zip(inputs, extra)),
                         torch.cat([y, torch.tensor([0])]), clipping, path, precision)
    moved = (added - base).norm().item()
    assert moved <= 1.0 * (1 + 1e-5), f"adding one example moved the clipped sum by {moved} C"
    assert base.norm().item() > 1.0  # the others' contributions are there to be absorbed


def _zero_token_classifier(d):
    """A zero-initialised nn.Linear(d, K) applied at every position: its one DP layer is its own
    clipping group (the fused norm-and-factor path)."""
    model = nn.Linear(d, K)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    return model


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("clipping", ["flat", "layer", "automatic"])
def test_an_example_whose_unscaled_product_overflows_moves_the_sum_by_at_most_c(clipping, path):
    """Inputs of 3e38 at every position: the example's per-sample product G^T A, formed before its
    factor, would pass float32's range (and Inf times the factor stays Inf), though its certified
    norm is finite and the example is kept with a factor near 1e-38. Its contribution must still be
    at most C (an op that scaled the finished product instead of the rows would turn the whole
    update to Inf here)."""
    if path == "cuda" and not (torch.cuda.is_available() and dpzero._C.with_cuda):
        pytest.skip("needs a GPU and dpzero built with its CUDA kernels")
    g = torch.Generator().manual_seed(1)
    n, t, d = 8, 8, 64
    x = torch.randn(n, t, d, generator=g)
    y = torch.randint(0, K, (n, t), generator=g)
    huge = torch.zeros(1, t, d)
    huge[0, :, 0] = 3e38
    labels = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    make = lambda: _zero_token_classifier(d)  # noqa: E731
    base = _clipped_sum(make, (x,), y, clipping, path)
    added = _clipped_sum(make, (torch.cat([x, huge]),), torch.cat([y, labels]), clipping, path)
    moved = (added - base).norm().item()
    assert moved <= 1.0 * (1 + 1e-5), f"adding one example moved the clipped sum by {moved} C"
    assert base.norm().item() > 0.5  # the others' contributions are there


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_kept_rows_rounded_to_float32_stay_within_c(rms):
    """A bias's and a norm weight's per-sample gradients are row sums kept in float64, scaled by
    the clip factor and rounded to float32 once per entry, which can grow a contribution by 2^-24
    relative: at norms of 1e2..1e6, c N sits within one float32 ulp of C, and a privacy review
    measured 1 + 2.5e-8 C from LayerNorm(2). The certified norms carry that rounding (Note
    [clipped-sum rounding]). One example at a time (B = 1, so the float32 sum is its contribution
    alone) through the fused op, its weight's and bias's contributions together, against C in
    float64."""
    g = torch.Generator().manual_seed(7)
    worst = 0.0
    for _ in range(2000):
        x = torch.randn(1, 1, 2, generator=g)
        out = torch.randn(1, 1, 2, generator=g) * 10 ** (2 + 4 * torch.rand((), generator=g))
        gw, gb, _, _, _ = torch.ops.dpzero.layer_norm_clip(x, out, 1e-5, 1.0, "flat", 0.01, rms,
                                                          True, 1)
        worst = max(worst, torch.cat([gw.double().flatten(), gb.double()]).norm().item())
    assert 0.999 < worst <= 1.0, f"an example's contribution reached {worst!r} C"


@pytest.mark.parametrize("kind", ["bias", "generic"])
def test_one_example_of_kept_or_generic_rows_moves_the_sum_by_at_most_c(kind):
    """The same end to end, where the book adds kept rows by per_sample_clipped_sum: a Linear
    whose weight is frozen (its bias's rows), and a module the kernels do not know (GroupNorm:
    per-sample gradients by torch.func, their squared norms certified by the book). No noise,
    q = 1, a summed loss and SGD with lr = N = 1 from zero parameters: the parameters' movement
    is the example's contribution, which must be at most C."""
    g = torch.Generator().manual_seed(11)
    worst = 0.0
    for _ in range(300):
        if kind == "bias":
            model = nn.Linear(1, 2)
            model.weight.requires_grad_(False)
            x = torch.randn(1, 3, 1, generator=g)
            out = torch.randn(1, 3, 2, generator=g)
        else:
            model = nn.GroupNorm(1, 2)
            x = torch.randn(1, 2, generator=g)
            out = torch.randn(1, 2, generator=g)
        out = out * 10 ** (2 + 4 * torch.rand((), generator=g))
        nn.init.zeros_(model.bias)
        if kind == "generic":
            nn.init.zeros_(model.weight)
        p = dpzero.make_private(model, dataset=torch.utils.data.TensorDataset(x, out),
                                sample_rate=1.0, noise_multiplier=0.0, allow_no_noise=True,
                                max_grad_norm=1.0, optimizer="sgd", lr=1.0,
                                loss_reduction="sum", seed=0)
        for xs, outs in p.data_loader:
            (p.model(xs) * outs).sum().backward()
            assert p.optimizer.step()
        moved = torch.cat([t.double().flatten() for t in p.privacy_engine.parameters().values()])
        worst = max(worst, moved.norm().item())
    assert 0.999 < worst <= 1.0, f"an example's contribution reached {worst!r} C"
