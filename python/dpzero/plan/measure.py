"""Measuring memory as the planner's model counts it: bytes of live tensors.

On CUDA the caching allocator keeps statistics (``torch.cuda.max_memory_allocated``). The CPU
allocator keeps none, so on CPU the allocations are tracked through torch's profiler
(``profile_memory=True``): every allocation and free of a tensor storage, with its size and time,
from which the live-byte curve and its peak follow. Only storages allocated or freed while the
profiler runs are seen; :class:`Tracked` therefore reports the peak of the live bytes *relative
to the start* (``peak_delta``). Tensors that live across the measured region (parameters,
optimizer state, gradient buffers) are counted by their owners (``ShardedModule.memory()``).
This is a tracked-allocation measure, not RSS: allocator slack, Python objects and library
code are not in it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch


@dataclass
class Tracked:
    peak_delta: int = 0        # max over the region of (live bytes - live bytes at its start)
    end_delta: int = 0         # live bytes at the end - at the start
    allocations: int = 0       # allocation events seen
    timeline: List[Tuple[int, int]] = field(default_factory=list)  # (time ns, live delta)
    marks: Dict[str, int] = field(default_factory=dict)  # name -> time ns (CPU only)

    def mark(self, name: str) -> None:
        """Marks this moment (``peak_since(name)`` after the region); CPU regions only."""
        with torch.autograd.profiler.record_function(f"dpzero.mark.{name}"):
            pass

    def peak_since(self, name: str) -> int:
        """The peak live delta (relative to the region's start) after mark ``name``."""
        t0 = self.marks[name]
        return max((live for t, live in self.timeline if t >= t0), default=0)

    def live_at(self, name: str) -> int:
        """The live delta at mark ``name``."""
        t0 = self.marks[name]
        before = [live for t, live in self.timeline if t < t0]
        return before[-1] if before else 0


def _events(prof, device_type: str):
    from torch._C._profiler import _EventType

    allocs, marks = [], {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            if f.device.type == device_type:
                allocs.append((node.start_time_ns, int(f.alloc_size)))
        elif node.name.startswith("dpzero.mark."):
            marks[node.name[len("dpzero.mark."):]] = node.start_time_ns
        stack.extend(node.children)
    allocs.sort()
    return allocs, marks


@contextlib.contextmanager
def tracked(device: str = "cpu"):
    """``with tracked() as t: ...`` then ``t.peak_delta``: the peak live tensor bytes the block
    added on ``device`` ("cpu" through the profiler, with a timeline and marks; "cuda" through
    the allocator's statistics)."""
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
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                 record_shapes=True) as prof:
        yield result
    events, result.marks = _events(prof, "cpu")
    live = peak = 0
    for t, size in events:
        live += size
        peak = max(peak, live)
        result.timeline.append((t, live))
    result.peak_delta, result.end_delta, result.allocations = peak, live, len(events)
