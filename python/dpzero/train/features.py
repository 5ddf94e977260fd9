"""Fixed (non-learned) features computed from each example alone, before training: ScatterNet
features of images, and a pretrained sentence encoder's embeddings of texts.

The ScatterNet of Oyallon & Mallat 2015 as Tramèr & Boneh 2021 ("Differentially Private Learning
Needs Better Features", ICLR) use it for private learning: a 2-D wavelet scattering transform with
J = 2 scales and L = 8 orientations (kymatio's ``Scattering2D``). On a 28x28 image it gives
1 + J L + L² J (J - 1) / 2 = 1 + 16 + 64 = 81 channels of 7x7 (the maps are subsampled by 2^J).

Note [fixed features and privacy]: the transform has no parameters and reads one image at a time,
so an example's features depend on that example only. Training on them changes nothing in the
DP-SGD analysis: each example still contributes one clipped gradient, and ε is the accountant's
for (σ, q, steps). What would couple examples (statistics over the training set, as the
"BN" normalisation in Tramèr & Boneh's code computes with noise) is not done here; the models
normalise per example (GroupNorm, see models.py). The same holds for ``sentence_features``: the
encoder was pretrained on public data, stays frozen, runs without dropout, and encodes each text
in a forward of its own, so a text's embedding is a function of that text, bit for bit: batching
texts would let the others change it by rounding, and adding or removing one example would then
move other rows of the training set.
"""

from __future__ import annotations

import torch

from .models import mean_pool

SCATTER_J = 2
SCATTER_CHANNELS = 81  # 1 + J L + L² J (J - 1) / 2 for J = 2, L = 8


def scatter_features(images: torch.Tensor, chunk: int = 2000) -> torch.Tensor:
    """images [n, 1, 28, 28] float32 -> ScatterNet features [n, 81, 7, 7] float32, computed in
    chunks of ``chunk`` images (kymatio's 2-D scattering, J = 2, L = 8)."""
    if images.dim() != 4 or images.shape[1] != 1:
        raise ValueError(f"scatter_features takes [n, 1, H, W] images, got {list(images.shape)}")
    try:
        from kymatio.torch import Scattering2D
    except ImportError:
        raise ImportError("the ScatterNet features need the PyPI package kymatio "
                          "(requirements.txt; scripts/setup.sh installs it)") from None
    h, w = images.shape[-2:]
    scattering = Scattering2D(J=SCATTER_J, shape=(h, w))
    out = []
    with torch.no_grad():
        for start in range(0, images.shape[0], chunk):
            s = scattering(images[start:start + chunk])  # [c, 1, 81, h/4, w/4]
            out.append(s.flatten(1, 2).float())
    if not out:
        return images.new_zeros((0, SCATTER_CHANNELS, h >> SCATTER_J, w >> SCATTER_J))
    return torch.cat(out)


def sentence_features(encoder: torch.nn.Module, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor) -> torch.Tensor:
    """input_ids, attention_mask [n, L] int64 -> the encoder's mean-pooled last hidden states
    [n, hidden] float32, in eval mode (no dropout), each text encoded alone: one forward of
    shape [1, its own length] per text, so no other text can change its embedding even by
    rounding (a batched forward's kernels block their sums by the batch's shape)."""
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"sentence_features takes input_ids and attention_mask of one [n, L] "
                         f"shape, got {list(input_ids.shape)} and {list(attention_mask.shape)}")
    out = torch.zeros((input_ids.shape[0], encoder.config.hidden_size))
    was_training = encoder.training
    encoder.eval()
    try:
        with torch.no_grad():
            for i in range(input_ids.shape[0]):
                keep = attention_mask[i].bool()  # the text's own tokens, wherever padding sits
                ids, mask = input_ids[i, keep][None], attention_mask[i, keep][None]
                h = encoder(input_ids=ids, attention_mask=mask).last_hidden_state  # [1, len, H]
                out[i] = mean_pool(h, mask)[0].float()
    finally:
        encoder.train(was_training)
    return out
