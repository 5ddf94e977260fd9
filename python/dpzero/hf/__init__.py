"""dpzero.hf: private fine-tuning through the Hugging Face ``transformers.Trainer``.

``PrivateTrainer`` is a ``Trainer`` whose training steps are dpzero's private steps (Poisson
sampling, per-sample clipping, noise, accounting, ledger); ``PrivacyArguments`` holds the privacy
settings. See docs/user-guide.md, "Fine-tune with the Trainer".
"""

from .trainer import PrivacyArguments, PrivateTrainer

__all__ = ["PrivacyArguments", "PrivateTrainer"]
