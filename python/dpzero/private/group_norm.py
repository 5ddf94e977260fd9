"""``nn.GroupNorm``'s per-sample gradients in closed form, on the generic path's interface.

Note [group norm in closed form]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
GroupNorm uses its parameters directly (``F.group_norm(x, G, weight, bias, eps)``), so it takes
the generic path (fallback.py), whose backward recomputes the module once per example under
``vmap`` and checks each recomputed output against the forward's (Note [separable recompute]).
GroupNorm is the norm DP image models train with (BatchNorm is refused, and
``ModuleValidator.fix`` puts GroupNorm in its place), and its gradients have a closed form: with
x̂ the input normalised over each group of channels of one example, y = x̂ γ + β per channel, so
example i's gradients are

    ∂γ_c = Σ_s G_i[c, s] x̂_i[c, s],   ∂β_c = Σ_s G_i[c, s]      (s: the spatial positions)

from its own input and output gradient alone. :class:`GroupNormKind` is the generic path with
these in place of the per-example recompute, for torch's own module (exact type, its own
forward, no parametrization) called as ``norm(x)`` with the examples on dim 0 of the input and
the output, which the probe decides as for any generic module (Note [batch provenance]). Any
other call (the examples elsewhere) takes the recompute. The saved input must still be what the
forward read: its version counter is compared with the call's, as autograd compares a kernel
layer's saved input, so a write in place after the call is refused (a write that bypasses the
counter, through ``.data``, is the same gap for every layer; the recompute's output check, which
saw such writes, cost more than the closed form saves). Nothing else changes: the
forward runs the module with its parameters detached and taps its output, and the book
certifies the norms of the rows returned here and adds c_i times these very rows (Note [kept
per-sample gradients]), so each contribution is bounded whatever the rounding of x̂ and of these
sums: x̂ is recomputed from the saved input in the dtype the forward normalised in (at least
float32, as under autocast), and the sums are float32, as the generic path's gradients are.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from .errors import PrivacyViolation
from .fallback import FuncKind


def closed_form(module: nn.Module) -> bool:
    """Whether ``module`` takes :class:`GroupNormKind` (Note [group norm in closed form])."""
    return type(module) is nn.GroupNorm and "forward" not in module.__dict__ and \
        not parametrize.is_parametrized(module) and module.affine


class GroupNormKind(FuncKind):
    """The generic path for nn.GroupNorm, its per-sample gradients in closed form."""

    def per_sample_grads(self, module: nn.Module, saved, g: torch.Tensor, train, dims,
                         module_name: str = "the module", defer=None):
        """As FuncKind.per_sample_grads: {name: [B, C] float32}. ``g``: [B, C * spatial]."""
        args, kwargs, layout, _ = saved
        in_dims, out_dims = dims
        x: Optional[torch.Tensor] = args[0] if len(args) == 1 and not kwargs else None
        if x is None or list(in_dims) != [0] or list(out_dims) != [0] or x.dim() < 2 or \
                len(layout.tapped) != 1:
            return super().per_sample_grads(module, saved, g, train, dims, module_name, defer)
        if x._version != layout.versions[0]:  # x̂ would not be the forward's
            raise PrivacyViolation(
                f"{module_name}: its input was written in place after the call (its version "
                f"moved from {layout.versions[0]} to {x._version}), so the per-sample gradients "
                "would be computed from other values than the forward's; write into a copy "
                "(x = x.clone()) instead")
        b, c = x.shape[0], x.shape[1]
        work = torch.promote_types(x.dtype, torch.float32)
        with torch.no_grad():
            x_hat = F.group_norm(x.to(work), module.num_groups, None, None, module.eps)
            grad = g.reshape(b, c, -1)  # [B, C, S] float32
            out: Dict[str, torch.Tensor] = {}
            for name, trained in zip(self.names, train):
                if not trained:
                    continue
                if name == "weight":
                    out[name] = torch.einsum("bcs,bcs->bc", grad, x_hat.reshape(b, c, -1).float())
                else:  # "bias"
                    out[name] = grad.sum(2)
        return out
