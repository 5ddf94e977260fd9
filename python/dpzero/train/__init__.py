"""Training jobs driven by a config file: ``dpzero train CONFIG`` and ``dpzero report RUN_DIR``.

``config`` (the TOML schema and its checks), ``datasets`` (fortunes categories, Fashion-MNIST),
``models`` (pretrained MiniLM classifier, tanh CNN), ``runner`` (one rank's job), ``launch``
(ranks torchrun-style), ``report`` (report.md/json and plots from the ledger).
"""

from .config import ConfigError, RunConfig, load
from .launch import launch
from .report import write_report

__all__ = ["ConfigError", "RunConfig", "launch", "load", "write_report"]
