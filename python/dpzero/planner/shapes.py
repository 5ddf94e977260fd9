"""Profiles without a run: the memory terms of a model too large for this machine (or of a device
it does not have), from tensor shapes on the meta device.

Note [shape profile]
~~~~~~~~~~~~~~~~~~~~
``profile`` (profile.py) measures the transient on the real device. For the DP-ZeRO paper's
A100 configurations nothing can be run here, so ``shape_profile`` builds the model on the meta
device, runs forward and backward there (shapes and dtypes, no data) and estimates the same
terms from what the graph would hold:

  activations  every tensor autograd saves (each storage once), per unit and outside units;
  book         flat / automatic clipping (book-keeping, Bu et al. 2023): every DP layer's input A
               and output gradient G (the output's shape) live together at the end of the
               backward, plus the per-sample gradients kept for biases and norm layers
               (float64, [B, numel]); layer clipping: one layer's A and G at a time;
  loss         the model output's gradient at the start of the backward (its size again).

Stage 3's gathered units: p (Ψ_root + 2 max_u Ψ_u), the root unit (what no unit holds: it
encloses the forward) and two units (the running one and the prefetched one).

transient(none) = max(activations + loss, book) and transient(all units checkpointed) =
max(inputs of the units + activations outside them + the largest unit's activations + loss,
book): the book-keeping terms do not shrink with checkpointing. No workspace (the CUDA kernels'
temporaries are per call) and no times: a shape profile predicts memory only.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ..private.layers import layer_kind
from ..zero import default_units
from .profile import Profile, storage_bytes, storage_key, unit_profiles


def shape_profile(make_model: Callable[[], nn.Module], forward_loss: Callable[[nn.Module], torch.Tensor],
                  batch_size: int, *, units: Optional[Sequence[str]] = None,
                  clipping: str = "flat", param_bytes: int = 2,
                  optimizer_bytes: int = 12) -> Profile:
    """Note [shape profile]. ``make_model()`` must build on the meta device (``with
    torch.device("meta")``) in the compute dtype; ``forward_loss(model)`` runs one micro-batch
    of meta tensors. ``param_bytes`` / ``optimizer_bytes``: p and K of the planned precision and
    optimizer (bf16 + Adam with fp32 master: 2 and 12)."""
    model = make_model()
    unit_names = list(units) if units is not None else default_units(model)
    per_unit = unit_profiles(model, unit_names, lambda: forward_loss(model), torch.device("meta"))
    for u in per_unit:
        u.forward_s = 0.0

    # Everything saved (inside units or not), the output, and the DP layers' A and G.
    saved = [0]
    seen = {storage_key(p) for p in model.parameters()}  # parameters and views of them
    book, largest_layer = [0], [0]

    def pack(t):
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            saved[0] += storage_bytes(t)
        return t

    def layer_hook(module, args, output):
        a = sum(x.numel() * x.element_size() for x in args if isinstance(x, torch.Tensor))
        g = output.numel() * output.element_size() if isinstance(output, torch.Tensor) else 0
        kept = 0
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and p.dim() == 1:  # biases and norm weights: kept per sample
                kept += batch_size * p.numel() * 8
        book[0] += a + g + kept
        largest_layer[0] = max(largest_layer[0], a + g + kept)

    handles = [m.register_forward_hook(layer_hook) for m in model.modules()
               if layer_kind(m) is not None and any(p.requires_grad for p in
                                                     m.parameters(recurse=False))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = forward_loss(model)
    finally:
        for h in handles:
            h.remove()
    del loss
    unit_saved = sum(u.saved_bytes for u in per_unit)
    outside = max(saved[0] - unit_saved, 0)
    book_term = book[0] if clipping in ("flat", "automatic", "group") else largest_layer[0]
    loss_bytes = _output_bytes(model, forward_loss)
    none = max(saved[0] + loss_bytes, book_term)
    checkpointed = (sum(u.input_bytes for u in per_unit) + outside
                    + max((u.saved_bytes for u in per_unit), default=0) + loss_bytes)
    every = max(checkpointed, book_term)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # Stage 3 (Note [planner memory model]): the root unit, the running and the prefetched unit.
    in_units = sum(u.params for u in per_unit)
    gathered = param_bytes * (max(n_params - in_units, 0)
                              + 2 * max((u.params for u in per_unit), default=0))
    return Profile(micro_batch=batch_size, device="meta", threads=0, clipping=clipping,
                   param_bytes=param_bytes, optimizer_bytes=optimizer_bytes, params=n_params,
                   units=per_unit, between={"none": 0, "all": 0}, workspace=0,
                   transient={"none": int(none), "all": int(every)},
                   backward_end={"none": 0, "all": 0},
                   compute_s={"none": 0.0, "all": 0.0}, optimizer_s=0.0,
                   terms={"activations": saved[0], "book": book_term, "loss": loss_bytes,
                          "checkpointed_activations": checkpointed - loss_bytes,
                          "gathered": gathered},
                   gathered=gathered)


def _output_bytes(model: nn.Module, forward_loss) -> int:
    """Bytes of the model's largest output tensor in one forward (the logits)."""
    sizes = [0]

    def hook(_m, _a, out):
        leaves = out if isinstance(out, (tuple, list)) else [getattr(out, "logits", out)]
        for t in leaves:
            if isinstance(t, torch.Tensor):
                sizes[0] = max(sizes[0], t.numel() * 4)  # the loss works in float32
    h = model.register_forward_hook(hook)
    try:
        with torch.no_grad():
            forward_loss(model)
    finally:
        h.remove()
    return sizes[0]
