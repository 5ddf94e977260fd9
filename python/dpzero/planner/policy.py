"""What the planner chooses: a memory policy (ZeRO stage, activation checkpointing, offload).

The clipping mode, the precision and the micro-batch are the user's (they change the algorithm or
its numerics, not only its cost) and are fixed for a plan; a policy only decides how the same
computation is laid out in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence


@dataclass(frozen=True)
class Policy:
    stage: int                 # ZeRO stage 0-3
    checkpointed: int = 0      # the first ``checkpointed`` units (in forward order) recompute
    offload_optimizer: bool = False  # fp32 master + optimizer state in host memory (GPU only)

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.checkpointed < 0:
            raise ValueError(f"checkpointed must be >= 0, got {self.checkpointed!r}")

    def label(self, units: int) -> str:
        ck = ("" if self.checkpointed == 0 else "-ckpt" if self.checkpointed == units
              else f"-ckpt{self.checkpointed}")
        return f"zero{self.stage}{ck}{'-offload' if self.offload_optimizer else ''}"

    def make_private_kwargs(self, unit_names: Sequence[str]) -> dict:
        """The make_private arguments that realise this policy."""
        kw = dict(zero_stage=self.stage)
        if self.checkpointed:
            kw["activation_checkpointing"] = list(unit_names[:self.checkpointed])
        if self.offload_optimizer:
            kw["offload_optimizer"] = True
        return kw


def candidates(units: int, world: int, accelerator: bool) -> List[Policy]:
    """Every policy worth predicting: stages 0-3 (at W = 1 only stage 0: every stage holds the
    whole model there), no / half / all units checkpointed, optimizer offload where there is an
    accelerator to offload from."""
    stages = [0] if world == 1 else [0, 1, 2, 3]
    checkpoints = sorted({0, units // 2, units}) if units else [0]
    offloads = [False, True] if accelerator else [False]
    return [Policy(s, c, o) for s in stages for c in checkpoints for o in offloads]
