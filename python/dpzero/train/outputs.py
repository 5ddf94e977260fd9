"""What a run writes as it goes: rank 0's progress line, files replaced whole (a reader never
sees half of one), and the trained model's state, for both training loops (runner.py,
trainer_loop.py)."""

from __future__ import annotations

import json
import math
import sys
from typing import Dict, Optional

import torch

from ..files import write_atomically


class Progress:
    """Rank 0's progress line: steps and ε spent so far, and the private model's test accuracy
    after each epoch — nothing computed from the training data (Note [released figures])."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.enabled, self.label = enabled, label
        self.bar = None
        if enabled:
            from tqdm import tqdm

            # No elapsed time or rate: step times follow the realised batch sizes.
            self.bar = tqdm(total=total, desc=label, file=sys.stderr, dynamic_ncols=True,
                            mininterval=0.5,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}{postfix}")

        self.post: Dict[str, str] = {}

    def update(self, eps: Optional[float] = None, accuracy: Optional[float] = None,
               step: bool = True) -> None:
        if self.bar is None:
            return
        if eps is not None:
            self.post["eps"] = "inf" if math.isinf(eps) else f"{eps:.3f}"
        if accuracy is not None:
            self.post["test_acc"] = f"{accuracy:.3f}"
        if self.post:
            self.bar.set_postfix(self.post)
        if step:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def atomic_save(obj, path: str) -> None:
    write_atomically(path, lambda f: torch.save(obj, f))


def atomic_json(obj, path: str) -> None:
    write_atomically(path, lambda f: json.dump(obj, f, indent=2, default=str), binary=False)


def final_state(model, params: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The model's state_dict with every trained parameter (also under a tied alias) taken from
    the engine's fp32 master values: in stage 3 the module's own copies are freed shards. On the
    CPU, wherever the run trained, so that ``torch.load`` reads it on any machine."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    every = dict(model.named_parameters(remove_duplicate=False))
    state = {}
    for key, value in model.state_dict(keep_vars=True).items():
        name = canonical.get(id(every[key])) if key in every else None
        value = params[name] if name in params else value.detach()
        state[key] = value.to("cpu", copy=True)
    return state
