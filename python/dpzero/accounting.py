"""Privacy accounting with the names Opacus users know.

The arithmetic lives in C++ (``accounting/``, exposed as ``dpzero._C.accounting``); this module
adds Opacus-compatible front ends:

* :class:`RDPAccountant` and :class:`PRVAccountant` with ``step(noise_multiplier=, sample_rate=)``,
  ``get_epsilon(delta)`` and ``history``;
* :func:`get_noise_multiplier` (σ for a target ε), :func:`get_steps` (steps for a target ε);
* :class:`Ledger`, the append-only privacy ledger on disk.
"""

from __future__ import annotations

import math
import warnings
from typing import List, Optional, Sequence, Tuple

from . import _C

_acc = _C.accounting

Phase = _acc.Phase
RdpEpsilon = _acc.RdpEpsilon
PrvEpsilon = _acc.PrvEpsilon
compute_log_a = _acc.compute_log_a
compute_rdp = _acc.compute_rdp
rdp_to_epsilon = _acc.rdp_to_epsilon
opacus_default_orders = _acc.opacus_default_orders
tfp_default_orders = _acc.tfp_default_orders

ACCOUNTANTS = ("rdp", "prv")


class _Accountant:
    """What both accountants share: the run's phases, kept by the C++ accountant ``_impl``, which
    a private step also charges directly (``dpzero._C.dp.PrivateStep``). ``history`` lists them as
    (noise_multiplier, sample_rate, num_steps), consecutive equal settings merged, as Opacus
    does."""

    _impl: "_acc.Accountant"

    def step(self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        self._impl.step(sample_rate, noise_multiplier, num_steps)

    @property
    def history(self) -> List[Tuple[float, float, int]]:
        return [(p.sigma, p.q, p.steps) for p in self._impl.phases]

    def __len__(self) -> int:
        return self._impl.steps

    @property
    def native(self) -> "_acc.Accountant":
        """The C++ accountant this one wraps (what a private step charges)."""
        return self._impl


class RDPAccountant(_Accountant):
    """Rényi-DP accountant for the Poisson-subsampled Gaussian (Mironov et al. 2019).

    ``orders`` defaults to Opacus's grid; the (ε, δ) conversion is Balle et al. 2020, Thm. 21.
    """

    def __init__(self, orders: Optional[Sequence[float]] = None) -> None:
        self._impl = _acc.RdpAccountant(list(orders) if orders is not None else None)

    @staticmethod
    def mechanism() -> str:
        return "rdp"

    def get_privacy_spent(self, *, delta: float) -> Tuple[float, float]:
        """(ε, best order); warns when the best order lies on the edge of the order grid."""
        result = self.epsilon_details(delta)
        if result.order_on_edge and len(self) > 0:
            warnings.warn(
                f"the best RDP order {result.best_order:g} lies on the edge of the order grid "
                f"[{min(self._impl.orders):g}, {max(self._impl.orders):g}]; ε = "
                f"{result.epsilon:.4g} may be loose: widen the grid (orders=...)",
                RuntimeWarning, stacklevel=2)
        return result.epsilon, result.best_order

    def get_epsilon(self, delta: float) -> float:
        return self.get_privacy_spent(delta=delta)[0]

    def epsilon_details(self, delta: float) -> RdpEpsilon:
        """ε, the best order and whether it sits on the edge of the order grid."""
        return self._impl.epsilon(delta)

    def get_delta(self, epsilon: float) -> float:
        return self._impl.delta(epsilon)


class PRVAccountant(_Accountant):
    """PRV accountant (Gopi, Lee, Wutschitz 2021): ε with lower bound, estimate and upper bound.

    ``get_epsilon`` returns the upper bound, as Opacus does; ``epsilon_bounds`` returns all three.
    """

    def __init__(self) -> None:
        self._impl = _acc.PrvAccountant()

    @staticmethod
    def mechanism() -> str:
        return "prv"

    def epsilon_bounds(
        self, delta: float, *, eps_error: float = 0.01, delta_error: Optional[float] = None
    ) -> PrvEpsilon:
        return self._impl.epsilon(delta, eps_error, 0.0 if delta_error is None else delta_error)

    def get_epsilon(
        self, delta: float, *, eps_error: float = 0.01, delta_error: Optional[float] = None
    ) -> float:
        return self.epsilon_bounds(delta, eps_error=eps_error, delta_error=delta_error).upper

    def get_delta(self, epsilon: float, *, eps_error: float = 0.01) -> float:
        return self._impl.delta(epsilon, eps_error, 0.0).upper


def create_accountant(mechanism: str):
    """Opacus-style factory: ``create_accountant("rdp" | "prv")``."""
    if mechanism == "rdp":
        return RDPAccountant()
    if mechanism == "prv":
        return PRVAccountant()
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {mechanism!r}")


def _steps(sample_rate: float, epochs: Optional[float], steps: Optional[int]) -> int:
    if (epochs is None) == (steps is None):
        raise ValueError(f"give exactly one of epochs and steps, got epochs={epochs}, steps={steps}")
    if steps is not None:
        return int(steps)
    if not (0.0 < sample_rate <= 1.0):
        raise ValueError(f"sample_rate must be in (0, 1] to convert epochs to steps, got {sample_rate}")
    if epochs < 0 or not math.isfinite(epochs):
        raise ValueError(f"epochs must be finite and >= 0, got {epochs}")
    return int(epochs / sample_rate)  # Opacus's convention


def get_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    epochs: Optional[float] = None,
    steps: Optional[int] = None,
    accountant: str = "rdp",
    epsilon_tolerance: float = 0.01,
    eps_error: float = 0.01,
) -> float:
    """σ such that the run's ε (PRV: its upper bound) is at most ``target_epsilon``.

    ``epochs`` converts to ``int(epochs / sample_rate)`` steps, as in Opacus.
    """
    n = _steps(sample_rate, epochs, steps)
    return _acc.noise_multiplier_for_epsilon(
        target_epsilon, target_delta, sample_rate, n, accountant, epsilon_tolerance, eps_error
    )


def get_steps(
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    noise_multiplier: float,
    accountant: str = "rdp",
    eps_error: float = 0.01,
) -> int:
    """The largest number of steps whose ε stays at or below ``target_epsilon``."""
    return _acc.steps_for_epsilon(
        target_epsilon, target_delta, sample_rate, noise_multiplier, accountant, eps_error
    )


LedgerError = _acc.LedgerError
LedgerRecord = _acc.LedgerRecord


def composed_epsilon(ledgers: Sequence["Ledger"], delta: float, accountant: str = "rdp",
                     eps_error: float = 0.01) -> float:
    """ε at ``delta`` of releasing the results of every run in ``ledgers`` together: all their
    recorded steps composed in one accountant (PRV: the upper bound); ``inf`` if any step had no
    noise. For one ledger it is that run's ε. The runs may differ in σ and q; each run samples
    independently, so their composition is the adaptive composition of all the steps."""
    if any(ledger.has_unnoised_steps for ledger in ledgers):
        return math.inf
    phases = [p for ledger in ledgers for p in ledger.phases() if p.steps > 0]
    if not phases:
        return 0.0
    if accountant == "rdp":
        acc = _acc.RdpAccountant(None)
        for p in phases:
            acc.add(p)
        return acc.epsilon(delta).epsilon
    if accountant == "prv":
        acc = _acc.PrvAccountant()
        for p in phases:
            acc.add(p)
        return acc.epsilon(delta, eps_error, 0.0).upper
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")


class Ledger:
    """The privacy ledger: an append-only JSON-lines file, fsync'ed per append (accounting/ledger.h).

    ``Ledger.create(path, run_id=..., dataset_size=N, settings={...})`` starts one (never
    overwriting), ``Ledger.open(path)`` resumes one (a torn last line from a crash is an error
    unless ``truncate_torn_tail=True``, which cuts it and reports it in ``torn_tail``), and
    ``Ledger.open_read_only(path)`` reads one next to a live writer. ``epsilon(delta)`` recomputes
    ε from the records alone; steps recorded without noise make it ``inf``.
    """

    def __init__(self, impl: "_acc.Ledger") -> None:
        self._impl = impl

    @property
    def native(self) -> "_acc.Ledger":
        """The C++ ledger this one wraps (what a private step appends to)."""
        return self._impl

    @classmethod
    def create(cls, path: str, *, run_id: str, dataset_size: int,
               settings: Optional[dict] = None) -> "Ledger":
        import json

        return cls(_acc.Ledger.create(str(path), run_id, int(dataset_size),
                                      json.dumps(settings if settings is not None else {})))

    @classmethod
    def open(cls, path: str, *, truncate_torn_tail: bool = False,
             expected_run_id: str = "") -> "Ledger":
        return cls(_acc.Ledger.open(str(path), truncate_torn_tail, expected_run_id))

    @classmethod
    def open_read_only(cls, path: str, *, expected_run_id: str = "") -> "Ledger":
        return cls(_acc.Ledger.open_read_only(str(path), expected_run_id))

    def append(self, *, first_step: int, q: float, sigma: float, max_grad_norm: float,
               last_step: Optional[int] = None, noise: bool = True,
               sampling: str = "poisson") -> None:
        """Record steps first_step..last_step (default: one step) durably before the update.
        ``sampling``: "poisson" (dpzero's sampler) or "caller" (``PrivacyEngine.own_batch``).
        Nothing that depends on the data goes in (Note [ledger format] in accounting/ledger.h)."""
        rec = _acc.LedgerRecord()
        rec.first_step = int(first_step)
        rec.last_step = int(first_step if last_step is None else last_step)
        rec.q, rec.sigma, rec.max_grad_norm = float(q), float(sigma), float(max_grad_norm)
        rec.noise, rec.sampling = bool(noise), str(sampling)
        self._impl.append(rec)

    @property
    def path(self) -> str:
        return self._impl.path

    @property
    def run_id(self) -> str:
        return self._impl.run_id

    @property
    def dataset_size(self) -> int:
        return self._impl.dataset_size

    @property
    def format(self) -> int:
        return self._impl.format

    @property
    def caller_sampled_steps(self) -> int:
        """Steps whose batches the caller sampled (``own_batch``), not dpzero's sampler."""
        return sum(r.steps for r in self.records if r.sampling == "caller")

    @property
    def settings(self) -> dict:
        import json

        return json.loads(self._impl.settings_json)

    @property
    def records(self) -> List["_acc.LedgerRecord"]:
        return self._impl.records

    @property
    def total_steps(self) -> int:
        return self._impl.total_steps

    @property
    def has_unnoised_steps(self) -> bool:
        return self._impl.unnoised_steps > 0

    @property
    def torn_tail(self) -> bytes:
        return self._impl.torn_tail

    @property
    def torn_tail_line(self) -> int:
        return self._impl.torn_tail_line

    def phases(self) -> List[Phase]:
        return self._impl.phases()

    def epsilon(self, delta: float, accountant: str = "rdp", eps_error: float = 0.01) -> float:
        """ε of everything recorded (PRV: the upper bound); ``inf`` if any step had no noise."""
        return composed_epsilon([self], delta, accountant, eps_error)

    def close(self) -> None:
        """Release the file and its writer lock (also happens when the object is collected). A
        private step sharing this ledger refuses its steps from then on (nothing applied)."""
        if self._impl is not None:
            self._impl.close()
        self._impl = None

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
