"""Where a run's randomness comes from: a seeded Philox source (reproducible) or secure mode.

:class:`NoiseSource` owns the seed (default mode) or the 256-bit ChaCha20 key (secure mode, drawn
from OS entropy and, in a multi-rank run, broadcast from rank 0 so that every rank draws the same
z(key, t, j) — Note [noise ownership] in privacy/noise.h, Note [secure noise] in
privacy/secure_noise.h). It adds the step's noise to the global coordinates a tensor holds and
hands the Poisson sampler its seed.
"""

from __future__ import annotations

import secrets
from typing import List, Optional, Union

import torch
import torch.distributed as dist

from . import _C


# Note [secure by default] (privacy/entropy.h): whether a run draws in secure mode, from
# secure_mode (None: not given) and the seed (None: none); the one rule of every front door.
# ValueError naming the seed for a seed with secure_mode=True.
def secure_noise(secure_mode: Optional[bool], seed) -> bool:
    return _C.privacy.secure_noise(secure_mode, None if seed is None else str(seed))


class NoiseSource:
    """Noise and sampling randomness of one run.

    Args:
        seed: 64-bit seed for the default Philox generator (reproducible runs). Ignored in secure
            mode. ``None`` draws one at random (still Philox: the run is then not reproducible
            unless you record ``seed``).
        secure_mode: use ChaCha20 keyed from OS entropy, fp64 noise and the sum-of-normals
            mitigation; the key is never derived from anything the user chose.
        group: process group to broadcast the secure key over (default: the default group if
            torch.distributed is initialised).
    """

    def __init__(self, seed: Optional[int] = None, secure_mode: bool = False, group=None) -> None:
        self.secure_mode = bool(secure_mode)
        self.seed: Optional[int] = None
        self._key: Optional[List[int]] = None
        if self.secure_mode:
            self._key = _broadcast_key(_C.privacy.entropy_key(), group)
        else:
            self.seed = int(seed) if seed is not None else secrets.randbits(63)

    @classmethod
    def of_run(cls, run: "_C.dp.RunStart") -> "NoiseSource":
        """The randomness the run's start settled on every rank (src/dp/run.h): rank 0's key in
        secure mode, else the run's seed."""
        source = cls.__new__(cls)
        source.secure_mode = bool(run.secure)
        source.seed = None if run.secure else int(run.seed)
        source._key = list(run.key) if run.secure else None
        return source

    @property
    def key(self) -> Optional[List[int]]:
        """Secure mode's ChaCha20 key (eight 32-bit words; whoever holds it can regenerate the
        run's noise and batches), None when seeded."""
        return None if self._key is None else list(self._key)

    @property
    def sampler_seed(self) -> Union[int, List[int]]:
        """What :class:`dpzero.data.PoissonBatchSampler` takes as ``seed``."""
        return list(self._key) if self.secure_mode else self.seed

    def add_(self, tensor: torch.Tensor, std: float, step: int, offset: int) -> torch.Tensor:
        """Add std · z(step, j) to ``tensor`` (contiguous) holding global coordinates
        [offset, offset + numel); returns ``tensor``."""
        if self.secure_mode:
            return torch.ops.dpzero.add_secure_noise_(tensor, std, self._key, step, offset)
        return torch.ops.dpzero.add_noise_(tensor, std, as_int64(self.seed), step, offset)

    def __repr__(self) -> str:
        return ("NoiseSource(secure_mode=True)" if self.secure_mode
                else f"NoiseSource(seed={self.seed})")


def as_int64(seed: int) -> int:
    """The op takes int64; any 64-bit seed is passed through by its bits."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= (1 << 63) else seed


def _broadcast_key(key: List[int], group) -> List[int]:
    # A group given (torch's, or one dpzero.zero.new_process_group made without
    # torch.distributed) is always used: every rank must hold rank 0's key.
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return key
    # Rank 0 *of the group*; in C++, not torch.distributed: see python/csrc/comm_bindings.cpp.
    return _C.comm.broadcast(group if group is not None else dist.group.WORLD, key, 0)
