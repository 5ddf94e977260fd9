"""The global random generators a private run's model and data draw from, keyed by the run's secret.

Note [the model's own randomness]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Dropout in the forward and augmentation in a dataset's ``__getitem__`` draw from torch's global
generator (CPU and CUDA), Python's ``random`` and numpy's global generator. How many numbers an
example's draws come after depends on the other examples: a dropout mask is drawn for the whole
padded batch [B, L_max, d], and an augmentation draws as many numbers as its example is long.
So one example, replaced or added, shifts the draws of every example after it. Each of their
contributions is still clipped, but all of them move: a privacy review moved one step's clipped
sum 3.6 times its bound 2C that way (dropout 0.5, dynamic padding, one longer example), in both
isolation modes, and 3.3 times with an augmentation that drew one number per token.

The clipping argument covers this only when nobody who sees the release knows the draws. For
every fixed value of the model's random numbers, one example moves the sum by at most C; the
other examples' draws are i.i.d. uniform under both neighbouring datasets, whatever positions of
the stream they take, so the two runs can be coupled to give every other example the same draws,
and the release is a mixture, over those secret draws, of mechanisms each within the bound. A
generator seeded from a public value (``torch.manual_seed(0)``, a Trainer's ``seed=42``, a
config file) makes the draws a known function of the batch's shapes instead, and the coupling
is gone. So a private run keys these generators by a secret of its own: the run's noise key in
secure mode, its seed when seeded (whose noise is then as secret as that seed, Note [secure by
default] in privacy/entropy.h), through keyed BLAKE2b (a pseudorandom function) of a purpose,
the rank and the logical step, and reseeds them

* before a logical batch's examples are fetched (``fetch``, when the loader fetches them in this
  process), so that augmentations draw from it;
* when a logical batch's first micro-batch is handed out (``forward``), so that dropout draws
  from it whether or not workers fetched the examples;
* when an epoch's iteration starts (``iter``), before DataLoader workers are started: each draws
  its base seed from torch's generator then, and :func:`seed_worker` seeds numpy in each worker
  from it (torch seeds its own generator and Python's per worker, numpy it leaves as forked, the
  same in every worker);
* when a logical batch closes, stepped or refused (``between``): checkpoints save the states
  then (dpzero.checkpoint's extras, the Trainer's rng_state.pth), and a state after the step's
  draws would give them away (torch's Mersenne twister can be run backwards from its state); it
  also holds nothing of the realised batch sizes (two earlier reviews read them off the saved
  states under add/remove neighbours). Nothing that trains draws from it: the next batch's fetch
  and forward reseed first.

Seeded runs stay reproducible (the same seed, the same draws at every step, a resumed run's
too); secure runs draw afresh. What this cannot reach: generators the caller makes and seeds
(``torch.Generator().manual_seed(0)`` inside an augmentation), reseeding in the caller's own
loop, and a caller's own loader feeding ``own_batch``, whose augmentations draw from the state
between steps (secret, but saved by checkpoints).
"""

from __future__ import annotations

import hashlib
import random
import sys
from typing import List, Union

import torch

_PURPOSES = (b"fetch", b"forward", b"iter", b"between")


class RunGenerators:
    """Reseeds the global generators from ``secret`` (the run's noise key words, or its seed) on
    ``rank`` (Note [the model's own randomness])."""

    def __init__(self, secret: Union[int, List[int]], rank: int) -> None:
        words = [secret] if isinstance(secret, int) else list(secret)
        material = b"".join(int(w).to_bytes(8, "little", signed=False) for w in words)
        self._key = hashlib.blake2b(material, digest_size=32,
                                    person=b"dpzero-generator").digest()
        self.rank = int(rank)

    def seed(self, purpose: bytes, step: int) -> int:
        """A 63-bit seed for ``purpose`` at logical step ``step`` on this rank."""
        if purpose not in _PURPOSES:
            raise ValueError(f"RunGenerators.seed: purpose must be one of {_PURPOSES}, got "
                             f"{purpose!r}")
        message = b"%s:%d:%d" % (purpose, self.rank, int(step))
        digest = hashlib.blake2b(message, key=self._key, digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1

    def reseed(self, purpose: bytes, step: int) -> None:
        """torch's generators (CPU; CUDA's once initialised), Python's random and numpy's global
        generator, from ``seed(purpose, step)``."""
        s = self.seed(purpose, step)
        torch.default_generator.manual_seed(s)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(s)  # (a device initialised later is seeded by torch)
        random.seed(s)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(s % (1 << 32))


def seed_worker(worker_id: int) -> None:
    """A DataLoader worker's ``worker_init_fn``: numpy's global generator from the worker's torch
    seed (the run's base seed plus the worker's id, Note [the model's own randomness])."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(torch.initial_seed() % (1 << 32))
