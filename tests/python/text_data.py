"""Real text for training tests: Debian's `fortunes` corpus (scripts/setup.sh installs it), as byte
sequences (vocabulary 256, so no tokenizer download is needed)."""

from __future__ import annotations

import os
from typing import Sequence

import torch

FORTUNES = "/usr/share/games/fortunes"


def fortune_entries(categories: Sequence[str]) -> list:
    entries = []
    for cat in categories:
        path = os.path.join(FORTUNES, cat)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: scripts/setup.sh installs the Debian "
                                    "packages fortunes and fortunes-min")
        with open(path, "rb") as f:
            text = f.read()
        entries += [e.strip() for e in text.split(b"\n%\n") if e.strip()]
    return entries


def byte_sequences(categories: Sequence[str], length: int, limit: int) -> torch.Tensor:
    """[n, length] int64 byte ids: the corpus concatenated (entries separated by a newline) and
    cut into consecutive windows, at most ``limit`` of them."""
    stream = b"\n".join(fortune_entries(categories))
    n = min(limit, len(stream) // length)
    data = torch.frombuffer(bytearray(stream[: n * length]), dtype=torch.uint8)
    return data.view(n, length).long()
