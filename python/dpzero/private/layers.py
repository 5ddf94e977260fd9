"""DP layers: the module kinds whose per-sample gradients dpzero computes without autograd.

A DP layer's forward runs inside :class:`_DPLayerFunction`, whose backward returns the gradient
with respect to the layer's INPUT only: autograd never forms the weight gradient of a DP layer
(design.md §2 step 3). The backward hands the layer's input A and output gradient G to the
clipping book (``book.py``, src/dp/book.h), which turns them into per-sample norms and clipped
sums through the layer's C++ ops (src/dp/layer_ops.h, over the kernels of ``kernels/``).

Each kind below says, for one module type: how to run the forward, how to get the input gradient
from G, and which C++ ops (``book_ops``) compute the per-sample squared norms, the clipped sums
and the fused clip of the module's trainable parameters. Shapes follow Note [per-sample ops] in
kernels/per_sample_ops.h: A is [B, ..., d_in] (Conv: [B, C_in, *spatial]) and G [B, ..., d_out];
every op returns float32.

Supported: ``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm`` and Hugging Face
RMSNorm modules (``LlamaRMSNorm`` and relatives: a ``weight`` of shape [d] and a
``variance_epsilon``), ``nn.Conv1d`` / ``nn.Conv2d``, and Hugging Face ``Conv1D`` (GPT-2).
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import _C

_dp = _C.dp  # src/dp: the book's per-layer ops

# Hugging Face RMSNorm classes whose forward is x / sqrt(mean(x^2) + eps) * weight (computed in
# fp32, cast back), checked against their sources. Others (Gemma's (1 + weight) scaling, which
# has the same weight gradient but an input gradient we have not verified) take the generic path
# (fallback.py) until checked and added here.
HF_RMS_NORMS = frozenset({
    "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MixtralRMSNorm",
    "PhiRMSNorm", "Phi3RMSNorm", "OlmoRMSNorm", "T5LayerNorm", "MT5LayerNorm", "UMT5LayerNorm",
})


def _param(module: nn.Module, name: str):
    """``getattr(module, name)`` for a parameter (or None), read from the module's parameter dict
    first: nn.Module.__getattr__ costs about a microsecond, paid per DP layer call."""
    params = module._parameters
    if name in params:
        return params[name]
    return getattr(module, name)



# A DP layer's own forward, kept on the module (under this attribute) by attach.py while the DP
# forward is patched in, and called by the layer kinds and the generic path.
ORIGINAL_FORWARD = "_dp_original_forward"


def original_forward(module: nn.Module):
    """The forward ``module`` had before attach.py patched it."""
    return module.__dict__[ORIGINAL_FORWARD]

class LayerKind:
    """How one module type runs under DP. ``params`` are the names of its parameters in the order
    the ops return gradients; a subclass implements the ops for the trainable subset ``train``
    (a tuple of bools parallel to ``params``)."""

    params: Sequence[str] = ("weight", "bias")
    # Whether a call may pass tensors after its input that the layer does not read but the probe
    # judges with the call (Note [call context] in provenance/records.py).
    context: bool = False

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

    def book_ops(self, module: nn.Module, train: Sequence[bool]):
        """The C++ ops the book runs on this layer's A and G (src/dp/layer_ops.h), for the
        trainable subset ``train``; None for the generic path (per-sample gradients). Built once,
        when make_private attaches: the module's settings they read (padding_idx, eps, a conv's
        geometry) are those of that moment, like its trainable set (which step() checks)."""
        raise NotImplementedError


# ---- Linear and HF Conv1D ------------------------------------------------------------------------

class LinearKind(LayerKind):
    """nn.Linear (weight [d_out, d_in]) and, with ``transposed``, HF Conv1D (weight [d_in, d_out],
    y = x W + b)."""

    def __init__(self, transposed: bool) -> None:
        self.transposed = transposed

    def forward(self, module, x):
        if self.transposed and module.bias is not None:  # HF Conv1D's own forward
            out = torch.addmm(module.bias, x.reshape(-1, x.shape[-1]), module.weight)
            return out.view(*x.shape[:-1], module.weight.shape[1])
        if self.transposed:
            return torch.matmul(x, module.weight)
        return F.linear(x, module.weight, module.bias)

    def input_grad(self, module, x, g):
        w = module.weight.to(g.dtype)  # autocast's cast, when the forward ran under it
        return torch.matmul(g, w.t() if self.transposed else w)

    def autocast_input(self, x, dtype):
        return x.to(dtype) if x.is_floating_point() else x

    def book_ops(self, module, train):
        return _dp.linear_ops(list(train), self.transposed)

    def dp_call(self, module, x, core, generation: int, part: int, refusal: Optional[str]):
        """The call as a C++ autograd function (src/dp/dp_layers.h) reporting to the book's
        ``core`` (or refusing with ``refusal``)."""
        return _dp.linear(x, _param(module, "weight"), _param(module, "bias"), self.transposed,
                          core, generation, part, refusal)


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

    def book_ops(self, module, train):
        return _dp.embedding_ops(list(train), module.num_embeddings, module.padding_idx)

    def dp_call(self, module, x, core, generation: int, part: int, refusal: Optional[str]):
        """As LinearKind.dp_call."""
        return _dp.embedding(x, _param(module, "weight"), module.padding_idx, core, generation,
                             part, refusal)


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

    def forward(self, module, x):
        return original_forward(module)(x)

    def input_grad(self, module, x, g):
        with torch.enable_grad():
            xr = x.detach().requires_grad_(True)
            y = original_forward(module)(xr)
            (gx,) = torch.autograd.grad(y, xr, g)
        return gx

    def book_ops(self, module, train):
        # nn.RMSNorm(eps=None) takes the input dtype's epsilon: None here, resolved by the op.
        eps = module.variance_epsilon if self.hf else module.eps
        return _dp.norm_ops(list(train), self.rms, None if eps is None else float(eps),
                            self.normalized_ndim(module))


class LayerNormKind(NormKind):
    """nn.LayerNorm (and subclasses keeping its forward, F.layer_norm): as a C++ autograd
    function (src/dp/dp_layers.h), its input gradient from ATen's layer-norm backward."""

    def __init__(self) -> None:
        super().__init__(rms=False)

    def dp_call(self, module, x, core, generation: int, part: int, refusal: Optional[str]):
        """As LinearKind.dp_call."""
        return _dp.layer_norm(x, list(module.normalized_shape), _param(module, "weight"),
                              _param(module, "bias"), float(module.eps), core, generation, part,
                              refusal)


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

    def book_ops(self, module, train):
        return _dp.conv_ops(list(train), *self._geometry(module))


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
        return LayerNormKind()
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
    sums, the noise and the update stay fp32 on the fp32 master shards (design.md §4).
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
