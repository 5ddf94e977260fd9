"""Real datasets that Debian packages ship, with train/test splits that cannot leak.

* ``fortunes``: Debian's ``fortunes`` / ``fortunes-min`` corpus (/usr/share/games/fortunes), one
  file per category, entries separated by ``%`` lines. The task is to tell the category of a
  fortune from its text: a multi-class problem with a clear metric (accuracy) on real, short
  English texts that a sentence encoder like MiniLM represents well. Identical texts are kept
  once (several categories repeat some), and the split goes by a SHA-256 of the text, so one
  text can never be on both sides and the split is the same on every machine and rank.
* ``fashion-mnist``: Debian's ``dataset-fashion-mnist`` (/usr/share/datasets/fashion-mnist), the
  IDX files of Xiao et al. 2017 with their official 60,000 / 10,000 split.
"""

from __future__ import annotations

import gzip
import hashlib
import os
from typing import List, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import TensorDataset

FORTUNES_DIR = "/usr/share/games/fortunes"
FASHION_DIR = "/usr/share/datasets/fashion-mnist"


class DatasetMissing(FileNotFoundError):
    """A dataset whose Debian package is not installed; the message says which."""


def fortune_texts(categories: Sequence[str], root: str = FORTUNES_DIR) -> List[Tuple[str, int]]:
    """[(text, label)] with label = index of the category, duplicates dropped (first kept)."""
    if not os.path.isdir(root):
        raise DatasetMissing(f"{root} does not exist: install the Debian packages fortunes and "
                             "fortunes-min (scripts/setup.sh does)")
    seen, out = set(), []
    for label, cat in enumerate(categories):
        path = os.path.join(root, cat)
        if not os.path.isfile(path):
            available = sorted(f for f in os.listdir(root) if "." not in f)
            raise DatasetMissing(f"fortunes category {cat!r} not found in {root}; available: "
                                 f"{available}")
        with open(path, encoding="utf-8", errors="replace") as f:
            raw = f.read()
        for entry in raw.split("\n%\n"):
            text = " ".join(entry.replace("%", " ").split())
            if len(text) < 8 or text in seen:
                continue
            seen.add(text)
            out.append((text, label))
    return out


def _text_hash(text: str) -> float:
    """The first 8 bytes of SHA-256(text) as a fraction in [0, 1)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64


def in_test_split(text: str, test_fraction: float) -> bool:
    """Deterministic split by content."""
    return _text_hash(text) < test_fraction


def split_texts(items, test_fraction: float):
    """(train, test), each in a content-hash order (a fixed shuffle: the corpus is grouped by
    category, so a prefix of either list mixes the classes)."""
    keyed = sorted(items, key=lambda item: _text_hash("order:" + item[0]))
    train = [(t, y) for t, y in keyed if not in_test_split(t, test_fraction)]
    test = [(t, y) for t, y in keyed if in_test_split(t, test_fraction)]
    return train, test


def tokenize(items, tokenizer, max_length: int) -> TensorDataset:
    """(input_ids [n, L] int64, attention_mask [n, L] int64, labels [n] int64)."""
    texts = [t for t, _ in items]
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=max_length,
                    return_tensors="pt")
    labels = torch.tensor([y for _, y in items], dtype=torch.int64)
    return TensorDataset(enc["input_ids"].long(), enc["attention_mask"].long(), labels)


def _read_idx(path: str) -> np.ndarray:
    """An IDX file (LeCun's MNIST format): magic 0x0000 0x08 ndim, big-endian dims, uint8 data."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes (header {data[:4]!r})")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims} ({int(np.prod(dims))} bytes), file has "
                         f"{body.size}")
    return body.reshape(dims)


def fashion_mnist(train: bool, root: str = FASHION_DIR,
                  scale: str = "standardize") -> TensorDataset:
    """(images [n, 1, 28, 28] float32, labels [n] int64). ``scale``: "standardize" (the training
    set's mean and standard deviation) or "unit" (pixels / 255 in [0, 1], torchvision's ToTensor,
    as Tramèr & Boneh 2021's code feeds the CNN)."""
    if scale not in ("standardize", "unit"):
        raise ValueError(f"scale must be 'standardize' or 'unit', got {scale!r}")
    if not os.path.isdir(root):
        raise DatasetMissing(f"{root} does not exist: install the Debian package "
                             "dataset-fashion-mnist (scripts/setup.sh does)")
    prefix = "train" if train else "t10k"
    images = _read_idx(os.path.join(root, f"{prefix}-images-idx3-ubyte.gz"))
    labels = _read_idx(os.path.join(root, f"{prefix}-labels-idx1-ubyte.gz"))
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{root}: {images.shape[0]} images but {labels.shape[0]} labels")
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    if scale == "standardize":
        x = (x - 0.2860) / 0.3530  # the training set's mean and standard deviation
    return TensorDataset(x, torch.from_numpy(labels.astype(np.int64)))
