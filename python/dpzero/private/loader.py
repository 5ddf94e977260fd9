"""The private data loader: this rank's micro-batches of each Poisson-sampled logical batch
(design.md §2 step 1; ``data.PoissonBatchSampler``), tagged as the examples of their micro-batch
(Note [batch provenance] in provenance/examples.py), with one-row padding batches where a rank's
share runs short (Note [padding batches] in src/dp/book.h)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from torch.utils.data import DataLoader, Dataset

from ..data import PoissonBatchSampler, empty_safe_collate
from .collate import SeparableCollate
from .provenance.examples import MicroBatchToken, tag


@dataclass(frozen=True)
class Schedule:
    """What the private loader needs of its engine, handed to it explicitly. The engine owns the
    step count and the sampling seed (a checkpoint's load may move both), so the loader asks for
    them each epoch rather than keeping copies."""
    sample_rate: float  # q
    # (steps_per_epoch, start step, micro-batch cap) -> this rank's sampler from that step on
    sampler: Callable[[int, int, Optional[int]], PoissonBatchSampler]
    next_step: Callable[[], int]  # the first logical step not yet taken
    # (t, i, n, size, rows, padding) -> the token of micro-batch i of n of logical step t
    begin_micro_batch: Callable[..., MicroBatchToken]
    # (what, {name: value}): every rank checks it holds the same values (a collective)
    agree: Callable[[str, dict], None]
    # (purpose, step, micro-batch index): the global generators reseeded from the run's secret
    # (Note [the model's own randomness] in src/dp/generators.h)
    reseed: Callable[[str, int, int], None]
    # a DataLoader's worker_init_fn reseeding each worker's generators from that secret
    worker_init: Callable[[int], None]


class DPDataLoader:
    """Micro-batches of Poisson-sampled logical batches (``data.PoissonBatchSampler``). One pass
    (``for batch in loader``) is one epoch: ``steps_per_epoch`` logical steps, continuing from
    the last step taken. ``len(loader)`` is the expected number of micro-batches of the next
    epoch (``PoissonBatchSampler.__len__``: the realised number follows the sampled batch sizes,
    which are private). The tensors it yields carry the micro-batch's tag (Note [batch
    provenance]): the model accepts them, and no others, for the step."""

    def __init__(self, schedule: Schedule, dataset: Dataset, steps_per_epoch: int,
                 max_physical_batch_size: Optional[int], collate_fn=None, num_workers: int = 0,
                 pin_memory: bool = False) -> None:
        self._schedule = schedule
        self.dataset = dataset
        self.steps_per_epoch = int(steps_per_epoch)
        self.max_physical_batch_size = max_physical_batch_size
        # Note [separable collate]: a caller's collate function is checked batch by batch.
        self.collate_fn = SeparableCollate(collate_fn or empty_safe_collate(dataset),
                                           vouched=collate_fn is None)
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.sample_rate = schedule.sample_rate

    def _sampler(self, start: int) -> PoissonBatchSampler:
        return self._schedule.sampler(self.steps_per_epoch, start, self.max_physical_batch_size)

    def cap_physical_batch_size(self, cap: int) -> Optional[int]:
        """Cuts micro-batches at no more than ``cap`` rows from now on (the smaller of it and
        the cap in force), once every rank has agreed on ``cap`` (Note [poisson schedule]: every
        rank derives every rank's micro-batch counts from it). Returns the cap that was in force,
        for ``max_physical_batch_size`` to be set back to."""
        self._schedule.agree("agreeing on the micro-batch cap",
                             {"max_physical_batch_size": cap})
        previous = self.max_physical_batch_size
        self.max_physical_batch_size = cap if previous is None else min(previous, cap)
        return previous

    def __len__(self) -> int:
        return len(self._sampler(self._schedule.next_step()))

    def __iter__(self):
        start = self._schedule.next_step()
        sampler = self._sampler(start)
        # Note [the model's own randomness]: workers draw their seeds from the run's secret when
        # the iteration starts; examples fetched here draw from it at each micro-batch.
        reseed = self._schedule.reseed
        reseed("iter", start, 0)
        padded = _PaddedBatches(sampler, None if self.num_workers else
                                (lambda t, i: reseed("fetch", t, i)))
        loader = DataLoader(self.dataset, batch_sampler=padded, collate_fn=self.collate_fn,
                            num_workers=self.num_workers, pin_memory=self.pin_memory,
                            worker_init_fn=self._schedule.worker_init if self.num_workers
                            else None)
        meta = ((t, i, len(s.micro_batches), s.logical_batch_size, len(mb))
                for t, s in self._sampler(start).logical_batches()
                for i, mb in enumerate(s.micro_batches))
        for batch, (t, i, n, size, rows) in zip(loader, meta):
            token = self._schedule.begin_micro_batch(t, i, n, size, max(rows, 1),
                                                     padding=rows == 0)
            yield tag(batch, token)  # Note [batch provenance]


class _PaddedBatches:
    """A short rank's empty micro-batch as one row of example 0 (Note [padding batches] in
    src/dp/book.h: the book makes its gradient exact zeros)."""

    def __init__(self, sampler: PoissonBatchSampler,
                 begin: Optional[Callable[[int, int], None]] = None) -> None:
        self.sampler = sampler
        self.begin = begin  # (t, i) before micro-batch i of logical step t is fetched

    def __iter__(self):
        for t, schedule in self.sampler.logical_batches():
            for i, mb in enumerate(schedule.micro_batches):
                if self.begin is not None:
                    self.begin(t, i)
                yield mb if len(mb) else [0]

    def __len__(self) -> int:
        return len(self.sampler)


@dataclass
class MicroBatch:
    """The micro-batch handed out last (by the loader or ``own_batch``)."""
    token: MicroBatchToken      # what its tensors carry (Note [batch provenance])
    count: Optional[int]        # micro-batches of its logical batch; None: the caller's step()
    logical_size: int           # the logical batch's realised size over all ranks (private)
