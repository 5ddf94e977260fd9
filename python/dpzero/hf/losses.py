"""Per-sample losses of Hugging Face heads, for the private Trainer.

Note [trainer loss]
~~~~~~~~~~~~~~~~~~~
DP-SGD's sensitivity argument needs each example's gradient to depend on that example alone: the
clipped sum then changes by at most C when one example comes or goes. A Hugging Face model's own
loss does not always have that form. A token-level head (masked LM, token classification, and
causal LM without ``num_items_in_batch``) averages over every labelled token of the micro-batch:
L = (sum of token losses) / (tokens in the micro-batch), so example i's gradient is scaled by
1 / (tokens of all examples), and adding one example rescales every other example's gradient
(measured: BertForMaskedLM's loss ignores ``num_items_in_batch``; GPT-2's honours it).

The private Trainer therefore never back-propagates the model's own loss. It runs the model
without labels and computes each example's loss from the logits here: a token-level head's loss
of example i is the mean over example i's own labelled tokens (shifted by one for causal LMs whose
own loss shifts them, not for the decoders that take shifted labels; labels -100 are ignored), a sequence-classification head's is
example i's cross-entropy, squared error or multi-label BCE (the config's ``problem_type``, or the
inference Hugging Face makes without one). The step back-propagates sum_i loss_i
(``loss_reduction="sum"``): every example's gradient is its own loss's gradient, whatever the
other rows of its micro-batch hold. Heads not listed here are refused; ``per_sample_loss=`` on
the Trainer supplies one.

Shapes: logits [B, T, V] (token heads) or [B, K] (sequence classification); labels [B, T] or
[B] / [B, K]; every function returns [B] float32.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100  # Hugging Face's label for "no loss here"

PerSampleLoss = Callable[[nn.Module, object, torch.Tensor], torch.Tensor]

# LM heads named otherwise than *ForCausalLM whose own loss shifts the labels by one (checked
# against their sources; XLNet's and XLM's LMHeadModels do not shift, so a suffix rule would be
# wrong for them).
_SHIFTED_LM_HEADS = frozenset({"GPT2LMHeadModel", "OpenAIGPTLMHeadModel", "CTRLLMHeadModel"})
# *ForCausalLM heads whose own loss does NOT shift (their labels come shifted: the decoders of
# encoder-decoder families; checked against transformers 5.23's sources, which compute
# loss_fct(logits.view(-1, V), labels.view(-1))).
_UNSHIFTED_CAUSAL_HEADS = frozenset({
    "BartForCausalLM", "MBartForCausalLM", "MarianForCausalLM", "PegasusForCausalLM",
    "BlenderbotForCausalLM", "BlenderbotSmallForCausalLM", "PLBartForCausalLM", "MvpForCausalLM",
    "BigBirdPegasusForCausalLM", "TrOCRForCausalLM", "WhisperForCausalLM",
})


def token_losses(logits: torch.Tensor, labels: torch.Tensor, shift: bool) -> torch.Tensor:
    """logits [B, T, V], labels [B, T] -> [B]: each example's mean cross-entropy over its own
    labelled tokens (0 for an example with none); ``shift``: token t predicts label t + 1."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    b = logits.shape[0]
    flat = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="none").view(b, -1)
    counts = (labels != IGNORE_INDEX).sum(1)
    return flat.sum(1) / counts.clamp(min=1)


def sequence_losses(logits: torch.Tensor, labels: torch.Tensor,
                    problem_type: Optional[str], num_labels: int) -> torch.Tensor:
    """logits [B, K], labels [B] or [B, K] -> [B], as Hugging Face's sequence-classification
    heads define the problem (``problem_type``, else inferred from K and the labels' dtype)."""
    if problem_type is None:
        if num_labels == 1:
            problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem_type = "single_label_classification"
        else:
            problem_type = "multi_label_classification"
    logits = logits.float()
    if problem_type == "regression":
        if num_labels == 1:
            return (logits.view(-1) - labels.float().view(-1)) ** 2
        return ((logits - labels.float()) ** 2).mean(1)
    if problem_type == "single_label_classification":
        return F.cross_entropy(logits.view(-1, num_labels), labels.view(-1), reduction="none")
    if problem_type == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits, labels.float(),
                                                  reduction="none").mean(1)
    raise ValueError(f"problem_type {problem_type!r} is not one the private Trainer knows "
                     "('regression', 'single_label_classification', "
                     "'multi_label_classification')")


def head_name(model: nn.Module) -> str:
    """The class name of the model's head (through a PEFT wrapper)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return type(base).__name__


def token_head_shift(model: nn.Module) -> Optional[bool]:
    """Whether ``model``'s head is a token-level one whose own loss averages over the batch's
    tokens (Note [trainer loss]): True for a causal LM whose loss shifts the labels, False for
    one that does not and for masked LM and token classification, None for any other head."""
    name = head_name(model)
    if name in _UNSHIFTED_CAUSAL_HEADS:
        return False
    if name.endswith("ForCausalLM") or name in _SHIFTED_LM_HEADS:
        return True
    if name.endswith("ForMaskedLM") or name.endswith("ForTokenClassification"):
        return False
    return None


def default_per_sample_loss(model: nn.Module) -> PerSampleLoss:
    """Note [trainer loss]: the per-sample loss for ``model``'s head; ValueError naming the class
    when dpzero has none."""
    name = head_name(model)
    shift = token_head_shift(model)
    if shift is not None:
        return lambda m, outputs, labels: token_losses(outputs.logits, labels, shift=shift)
    if name.endswith("ForSequenceClassification"):
        def loss(m, outputs, labels):
            config = getattr(m, "config", None)
            return sequence_losses(outputs.logits, labels, getattr(config, "problem_type", None),
                                   getattr(config, "num_labels", outputs.logits.shape[-1]))
        return loss
    raise ValueError(
        f"dpzero.hf.PrivateTrainer has no per-sample loss for {name}: it knows causal LM, masked "
        "LM, token- and sequence-classification heads (Note [trainer loss] in "
        "dpzero/hf/losses.py). Pass per_sample_loss=fn, fn(model, outputs, labels) -> [B] "
        "losses, one per example, each depending on that example alone")


# Note [a model's own loss under make_private]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``loss = model(**batch, labels=labels).loss; loss.backward()`` is the ordinary Hugging Face
# loop, and under make_private the token-level heads' own loss couples the examples (Note
# [trainer loss]: one example's labelled-token count rescales every other example's gradient).
# So make_private's root forward (isolation="detect") replaces it: for a token-level head called
# with ``labels`` that returns ``loss`` and ``logits``, ``outputs.loss`` becomes the mean over the
# micro-batch's examples (their sum under loss_reduction="sum") of each example's own loss, the
# mean over its own labelled tokens (token_losses). It equals the model's own loss when every
# example has as many labelled tokens. Sequence-classification losses are per example already and
# are left as they are; under strict isolation every example runs alone, so the model's own loss
# is already that example's. A tuple output (return_dict=False) is Hugging Face's (loss, logits,
# ...) when labels are given, and its first entry is replaced the same way (a review trained on
# the pooled loss through return_dict=False, 5.5 times the bound).
def per_example_model_loss(model: nn.Module, kwargs: dict, outputs, mean: bool):
    """``outputs`` of ``model(**kwargs)``, with its loss replaced as Note [a model's own loss
    under make_private] says where it applies."""
    labels = kwargs.get("labels")
    if not isinstance(labels, torch.Tensor):
        return outputs
    shift = token_head_shift(model)
    if shift is None:
        return outputs
    pair = outputs[:2] if isinstance(outputs, tuple) else (getattr(outputs, "loss", None),
                                                          getattr(outputs, "logits", None))
    if len(pair) < 2 or not all(isinstance(t, torch.Tensor) for t in pair):
        return outputs
    losses = token_losses(pair[1], labels.to(pair[1].device), shift)  # [B]
    loss = losses.mean() if mean else losses.sum()
    if isinstance(outputs, tuple):
        return (loss,) + tuple(outputs[1:])
    outputs["loss"] = loss
    return outputs
