"""Per-sample gradient ops (kernels/per_sample_ops.h) against torch.func.

Reference: per-sample gradients from torch.func (vmap(grad(...)) of the layer's own functional
form, with the loss sum(y * G) so that G is the output gradient), computed in float64 from the very
values the op sees (low-precision inputs rounded first). Norms, clipped sums and fused clipping are
then formed from those gradients explicitly. Every test body runs on CPU and, when a GPU and the
CUDA kernels are present, on CUDA (design.md §6 "Twins").

Tolerances: the ops upcast bf16/fp16 inputs exactly (norms to float64, clipped sums to float32)
and accumulate in float64 (norms) or float32 (clipped sums), so the error against the float64
reference is at most float32 summation error for every input dtype; we keep one entry per dtype
anyway, and they are tight enough (2e-5 of the largest value) that any accumulation in bf16
(error ~1e-2), fp16 (~1e-3) or TF32 (~1e-3) would fail.

Norms are certified upper bounds (Note [certified norms] in kernels/per_sample/common.h): the
"certified" tests build inputs whose per-sample sums cancel (or sit at the ends of float32's
range) and check that the reported norm is never below the exact float64 one, so that
factor * exact norm <= C.
"""

import contextlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

from clip_margin import linear_s, with_margin
from devices import DEVICES  # imports dpzero, which registers torch.ops.dpzero

ops = torch.ops.dpzero

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


# ---- the clipped sums' rounding margin (clip_margin.py) ---------------------------------------

def embedding_s(ids, G, pad):
    """(S_i = sum over non-padding tokens of ||g_t|| [B], T) of an Embedding."""
    g = f64(G)
    if g.dim() == 2:
        g = g.unsqueeze(1)
    g = g.flatten(1, -2)
    keep = (ids.reshape(g.shape[:2]) != (-1 if pad is None else pad)).cpu()
    return (g.norm(dim=-1) * keep).sum(1), g.shape[1]


def conv_weight_bound(x, G, gw, k, stride, padding, dilation, groups):
    """sum over groups j of (||W_j|| + m S_j)^2 for a Conv's per-sample weight gradients gw, S_j
    over the unfolded patches of group j and its output channels."""
    x4, g = f64(x), f64(G)
    if x4.dim() == 3:  # Conv1d as a 2-d unfold of height 1
        x4, k, stride = x4.unsqueeze(2), [1, *k], [1, *stride]
        padding, dilation = [0, *padding], [1, *dilation]
    cols = F.unfold(x4, k, dilation=dilation, padding=padding, stride=stride)  # [B, C K, P]
    g = g.flatten(2)  # [B, C_out, P]
    rows_in, rows_out = cols.shape[1] // groups, g.shape[1] // groups
    total = 0
    for j in range(groups):
        a_j = cols[:, j * rows_in:(j + 1) * rows_in]
        g_j = g[:, j * rows_out:(j + 1) * rows_out]
        s_j = (a_j.norm(dim=1) * g_j.norm(dim=1)).sum(1)
        total = total + with_margin(sq_norms_of(gw[:, j * rows_out:(j + 1) * rows_out]), s_j,
                                    cols.shape[2])
    return total


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


def per_sample_norm_layer(x, G, eps, rms, normalized_ndim=1):
    x, G = f64(x), f64(G)
    shape = tuple(x.shape[x.dim() - normalized_ndim :])
    params = {
        "weight": torch.ones(shape, dtype=torch.float64),
        "bias": torch.zeros(shape, dtype=torch.float64),
    }

    def loss(p, xi, g):
        if rms:
            y = F.rms_norm(xi, shape, p["weight"], eps) + p["bias"]
        else:
            y = F.layer_norm(xi, shape, p["weight"], p["bias"], eps)
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
    want = with_margin(sq_norms_of(gw), *linear_s(A, G)) + (sq_norms_of(gb) if bias else 0)
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
    # 1024 x 1024 float64 per-sample gradients are 8 MiB each: 20 samples need three chunks of
    # the 64 MiB budget (7 + 7 + 6). Norms of 10^6 terms also pin the summation accuracy.
    A = rand((20, 2, 1024), torch.float32, device, 15)
    G = rand((20, 2, 1024), torch.float32, device, 16)
    gw, _ = per_sample_linear(A, G)
    want = sq_norms_of(gw)
    assert_close(ops.linear_sq_norms(A, G, False, DIRECT), want, torch.float32)
    _, _, sq, factors, _ = ops.linear_clip(A, G, C, "flat", GAMMA, False, False, DIRECT)
    assert_close(sq, want, torch.float32)
    assert_close(factors, ref_factors(want, "flat"), torch.float32)


@device_param
@dtype_param
@pytest.mark.parametrize("shape", [((6,), 33, 17), ((5, 1), 1, 300), ((4,), 2, 1)],
                         ids=["BxD", "T1", "d_in1"])
def test_rank_one_ghost_is_the_torch_func_norm(device, dtype, shape):
    # Note [rank-one ghost]: at T = 1 the ghost kernel's raw value is ||a||^2 ||g||^2, the squared
    # norm of the per-sample gradient g a^T from torch.func (float64; a few ulps apart, the
    # summation orders differ), and S = ||a|| ||g||; shared-input groups give each layer's value.
    lead, d_in, d_out = shape
    A = rand((*lead, d_in), dtype, device, 30)
    G = rand((*lead, d_out), dtype, device, 31)
    G2 = rand((*lead, 3), dtype, device, 32)
    gw, _ = per_sample_linear(A, G)
    want = sq_norms_of(gw)
    A3, G3 = A.reshape(lead[0], 1, d_in), G.reshape(lead[0], 1, d_out)
    value, s = ops._ghost_sq_norms(A3, G3)
    torch.testing.assert_close(value.cpu(), want, rtol=1e-12, atol=0)
    torch.testing.assert_close(s.cpu(), want.sqrt(), rtol=1e-12, atol=0)
    values, norms = ops._ghost_sq_norms_multi(A3, [G3, G2.reshape(lead[0], 1, 3)])
    assert torch.equal(values[0], value) and torch.equal(norms[0], s)
    torch.testing.assert_close(values[1].cpu(), sq_norms_of(per_sample_linear(A, G2)[0]),
                               rtol=1e-12, atol=0)


@device_param
@pytest.mark.parametrize("shape", [((6,), 33, 17), ((5, 1), 1, 300), ((4,), 2, 1), ((3,), 1, 1)],
                         ids=["BxD", "T1", "d_in1", "1x1"])
def test_t1_auto_takes_the_rank_one_path(device, shape):
    # Note [ghost or direct] at T = 1: the ghost path (the rank-one kernel) unless the layer is
    # 1 x 1 (d_in d_out < 2), where the direct path holds fewer numbers; auto equals, bit for
    # bit, the path the rule names, and both match torch.func.
    lead, d_in, d_out = shape
    A = rand((*lead, d_in), torch.float32, device, 33)
    G = rand((*lead, d_out), torch.float32, device, 34)
    want_ghost = d_in * d_out >= 2
    assert ops.ghost_is_cheaper(1, d_in, d_out) == want_ghost
    auto = ops.linear_sq_norms(A, G, False, AUTO)
    assert torch.equal(auto, ops.linear_sq_norms(A, G, False, GHOST if want_ghost else DIRECT))
    assert_close(auto, sq_norms_of(per_sample_linear(A, G)[0]), torch.float32)


@device_param
def test_rank_one_token_ghost_skips_padding(device):
    # T = 1 embedding, ghost path forced: ||g||^2 for a kept token, 0 for padding (whose G row is
    # NaN and must never be read into the result); matches torch.func.
    ids = torch.tensor([3, 0, 3, 1, 0], device=device)
    G = rand((5, 8), torch.float32, device, 35)
    G[ids == 0] = float("nan")
    got = ops.embedding_sq_norms(ids, G, 5, 0, GHOST)
    want = sq_norms_of(per_sample_embedding(ids, torch.nan_to_num(G), 5, 0))
    assert_close(got, want, torch.float32)
    value, s = ops._token_ghost_sq_norms(ids.view(5, 1), G.view(5, 1, 8), 0)
    assert torch.isfinite(value).all() and torch.equal(value.cpu()[ids.cpu() == 0],
                                                       torch.zeros(2, dtype=torch.float64))


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
    want = with_margin(sq_norms_of(per_sample_embedding(ids, G, V, pad)), *embedding_s(ids, G, pad))
    assert_close(ops.embedding_sq_norms(ids, G, V, pad, method), want, dtype)
    assert_close(ops.embedding_sq_norms(ids.int(), G, V, pad, method), want, dtype)


@device_param
@pytest.mark.parametrize("case", EMB_CASES, ids=EMB_IDS)
def test_embedding_auto_takes_the_path_the_cost_rule_names(device, case):
    # Note [ghost or direct], except on the CPU, whose direct kernel is always the cheaper one
    # (Note [embedding rows]).
    shape, V, d, pad = case
    ids, G = emb_inputs(shape, V, d, torch.float32, device, 21, pad)
    t = math.prod(shape[1:])
    ghost = device != "cpu" and ops.ghost_is_cheaper(t, min(t, V), d)
    auto = ops.embedding_sq_norms(ids, G, V, pad, AUTO)
    assert torch.equal(auto, ops.embedding_sq_norms(ids, G, V, pad, GHOST if ghost else DIRECT))


@device_param
@pytest.mark.parametrize("case", EMB_CASES, ids=EMB_IDS)
def test_embedding_rows_are_the_float64_row_sums(device, case):
    # The raw direct-path values (Note [embedding rows]) against float64 sums done here: q = sum
    # over distinct non-padding ids of ||sum of their G rows||^2 and S = sum over non-padding
    # tokens of ||G_t||, whose correctness the certified bound relies on.
    shape, V, d, pad = case
    ids, G = emb_inputs(shape, V, d, torch.float32, device, 25, pad)
    b, t = shape[0], math.prod(shape[1:])
    flat_ids, g64 = ids.reshape(b, t).cpu(), G.reshape(b, t, d).double().cpu()
    p = -1 if pad is None else pad % V
    q_want, s_want = torch.zeros(b, dtype=torch.float64), torch.zeros(b, dtype=torch.float64)
    for i in range(b):
        for v in set(flat_ids[i].tolist()) - {p}:
            q_want[i] += g64[i][flat_ids[i] == v].sum(0).square().sum()
        s_want[i] = g64[i][flat_ids[i] != p].norm(dim=1).sum()
    q, s = torch.ops.dpzero._embedding_rows(flat_ids.to(device), G.reshape(b, t, d), V, p)
    assert q.dtype == s.dtype == torch.float64
    torch.testing.assert_close(q.cpu(), q_want, rtol=1e-13, atol=0)
    torch.testing.assert_close(s.cpu(), s_want, rtol=1e-13, atol=0)


# [B, T, d]: one row, rows past one flush of the CUDA kernel's row squares (32), columns over one
# tile (256) and not a multiple of it, a sample count past one warp.
ROW_SHAPES = [(3, 1, 5), (2, 40, 300), (33, 7, 256), (4, 65, 513)]


@device_param
@dtype_param
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("norm", [None, "layer", "rms"])
def test_row_sums_are_the_float64_row_sums(device, dtype, shape, norm):
    # The raw direct-path values of Note [row sums] against float64 sums done here: sums = sum_t
    # of each sample's rows and S = sum_t ||row_t||, the rows being G (biases) or G * x-hat with
    # x-hat normalised in float64 (norm layers' weights): the values the certified bound relies on.
    x, G = rand(shape, dtype, device, 31), rand(shape, dtype, device, 32)
    g64 = f64(G)
    if norm is None:
        sums, s = ops._row_sums(G)
        rows = g64
    else:
        eps, rms = 1e-5, norm == "rms"
        sums, s = ops._norm_row_sums(x, G, eps, rms)
        x64 = f64(x)
        centred = x64 if rms else x64 - x64.mean(-1, keepdim=True)
        rows = g64 * centred / (centred.square().mean(-1, keepdim=True) + eps).sqrt()
    assert sums.dtype == s.dtype == torch.float64 and sums.device.type == device
    torch.testing.assert_close(sums.cpu(), rows.sum(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s.cpu(), rows.norm(dim=2).sum(1), rtol=1e-12, atol=0)


@device_param
def test_embedding_rows_past_one_blocks_sort_are_the_float64_row_sums(device):
    # CUDA sorts a sample's tokens in one block up to T = 2048 and takes the generic version past
    # it; both against the float64 sums, with repeated ids and padding.
    b, t, v, d, pad = 2, 2100, 37, 5, 4
    g = torch.Generator().manual_seed(41)
    ids = torch.randint(0, v, (b, t), generator=g)
    G = torch.randn(b, t, d, generator=g)
    q, s = ops._embedding_rows(ids.to(device), G.to(device), v, pad)
    g64 = G.double()
    for i in range(b):
        want_q = sum(g64[i][ids[i] == u].sum(0).square().sum() for u in set(ids[i].tolist()) - {pad})
        torch.testing.assert_close(q[i].cpu(), want_q, rtol=1e-12, atol=0)
        torch.testing.assert_close(s[i].cpu(), g64[i][ids[i] != pad].norm(dim=1).sum(), rtol=1e-12,
                                   atol=0)


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


def embedding_sums_reference(self0, ids, G, scale, pad):
    """Note [embedding sums] written out with float32 tensor operations, one sample and one id at a
    time (IEEE float32 each, as torch computes them on the CPU): a kept sample's tokens of id v
    summed in position order, each c * G_t rounded first, then added into row v."""
    out = self0.detach().cpu().clone()
    ids, G, scale = ids.cpu(), G.cpu().float(), scale.cpu()
    for i in range(G.shape[0]):
        c = scale[i]
        if not torch.isfinite(c) or c == 0:
            continue  # a dropped sample: its rows never read
        for v in sorted(set(ids[i].tolist()) - {pad}):
            run = torch.zeros(G.shape[2])
            for t in (ids[i] == v).nonzero().flatten().tolist():
                run = run + c * G[i, t]
            out[v] = out[v] + run
    return out


@device_param
@dtype_param
@pytest.mark.parametrize("b,t,v,d,pad", [(7, 9, 3, 5, 2), (5, 1, 4, 3, -1), (3, 40, 50, 300, 0),
                                         (40, 6, 2, 4, -1)],
                         ids=["repeats", "T1", "wide", "B40"])
def test_add_embedding_sums_gives_the_per_sample_float32_bits(device, dtype, b, t, v, d, pad):
    # The device path's embedding clipped sum: every bit of a per-sample, per-id float32 loop,
    # with dropped samples (factor 0, -0, NaN, Inf) and padding tokens whose rows hold NaN, into
    # an accumulator that already holds values, and into a strided one.
    g = torch.Generator().manual_seed(61)
    ids = torch.randint(0, v, (b, t), generator=g)
    G = (3 * torch.randn(b, t, d, generator=g)).to(dtype)
    scale = torch.rand(b, generator=g) * 2
    for i, f in zip(range(1, b, 2), [0.0, float("nan"), -0.0, float("inf")]):
        scale[i] = f
        G[i, 0, 0] = float("nan")  # a dropped sample's row is never read
    if pad >= 0:
        ids[:, ::2] = pad
        G.masked_fill_((ids == pad).unsqueeze(-1), float("nan"))
    self0 = torch.randn(v, d, generator=g)
    want = embedding_sums_reference(self0, ids, G, scale, pad)
    assert torch.isfinite(want).all()
    got = self0.to(device, copy=True)
    ops._add_embedding_sums_(got, ids.to(device), G.to(device), scale.to(device), pad)
    assert torch.equal(got.cpu(), want)
    wide = torch.zeros(v, d, 2, device=device)
    wide[..., 0] = self0.to(device)
    ops._add_embedding_sums_(wide[..., 0], ids.to(device), G.to(device), scale.to(device), pad)
    assert torch.equal(wide[..., 0].cpu(), want) and torch.count_nonzero(wide[..., 1]) == 0


@device_param
def test_add_embedding_sums_checks_ids_and_writes_nothing_for_no_samples(device):
    self0 = torch.randn(4, 3, device=device)
    got = self0.clone()
    version = got._version
    ops._add_embedding_sums_(got, torch.zeros(0, 5, dtype=torch.long, device=device),
                             torch.zeros(0, 5, 3, device=device), torch.zeros(0, device=device), -1)
    assert torch.equal(got, self0) and got._version > version  # an in-place write, nothing added
    with pytest.raises(RuntimeError, match=r"G must be \[B, T, d\] with ids' \[B, T\] = \[2, 5\], "
                       r"got \[2, 4, 3\]"):
        ops._add_embedding_sums_(got, torch.zeros(2, 5, dtype=torch.long, device=device),
                                 torch.zeros(2, 4, 3, device=device), torch.ones(2, device=device),
                                 -1)
    with pytest.raises(RuntimeError, match="self shares memory with ids, G or scale"):
        G = torch.zeros(2, 4, 3, device=device)
        ops._add_embedding_sums_(G[0], torch.zeros(2, 4, dtype=torch.long, device=device), G,
                                 torch.ones(2, device=device), -1)
    if device == "cpu":  # on a device the forward's lookup has refused it (Note [embedding sums])
        bad = torch.tensor([[0, 1], [4, 2]])
        with pytest.raises(RuntimeError, match=r"ids must be in \[0, V\) = \[0, 4\), got 4 "
                           r"\(sample 1, token 0\)"):
            ops._add_embedding_sums_(got, bad, torch.ones(2, 2, 3), torch.ones(2), -1)


@device_param
def test_embedding_sample_of_only_padding_has_zero_norm(device):
    ids = torch.tensor([[2, 2, 2], [1, 2, 1]], device=device)
    G = rand((2, 3, 4), torch.float32, device, 24)
    for method in (GHOST, DIRECT):
        got = ops.embedding_sq_norms(ids, G, 3, 2, method)
        assert got[0].item() == 0.0
        want = with_margin((G[1, 0] + G[1, 2]).pow(2).sum().double().cpu(),
                           (G[1, 0].norm() + G[1, 2].norm()).double().cpu(), 3)
        torch.testing.assert_close(got[1].double().cpu(), want, rtol=1e-6, atol=1e-6)


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


# ---- layers sharing one input (Note [shared inputs]) ----------------------------------------------


@device_param
@method_param
def test_shared_input_norms_equal_each_layers_own(device, method):
    # Query/key/value-like layers on one A, plus a wide one and a [B, d] one (T = 1).
    A = rand((4, 70, 24), torch.float32, device, 40)
    Gs = [rand((4, 70, d), torch.float32, device, 41 + d) for d in (24, 24, 96, 3)]
    got = ops.linear_sq_norms_multi(A, Gs, method)
    assert got.shape == (4, 4) and got.dtype == torch.float32
    for l, G in enumerate(Gs):
        assert torch.equal(got[l], ops.linear_sq_norms(A, G, False, method)), l
        gw, _ = per_sample_linear(A, G)
        assert_close(got[l], with_margin(sq_norms_of(gw), *linear_s(A, G)), torch.float32)
    A1 = rand((5, 6), torch.float32, device, 50)
    G1 = [rand((5, 4), torch.float32, device, 51), rand((5, 9), torch.float32, device, 52)]
    got1 = ops.linear_sq_norms_multi(A1, G1, method)
    for l, G in enumerate(G1):
        assert torch.equal(got1[l], ops.linear_sq_norms(A1, G, False, method))


@device_param
def test_shared_input_norms_check_every_gradient(device):
    A = rand((3, 5, 4), torch.float32, device, 60)
    with pytest.raises(RuntimeError, match="G must hold at least one tensor"):
        ops.linear_sq_norms_multi(A, [])
    with pytest.raises(RuntimeError, match="linear_sq_norms_multi"):
        ops.linear_sq_norms_multi(A, [rand((3, 5, 2), torch.float32, device, 61),
                                      rand((3, 6, 2), torch.float32, device, 62)])


# ---- kept per-sample gradients (Note [kept per-sample gradients]) ----------------------------------


@device_param
@dtype_param
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_kept_per_sample_gradients_match_torch_func(device, dtype, rms, shape):
    eps = 1e-5
    x = rand(shape, dtype, device, 33, scale=3.0)
    G = rand(shape, dtype, device, 34)
    gw, gb = per_sample_norm_layer(x, G, eps, rms)
    grads_w, sq_w = ops.layer_norm_per_sample(x, G, eps, rms)
    grads_b, sq_b = ops.bias_per_sample(G)
    assert grads_w.dtype == grads_b.dtype == torch.float64
    torch.testing.assert_close(f64(grads_w), gw, rtol=1e-12, atol=1e-12 * gw.abs().max().item())
    torch.testing.assert_close(f64(grads_b).view_as(gb), gb, rtol=1e-12,
                               atol=1e-12 * gb.abs().max().item())
    assert_close(sq_w, sq_norms_of(gw), dtype)
    assert_close(sq_b, sq_norms_of(gb), dtype)
    # The kept rows' certified norms are the norm ops' (same float64 pass, same bound).
    assert torch.equal(sq_w, ops.layer_norm_sq_norms(x, G, eps, rms, False))
    assert torch.equal(sq_b, ops.bias_sq_norms(G))
    scale = random_scale(shape[0], device, 35)
    assert_close(ops.per_sample_clipped_sum(grads_w, scale), weighted_sum(gw, scale), dtype)
    assert_close(ops.per_sample_clipped_sum(grads_b, scale), weighted_sum(gb, scale).flatten(),
                 dtype)


@device_param
def test_per_sample_clipped_sum_drops_nan_rows_and_checks_arguments(device):
    grads = torch.tensor([[1.0, 2.0], [float("nan"), 5.0], [3.0, float("inf")]],
                         dtype=torch.float64, device=device)
    scale = torch.tensor([0.5, 0.0, float("nan")], device=device)
    out = ops.per_sample_clipped_sum(grads, scale)
    assert out.dtype == torch.float32
    assert torch.equal(out.cpu(), torch.tensor([0.5, 1.0]))  # only sample 0 counts
    with pytest.raises(RuntimeError, match=r"scale must be \[B\] = \[3\], got shape \[2\]"):
        ops.per_sample_clipped_sum(grads, scale[:2])
    # B = 0 (found by a review: the host loop returned uninitialised memory): exact zeros.
    for shape in [(0, 1000), (0, 4, 5)]:
        empty = ops.per_sample_clipped_sum(torch.zeros(shape, dtype=torch.float64, device=device),
                                           torch.zeros(0, device=device))
        assert empty.shape == shape[1:] and torch.equal(empty.cpu(), torch.zeros(shape[1:]))
    with pytest.raises(RuntimeError, match="grads must be float64 or float32, got Half"):
        ops.per_sample_clipped_sum(grads.half(), scale)


@device_param
@pytest.mark.parametrize("b", [5, 70])  # one chunk of samples, and three (Note [kept sums in chunks])
def test_the_list_of_kept_sums_gives_each_pair_the_single_ops_bits(device, b):
    # dpzero::_add_per_sample_clipped_sums_ against the single op pair by pair (the same bits),
    # and the single op against the float64 sum of the kept samples written out here. 53 pairs:
    # more than one launch holds on a GPU; float64 and float32 rows, an empty pair, a strided self.
    g = torch.Generator().manual_seed(61)
    sizes = [(3,), (0,), (2, 5), (300,), (1,), (7, 3)] * 8 + [(1000,)] * 5
    grads = [torch.randn((b,) + s, generator=g, dtype=torch.float64) * 2 for s in sizes]
    grads = [x.float() if k % 3 == 1 else x for k, x in enumerate(grads)]
    grads[3][2, 7] = float("nan")  # a dropped sample's row is never read
    scale = torch.rand(b, generator=g)
    scale[2], scale[4] = 0.0, float("inf")
    starts = [torch.randn(s, generator=g) for s in sizes]
    wide = torch.zeros(sizes[3][0], 2)
    selves = [x.clone().to(device) for x in starts]
    selves[3] = wide.to(device)[:, 0]
    selves[3].copy_(starts[3].to(device))
    on = [x.to(device) for x in grads]
    ops._add_per_sample_clipped_sums_(selves, on, scale.to(device))
    kept = [i for i in range(b) if i not in (2, 4)]
    for k, (self, start) in enumerate(zip(selves, starts)):
        one = start.clone().to(device)
        ops.add_per_sample_clipped_sum_(one, on[k], scale.to(device))
        assert torch.equal(self.cpu(), one.cpu()), k
        want = (scale[kept].double().view(-1, *[1] * len(sizes[k]))
                * grads[k][kept].double()).sum(0)
        torch.testing.assert_close(one.cpu().double() - start.double(), want, rtol=1e-6,
                                   atol=1e-6)


def test_the_list_of_kept_sums_refuses_exactly_the_pairs_that_share_memory():
    # Its one sweep over sorted byte spans against every two tensors compared here: a self may
    # share memory with no other self and no grads; grads may share memory with grads.
    g = torch.Generator().manual_seed(63)
    buf = torch.zeros(200)

    def span(x):
        first = x.storage_offset()
        last = first + sum((n - 1) * st for n, st in zip(x.shape, x.stride()))
        return first, last + 1

    def meet(x, y):
        if x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr():
            return False
        (a0, a1), (b0, b1) = span(x), span(y)
        return a0 < b1 and b0 < a1

    def piece(n):  # [n] or a [3, n] view of buf, contiguous or every other row of a wider one
        start = int(torch.randint(0, 200 - 6 * n, (1,), generator=g))
        if n == 0:
            return buf[start:start]
        return buf[start:start + 6 * n].view(6, n)[::2] if torch.rand(1, generator=g) < 0.5 \
            else buf[start:start + 3 * n].view(3, n)

    refused = 0
    for _ in range(300):
        k = int(torch.randint(2, 6, (1,), generator=g))
        sizes = [int(torch.randint(1, 9, (1,), generator=g)) for _ in range(k)]
        grads = [piece(n) for n in sizes]
        selves = [piece(n)[0].clone() if torch.rand(1, generator=g) < 0.5 else piece(n)[0]
                  for n in sizes]
        clash = any(meet(selves[i], selves[j]) for i in range(k) for j in range(i + 1, k)) or \
            any(meet(selves[i], grads[j]) for i in range(k) for j in range(k))
        try:
            ops._add_per_sample_clipped_sums_(selves, grads, torch.ones(3))
        except RuntimeError as e:
            assert clash and "shares memory with" in str(e), str(e)
            refused += 1
        else:
            assert not clash
    assert 30 < refused < 270  # both outcomes drawn often
    # A self inside a long grads span that a shorter grads span begins in first: only the span
    # reaching furthest, not the one sorted just before, meets it.
    selves = [torch.zeros(30), buf[60:62]]
    grads = [buf[0:90].view(3, 30), buf[10:16].view(3, 2)]
    with pytest.raises(RuntimeError, match=r"self\[1\] shares memory with grads\[0\]"):
        ops._add_per_sample_clipped_sums_(selves, grads, torch.ones(3))


@device_param
def test_kept_sums_past_65535_chunks_give_the_cpus_bits(device):
    # More chunks of 32 samples than a CUDA grid's y dimension holds (65535): its blocks sum the
    # chunks past the limit in turn, with the CPU kernel's bits (the op refused B > 2,097,120).
    b = 65536 * 32 + 5
    g = torch.Generator().manual_seed(62)
    grads = [torch.randn(b, 3, generator=g, dtype=torch.float64), torch.randn(b, 1, generator=g)]
    scale = torch.rand(b, generator=g)
    scale[::7] = 0.0
    starts = [torch.randn(3, generator=g), torch.randn(1, generator=g)]
    want = [x.clone() for x in starts]
    ops._add_per_sample_clipped_sums_(want, grads, scale)
    got = [x.clone().to(device) for x in starts]
    ops._add_per_sample_clipped_sums_(got, [x.to(device) for x in grads], scale.to(device))
    for k in range(2):
        assert torch.equal(got[k].cpu(), want[k]), k
        exact = (scale.double().unsqueeze(1) * grads[k].double()).sum(0)
        torch.testing.assert_close(want[k].double() - starts[k].double(), exact, rtol=1e-5,
                                   atol=1e-4)


@device_param
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d_in,d_out", [(3, 5), (5, 3)], ids=["scale-A", "scale-G"])
def test_linear_clipped_sum_zeroes_dropped_rows(device, dtype, d_in, d_out):
    # A dropped sample's rows are set to zero, never multiplied by its factor (a NaN or inf in its
    # A or G would reach the sum); which operand carries the factors depends on the widths (Note
    # [host factors] on the CPU). Reference: the kept samples' per-sample gradients.
    A = rand((4, 2, d_in), dtype, device, 150)
    G = rand((4, 2, d_out), dtype, device, 151)
    A[1, 0, 0], G[2, 1, 1], A[3, 1, 2] = float("nan"), float("inf"), float("nan")
    scale = torch.tensor([0.5, 0.0, float("nan"), float("inf")], device=device)
    gw, _ = per_sample_linear(A[:1], G[:1])
    want = 0.5 * gw[0]
    for transposed in (False, True):
        got = ops.linear_clipped_sum(A, G, scale, transposed)
        assert_close(got, want.t() if transposed else want, dtype)
        buf = torch.ones(d_in * d_out + 2, device=device)
        ops.add_linear_clipped_sum_(slot_of(buf, 1, got.shape), A, G, scale, transposed)
        assert_close(buf[1:-1].view(got.shape) - 1, want.t() if transposed else want, dtype)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [1, 1]], device=device)
    got = ops.embedding_clipped_sum(ids, G, scale, 3)
    want_e = torch.zeros(3, d_out, dtype=torch.float64)  # the reference lives on the CPU (f64)
    want_e.index_add_(0, ids[0].cpu(), 0.5 * f64(G[0]))
    assert_close(got, want_e, dtype)


# ---- in-place clipped sums (Note [accumulating clipped sums]) ------------------------------------


def slot_of(flat, offset, shape):
    """A parameter's slot in a flat buffer, as the clipping book hands it to the in-place ops."""
    n = math.prod(shape)
    return flat[offset:offset + n].view(shape)


@device_param
@dtype_param
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
def test_add_linear_clipped_sum_adds_into_a_buffer_slot(device, dtype, transposed):
    # The accumulator is a slot in the middle of a flat buffer that already holds a gradient (a
    # previous micro-batch's): the op adds the weighted per-sample sum there and touches nothing
    # outside the slot. Reference: torch.func per-sample gradients, weighted in float64.
    A = rand((4, 6, 5), dtype, device, 30)
    G = rand((4, 6, 3), dtype, device, 31)
    scale = random_scale(4, device, 32)  # sample 1 dropped
    gw, _ = per_sample_linear(A, G, transposed=transposed)
    flat = rand((40,), torch.float32, device, 33)
    before = flat.clone()
    shape = (5, 3) if transposed else (3, 5)
    out = ops.add_linear_clipped_sum_(slot_of(flat, 7, shape), A, G, scale, transposed)
    assert out.data_ptr() == flat[7:].data_ptr()  # the slot itself, returned
    assert_close(slot_of(flat, 7, shape), f64(slot_of(before, 7, shape)) + weighted_sum(gw, scale),
                 dtype)
    assert torch.equal(flat[:7], before[:7]) and torch.equal(flat[22:], before[22:])


@device_param
def test_add_embedding_clipped_sum_adds_into_a_buffer_slot(device):
    V, d, pad = 7, 4, 2
    ids, G = emb_inputs((3, 5), V, d, torch.float32, device, 34, pad)
    scale = random_scale(3, device, 35)
    want = weighted_sum(per_sample_embedding(ids, G, V, pad), scale)
    flat = rand((V * d + 3,), torch.float32, device, 36)
    before = flat.clone()
    ops.add_embedding_clipped_sum_(slot_of(flat, 3, (V, d)), ids, G, scale, V, pad)
    got = slot_of(flat, 3, (V, d))
    assert_close(got, f64(slot_of(before, 3, (V, d))) + want, torch.float32)
    assert torch.equal(got[pad], slot_of(before, 3, (V, d))[pad])  # the padding row: nothing added
    assert torch.equal(flat[:3], before[:3])


@device_param
def test_in_place_clipped_sums_check_the_accumulator(device):
    A, G = rand((2, 3, 4), torch.float32, device, 37), rand((2, 3, 5), torch.float32, device, 38)
    ids = torch.tensor([[0, 1, 2], [2, 2, 1]], device=device)
    scale = torch.ones(2, device=device)
    with pytest.raises(RuntimeError, match=r"add_linear_clipped_sum_: self \(the accumulator\) "
                       r"must have shape \[5, 4\], got \[4, 5\]"):
        ops.add_linear_clipped_sum_(torch.zeros(4, 5, device=device), A, G, scale)
    with pytest.raises(RuntimeError, match=r"self \(the accumulator\) must be float32, got Double"):
        ops.add_linear_clipped_sum_(torch.zeros(5, 4, dtype=torch.float64, device=device), A, G,
                                    scale)
    with pytest.raises(RuntimeError, match=r"add_embedding_clipped_sum_: self \(the accumulator\) "
                       r"must have shape \[3, 5\], got \[3, 4\]"):
        ops.add_embedding_clipped_sum_(torch.zeros(3, 4, device=device), ids, G, scale, 3)
    if device != "cpu":
        with pytest.raises(RuntimeError, match="self is on cpu but A is on"):
            ops.add_linear_clipped_sum_(torch.zeros(5, 4), A, G, scale)


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
    weight = conv_weight_bound(x, G, gw, k, s, p, dil, groups)
    assert_close(ops.conv_sq_norms(x, G, k, s, p, dil, groups, False, method), weight, dtype)
    assert_close(
        ops.conv_sq_norms(x, G, k, s, p, dil, groups, True, method), weight + sq_norms_of(gb),
        dtype
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
    # Sensitivity (design.md §3): any one sample's clipped weight + bias gradient has norm <= C
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
    with pytest.raises(RuntimeError, match=r"max_norm must be at least 2\^-64 \(Note \[smallest "
                       r"clip norm\]\), got 1e-42"):
        ops.linear_clip(A, G, 1e-42, "flat")
    with pytest.raises(RuntimeError, match=r"mode must be 'flat' or 'automatic', got 'clamp'"):
        ops.linear_clip(A, G, 1.0, "clamp")
    for method in (GHOST, DIRECT):  # checked before any work, even for an empty micro-batch
        with pytest.raises(RuntimeError, match=r"max_norm must be finite and > 0, got 0"):
            ops.linear_clip(A[:0], G[:0], 0.0, "flat", GAMMA, False, False, method)


# ---- certified norms (Note [certified norms]) ----------------------------------------------------
# Inputs whose per-sample sums cancel: every row a_t of a sample is one shared row, and
# g_t = sign_t * (one shared row) + 5e-4 * noise with exactly as many +1 as -1 signs, so
# sum_t g_t a_t^T is ~10^4 times smaller than sum_t ||g_t|| ||a_t||. In float32 the ghost norm of
# such a sample came out anywhere between 0.05x and 3x the exact value (and the direct paths a few
# 1e-5 low): a clipped contribution up to ~4 C. And inputs at the ends of float32's range (~1e-25
# times ~1e17), where a float32 Gram of the tiny operand underflows to 0: norm 0, factor 1.


def balanced_signs(b, t, gen):
    """[b, t, 1] float64 of +-1, half of each per sample, shuffled: sum_t sign_t = 0 (t even)."""
    signs = torch.ones(b, t, 1, dtype=torch.float64)
    signs[:, t // 2 :] = -1
    perm = torch.stack([torch.randperm(t, generator=gen) for _ in range(b)])
    return torch.gather(signs, 1, perm.unsqueeze(-1))


def cancelling_rows(b, t, d, gen, shared=None):
    """[b, t, d] float64: sign_t * (a shared row per sample) + 5e-4 * noise."""
    row = torch.randn(b, 1, d, generator=gen, dtype=torch.float64) if shared is None else shared
    noise = torch.randn(b, t, d, generator=gen, dtype=torch.float64)
    return balanced_signs(b, t, gen) * row + 5e-4 * noise


def check_certified(sq, factors, true_sq, c, label="", bound=None):
    """The reported sq norms bound the exact ones from above, and no clipped contribution exceeds
    C: factor * exact norm <= C (1 + 1e-6). ``bound``: the certified value with the clipped sum's
    margin (with_margin), which the norms stay within 1 % of (default: the exact one)."""
    sq, factors = f64(sq), f64(factors)
    assert (sq >= true_sq).all(), (label, (sq / true_sq).tolist())
    # And stays tight, where float32 can represent it (a norm^2 below float32's smallest normal
    # comes back as a subnormal rounded up).
    bound = true_sq if bound is None else bound
    normal = true_sq > 1e3 * torch.finfo(torch.float32).tiny
    assert (sq[normal] <= bound[normal] * 1.01).all(), (label, (sq / bound).tolist())
    contribution = factors * true_sq.sqrt()
    assert (contribution <= c * (1 + 1e-6)).all(), (label, (contribution / c).tolist())


def clip_threshold(true_sq):
    return 0.5 * true_sq.sqrt().min().item()  # every sample is clipped


@device_param
@method_param
def test_certified_norms_linear_cancelling_rows(device, method):
    # T = 128, d = 256: auto takes the ghost path (2 T^2 <= d_in d_out).
    gen = torch.Generator().manual_seed(90)
    b, t, d = 4, 128, 256
    A = torch.randn(b, 1, d, generator=gen, dtype=torch.float64).expand(b, t, d)
    G = cancelling_rows(b, t, d, gen)
    A, G = A.float().to(device), G.float().to(device)
    gw, gb = per_sample_linear(A, G)
    true_sq = sq_norms_of(gw, gb)
    bound = with_margin(sq_norms_of(gw), *linear_s(A, G)) + sq_norms_of(gb)
    c = clip_threshold(true_sq)
    _, _, sq, factors, nonfinite = ops.linear_clip(A, G, c, "flat", GAMMA, True, False, method)
    assert nonfinite.item() == 0
    # (the fused direct path sums the very per-sample gradients it certified: no margin there)
    check_certified(sq, factors, true_sq, c, "linear_clip", bound)
    check_certified(ops.linear_sq_norms(A, G, True, method), factors, true_sq, c, "sq_norms",
                    bound)
    _, gb_only = per_sample_linear(A, G)
    assert (f64(ops.bias_sq_norms(G)) >= sq_norms_of(gb_only)).all()


@device_param
@pytest.mark.parametrize("t", [16, 128, 300])
def test_certified_norms_shared_input_where_the_margin_is_the_bound(device, t):
    # Note [shared inputs] on rows that cancel to float32's rounding of them: each sample's exact
    # norm is far below the float64 rounding of its Gram sum, so only the certified margin keeps
    # each layer's value an upper bound. linear_sq_norms_multi (T = 16: Note [small ghost], its
    # certification fused into one host loop; T = 128: the GEMM path) must bound every layer's
    # exact norm, each with its own width's margin, bit-equal to the layer's own linear_sq_norms.
    # T = 300: CUDA's float64 GEMM Gram strips (Note [ghost roofline]).
    gen = torch.Generator().manual_seed(92)
    b, d = 4, 48
    A = torch.randn(b, 1, d, generator=gen, dtype=torch.float64).expand(b, t, d)
    Gs = []
    for d_out in (40, 96, 3):
        row = torch.randn(b, 1, d_out, generator=gen, dtype=torch.float64)
        noise = torch.randn(b, t, d_out, generator=gen, dtype=torch.float64)
        Gs.append(balanced_signs(b, t, gen) * row + 1e-6 * noise)
    A, Gs = A.float().to(device), [G.float().to(device) for G in Gs]
    got = ops.linear_sq_norms_multi(A, Gs, GHOST)
    for l, G in enumerate(Gs):
        gw, _ = per_sample_linear(A, G)
        true_sq = sq_norms_of(gw)
        assert (f64(got[l]) >= true_sq).all(), (l, (f64(got[l]) / true_sq).tolist())
        assert torch.equal(got[l], ops.linear_sq_norms(A, G, False, GHOST)), l


@device_param
@method_param
@pytest.mark.parametrize("tiny", ["A", "G"])
def test_certified_norms_linear_tiny_and_huge_scales(device, method, tiny):
    # A ~ 7e-25 and G ~ 5e17 (or the other way round): the tiny operand's float32 Gram entries
    # (~5e-49) underflow to 0. T = 32, d = 64: auto takes the ghost path.
    gen = torch.Generator().manual_seed(91)
    small = 7e-25 * torch.randn(3, 32, 64, generator=gen, dtype=torch.float64)
    large = 5e17 * torch.randn(3, 32, 64, generator=gen, dtype=torch.float64)
    A, G = (small, large) if tiny == "A" else (large, small)
    A, G = A.float().to(device), G.float().to(device)
    gw, _ = per_sample_linear(A, G)
    true_sq = sq_norms_of(gw)
    c = clip_threshold(true_sq)
    _, _, sq, factors, nonfinite = ops.linear_clip(A, G, c, "flat", GAMMA, False, False, method)
    assert nonfinite.item() == 0
    check_certified(sq, factors, true_sq, c)


@device_param
@method_param
def test_certified_norms_embedding_repeated_token(device, method):
    # One token repeated (plus padding tokens), G rows cancelling: the sample's single gradient row
    # sum_t g_t is tiny next to sum_t ||g_t||. T = 64, V = 100, d = 256: auto takes the ghost path
    # on CUDA, the direct one on the CPU (Note [embedding rows]).
    gen = torch.Generator().manual_seed(92)
    b, t, d, v, pad = 4, 64, 256, 100, 0
    ids = torch.full((b, t + 8), 7)
    ids[:, t:] = pad  # padding tokens, whose G rows are large and must be ignored
    padding_rows = 1e3 * torch.ones(b, 8, d, dtype=torch.float64)
    G = torch.cat([cancelling_rows(b, t, d, gen), padding_rows], 1)
    ids, G = ids.to(device), G.float().to(device)
    true_sq = sq_norms_of(per_sample_embedding(ids, G, v, pad))
    c = clip_threshold(true_sq)
    _, sq, factors, nonfinite = ops.embedding_clip(ids, G, v, c, "flat", GAMMA, pad, method)
    assert nonfinite.item() == 0
    check_certified(sq, factors, true_sq, c, bound=with_margin(true_sq, *embedding_s(ids, G, pad)))


@device_param
@method_param
def test_certified_norms_embedding_tiny_scale(device, method):
    gen = torch.Generator().manual_seed(93)
    ids = torch.randint(0, 5, (3, 16), generator=gen).to(device)
    G = (7e-25 * torch.randn(3, 16, 64, generator=gen, dtype=torch.float64)).float().to(device)
    true_sq = sq_norms_of(per_sample_embedding(ids, G, 5, None))
    # A clip norm at these norms' scale (~1e-23) is below 2^-64 and refused (Note [smallest clip
    # norm]), so the clip runs at the smallest one; the norms must still bound the exact ones.
    with pytest.raises(RuntimeError, match="max_norm must be at least 2\\^-64"):
        ops.embedding_clip(ids, G, 5, clip_threshold(true_sq), "flat", GAMMA, None, method)
    c = 2.0**-64
    _, sq, factors, _ = ops.embedding_clip(ids, G, 5, c, "flat", GAMMA, None, method)
    check_certified(sq, factors, true_sq, c)


@device_param
@method_param
def test_certified_norms_conv_cancelling_positions(device, method):
    # A spatially constant input makes every unfolded patch the same row; G alternates in sign
    # over the 256 output positions. Auto takes the direct path here (2 L^2 > C_in K C_out).
    gen = torch.Generator().manual_seed(94)
    b, c_in, c_out, k, length = 4, 16, 64, 3, 258
    x = torch.randn(b, c_in, 1, generator=gen, dtype=torch.float64).expand(b, c_in, length)
    G = cancelling_rows(b, length - k + 1, c_out, gen).transpose(1, 2)
    x, G = x.float().to(device), G.float().to(device)
    gw, gb = per_sample_conv(x, G, (c_out, c_in, k), [1], [0], [1], 1)
    true_sq = sq_norms_of(gw, gb)
    bound = conv_weight_bound(x, G, gw, [k], [1], [0], [1], 1) + sq_norms_of(gb)
    c = clip_threshold(true_sq)
    res = ops.conv_clip(x, G, [k], [1], [0], [1], 1, c, "flat", GAMMA, True, method)
    assert res[-1].item() == 0
    if method != AUTO:
        check_certified(res[2], res[3], true_sq, c, bound=bound)
        return
    # Auto keeps the per-sample gradients as float32 rows (Note [kept conv gradients]): what is
    # certified, and added, is those rows, within float32 rounding of the exact gradient. So
    # each sample's contribution, clipped alone, is measured itself.
    assert ((f64(res[2]) - true_sq).abs() <= 1e-3 * true_sq).all(), (f64(res[2]) / true_sq)
    for i in range(b):
        gw_i, gb_i = ops.conv_clip(x[i:i + 1], G[i:i + 1], [k], [1], [0], [1], 1, c, "flat",
                                   GAMMA, True, method)[:2]
        added = torch.cat([f64(gw_i).flatten(), f64(gb_i).flatten()]).norm()
        assert added <= c * (1 + 1e-6), (added / c).item()


@device_param
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_certified_norms_layer_norm_cancelling_positions(device, rms):
    gen = torch.Generator().manual_seed(95)
    b, t, d = 3, 64, 32
    x = torch.randn(b, 1, d, generator=gen, dtype=torch.float64).expand(b, t, d)
    G = cancelling_rows(b, t, d, gen)
    x, G = x.float().to(device), G.float().to(device)
    gw, gb = per_sample_norm_layer(x, G, 1e-5, rms)
    true_sq = sq_norms_of(gw, gb)
    c = clip_threshold(true_sq)
    res = ops.layer_norm_clip(x, G, 1e-5, c, "flat", GAMMA, rms, True)
    check_certified(res[2], res[3], true_sq, c)


@device_param
def test_certified_norms_zero_gradient_stays_zero(device):
    # The margin is proportional to sum_t ||a_t|| ||g_t||: an all-zero gradient reports exactly 0.
    A = rand((2, 40, 6), torch.float32, device, 96)
    G = torch.zeros(2, 40, 5, device=device)
    for method in (GHOST, DIRECT):
        assert torch.equal(ops.linear_sq_norms(A, G, True, method), torch.zeros(2, device=device))


# ---- float32 matmul precision (Note [fp32 matmul precision]) -------------------------------------


def precision_state():
    """The matmul precision settings as Python reports them ('error' where torch refuses)."""

    def get(f):
        try:
            return f()
        except RuntimeError:
            return "error"

    return (
        get(torch.get_float32_matmul_precision),
        get(lambda: torch.backends.cuda.matmul.fp32_precision),
        get(lambda: torch.backends.mkldnn.matmul.fp32_precision),
        get(lambda: torch.backends.cuda.matmul.allow_tf32),
    )


def reset_precision():
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.fp32_precision = "none"
    torch.backends.mkldnn.matmul.fp32_precision = "none"


PRECISION_SETUPS = {
    "high": lambda: torch.set_float32_matmul_precision("high"),
    "medium": lambda: torch.set_float32_matmul_precision("medium"),
    "allow_tf32": lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
    "cuda_tf32_new_api": lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
    "mkldnn_bf16_new_api": lambda: setattr(torch.backends.mkldnn.matmul, "fp32_precision", "bf16"),
}


@device_param
@pytest.mark.parametrize("setup", list(PRECISION_SETUPS))
def test_ops_run_ieee_fp32_matmuls_and_restore_the_setting(device, setup):
    # With TF32 (CUDA) or bf16 (oneDNN, "medium") float32 matmuls, the clipped sums would be off
    # by ~1e-3; the ops force IEEE float32 for their duration and leave the setting as found.
    A = rand((8, 64, 96), torch.float32, device, 97)
    G = rand((8, 64, 80), torch.float32, device, 98)
    scale = random_scale(8, device, 99)
    x, Gc, w_shape = conv_inputs(CONV_CASES[3], torch.float32, device, 100)
    _, _, k, s, p, dil, groups = CONV_CASES[3]
    conv_scale = random_scale(x.shape[0], device, 101)

    def run():
        return [
            ops.linear_clipped_sum(A, G, scale),
            ops.linear_clipped_sum(A, G, scale, True),
            ops.linear_clip(A, G, C, "flat", GAMMA, True, False, DIRECT)[0],
            ops.linear_clip(A, G, C, "flat", GAMMA, True, False, GHOST)[0],
            ops.conv_clipped_sum(x, Gc, conv_scale, k, s, p, dil, groups),
        ]

    reset_precision()
    want = run()
    try:
        PRECISION_SETUPS[setup]()
        before = precision_state()
        got = run()
        assert precision_state() == before
    finally:
        reset_precision()
    gw, _ = per_sample_linear(A, G)
    assert_close(got[0], weighted_sum(gw, scale), torch.float32)
    assert_close(got[1], weighted_sum(gw, scale).transpose(0, 1), torch.float32)
    gcw, _ = per_sample_conv(x, Gc, w_shape, s, p, dil, groups)
    assert_close(got[4], weighted_sum(gcw, conv_scale), torch.float32)
    if device == "cpu":  # same BLAS calls as under "highest", bit for bit
        for g, w in zip(got, want):
            assert torch.equal(g, w)


# ---- chunk boundaries ----------------------------------------------------------------------------
# dpzero::_set_chunk_bytes replaces the 64 MiB chunk budget. B = 7 is prime, and doubling the budget
# from 64 bytes to 64 MiB takes every loop's chunk size through 1 and then through 2 or 3 (when
# budget / bytes_per_sample goes from [1, 2) to [2, 4)), so each loop runs with a short last chunk.

CHUNK_BUDGETS = [2**k for k in range(6, 27)]


@contextlib.contextmanager
def chunk_budget(nbytes):
    prev = ops._set_chunk_bytes(nbytes)
    try:
        yield
    finally:
        ops._set_chunk_bytes(prev)


def test_set_chunk_bytes_returns_the_previous_budget():
    prev = ops._set_chunk_bytes(1000)
    try:
        assert prev == 64 << 20
        assert ops._set_chunk_bytes(2000) == 1000
    finally:
        ops._set_chunk_bytes(prev)
    with pytest.raises(RuntimeError, match=r"bytes must be >= 1, got 0"):
        ops._set_chunk_bytes(0)


@device_param
def test_chunk_boundaries_linear(device):
    A = rand((7, 5, 6), torch.float32, device, 101)
    G = rand((7, 5, 4), torch.float32, device, 102)
    scale = random_scale(7, device, 103)
    gw, gb = per_sample_linear(A, G)
    sq = sq_norms_of(gw, gb)
    for budget in CHUNK_BUDGETS:
        with chunk_budget(budget):
            for method in (GHOST, DIRECT):
                assert_close(ops.linear_sq_norms(A, G, True, method), sq, torch.float32)
                res = ops.linear_clip(A, G, C, "flat", GAMMA, True, False, method)
                check_fused(res, (gw, gb), "flat", torch.float32, with_bias_grad=True)
            assert_close(
                ops.linear_clipped_sum(A, G, scale), weighted_sum(gw, scale), torch.float32
            )
            assert_close(ops.bias_clipped_sum(G, scale), weighted_sum(gb, scale), torch.float32)


@device_param
def test_chunk_boundaries_embedding(device):
    ids, G = emb_inputs((7, 9), 6, 5, torch.float32, device, 104, 0)
    scale = random_scale(7, device, 105)
    per_sample = per_sample_embedding(ids, G, 6, 0)
    for budget in CHUNK_BUDGETS:
        with chunk_budget(budget):
            for method in (GHOST, DIRECT):
                assert_close(
                    ops.embedding_sq_norms(ids, G, 6, 0, method),
                    sq_norms_of(per_sample),
                    torch.float32,
                )
            assert_close(
                ops.embedding_clipped_sum(ids, G, scale, 6, 0),
                weighted_sum(per_sample, scale),
                torch.float32,
            )


@device_param
def test_chunk_boundaries_layer_norm(device):
    x = rand((7, 4, 6), torch.float32, device, 106, scale=2.0)
    G = rand((7, 4, 6), torch.float32, device, 107)
    scale = random_scale(7, device, 108)
    for rms in (False, True):
        gw, gb = per_sample_norm_layer(x, G, 1e-5, rms)
        for budget in CHUNK_BUDGETS:
            with chunk_budget(budget):
                assert_close(
                    ops.layer_norm_sq_norms(x, G, 1e-5, rms, True),
                    sq_norms_of(gw, gb),
                    torch.float32,
                )
                assert_close(
                    ops.layer_norm_clipped_sum(x, G, scale, 1e-5, rms),
                    weighted_sum(gw, scale),
                    torch.float32,
                )


@device_param
def test_chunk_boundaries_conv(device):
    case = ((7, 4, 11), 6, [3], [2], [1], [1], 2)
    _, _, k, s, p, dil, groups = case
    x, G, w_shape = conv_inputs(case, torch.float32, device, 109)
    scale = random_scale(7, device, 110)
    gw, gb = per_sample_conv(x, G, w_shape, s, p, dil, groups)
    for budget in CHUNK_BUDGETS:
        with chunk_budget(budget):
            for method in (GHOST, DIRECT):
                assert_close(
                    ops.conv_sq_norms(x, G, k, s, p, dil, groups, True, method),
                    sq_norms_of(gw, gb),
                    torch.float32,
                )
            assert_close(
                ops.conv_clipped_sum(x, G, scale, k, s, p, dil, groups),
                weighted_sum(gw, scale),
                torch.float32,
            )


# ---- non-finite scales and inputs ----------------------------------------------------------------


def non_finite_scale(b, device, seed):
    s = random_scale(b, device, seed)
    s[1], s[3] = float("nan"), float("inf")
    return s


def finite_part(scale):
    """The scale with NaN/Inf (dropped samples) replaced by 0, for the float64 reference."""
    return torch.where(torch.isfinite(scale), scale, torch.zeros_like(scale))


@device_param
def test_non_finite_scale_drops_the_sample_in_every_clipped_sum(device):
    b = 5
    scale = non_finite_scale(b, device, 111)
    ref_scale = finite_part(scale)
    A = rand((b, 6, 7), torch.float32, device, 112)
    G = rand((b, 6, 4), torch.float32, device, 113)
    gw, gb = per_sample_linear(A, G)
    assert_close(ops.linear_clipped_sum(A, G, scale), weighted_sum(gw, ref_scale), torch.float32)
    assert_close(
        ops.linear_clipped_sum(A, G, scale, True),
        weighted_sum(gw, ref_scale).transpose(0, 1),
        torch.float32,
    )
    assert_close(ops.bias_clipped_sum(G, scale), weighted_sum(gb, ref_scale), torch.float32)
    ids, Ge = emb_inputs((b, 9), 7, 5, torch.float32, device, 114, 0)
    assert_close(
        ops.embedding_clipped_sum(ids, Ge, scale, 7, 0),
        weighted_sum(per_sample_embedding(ids, Ge, 7, 0), ref_scale),
        torch.float32,
    )
    x = rand((b, 4, 6), torch.float32, device, 115)
    gl, _ = per_sample_norm_layer(x, G[..., :4].repeat(1, 1, 2)[:, :4, :6], 1e-5, False)
    assert_close(
        ops.layer_norm_clipped_sum(x, G[..., :4].repeat(1, 1, 2)[:, :4, :6], scale, 1e-5),
        weighted_sum(gl, ref_scale),
        torch.float32,
    )
    case = ((b, 4, 11), 6, [3], [2], [1], [1], 2)
    _, _, k, s, p, dil, groups = case
    xc, Gc, w_shape = conv_inputs(case, torch.float32, device, 116)
    gcw, _ = per_sample_conv(xc, Gc, w_shape, s, p, dil, groups)
    assert_close(
        ops.conv_clipped_sum(xc, Gc, scale, k, s, p, dil, groups),
        weighted_sum(gcw, ref_scale),
        torch.float32,
    )


@device_param
@method_param
def test_fused_clip_drops_samples_with_nan_inputs(device, method):
    # A NaN in sample 1's input (or G) drops sample 1 (factor 0, counted); the others are unchanged.
    keep = [0, 2, 3]

    def check(res, per_sample, bias_grads=None):
        grad_w, sq, factors, nonfinite = res[0], res[-3], res[-2], res[-1]
        assert nonfinite.item() == 1 and factors[1].item() == 0.0
        assert torch.isfinite(grad_w).all()
        want_sq = sq_norms_of(*[g[keep] for g in (per_sample, bias_grads) if g is not None])
        f = ref_factors(want_sq, "flat")
        assert_close(sq[keep], want_sq, torch.float32)
        assert_close(grad_w, weighted_sum(per_sample[keep], f), torch.float32)
        if bias_grads is not None:
            assert_close(res[1], weighted_sum(bias_grads[keep], f), torch.float32)

    ids, G = emb_inputs((4, 9), 7, 5, torch.float32, device, 117, 0)
    G[1, 1] = float("nan")  # token 1 of sample 1 is not padding (every third token is)
    G[2, 0] = float("nan")  # a padding token's row: ignored
    check(
        ops.embedding_clip(ids, G, 7, C, "flat", GAMMA, 0, method),
        per_sample_embedding(ids, G, 7, 0),
    )

    x = rand((4, 5, 6), torch.float32, device, 118)
    Gl = rand((4, 5, 6), torch.float32, device, 119)
    x[1, 2, 3] = float("nan")
    gw, gb = per_sample_norm_layer(x, Gl, 1e-5, False)
    check(ops.layer_norm_clip(x, Gl, 1e-5, C, "flat", GAMMA, False, True), gw, gb)

    case = ((4, 4, 11), 6, [3], [2], [1], [1], 2)
    _, _, k, s, p, dil, groups = case
    xc, Gc, w_shape = conv_inputs(case, torch.float32, device, 120)
    xc[1, 0, 4] = float("inf")
    gw, gb = per_sample_conv(xc, Gc, w_shape, s, p, dil, groups)
    check(ops.conv_clip(xc, Gc, k, s, p, dil, groups, C, "flat", GAMMA, True, method), gw, gb)


@device_param
@method_param
def test_embedding_ignores_nan_in_padding_rows(device, method):
    # Padding tokens get no gradient, so whatever their G rows hold (here NaN) must not reach the
    # norm; on CUDA the token Gram is applied by a select, not a multiply by the 0/1 indicator.
    ids, G = emb_inputs((3, 40), 7, 5, torch.float32, device, 121, 2)
    G[ids == 2] = float("nan")
    want = with_margin(sq_norms_of(per_sample_embedding(ids, G, 7, 2)),
                       *embedding_s(ids, torch.where(ids[..., None] == 2, 0.0, G), 2))
    got = ops.embedding_sq_norms(ids, G, 7, 2, method)
    assert torch.isfinite(got).all()
    assert_close(got, want, torch.float32)


# ---- LayerNorm eps and normalized_ndim -----------------------------------------------------------


@device_param
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_layer_norm_eps_is_applied(device, rms):
    # eps = 0.5 against a variance of ~0.25: dropping or misplacing eps changes the gradients by
    # far more than the tolerance (checked against the reference without eps).
    x = rand((4, 6, 8), torch.float32, device, 122, scale=0.5)
    G = rand((4, 6, 8), torch.float32, device, 123)
    eps = 0.5
    gw, gb = per_sample_norm_layer(x, G, eps, rms)
    gw0, _ = per_sample_norm_layer(x, G, 0.0, rms)
    eps_effect = (sq_norms_of(gw) - sq_norms_of(gw0)).abs().max()
    assert eps_effect > 100 * TOL[torch.float32] * sq_norms_of(gw).max()
    assert_close(ops.layer_norm_sq_norms(x, G, eps, rms, True), sq_norms_of(gw, gb), torch.float32)
    scale = random_scale(4, device, 124)
    assert_close(
        ops.layer_norm_clipped_sum(x, G, scale, eps, rms), weighted_sum(gw, scale), torch.float32
    )
    res = ops.layer_norm_clip(x, G, eps, C, "flat", GAMMA, rms, True)
    check_fused(res, (gw, gb), "flat", torch.float32, with_bias_grad=True)


@device_param
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_layer_norm_multi_dim_normalized_shape(device, rms):
    # nn.LayerNorm((3, 4)) normalises over the last two dims: normalized_ndim=2.
    x = rand((3, 5, 3, 4), torch.float32, device, 125, scale=2.0)
    G = rand((3, 5, 3, 4), torch.float32, device, 126)
    gw, gb = per_sample_norm_layer(x, G, 1e-5, rms, normalized_ndim=2)
    assert_close(
        ops.layer_norm_sq_norms(x, G, 1e-5, rms, True, 2), sq_norms_of(gw, gb), torch.float32
    )
    scale = random_scale(3, device, 127)
    got = ops.layer_norm_clipped_sum(x, G, scale, 1e-5, rms, 2)
    assert got.shape == (3, 4)
    assert_close(got, weighted_sum(gw, scale), torch.float32)
    res = ops.layer_norm_clip(x, G, 1e-5, C, "flat", GAMMA, rms, True, 2)
    assert res[0].shape == res[1].shape == (3, 4)
    check_fused(res, (gw, gb), "flat", torch.float32, with_bias_grad=True)
    with pytest.raises(RuntimeError, match=r"normalized_ndim must be in \[1, input.dim\(\) - 1\]"):
        ops.layer_norm_sq_norms(x, G, 1e-5, rms, False, 4)


# ---- ghost kernel geometry: whole tiles, and more samples than one launch ------------------------


@device_param
@pytest.mark.parametrize("t", [32, 64])
def test_ghost_norm_whole_tiles(device, t):
    # T an exact multiple of the CUDA kernel's 32-row tile (no partial tile).
    A = rand((3, t, 40), torch.float32, device, 128)
    G = rand((3, t, 36), torch.float32, device, 129)
    gw, _ = per_sample_linear(A, G)
    assert_close(ops.linear_sq_norms(A, G, False, GHOST),
                 with_margin(sq_norms_of(gw), *linear_s(A, G)), torch.float32)
    ids, Ge = emb_inputs((3, t), 9, 6, torch.float32, device, 130, 1)
    assert_close(
        ops.embedding_sq_norms(ids, Ge, 9, 1, GHOST),
        with_margin(sq_norms_of(per_sample_embedding(ids, Ge, 9, 1)), *embedding_s(ids, Ge, 1)),
        torch.float32,
    )


@device_param
def test_ghost_norm_more_samples_than_one_grid(device):
    # B = 70000 > 65535 (the CUDA grid's y limit): the kernel is launched in slices of samples.
    b = 70000
    A = rand((b, 1, 3), torch.float32, device, 131)
    G = rand((b, 1, 2), torch.float32, device, 132)
    want = f64(A).square().sum((1, 2)) * f64(G).square().sum((1, 2))  # T = 1: ||g||^2 ||a||^2
    assert_close(ops.linear_sq_norms(A, G, False, GHOST), want, torch.float32)
    ids = torch.randint(0, 4, (b, 1), generator=torch.Generator().manual_seed(133)).to(device)
    assert_close(
        ops.embedding_sq_norms(ids, G, 4, None, GHOST), f64(G).square().sum((1, 2)), torch.float32
    )


def ghost_reference(A, G):
    """<A_i A_i^T, G_i G_i^T> and sum_t ||a_t|| ||g_t|| per sample, in float64 by einsum."""
    a, g = f64(A), f64(G)
    ga, gg = torch.einsum("bsd,btd->bst", a, a), torch.einsum("bsd,btd->bst", g, g)
    return (ga * gg).sum((1, 2)), (a.norm(dim=2) * g.norm(dim=2)).sum(1)


@pytest.mark.parametrize("t", [1, 2, 7, 32, 33])
@pytest.mark.parametrize("d_in,d_out",
                         [(1, 3), (2, 6), (4, 5), (7, 15), (12, 13), (16, 17), (33, 64)])
def test_ghost_raw_values_small_sequences(t, d_in, d_out):
    # Note [small ghost] (kernels/cpu/ghost_norm.cpp): for T <= 32 float32 contiguous rows the CPU
    # kernel forms the Grams itself (AVX2, every d % 8 and d % 4 tail, odd T); T = 33 and a
    # non-contiguous G take the batched-GEMM path. All must give the float64 value and S.
    A = rand((3, t, d_in), torch.float32, "cpu", 140)
    G = rand((3, t, d_out), torch.float32, "cpu", 141)
    want_v, want_s = ghost_reference(A, G)
    strided = rand((3, t, 2 * d_out), torch.float32, "cpu", 141)[:, :, ::2]
    for g in (G, strided):
        v, s_ = torch.ops.dpzero._ghost_sq_norms(A, g)
        rv, rs = ghost_reference(A, g)
        torch.testing.assert_close(v, rv, rtol=1e-12, atol=0)
        torch.testing.assert_close(s_, rs, rtol=1e-12, atol=0)
    v, s_ = torch.ops.dpzero._ghost_sq_norms_multi(A, [G, G[:, :, :1].contiguous()])
    torch.testing.assert_close(v[0], want_v, rtol=1e-12, atol=0)
    torch.testing.assert_close(s_[0], want_s, rtol=1e-12, atol=0)
    v1, s1 = ghost_reference(A, G[:, :, :1])
    torch.testing.assert_close(v[1], v1, rtol=1e-12, atol=0)
    torch.testing.assert_close(s_[1], s1, rtol=1e-12, atol=0)
    # The token Gram (an embedding's one-hot rows), with padding tokens skipped.
    ids = torch.randint(0, 4, (3, t), generator=torch.Generator().manual_seed(142))
    v, s_ = torch.ops.dpzero._token_ghost_sq_norms(ids, G, 1)
    onehot = F.one_hot(ids, 4).double() * (ids != 1).unsqueeze(-1)
    rv, rs = ghost_reference(onehot, G * (ids != 1).unsqueeze(-1))
    torch.testing.assert_close(v, rv, rtol=1e-12, atol=0)
    torch.testing.assert_close(s_, rs, rtol=1e-12, atol=0)


# ---- error messages name the op the caller called ------------------------------------------------


def test_clip_argument_errors_name_the_called_op():
    # The fused ops check the clip arguments themselves (before any work, even for an empty
    # micro-batch), so the message names the op the caller called, not dpzero::clip_factors.
    def calls(b):
        A, G = torch.randn(b, 3, 4), torch.randn(b, 3, 5)
        ids = torch.zeros(b, 3, dtype=torch.long)
        conv_x, conv_g = torch.randn(b, 3, 8), torch.randn(b, 4, 6)
        return {
            "linear_clip": lambda c, m: ops.linear_clip(A, G, c, m),
            "embedding_clip": lambda c, m: ops.embedding_clip(ids, G, 3, c, m),
            "layer_norm_clip": lambda c, m: ops.layer_norm_clip(A, A, 1e-5, c, m),
            "conv_clip": lambda c, m: ops.conv_clip(conv_x, conv_g, [3], [1], [0], [1], 1, c, m),
            "clip_factors": lambda c, m: ops.clip_factors(torch.ones(b), c, m),
        }

    for b in (2, 0):
        for name, call in calls(b).items():
            with pytest.raises(
                RuntimeError, match=rf"dpzero::{name}: max_norm must be finite and > 0, got -1"
            ):
                call(-1.0, "flat")
            with pytest.raises(
                RuntimeError,
                match=rf"dpzero::{name}: clipping mode must be 'flat' or 'automatic', got 'x'",
            ):
                call(1.0, "x")


def test_row_and_ghost_ops_give_exact_zeros_for_samples_without_rows():
    # The CPU kernels write their outputs sample by sample into uninitialised memory; a sample
    # with no rows (T = 0) must still come out as exact zeros, as the sums over an empty set
    # (reference: the empty sum), whatever the allocator handed back. Fill the cache with
    # non-zero garbage first so that a missing initialisation would show.
    for _ in range(4):
        torch.full((64, 64), 7.0, dtype=torch.float64).sum()
    zeros = torch.zeros(3, dtype=torch.float64)
    sums, s = torch.ops.dpzero._row_sums(torch.randn(3, 0, 5))
    assert torch.equal(sums, torch.zeros(3, 5, dtype=torch.float64)) and torch.equal(s, zeros)
    sums, s = torch.ops.dpzero._norm_row_sums(torch.randn(3, 0, 5), torch.randn(3, 0, 5), 1e-5,
                                              False)
    assert torch.equal(sums, torch.zeros(3, 5, dtype=torch.float64)) and torch.equal(s, zeros)
    q, s = torch.ops.dpzero._embedding_rows(torch.zeros(3, 0, dtype=torch.long),
                                            torch.randn(3, 0, 4), 10, -1)
    assert torch.equal(q, zeros) and torch.equal(s, zeros)
    value, norms = torch.ops.dpzero._ghost_sq_norms(torch.randn(3, 0, 8), torch.randn(3, 0, 4))
    assert torch.equal(value, zeros) and torch.equal(norms, zeros)
    # Every token a padding id: nothing of any sample is summed.
    q, s = torch.ops.dpzero._embedding_rows(torch.full((3, 6), 2, dtype=torch.long),
                                            torch.randn(3, 6, 4), 10, 2)
    assert torch.equal(q, zeros) and torch.equal(s, zeros)


@contextlib.contextmanager
def intra_op_threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_cpu_kernels_give_the_same_values_at_every_thread_count():
    # Every CPU kernel with an at::parallel_for splits its work by the intra-op thread count; what
    # it returns must not depend on that split: the noise a rank adds is a function of (seed or
    # key, step, offset) alone (design.md §3 "Noise"), and the checks' fingerprints and the clipped
    # sums are compared across runs and ranks. pytest runs with one thread per worker
    # (scripts/test.sh), so this test sets 1, 2 and 3 threads itself, on inputs long enough for
    # every thread to get a chunk, and checks each against the independent reference too.
    from philox_reference import noise, secure_noise

    key = [0xDEADBEEF, 1, 2, 3, 4, 5, 6, 0xFFFFFFFF]
    A, G = rand((24, 16, 40), torch.float32, "cpu", 41), rand((24, 16, 24), torch.float32, "cpu", 42)
    scale = random_scale(24, "cpu", 43)
    words = [rand((n,), torch.float32, "cpu", 44 + n).view(torch.int32) for n in (5, 70000, 4096)]
    # A Gram-strip shape (T past Note [small ghost]'s rows), a rank-one one (T = 1, B past the
    # kernel's grain) and an embedding's ids with padding.
    A2, G2 = rand((6, 64, 48), torch.float32, "cpu", 45), rand((6, 64, 40), torch.float32, "cpu", 46)
    A1, G1 = rand((2048, 1, 64), torch.float32, "cpu", 47), rand((2048, 1, 8), torch.float32, "cpu", 48)
    ids = torch.randint(0, 5, (24, 16), generator=torch.Generator().manual_seed(49))
    got = {}
    for threads in (1, 2, 3):
        with intra_op_threads(threads):
            x = torch.zeros(1 << 16)
            ops.add_noise_(x, 1.0, 12345, 11, 0)
            y = torch.zeros(1 << 14, dtype=torch.float64)
            ops.add_secure_noise_(y, 1.0, key, 42, 0)
            products = ops._add_sample_products_(torch.zeros(40, 24), A, G, scale)
            got[threads] = dict(
                noise=x, secure=y, products=products,
                ghost=ops._ghost_sq_norms(A, G)[0], rows=ops._row_sums(G)[0],
                strips=ops._ghost_sq_norms(A2, G2)[0], rank_one=ops._ghost_sq_norms(A1, G1)[0],
                tokens=ops._token_ghost_sq_norms(ids, G, 0)[0],
                norm_rows=ops._norm_row_sums(A, A, 1e-5, False)[0],
                scaled=ops._scale_rows(G, scale, True),
                fingerprint=ops._state_fingerprint(words, 7))
    for threads in (2, 3):
        for name, value in got[threads].items():
            assert torch.equal(value, got[1][name]), (name, threads)
    # The last chunk of each noise tensor against the independent generators.
    mine = got[3]
    np.testing.assert_allclose(mine["noise"][-9:].numpy(), noise(12345, 11, (1 << 16) - 9, 9),
                               rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(mine["secure"][-5:].numpy(),
                               secure_noise(key, 42, (1 << 14) - 5, 5), rtol=1e-13, atol=1e-13)
    a64, g64 = f64(A), f64(G)
    per_sample = torch.einsum("bti,bto->bio", a64, g64)
    assert_close(mine["products"], weighted_sum(per_sample, scale), torch.float32)
    # The raw ghost value (before certification, which the certified tests cover).
    torch.testing.assert_close(mine["ghost"], per_sample.flatten(1).square().sum(1), rtol=1e-12,
                               atol=0)
    torch.testing.assert_close(mine["rows"], g64.sum(1), rtol=1e-12, atol=1e-12)
    for name, (a, g) in dict(strips=(A2, G2), rank_one=(A1, G1)).items():
        exact = torch.einsum("bti,bto->bio", f64(a), f64(g)).flatten(1).square().sum(1)
        torch.testing.assert_close(mine[name], exact, rtol=1e-12, atol=0)


def test_a_kept_conv_gradient_above_float32s_range_is_clipped_not_dropped():
    """Note [kept conv gradients]: a sample whose squared norm overflows float32 (norm ~2.9e19)
    is clipped from the float64 norm on every path (a review saw the kept path drop it)."""
    x, G = torch.full((1, 3, 16, 16), 1.0), torch.full((1, 8, 14, 14), 1e16)
    for method in (AUTO, GHOST, DIRECT):
        gw, gb, _, factors, nonfinite = ops.conv_clip(x, G, [3, 3], [1, 1], [0, 0], [1, 1], 1,
                                                       1.0, "flat", GAMMA, True, method)
        assert nonfinite.item() == 0 and factors.item() > 0, method
        added = torch.cat([f64(gw).flatten(), f64(gb).flatten()]).norm().item()
        assert 0.99 < added <= 1.0 + 1e-6, (method, added)


@device_param
def test_a_rows_certified_norm_does_not_depend_on_the_rest_of_its_batch(device):
    """Each kernel's certified norm of one row is the same to the bit whatever the other rows of
    its batch are, how many and in which order (ghost and direct linear norms, a sequence, conv,
    layer norm, embedding): the norm kernels add no dependence between examples of their own.
    (torch's GEMMs before them can: docs/reliability.md, floating-point rows.)"""
    g = torch.Generator().manual_seed(0)

    def rows(*shape):
        return torch.randn(65, *shape, generator=g).to(device)

    A1, G1, A4, G4 = rows(48), rows(24), rows(4, 48), rows(4, 24)
    X, GX = rows(3, 8, 8), rows(5, 6, 6)
    L, GL = rows(4, 16), rows(4, 16)
    ids, GE = torch.randint(0, 30, (65, 4), generator=g).to(device), rows(4, 12)
    norms = {  # each of the rows `i` of its batch, in that order
        "linear": lambda i: ops.linear_sq_norms(A1[i], G1[i], True, AUTO),
        "linear-ghost": lambda i: ops.linear_sq_norms(A4[i], G4[i], True, GHOST),
        "linear-direct": lambda i: ops.linear_sq_norms(A4[i], G4[i], True, DIRECT),
        "conv": lambda i: ops.conv_sq_norms(X[i], GX[i], [3, 3], [1, 1], [0, 0], [1, 1], 1,
                                            True, AUTO),
        "layer-norm": lambda i: ops.layer_norm_sq_norms(L[i], GL[i], 1e-5, False, True, 1),
        "embedding": lambda i: ops.embedding_sq_norms(ids[i], GE[i], 30, None, AUTO),
    }
    for name, of in norms.items():
        alone = of(torch.tensor([0]))[0]
        for k in (2, 3, 17, 64, 65):
            first = torch.arange(k)  # row 0 first, then k - 1 others
            assert torch.equal(of(first)[0], alone), (name, k)
            assert torch.equal(of(first.flip(0))[-1], alone), (name, k)  # row 0 last
