"""dpzero: differentially private training with ZeRO sharding.

``import dpzero`` loads the C++ core (``dpzero._C``), which also registers the torch ops under
``torch.ops.dpzero``.
"""

import torch  # loaded before our extension, which links against libtorch


def _check_torch() -> None:
    """_C links against one torch's C++ library, whose ABI changes between minor versions."""
    try:
        from ._build_info import TORCH_VERSION
    except ImportError:  # a source checkout on PYTHONPATH: _C is the build's own
        return
    built = TORCH_VERSION.split("+")[0].split(".")[:2]
    found = torch.__version__.split("+")[0].split(".")[:2]
    if built != found:
        raise ImportError(
            f"dpzero was built against torch {TORCH_VERSION}, but this environment has torch "
            f"{torch.__version__}. Install torch {'.'.join(built)}.x, or rebuild dpzero against "
            "this torch: pip install --no-build-isolation --no-deps --force-reinstall <dpzero checkout>")


_check_torch()

from . import _C  # noqa: E402,F401  (the C++ core; registers torch.ops.dpzero)
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
