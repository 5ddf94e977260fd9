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
5.23) and whose result is only ever added to scores that hold the examples on dim 0, dpzero
computes the same bias per example. The class's own ``compute_bias`` runs without gradients; the
bucket ids [q, k] of its one lookup are expanded to [B, q, k] (B: the examples of the current
micro-batch as the engine counts them, or the probe's B + 1); the DP Embedding looks them up
([B, q, k, heads]) and the result is [B, heads, q, k]. The sum with the scores is the same row by
row, so the model computes the same function; the Embedding's input now holds the examples on dim
0, which the probe confirms like any layer input, and each example's gradient of the bias table
is its own. Every call checks that example 0's bias equals the class's own result exactly, so a
transformers release that changes the computation stops the step instead of training another
function.

A frozen ``relative_attention_bias`` (no per-sample gradient needed) keeps the original code.
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


def install(model: nn.Module, book_ref) -> None:
    for module in owners(model):
        module.compute_bias = functools.partial(_compute_bias, book_ref, module,
                                                module.compute_bias)


def remove(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module.__dict__.get("compute_bias"), functools.partial):
            del module.compute_bias


def _rows(book) -> int:
    """The examples the current forward holds: the probe's B + 1, else the micro-batch's B."""
    if book.probe is not None:
        return book.probe.rows
    return book.expected_rows


def _compute_bias(book_ref, module: nn.Module, original, query_length: int, key_length: int,
                  device=None, past_seen_tokens: int = 0) -> torch.Tensor:
    """[B, heads, q, k] where the original gives [1, heads, q, k] (Note [relative position
    bias]); the original's result outside a private forward with gradients."""
    book = book_ref()
    if book is None or not torch.is_grad_enabled() or _rows(book) is None:
        return original(query_length, key_length, device=device,
                        past_seen_tokens=past_seen_tokens)
    rows = _rows(book)
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
        buckets = ids[0]  # [q, k]
        values = table(buckets.expand(rows, *buckets.shape))  # [B, q, k, heads]
        bias = values.permute(0, 3, 1, 2)  # [B, heads, q, k]
    if bias is None or (rows and not torch.equal(bias[:1].detach(), expected)):
        raise RuntimeError(
            f"{type(module).__name__}.compute_bias no longer computes what dpzero's per-example "
            "relative position bias assumes (one lookup of [q, k] buckets, permuted to [1, "
            "heads, q, k]; Note [relative position bias], read on transformers 5.23): freeze "
            "relative_attention_bias (requires_grad_(False)) or use a transformers release "
            "dpzero supports")
    return bias
