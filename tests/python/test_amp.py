"""Mixed precision the PyTorch way: torch.autocast around the forward of a
private model, and torch.amp.GradScaler refused with its reason.

Reference: the same model in fp32 under the same autocast, one example at a time through torch's
own autograd (so its casts are autocast's), clipped in float64 and summed. The reference's weight
gradients are themselves rounded to bf16 by autograd's bf16 matmuls (dpzero's per-sample ops
accumulate in fp32), so the comparison allows 2e-2 relative: a dtype or scaling mistake is O(1).
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpzero

C = 0.05


class Mixed(nn.Module):
    """One of every kernel layer kind: Embedding, Conv1d, LayerNorm, RMSNorm, Linear."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(11, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.ln = nn.LayerNorm(8)
        self.rms = nn.RMSNorm(8)
        self.mlp = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        h = self.wte(ids)                                      # [B, T, 8]
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = self.rms(self.ln(h))
        return self.head(torch.tanh(self.mlp(h)).mean(1))      # [B, 3]


def _data(n=24):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randint(0, 11, (n, 6), generator=g),
                                          torch.randint(0, 3, (n,), generator=g))


def _reference_update(model, x, y, expected_batch, lr, dtype, autocast=True):
    ref = copy.deepcopy(model)
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in ref.named_parameters()}
    for i in range(len(x)):
        ref.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            loss = F.cross_entropy(ref(x[i:i + 1]), y[i:i + 1])
        loss.backward()
        grads = {n: p.grad.double() for n, p in ref.named_parameters()}
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
        factor = min(1.0, C / norm)
        for n in total:
            total[n] += factor * grads[n]
    return {n: p.detach().double() - lr * total[n] / expected_batch
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [0, 3])
def test_bf16_autocast_forward_matches_per_example_autograd(stage):
    torch.manual_seed(0)
    model = Mixed()
    start = copy.deepcopy(model)
    data = _data()
    p = dpzero.make_private(model, dataset=data, batch_size=8, noise_multiplier=0.0,
                            max_grad_norm=C, allow_no_noise=True, lr=0.5, seed=4,
                            zero_stage=stage)
    x, y = next(iter(p.data_loader))
    assert len(x) > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = p.model(x)
        assert logits.dtype == torch.bfloat16
        loss = F.cross_entropy(logits, y)
    loss.backward()
    assert p.optimizer.step()
    want = _reference_update(start, x, y, 8.0, 0.5, torch.bfloat16)
    got = p.privacy_engine.parameters()  # fp32 masters (gathered at stage 3)
    for n in want:
        assert got[n].dtype == torch.float32
        moved = (want[n] - start.get_parameter(n).detach().double()).norm()
        err = float((got[n].double() - want[n]).norm() / moved)
        assert err < 2e-2, (n, err)


class HalfInputNorm(nn.Module):
    """A LayerNorm with float32 parameters fed a bfloat16 input, without autocast (ATen's mixed
    layer norm: float32 statistics, a bfloat16 output)."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(11, 8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        h = self.ln(self.wte(ids).to(torch.bfloat16))
        assert h.dtype == torch.bfloat16
        return self.head(h.float().mean(1))


def test_a_layer_norm_on_a_16_bit_input_without_autocast_matches_per_example_autograd():
    # The DP LayerNorm's input gradient in the output's dtype with float32 parameters (a review
    # found the forward's float32 statistics handed to a bfloat16 backward: a crash).
    torch.manual_seed(0)
    model = HalfInputNorm()
    start = copy.deepcopy(model)
    p = dpzero.make_private(model, dataset=_data(), batch_size=8, noise_multiplier=0.0,
                            max_grad_norm=C, allow_no_noise=True, lr=0.5, seed=4)
    x, y = next(iter(p.data_loader))
    assert len(x) > 0
    F.cross_entropy(p.model(x), y).backward()
    assert p.optimizer.step()
    want = _reference_update(start, x, y, 8.0, 0.5, torch.bfloat16, autocast=False)
    got = p.privacy_engine.parameters()
    for n in want:
        moved = (want[n] - start.get_parameter(n).detach().double()).norm()
        err = float((got[n].double() - want[n]).norm() / moved)
        assert err < 2e-2, (n, err)


def test_grad_scaler_is_refused_naming_the_reason():
    torch.manual_seed(0)
    model = Mixed()
    p = dpzero.make_private(model, dataset=_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=C, seed=4)
    scaler = torch.amp.GradScaler("cpu")
    before = [t.detach().clone() for t in model.parameters()]
    x, y = next(iter(p.data_loader))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(p.model(x), y)
    scaler.scale(loss).backward()
    with pytest.raises(ValueError, match="GradScaler.*before clipping"):
        scaler.step(p.optimizer)
    assert p.privacy_engine.charges == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_fp16_autocast_without_a_scaler_trains():
    torch.manual_seed(0)
    model = Mixed()
    p = dpzero.make_private(model, dataset=_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=C, seed=4)
    for step, (x, y) in enumerate(p.data_loader):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(p.model(x), y)
        loss.backward()
        p.optimizer.step()
        p.optimizer.zero_grad()
    assert p.privacy_engine.charges == 3
    assert all(torch.isfinite(t).all() for t in model.parameters())


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_casts_frozen_parameters_to_the_compute_dtype(dtype):
    """A frozen float32 weight would meet the 16-bit activations of mixed_precision= and fail
    ("self and mat2 must have the same dtype", a review): frozen floating-point parameters take
    the compute dtype in place (zero.py's _cast_frozen, as FSDP2's param_dtype casts a module's
    parameters), their values the float32 ones rounded once, and stay so through a step and a
    release (the module-state check fixes them after the cast)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3))
    model[0].requires_grad_(False)             # a whole frozen layer (no DP layer: plain torch)
    model[1].weight.requires_grad_(False)      # a DP layer with a frozen weight, trained bias
    want = {n: p.detach().to(getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype]))
            for n, p in model.named_parameters() if not p.requires_grad}
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    p = dpzero.make_private(model, dataset=torch.utils.data.TensorDataset(x, y),
                            sample_rate=0.5, noise_multiplier=1.0, max_grad_norm=1.0, seed=0,
                            mixed_precision=dtype)
    before = {k: v.clone() for k, v in p.privacy_engine.parameters().items()}
    steps = 0
    for xs, ys in p.data_loader:
        F.cross_entropy(p.model(xs), ys).backward()
        steps += bool(p.optimizer.step())
    assert steps > 0
    state = p.model.state_dict()
    for name, value in want.items():
        assert state[name].dtype == value.dtype and torch.equal(state[name], value), name
    after = p.privacy_engine.parameters()
    assert all(not torch.equal(after[k], before[k]) for k in ("1.bias", "2.weight"))
