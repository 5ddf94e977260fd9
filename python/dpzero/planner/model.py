"""The memory and time model: a profile (Note [planner profile]) and a policy -> peak bytes per
rank and step time.

Note [planner memory model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Peak live bytes on one rank = between + workspace + transient, where

  between    the model state held between steps, by ZeRO's formulas (Rajbhandari et al. 2020,
             §5.1; src/zero/memory.h) with Ψ parameters, W ranks, p bytes per compute parameter,
             K optimizer bytes per parameter (fp32 master included under mixed precision):
               parameters  Ψ p (stages 0-2), Ψ p / W (stage 3)
               gradients   4 Ψ (stages 0-1: the fp32 buffer persists); 0 in stages 2-3, whose
                           reduced shard lives only from the first reduction to the step and is
                           in the transient
               optimizer   K Ψ (stage 0), K Ψ / W (stages 1-3); 0 on the device under offload
  workspace  what else stays allocated between steps, as profiled (Note [planner profile]);
  transient  the step's peak above that, as profiled at the policy's stage (stages 1-3 on the
             planned ranks; stage 0 takes stage 1's) with no / every unit checkpointed; for the
             first k units checkpointed, interpolated by the activation bytes checkpointing
             frees, sum_{u < k} (saved_u - input_u) over the same sum for all units;
  gathered   a shape profile's stage-3 estimate of the units gathered at the peak,
             p (Ψ_root + 2 max_u Ψ_u) (a measured profile has them in stage 3's transient).
  noise_history  with bands b > 1 (banded correlated noise, src/dp/correlated_noise.h), the
             b − 1 previous noise vectors of what the rank updates: 4 (b − 1) Ψ at stage 0,
             4 (b − 1) Ψ / W at stages 1-3, float32. Not profiled (the probes run DP-SGD).

Why per stage: the peak holds the activations, the loss's temporaries and the DP book's A and G
at every stage, but what else is live then differs — stage 2 holds the reduced gradient shards
and the packed unit gradients in flight, stage 1 neither (its 4Ψ buffer is model state), stage 3
the gathered units, which are not small: the root unit (embeddings and head, gathered through
the whole forward) alone holds 18-40% of the CPU grid's GPT shapes. Carried over from the
stage-2 profile, stage 3 was under-predicted by up to 19% and stage 1 with checkpointing
over-predicted by 17% (experiments/results/plan-cpu.md, before per-stage probes).

Note [planner time model]
~~~~~~~~~~~~~~~~~~~~~~~~~
Step time of one micro-batch = compute + recompute + optimizer + collectives:
  compute    forward + backward as profiled without checkpointing (per-rank share of the cores),
             less the profile's own collectives (below, at its stage and W);
  recompute  (profiled time with every unit checkpointed - without) x the checkpointed units'
             share of the units' forward time;
  optimizer  the profiled step, rescaled from the probes' share of the parameters to the
             policy's (all of Ψ in stage 0, Ψ / W in stages 1-3);
  collectives  bytes each rank sends over the profiled all-gather bandwidth B, plus a latency
             per collective (one per unit and direction), with (W - 1)/W of the data leaving:
               stage 0   all-reduce of the fp32 gradients: 2 (W-1)/W 4Ψ
               stages 1-2  reduce-scatter of the gradients and all-gather of the updated
                         parameters: (W-1)/W (4Ψ + pΨ)
               stage 3   reduce-scatter, and an all-gather of each unit before its forward and
                         again before its backward: (W-1)/W (4Ψ + 2pΨ)
Nothing overlaps in the model (the engine overlaps reductions with the backward on GPU), so on
GPU it is an upper bound; the ranking is what the planner uses.

Ranking: the policies that fit the budget first, fastest first; among equal times the one that
checkpoints fewer units, then the one without optimizer offload (whose host transfers the model
does not time), then the one with less memory: a cost the model cannot see is not taken for
memory the budget does not need. Equal times between checkpointing and
not arise when the two profiled compute times differ by less than their noise (a small model):
the measured difference is then <= 0 and recompute is 0. Checkpointing still runs a unit's
forward twice, only by less than could be measured, so it cannot be the faster choice; ranked by
memory alone it won the tie, and policy='auto' checkpointed on a budget where nothing had to be.
The plain forward of a unit is no floor for recompute: under DP the measured difference was below
it (gpt-6x512 flat, one rank: 179 ms against 243 ms of plain unit forwards; non-reentrant
checkpointing stops recomputing once the backward's saved tensors are back, and the DP layers'
book holds their inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .policy import Policy
from .profile import Profile
from .state import state_between


@dataclass
class Prediction:
    policy: Policy
    peak_bytes: int                      # on the device, per rank
    host_bytes: int                      # offloaded state in host memory, per rank
    step_s: float                        # one micro-batch step
    memory: Dict[str, int] = field(default_factory=dict)
    time: Dict[str, float] = field(default_factory=dict)


def _freed_share(profile: Profile, k: int) -> float:
    units = profile.units
    k = min(k, len(units))
    total = sum(max(u.saved_bytes - u.input_bytes, 0) for u in units)
    if total <= 0 or k == 0:
        return 0.0
    return sum(max(u.saved_bytes - u.input_bytes, 0) for u in units[:k]) / total


def _forward_share(profile: Profile, k: int) -> float:
    units = profile.units
    total = sum(u.forward_s for u in units)
    if total <= 0 or k == 0:
        return 0.0
    return sum(u.forward_s for u in units[:min(k, len(units))]) / total


def _collectives(profile: Profile, stage: int, world: int, bandwidth) -> float:
    """Note [planner time model]: seconds of one step's collectives on ``world`` ranks."""
    if world == 1:
        return 0.0
    if not bandwidth:  # no measured bandwidth (a shape profile): the time is unknown
        return math.nan
    bw, latency = bandwidth
    psi, p, frac = profile.params, profile.param_bytes, (world - 1) / world
    volume = {0: 2 * frac * 4 * psi, 1: frac * (4 + p) * psi, 2: frac * (4 + p) * psi,
              3: frac * (4 + 2 * p) * psi}[stage]
    calls = len(profile.units) + 1
    count = {0: calls, 1: 2 * calls, 2: 2 * calls, 3: 3 * calls}[stage]
    return volume / bw + count * latency


def predict(profile: Profile, policy: Policy, world: int,
            bandwidth: Optional[tuple] = None, bands: int = 1) -> Prediction:
    """Note [planner memory model] and Note [planner time model] for ``policy`` on ``world``
    ranks. ``bandwidth``: (bytes/s, latency s) of the collectives; default the profile's for
    this world size, else none (world 1). ``bands``: the run's (make_private's)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if policy.checkpointed > len(profile.units):
        raise ValueError(f"policy checkpoints {policy.checkpointed} units, the model has "
                         f"{len(profile.units)}")
    psi, p, k_opt, w, s = profile.params, profile.param_bytes, profile.optimizer_bytes, world, \
        policy.stage
    memory = state_between(psi, p, k_opt, s, w, policy.offload_optimizer)
    host = state_between(psi, p, k_opt, s, w)["optimizer"] if policy.offload_optimizer else 0
    share = _freed_share(profile, policy.checkpointed)
    # the transient profiled at this stage (stage 0 on several ranks: stage 1's, which also
    # reduces a persistent gradient buffer at the step), else at the probes' own stage
    measured = profile.transient_at.get(1 if s == 0 else s) if s != profile.stage else None
    t = measured or profile.transient
    t0, t_all = t["none"], t["all"]
    memory.update(workspace=profile.workspace,
                  transient=int(round(t0 - (t0 - t_all) * share)),
                  gathered=profile.gathered if s == 3 and measured is None else 0)
    if bands > 1:
        memory["noise_history"] = 4 * (bands - 1) * psi // (1 if s == 0 else w)
    peak = sum(memory.values())

    # The probes' own step already holds their collectives and their optimizer share: take the
    # one out of the compute, rescale the other to the policy's.
    bw = bandwidth or profile.bandwidth.get(w) or profile.bandwidth.get(profile.world)
    probes_comm = _collectives(profile, profile.stage, profile.world, bw)
    compute = max(profile.compute_s["none"] - probes_comm, 0.0)
    recompute = max(profile.compute_s["all"] - profile.compute_s["none"], 0.0) * \
        _forward_share(profile, policy.checkpointed)
    held = lambda stage, ranks: 1.0 if stage == 0 else 1.0 / ranks  # noqa: E731
    opt_time = profile.optimizer_s * held(s, w) / held(profile.stage, profile.world)
    timing = dict(compute=compute, recompute=recompute, optimizer=opt_time,
                  collectives=_collectives(profile, s, w, bw))
    return Prediction(policy, peak, host, sum(timing.values()), memory, timing)


def plan(profile: Profile, world: int, budget_bytes: Optional[float], accelerator: bool = False,
         bandwidth: Optional[tuple] = None, bands: int = 1) -> List[Prediction]:
    """Every candidate policy's prediction, those within ``budget_bytes`` (None: no limit)
    first, fastest first; among equal times the one checkpointing fewer units, then the one
    without offload, then the one with less memory (Note [planner time model])."""
    from .policy import candidates

    out = [predict(profile, pol, world, bandwidth, bands)
           for pol in candidates(len(profile.units), world, accelerator)]
    fits = lambda r: budget_bytes is None or r.peak_bytes <= budget_bytes  # noqa: E731
    return sorted(out, key=lambda r: (not fits(r), r.step_s, r.policy.checkpointed,
                                      r.policy.offload_optimizer, r.peak_bytes))
