"""Memory policies under DP: profile the real model, predict peak memory and step time for each
policy (ZeRO stage, activation checkpointing, optimizer offload), and rank those that fit.

    prof = dpzero.planner.profile(make_model, inputs, targets, loss_fn, clipping="flat")
    for row in dpzero.planner.plan(prof, world=2, budget_bytes=8 << 30):
        print(row.policy, row.peak_bytes, row.step_s)

Notes [planner profile] (profile.py), [planner memory model] and [planner time model]
(model.py); ``dpzero plan`` is the command line; ``make_private(..., policy="auto")`` uses it.
"""

from .measure import Tracked, tracked
from .model import Prediction, plan, predict
from .policy import Policy, candidates
from .profile import Profile, UnitProfile, measure_collectives, profile

__all__ = ["Policy", "Prediction", "Profile", "Tracked", "UnitProfile", "candidates",
           "measure_collectives", "plan", "predict", "profile", "tracked"]
