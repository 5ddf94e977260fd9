"""T5-family relative position bias, looked up once per example (Note [relative position bias]).

Note [relative position bias]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
T5's attention adds a learned bias to its scores (Raffel et al. 2020, JMLR, §2.1, "relative
position embeddings"): ``compute_bias(q, k)`` looks the bucket of every (query, key) offset up in
``relative_attention_bias`` (an Embedding of [buckets, heads]) with ids [q, k] that no example
enters, and returns [1, heads, q, k], which every layer then adds to its scores [B, heads, q, k].
The broadcast sums the examples' gradients before the Embedding sees them, so its per-example
gradient cannot be split afterwards, and ids of shape [q, k] cannot be expanded to the batch the
way [1, T] position ids are (Note [broadcast positions]) without changing the shapes the model's
own code expects: the probe refuses such a lookup (Note [batch provenance]).

For the Hugging Face classes in :data:`VETTED`, whose ``compute_bias`` was read (transformers
5.23), dpzero computes the same bias per example. The class's own ``compute_bias`` runs without
gradients; the bucket ids [q, k] of its one lookup are given a batch dim of 1, [1, q, k], which
the DP Embedding expands to the examples of a private forward as it does [1, T] position ids
(Note [broadcast positions]): the lookup is [B, q, k, heads] and the result [B, heads, q, k]
(outside a private forward, B = 1 and the result is the original's). The probe follows every
use of the expanded lookup as it does for positions: the permutation keeping its rows on dim 0,
then T5's attention, which must add it to scores that hold the examples on the same dim
(eager attention's sum, or scaled-dot-product attention's additive ``attn_mask``); any other use
first (``bias[:1]``, an attention function of unknown semantics) refuses the step, and a rotated
probe checks the buckets do not depend on the examples. The sum with the scores is then the same
row by row, so the model computes the same function, and each example's gradient of the bias
table is its own. Every call checks that example 0's bias equals the class's own result exactly,
so a transformers release that changes the computation stops the step instead of training
another function.

The cost is memory: the bias is held as [B, heads, q, k], B times T5's own (UMT5 computes one
per layer), the size of one layer's attention scores. A frozen ``relative_attention_bias`` (no
per-sample gradient needed) keeps the original code.
"""

from __future__ import annotations

import functools
from typing import List

import torch
from torch import nn

from .fallback import bypass

# Hugging Face attention classes whose compute_bias(query_length, key_length, device,
# past_seen_tokens) is T5's (transformers 5.23): one lookup of the buckets of memory - context
# positions, permuted to [1, heads, q, k]. LongT5's local and transient-global attentions
# compute their bias over blocks and are not among them.
VETTED = frozenset({
    "T5Attention", "MT5Attention", "UMT5Attention", "LongT5Attention",
    "SwitchTransformersAttention", "Pop2PianoAttention", "UdopAttention",
})


def owners(model: nn.Module) -> List[nn.Module]:
    """The modules of ``model`` whose trainable relative position bias is computed per example."""
    out = []
    for module in model.modules():
        table = getattr(module, "relative_attention_bias", None)
        if type(module).__name__ in VETTED and \
                type(module).__module__.startswith("transformers.") and \
                getattr(module, "has_relative_attention_bias", False) and \
                isinstance(table, nn.Embedding) and table.weight.requires_grad:
            out.append(module)
    return out


def install(model: nn.Module) -> None:
    for module in owners(model):
        module._dp_compute_bias = module.__dict__.get("compute_bias")
        module.compute_bias = functools.partial(_compute_bias, module, module.compute_bias)


def remove(model: nn.Module) -> None:
    for module in model.modules():
        if "_dp_compute_bias" in module.__dict__:
            previous = module.__dict__.pop("_dp_compute_bias")
            if previous is None:
                del module.compute_bias
            else:
                module.compute_bias = previous


def _compute_bias(module: nn.Module, original, query_length: int, key_length: int,
                  device=None, past_seen_tokens: int = 0) -> torch.Tensor:
    """[B, heads, q, k] where the original gives [1, heads, q, k] (Note [relative position
    bias]); the original's result when no gradient is recorded."""
    if not torch.is_grad_enabled():
        return original(query_length, key_length, device=device,
                        past_seen_tokens=past_seen_tokens)
    table = module.relative_attention_bias
    # The class's own computation, without gradients: its lookup's ids (the buckets) and result.
    ids: List[torch.Tensor] = []
    handle = table.register_forward_pre_hook(lambda _m, args: ids.append(args[0]))
    try:
        with torch.no_grad(), bypass():
            expected = original(query_length, key_length, device=device,
                                past_seen_tokens=past_seen_tokens)  # [1, heads, q, k]
    finally:
        handle.remove()
    bias = None
    if len(ids) == 1 and ids[0].dim() == 2:
        # [1, q, k] ids, expanded to the examples by the DP Embedding in a private forward and
        # its probe (Note [broadcast positions]), which also follows every use of the lookup.
        values = table(ids[0].unsqueeze(0))  # [B, q, k, heads] (B = 1 outside one)
        bias = values.permute(0, 3, 1, 2)  # [B, heads, q, k]
    with torch._C.DisableTorchFunctionSubclass():  # the check is not a use of the lookup
        same = bias is not None and torch.equal(bias[:1].detach(), expected)
    if not same:
        raise RuntimeError(
            f"{type(module).__name__}.compute_bias no longer computes what dpzero's per-example "
            "relative position bias assumes (one lookup of [q, k] buckets, permuted to [1, "
            "heads, q, k]; Note [relative position bias], read on transformers 5.23): freeze "
            "relative_attention_bias (requires_grad_(False)) or use a transformers release "
            "dpzero supports")
    return bias
