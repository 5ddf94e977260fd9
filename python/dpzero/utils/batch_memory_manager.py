"""``BatchMemoryManager``: Opacus's way to cap the physical batch, under Opacus's import path.

dpzero's loader already cuts every Poisson-sampled logical batch into micro-batches of at most
``max_physical_batch_size`` rows (make_private's setting of that name), and its optimizer steps
only after a logical batch's last micro-batch, so the manager is a context in which the loader's
cap is the one given (the smaller of the two), restored on the way out. The cap changes only the
cutting, never which examples are sampled or what is charged: ε is the same.
"""

from __future__ import annotations

from typing import Optional

from ..private.loader import DPDataLoader
from ..private.optimizer import DPOptimizer


class BatchMemoryManager:
    def __init__(self, *, data_loader: DPDataLoader, max_physical_batch_size: int,
                 optimizer: Optional[DPOptimizer] = None) -> None:
        if not isinstance(data_loader, DPDataLoader):
            raise TypeError("BatchMemoryManager: data_loader must be the loader make_private "
                            f"returned, got {type(data_loader).__name__}")
        if isinstance(max_physical_batch_size, bool) or not isinstance(
                max_physical_batch_size, int) or max_physical_batch_size < 1:
            raise ValueError("BatchMemoryManager: max_physical_batch_size must be an integer "
                             f">= 1, got {max_physical_batch_size!r}")
        if optimizer is not None and not isinstance(optimizer, DPOptimizer):
            raise TypeError("BatchMemoryManager: optimizer must be the optimizer make_private "
                            f"returned, got {type(optimizer).__name__}")
        self.data_loader = data_loader
        self.max_physical_batch_size = max_physical_batch_size
        self._saved: Optional[int] = None

    def __enter__(self) -> DPDataLoader:
        self._saved = self.data_loader.cap_physical_batch_size(self.max_physical_batch_size)
        return self.data_loader

    def __exit__(self, *exc) -> None:
        self.data_loader.max_physical_batch_size = self._saved
