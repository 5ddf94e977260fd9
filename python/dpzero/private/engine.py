"""``make_private`` and ``PrivacyEngine``: DP-SGD under ZeRO sharding (design.md §2, one step).

One logical step t, top to bottom:

1. ``DPDataLoader`` yields this rank's micro-batches of the Poisson batch of step t (``data.py``;
   every rank yields as many, short ranks empty ones).
2. forward / ``loss.backward()`` per micro-batch: DP layers hand (A, G) to the clipping book
   (``book.py``), which puts clipped sums into the engine's gradient buffers, unit by unit.
3. ``optimizer.step()`` after the last micro-batch of t (earlier calls only accumulate, as
   Opacus's BatchMemoryManager) runs the step's transaction in C++ (``src/dp/private_step.h``):
   the ranks agree, the budget guard, the ledger record (rank 0, durable; all ranks wait for it),
   the accountant charge with the sigma and q used, then the ZeRO update with the step's noise
   sigma*C*z(seed, k, j) on exactly the owned coordinates, k = the charge index (Note [noise
   index]), scale 1/(q*N), update.

Note [released figures]
~~~~~~~~~~~~~~~~~~~~~~~
ε covers what the mechanism releases: the noisy updates, and so the model and anything computed
from it alone. A run's other outputs must carry only figures that do not depend on the training
data, or that the mechanism protects (design.md §3): ε, δ, σ, q, C, the number of steps, the
expected batch size q·N, who sampled the batches. The ledger, the report, the progress bar, logs,
``last_step`` and warnings are held to that. What a step realised — the logical batch's size, the
rows the layers saw, whether and how many samples were dropped for a NaN/Inf loss or gradient —
and the training loss depend on the data without noise: they are data-dependent diagnostics
(``last_step_diagnostics``, the ``diagnostics_path`` file), whose first line says so. Realised
batch sizes leak membership under add/remove neighbours; even one bit of "some example was
dropped", shown as a warning, says whether a NaN-producing record was sampled, so no warning or
log line depends on it.

The noise index k is the step's charge index (Note [noise index] in src/dp/private_step.h).
"""

from __future__ import annotations

import functools
import json
import math
import os
import weakref
from typing import Any, Dict, NamedTuple, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

from .. import _C, lifetime
from ..data import PoissonBatchSampler
from ..accounting import Ledger, create_accountant
from ..noise import NoiseSource
from ..zero import default_process_group, default_units, shard
from . import checkpointing, opacus_entry, strict
from .attach import assign_components, find_layers, guard_hooks, param_slots, patch, unpatch
from .agreements import RankAgreements
from .book import Book
from .generators import RunGenerators
from .errors import PrivacyViolation
from .config import DEFAULT_ACCOUNTANT, PrivateConfig, resolve, run_settings, steps_per_epoch
from .provenance.examples import MicroBatchToken, tag
from .loader import DPDataLoader, MicroBatch, Schedule
from .slots import Slots
from .optimizer import DPOptimizer, EngineLink
from .provenance.root import Ranks
from .state_guard import ProbeWrites, StateGuard
from .trainable import TrainableSet, checks_alone
from . import state_dict

# Note [compiled private models]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.compile traces Python into graphs guarded on the values it saw. The private model's
# forward is nothing it may trace: the root forward's probe, the Examples tag's rules and the DP
# layers' autograd nodes (C++ functions it cannot see into) are what make each step private, and
# a graph captured from one call would replay the layers without the book's state of the next.
# So the private model's forward and the root forward are excluded from compilation
# (torch.compiler.disable): torch.compile(private_model), or a compiled function that calls it,
# runs the model eagerly with every DP layer intact: the same update as without compilation
# (tested), and no speedup inside the model. A model compiled before make_private is refused
# (its compiled code would trace into the DP layers); before, dynamo recursed without end.


class PrivateModule(nn.Module):
    """The model under DP: calls go to the wrapped module (whose DP layers are patched);
    attributes not found here are looked up on it, as Opacus's GradSampleModule does."""

    def __init__(self, module: nn.Module, engine: "PrivacyEngine") -> None:
        super().__init__()
        self._module = module
        self.__dict__["_engine_ref"] = weakref.ref(engine)
        # Note [compiled private models]: a compiled caller runs the whole call eagerly (hooks
        # included); tracing would reach the Examples tag on the inputs first. Set at the first
        # construction, not in the class body: torch.compiler.disable imports torch._dynamo,
        # which a process that never makes a model private need not load.
        if "__call__" not in PrivateModule.__dict__:
            PrivateModule.__call__ = torch.compiler.disable(nn.Module.__call__)

    def forward(self, *args, **kwargs):
        return self._module(*args, **kwargs)

    def __getstate__(self):
        _refuse_copy(self)

    def to_standard_module(self) -> nn.Module:
        """Opacus's: the wrapped module, made plain again (``PrivacyEngine.detach``: the DP
        forwards and guards removed, the engine's optimizer and loader retired)."""
        engine = self.__dict__["_engine_ref"]()
        if engine is None:
            raise RuntimeError("to_standard_module: the PrivacyEngine of this model is gone")
        return engine.detach()

    # Note [module state dicts] (state_dict.py): the wrapped module's state dict, under its own
    # names, so that it loads into the plain model; Opacus's names (``_module.`` in front, as its
    # GradSampleModule writes them) load too.
    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        return self._module.state_dict(*args, destination=destination, prefix=prefix,
                                       keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if state_dict and all(k.startswith("_module.") for k in state_dict):
            state_dict = type(state_dict)((k[len("_module."):], v) for k, v in state_dict.items())
        return self._module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_module"], name)


def _refuse_copy(model: nn.Module, *_):
    """Pickling (torch.save(model)) or copy.deepcopy of a model under make_private: refused by
    name. The model carries the engine's patched forwards and hooks, and a copy would release
    its buffers and frozen parameters without the check every release makes (Note [state
    written from data])."""
    raise PrivacyViolation(
        f"torch.save, pickle or copy.deepcopy of a {type(model).__name__} under make_private: "
        "it carries the private engine's forwards and hooks, and its state is released only "
        "through checked paths. Save model.state_dict() (checked, Note [state written from "
        "data]), copy the model before make_private, or call privacy_engine.detach() first")


class PrivateLog:
    """Note [released figures]: a data-dependent diagnostics file, one JSON line per record (rank 0;
    nothing is written without a path). Its first line says what it is: figures that depend on
    the training data, not covered by epsilon, not to be shared."""

    HEADER = {"kind": "header", "private": True,
              "warning": "PRIVATE: these figures depend on the training data and are NOT covered "
                         "by the run's epsilon (realised batch sizes, samples dropped for a "
                         "non-finite loss or gradient, training losses); do not share this file"}

    def __init__(self, path: Optional[str]) -> None:
        self.path = path
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            if not os.path.exists(path) or os.path.getsize(path) == 0:
                with open(path, "a") as f:
                    f.write(json.dumps(self.HEADER) + "\n")

    def write(self, row: Dict[str, Any]) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(dict(row, kind="step")) + "\n")


class Private(NamedTuple):
    """What ``make_private`` returns."""
    model: PrivateModule
    optimizer: DPOptimizer
    data_loader: DPDataLoader
    privacy_engine: "PrivacyEngine"


class PrivacyEngine:
    """The privacy side of a private run: accountant, ledger, noise source, clipping book.

    ``PrivacyEngine().make_private(module=, optimizer=, data_loader=, noise_multiplier=,
    max_grad_norm=)`` is the Opacus entry point (so an Opacus script switches by changing the
    import); :func:`make_private` is dpzero's own with every option. The model takes its
    batches from the returned data loader, or, for callers who sample themselves, through
    :meth:`own_batch` (Note [batch provenance]).

    ``secure_mode``: None (the default) draws the noise and the batches in secure mode (ChaCha20
    keyed from the OS) unless the run is given a seed, True asks for secure mode (no seed
    allowed), False for seeded Philox noise with a seed drawn now unless one is given (Note
    [secure by default] in privacy/entropy.h). It is settled when the model is made private.
    """

    def __init__(self, accountant: str = DEFAULT_ACCOUNTANT,
                 secure_mode: Optional[bool] = None) -> None:
        self.accountant_name = accountant
        self._accountant = create_accountant(accountant)
        self._secure_mode_asked = secure_mode
        self.secure_mode = secure_mode  # a bool from the attach on (Note [secure by default])
        self._attached = False
        self._step = None  # the step's transaction (src/dp/private_step.h), made at attach
        # policy="auto" (dpzero.make_private, front.py): the memory planner's choice, its
        # ranking, the units.
        self.memory_plan: Optional[Dict[str, Any]] = None

    # ---- Opacus-compatible entry points -------------------------------------------------------

    def make_private(self, *, module: nn.Module, optimizer, data_loader: DataLoader,
                     noise_multiplier: float, max_grad_norm: float, **kwargs):
        """Opacus's signature: its other arguments (criterion, batch_first, loss_reduction,
        poisson_sampling, clipping, noise_generator, grad_sample_mode, wrap_model, rand_on_empty;
        ``_opacus_attach`` holds their defaults, Opacus's, and Note [Opacus's arguments] in
        opacus_entry.py says what each does here) and :func:`dpzero.make_private`'s own keywords
        go in ``kwargs``. Returns (module, optimizer, data_loader), and with
        ``grad_sample_mode="ghost"`` (module, optimizer, criterion, data_loader)."""
        return self._opacus_attach(module=module, optimizer=optimizer, data_loader=data_loader,
                                   noise_multiplier=noise_multiplier,
                                   max_grad_norm=max_grad_norm, **kwargs)

    def make_private_with_epsilon(self, *, module: nn.Module, optimizer, data_loader: DataLoader,
                                  target_epsilon: float, target_delta: float, epochs: float,
                                  max_grad_norm: float, **kwargs):
        """``make_private`` with σ calibrated so that ``epochs`` epochs spend ``target_epsilon``
        at ``target_delta``, which is also the run's budget (BudgetExhausted past it)."""
        return self._opacus_attach(module=module, optimizer=optimizer, data_loader=data_loader,
                                   target_epsilon=target_epsilon, target_delta=target_delta,
                                   epochs=epochs, max_grad_norm=max_grad_norm, **kwargs)

    def _opacus_attach(self, *, module: nn.Module, criterion=None, batch_first: bool = True,
                       loss_reduction: str = "mean", poisson_sampling: bool = True,
                       clipping: str = "flat", noise_generator: Optional[torch.Generator] = None,
                       grad_sample_mode: str = "hooks", wrap_model: bool = True,
                       rand_on_empty: bool = False, **settings):
        """Both Opacus entry points: every Opacus-only argument checked before anything is
        touched (Note [Opacus's arguments]), then dpzero's own attach with ``settings``."""
        if not poisson_sampling:
            raise ValueError("poisson_sampling=False: dpzero's accounting assumes Poisson "
                             "sampling, the only sampling it implements")
        opacus_entry.check_arguments(batch_first=batch_first, grad_sample_mode=grad_sample_mode,
                                     clipping=clipping, wrap_model=wrap_model,
                                     rand_on_empty=rand_on_empty)
        ghost = grad_sample_mode == "ghost"
        loss = None
        if ghost:
            loss = opacus_entry.PrivateCriterion(
                criterion if criterion is not None else nn.CrossEntropyLoss(), loss_reduction)
        # A refused attach leaves the generator as it was, as it leaves the model.
        drawn_from = noise_generator.get_state() if isinstance(
            noise_generator, torch.Generator) else None
        settings["seed"] = opacus_entry.seed_from_generator(
            noise_generator, self._secure_mode_asked, settings.get("seed"))
        try:
            out = self._attach(module, resolve(accountant=self.accountant_name,
                                               clipping=clipping, loss_reduction=loss_reduction,
                                               **settings))
        except BaseException:
            if drawn_from is not None:
                noise_generator.set_state(drawn_from)
            raise
        model = out.model if wrap_model else opacus_entry.PrivateHooks(self, module)
        if ghost:
            return model, out.optimizer, loss, out.data_loader
        return model, out.optimizer, out.data_loader

    def save_checkpoint(self, *, path, module: nn.Module, optimizer=None, **kwargs) -> None:
        """Opacus's: the module's, the optimizer's and this engine's state dicts in one file
        (``opacus_entry.save_checkpoint``; every rank calls it, rank 0 writes)."""
        opacus_entry.save_checkpoint(self, path=path, module=module, optimizer=optimizer,
                                     **kwargs)

    def load_checkpoint(self, *, path, module: nn.Module, optimizer=None, **kwargs):
        """Opacus's: loads what ``save_checkpoint`` wrote, this engine's state last; returns the
        file's other entries (``opacus_entry.load_checkpoint``)."""
        return opacus_entry.load_checkpoint(self, path=path, module=module, optimizer=optimizer,
                                            **kwargs)

    def get_epsilon(self, delta: float) -> float:
        return self.epsilon(delta)

    @property
    def charges(self) -> int:
        """Steps charged to this run's ledger and accountant, a reopened ledger's included (the
        next step's noise index, Note [noise index] in src/dp/private_step.h)."""
        return self._step.charges if self._step is not None else 0

    @property
    def remaining_steps(self) -> Optional[float]:
        """Steps the ε budget still allows (None without a budget)."""
        if not self._attached or self.max_steps is None:
            return None
        if self.bands > 1:  # the budget is of equivalent steps, one in b (Note [banded steps])
            return max(0, self.max_steps * self.bands - self.next_step)
        return max(0, self.max_steps - self.charges)

    # ---- queries -----------------------------------------------------------------------------

    @property
    def accountant(self):
        """The run's accountant (read-only): the private step composes every charge into it in
        C++, so another one put in its place would count none of them."""
        return self._accountant

    @accountant.setter
    def accountant(self, value) -> None:
        raise AttributeError(
            "PrivacyEngine.accountant cannot be replaced: the private step charges the engine's "
            "own; choose it with PrivacyEngine(accountant='rdp' | 'prv'), or compose another "
            "accountant from accountant.history")

    def epsilon(self, delta: float) -> float:
        """ε spent so far at ``delta`` (PRV: its upper bound); inf if noise was disabled."""
        if self._attached and self.noise_multiplier == 0.0 and self.charges > 0:
            return math.inf
        return float(self.accountant.get_epsilon(delta))  # 0 before any step

    @property
    def ledger(self) -> Optional[Ledger]:
        """The run's privacy ledger on rank 0 (None on other ranks and without ledger_path)."""
        return self._ledger

    @property
    def state_guard(self) -> StateGuard:
        """The guard of the model's buffers and frozen parameters (Note [state written from
        data] in state_guard.py)."""
        return self._state

    def state_dict(self, include_secrets: bool = False) -> dict:
        """JSON-serialisable privacy state for a checkpoint: charges, sampler position,
        accountant history, σ, q, C, N. The Philox seed is included (it is what makes a seeded
        run reproducible). In secure mode nothing secret is: ``"seed"`` is None and the ChaCha20
        key is left out unless ``include_secrets=True`` asks for it (under ``"key"``; whoever
        reads it can regenerate the run's noise and sampling)."""
        state = {
            "next_step": self.next_step, "charges": self.charges, "rows": self._step.rows,
            "bands": self.bands, **self._strategy,
            "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate,
            "max_grad_norm": self.max_grad_norm, "dataset_size": self.dataset_size,
            "accountant": self.accountant_name,
            "history": [tuple(h) for h in self.accountant.history],
            "seed": None if self.secure_mode else self.noise_source.seed,
        }
        if include_secrets and self.secure_mode:
            state["key"] = self.noise_source.key
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()`` of a run with the same q, σ, C and N (checked, named;
        nothing changes on a mismatch)."""
        self.checked_load(state)()

    def checked_load(self, state: dict):
        """Every check of ``load_state_dict(state)``, with nothing changed; returns the load
        itself, to call once whatever else a checkpoint restores has been restored too
        (``PrivacyEngine.load_checkpoint`` restores the model and optimizer in between, so that
        a refused state leaves all three as they were)."""
        missing = [k for k in ("next_step", "charges", "noise_multiplier", "sample_rate",
                               "max_grad_norm", "dataset_size", "accountant", "history")
                   if k not in state]
        if missing:
            raise ValueError(f"state_dict: missing entries {missing}; is this a "
                             "PrivacyEngine.state_dict()?")
        for key in ("sample_rate", "noise_multiplier", "max_grad_norm", "dataset_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"state_dict: {key} is {state[key]}, this engine has "
                                 f"{getattr(self, key)}")
        if state.get("key") is not None and not self.secure_mode:
            raise ValueError("state_dict: holds a secure-mode key, this engine is seeded "
                             "(secure_mode=False)")
        bands, rows = int(state.get("bands", 1)), int(state.get("rows", 0))
        if bands != self.bands:
            raise ValueError(f"state_dict: bands is {bands}, this engine has {self.bands}")
        # A banded run's noise continues only with the strategy its rows were drawn with (one
        # C⁻¹z over the whole run, Note [run strategy]); a state from before the strategy was
        # recorded is of the square root's.
        if bands > 1:
            theirs = {"strategy": state.get("strategy", "sqrt_prefix_sum"),
                      "strategy_rows": state.get("strategy_rows", 0),
                      "strategy_coefficients": state.get(
                          "strategy_coefficients", self._strategy["strategy_coefficients"]
                          if self._strategy["strategy"] == "sqrt_prefix_sum" else None)}
            differs = [f"{key} is {theirs[key]!r}, this engine's {self._strategy[key]!r}"
                       for key in theirs if theirs[key] != self._strategy[key]]
            if differs:
                raise ValueError(f"state_dict: its {'; '.join(differs)}: the noise would not "
                                 "continue the run's own (Note [run strategy]); make the model "
                                 "private with the run's strategy and length")
        # A banded run's rows only grow and every charge has its own (Note [banded steps]):
        # rows >= charges, and its sampler is past them.
        if bands > 1 and ("rows" not in state or not
                          int(state["charges"]) <= rows <= int(state["next_step"])):
            raise ValueError(f"state_dict: a banded state needs charges <= rows <= next_step, got "
                             f"charges={state['charges']}, rows={state.get('rows')}, "
                             f"next_step={state['next_step']}")
        if state["accountant"] != self.accountant_name:
            raise ValueError(f"state_dict: its accountant is {state['accountant']!r}, this "
                             f"engine's {self.accountant_name!r}")
        # The history must be the charges' own: every charge at this run's (σ, q) when there is
        # noise (a σ = 0 run composes nothing), so ε can never count fewer steps than charged.
        history = [(float(sigma), float(q), int(steps)) for sigma, q, steps in state["history"]]
        charged = int(state["charges"])
        # Banded: the charges' equivalent steps (Note [amplified banded accounting]).
        equivalent = _C.accounting.equivalent_steps(charged, rows, bands)
        wanted = equivalent if self.noise_multiplier > 0.0 else 0
        if sum(steps for _, _, steps in history) != wanted or any(
                steps and (sigma, q) != (self.noise_multiplier, self.sample_rate)
                for sigma, q, steps in history):
            raise ValueError(f"state_dict: its history {history} is not {wanted} steps at "
                             f"sigma={self.noise_multiplier}, q={self.sample_rate}, the "
                             f"{charged} charges it counts" +
                             (f" over {rows} steps of bands={bands}" if bands > 1 else ""))
        # With a ledger, every charge this engine counts is a record of it (the record is written
        # before the charge), so a state that counts more charges than the ledger holds comes
        # from another run's ledger: continuing would leave those steps out of the durable
        # record ε is recomputed from.
        if self.config.ledger_path is not None and int(state["charges"]) > self.charges:
            raise ValueError(
                f"state_dict: the run it comes from charged {int(state['charges'])} steps, but "
                f"this engine's ledger {self.config.ledger_path} holds {self.charges}; make "
                "private with the ledger_path of the run that wrote it, so that its ledger keeps "
                "counting every step")
        # Note [noise index]: never go back to a charge index (or sampler step) already used —
        # a ledger reopened at attach may be ahead of the checkpoint.
        accountant = None
        if charged >= self.charges and rows >= self._step.rows:  # the history, checked above
            accountant = create_accountant(self.accountant_name)
            if wanted:
                accountant.step(noise_multiplier=self.noise_multiplier,
                                sample_rate=self.sample_rate, num_steps=wanted)
        # Every check has passed: nothing above changed the engine. The key last of all, so a
        # refused state never leaves another run's key behind (its noise at this run's charge
        # indices would repeat that run's).
        key = None if state.get("key") is None else [int(w) for w in state["key"]]
        next_step = int(state["next_step"])

        def load() -> None:
            if key is not None:
                self._step.set_noise_key(key)  # checks it first: sampling and noise use one key
                self.noise_source._key = key
            if accountant is not None:
                self._step.restore(charged, accountant.native, rows)
                self._accountant = accountant
            self._next_step = max(next_step, self.charges, self._step.rows)
        return load

    def accept_state_change(self, names=None) -> None:
        """Note [state written from data]: takes the model's buffers and frozen parameters as they
        are now (``names``: only these, dotted as in ``model.state_dict()``) as its state, which
        every step and every release then verifies. Only for a write that holds nothing of the
        training data, e.g. a value computed from the released model or from public data;
        ``model.load_state_dict()`` and ``dpzero.checkpoint.load`` accept what they load by
        themselves. Call it between steps, on every rank."""
        self._check_attached()
        self._state.accept(names)

    def _verify_release(self, what: str, collective: bool = True) -> None:
        """Note [state written from data]: raises PrivacyViolation before ``what`` releases the
        model's state if a buffer or frozen parameter changed. ``collective``: the release is a
        collective (a checkpoint, a gathering state_dict), so every rank refuses when one
        does."""
        error = None
        try:
            self._state.verify_release(what)
        except PrivacyViolation as e:
            error = e
        if collective and self.world_size > 1:
            agree = self.agreements
            if agree.collective(f"agreeing on {what}", agree.any_rank, error is not None) \
                    and error is None:
                error = PrivacyViolation(f"{what} is refused: the model state of another rank "
                                         "changed since make_private (its error names it)")
        if error is not None:
            raise error

    # ---- construction ------------------------------------------------------------------------

    def _attach(self, model: nn.Module, config: PrivateConfig) -> Private:
        """Makes ``model`` train privately as ``config`` (config.py) says."""
        if self._attached:
            raise RuntimeError("this PrivacyEngine is already attached to a model")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        c = self.config = config
        q, n, sigma, max_grad_norm = (c.sample_rate, c.dataset_size, c.noise_multiplier,
                                      c.max_grad_norm)
        units, process_group, clipping = c.units, c.process_group, c.clipping
        # Note [secure by default] (privacy/entropy.h) from what was asked, at each attach.
        settings = run_settings(c, self.accountant_name, self._secure_mode_asked)

        # Validation before anything is touched (a rejected model stays as it was); the settings'
        # own rules run in start_run below, on every rank, still before the model is sharded.
        trainable = {id(p): p for p in model.parameters() if p.requires_grad}
        if not trainable:
            raise ValueError("the model has no trainable parameters")
        _refuse_compiled(model)
        _check_optimizer_params(model, trainable, c.torch_optimizer)
        layers_of = strict.find_layer if c.isolation == "strict" else find_layers
        probe = layers_of(model, {pid: None for pid in trainable})  # names bad modules
        checkpointing.check_reentrant(model)
        checkpointed = checkpointing.resolve(
            model, c.activation_checkpointing,
            units if units is not None else default_units(model))
        self._clip_groups(probe, assign_components(probe), clipping, c.clipping_groups,
                          c.group_weights, max_grad_norm)
        self._group = (process_group if process_group is not None
                       else default_process_group("dpzero.make_private"))
        self.agreements = agree = RankAgreements(self._group, lambda: self.next_step)
        self.rank, self.world_size = agree.rank, agree.world_size
        # Every rank must clip, sample, scale, draw and budget alike (rank 1 with a larger C would
        # clip at its own C while rank 0's ledger records rank 0's), and take the same collective
        # path below: the run's rules (Note [one set of rules] in src/dp/run.h) agree on the
        # settings, then settle the randomness, the ledger and the budget.
        run = agree.collective("agreeing on the privacy settings", agree.start_run, settings, {
            "clipping_groups": c.clipping_groups, "group_weights": c.group_weights,
            "isolation": c.isolation}, self.accountant.native)
        self.secure_mode = run.secure
        self.noise_multiplier_, self.max_grad_norm_ = sigma, max_grad_norm
        # Read-only (properties below): the sampler reads them at every epoch, and the private
        # step fixed its own copies, which must never disagree with what it samples.
        self._sample_rate, self._dataset_size, self._bands = q, n, c.bands
        # Note [run strategy] (src/dp/run.h): the coefficients every rank's noise uses.
        self._strategy = {"strategy": c.strategy, "strategy_rows": c.strategy_rows,
                          "strategy_coefficients": list(run.strategy)} if c.bands > 1 else {}
        self.noise_source = NoiseSource.of_run(run)
        self._ledger = Ledger(run.ledger) if run.ledger is not None else None
        first_step = run.first_step  # past every charge and every step the ledger holds
        self.budget = (c.epsilon_budget, c.budget_delta) if c.epsilon_budget is not None else None
        self.max_steps = run.max_steps

        sharded = shard(model, stage=c.zero_stage, optimizer=c.optimizer,
                        process_group=process_group, grad_scale=1.0, param_dtype=c.param_dtype,
                        reduce_dtype=torch.float32, units=units, grad_hooks=False,
                        **dict(c.optimizer_options,
                               weight_decay_exempt=_decay_exempt_names(model, c)))
        # Note [private gradients] (src/zero/unit.h): gradients reach the step only from the
        # clipping; no .grad views, so nothing written to a parameter's .grad is released.
        sharded.zero_state.set_private(True)
        slot_of, unit_numel, unit_device = param_slots(sharded)
        self.slots = Slots(slot_of, sharded, self._check_between_steps,
                           lambda: self._state.clean_trained(),
                           lambda clean: self._state.record_trained(clean=clean))
        layers = layers_of(model, slot_of)
        n_components = assign_components(layers)
        groups, thresholds = self._clip_groups(layers, n_components, clipping,
                                               c.clipping_groups, c.group_weights, max_grad_norm)
        self.sharded = sharded
        self.module = model
        self.layers = layers
        self.book = Book(layers, groups, thresholds,
                         "automatic" if clipping == "automatic" else "flat", c.automatic_gamma,
                         c.loss_reduction, sharded.zero_state, unit_numel, unit_device)
        book_ref = weakref.ref(self.book)
        self._step = _C.dp.PrivateStep(self.book.core, sharded.zero_state, settings, run,
                                       self.accountant.native)
        # Note [batch provenance]: at stage 3 the probe's forward gathers units, so all ranks
        # probe when one must (at stages 0-2 a forward has no collectives); with several ranks
        # every rank refuses a forward when one does.
        several = self.world_size > 1
        ranks = Ranks(
            probe=((lambda need: agree.collective("agreeing on a probe", agree.any_rank, need))
                   if sharded.stage == 3 and several else (lambda need: need)),
            refusals=((lambda refused: agree.collective(
                "agreeing on a refusal", agree.all_reduce, [int(refused)])[0])
                if several else (lambda refused: int(refused))),
            world=self.world_size)
        devices = sorted({d.index or 0 for d in unit_device if d.type == "cuda"})
        self.isolation = c.isolation
        if c.isolation == "strict":  # Note [strict isolation]
            self._strict = strict.patch(
                model, lambda original: strict.Strict(model, original, layers[0], devices),
                book_ref, ranks)
        else:
            patch(model, layers, book_ref, ranks, devices)
        self._checkpointed = checkpointing.apply(model, checkpointed)
        self._guards = guard_hooks(model, book_ref)
        self._trainable_set = TrainableSet(model, list(trainable.values()))  # checked each step
        self._trainable = self._trainable_set.params
        # Note [state written from data]: buffers and frozen parameters are fixed now, verified
        # at every step and at every release (state_dict, checkpoints, detach).
        # At stage 3 the trained parameters are watched while gathered instead (Note [writes to
        # a gathered unit] in src/zero/flat_param.h).
        gathered = None if sharded.stage < 3 else (
            sharded.zero_state, [[n for n, _, _ in members] for _, members in sharded.unit_members])
        self._state = StateGuard(model, self._trainable_set, watch_trained=sharded.stage < 3,
                                 gathered=gathered)
        self.book.restore_state = self._state.restore_buffers
        self.book.watch_state = functools.partial(ProbeWrites, model, self._trainable_set.ids)
        sharded.release_check = self._verify_release
        # Note [the model's own randomness]: a checkpoint saves states nothing draws from.
        sharded.rng_states = lambda: self._generators.saved_states(self.next_step)
        sharded.state_loaded = self._state.accept
        self._state_dict_hooks = state_dict.register(
            model, sharded=sharded, slots=self.slots, guard=self._state,
            verify_release=self._verify_release)
        lifetime.track(self, PrivacyEngine._release_at_exit)  # Note [ending a script]
        model.__dict__["__getstate__"] = functools.partial(_refuse_copy, model)
        self.clipping = clipping
        self.loss_reduction = c.loss_reduction
        # Note [noise index]: the sampler's step and the noise index never repeat a charged one.
        self._next_step, self.steps_taken = first_step, 0
        # What a step released (data-independent) and its data-dependent diagnostics (Note [released
        # figures]).
        self.last_step: Optional[Dict[str, int]] = None
        self.last_step_diagnostics: Optional[Dict[str, Any]] = None
        self._diagnostics = PrivateLog(c.diagnostics_path if self.rank == 0 else None)
        self._micro: Optional[MicroBatch] = None  # the micro-batch handed out last
        # Note [the model's own randomness] (src/dp/generators.h): dropout's and augmentations'
        # draws keyed by the run's secret, not by torch's (public) seed.
        self._generators = RunGenerators(self.noise_source.sampler_seed, self.rank)
        self._skipped_step = False  # the last step() only accumulated (Opacus's semantics)
        self._detached = False
        epoch_steps = steps_per_epoch(q, c.bands)
        self.model = PrivateModule(model, self)
        if self.isolation == "strict":
            self._strict.outer = self.model
        self._optimizer_kind = c.optimizer
        link = EngineLink(trainable=list(self._trainable), step=self._optimizer_step,
                          zero_grad=self._zero_grad, drop_batch=self._drop_batch,
                          between_steps=self._check_between_steps, slots=self.slots,
                          sharded=sharded)
        self.optimizer = DPOptimizer(self, link, c.optimizer, c.optimizer_options,
                                     c.torch_optimizer)
        schedule = Schedule(
            sample_rate=q, sampler=self._sampler, next_step=lambda: self.next_step,
            begin_micro_batch=self._begin_micro_batch, reseed=self._generators.reseed,
            worker_init=self._generators.workers(),
            agree=lambda what, values: agree.collective(what, agree.same_everywhere, values))
        self.data_loader = DPDataLoader(schedule, c.dataset, epoch_steps,
                                        c.max_physical_batch_size, c.collate_fn, c.num_workers)
        self._attached = True
        return Private(self.model, self.optimizer, self.data_loader, self)

    @property
    def noise_multiplier(self) -> float:
        """σ (read-only: the accountant, the ledger and the noise all use this one value)."""
        return self.noise_multiplier_

    @property
    def next_step(self) -> int:
        """The sampler's next logical step (read-only: the loader draws its Poisson batches from
        it, and a step already charged must never be drawn again, Note [noise index])."""
        return self._next_step

    @property
    def sample_rate(self) -> float:
        """q, each example's inclusion probability at the steps that sample it (read-only: the
        sampler, the ledger and the accountant all use this one value)."""
        return self._sample_rate

    @property
    def dataset_size(self) -> int:
        """N (read-only, as sample_rate)."""
        return self._dataset_size

    @property
    def bands(self) -> int:
        """b (read-only, as sample_rate): 1 for DP-SGD; > 1 for banded noise, whose sampler
        draws partition t mod b at step t (Note [banded steps] in src/dp/private_step.h)."""
        return self._bands

    @property
    def max_grad_norm(self) -> float:
        """C (read-only: the clipping thresholds were fixed from it at attach)."""
        return self.max_grad_norm_

    def _clip_groups(self, layers, n_components, clipping, clipping_groups, group_weights, c):
        if clipping in ("flat", "automatic"):
            if clipping_groups is not None:
                raise ValueError(f"clipping_groups is for clipping='group', not {clipping!r}")
            for layer in layers:
                layer.group = 0
            return [list(range(n_components))], \
                [_C.privacy.threshold_f32(c) if math.isfinite(c) else c]
        if clipping == "layer":
            for layer in layers:
                layer.group = layer.component
            k = n_components
        else:
            if not clipping_groups:
                raise ValueError("clipping='group' needs clipping_groups: a list of lists of "
                                 "module names (prefixes)")
            k = len(clipping_groups)
            for layer in layers:
                matches = [g for g, prefixes in enumerate(clipping_groups)
                           if any(layer.name == p or layer.name.startswith(p + ".")
                                  for p in prefixes)]
                if not matches:
                    raise ValueError(f"DP layer {layer.name!r} is in no clipping group")
                layer.group = matches[0]
            for comp in range(n_components):
                members = {l.group for l in layers if l.component == comp}
                if len(members) > 1:
                    names = [l.name for l in layers if l.component == comp]
                    raise ValueError(f"layers {names} share a parameter but are in different "
                                     f"clipping groups {sorted(members)}; put them in one")
        if group_weights is not None and len(group_weights) != k:
            raise ValueError(f"group_weights has {len(group_weights)} entries for {k} groups")
        if math.isfinite(c):
            # Rounded down to float32, squares summing to at most C^2 exactly (the clip factors
            # compare against float32 thresholds, which must never exceed C_g).
            thresholds = list(_C.privacy.group_thresholds(c, k, list(group_weights or [])))
        else:
            thresholds = [math.inf] * k
        groups = [sorted({l.component for l in layers if l.group == g}) for g in range(k)]
        return groups, thresholds

    # ---- the step ----------------------------------------------------------------------------

    def _hand_out(self, micro: "MicroBatch", padding: bool) -> MicroBatchToken:
        """Makes ``micro`` the current micro-batch: the model's inputs must carry its token (Note
        [batch provenance]), its rows are what every DP layer must see."""
        book = self.book
        # Note [state written from data]: state a micro-batch's forward wrote must not reach the
        # next one's (put back here, and the logical batch's step refused), even when a later
        # forward clears it before the step; nor state written between two logical batches (an
        # evaluation forward on training rows), which the first micro-batch's forward could read
        # and clear (a review moved two steps 2.6 times the bound that way).
        self._state.check_micro_batch(first=micro.token.index == 0)
        self._micro = micro
        book.token = micro.token
        book.padding = padding
        book.expected_rows = micro.token.rows  # and one backward may reach the clipping
        return micro.token

    def _sampler(self, steps_per_epoch: int, start: int,
                 cap: Optional[int]) -> PoissonBatchSampler:
        """This rank's Poisson batches from logical step ``start`` on (the loader's Schedule)."""
        return PoissonBatchSampler(self.dataset_size, self.sample_rate, steps_per_epoch,
                                   self.noise_source.sampler_seed, self.rank, self.world_size,
                                   cap, start_step=start, partitions=self.bands)

    def _begin_micro_batch(self, t: int, i: int, n: int, size: int, rows: int,
                           padding: bool = False) -> MicroBatchToken:
        """The loader is about to yield micro-batch i of n of logical step t (``size`` examples
        over all ranks, ``rows`` here; a padding batch has one row); returns its token."""
        self._check_attached()
        book = self.book
        if self._micro is not None and self._micro.token.sampling == "caller":
            # A logical batch is all the sampler's or all the caller's: own_batch's rows must
            # not be released under a step the ledger records as the sampler's (own_batch refuses
            # the converse).
            raise RuntimeError("the private data loader handed out a micro-batch while a logical "
                               f"batch of own_batch is open ({self._micro.token!r}); step() it "
                               "(or zero_grad()) first")
        micro = self._micro
        if micro is not None and (book.micro_batches or book.open) and \
                (t, i) != (micro.token.step, micro.token.index + 1) and not \
                (i == 0 and t > micro.token.step):
            # One hand-out of each micro-batch per logical batch: a second iteration of the
            # loader while logical batch t holds gradients would hand out its micro-batches
            # again, and their examples would be clipped twice under one step's charge.
            raise RuntimeError(
                f"the private data loader would hand out micro-batch {i} of step {t} while "
                f"{micro.token!r} holds gradients (a second iteration of the loader inside a "
                "logical batch); go on with the iteration that handed it out, to its step")
        if i == 0 and self._micro is not None and self._micro.token.step != t and \
                (book.micro_batches or book.open):
            # Logical batch t-1 accumulated but never stepped: zero_grad() must drop it before
            # t's gradients arrive, or it would be released together with t's.
            book.stale = True
        self._generators.reseed("forward", t, i)  # Note [the model's own randomness]
        return self._hand_out(MicroBatch(MicroBatchToken(t, i, rows, "poisson"), n, size),
                              padding)

    @property
    def micro_batches_of_step(self) -> Optional[int]:
        """How many micro-batches the logical batch handed out last has (the loader's; None
        before the first or for own_batch, whose caller says when the step comes)."""
        return self._micro.count if self._micro is not None else None

    def own_batch(self, batch, *, logical_batch_size: int):
        """The opt-out for callers who Poisson-sample their batches themselves (Note [batch
        provenance]): returns ``batch`` (a tensor or a nested tuple / list / dict of tensors, one
        row per example on dim 0) tagged as one micro-batch of the next logical step, which the
        model then accepts in place of the private loader's.

        ``logical_batch_size``: the realised size of the logical batch this micro-batch belongs
        to, over all ranks (every micro-batch of a logical batch gives the same value; a step
        refuses more rows than that). ``optimizer.step()`` closes the logical batch. The privacy
        guarantee then rests on the caller's sampling: each example in the logical batch
        independently with probability q = ``sample_rate``; every step taken this way is
        recorded as ``sampling: "caller"`` in the ledger and the report."""
        self._check_attached()
        size = int(logical_batch_size)
        if isinstance(logical_batch_size, bool) or size != logical_batch_size or \
                not 0 <= size <= self.dataset_size:
            raise ValueError(f"own_batch: logical_batch_size must be an integer in [0, "
                             f"{self.dataset_size}] (the dataset size), got "
                             f"{logical_batch_size!r}")
        rows = {leaf.shape[0] for leaf in torch.utils._pytree.tree_leaves(batch)
                if isinstance(leaf, torch.Tensor) and leaf.dim() > 0}
        if len(rows) != 1:
            raise ValueError("own_batch: the batch must hold tensors with one row per example "
                             f"on dim 0, all with the same row count; got row counts "
                             f"{sorted(rows)}")
        (rows,) = rows
        micro = self._micro
        if micro is not None and micro.token.sampling == "poisson":
            raise RuntimeError("own_batch() while a logical batch of the private loader is open "
                               f"({micro.token!r}); step() it first")
        if micro is not None and micro.logical_size != size:
            raise ValueError(f"own_batch: logical_batch_size={size}, but this logical batch's "
                             f"earlier micro-batches gave {micro.logical_size}")
        index = micro.token.index + 1 if micro is not None else 0
        token = MicroBatchToken(self.next_step, index, rows, "caller")
        self._generators.reseed("forward", token.step, index)  # Note [the model's own randomness]
        self._hand_out(MicroBatch(token, None, size), padding=False)
        return tag(batch, token)

    @property
    def is_padding_batch(self) -> bool:
        """Whether the micro-batch the loader yielded last is a padding batch (Note [padding
        batches]): its loss means nothing and its gradient is discarded."""
        return bool(self._attached and self.book.padding)

    def _close_logical_batch(self) -> None:
        """No micro-batch is current any more: inputs of the last one are refused from now on,
        and the generators leave its draws (Note [the model's own randomness])."""
        self._generators.reseed("between", self._micro.token.step if self._micro is not None
                     else self.next_step)
        self._micro = None
        self._skipped_step = False
        self._state.clear_pending()
        self.book.token = None
        self.book.padding = False
        self.book.expected_rows = None

    def _drop_batch(self) -> None:
        """A step refused here (not by the transaction, which drops its own): the logical batch
        is closed and its gradients are never released."""
        self._close_logical_batch()
        self._step.drop_batch()

    def _set_hyperparameters(self) -> None:
        """param_groups' hyperparameters into the engine (Note [hyperparameters at the
        step]); ValueError naming a bad one, the engine unchanged."""
        options = self.optimizer.engine_options()
        current = self.sharded.zero_state.optimizer_options
        if any(current[k] != v for k, v in options.items()):
            merged = dict(current, **options)
            try:
                self.sharded.zero_state.set_optimizer_options(kind=self._optimizer_kind, **merged)
            except RuntimeError as e:
                first = (str(e).strip().splitlines() or [""])[0]
                raise ValueError(f"optimizer.param_groups: {first}") from None

    def _check_between_steps(self, what: str) -> None:
        """Raises on every rank if any rank has a logical batch accumulated or a backward
        pending (a collective with several ranks)."""
        book = self.book
        busy = bool(book.micro_batches or book.open or self._micro is not None)
        agree = self.agreements
        if agree.collective(f"agreeing on {what}", agree.any_rank, busy):
            raise RuntimeError(f"{what}: a logical batch is accumulated (on this rank: {busy}); "
                               "call it between steps, after optimizer.step() or zero_grad()")

    def _check_attached(self) -> None:
        if self._detached:
            raise RuntimeError("this PrivacyEngine was detached from its model; its optimizer "
                               "and data loader no longer work")

    def _zero_grad(self) -> None:
        self._check_attached()
        if self._skipped_step and self.book.error is None:
            return  # mid logical batch (the last step() only accumulated): keep it
        if self._micro is not None and self._micro.token.sampling == "caller":
            self._close_logical_batch()  # own_batch: zero_grad() drops the logical batch
        elif self._micro is not None and (self.book.micro_batches or self.book.open):
            # A loader batch's gradients dropped: the generators leave its draws, or a save now
            # would hold them, and the loader hands out its step again (Note [the model's own
            # randomness]).
            self._generators.reseed("between", self._micro.token.step)
        self.book.discard()
        self.book.take_stats()
        self.book.drop_deferred()  # a dropped batch's checks go with it
        self.book.error = None
        self.book.stale = False
        self.sharded.zero_grad()  # Note [private gradients]: skips buffers the step left zeroed

    def _optimizer_step(self) -> bool:
        """Returns True if a private step was taken."""
        self._check_attached()
        micro = self._micro
        book = self.book
        if micro is None:
            raise RuntimeError(
                "step() without a micro-batch since the last step: iterate the data_loader that "
                "make_private returned (each logical batch is stepped once, after its last "
                "micro-batch), or hand in batches you sampled yourself through "
                "privacy_engine.own_batch(...)")
        if micro.count is not None and micro.token.index + 1 < micro.count and book.error is None:
            self._skipped_step = True
            return False  # not the last micro-batch of the logical batch: only accumulate
        # Checks only Python can make; the book's own, the agreement, the budget, the ledger,
        # the charge and the noisy update are the step's transaction (src/dp/private_step.h).
        # From the checks to the record of the update's writes no mode runs (Note [checks
        # alone] in trainable.py): a write made in between would be recorded as the update's.
        with checks_alone():
            with self._trainable_set.one_listing():
                state_flags, deferred = self.book.read_step_checks(self._state.step_flags())
                state = self._state.verify_step(state_flags)  # always: it puts buffers back
                refusal = deferred or self._trainable_set.changed() or state
            try:  # Note [hyperparameters at the step] (optimizer.py)
                self._set_hyperparameters()
                bad_settings = None
            except ValueError as e:
                bad_settings = str(e)
            t, size = micro.token.step, micro.logical_size
            try:
                out = self._step.take(step=t, logical_size=size,
                                      caller_sampled=micro.token.sampling == "caller",
                                      refusal=refusal, bad_settings=bad_settings)
            finally:
                self._close_logical_batch()
                # Note [noise index]: a step charged and then failed (its update, the
                # accountant) used batch t; the sampler never draws a step below the charges
                # again.
                self._next_step = max(self._next_step, self.charges, self._step.rows)
            self._state.record_trained()  # the update's own writes
        self._next_step = max(t + 1, self.charges, self._step.rows)
        self.steps_taken += 1
        self.last_step = {"step": t, "noise_index": out.noise_index}
        self._diagnose(t, out.noise_index, "caller" if out.caller_sampled else "poisson", size,
                       out.samples, out.dropped)
        return True

    def _diagnose(self, t: int, k: int, sampling: str, size: int, samples: int,
                  dropped: int) -> None:
        """Note [released figures]: what a step realised (batch size, rows seen, samples dropped
        for a NaN/Inf norm) depends on the data and is not covered by epsilon. It goes to
        ``last_step_diagnostics`` and the data-dependent diagnostics file only, never into a
        warning:
        whether any example was dropped tells whether a record with a non-finite gradient was
        sampled (a membership oracle). That the mechanism drops such examples is said once, in
        the docs and the report, whatever the data."""
        all_dropped = samples > 0 and dropped == samples
        self.last_step_diagnostics = {"step": t, "noise_index": k, "sampling": sampling,
                                      "logical_batch_size": size, "samples_seen": samples,
                                      "dropped": dropped, "all_dropped": all_dropped}
        self._diagnostics.write(self.last_step_diagnostics)

    # ---- teardown ----------------------------------------------------------------------------

    def detach(self) -> nn.Module:
        """Removes the DP forwards and guards and retires this engine: its optimizer and data
        loader refuse to run afterwards (with the guards gone, autograd's unclipped gradients
        would reach the engine's buffers). Gathers nothing: in stage 3 read the trained values
        with ``parameters()`` first."""
        self._verify_release("detach()", collective=False)
        self.module.__dict__.pop("__getstate__", None)
        checkpointing.remove(self._checkpointed)
        if self.isolation == "strict":
            strict.unpatch(self.module)
        else:
            unpatch(self.module, self.layers)
        for h in self._guards + self._state_dict_hooks:
            h.remove()
        self._guards, self._state_dict_hooks = [], []
        self.sharded.zero_state.set_private(False)
        self._state.stop_watching()
        self.sharded.rng_states = None  # a plain model's checkpoints save the live states
        self.sharded.release_check = None  # checked above, once: the model is the caller's now
        self.sharded.zero_grad()
        self._detached = True
        return self.module

    def _release_at_exit(self) -> None:
        """Note [ending a script] (lifetime.py): retired as by detach(), without its checks (the
        interpreter is ending; nothing is released), and every reference that reaches the C++
        state or the process group dropped."""
        self._detached = True
        if getattr(self, "agreements", None) is not None:
            self.agreements.group = None  # the model's patched forwards keep the agreements
        if getattr(self, "_state", None) is not None:
            self._state.stop_watching()  # it holds the ZeRO state at stage 3
        for name in ("_step", "book", "sharded", "noise_source", "_group", "_ledger"):
            if hasattr(self, name):
                setattr(self, name, None)

    def parameters(self) -> Dict[str, torch.Tensor]:
        """Every trainable parameter by name (fp32 master; a collective in stages 1-3)."""
        return self.sharded.full_parameters()


def make_private_from_config(model: nn.Module, config: PrivateConfig, *,
                             accountant: str = DEFAULT_ACCOUNTANT,
                             secure_mode: Optional[bool] = None) -> Private:
    """A new PrivacyEngine attached to ``model`` with ``config`` (``resolve``'s): what
    ``dpzero.make_private`` does once its policy is chosen, and what the memory planner's probes
    run (below the front door, which depends on the planner)."""
    engine = PrivacyEngine(accountant=accountant, secure_mode=secure_mode)
    return engine._attach(model, config)


def _refuse_compiled(model: nn.Module) -> None:
    """Note [compiled private models]: a module compiled before make_private is refused."""
    from torch._dynamo.eval_frame import OptimizedModule

    for name, m in model.named_modules():
        if isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None:
            raise ValueError(
                f"module {name or '<model>'!r} ({type(m).__name__}) is compiled (torch.compile "
                "or .compile()): its compiled code would trace into dpzero's DP layers, which "
                "compilation cannot follow (Note [compiled private models]). Pass the model "
                "uncompiled; torch.compile of the private model make_private returns runs it "
                "eagerly")


def _check_optimizer_params(model: nn.Module, trainable: Dict[int, torch.Tensor],
                            optimizer: Optional[torch.optim.Optimizer]) -> None:
    """A torch optimizer given to make_private must hold every trainable parameter of the model
    and no parameter of another: the engine trains exactly the parameters with requires_grad
    (the optimizer lends only its hyperparameters), so one built for a part of the model, or
    for another copy of it, would silently train something else."""
    if optimizer is None:
        return
    held = {id(p): (g, k, tuple(p.shape)) for g, group in enumerate(optimizer.param_groups)
            for k, p in enumerate(group["params"])}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    missing = [names[i] for i in trainable if i not in held]
    if missing:
        raise ValueError(
            f"the optimizer does not hold {len(missing)} of the model's {len(trainable)} "
            f"trainable parameters (first: {missing[0]!r}); dpzero trains every parameter with "
            "requires_grad=True. Freeze those you do not train (requires_grad_(False)) or give "
            "the optimizer all of them")
    foreign = [where for i, where in held.items() if i not in names]
    if foreign:
        g, k, shape = foreign[0]
        raise ValueError(f"the optimizer holds {len(foreign)} parameters that are not the "
                         f"model's (first: param_groups[{g}]['params'][{k}], shape {shape}; "
                         "built for another copy of it?); build it on this model's parameters")


def _decay_exempt_names(model: nn.Module, config: PrivateConfig) -> Optional[list]:
    """dpzero.shard's weight_decay_exempt: the names passed through, and the parameters of the
    torch optimizer's weight_decay=0 groups (config.optimizer_settings)."""
    given = config.optimizer_options.get("weight_decay_exempt")
    if given is None and not config.decay_exempt:
        return None
    names = {id(p): n for n, p in model.named_parameters()}
    out = list(given or ())
    out += [names[id(p)] for p in config.decay_exempt if id(p) in names and p.requires_grad]
    return out
