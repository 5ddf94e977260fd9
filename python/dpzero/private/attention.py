"""``nn.MultiheadAttention`` through the kernels: its projections as DP Linear layers.

Note [attention through the kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's MultiheadAttention reads its parameters directly (``F.multi_head_attention_forward``
takes ``in_proj_weight`` and ``out_proj.weight`` as arguments), so no DP layer ever sees a call
of it, and the generic path (fallback.py) would recompute the module one example at a time. Its
parameters are four linear maps, though: the query, key and value projections (row blocks
``[0, E)``, ``[E, 2E)`` and ``[2E, 3E)`` of the packed ``in_proj_weight`` and ``in_proj_bias``,
or the separate ``q/k/v_proj_weight`` with those rows of the bias) and ``out_proj``, a Linear.
So while it trains, the module's forward is :func:`attention_forward`, which runs

    q = P_q(query), k = P_k(key), v = P_v(value)           three DP Linear layers
    o = softmax(q kᵀ / √D + mask) v, head by head           plain autograd, no parameters
    out_proj(o)                                             the DP Linear child

where ``P_q``, ``P_k`` and ``P_v`` are :class:`Projection` objects: Linear layers whose weight and
bias are those row blocks, read from the module at each call (so a stage-3 gather is seen), each
its own DP layer with its own slots in the unit's gradient buffer (``offset + k * rows``: a row
block of a row-major parameter is contiguous). Their per-sample gradients are disjoint blocks of
the parameter's, so the parameter's per-sample squared norm is exactly the sum of theirs: each is
its own clipping component, like any two Linears (so ``clipping="layer"`` counts four). That
holds only if no other module holds the parameter, so the generic path keeps a module that shares
one (or its out_proj's) with another module, one with ``add_bias_kv`` (two more parameters used
directly), one with parameters of other names (the deprecated ``weight_norm``'s) or a
parametrization, a subclass, an instance-level forward, an out_proj with a forward of its own
(torch's attention never calls out_proj; this one does, hooks included), and one whose input
projections are all frozen while out_proj trains (no projection call to carry the masks).

The middle line is torch's own arithmetic (the masks canonicalised by torch's helpers, the
weights averaged as ``need_weights`` and ``average_attn_weights`` ask, ``add_zero_attn``, the
``is_causal`` hint, an unbatched call as a batch of one), in batch-first layout: a
``batch_first=False`` module's inputs are transposed before the projections, so every DP layer
input holds the examples on dim 0, which the probe decides from where they came from (Note
[batch provenance]); one fed batch-first inputs by mistake has its examples on dim 1 there and is
refused. Every tensor keeps the examples on dim 0 and heads are split within an example; what
could still mix examples are the masks, which no DP layer reads: they ride with the first DP
projection's call as its context (Note [call context] in provenance/records.py), so a shared
mask computed from the batch, or a [B * H, L, S] mask (the examples folded with the heads), is
refused at the forward, as the generic path's probe refused them. Attention dropout is an
ordinary random op of the forward, which the generic path refused because its per-example
recompute would draw other masks; here nothing is recomputed. Outside a backward-building
forward (``torch.no_grad()``, evaluation) and inside a generic module's recompute the module runs
its own forward, fast path included.
"""

from __future__ import annotations

import math
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from .errors import PrivacyViolation
from .fallback import BYPASS
from .layers import ORIGINAL_FORWARD, LinearKind

_NAMES = ("q", "k", "v")
# The parameters a MultiheadAttention holds itself (out_proj holds its own).
_OWN = frozenset({"in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                  "in_proj_bias", "bias_k", "bias_v"})


class Projection(nn.Module):
    """Row block ``which`` (0, 1, 2: query, key, value) of a MultiheadAttention's input
    projection, as a Linear: weight [E, d_in], bias [E] or None. Not a child of anything: the
    module's parameters stay where they are, this only reads them."""

    def __init__(self, attention: nn.MultiheadAttention, which: int) -> None:
        super().__init__()
        self.__dict__["_owner"] = weakref.ref(attention)  # not a submodule
        self.which = which

    @property
    def owner(self) -> nn.MultiheadAttention:
        return self.__dict__["_owner"]()

    def source(self, name: str) -> Optional[torch.Tensor]:
        """The owner's parameter that this block's ``name`` ("weight" or "bias") lies in."""
        m = self.owner
        if name == "bias":
            return m.in_proj_bias
        if m._qkv_same_embed_dim:
            return m.in_proj_weight
        return (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)[self.which]

    @property
    def weight(self) -> torch.Tensor:  # [E, d_in]
        m = self.owner
        if not m._qkv_same_embed_dim:
            return self.source("weight")
        e = m.embed_dim
        return m.in_proj_weight[self.which * e:(self.which + 1) * e]

    @property
    def bias(self) -> Optional[torch.Tensor]:  # [E]
        b, e = self.owner.in_proj_bias, self.owner.embed_dim
        return None if b is None else b[self.which * e:(self.which + 1) * e]

    def forward(self, x: torch.Tensor, *context) -> torch.Tensor:  # x [B, L, d_in] -> [B, L, E]
        """``context``: tensors the probe judges with the call (Note [call context] in
        provenance/records.py); the projection does not read them."""
        return F.linear(x, self.weight, self.bias)


class ProjectionKind(LinearKind):
    """A projection's layer kind: a Linear whose call may carry the attention's masks as
    context (Note [call context] in provenance/records.py)."""

    context = True

    def __init__(self) -> None:
        super().__init__(transposed=False)


_PROJECTIONS: "weakref.WeakKeyDictionary[nn.Module, Tuple[Projection, ...]]" = \
    weakref.WeakKeyDictionary()


def projections(attention: nn.MultiheadAttention) -> Tuple[Projection, Projection, Projection]:
    """The module's three projections (the same objects at every call)."""
    found = _PROJECTIONS.get(attention)
    if found is None:
        found = tuple(Projection(attention, k) for k in range(3))
        _PROJECTIONS[attention] = found
    return found  # type: ignore[return-value]


def generic_reason(module: nn.Module, owners: Dict[int, int]) -> Optional[str]:
    """Why the MultiheadAttention ``module`` keeps the generic path (Note [attention through
    the kernels]), or None; ``owners``: id(parameter) -> how many modules hold it. Decided once,
    at make_private: what it reads cannot change unnoticed later, since a parameter added,
    replaced, shared or (un)frozen changes the trained set the step checks (Note [trained set]),
    and a forward or out_proj that uses the parameters directly gives them a gradient, which the
    escape guard refuses (attach.guard_hooks)."""
    if type(module) is not nn.MultiheadAttention:
        return "a subclass"
    if "forward" in module.__dict__:
        return "a forward set on the instance"
    if module.bias_k is not None or module.bias_v is not None:
        return "add_bias_kv=True"
    if type(module.out_proj).forward is not nn.Linear.forward:
        return "an out_proj with a forward of its own"
    if parametrize.is_parametrized(module) or parametrize.is_parametrized(module.out_proj):
        return "a parametrization"
    own = sorted(n for n, p in module._parameters.items() if p is not None)
    if any(n not in _OWN for n in own):  # e.g. the deprecated weight_norm's in_proj_weight_g
        return f"parameters {own}, not only its projections'"
    if not any(module._parameters[n].requires_grad for n in own) and \
            any(p.requires_grad for p in module.parameters()):
        # The masks ride with a projection's call (Note [call context]): one must be a DP layer.
        return "its input projections frozen while out_proj trains"
    if any(owners.get(id(p), 1) > 1 for p in module.parameters()):
        return "a parameter shared with another module"
    return None


def name_of(module_name: str, which: int) -> str:
    """A projection's DP layer name: the module's, with the block (``attn.in_proj.q``), so that
    a clipping group named by the module's prefix holds it."""
    return f"{module_name}.in_proj.{_NAMES[which]}" if module_name else f"in_proj.{_NAMES[which]}"


def attention_forward(module: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, key_padding_mask: Optional[torch.Tensor] = None,
                      need_weights: bool = True, attn_mask: Optional[torch.Tensor] = None,
                      average_attn_weights: bool = True, is_causal: bool = False):
    """``module``'s forward with its projections as DP layers (Note [attention through the
    kernels]). query [B, L, E] ([L, B, E] unless batch_first; [L, E] unbatched), key and value
    [B, S, kdim / vdim] likewise; returns (output like query, weights [B, L, S] or
    [B, H, L, S] or None)."""
    if BYPASS.depth or not torch.is_grad_enabled():
        return module.__dict__[ORIGINAL_FORWARD](
            query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
            attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal)
    if query.is_nested or key.is_nested or value.is_nested:
        raise PrivacyViolation("MultiheadAttention got a nested tensor, which it supports only "
                               "in its inference fast path; pass padded tensors and a "
                               "key_padding_mask")
    batched = query.dim() == 3
    # torch's checks and masks read the sequence-first layout
    seq_first = [t.transpose(0, 1) if batched and module.batch_first else t
                 for t in (query, key, value)]
    F._mha_shape_check(*seq_first, key_padding_mask, attn_mask, module.num_heads)
    # Batch-first from here (an unbatched call is a batch of one, as in torch's forward): every
    # tensor holds the examples on dim 0.
    query, key, value = (t.transpose(0, 1) if batched else t.unsqueeze(0) for t in seq_first)
    if not batched and key_padding_mask is not None:
        key_padding_mask = key_padding_mask.unsqueeze(0)
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask, mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask), other_name="attn_mask", target_type=query.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the "
                           "Transformer module method `generate_square_subsequent_mask` to "
                           "create this mask.")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # SDPA takes the hint, as torch's own forward does
    else:
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None,
                                      other_name="", target_type=query.dtype, check_other=False)
        if key_padding_mask is not None:
            is_causal = False  # the merged mask is no longer causal
    batch, tgt, embed = query.shape
    src = key.shape[1]
    if embed != module.embed_dim:
        raise RuntimeError(f"MultiheadAttention expected an embedding dimension of "
                           f"{module.embed_dim}, got a query of shape {tuple(query.shape)}")
    if key.shape[:2] != value.shape[:2] or \
            (module._qkv_same_embed_dim and key.shape != value.shape):
        raise RuntimeError(f"MultiheadAttention: key of shape {tuple(key.shape)} does not match "
                           f"value of shape {tuple(value.shape)} (batch-first)")
    heads = module.num_heads
    head_dim = embed // heads
    mask = None  # attn_mask broadcast to [B, H, L, S]
    if attn_mask is not None and attn_mask.dim() == 2:
        if attn_mask.shape != (tgt, src):
            raise RuntimeError(f"The shape of the 2D attn_mask is {attn_mask.shape}, but "
                               f"should be {(tgt, src)}.")
        mask = attn_mask.view(1, 1, tgt, src)
    elif attn_mask is not None:
        if attn_mask.shape != (batch * heads, tgt, src):
            raise RuntimeError(f"The shape of the 3D attn_mask is {attn_mask.shape}, but "
                               f"should be {(batch * heads, tgt, src)}.")
        mask = attn_mask.view(batch, heads, tgt, src)  # torch's row b * H + h
    # Note [call context]: the masks ride with one projection's call (a DP layer's: patch()
    # picks it), so that the probe judges them as it judges that call's input.
    carrier = module.__dict__.get("_dp_mask_carrier", 0)
    context = (key_padding_mask, attn_mask)
    q, k, v = (p(x, *context) if i == carrier else p(x)
               for i, (p, x) in enumerate(zip(projections(module), (query, key, value))))
    q = q.view(batch, tgt, heads, head_dim).transpose(1, 2)  # [B, H, L, D]
    k = k.view(batch, src, heads, head_dim).transpose(1, 2)  # [B, H, S, D]
    v = v.view(batch, src, heads, head_dim).transpose(1, 2)  # [B, H, S, D]
    if module.add_zero_attn:
        zeros = torch.zeros(batch, heads, 1, head_dim, dtype=k.dtype, device=k.device)
        k, v = torch.cat([k, zeros], 2), torch.cat([v, zeros], 2)
        mask = None if mask is None else F.pad(mask, (0, 1))
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))
        src += 1
    if key_padding_mask is not None:
        F._check_key_padding_mask(key_padding_mask, src, batch)
        padding = key_padding_mask.view(batch, 1, 1, src)
        mask = padding if mask is None else mask + padding
    dropout = module.dropout if module.training else 0.0
    weights = None
    if need_weights:
        scores = torch.matmul(q * math.sqrt(1.0 / float(head_dim)), k.transpose(-2, -1))
        scores = F.softmax(scores if mask is None else scores + mask, dim=-1)  # [B, H, L, S]
        if dropout > 0.0:
            scores = F.dropout(scores, p=dropout)
        out = torch.matmul(scores, v)
        weights = scores.mean(dim=1) if average_attn_weights else scores
    else:
        out = F.scaled_dot_product_attention(q, k, v, mask, dropout, is_causal)
    out = module.out_proj(out.transpose(1, 2).reshape(batch, tgt, embed))  # [B, L, E]
    if not batched:
        return out[0], (None if weights is None else weights[0])
    return (out if module.batch_first else out.transpose(0, 1)), weights


def patch(model: nn.Module, layers: List) -> None:
    """Gives every MultiheadAttention with a DP projection among ``layers``
    :func:`attention_forward` as its forward, and the first of them its masks to carry."""
    in_layers = {id(layer.module) for layer in layers}
    for m in model.modules():
        layer_projections = [i for i, p in enumerate(_PROJECTIONS.get(m, ()))
                             if id(p) in in_layers]
        if isinstance(m, nn.MultiheadAttention) and "forward" not in m.__dict__ and \
                layer_projections:  # generic_reason: no DP projection, no trained parameter
            m.__dict__[ORIGINAL_FORWARD] = m.forward
            m.forward = attention_forward.__get__(m)
            m.__dict__["_dp_attention"] = True
            m.__dict__["_dp_mask_carrier"] = layer_projections[0]  # Note [call context]


def unpatch(model: nn.Module) -> None:
    for m in model.modules():
        if m.__dict__.pop("_dp_attention", False):
            m.__dict__.pop("forward", None)
            m.__dict__.pop(ORIGINAL_FORWARD, None)
            m.__dict__.pop("_dp_mask_carrier", None)
