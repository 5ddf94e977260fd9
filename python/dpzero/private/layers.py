"""DP layers: the module kinds whose per-sample gradients dpzero computes without autograd.

A DP layer's forward runs inside :class:`_DPLayerFunction`, whose backward returns the gradient
with respect to the layer's INPUT only: autograd never forms the weight gradient of a DP layer
(DESIGN.md §2 step 3). The backward hands the layer's input A and output gradient G to the
clipping book (``book.py``), which turns them into per-sample norms and clipped sums through the
C++ ops of ``kernels/`` (``torch.ops.dpzero.*``).

Each kind below says, for one module type: how to run the forward, how to get the input gradient
from G, and which op computes the per-sample squared norms, the clipped sums and the fused clip of
the module's trainable parameters. Shapes follow Note [per-sample ops] in kernels/per_sample_ops.h:
A is [B, ..., d_in] (Conv: [B, C_in, *spatial]) and G [B, ..., d_out]; every op returns float32.

Supported: ``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm`` and Hugging Face
RMSNorm modules (``LlamaRMSNorm`` and relatives: a ``weight`` of shape [d] and a
``variance_epsilon``), ``nn.Conv1d`` / ``nn.Conv2d``, and Hugging Face ``Conv1D`` (GPT-2).
"""

from __future__ import annotations

import inspect
from typing import Callable, List, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import _C

_ops = torch.ops.dpzero

# Hugging Face RMSNorm classes whose forward is x / sqrt(mean(x^2) + eps) * weight (computed in
# fp32, cast back), checked against their sources. Others (Gemma's (1 + weight) scaling, which
# has the same weight gradient but an input gradient we have not verified) take the generic path
# (fallback.py) until checked and added here.
HF_RMS_NORMS = frozenset({
    "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MixtralRMSNorm",
    "PhiRMSNorm", "Phi3RMSNorm", "OlmoRMSNorm", "T5LayerNorm", "MT5LayerNorm", "UMT5LayerNorm",
})


class Kept(NamedTuple):
    """What the book keeps of a layer between its backward and the clip factors when the layer has
    small per-sample gradients (Note [kept per-sample gradients] in kernels/per_sample_ops.h).

    ``grads``: per parameter (the kind's ``params`` order), its per-sample gradients [B, *shape]
    (float64), or None (not trainable, or summed from ``a`` and ``g`` by the kind's
    ``clipped_sums``); ``sq``: the layer's certified squared norms [B] float32 (None when no clipping
    needs them); ``a``, ``g``: the input and output gradient the remaining parameters need, or
    None."""

    grads: Sequence[Optional[torch.Tensor]]
    sq: Optional[torch.Tensor]
    a: Optional[torch.Tensor] = None
    g: Optional[torch.Tensor] = None


def certified_sum(sqs: Sequence[torch.Tensor]) -> torch.Tensor:
    """[B] float32 never below the exact sum of certified squared norms ([B] float32 each, at most
    8): the float64 sum of float32 values is off by at most 7 * 2^-53 relative, which the factor
    covers, and the result is rounded up to float32."""
    return _C.dp.certified_sum(list(sqs))  # src/dp/clip_group.h


def add_into(dests, grads) -> None:
    """Adds each parameter's clipped sum (or nothing, for None) into its destination slot."""
    for dest, grad in zip(dests, grads):
        if grad is not None:
            dest.add_(grad.view(dest.shape))


def add_kept_clipped_sums(kind: "LayerKind", module, kept: Kept, scale, train, dests) -> None:
    """Adds the clipped sums of a layer kept as :class:`Kept` into ``dests`` (as
    ``LayerKind.add_clipped_sums``): sum_i scale_i g_i from the kept rows, and the kind's own
    clipped sums for the parameters summed from ``a`` and ``g``."""
    rest = tuple(t and grad is None for t, grad in zip(train, kept.grads))
    if any(rest):
        kind.add_clipped_sums(module, kept.a, kept.g, scale, rest, dests)
    for dest, grad in zip(dests, kept.grads):
        if grad is not None:
            dest.add_(_ops.per_sample_clipped_sum(grad, scale).view(dest.shape))


class LayerKind:
    """How one module type runs under DP. ``params`` are the names of its parameters in the order
    the ops return gradients; a subclass implements the ops for the trainable subset ``train``
    (a tuple of bools parallel to ``params``)."""

    params: Sequence[str] = ("weight", "bias")

    def check(self, module: nn.Module) -> Optional[str]:
        """Why this module cannot run under DP (an error text), or None."""
        return None

    def forward(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def input_grad(self, module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def autocast_input(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The input the forward's weight-side op saw under autocast to ``dtype`` (Note
        [autocast]): ``x`` itself unless the kind's op is on autocast's lower-precision list."""
        return x

    def batch_input(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """What the ops take as A (the input as the ops expect it; Conv pads here)."""
        return x

    def keep(self, module, a, g, train, norms: bool):
        """What the book keeps of this layer's backward until the clip factors are known: (a, g)
        by default; a kind with small per-sample gradients returns (Kept(...), None) instead, with
        the squared norms computed when ``norms``."""
        return a, g

    def sq_norms(self, module, a, g, train) -> torch.Tensor:  # -> [B] float32
        raise NotImplementedError

    def clipped_sums(self, module, a, g, scale, train) -> List[Optional[torch.Tensor]]:
        """sum_i scale_i g_i per parameter (None where not trainable)."""
        raise NotImplementedError

    def add_clipped_sums(self, module, a, g, scale, train, dests) -> None:
        """Adds sum_i scale_i g_i into ``dests`` (per parameter: a float32 tensor of its shape,
        typically its slot in the engine's gradient buffer, or None where not trainable). Kinds
        with an in-place op override this (Note [accumulating clipped sums] in
        kernels/per_sample_ops.h); the rest add what ``clipped_sums`` returns."""
        add_into(dests, self.clipped_sums(module, a, g, scale, train))

    def clip(self, module, a, g, max_norm, mode, gamma, train):
        """Fused norms + factors + clipped sums for threshold ``max_norm``:
        -> (grads per parameter, sq_norms [B], factors [B])."""
        sq = self.sq_norms(module, a, g, train)
        norms = _certified_sqrt(sq.double())
        factors, _ = _ops.clip_factors(norms, max_norm, mode, gamma)
        return self.clipped_sums(module, a, g, factors, train), sq, factors


def _certified_sqrt(sq: torch.Tensor) -> torch.Tensor:
    """float32 norms never below sqrt(sq) (sq float64 >= 0, NaN/Inf kept): the clip must see a
    norm at least the exact one (Note [certified norms] in kernels/per_sample_ops.h)."""
    return round_up_f32(torch.sqrt(sq) * (1.0 + 1e-12))


def round_up_f32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounded toward +inf (NaN/Inf unchanged); src/dp/clip_group.h."""
    return _C.dp.round_up_f32(x)


def round_down_f32(x: torch.Tensor) -> torch.Tensor:
    """float64 >= 0 -> float32 rounded toward 0; src/dp/clip_group.h."""
    return _C.dp.round_down_f32(x)


def _bias_sq_norms(g: torch.Tensor, last_dims: int) -> torch.Tensor:
    return _ops.bias_sq_norms(g.flatten(-last_dims) if last_dims > 1 else g)


# ---- Linear and HF Conv1D ------------------------------------------------------------------------

class LinearKind(LayerKind):
    """nn.Linear (weight [d_out, d_in]) and, with ``transposed``, HF Conv1D (weight [d_in, d_out],
    y = x W + b)."""

    def __init__(self, transposed: bool) -> None:
        self.transposed = transposed

    def forward(self, module, x):
        if self.transposed:
            return torch.matmul(x, module.weight) + module.bias if module.bias is not None \
                else torch.matmul(x, module.weight)
        return F.linear(x, module.weight, module.bias)

    def input_grad(self, module, x, g):
        w = module.weight.to(g.dtype)  # autocast's cast, when the forward ran under it
        return torch.matmul(g, w.t() if self.transposed else w)

    def autocast_input(self, x, dtype):
        return x.to(dtype) if x.is_floating_point() else x

    def keep(self, module, a, g, train, norms):
        w, b = train
        if not b:
            return a, g
        gb, sq_b = _ops.bias_per_sample(g)
        sq = None
        if norms:
            sq = certified_sum([_ops.linear_sq_norms(a, g, bias=False), sq_b]) if w else sq_b
        return Kept([None, gb], sq, a if w else None, g if w else None), None

    def keep_for_shared_norms(self, module, a, g, train):
        """keep() when the book computes the weight's norm later, with the other layers that read
        the same input (Note [shared inputs] in kernels/per_sample_ops.h): -> (a-state, g-state,
        the bias's certified squared norms or None). The weight must be trainable."""
        if not train[1]:
            return a, g, None
        gb, sq_b = _ops.bias_per_sample(g)
        return Kept([None, gb], None, a, g), None, sq_b

    def sq_norms(self, module, a, g, train):
        w, b = train
        if w:
            return _ops.linear_sq_norms(a, g, bias=b)
        return _ops.bias_sq_norms(g)

    def clipped_sums(self, module, a, g, scale, train):
        w, b = train
        return [_ops.linear_clipped_sum(a, g, scale, transposed=self.transposed) if w else None,
                _ops.bias_clipped_sum(g, scale) if b else None]

    def add_clipped_sums(self, module, a, g, scale, train, dests):
        w, b = train
        if w:
            _ops.add_linear_clipped_sum_(dests[0], a, g, scale, transposed=self.transposed)
        if b:
            dests[1].add_(_ops.bias_clipped_sum(g, scale))

    def clip(self, module, a, g, max_norm, mode, gamma, train):
        w, b = train
        if not w:
            return super().clip(module, a, g, max_norm, mode, gamma, train)
        gw, gb, sq, factors, _ = _ops.linear_clip(a, g, max_norm, mode, gamma, bias=b,
                                                  transposed=self.transposed)
        return [gw, gb if b else None], sq, factors


# ---- Embedding -----------------------------------------------------------------------------------

class EmbeddingKind(LayerKind):
    params = ("weight",)

    def check(self, module):
        if module.scale_grad_by_freq:
            return ("scale_grad_by_freq=True divides each row's gradient by the id's frequency in "
                    "the whole batch, so one sample's gradient depends on the others")
        if module.sparse:
            return "sparse=True gradients are not supported under DP"
        if module.max_norm is not None:
            return ("max_norm renormalises the weight in place during the forward, which a sharded "
                    "flat parameter does not allow")
        return None

    def forward(self, module, x):
        return F.embedding(x, module.weight, module.padding_idx)

    def input_grad(self, module, x, g):
        return None  # ids have no gradient

    def sq_norms(self, module, a, g, train):
        return _ops.embedding_sq_norms(a, g, module.num_embeddings, module.padding_idx)

    def add_clipped_sums(self, module, a, g, scale, train, dests):
        _ops.add_embedding_clipped_sum_(dests[0], a, g, scale, module.num_embeddings,
                                        module.padding_idx)

    def clip(self, module, a, g, max_norm, mode, gamma, train):
        gw, sq, factors, _ = _ops.embedding_clip(a, g, module.num_embeddings, max_norm, mode,
                                                 gamma, module.padding_idx)
        return [gw], sq, factors


# ---- LayerNorm / RMSNorm -------------------------------------------------------------------------

class NormKind(LayerKind):
    """nn.LayerNorm (rms=False), nn.RMSNorm and HF RMSNorms (rms=True). The forward is the module's
    own (so its exact numerics, e.g. HF's fp32 upcast, are kept); the input gradient recomputes
    that forward under autograd for the input only (cheap next to the GEMMs around it)."""

    def __init__(self, rms: bool, hf: bool = False) -> None:
        self.rms, self.hf = rms, hf

    @property
    def params(self):  # type: ignore[override]
        return ("weight",) if self.rms else ("weight", "bias")

    def check(self, module):
        if self.hf:
            w = getattr(module, "weight", None)
            if w is None or w.dim() != 1 or not hasattr(module, "variance_epsilon"):
                return "a Hugging Face RMSNorm needs a 1-D weight and a variance_epsilon"
        return None

    def normalized_ndim(self, module) -> int:
        return 1 if self.hf else len(module.normalized_shape)

    def eps(self, module, x) -> float:
        if self.hf:
            return float(module.variance_epsilon)
        if module.eps is None:  # nn.RMSNorm(eps=None): torch.finfo(input dtype).eps
            return float(torch.finfo(x.dtype).eps)
        return float(module.eps)

    def forward(self, module, x):
        return module._dp_original_forward(x)

    def input_grad(self, module, x, g):
        with torch.enable_grad():
            xr = x.detach().requires_grad_(True)
            y = module._dp_original_forward(xr)
            (gx,) = torch.autograd.grad(y, xr, g)
        return gx

    def keep(self, module, a, g, train, norms):
        nd = self.normalized_ndim(module)
        grads: List[Optional[torch.Tensor]] = [None] * len(train)
        sqs = []
        if train[0]:
            grads[0], sq = _ops.layer_norm_per_sample(a, g, self.eps(module, a), rms=self.rms,
                                                      normalized_ndim=nd)
            sqs.append(sq)
        if len(train) > 1 and train[1]:
            gb, sq = _ops.bias_per_sample(g.flatten(-nd) if nd > 1 else g)
            grads[1] = gb.view(gb.shape[0], *module.bias.shape)
            sqs.append(sq)
        return Kept(grads, certified_sum(sqs) if norms else None), None

    def sq_norms(self, module, a, g, train):
        nd = self.normalized_ndim(module)
        w = train[0]
        b = len(train) > 1 and train[1]
        if w:
            return _ops.layer_norm_sq_norms(a, g, self.eps(module, a), rms=self.rms, bias=b,
                                            normalized_ndim=nd)
        return _bias_sq_norms(g, nd)

    def clipped_sums(self, module, a, g, scale, train):
        nd = self.normalized_ndim(module)
        shape = module.weight.shape if module.weight is not None else module.bias.shape
        out: List[Optional[torch.Tensor]] = [None] * len(train)
        if train[0]:
            out[0] = _ops.layer_norm_clipped_sum(a, g, scale, self.eps(module, a), rms=self.rms,
                                                 normalized_ndim=nd)
        if len(train) > 1 and train[1]:
            gb = g.flatten(-nd) if nd > 1 else g
            out[1] = _ops.bias_clipped_sum(gb, scale).view(shape)
        return out

    def clip(self, module, a, g, max_norm, mode, gamma, train):
        if not train[0]:
            return super().clip(module, a, g, max_norm, mode, gamma, train)
        b = len(train) > 1 and train[1]
        gw, gb, sq, factors, _ = _ops.layer_norm_clip(
            a, g, self.eps(module, a), max_norm, mode, gamma, rms=self.rms, bias=b,
            normalized_ndim=self.normalized_ndim(module))
        out = [gw] + ([gb if b else None] if len(train) > 1 else [])
        return out, sq, factors


# ---- Conv1d / Conv2d -----------------------------------------------------------------------------

class ConvKind(LayerKind):
    """nn.Conv1d / nn.Conv2d. Non-zero padding modes and string paddings ('same') are applied to
    the input first (the ops then see padding 0)."""

    def _prepadded(self, module) -> bool:
        return module.padding_mode != "zeros" or isinstance(module.padding, str)

    def _pads(self, module):
        """F.pad amounts (last dim first) for a pre-padded module."""
        if module.padding_mode != "zeros":
            return list(module._reversed_padding_repeated_twice), module.padding_mode
        if module.padding == "valid":
            return [0, 0] * len(module.kernel_size), "constant"
        pads = []  # 'same' (stride 1): total dilation*(k-1), the extra one on the right
        for k, d in zip(reversed(module.kernel_size), reversed(module.dilation)):
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
        return pads, "constant"

    def _geometry(self, module):
        padding = [0] * len(module.kernel_size) if self._prepadded(module) else list(module.padding)
        return (list(module.kernel_size), list(module.stride), padding, list(module.dilation),
                module.groups)

    def forward(self, module, x):
        return module._conv_forward(x, module.weight, module.bias)

    def input_grad(self, module, x, g):
        if self._prepadded(module):
            with torch.enable_grad():
                xr = x.detach().requires_grad_(True)
                y = module._conv_forward(xr, module.weight.detach(), None)
                (gx,) = torch.autograd.grad(y, xr, g)
            return gx
        k, s, p, d, groups = self._geometry(module)
        return torch.ops.aten.convolution_backward(  # autocast's casts, if the forward had them
            g, x.to(g.dtype), module.weight.to(g.dtype), None, s, p, d, False, [0] * len(k),
            groups, [True, False, False])[0]

    def autocast_input(self, x, dtype):
        return x.to(dtype) if x.is_floating_point() else x

    def batch_input(self, module, x):
        if self._prepadded(module):
            pads, mode = self._pads(module)
            return F.pad(x, pads, mode=mode)
        return x

    def sq_norms(self, module, a, g, train):
        w, b = train
        if w:
            return _ops.conv_sq_norms(a, g, *self._geometry(module), bias=b)
        return _ops.bias_sq_norms(g.movedim(1, -1))

    def clipped_sums(self, module, a, g, scale, train):
        w, b = train
        return [_ops.conv_clipped_sum(a, g, scale, *self._geometry(module)) if w else None,
                _ops.bias_clipped_sum(g.movedim(1, -1), scale) if b else None]

    def clip(self, module, a, g, max_norm, mode, gamma, train):
        w, b = train
        if not w:
            return super().clip(module, a, g, max_norm, mode, gamma, train)
        k, s, p, d, groups = self._geometry(module)
        gw, gb, sq, factors, _ = _ops.conv_clip(a, g, k, s, p, d, groups, max_norm, mode, gamma,
                                                bias=b)
        return [gw, gb if b else None], sq, factors


_BASES = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.Conv1d, nn.Conv2d)


def overridden_base(module: nn.Module) -> Optional[type]:
    """The torch layer class ``module`` subclasses while replacing its forward (e.g. Hugging
    Face's scaled word embeddings, which multiply the lookup by a constant), or None."""
    for base in _BASES:
        if isinstance(module, base) and type(module).forward is not base.forward:
            return base
    return None


# Note [subclass forwards] (attach.py): Hugging Face subclasses of kernel layers whose forward
# was read and found to compute ids from the input's shape or an attention mask row by row and
# then call super().forward, or to scale super().forward's output by a constant (transformers
# 5.23). Only these keep the kernel; any other subclass overriding forward takes the generic
# path, whose recompute checks that examples do not mix (a review found mixing in an unvetted
# override accepted: 3.9 against the 2C = 2 bound).
ROUTED_SUBCLASSES = frozenset({
    "BartLearnedPositionalEmbedding", "BartScaledWordEmbedding",
    "MBartLearnedPositionalEmbedding", "MBartScaledWordEmbedding",
    "PLBartScaledWordEmbedding", "M2M100ScaledWordEmbedding", "NllbMoeScaledWordEmbedding",
    "OPTLearnedPositionalEmbedding", "BioGptLearnedPositionalEmbedding",
    "BioGptScaledWordEmbedding", "GemmaTextScaledWordEmbedding",
    "Gemma3TextScaledWordEmbedding",
})


def calls_base_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class is one of the vetted Hugging Face subclasses routed to their
    base's kernel (ROUTED_SUBCLASSES), and its forward still calls ``super().forward``."""
    cls = type(module)
    if cls.__name__ not in ROUTED_SUBCLASSES or \
            not cls.__module__.startswith("transformers."):
        return False
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "super().forward(" in source


def layer_kind(module: nn.Module, through_super: bool = False) -> Optional[LayerKind]:
    """The DP kind of ``module``, or None if dpzero has no per-sample ops for it: the torch
    classes (and subclasses that keep their forward) and the named Hugging Face classes;
    ``through_super``: also a subclass overriding forward, by its base class's kind (Note
    [subclass forwards])."""
    name = type(module).__name__
    if overridden_base(module) is not None and not through_super:
        return None
    if isinstance(module, nn.Linear):
        return LinearKind(transposed=False)
    if name == "Conv1D" and type(module).__module__.startswith("transformers"):
        return LinearKind(transposed=True)
    if isinstance(module, nn.Embedding):
        return EmbeddingKind()
    if isinstance(module, nn.LayerNorm):
        return NormKind(rms=False)
    if isinstance(module, nn.RMSNorm):
        return NormKind(rms=True)
    if name in HF_RMS_NORMS:
        return NormKind(rms=True, hf=True)
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return ConvKind()
    return None


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype torch.autocast casts to on ``device_type`` now, or None when it is off."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class _DPLayerFunction(torch.autograd.Function):
    """y = layer(x); backward returns dL/dx only and hands (A, G) to ``on_backward``.

    The layer's trainable parameters are inputs (so that y requires grad even when x does not,
    e.g. token ids, and the backward runs) but get no gradient from autograd: that is the point.

    Note [autocast]
    ~~~~~~~~~~~~~~~
    Under ``torch.autocast`` the forward's ops cast as autocast decides (Linear and Conv compute
    in the 16-bit dtype, LayerNorm in fp32) and G arrives in the output's dtype. Autograd runs a
    backward without autocast, so the backward re-enters the forward's autocast state for the
    input gradient (as torch.amp.custom_bwd does) and returns it in x's dtype, as autocast's cast
    nodes would. A (the per-sample ops' input) is what the weight-side op saw: x cast to the
    16-bit dtype for Linear and Conv (``LayerKind.autocast_input``). The per-sample ops read 16-bit
    A and G and accumulate norms and clipped sums in fp32 (kernels/per_sample_ops.h); the clipped
    sums, the noise and the update stay fp32 on the fp32 master shards (DESIGN.md §4).
    """

    @staticmethod
    def forward(ctx, kind: LayerKind, module: nn.Module, on_backward: Callable, x, *params):
        ctx.kind, ctx.module, ctx.on_backward = kind, module, on_backward
        ctx.autocast = autocast_dtype(x.device.type)
        ctx.save_for_backward(x)
        return kind.forward(module, x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        # G arrives non-contiguous behind a permute (BERT's value projection, through the heads'
        # transpose): made contiguous once here, not once in each of the input gradient's
        # matmul, the norm kernels and the clipped sum (three copies of [B, T, d_out]).
        g = g.contiguous()
        dtype = ctx.autocast
        gx = None
        if ctx.needs_input_grad[3]:
            if dtype is None:
                gx = ctx.kind.input_grad(ctx.module, x, g)
            else:  # Note [autocast]
                with torch.autocast(x.device.type, dtype=dtype):
                    gx = ctx.kind.input_grad(ctx.module, x, g)
                gx = gx.to(x.dtype)
        ctx.on_backward(x if dtype is None else ctx.kind.autocast_input(x, dtype), g)
        return (None, None, None, gx) + (None,) * (len(ctx.needs_input_grad) - 4)


def dp_apply(kind: LayerKind, module: nn.Module, on_backward: Callable, x: torch.Tensor,
             params: Sequence[torch.Tensor]) -> torch.Tensor:
    return _DPLayerFunction.apply(kind, module, on_backward, x, *params)
