"""Private training on the ZeRO engine: ``make_private`` and the Opacus-style ``PrivacyEngine``.

Modules: ``layers`` (DP layer kinds over the kernels' ops), ``fallback`` (torch.func per-sample
gradients for parameters used directly), ``attach`` (model walk, validation, patched forwards),
``book`` (clipping groups, book-keeping, hand-over to the engine), ``agreements`` (every
agreement across ranks), ``loader`` (the Poisson data loader), ``engine`` (the step, the ledger,
the accountant).
"""

from .agreements import BudgetExhausted, CollectiveError
from .attach import PrivacyViolation
from .engine import (DPDataLoader, DPOptimizer, Private, PrivacyEngine, PrivateModule,
                     make_private)

__all__ = ["BudgetExhausted", "CollectiveError", "DPDataLoader", "DPOptimizer", "Private",
           "PrivacyEngine", "PrivacyViolation", "PrivateModule", "make_private"]
