"""The task a run's config names: its model and data (``build``), and the private model's
evaluation on the test set, the same for the job's own loop (runner.py) and the Trainer's
(trainer_loop.py)."""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from .. import _C
from .config import ConfigError, RunConfig
from .datasets import fashion_mnist, fortune_texts, split_texts, tokenize
from .features import scatter_features, sentence_features
from .models import (ScatterNetCNN, ScatterNetLinear, SentenceLinear, TanhCNN, load_encoder,
                     load_minilm)


def rank_world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def ranks_here(cfg: RunConfig) -> int:
    """The job's ranks on this machine: the launcher's LOCAL_WORLD_SIZE (a job over several
    nodes), else world_size (``dpzero train`` starts every rank on this machine)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", cfg.training.world_size))


def device_kind(choice: str, ranks: int, gpus: Optional[int] = None) -> str:
    """``[training] device`` for ``ranks`` processes on a machine of ``gpus`` GPUs (default: this
    one's): "cuda" (one GPU each) or "cpu". "auto" takes the GPUs only when there is one per
    rank: NCCL runs one rank per GPU."""
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if choice == "cpu" or (choice == "auto" and gpus < ranks):
        return "cpu"
    if gpus < ranks:
        raise ConfigError(f'[training] device = "cuda" needs one GPU per rank: {ranks} rank(s) on '
                          f"this machine, but it has {gpus} GPU(s); lower world_size or set "
                          'device = "auto"')
    return "cuda"


def unused_gpus(choice: str, ranks: int, gpus: Optional[int] = None) -> Optional[str]:
    """What to tell the user when "auto" trains on the CPU of a machine that has GPUs (too few
    for one per rank), or None."""
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if choice != "auto" or not 0 < gpus < ranks:
        return None
    return (f"[dpzero train] training on the CPU: {ranks} rank(s) and {gpus} GPU(s) on this "
            f"machine, and each rank needs a GPU of its own; set [training] world_size = {gpus} "
            "to train on the GPUs")


def rank_device(cfg: RunConfig, local_rank: int = None) -> torch.device:
    """This rank's device (device_kind over ranks_here): the CPU, or GPU ``local_rank`` (by
    default the current one, which the worker set from the launcher's LOCAL_RANK; a job of one
    rank, run in the launching process, takes GPU 0)."""
    if device_kind(cfg.training.device, ranks_here(cfg)) == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device() if local_rank is None else local_rank)


def on_device(unpack, device: torch.device):
    """``unpack`` (build's: a batch of the data set's CPU rows -> (inputs, labels)) with its
    tensors moved to ``device``."""
    if device.type == "cpu":
        return unpack

    def moved(batch):
        inputs, y = unpack(batch)
        return tuple(t.to(device, non_blocking=True) for t in inputs), y.to(device)
    return moved


def autocast(cfg: RunConfig, device: torch.device):
    """The context of the forward and the loss: bf16 autocast under ``precision = "bf16"`` (as
    torch.autocast around a forward, and as the Trainer's bf16=True), else nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16,
                          enabled=cfg.training.precision == "bf16")


def loss(model, rows, cast) -> torch.Tensor:
    """The mean cross-entropy of a micro-batch ``rows`` = (inputs, labels), its forward and loss
    in ``cast`` (the run's autocast)."""
    inputs, y = rows
    with cast():
        return F.cross_entropy(model(*inputs), y)


def build(cfg: RunConfig):
    """(model, train set, test set, batch -> (inputs tuple, labels))."""
    torch.manual_seed(cfg.training.seed)
    m, d = cfg.model, cfg.data
    if m.kind == "minilm-linear":  # Note [fixed features and privacy] (features.py)
        train, test = embedded(m.path, tuple(d.categories), d.test_fraction, d.max_length,
                                d.limit, d.test_limit, *rank_world())
        torch.manual_seed(cfg.training.seed)  # the head's draw, whether or not features were cached
        model = SentenceLinear(len(d.categories), train.tensors[0].shape[1])
        unpack = lambda b: ((b[0],), b[1])  # noqa: E731
    elif m.kind == "minilm":
        train_items, test_items = fortunes(d.categories, d.test_fraction, d.limit, d.test_limit)
        model, tokenizer = load_minilm(m.path, len(d.categories), m.train_layers, m.lora_rank,
                                       m.lora_alpha)
        train = tokenize(train_items, tokenizer, d.max_length)
        test = tokenize(test_items, tokenizer, d.max_length)
        unpack = lambda b: ((b[0], b[1]), b[2])  # noqa: E731
    else:
        if cfg.model.kind == "cnn":
            train, test = image_split(True, d.scale, d.limit), image_split(False, d.scale, d.test_limit)
            model = TanhCNN(10, padding=cfg.model.padding)
        else:  # Note [fixed features and privacy] (features.py)
            train = scattered(True, d.scale, d.limit)
            test = scattered(False, d.scale, d.test_limit)
            head = ScatterNetLinear if cfg.model.kind == "scatternet-linear" else ScatterNetCNN
            model = head(10, groups=cfg.model.groups)
        unpack = lambda b: ((b[0],), b[1])  # noqa: E731
    return model, train, test, unpack


def fortunes(categories, test_fraction: float, limit: int, test_limit: int):
    """(train, test) [(text, label)] of the fortunes categories, each cut to its limit (0 = all)."""
    train, test = split_texts(fortune_texts(categories), test_fraction)
    return train[:limit] if limit else train, test[:test_limit] if test_limit else test


@functools.lru_cache(maxsize=4)
def embedded(path, categories: tuple, test_fraction: float, max_length: int, limit: int,
              test_limit: int, rank: int, world: int):
    """(train, test) TensorDatasets of (MiniLM sentence embeddings [n, 384], labels [n]), for
    kind "minilm-linear". Rank r embeds the texts r, r + W, ... and the ranks gather them, so
    every rank holds the same tensors and each text is encoded once. Kept for the process, like
    scattered, so a one-rank sweep's runs embed the texts once."""
    train_items, test_items = fortunes(list(categories), test_fraction, limit, test_limit)
    encoder, tokenizer = load_encoder(path)
    out = []
    for items in (train_items, test_items):
        ids, mask, labels = tokenize(items, tokenizer, max_length).tensors
        mine = sentence_features(encoder, ids[rank::world], mask[rank::world])
        if world > 1:
            parts = [None] * world
            dist.all_gather_object(parts, mine)
            features = torch.empty(len(items), mine.shape[1])
            for r, part in enumerate(parts):
                features[r::world] = part
        else:
            features = mine
        out.append(TensorDataset(features, labels))
    return tuple(out)


def image_split(train: bool, scale: str, limit: int) -> TensorDataset:
    """Fashion-MNIST's training or test split, its first ``limit`` examples (0 = all)."""
    data = fashion_mnist(train=train, scale=scale)
    return TensorDataset(*(t[:limit] for t in data.tensors)) if limit else data


@functools.lru_cache(maxsize=2)
def scattered(train: bool, scale: str, limit: int) -> TensorDataset:
    """image_split's ScatterNet features [n, 81, 7, 7] and labels. Kept for the process (the training
    and the test split, 1.1 GB for all of Fashion-MNIST) so that the runs of a one-rank sweep, and
    a run's baseline, compute them once: about 3 minutes here for the 70,000 images."""
    images, labels = image_split(train, scale, limit).tensors
    return TensorDataset(scatter_features(images), labels)


def input_names(cfg: RunConfig) -> tuple:
    """The names of the model's forward arguments, in ``unpack``'s order (build)."""
    return ("input_ids", "attention_mask") if cfg.model.kind == "minilm" else ("x",)


def evaluate(model, test, unpack, cast=contextlib.nullcontext, batch: int = 256
             ) -> Dict[str, float]:
    """Accuracy and mean loss over the test set. Each rank takes rows k mod W; all ranks run
    the same number of forwards (stage 3 gathers in every forward), the last ones possibly
    empty, and the counts are summed. ``unpack`` puts the rows on the model's device; ``cast``:
    a context factory the forwards run in (the training's autocast)."""
    rank, world = rank_world()
    n = len(test)
    idx = torch.arange(rank, n, world)
    rounds = math.ceil(math.ceil(n / world) / batch)
    correct = [0.0, 0.0, 0.0]  # correct, loss sum, count
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for r in range(rounds):
            rows = idx[r * batch:(r + 1) * batch]
            inputs, y = unpack(test[rows])
            with cast():
                logits = model(*inputs).float()
            correct[0] += (logits.argmax(-1) == y).sum().item()
            correct[1] += F.cross_entropy(logits, y, reduction="sum").item() if len(y) else 0.0
            correct[2] += len(y)
    model.train(was_training)
    if world > 1:  # in C++, not torch.distributed: see python/csrc/comm_bindings.cpp
        correct = _C.comm.all_reduce_sum_float64(dist.group.WORLD, correct)
    return {"accuracy": correct[0] / correct[2], "test_loss": correct[1] / correct[2]}
