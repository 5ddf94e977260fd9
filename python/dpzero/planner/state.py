"""Model-state bytes one rank holds between steps, by ZeRO stage (Note [planner memory model] in
model.py; Rajbhandari et al. 2020, "ZeRO", Figure 1: Ψ parameters, K bytes of optimizer
state per parameter, N_d ranks). Its own module because both the planner's model (model.py) and
the profile (profile.py), which measures the workspace against it, need it."""

from __future__ import annotations

import math
from typing import Dict


def state_between(psi: int, p: int, k_opt: int, stage: int, world: int,
                  offload: bool = False) -> Dict[str, int]:
    """{parameters, gradients, optimizer} bytes per rank: ``psi`` parameters of ``p`` bytes,
    ``k_opt`` optimizer bytes per parameter, ZeRO ``stage`` over ``world`` ranks, the optimizer
    state in host memory when ``offload``."""
    params = psi * p if stage < 3 else math.ceil(psi / world) * p
    grads = 4 * psi if stage <= 1 else 0
    optimizer = k_opt * psi if stage == 0 else math.ceil(k_opt * psi / world)
    if offload:
        optimizer = 0
    return dict(parameters=params, gradients=grads, optimizer=optimizer)
