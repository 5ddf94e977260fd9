"""Poisson-sampled data loading (design.md §2 step 1; Note [poisson schedule] in privacy/poisson.h).

:class:`PoissonBatchSampler` is a torch ``Sampler`` of micro-batches: for each step t it yields
this rank's micro-batches of the logical batch {k : u(seed, t, k) < q}, at most
``max_physical_batch_size`` examples each, and as many as every other rank (short ranks get empty
micro-batches). :func:`dp_data_loader` wraps it in a ``DataLoader`` whose collate function turns an
empty micro-batch into correctly shaped empty tensors.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterator, List, Optional, Sequence, Union

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data._utils.collate import default_collate

from . import _C

_privacy = _C.privacy


class PoissonBatchSampler(Sampler[List[int]]):
    """Micro-batches of Poisson-sampled logical batches for one rank.

    Args:
        num_samples: dataset size N.
        sample_rate: q in [0, 1].
        steps: number of logical steps to yield.
        seed: sampler seed — a 64-bit integer (Philox), or in secure mode the run's 8-word key
            (``NoiseSource.sampler_seed``); the same seed gives the same batches on every rank.
        rank, world_size: this rank and the number of ranks (partition k mod world_size).
        max_physical_batch_size: micro-batch cap m (default: no cap, one micro-batch per step).
        start_step: first step (for resuming a run).
        partitions: b >= 1; step t samples only the examples k with k mod b = t mod b (Note
            [cyclic poisson] in privacy/poisson.h: banded noise needs it); 1: all of them.
    """

    def __init__(self, num_samples: int, sample_rate: float, steps: int,
                 seed: Union[int, Sequence[int]], rank: int = 0,
                 world_size: int = 1, max_physical_batch_size: Optional[int] = None,
                 start_step: int = 0, partitions: int = 1) -> None:
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        if max_physical_batch_size is not None and max_physical_batch_size < 1:
            raise ValueError(
                f"max_physical_batch_size must be >= 1, got {max_physical_batch_size}")
        self.num_samples = int(num_samples)
        self.sample_rate = float(sample_rate)
        self.steps = int(steps)
        self.seed = _sampler_seed(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.max_physical_batch_size = max_physical_batch_size or max(1, self.num_samples)
        self.start_step = int(start_step)
        self.partitions = int(partitions)
        # Validates every argument once, with the value named, before any iteration.
        _privacy.poisson_micro_batches(self.seed, self.start_step, self.num_samples,
                                       self.sample_rate, self.rank, self.world_size,
                                       self.max_physical_batch_size, self.partitions)

    def schedule(self, step: int) -> _privacy.MicroBatchSchedule:
        """This rank's micro-batches of ``step`` with the logical batch size and per-rank counts."""
        return _privacy.poisson_micro_batches(self.seed, step, self.num_samples, self.sample_rate,
                                              self.rank, self.world_size,
                                              self.max_physical_batch_size, self.partitions)

    def logical_batches(self) -> Iterator[tuple]:
        """(step, schedule) for each step."""
        for t in range(self.start_step, self.start_step + self.steps):
            yield t, self.schedule(t)

    def __iter__(self) -> Iterator[List[int]]:
        for _, sched in self.logical_batches():
            yield from sched.micro_batches

    def __len__(self) -> int:
        """The expected number of micro-batches: ``steps`` times the micro-batches of a step of
        the expected size q·N / (partitions · world_size) rows (at least one). Not the realised
        number, which follows the sampled batch sizes: those are private (one example's coin
        moves them), and a progress bar or a schedule sized by ``len()`` would release them."""
        rows = self.sample_rate * self.num_samples / (self.partitions * self.world_size)
        return self.steps * max(1, math.ceil(rows / self.max_physical_batch_size))


def _sampler_seed(seed):
    """An integer seed (any integral type: Python, numpy) or secure mode's 8-word key."""
    if isinstance(seed, numbers.Integral):
        return int(seed) & ((1 << 64) - 1)
    if isinstance(seed, (list, tuple)) and len(seed) == 8 and all(
            isinstance(w, numbers.Integral) for w in seed):
        return [int(w) for w in seed]
    raise ValueError(f"seed must be an integer or a secure key of 8 integers, got {seed!r}")


class EmptySafeCollate:
    """A collate function that maps an empty micro-batch to empty tensors shaped like one example
    of ``dataset``. A class, not a closure, so that DataLoader workers started by spawn or
    forkserver (macOS's and Windows's default) can be handed it."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __call__(self, batch: Sequence[Any]):
        if len(batch) > 0:
            return default_collate(batch)
        template = default_collate([self.dataset[0]])
        return _map_tensors(template, lambda t: t[:0])


def empty_safe_collate(dataset: Dataset) -> EmptySafeCollate:
    return EmptySafeCollate(dataset)


def _map_tensors(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def dp_data_loader(dataset: Dataset, sample_rate: float, steps: int,
                   seed: Union[int, Sequence[int]], rank: int = 0,
                   world_size: int = 1, max_physical_batch_size: Optional[int] = None,
                   start_step: int = 0, **loader_kwargs) -> DataLoader:
    """A DataLoader over Poisson-sampled micro-batches (``loader.batch_sampler`` is the sampler)."""
    if len(dataset) == 0:
        raise ValueError("dp_data_loader: the dataset is empty (0 examples)")
    sampler = PoissonBatchSampler(len(dataset), sample_rate, steps, seed, rank, world_size,
                                  max_physical_batch_size, start_step)
    loader_kwargs.setdefault("collate_fn", empty_safe_collate(dataset))
    return DataLoader(dataset, batch_sampler=sampler, **loader_kwargs)
