"""``DPOptimizer``: the optimizer of a private model, a real ``torch.optim.Optimizer``.

The update itself runs in the ZeRO state (``src/zero/``: a sharded fp32 optimizer, op for op
torch.optim's); this class is torch's interface to it, so that what an ordinary training script
does with its optimizer works unchanged:

* ``param_groups`` holds torch's own keys for SGD, Adam or AdamW. When the caller
  handed ``make_private`` a torch optimizer, it IS that optimizer's list (as Opacus's DPOptimizer
  shares it), so an LR scheduler built on either drives the private step. Its groups may differ
  in weight_decay alone, and then those with weight_decay 0 are exempt from it (Note [weight
  decay runs] in src/zero/optim.h). Whatever a scheduler or
  the caller writes there (``lr``, ``momentum``, ``betas``, ``weight_decay``, ...) is handed to the
  engine at the next private step (Note [hyperparameters at the step]).
* ``step()`` takes a private step after the last micro-batch of a logical batch and only
  accumulates before it (Opacus's semantics with BatchMemoryManager); it returns whether a step
  was taken, or the closure's loss when given one. torch's step hooks run around it.
* ``zero_grad(set_to_none=...)`` drops the accumulated clipped sums of a finished step and keeps
  what the current logical batch accumulated (private gradients are never in ``.grad``).
* ``state_dict()`` / ``load_state_dict()`` are torch's format: per-parameter state by index
  (``momentum_buffer``; ``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) and the group's
  hyperparameters (a scheduler's ``initial_lr`` included). The state lives sharded in the engine;
  both calls gather or scatter it, so with several ranks every rank calls them (as FSDP's full
  optimizer state dict); ``dpzero.checkpoint`` saves shards without gathering.

Note [hyperparameters at the step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch.optim reads its hyperparameters from ``param_groups`` at every ``step()``; schedulers rely
on it (OneCycleLR cycles ``momentum`` or ``betas`` along with ``lr``). The engine keeps its own
copy (``ShardOptimizer::set_options``), refreshed from ``param_groups`` in every private step
before anything is charged: a bad value (a negative lr, amsgrad switched on mid-run) is refused
with nothing charged or applied. Hyperparameters do not depend on the data, so they need no
privacy reasoning; every rank must set the same ones (schedulers are deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from .config import decay_groups
from .slots import Slots


@dataclass(frozen=True)
class EngineLink:
    """What the optimizer needs of its engine beyond the public figures (σ, C, q, N), handed to
    it when the engine attaches."""
    trainable: List[torch.nn.Parameter]  # the parameters the engine trains, fixed at attach
    step: Callable[[], bool]             # the private step, or accumulate: whether one was taken
    zero_grad: Callable[[], None]        # optimizer.zero_grad()'s meaning (module docstring)
    drop_batch: Callable[[], None]       # drops the logical batch, charging nothing
    between_steps: Callable[[str], None]  # raises on every rank unless all are between steps
    slots: Slots                         # where each parameter's state lives
    sharded: Any                         # the ShardedModule (its ZeRO state: .zero_state)

# torch's optimizer class and the hyperparameters the engine takes from its param group.
_TORCH_CLASS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
_HYPER = {
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
    "adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"),
    "adamw": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"),
}


def torch_defaults(kind: str, settings: Dict[str, Any]) -> Dict[str, Any]:
    """torch's defaults dict for ``kind`` with ``settings`` (engine kwargs) applied, checked by
    torch's own constructor."""
    hyper = {k: v for k, v in settings.items() if k in _HYPER[kind]}
    return dict(_TORCH_CLASS[kind]([torch.zeros(1, requires_grad=True)], **hyper).defaults)


class DPOptimizer(torch.optim.Optimizer):
    """The optimizer of a private model (module docstring): ``make_private`` builds it."""

    # torch.amp.GradScaler.step then hands this optimizer the scale (as ``grad_scale``) instead
    # of unscaling .grad (which private parameters do not have): step() refuses it, naming why.
    _step_supports_amp_scaling = True

    def __init__(self, engine, link: EngineLink, kind: str, settings: Dict[str, Any],
                 original: Optional[torch.optim.Optimizer] = None) -> None:
        self._engine = engine  # its public figures
        self._link = link
        self._kind = kind
        self._building = True
        defaults = dict(original.defaults) if original is not None else torch_defaults(
            kind, settings)
        super().__init__(list(link.trainable), defaults)
        self._building = False
        if original is not None:
            self.param_groups = original.param_groups  # shared (module docstring)
        # The groups whose parameters the engine exempts from weight decay (fixed at attach).
        self._exempt_groups = decay_groups(self.param_groups)[0]
        for group in self.param_groups:
            for key in _HYPER[kind]:
                if key in settings and key != "weight_decay":
                    group[key] = settings[key]
        if "weight_decay" in settings and len(self.param_groups) == 1:
            self.param_groups[0]["weight_decay"] = settings["weight_decay"]

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if not self._building:
            raise ValueError("DPOptimizer's parameter groups are fixed when make_private "
                             "attaches (the engine shards the parameters it was given then); "
                             "give make_private an optimizer holding every parameter to train")
        super().add_param_group(param_group)

    # ---- the step ----------------------------------------------------------------------------

    def step(self, closure=None):
        """A private step after the logical batch's last micro-batch (else accumulate only).
        Returns the closure's loss when given a closure (run once, with gradients enabled),
        else whether a private step was taken."""
        if getattr(self, "grad_scale", None) is not None:  # set by torch.amp.GradScaler.step
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            self._link.drop_batch()
            raise ValueError(
                "torch.amp.GradScaler cannot drive a private step: the loss scale multiplies "
                "every per-sample gradient before clipping, so examples would be clipped at "
                "max_grad_norm / scale. Use bf16 autocast (no scaler needed), or fp16 autocast "
                "without a GradScaler (per-sample norms and clipped sums are fp32). The batch "
                "was dropped and nothing was charged; call zero_grad() to go on")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        taken = self._link.step()
        return loss if closure is not None else taken

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the clipped sums of the last step (both ways: private gradients are never in
        ``.grad``, so there is nothing to set to None or to zero there)."""
        self._link.zero_grad()

    def engine_options(self) -> Dict[str, Any]:
        """The hyperparameters of ``param_groups`` for ``ZeroState.set_optimizer_options`` (Note
        [hyperparameters at the step]); ValueError naming a bad entry, a group that differs from
        the first in anything but weight_decay, or a weight_decay that would move the exemption
        fixed at attach."""
        groups = self.param_groups
        out: Dict[str, Any] = {}
        for key in _HYPER[self._kind]:
            if key == "weight_decay":
                continue
            out[key] = self._parse(0, key)
            for i in range(1, len(groups)):
                if self._parse(i, key) != out[key]:
                    raise ValueError(
                        f"optimizer.param_groups[{i}][{key!r}] = {groups[i].get(key)!r} differs "
                        f"from param_groups[0][{key!r}] = {groups[0].get(key)!r}: dpzero's "
                        "sharded optimizer applies one value of every hyperparameter but "
                        "weight_decay")
        for i in range(len(groups)):
            self._parse(i, "weight_decay")
        exempt, decay = decay_groups(groups)
        if decay != 0.0 and tuple(exempt) != tuple(self._exempt_groups):
            raise ValueError(
                f"optimizer.param_groups weight_decay = "
                f"{[g['weight_decay'] for g in groups]}: the groups exempt from weight decay "
                f"were fixed at make_private as {list(self._exempt_groups)} (those with "
                "weight_decay 0 then); keep their weight_decay at 0 and the others' equal")
        out["weight_decay"] = decay
        return out

    def _parse(self, i: int, key: str):
        value = self.param_groups[i].get(key)
        try:
            if key == "betas":
                return (float(value[0]), float(value[1]))
            if key in ("nesterov", "amsgrad", "maximize"):
                return bool(value)
            return float(value)
        except (TypeError, ValueError, IndexError):
            raise ValueError(f"optimizer.param_groups[{i}][{key!r}] = {value!r} is not a "
                             f"valid {self._kind} hyperparameter") from None

    def _indexed(self):
        """[(torch's state-dict index, parameter)] over ``param_groups`` in order, the
        parameters the engine trains only (a frozen one has no state)."""
        out, i = [], 0
        for group in self.param_groups:
            for p in group["params"]:
                if p in self._link.slots:
                    out.append((i, p))
                i += 1
        return out

    # ---- state -------------------------------------------------------------------------------

    @property
    def noise_multiplier(self) -> float:
        return self._engine.noise_multiplier

    @property
    def max_grad_norm(self) -> float:
        return self._engine.max_grad_norm

    @property
    def expected_batch_size(self) -> float:
        return self._engine.sample_rate * self._engine.dataset_size

    def state_dict(self) -> Dict[str, Any]:
        """torch's optimizer state dict (module docstring); a collective with several ranks."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        slots, zero = self._link.slots, self._link.sharded.zero_state
        indexed = self._indexed()
        units = sorted({slots.unit(p) for _, p in indexed})
        gathered = {u: zero.gathered_state(u) for u in units}  # every rank, same order
        state: Dict[int, Dict[str, torch.Tensor]] = {}
        for i, p in indexed:
            unit = slots.unit(p)
            steps = zero.optimizer_steps(unit)
            entries = {name: slots.read(flat, p).to(p.device).clone()
                       for name, flat in gathered[unit].items() if name != "param"}
            if steps == 0 and not entries:
                continue  # torch.optim creates state at the first step
            if self._kind != "sgd":
                entries["step"] = torch.tensor(float(steps))
            state[i] = entries
        groups, start = [], 0
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(saved)
        out = {"state": state, "param_groups": groups}
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, out)
            if result is not None:
                out = result
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores ``state_dict()``'s hyperparameters and per-parameter state into the engine
        (a collective with several ranks; call between steps: a logical batch accumulated so far
        is dropped). Parameter values are the model's (load them with its state dict)."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        slots, zero = self._link.slots, self._link.sharded.zero_state
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise ValueError(f"load_state_dict: expected {len(self.param_groups)} parameter "
                             f"groups, got {len(groups) if isinstance(groups, list) else groups!r}")
        for g, (theirs, mine) in enumerate(zip(groups, self.param_groups)):
            if len(theirs.get("params", ())) != len(mine["params"]):
                raise ValueError(f"load_state_dict: group {g} of the state dict has "
                                 f"{len(theirs.get('params', ()))} parameters, this optimizer's "
                                 f"{len(mine['params'])}")
        saved_keys = [key for group in groups for key in group["params"]]
        indexed = self._indexed()
        saved = state_dict.get("state", {})
        names = None
        per_unit: Dict[int, list] = {}
        for i, p in indexed:
            per_unit.setdefault(slots.unit(p), []).append((i, p))
        self._link.between_steps("load_state_dict")  # collective: every rank or none
        loaded: Dict[int, tuple] = {}
        for u in sorted(per_unit):
            current = zero.gathered_state(u)  # collective; also the parameter values kept
            flats: Dict[str, torch.Tensor] = {}
            steps = None
            for i, p in per_unit[u]:
                key = saved_keys[i]  # the saved index (a str after a JSON round trip)
                entry = saved.get(key, saved.get(str(key), {}))
                entry = {k: v for k, v in entry.items() if v is not None}
                here = sorted(k for k in entry if k != "step")
                if names is None:
                    names = here
                if here != names:
                    raise ValueError(f"load_state_dict: parameter {i} has state {here}, "
                                     f"parameter 0 has {names}")
                if "step" in entry:
                    s = int(float(entry["step"]))
                    if steps is not None and s != steps:
                        raise ValueError(f"load_state_dict: parameter {i} is at step {s}, "
                                         f"others at {steps}")
                    steps = s
                for name in here:
                    t = entry[name]
                    if tuple(t.shape) != tuple(p.shape):
                        raise ValueError(f"load_state_dict: state {name!r} of parameter {i} "
                                         f"has shape {tuple(t.shape)}, the parameter "
                                         f"{tuple(p.shape)}")
                    slots.write(flats.setdefault(name, torch.zeros_like(current["param"])), p, t)
            if steps is None:  # SGD keeps no step: a momentum buffer means it has stepped
                steps = max(zero.optimizer_steps(u), 1) if flats else 0
            loaded[u] = (dict(flats, param=current["param"]), steps)
        for u, (entries, steps) in loaded.items():
            slots.load_unit(u, entries, steps)
        for saved_group, group in zip(groups, self.param_groups):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)
