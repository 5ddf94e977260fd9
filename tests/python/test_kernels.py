"""Per-sample gradient ops (kernels/per_sample_ops.h, issue #4) against torch.func.

Reference: per-sample gradients from torch.func (vmap(grad(...)) of the layer's own functional
form, with the loss sum(y * G) so that G is the output gradient), computed in float64 from the very
values the op sees (low-precision inputs rounded first). Norms, clipped sums and fused clipping are
then formed from those gradients explicitly. Every test body runs on CPU and, when a GPU and the
CUDA kernels are present, on CUDA (DESIGN.md §6 "Twins").

Tolerances: the ops upcast bf16/fp16 inputs to float32 exactly and accumulate in float32, so the
error against the float64 reference is float32 summation error for every input dtype; we keep
one entry per dtype anyway, and they are tight enough (2e-5 of the largest value) that any
accumulation in bf16 (error ~1e-2) or fp16 (~1e-3) would fail.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

import dpzero

ops = torch.ops.dpzero

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and dpzero._C.with_cuda else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}
AUTO, GHOST, DIRECT = 0, 1, 2
C, GAMMA = 1.5, 0.01

device_param = pytest.mark.parametrize("device", DEVICES)
dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
method_param = pytest.mark.parametrize(
    "method", [AUTO, GHOST, DIRECT], ids=["auto", "ghost", "direct"]
)


def rand(shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype).to(device)


def f64(x):
    return x.detach().cpu().to(torch.float64)


def assert_close(actual, expected, dtype):
    assert actual.dtype == torch.float32, actual.dtype
    assert tuple(actual.shape) == tuple(expected.shape), (actual.shape, expected.shape)
    expected = expected.to(torch.float64)
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(f64(actual), expected, rtol=TOL[dtype], atol=TOL[dtype] * scale)


def sq_norms_of(*grads):
    """Per-sample squared norm over all given per-sample gradients [B, ...]."""
    return sum(g.flatten(1).pow(2).sum(1) for g in grads)


def weighted_sum(per_sample, scale):
    """sum_i c_i g_i of per-sample gradients [B, ...] (float64)."""
    c = f64(scale).view(-1, *([1] * (per_sample.dim() - 1)))
    return (c * per_sample).sum(0)


def ref_factors(sq, mode):
    n = sq.sqrt()
    f = C / (n + GAMMA) if mode == "automatic" else torch.clamp(C / (n + 1e-6), max=1.0)
    return torch.where(torch.isfinite(n), f, torch.zeros_like(f))


def random_scale(b, device, seed):
    g = torch.Generator().manual_seed(seed)
    s = 2.0 * torch.rand(b, generator=g)
    if b > 2:
        s[1] = 0.0  # a dropped sample
    return s.to(device)


# ---- torch.func references -----------------------------------------------------------------------


def per_sample_linear(A, G, transposed=False):
    """Per-sample (weight, bias) gradients of y = A W^T + b (nn.Linear) or A W + b (HF Conv1D)."""
    A, G = f64(A), f64(G)
    d_in, d_out = A.shape[-1], G.shape[-1]
    w = torch.zeros((d_in, d_out) if transposed else (d_out, d_in), dtype=torch.float64)
    params = {"weight": w, "bias": torch.zeros(d_out, dtype=torch.float64)}

    def loss(p, a, g):
        y = a @ p["weight"] + p["bias"] if transposed else F.linear(a, p["weight"], p["bias"])
        return (y * g).sum()

    out = vmap(grad(loss), in_dims=(None, 0, 0))(params, A, G)
    return out["weight"], out["bias"]


def per_sample_embedding(ids, G, num_embeddings, padding_idx):
    G = f64(G)
    w = torch.zeros(num_embeddings, G.shape[-1], dtype=torch.float64)

    def loss(weight, i, g):
        return (F.embedding(i, weight, padding_idx=padding_idx) * g).sum()

    return vmap(grad(loss), in_dims=(None, 0, 0))(w, ids.cpu().long(), G)


def per_sample_norm_layer(x, G, eps, rms):
    x, G = f64(x), f64(G)
    d = x.shape[-1]
    params = {
        "weight": torch.ones(d, dtype=torch.float64),
        "bias": torch.zeros(d, dtype=torch.float64),
    }

    def loss(p, xi, g):
        if rms:
            y = F.rms_norm(xi, (d,), p["weight"], eps) + p["bias"]
        else:
            y = F.layer_norm(xi, (d,), p["weight"], p["bias"], eps)
        return (y * g).sum()

    out = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, G)
    return out["weight"], out["bias"]


def conv_fn(nd):
    return F.conv1d if nd == 1 else F.conv2d


def per_sample_conv(x, G, weight_shape, stride, padding, dilation, groups):
    x, G = f64(x), f64(G)
    nd = len(weight_shape) - 2
    params = {
        "weight": torch.zeros(weight_shape, dtype=torch.float64),
        "bias": torch.zeros(weight_shape[0], dtype=torch.float64),
    }

    def loss(p, xi, g):
        y = conv_fn(nd)(xi.unsqueeze(0), p["weight"], p["bias"], stride, padding, dilation, groups)
        return (y.squeeze(0) * g).sum()

    out = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, G)
    return out["weight"], out["bias"]


# ---- the cost rule -------------------------------------------------------------------------------


def test_ghost_is_cheaper_follows_cost_rule():
    # 2 T^2 <= d_in d_out, boundary included.
    assert ops.ghost_is_cheaper(24, 32, 36)  # 1152 <= 1152
    assert not ops.ghost_is_cheaper(25, 32, 36)  # 1250 > 1152
    assert ops.ghost_is_cheaper(1, 1, 2) and not ops.ghost_is_cheaper(1, 1, 1)
    assert ops.ghost_is_cheaper(0, 0, 0)
    assert ops.ghost_is_cheaper(512, 768, 3072) and not ops.ghost_is_cheaper(2048, 768, 3072)
    # No int64 overflow for huge sizes.
    assert not ops.ghost_is_cheaper(2**40, 2**40, 2**40) and ops.ghost_is_cheaper(
        2**20, 2**40, 2**40
    )
    for t in range(0, 60):
        assert ops.ghost_is_cheaper(t, 40, 45) == (2 * t * t <= 40 * 45)
    with pytest.raises(RuntimeError, match="got T=-1"):
        ops.ghost_is_cheaper(-1, 3, 3)


# ---- Linear / HF Conv1D / bias -------------------------------------------------------------------

# (A shape without d_in, d_in, d_out): [B, T] or [B] (T = 1) or [B, *, *] (flattened into T).
LINEAR_SHAPES = [
    ((4, 6), 5, 7),
    ((1, 9), 8, 3),  # B = 1
    ((5,), 6, 4),  # [B, d]: T = 1
    ((3, 1), 7, 5),  # T = 1 with a sequence dim
    ((2, 3, 4), 5, 6),  # two leading dims flattened into T = 12
    ((3, 70), 45, 37),  # several 32-row Gram tiles with a remainder (CUDA kernel)
    ((2, 40), 3, 2),  # 2 T^2 > d_in d_out: auto takes the direct path
]
LINEAR_IDS = ["B4T6", "B1", "BxD", "T1", "4d", "T70", "tall"]


@device_param
@dtype_param
@method_param
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=LINEAR_IDS)
def test_linear_sq_norms_match_torch_func(device, dtype, method, bias, shape):
    lead, d_in, d_out = shape
    A = rand((*lead, d_in), dtype, device, 1)
    G = rand((*lead, d_out), dtype, device, 2)
    gw, gb = per_sample_linear(A, G)
    want = sq_norms_of(gw, gb) if bias else sq_norms_of(gw)
    assert_close(ops.linear_sq_norms(A, G, bias, method), want, dtype)


@device_param
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=LINEAR_IDS)
def test_linear_auto_takes_the_path_the_cost_rule_names(device, shape):
    # The two paths sum in different orders, so the auto result equals, bit for bit, the path
    # that ghost_is_cheaper names (both paths are deterministic).
    lead, d_in, d_out = shape
    A = rand((*lead, d_in), torch.float32, device, 3)
    G = rand((*lead, d_out), torch.float32, device, 4)
    t = math.prod(lead[1:])
    want = GHOST if ops.ghost_is_cheaper(t, d_in, d_out) else DIRECT
    ghost = ops.linear_sq_norms(A, G, False, GHOST)
    direct = ops.linear_sq_norms(A, G, False, DIRECT)
    torch.testing.assert_close(ghost, direct, rtol=1e-5, atol=1e-5 * direct.abs().max().item())
    assert torch.equal(ops.linear_sq_norms(A, G, False, AUTO), ghost if want == GHOST else direct)


@device_param
@dtype_param
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "hf_conv1d"])
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=LINEAR_IDS)
def test_linear_clipped_sum_matches_torch_func(device, dtype, transposed, shape):
    lead, d_in, d_out = shape
    A = rand((*lead, d_in), dtype, device, 5)
    G = rand((*lead, d_out), dtype, device, 6)
    scale = random_scale(lead[0], device, 7)
    gw, gb = per_sample_linear(A, G, transposed=transposed)
    assert_close(ops.linear_clipped_sum(A, G, scale, transposed), weighted_sum(gw, scale), dtype)
    assert_close(ops.bias_clipped_sum(G, scale), weighted_sum(gb, scale), dtype)


@device_param
@dtype_param
def test_hf_conv1d_norms_equal_linear_norms(device, dtype):
    # HF Conv1D's per-sample gradient is the transpose of nn.Linear's: same norm.
    A = rand((3, 5, 6), dtype, device, 8)
    G = rand((3, 5, 4), dtype, device, 9)
    gw, gb = per_sample_linear(A, G, transposed=True)
    assert_close(ops.linear_sq_norms(A, G, True, AUTO), sq_norms_of(gw, gb), dtype)


@device_param
@dtype_param
@pytest.mark.parametrize("shape", [(4, 3, 5), (1, 1, 2), (5, 7), (2, 2, 3, 4)], ids=str)
def test_bias_sq_norms_match_torch_func(device, dtype, shape):
    G = rand(shape, dtype, device, 10)
    A = rand((*shape[:-1], 3), dtype, device, 11)
    _, gb = per_sample_linear(A, G)
    assert_close(ops.bias_sq_norms(G), sq_norms_of(gb), dtype)


@device_param
def test_mixed_input_dtypes(device):
    # Under bf16 autocast a Linear can see an fp32 input and a bf16 output gradient.
    A = rand((3, 33, 6), torch.float32, device, 12)
    G = rand((3, 33, 5), torch.bfloat16, device, 13)
    gw, _ = per_sample_linear(A, G)
    scale = random_scale(3, device, 14)
    for method in (GHOST, DIRECT):
        assert_close(ops.linear_sq_norms(A, G, False, method), sq_norms_of(gw), torch.bfloat16)
    assert_close(ops.linear_clipped_sum(A, G, scale), weighted_sum(gw, scale), torch.bfloat16)


@device_param
def test_direct_path_chunks_over_samples(device):
    # 1024 x 1024 fp32 per-sample gradients are 4 MiB each: 20 samples need two chunks (norm op)
    # or three (fused clip). Norms of 10^6 terms also pin the fp32 summation accuracy.
    A = rand((20, 2, 1024), torch.float32, device, 15)
    G = rand((20, 2, 1024), torch.float32, device, 16)
    gw, _ = per_sample_linear(A, G)
    want = sq_norms_of(gw)
    assert_close(ops.linear_sq_norms(A, G, False, DIRECT), want, torch.float32)
    _, _, sq, factors, _ = ops.linear_clip(A, G, C, "flat", GAMMA, False, False, DIRECT)
    assert_close(sq, want, torch.float32)
    assert_close(factors, ref_factors(want, "flat"), torch.float32)


# ---- Embedding -----------------------------------------------------------------------------------

EMB_CASES = [  # (ids shape, V, d, padding_idx)
    ((4, 9), 7, 5, None),
    ((4, 9), 7, 5, 0),
    ((3, 12), 5, 6, -1),  # negative padding_idx counts from the end, as in nn.Embedding
    ((1, 6), 4, 3, 2),  # B = 1
    ((6,), 5, 4, 1),  # [B] ids: T = 1
    ((2, 3, 5), 6, 4, 3),  # leading dims flattened
    ((3, 70), 11, 8, 4),  # several 32-row tiles (CUDA kernel)
    ((2, 40), 50, 2, None),  # 2 T^2 > min(T, V) d: auto takes the direct path
]
EMB_IDS = ["pad_none", "pad0", "pad_neg", "B1", "T1", "4d", "T70", "tall"]


def emb_inputs(shape, V, d, dtype, device, seed, pad):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, shape, generator=g)
    if pad is not None:
        ids.view(-1)[::3] = pad % V  # plenty of padding tokens
    G = rand((*shape, d), dtype, device, seed + 1)
    return ids.to(device), G


@device_param
@dtype_param
@method_param
@pytest.mark.parametrize("case", EMB_CASES, ids=EMB_IDS)
def test_embedding_sq_norms_match_torch_func(device, dtype, method, case):
    shape, V, d, pad = case
    ids, G = emb_inputs(shape, V, d, dtype, device, 20, pad)
    want = sq_norms_of(per_sample_embedding(ids, G, V, pad))
    assert_close(ops.embedding_sq_norms(ids, G, V, pad, method), want, dtype)
    assert_close(ops.embedding_sq_norms(ids.int(), G, V, pad, method), want, dtype)


@device_param
@pytest.mark.parametrize("case", EMB_CASES, ids=EMB_IDS)
def test_embedding_auto_takes_the_path_the_cost_rule_names(device, case):
    shape, V, d, pad = case
    ids, G = emb_inputs(shape, V, d, torch.float32, device, 21, pad)
    t = math.prod(shape[1:])
    ghost_cheaper = ops.ghost_is_cheaper(t, min(t, V), d)
    auto = ops.embedding_sq_norms(ids, G, V, pad, AUTO)
    assert torch.equal(
        auto, ops.embedding_sq_norms(ids, G, V, pad, GHOST if ghost_cheaper else DIRECT)
    )


@device_param
@dtype_param
@pytest.mark.parametrize("case", EMB_CASES, ids=EMB_IDS)
def test_embedding_clipped_sum_matches_torch_func(device, dtype, case):
    shape, V, d, pad = case
    ids, G = emb_inputs(shape, V, d, dtype, device, 22, pad)
    scale = random_scale(shape[0], device, 23)
    want = weighted_sum(per_sample_embedding(ids, G, V, pad), scale)
    got = ops.embedding_clipped_sum(ids, G, scale, V, pad)
    assert_close(got, want, dtype)
    if pad is not None:
        assert torch.count_nonzero(got[pad % V]) == 0  # the padding row gets no gradient


@device_param
def test_embedding_sample_of_only_padding_has_zero_norm(device):
    ids = torch.tensor([[2, 2, 2], [1, 2, 1]], device=device)
    G = rand((2, 3, 4), torch.float32, device, 24)
    for method in (GHOST, DIRECT):
        got = ops.embedding_sq_norms(ids, G, 3, 2, method)
        assert got[0].item() == 0.0
        want = (G[1, 0] + G[1, 2]).pow(2).sum()
        torch.testing.assert_close(got[1], want, rtol=1e-6, atol=1e-6)


# ---- LayerNorm / RMSNorm -------------------------------------------------------------------------

NORM_SHAPES = [(4, 6, 8), (1, 3, 5), (5, 7), (2, 3, 2, 6), (3, 1, 4)]


@device_param
@dtype_param
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_layer_norm_ops_match_torch_func(device, dtype, rms, bias, shape):
    eps = 1e-5
    x = rand(shape, dtype, device, 30, scale=3.0)
    G = rand(shape, dtype, device, 31)
    gw, gb = per_sample_norm_layer(x, G, eps, rms)
    want = sq_norms_of(gw, gb) if bias else sq_norms_of(gw)
    assert_close(ops.layer_norm_sq_norms(x, G, eps, rms, bias), want, dtype)
    scale = random_scale(shape[0], device, 32)
    assert_close(ops.layer_norm_clipped_sum(x, G, scale, eps, rms), weighted_sum(gw, scale), dtype)


# ---- Conv1d / Conv2d -----------------------------------------------------------------------------

CONV_CASES = [  # (input shape, C_out, kernel_size, stride, padding, dilation, groups)
    ((3, 4, 11), 6, [3], [2], [1], [1], 2),
    ((2, 3, 9), 5, [2], [1], [0], [3], 1),
    ((1, 2, 5), 3, [5], [1], [2], [1], 1),  # B = 1
    ((2, 3, 7, 6), 4, [3, 2], [1, 2], [1, 0], [2, 1], 1),
    ((3, 4, 5, 5), 8, [3, 3], [1, 1], [1, 1], [1, 1], 4),  # depthwise (groups = C_in)
    ((2, 2, 12, 12), 3, [3, 3], [1, 1], [0, 0], [1, 1], 1),  # 100 positions: auto goes direct
]
CONV_IDS = ["1d_groups", "1d_dilated", "1d_B1", "2d", "2d_depthwise", "2d_many_positions"]


def conv_inputs(case, dtype, device, seed):
    shape, c_out, k, s, p, dil, groups = case
    x = rand(shape, dtype, device, seed)
    nd = len(k)
    w_shape = (c_out, shape[1] // groups, *k)
    out = conv_fn(nd)(
        torch.zeros(shape, dtype=torch.float64),
        torch.zeros(w_shape, dtype=torch.float64),
        None,
        s,
        p,
        dil,
        groups,
    )
    G = rand(out.shape, dtype, device, seed + 1)
    return x, G, w_shape


@device_param
@dtype_param
@method_param
@pytest.mark.parametrize("case", CONV_CASES, ids=CONV_IDS)
def test_conv_ops_match_torch_func(device, dtype, method, case):
    _, _, k, s, p, dil, groups = case
    x, G, w_shape = conv_inputs(case, dtype, device, 40)
    gw, gb = per_sample_conv(x, G, w_shape, s, p, dil, groups)
    assert_close(
        ops.conv_sq_norms(x, G, k, s, p, dil, groups, False, method), sq_norms_of(gw), dtype
    )
    assert_close(
        ops.conv_sq_norms(x, G, k, s, p, dil, groups, True, method), sq_norms_of(gw, gb), dtype
    )
    scale = random_scale(x.shape[0], device, 42)
    assert_close(
        ops.conv_clipped_sum(x, G, scale, k, s, p, dil, groups), weighted_sum(gw, scale), dtype
    )


# ---- fused clipping ------------------------------------------------------------------------------


def check_fused(result, per_sample, mode, dtype, with_bias_grad=None):
    """result = (grad_w, [grad_b,] sq, factors, nonfinite); per_sample = (gw, gb or None)."""
    gw, gb = per_sample
    sq = sq_norms_of(gw, gb) if gb is not None else sq_norms_of(gw)
    factors = ref_factors(sq, mode)
    grad_w, sq_got, f_got, nonfinite = result[0], result[-3], result[-2], result[-1]
    assert_close(sq_got, sq, dtype)
    assert_close(f_got, factors, dtype)
    assert_close(grad_w, weighted_sum(gw, factors), dtype)
    if with_bias_grad is not None:
        if gb is None:
            assert result[1].numel() == 0
        else:
            assert_close(result[1], weighted_sum(gb, factors), dtype)
    assert nonfinite.dtype == torch.int64 and nonfinite.item() == 0


@device_param
@dtype_param
@pytest.mark.parametrize("mode", ["flat", "automatic"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@method_param
def test_linear_clip_matches_torch_func(device, dtype, mode, bias, method):
    A = rand((5, 6, 7), dtype, device, 50)
    G = rand((5, 6, 4), dtype, device, 51, scale=0.1)  # some samples below the threshold
    G[2] = 0  # a zero gradient
    gw, gb = per_sample_linear(A, G)
    for transposed in (False, True):
        res = ops.linear_clip(A, G, C, mode, GAMMA, bias, transposed, method)
        want_w = gw.transpose(1, 2) if transposed else gw
        check_fused(res, (want_w, gb if bias else None), mode, dtype, with_bias_grad=True)


@device_param
@dtype_param
@pytest.mark.parametrize("mode", ["flat", "automatic"])
def test_embedding_clip_matches_torch_func(device, dtype, mode):
    ids, G = emb_inputs((4, 9), 7, 5, dtype, device, 52, 0)
    res = ops.embedding_clip(ids, G, 7, C, mode, GAMMA, 0, AUTO)
    check_fused(res, (per_sample_embedding(ids, G, 7, 0), None), mode, dtype)


@device_param
@dtype_param
@pytest.mark.parametrize("mode", ["flat", "automatic"])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_layer_norm_clip_matches_torch_func(device, dtype, mode, rms):
    x = rand((4, 5, 6), dtype, device, 53)
    G = rand((4, 5, 6), dtype, device, 54, scale=0.2)
    gw, gb = per_sample_norm_layer(x, G, 1e-6, rms)
    res = ops.layer_norm_clip(x, G, 1e-6, C, mode, GAMMA, rms, not rms)
    check_fused(res, (gw, None if rms else gb), mode, dtype, with_bias_grad=True)


@device_param
@dtype_param
@pytest.mark.parametrize("mode", ["flat", "automatic"])
@pytest.mark.parametrize("case", [CONV_CASES[0], CONV_CASES[3]], ids=["1d", "2d"])
def test_conv_clip_matches_torch_func(device, dtype, mode, case):
    _, _, k, s, p, dil, groups = case
    x, G, w_shape = conv_inputs(case, dtype, device, 55)
    gw, gb = per_sample_conv(x, G, w_shape, s, p, dil, groups)
    res = ops.conv_clip(x, G, k, s, p, dil, groups, C, mode, GAMMA, True, AUTO)
    check_fused(res, (gw, gb), mode, dtype, with_bias_grad=True)


@device_param
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@method_param
def test_fused_clip_drops_and_counts_non_finite_samples(device, bad, method):
    A = rand((4, 3, 5), torch.float32, device, 56)
    G = rand((4, 3, 6), torch.float32, device, 57)
    G[1, 0, 0] = bad
    A[3, 2, 1] = bad
    grad_w, grad_b, sq, factors, nonfinite = ops.linear_clip(
        A, G, C, "flat", GAMMA, True, False, method
    )
    assert nonfinite.item() == 2
    assert factors[1].item() == 0.0 and factors[3].item() == 0.0
    assert torch.isfinite(grad_w).all() and torch.isfinite(grad_b).all()
    keep = [0, 2]
    gw, gb = per_sample_linear(A[keep], G[keep])
    f = ref_factors(sq_norms_of(gw, gb), "flat")
    assert_close(grad_w, weighted_sum(gw, f), torch.float32)
    assert_close(grad_b, weighted_sum(gb, f), torch.float32)


@device_param
@pytest.mark.parametrize("mode", ["flat", "automatic"])
def test_each_clipped_contribution_is_bounded_by_the_threshold(device, mode):
    # Sensitivity (DESIGN.md §3): any one sample's clipped weight + bias gradient has norm <= C
    # (automatic clipping: C ||g|| / (||g|| + gamma) < C).
    for seed in range(5):
        A = rand((1, 8, 16), torch.bfloat16, device, 60 + seed, scale=10.0)
        G = rand((1, 8, 12), torch.bfloat16, device, 70 + seed, scale=10.0)
        grad_w, grad_b, *_ = ops.linear_clip(A, G, C, mode, GAMMA, True, False, AUTO)
        norm = torch.cat([grad_w.flatten(), grad_b]).double().norm().item()
        assert norm <= C * (1 + 1e-6), norm


# ---- empty micro-batches and zero gradients ------------------------------------------------------


@device_param
@dtype_param
def test_empty_micro_batch(device, dtype):
    z = lambda *s: torch.zeros(s, dtype=dtype, device=device)  # noqa: E731
    scale = torch.zeros(0, device=device)
    for method in (AUTO, GHOST, DIRECT):
        for A, G in ((z(0, 5, 3), z(0, 5, 4)), (z(0, 3), z(0, 4))):
            got = ops.linear_sq_norms(A, G, True, method)
            assert got.shape == (0,) and got.dtype == torch.float32
        ids = torch.zeros(0, 5, dtype=torch.long, device=device)
        assert ops.embedding_sq_norms(ids, z(0, 5, 4), 6, 0, method).shape == (0,)
        assert ops.conv_sq_norms(
            z(0, 2, 6), z(0, 4, 4), [3], [1], [0], [1], 1, True, method
        ).shape == (0,)
    assert torch.equal(
        ops.linear_clipped_sum(z(0, 5, 3), z(0, 5, 4), scale), torch.zeros(4, 3, device=device)
    )
    assert torch.equal(
        ops.linear_clipped_sum(z(0, 3), z(0, 4), scale, True), torch.zeros(3, 4, device=device)
    )
    assert torch.equal(ops.bias_clipped_sum(z(0, 5, 4), scale), torch.zeros(4, device=device))
    assert ops.bias_sq_norms(z(0, 4)).shape == (0,)
    ids = torch.zeros(0, 5, dtype=torch.long, device=device)
    assert torch.equal(
        ops.embedding_clipped_sum(ids, z(0, 5, 4), scale, 6, None), torch.zeros(6, 4, device=device)
    )
    assert ops.layer_norm_sq_norms(z(0, 5, 4), z(0, 5, 4), 1e-5, False, True).shape == (0,)
    assert torch.equal(
        ops.layer_norm_clipped_sum(z(0, 5, 4), z(0, 5, 4), scale, 1e-5, True),
        torch.zeros(4, device=device),
    )
    assert torch.equal(
        ops.conv_clipped_sum(
            z(0, 2, 6, 6), z(0, 4, 4, 4), scale, [3, 3], [1, 1], [0, 0], [1, 1], 2
        ),
        torch.zeros(4, 1, 3, 3, device=device),
    )
    grad_w, grad_b, sq, factors, nonfinite = ops.linear_clip(
        z(0, 5, 3), z(0, 5, 4), C, "flat", GAMMA, True, False, AUTO
    )
    assert torch.equal(grad_w, torch.zeros(4, 3, device=device)) and torch.equal(
        grad_b, torch.zeros(4, device=device)
    )
    assert sq.shape == factors.shape == (0,) and nonfinite.item() == 0
    grad_w, sq, factors, nonfinite = ops.embedding_clip(
        ids, z(0, 5, 4), 6, C, "automatic", GAMMA, None, AUTO
    )
    assert torch.equal(grad_w, torch.zeros(6, 4, device=device)) and sq.shape == (0,)
    res = ops.layer_norm_clip(z(0, 4), z(0, 4), 1e-5, C, "flat", GAMMA, True, True)
    assert torch.equal(res[0], torch.zeros(4, device=device)) and res[2].shape == (0,)
    res = ops.conv_clip(z(0, 2, 6), z(0, 4, 4), [3], [1], [0], [1], 1, C, "flat", GAMMA, True, AUTO)
    assert torch.equal(res[0], torch.zeros(4, 2, 3, device=device)) and torch.equal(
        res[1], torch.zeros(4, device=device)
    )


@device_param
@method_param
def test_zero_gradients_give_zero_norms_and_sums(device, method):
    A = rand((3, 40, 6), torch.float32, device, 80)
    G = torch.zeros(3, 40, 5, device=device)
    assert torch.equal(ops.linear_sq_norms(A, G, True, method), torch.zeros(3, device=device))
    res = ops.linear_clip(A, G, C, "automatic", GAMMA, True, False, method)
    assert torch.equal(res[0], torch.zeros(5, 6, device=device)) and torch.equal(
        res[1], torch.zeros(5, device=device)
    )
    assert torch.equal(res[3], torch.full((3,), C / GAMMA, device=device))
    ids = torch.randint(0, 4, (3, 40), device=device)
    assert torch.equal(
        ops.embedding_sq_norms(ids, G, 4, None, method), torch.zeros(3, device=device)
    )


# ---- argument checks name the offending value ----------------------------------------------------


def test_rejects_bad_arguments_naming_them():
    A, G = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
    with pytest.raises(
        RuntimeError, match=r"method must be 0 \(auto\), 1 \(ghost\) or 2 \(direct\), got 3"
    ):
        ops.linear_sq_norms(A, G, False, 3)
    with pytest.raises(RuntimeError, match=r"must share all but their last dim"):
        ops.linear_sq_norms(A, torch.randn(2, 4, 5))
    with pytest.raises(RuntimeError, match=r"float32, bfloat16 or float16, got Double"):
        ops.linear_sq_norms(A.double(), G.double())
    with pytest.raises(RuntimeError, match=r"scale must be \[B\] = \[2\], got shape \[3\]"):
        ops.linear_clipped_sum(A, G, torch.ones(3))
    with pytest.raises(RuntimeError, match=r"scale must be float32, got Double"):
        ops.linear_clipped_sum(A, G, torch.ones(2, dtype=torch.float64))
    ids = torch.tensor([[0, 1, 2]])
    with pytest.raises(
        RuntimeError,
        match=r"padding_idx must be in \[-num_embeddings, num_embeddings\) = \[-3, 3\), got 3",
    ):
        ops.embedding_sq_norms(ids, torch.randn(1, 3, 2), 3, 3)
    with pytest.raises(
        RuntimeError, match=r"ids must be in \[0, num_embeddings\) = \[0, 2\), got 2"
    ):
        ops.embedding_sq_norms(ids, torch.randn(1, 3, 2), 2)
    with pytest.raises(RuntimeError, match=r"G must be ids.shape \+ \[d\]"):
        ops.embedding_sq_norms(ids, torch.randn(1, 4, 2), 3)
    with pytest.raises(RuntimeError, match=r"eps must be finite and >= 0, got -1"):
        ops.layer_norm_sq_norms(A, A, -1.0)
    with pytest.raises(RuntimeError, match=r"G's spatial dim 0 is 5 but the convolution of input"):
        ops.conv_sq_norms(torch.randn(2, 3, 8), torch.randn(2, 4, 5), [3], [1], [0], [1])
    with pytest.raises(
        RuntimeError, match=r"groups must be >= 1 and divide C_in = 3 and C_out = 4, got 2"
    ):
        ops.conv_sq_norms(torch.randn(2, 3, 8), torch.randn(2, 4, 6), [3], [1], [0], [1], 2)
    with pytest.raises(RuntimeError, match=r"max_norm must be finite and > 0, got -1"):
        ops.linear_clip(A, G, -1.0, "flat")
    with pytest.raises(RuntimeError, match=r"mode must be 'flat' or 'automatic', got 'clamp'"):
        ops.linear_clip(A, G, 1.0, "clamp")
    for method in (GHOST, DIRECT):  # checked before any work, even for an empty micro-batch
        with pytest.raises(RuntimeError, match=r"max_norm must be finite and > 0, got 0"):
            ops.linear_clip(A[:0], G[:0], 0.0, "flat", GAMMA, False, False, method)
