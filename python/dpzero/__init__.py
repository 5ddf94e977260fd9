"""dpzero: differentially private training with ZeRO sharding.

``import dpzero`` loads the C++ core (``dpzero._C``), which also registers the torch ops under
``torch.ops.dpzero``.
"""

import torch  # noqa: F401  (loads libtorch before our extension links against it)

from . import _C
from .accounting import (
    Ledger,
    LedgerError,
    PRVAccountant,
    RDPAccountant,
    get_noise_multiplier,
    get_steps,
)
from .zero import ShardedModule, shard
from .private import BudgetExhausted, CollectiveError, PrivacyEngine, PrivacyViolation, UpdateError
from .front import make_private
from . import checkpoint  # noqa: E402  (dpzero.checkpoint.save / load)

__version__ = "0.1.0"

__all__ = [
    "BudgetExhausted",
    "CollectiveError",
    "Ledger",
    "LedgerError",
    "PRVAccountant",
    "PrivacyEngine",
    "PrivacyViolation",
    "RDPAccountant",
    "ShardedModule",
    "UpdateError",
    "checkpoint",
    "get_noise_multiplier",
    "get_steps",
    "make_private",
    "shard",
    "__version__",
]
