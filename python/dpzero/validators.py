"""``ModuleValidator``: which modules of a model make_private would refuse, and a copy with the
common ones replaced (Opacus's ``opacus.validators.ModuleValidator``, so a switched script keeps
its ``validate`` / ``fix`` calls).

``validate`` runs make_private's own model walk (``attach.find_layers``: one rule, one place), so
it names exactly what make_private would refuse, and why. ``fix`` replaces what has a standard
private replacement and leaves the rest for ``validate`` to name:

* BatchNorm (any dimension) becomes GroupNorm over the same channels, with the largest number
  of groups at most 32 that divides them (Opacus's choice of 32, made valid for any channel
  count), its affine parameters starting as BatchNorm's were. BatchNorm mixes the examples of a
  batch; GroupNorm normalises each example by itself (Wu & He 2018), the usual replacement in DP
  training (Kurakin et al. 2022; De et al. 2022).
* InstanceNorm with running statistics stops tracking them (its buffers would average the
  training examples into the released model); its affine parameters are kept.
"""

from __future__ import annotations

import copy
import itertools
from typing import List

from torch import nn

from .private.attach import find_layers
from .private.errors import PrivacyViolation


class ModuleValidator:
    @staticmethod
    def validate(module: nn.Module, *, strict: bool = False) -> List[str]:
        """The modules make_private would refuse, each as "name (Type): reason and fix"; empty
        when none. ``strict=True`` raises the PrivacyViolation make_private would raise."""
        trainable = {id(p): None for p in module.parameters() if p.requires_grad}
        try:
            find_layers(module, trainable)
        except PrivacyViolation as error:
            if strict:
                raise
            return list(getattr(error, "problems", [str(error)]))
        return []

    @staticmethod
    def is_valid(module: nn.Module) -> bool:
        return not ModuleValidator.validate(module)

    @staticmethod
    def fix(module: nn.Module) -> nn.Module:
        """A copy of ``module`` with BatchNorm replaced by GroupNorm and InstanceNorm's running
        statistics off (module docstring); ``module`` itself is unchanged."""
        fixed = copy.deepcopy(module)
        whole = _replacement(fixed)  # the model itself a BatchNorm or InstanceNorm
        if whole is not None:
            return whole
        for parent in list(fixed.modules()):
            for name, child in list(parent.named_children()):
                new = _replacement(child)
                if new is not None:
                    setattr(parent, name, new)
        return fixed


def _groups(channels: int) -> int:
    return max(g for g in range(1, min(32, channels) + 1) if channels % g == 0)


def _replacement(module: nn.Module):
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        c = module.num_features
        new = nn.GroupNorm(_groups(c), c, eps=module.eps, affine=module.affine)
        if module.affine:
            new.weight.data.copy_(module.weight.data)
            new.bias.data.copy_(module.bias.data)
            new.weight.requires_grad_(module.weight.requires_grad)
            new.bias.requires_grad_(module.bias.requires_grad)
        state = next(itertools.chain(module.parameters(), module.buffers()), None)
        return new if state is None else new.to(state.device)
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
        new = copy.deepcopy(module)
        new.track_running_stats = False
        new.running_mean = new.running_var = new.num_batches_tracked = None
        return new
    return None
