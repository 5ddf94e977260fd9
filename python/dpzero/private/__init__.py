"""Private training under ZeRO sharding: the Opacus-style ``PrivacyEngine`` (``dpzero.make_private``,
the front door, is in ``front.py``).

Modules: ``config`` (make_private's settings checked and resolved, σ calibrated), ``layers`` (DP
layer kinds over the kernels' ops), ``fallback`` (torch.func per-sample gradients for parameters
used directly), ``attach`` (model walk, validation, patched forwards), ``book`` (the Python side
of the C++ clipping book), ``agreements`` (the agreements Python makes across ranks), ``loader``
(the Poisson data loader), ``optimizer`` (the torch-facing optimizer), ``engine`` (attach, the
ledger, the accountant, the call into the C++ step), ``errors`` (the errors a private run raises).
"""

from .config import PrivateConfig, resolve
from .engine import DPDataLoader, DPOptimizer, Private, PrivacyEngine, PrivateModule
from .errors import BudgetExhausted, CollectiveError, PrivacyViolation, UpdateError

__all__ = ["BudgetExhausted", "CollectiveError", "DPDataLoader", "DPOptimizer", "Private",
           "PrivacyEngine", "PrivacyViolation", "PrivateConfig", "PrivateModule", "UpdateError",
           "resolve"]
