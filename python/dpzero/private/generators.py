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
the rank, the logical step and the micro-batch, and reseeds them

* before each micro-batch's examples are fetched (``fetch``, when the loader fetches them in
  this process), so that augmentations draw from it;
* when each micro-batch is handed out (``forward``, also by ``own_batch``), so that dropout draws
  from it whether or not workers fetched the examples;
* when an epoch's iteration starts (``iter``), before DataLoader workers are started: each
  worker's base seed is drawn from torch's generator then, and :class:`WorkerSeeds` reseeds each
  worker's generators from the run's secret and that base seed (torch's own per-worker seeding
  keeps 32 bits of it for its Mersenne twister);
* when a logical batch closes, stepped, refused or dropped (``between``): checkpoints save the
  states then (dpzero.checkpoint's extras, the Trainer's rng_state.pth), and a state after the
  step's draws would give them away (torch's state even records the seed it started from); it
  also holds nothing of the realised batch sizes (two earlier reviews read them off the saved
  states under add/remove neighbours). Nothing that trains draws from it: the next batch's fetch
  and forward reseed first. A checkpoint in the middle of a logical batch would hold that
  batch's draws, so dpzero.checkpoint refuses one.

Each reseed sets all of a generator's state, not a seed: torch's CPU generator (a Mersenne
twister) takes only 32 bits of ``manual_seed``, and numpy's ``seed(int)`` 32, so a run's draws
would have 2^32 possibilities a step, few enough to search and to repeat within a run (a review
found two steps of one run with the same draws at steps 31722 and 33543). The PRF's 32 bytes are
expanded with SHAKE256 into the twister's 624 words (``torch.Generator.set_state``, whose
layout :func:`_set_twister` checks), numpy's init_by_array key and Python's seed; CUDA's Philox
generator takes a 64-bit key.

Seeded runs stay reproducible (the same seed, the same draws at every step, a resumed run's
too); secure runs draw afresh. What this cannot reach: generators the caller makes and seeds
(``torch.Generator().manual_seed(0)`` inside an augmentation), reseeding in the caller's own
loop, and a caller's own loader feeding ``own_batch``, whose augmentations draw from the state
between steps (secret, but saved by checkpoints).
"""

from __future__ import annotations

import hashlib
import random
import struct
import sys
from typing import List, Union

import torch

_PURPOSES = (b"fetch", b"forward", b"iter", b"between")
_TWISTER_WORDS = 624  # the Mersenne twister's state (MT19937)
# torch's CPU generator state (CPUGeneratorImplState): the initial seed (u64), left (i32), seeded
# (i32), next (u64), the 624 state words (each in a u64), then the normal-sample caches.
_TWISTER_OFFSET = 24
_TWISTER_BYTES = 5056


def _set_twister(generator: torch.Generator, words: bytes, initial: int) -> None:
    """``generator``'s (a CPU one) Mersenne twister state set to ``words`` (624 × 4 bytes), to be
    twisted before its first draw, its recorded initial seed to ``initial``. RuntimeError if
    this torch's state layout is not the one known here (the state would not be set)."""
    generator.manual_seed(initial)  # this torch's layout, the normal caches cleared, left = 1
    state = bytearray(generator.get_state().numpy().tobytes())
    header = struct.unpack_from("<QiiQ", state, 0) if len(state) >= _TWISTER_OFFSET else None
    first = struct.unpack_from("<Q", state, _TWISTER_OFFSET)[0] if header else None
    if len(state) != _TWISTER_BYTES or header != (initial, 1, 1, 0) or \
            first != initial & 0xFFFFFFFF:
        raise RuntimeError(
            f"dpzero: torch {torch.__version__}'s CPU generator state ({len(state)} bytes, "
            f"header {header}) is not the layout dpzero sets (Note [the model's own randomness] "
            "in dpzero/private/generators.py: 5056 bytes, the twister's words from byte 24); "
            "without it a private run's dropout and augmentations would draw from a 32-bit seed. "
            "Use the torch version dpzero's setup installs")
    # Each 32-bit word zero-extended into its u64 slot (little-endian), in one copy.
    wide = torch.zeros(_TWISTER_WORDS, 2, dtype=torch.int32)
    wide[:, 0] = torch.frombuffer(bytearray(words), dtype=torch.int32)
    state[_TWISTER_OFFSET:_TWISTER_OFFSET + 8 * _TWISTER_WORDS] = wide.numpy().tobytes()
    generator.set_state(torch.frombuffer(state, dtype=torch.uint8))


def reseed_all(material: bytes) -> None:
    """torch's generators (the CPU one's whole state; CUDA's once initialised), Python's random
    and numpy's global generator, from ``material`` (32 secret bytes), expanded with SHAKE256."""
    stream = hashlib.shake_256(b"dpzero-generators:" + material).digest(
        4 * _TWISTER_WORDS + 8 + 32)
    twister, rest = stream[:4 * _TWISTER_WORDS], stream[4 * _TWISTER_WORDS:]
    initial = int.from_bytes(rest[:8], "little") >> 1
    _set_twister(torch.default_generator, twister, initial)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(initial)  # Philox: a 64-bit key (a device initialised later
        # is seeded by torch from the CPU generator)
    random.seed(int.from_bytes(material, "little"))  # all of it (init_by_array)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(numpy.frombuffer(rest[8:], dtype=numpy.uint32))


class RunGenerators:
    """Reseeds the global generators from ``secret`` (the run's noise key words, or its seed) on
    ``rank`` (Note [the model's own randomness])."""

    def __init__(self, secret: Union[int, List[int]], rank: int) -> None:
        words = [secret] if isinstance(secret, int) else list(secret)
        material = b"".join(int(w).to_bytes(8, "little", signed=False) for w in words)
        self.key = hashlib.blake2b(material, digest_size=32, person=b"dpzero-generator").digest()
        self.rank = int(rank)

    def material(self, purpose: bytes, step: int, index: int = 0) -> bytes:
        """The 32 secret bytes of ``purpose`` at micro-batch ``index`` of logical step ``step``
        on this rank."""
        if purpose not in _PURPOSES:
            raise ValueError(f"RunGenerators.material: purpose must be one of {_PURPOSES}, got "
                             f"{purpose!r}")
        message = b"%s:%d:%d:%d" % (purpose, self.rank, int(step), int(index))
        return hashlib.blake2b(message, key=self.key, digest_size=32).digest()

    def reseed(self, purpose: bytes, step: int, index: int = 0) -> None:
        reseed_all(self.material(purpose, step, index))

    def workers(self) -> "WorkerSeeds":
        return WorkerSeeds(self.key)


class WorkerSeeds:
    """A DataLoader's ``worker_init_fn``: the worker's generators reseeded from the run's secret
    and the worker's torch seed (the base seed its loader drew, plus its id). Picklable."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def __call__(self, worker_id: int) -> None:
        message = b"worker:%d" % torch.initial_seed()
        reseed_all(hashlib.blake2b(message, key=self.key, digest_size=32).digest())
