"""Measuring memory as the planner's model counts it: bytes of live tensors.

On CUDA the caching allocator keeps statistics (``torch.cuda.max_memory_allocated``). The CPU
allocator keeps none, so on CPU dpzero counts them itself: while a measurement runs, a tracking
wrapper around the CPU allocator records every storage's size at allocation and subtracts it at
the free, on whichever thread the free happens (Note [tracking CPU allocator] in
src/memory/cpu_tracker.h; torch's profiler, used before, misses frees on Gloo's worker threads
and drifted upward by several MiB over a few steps). Only storages allocated while tracked are
counted; :class:`Tracked` therefore reports live bytes *relative to the start*
(``peak_delta``). Tensors that live across the measured region (parameters, optimizer state,
gradient buffers) are counted by their owners (``ShardedModule.memory()``). This is a
tracked-allocation measure, not RSS: allocator slack, Python objects and library code are not
in it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch


@dataclass
class Tracked:
    peak_delta: int = 0        # max over the region of (live bytes - live bytes at its start)
    end_delta: int = 0         # live bytes at the end - at the start
    # CPU only: the region cut at its marks; segment i runs from mark i - 1 (or the start) to
    # mark i (or the end) and holds its peak live delta
    segment_peaks: List[int] = field(default_factory=list)
    marks: Dict[str, Tuple[int, int]] = field(default_factory=dict)  # name -> (segment, live)
    _watch: Optional[int] = None
    _start: int = 0

    def mark(self, name: str) -> None:
        """Marks this moment (``live_at(name)``, ``peak_since(name)`` after the region); CPU
        regions only."""
        if self._watch is None:
            raise RuntimeError("Tracked.mark: marks are for CPU regions, while they run")
        from .. import _C

        self.segment_peaks.append(_C.memory.cpu_peak_bytes(self._watch) - self._start)
        _C.memory.reset_cpu_peak(self._watch)
        self.marks[name] = (len(self.segment_peaks), _C.memory.cpu_live_bytes() - self._start)

    def peak_since(self, name: str) -> int:
        """The peak live delta (relative to the region's start) after mark ``name``."""
        return max(self.segment_peaks[self.marks[name][0]:], default=0)

    def live_at(self, name: str) -> int:
        """The live delta at mark ``name``."""
        return self.marks[name][1]


@contextlib.contextmanager
def tracked(device: str = "cpu"):
    """``with tracked() as t: ...`` then ``t.peak_delta``: the peak live tensor bytes the block
    added on ``device`` ("cpu" through dpzero's tracking allocator, with marks; "cuda" through
    the caching allocator's statistics)."""
    result = Tracked()
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        start = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        yield result
        torch.cuda.synchronize(dev)
        result.peak_delta = torch.cuda.max_memory_allocated(dev) - start
        result.end_delta = torch.cuda.memory_allocated(dev) - start
        return
    from .. import _C

    result._watch = _C.memory.watch_cpu()
    result._start = _C.memory.cpu_live_bytes()
    try:
        yield result
        result.segment_peaks.append(_C.memory.cpu_peak_bytes(result._watch) - result._start)
        result.peak_delta = max(result.segment_peaks)
        result.end_delta = _C.memory.cpu_live_bytes() - result._start
    finally:
        _C.memory.unwatch_cpu(result._watch)
        result._watch = None
