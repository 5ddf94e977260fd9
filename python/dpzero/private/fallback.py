"""The generic path: per-sample gradients of a module's OWN parameters through ``torch.func``.

Some trainable parameters are not held by a layer kind of ``layers.py`` but used directly by a
module's forward: ViT's ``cls_token`` and ``position_embeddings``, learned scales, prompt tokens.
For such a module M, its own (non-recursive) trainable parameters P are clipped like any DP layer:

* forward: M runs with P swapped for detached copies, so autograd computes no gradient for P; its
  output y goes through :class:`_Tap`, whose backward passes dy through and hands it to the book.
* backward: the per-sample gradients of P are ``vmap`` over samples of the VJP of M's forward at
  sample i with respect to P, applied to dy_i (Opacus's functorch fallback does the same). Child
  modules run their plain forward there (their own parameters are constants).

Per-sample gradients exist as [B, *P.shape] for a moment, so this is meant for small parameter sets
(the big layers have kernels). Norms and clipped sums are computed in float64 from them; the norm is
rounded up so a clip factor never lets a contribution exceed its threshold.

Restrictions (checked, with the module named): M takes the examples on dim 0 of some of its
positional tensor arguments (which ones is decided by provenance, Note [batch provenance]; the
others are shared by all samples) and returns one tensor with the examples on dim 0; M must not
contain active dropout (the per-sample recompute would draw other masks than the forward did, so
the clipped gradient would belong to another function than the one the loss was computed with;
vmap also refuses random ops).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .layers import LayerKind, round_up_f32

_bypass = threading.local()


def bypassing() -> bool:
    """True while a fallback recomputes a forward: DP layers then run their plain forward."""
    return getattr(_bypass, "depth", 0) > 0


@contextlib.contextmanager
def bypass():
    _bypass.depth = getattr(_bypass, "depth", 0) + 1
    try:
        yield
    finally:
        _bypass.depth -= 1


@contextlib.contextmanager
def swapped(module: nn.Module, values: Dict[str, torch.Tensor]):
    """Temporarily replaces module's own parameters by ``values`` (tensors, not Parameters)."""
    old = {name: module._parameters[name] for name in values}
    try:
        for name, value in values.items():
            module._parameters[name] = value
        yield
    finally:
        for name, value in old.items():
            module._parameters[name] = value


class FuncKind(LayerKind):
    """A module whose own trainable parameters are used directly by its forward."""

    def __init__(self, names: List[str]) -> None:
        self.names = list(names)

    @property
    def params(self):  # type: ignore[override]
        return tuple(self.names)

    def check(self, module):
        for sub_name, sub in module.named_modules():
            if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
                where = f"{sub_name!r} " if sub_name else ""
                return (f"its dropout {where}(p={sub.p}) would draw a different mask when the "
                        "per-sample gradients are recomputed; set its p to 0")
        return None

    def per_sample_grads(self, module: nn.Module, inputs, g: torch.Tensor, train,
                         in_dims: Tuple[Optional[int], ...]):
        """{name: [B, *shape] float32} for the trainable own parameters. ``in_dims``: per
        positional argument, 0 where its dim 0 holds the examples, None where it is shared by
        all of them (the root forward's verdict, Note [batch provenance])."""
        args, kwargs = inputs
        names = [n for n, t in zip(self.names, train) if t]
        values = {n: module._parameters[n].detach() for n in names}

        def sample_out(p, *xs):
            xs = tuple(x.unsqueeze(0) if d == 0 else x for x, d in zip(xs, in_dims))
            with swapped(module, p), bypass():
                y = module._dp_original_forward(*xs, **kwargs)
            return y.squeeze(0)

        def one(g_i, *xs):
            _, vjp = torch.func.vjp(lambda p: sample_out(p, *xs), values)
            return vjp(g_i)[0]

        with torch.enable_grad():
            grads = torch.func.vmap(one, in_dims=(0,) + in_dims)(g, *args)
        return {n: grads[n].float() for n in names}

    def sq_norms(self, module, a, g, train):
        ps = a  # the per-sample gradients (Book passes them as A)
        total = None
        for t in ps.values():
            flat = t.double().flatten(1)
            s = (flat * flat).sum(1)
            # float64 sum of n non-negative terms: relative error <= (n - 1) 2^-53, covered here.
            s = s * (1.0 + flat.shape[1] * 2.3e-16)
            total = s if total is None else total + s
        return round_up_f32(total * (1.0 + 1e-15))

    def clipped_sums(self, module, a, g, scale, train):
        ps = a
        out: List[Optional[torch.Tensor]] = []
        for name, t in zip(self.names, train):
            if not t:
                out.append(None)
                continue
            grads = ps[name].double()
            w = scale.double().view(-1, *([1] * (grads.dim() - 1)))
            ok = (scale > 0) & torch.isfinite(scale)
            contrib = torch.where(ok.view_as(w), grads * w, torch.zeros_like(grads))
            out.append(contrib.sum(0).float())
        return out


class _Tap(torch.autograd.Function):
    """y -> y; backward hands dy to ``on_backward`` and passes it through. The module's own
    parameters are inputs so y requires grad even when no input does."""

    @staticmethod
    def forward(ctx, on_backward, y, *params):
        ctx.on_backward = on_backward
        ctx.n = len(params)
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.on_backward(g)
        return (None, g) + (None,) * ctx.n


def tap(on_backward, y: torch.Tensor, params) -> torch.Tensor:
    return _Tap.apply(on_backward, y, *params)
