"""The global random generators a private run's model and data draw from, keyed by the run's
secret: Note [the model's own randomness] in src/dp/generators.h (the rule, and torch's
generators set from it, are C++, shared with the C++ front door). Here: the Python door's
reseeds, which also set torch's CUDA generators through torch.cuda (which defers a device not yet
initialised), Python's ``random`` and numpy's global generator (init_by_array of eight words:
``seed(int)`` keeps 32 bits), and DataLoader workers."""

from __future__ import annotations

import random
import sys
from typing import List, Union

import torch

from .. import _C
from ..noise import as_int64

PURPOSES = ("iter", "fetch", "forward", "between", "saved")


def _reseed_python(seed: int, extra: List[int]) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)  # Philox: a 63-bit key; deferred until initialised
    random.seed(sum(w << (32 * i) for i, w in enumerate(extra)))  # all 256 bits
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(numpy.array(extra, dtype=numpy.uint32))


class RunGenerators:
    """Reseeds the global generators from ``secret`` (the run's secure key words, or its seed)
    on ``rank``."""

    def __init__(self, secret: Union[int, List[int]], rank: int) -> None:
        secure = not isinstance(secret, int)
        seed = 0 if secure else as_int64(int(secret))
        self.key = list(_C.dp.generator_key(secure, seed, list(secret) if secure else []))
        self.rank = int(rank)

    def reseed(self, purpose: str, step: int, index: int = 0) -> None:
        """``purpose`` (one of PURPOSES) at micro-batch ``index`` of logical step ``step``."""
        if purpose not in PURPOSES:
            raise ValueError(f"RunGenerators.reseed: purpose must be one of {PURPOSES}, got "
                             f"{purpose!r}")
        seed, extra = _C.dp.reseed_generators(self.key, purpose, self.rank, int(step), int(index))
        _reseed_python(seed, extra)

    def workers(self) -> "WorkerSeeds":
        return WorkerSeeds(self.key)

    def saved_states(self, step: int) -> dict:
        """What a checkpoint saves of the generators at logical step ``step``: the states of
        purpose "saved", which nothing draws from, never the live ones (those a handed-out
        micro-batch draws from); the live states are put back. {"cpu": torch's CPU state,
        "cuda": [each device's] (only once CUDA is initialised)}."""
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        numpy = sys.modules.get("numpy")
        live = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None,
                random.getstate(), numpy.random.get_state() if numpy is not None else None)
        try:
            self.reseed("saved", step)
            return {"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if cuda else []}
        finally:
            torch.set_rng_state(live[0])
            if cuda:
                torch.cuda.set_rng_state_all(live[1])
            random.setstate(live[2])
            if numpy is not None:
                numpy.random.set_state(live[3])


class WorkerSeeds:
    """A DataLoader's ``worker_init_fn``: the worker's generators reseeded from the run's
    generator key and the worker's torch seed (its loader's base seed plus its id), which torch's
    own per-worker seeding keeps 32 bits of. Picklable."""

    def __init__(self, key: List[int]) -> None:
        self.key = key

    def __call__(self, worker_id: int) -> None:
        s = torch.initial_seed() & ((1 << 64) - 1)
        seed, extra = _C.dp.reseed_generators(self.key, "worker", 0, s & 0xFFFFFFFF, s >> 32)
        _reseed_python(seed, extra)
