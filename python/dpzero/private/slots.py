"""Where each trained parameter lives in the ZeRO state: its unit and its slot of the unit's flat
layout. The engine makes one ``Slots`` at attach and hands it to those who read or write the
masters by parameter (the optimizer's state dicts, the module state-dict hooks)."""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Tuple

import torch

from .book import Slot


class Slots:
    def __init__(self, slot_of: Dict[int, Slot], sharded, between_steps: Callable[[str], None],
                 clean: Callable[[], object], loaded: Callable[[object], None]) -> None:
        """``slot_of``: id(parameter) -> its Slot; ``sharded``: the ShardedModule whose ZeRO state
        holds them (read at each use: a retired one no longer has it, Note [ending a script]);
        ``between_steps(what)`` raises on every rank unless every rank is between steps (a
        collective); ``clean()`` is asked before a load writes the masters and ``loaded(that
        answer)`` told after (StateGuard.clean_trained and record_trained)."""
        self._clean = clean
        self._slot_of = slot_of
        self._sharded = sharded
        self._between_steps = between_steps
        self._loaded = loaded

    def __contains__(self, p: torch.Tensor) -> bool:
        return id(p) in self._slot_of

    def unit(self, p: torch.Tensor) -> int:
        return self._slot_of[id(p)].unit

    def read(self, flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """p's slot of ``flat`` ([padded_numel] of its unit), as p's shape (a view)."""
        slot = self._slot_of[id(p)]
        return flat[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def write(self, flat: torch.Tensor, p: torch.Tensor, value: torch.Tensor) -> None:
        """Writes ``value`` (p's shape) into p's slot of ``flat`` ([padded_numel] of its unit)."""
        slot = self._slot_of[id(p)]
        flat[slot.offset:slot.offset + slot.numel] = value.reshape(-1).to(flat)

    def load_unit(self, u: int, entries: Dict[str, torch.Tensor], steps: int) -> None:
        """Loads unit u's 'param' and optimizer ``entries`` (each [padded_numel], the whole
        layout) over this rank's kept range (Note [checkpoint slices]; collective in stages
        1-2)."""
        zero = self._sharded.zero_state
        begin, end = zero.kept_range(u)
        clean = self._clean()
        zero.load_state(u, {name: t[begin:end] for name, t in entries.items()}, steps)
        self._loaded(clean)  # loaded, not written by the forward

    def load_parameters(self, values: Iterable[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Writes ``values`` ([(parameter, tensor of its shape)]) into the masters (Note [module
        state dicts]); the optimizer state is kept. A collective with several ranks."""
        self._between_steps("load_state_dict")
        zero = self._sharded.zero_state
        by_unit: Dict[int, list] = {}
        for p, v in values:
            by_unit.setdefault(self.unit(p), []).append((p, v))
        for u in sorted(by_unit):
            current = zero.gathered_state(u)  # collective when W > 1
            for p, v in by_unit[u]:
                self.write(current["param"], p, v)
            self.load_unit(u, current, zero.optimizer_steps(u))
