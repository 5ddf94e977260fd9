"""Batch provenance (Note [batch provenance], design.md §3 "Batch provenance"): no tensor is
clipped per row unless its rows are the examples, whatever the call order and whatever sizes
coincide; batches that did not come from the private loader (or the ledgered own_batch opt-out)
are refused.

The models with shared inputs are the cases a review reproduced: with B = T, a position table
called before the token embedding, and relative-position buckets [T, T], were clipped per row,
and one example moved the pre-noise sum by 6.5 and 7.3 against the replace-one bound 2C = 2. Each
case is measured with an outlier example (sensitivity.py): it must be refused, or hold 2C.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpzero
import ranks
from dpzero.private import PrivacyViolation
from dpzero.private.provenance.examples import Examples, MicroBatchToken, tag
from sensitivity import refused_or_bounded

V, T, D, K = 19, 8, 12, 3  # vocabulary, sequence length (= the batch size B below), width, classes


def ids_and_labels(n, seed=0, t=T):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n, t), generator=g), torch.randint(0, K, (n,), generator=g)


# ---- models whose DP layers get inputs shared by the batch ------------------------------------

class PositionTable(nn.Module):
    """nanoGPT: h = wte(ids) + wpe(positions), the position table called ``order`` = before,
    between or after the batched layers; ``rows`` 1 gives wpe 1-D ids [T] (shared: refused),
    2 gives [1, T] (shared, expanded to the batch: allowed)."""

    def __init__(self, order="before", rank=1):
        super().__init__()
        self.order, self.rank = order, rank
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.mix, self.head = nn.Linear(D, D), nn.Linear(D, K)

    def positions(self, t):
        pos = torch.arange(t)
        return self.wpe(pos if self.rank == 1 else pos.unsqueeze(0))

    def forward(self, ids):
        t = ids.shape[1]
        if self.order == "before":
            p = self.positions(t)
            h = self.wte(ids) + p
        elif self.order == "between":
            h = self.wte(ids)
            h = h + self.positions(t)
        else:
            h = self.wte(ids)
        h = torch.tanh(self.mix(h))
        if self.order == "after":
            h = h + self.positions(t)
        return self.head(h.mean(1))


class RelativeBuckets(nn.Module):
    """T5-style relative position bias: an Embedding on bucket ids [T, T] (shared by the batch),
    added to attention scores [B, heads, T, T]."""

    def __init__(self, heads=2, frozen=False):
        super().__init__()
        self.heads = heads
        self.wte = nn.Embedding(V, D)
        self.qk = nn.Linear(D, 2 * D)
        self.bias = nn.Embedding(2 * T, heads)
        self.bias.requires_grad_(not frozen)
        self.head = nn.Linear(D, K)

    def forward(self, ids):
        b, t = ids.shape
        h = self.wte(ids)
        q, k = self.qk(h).view(b, t, 2, self.heads, D // self.heads).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k)
        rel = torch.arange(t)[None, :] - torch.arange(t)[:, None] + T  # [T, T] buckets
        scores = scores + self.bias(rel).permute(2, 0, 1).unsqueeze(0)
        att = scores.softmax(-1)
        v = h.view(b, t, self.heads, D // self.heads)
        out = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, D)
        return self.head(out.mean(1))


class MaskBuckets(nn.Module):
    """A relative bias looked up with ids [1, T, T] (expanded to the batch by dpzero, Note
    [broadcast positions]) and used as scaled-dot-product attention's additive mask; ``mix``:
    the keys come from other examples (their rows flipped)."""

    def __init__(self, heads=2, mix=False):
        super().__init__()
        self.heads, self.mix = heads, mix
        self.wte = nn.Embedding(V, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.bias = nn.Embedding(2 * T, heads)
        self.head = nn.Linear(D, K)

    def forward(self, ids):
        b, t = ids.shape
        q, k, v = self.qkv(self.wte(ids)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.mix:
            k = k.flip(0)
        rel = torch.arange(t)[None, :] - torch.arange(t)[:, None] + T  # [T, T] buckets
        mask = self.bias(rel.unsqueeze(0)).permute(0, 3, 1, 2)  # [B, heads, T, T]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(out.transpose(1, 2).reshape(b, t, D).mean(1))


class SharedLatents(nn.Module):
    """Perceiver-style latents [n, D] projected by a Linear (shared by the batch), n = B."""

    def __init__(self, n=T):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(n, D), requires_grad=False)
        self.wte, self.proj, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, K)

    def forward(self, ids):
        lat = self.proj(self.latents)                     # [n, D]: rows are latents
        att = torch.einsum("btd,nd->btn", self.wte(ids), lat).softmax(-1)
        return self.head((att @ lat).mean(1))


class SequenceFirst(nn.Module):
    """Layers run on [T, B, D] (seq-first, as nn.Transformer's default): dim 0 is positions."""

    def __init__(self):
        super().__init__()
        self.wte, self.mix, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, K)

    def forward(self, ids):
        h = self.wte(ids).transpose(0, 1)                 # [T, B, D]
        h = torch.tanh(self.mix(h))
        return self.head(h.mean(0))


@pytest.mark.parametrize("order", ["before", "between", "after"])
def test_a_position_table_on_1d_ids_is_refused_whatever_the_call_order(order):
    """B = T: wpe's [T] ids have as many rows as the batch. Refused (it was accepted when called
    before the token embedding, and one example then moved the sum by 6.5 against 2C = 2)."""
    ids, y = ids_and_labels(T)
    assert refused_or_bounded(lambda: PositionTable(order, rank=1), [ids], y) == "refused"


@pytest.mark.parametrize("order", ["before", "between", "after"])
@pytest.mark.parametrize("batch", [1, 2, T, T + 1])
def test_a_position_table_on_1_by_t_ids_is_expanded_and_holds_2c(order, batch):
    ids, y = ids_and_labels(batch)
    assert refused_or_bounded(lambda: PositionTable(order, rank=2), [ids], y) == "bounded"


class PositionUse(nn.Module):
    """wpe on [1, T] ids (expanded to the batch by dpzero), then used as ``use`` says before it
    meets the token embeddings; or ids computed from the first example (``first_example``)."""

    def __init__(self, use):
        super().__init__()
        self.use = use
        self.wte, self.wpe, self.head = nn.Embedding(V, D), nn.Embedding(V, D), nn.Linear(D, K)

    def forward(self, ids, seq_first=False):
        t = ids.shape[1]
        pos = ids[:1] if self.use == "first_example" else torch.arange(t).unsqueeze(0)
        p = self.wpe(pos)
        tok = self.wte(ids)
        if self.use == "after_meeting":  # a second use, after the lookup met the batch
            h = tok + p
            return self.head((h + p.mean(0).mean(0)).mean(1))
        if self.use == "via_unknown_rows":  # met with a tensor of unknown rows, then reduced
            p = (p + torch.zeros(ids.shape[0], 1, 1)).mean(0)
        p = {"mean0": lambda: p.mean(0), "row0": lambda: p[0],
             "squeeze": lambda: p.squeeze(0)}.get(self.use, lambda: p)()
        h = tok + p
        return self.head(h.mean(1))


@pytest.mark.parametrize("use, verdict", [("add", "bounded"), ("squeeze", "bounded"),
                                          ("mean0", "refused"), ("row0", "refused"),
                                          ("first_example", "refused"),
                                          ("after_meeting", "refused"),
                                          ("via_unknown_rows", "refused")])
@pytest.mark.parametrize("batch", [2, T])
def test_expanded_ids_must_meet_the_batch_row_by_row_and_not_come_from_an_example(use, verdict,
                                                                                  batch):
    """A review found: following the advice wpe(pos.unsqueeze(0)) and then taking .mean(0) or
    [0] of the (expanded) lookup moved the sum by 15.7 and 2.004 against 2C = 2; ids computed from
    example 0 (ids[:1]) were judged shared. The probe follows the expanded lookup to its first
    use and checks the ids against rotated examples."""
    ids, y = ids_and_labels(batch)
    assert refused_or_bounded(lambda: PositionUse(use), [ids], y) == verdict


class LayoutFlag(nn.Module):
    """A kwarg switches the layers to seq-first ([T, B, D]): the same ranks, and with B = T the
    same shapes, as batch-first."""

    def __init__(self):
        super().__init__()
        self.wte, self.mix, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, K)

    def forward(self, ids, seq_first=False):
        h = self.wte(ids)
        if seq_first:
            return self.head(torch.tanh(self.mix(h.transpose(0, 1))).mean(0))
        return self.head(torch.tanh(self.mix(h)).mean(1))


def test_a_new_argument_value_or_a_coinciding_size_is_probed_again():
    """A review found: the verdicts of a batch-first call were reused for a seq-first call of the
    same pattern (B = T), moving the sum by 4.1 against 2. Non-tensor argument values are part of
    the pattern, and a call with a non-batch dim equal to B is probed again."""
    ids, y = ids_and_labels(2 * T)
    p = dpzero.make_private(LayoutFlag(), dataset=torch.utils.data.TensorDataset(ids, y),
                            sample_rate=1.0, noise_multiplier=1.0, max_grad_norm=1.0,
                            max_physical_batch_size=T)
    batches = iter(p.data_loader)
    x, t = next(batches)
    F.cross_entropy(p.model(x, seq_first=False), t).backward()
    assert not p.optimizer.step()  # the first of two micro-batches: accumulated
    x, t = next(batches)
    with pytest.raises(PrivacyViolation, match=r"Linear 'mix': its input dims \[1\]"):
        p.model(x, seq_first=True)


def test_relative_position_buckets_shared_by_the_batch_are_refused_or_frozen():
    """B = T: the bias Embedding's [T, T] bucket ids (was accepted: 7.3 against 2C = 2)."""
    ids, y = ids_and_labels(T)
    assert refused_or_bounded(lambda: RelativeBuckets(), [ids], y) == "refused"
    assert refused_or_bounded(lambda: RelativeBuckets(frozen=True), [ids], y) == "bounded"
    assert refused_or_bounded(lambda: RelativeBuckets(), [ids[:2]], y[:2]) == "refused"  # any B
    with pytest.raises(PrivacyViolation, match=r"Embedding 'bias': its input of shape \[8, 8\] "
                                               r"does not come from the examples.*freeze"):
        refused_or_bounded_raising(lambda: RelativeBuckets(), ids, y)


def refused_or_bounded_raising(make_model, ids, y):
    p = dpzero.make_private(make_model(), dataset=torch.utils.data.TensorDataset(ids, y),
                            sample_rate=1.0, noise_multiplier=1.0, max_grad_norm=1.0)
    for x, t in p.data_loader:
        F.cross_entropy(p.model(x), t).backward()


def test_a_linear_on_latents_shared_by_the_batch_is_refused():
    ids, y = ids_and_labels(T)  # B = T = number of latents
    assert refused_or_bounded(lambda: SharedLatents(), [ids], y) == "refused"
    with pytest.raises(PrivacyViolation, match=r"Linear 'proj': its input of shape \[8, 12\] "
                                               r"does not come from the examples.*expand"):
        refused_or_bounded_raising(lambda: SharedLatents(), ids, y)


def test_sequence_first_layers_are_refused_even_when_b_equals_t():
    ids, y = ids_and_labels(T)
    assert refused_or_bounded(SequenceFirst, [ids], y) == "refused"
    with pytest.raises(PrivacyViolation, match=r"Linear 'mix': its input dims \[1\] of its shape "
                                               r"\[8, 8, 12\] change with the number of examples"):
        refused_or_bounded_raising(SequenceFirst, ids, y)


# ---- Hugging Face models from tiny configs, at every coinciding batch size --------------------

HEADS, HF_WIDTH = 4, 16  # head dim 4 (Llama's rotary embedding needs an even one)


class Pooled(nn.Module):
    """A Hugging Face base model + mean pooling + a linear head (the same for every family)."""

    def __init__(self, backbone, width):
        super().__init__()
        self.backbone, self.head = backbone, nn.Linear(width, K)

    def forward(self, ids):
        return self.head(self.backbone(input_ids=ids).last_hidden_state.mean(1))


def hf_model(family, frozen_bias=False, only_bias=False, attn=None):
    import transformers as tf

    w = HF_WIDTH
    common = dict(vocab_size=V, num_attention_heads=HEADS)
    if family == "gpt2":
        cfg = tf.GPT2Config(n_embd=w, n_layer=2, n_head=HEADS, n_positions=2 * T, vocab_size=V,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return Pooled(tf.GPT2Model(cfg), w)
    if family == "bert":
        cfg = tf.BertConfig(hidden_size=w, num_hidden_layers=2, intermediate_size=2 * w,
                            max_position_embeddings=2 * T, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, **common)
        return Pooled(tf.BertModel(cfg), w)
    if family == "llama":
        cfg = tf.LlamaConfig(hidden_size=w, num_hidden_layers=2, intermediate_size=2 * w,
                             num_key_value_heads=HEADS, max_position_embeddings=2 * T, **common)
        return Pooled(tf.LlamaModel(cfg), w)
    if family == "t5":
        cfg = tf.T5Config(d_model=w, d_kv=w // HEADS, d_ff=2 * w, num_layers=2, num_heads=HEADS,
                          vocab_size=V, dropout_rate=0.0, relative_attention_num_buckets=8,
                          **({"attn_implementation": attn} if attn else {}))
        model = Pooled(tf.T5EncoderModel(cfg), w)
        for name, p in model.backbone.named_parameters():
            bias = "relative_attention_bias" in name
            p.requires_grad_(not (bias and frozen_bias) and (bias or not only_bias))
        return model
    raise ValueError(family)


@pytest.mark.parametrize("family", ["gpt2", "bert", "llama", "t5", "t5-frozen-bias"])
@pytest.mark.parametrize("batch", [1, 2, T, T + 1, HEADS])
def test_hugging_face_models_hold_2c_at_every_coinciding_batch_size(family, batch):
    """The sweep of batch sizes: B in {1, 2, T, T + 1, heads} on GPT-2, BERT, Llama and T5 from tiny
    configs; every step is accepted (their inputs are batched, their position ids [1, T]) and
    holds the replace-one bound 2C with an outlier example."""
    torch.manual_seed(0)
    ids, y = ids_and_labels(batch, seed=batch)
    name = family.split("-")[0]
    make = lambda: hf_model(name, frozen_bias=family.endswith("frozen-bias"))  # noqa: E731
    assert refused_or_bounded(make, [ids], y) == "bounded"


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("only_bias", [False, True])
@pytest.mark.parametrize("batch", [1, 2, T, HEADS])
def test_t5s_trainable_relative_bias_is_looked_up_per_example(batch, only_bias, attn):
    """T5's relative_attention_bias reads bucket ids [T, T] shared by the batch: dpzero looks them
    up once per example (Note [relative position bias]), so the step is accepted and holds 2C,
    with eager attention (the bias added to the scores) and SDPA (the bias as attn_mask), and
    with the bias the only trainable parameter (the probe then follows the examples through the
    frozen layers). A custom model doing the same (RelativeBuckets) is still refused."""
    ids, y = ids_and_labels(batch, seed=batch)
    make = lambda: hf_model("t5", only_bias=only_bias, attn=attn)  # noqa: E731
    assert refused_or_bounded(make, [ids], y) == "bounded"


@pytest.mark.parametrize("where", ["eager", "registered"])
def test_t5_attention_that_treats_the_bias_as_shared_is_refused(where, monkeypatch):
    """Found by a review: an attention function that reads only row 0 of the bias (the identity
    for T5's own [1, heads, q, k] bias) mixed every example's bias gradient into example 0's
    (2.85 against 2C = 2). The probe follows the expanded lookup into the attention function:
    any use but a row-by-row sum with the scores refuses the step."""
    import transformers.models.t5.modeling_t5 as t5
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    own = t5.eager_attention_forward if where == "eager" else sdpa_attention_forward

    def first_row(module, q, k, v, mask, position_bias=None, **kw):
        return own(module, q, k, v, mask, **kw,
                   position_bias=None if position_bias is None else position_bias[:1])

    if where == "eager":
        monkeypatch.setattr(t5, "eager_attention_forward", first_row)
    else:
        AttentionInterface.register("dpzero_test_first_row", first_row)
    ids, y = ids_and_labels(4, seed=4)
    attn = "eager" if where == "eager" else "dpzero_test_first_row"
    with pytest.raises(PrivacyViolation, match=r"relative_attention_bias'.*uses it in "
                                               r"TensorBase.__getitem__ first"):
        refused_or_bounded_raising(lambda: hf_model("t5", attn=attn), ids, y)


@pytest.mark.parametrize("family", ["t5", "gpt2"])
def test_an_evaluation_with_gradients_between_micro_batches_keeps_the_models_shapes(family):
    """Found by a review: a forward on other data with gradients on, between a micro-batch's
    backward and the step, expanded shared ids to the micro-batch's rows and crashed on the
    shapes. Refused forwards now keep the model's own shapes (and register nothing)."""
    ids, y = ids_and_labels(7, seed=1)
    p = dpzero.make_private(hf_model(family), dataset=torch.utils.data.TensorDataset(ids, y),
                            sample_rate=1.0, noise_multiplier=1.0, max_grad_norm=1.0,
                            max_physical_batch_size=3)
    for i, (x, t) in enumerate(p.data_loader):
        F.cross_entropy(p.model(x), t).backward()
        if i == 0:
            assert p.model(ids_and_labels(2, seed=2)[0]).shape == (2, K)
        if p.optimizer.step():
            break


def test_a_lookup_as_an_attention_mask_needs_queries_keys_and_values_of_the_same_rows():
    """Scaled-dot-product attention adds its attn_mask to the scores row by row: a [1, ...]
    lookup used as the mask is accepted when query, key and value are the examples at the same
    dim; keys from other examples fail the check (a review: the mask's rows were taken to meet
    the batch whatever the keys were)."""
    ids, y = ids_and_labels(4, seed=4)
    assert refused_or_bounded(lambda: MaskBuckets(), [ids], y) == "bounded"
    with pytest.raises(PrivacyViolation, match=r"Embedding 'bias'.*uses it in "
                                               r"scaled_dot_product_attention first"):
        refused_or_bounded_raising(lambda: MaskBuckets(mix=True), ids, y)


class BufferWrites(nn.Module):
    """A Linear with buffers its forward updates: ``from_examples`` "in place" or "replaced", an
    EMA of the batch mean (as BatchNorm's running statistics), or "counter", a count of forward
    calls (it follows the realised Poisson batch sizes); None writes nothing."""

    def __init__(self, from_examples=None):
        super().__init__()
        self.from_examples = from_examples
        self.wte, self.head = nn.Embedding(V, D), nn.Linear(D, K)
        self.register_buffer("ema", torch.zeros(D))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, ids):
        h = self.wte(ids).mean(1)
        with torch.no_grad():
            if self.from_examples == "in place":
                self.ema.mul_(0.9).add_(0.1 * h.mean(0))
            elif self.from_examples == "replaced":
                self.ema = 0.9 * self.ema + 0.1 * h.mean(0)
            elif self.from_examples == "counter":
                self.calls += 1
        return self.head(h)


def test_a_forward_that_writes_into_a_buffer_is_refused():
    """Data of the examples written into a buffer leaves the training without noise (BatchNorm's
    running statistics are refused by type; this is any buffer), and so does a count of forward
    calls: the probe sees the write and refuses the forward, naming the buffer; the buffer's
    value and class are restored (Note [probe writes]; test_state.py has the rest)."""
    ids, y = ids_and_labels(4, seed=4)
    assert refused_or_bounded(lambda: BufferWrites(from_examples=None), [ids], y) == "bounded"
    for how, name in (("in place", "ema"), ("replaced", "ema"), ("counter", "calls")):
        model = BufferWrites(from_examples=how)
        with pytest.raises(PrivacyViolation, match=rf"buffer '{name}' of module '<model>'"):
            refused_or_bounded_raising(lambda: model, ids, y)
        assert type(model.ema) is torch.Tensor, how
        assert torch.equal(model.ema, torch.zeros(D)) and int(model.calls) == 0, how


def test_a_changed_t5_compute_bias_stops_the_step():
    """The rewrite checks example 0's bias against the class's own compute_bias on every call:
    a compute_bias that no longer is one lookup permuted to [1, heads, q, k] (here: scaled)
    stops the step with the class named instead of training another function."""
    torch.manual_seed(0)
    model = hf_model("t5")
    attention = model.backbone.encoder.block[0].layer[0].SelfAttention
    own = type(attention).compute_bias
    attention.compute_bias = lambda *a, **k: 2 * own(attention, *a, **k)
    ids, y = ids_and_labels(2)
    with pytest.raises(RuntimeError, match=r"T5Attention.compute_bias no longer computes"):
        refused_or_bounded_raising(lambda: model, ids, y)


# ---- batches that did not come from the private loader -----------------------------------------

def _linear_private(n=16, **kw):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))
    model = nn.Sequential(nn.Linear(4, 2))
    base = dict(dataset=data, batch_size=8, noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    base.update(kw)
    return model, data, dpzero.make_private(model, **base)


def test_iterating_another_loader_is_refused():
    """Two forward/backward passes over the same 8 examples from the user's own DataLoader were
    taken as one step of 16 Poisson-sampled samples (each example carrying 2C)."""
    model, data, p = _linear_private()
    own_loader = torch.utils.data.DataLoader(data, batch_size=8)
    x, y = next(iter(own_loader))
    with pytest.raises(PrivacyViolation, match="do not come from the private data loader"):
        for _ in range(2):
            F.cross_entropy(p.model(x), y).backward()
    with pytest.raises((PrivacyViolation, RuntimeError)):
        p.optimizer.step()
    assert p.privacy_engine.charges == 0


def test_a_stale_micro_batch_is_refused():
    model, data, p = _linear_private(sample_rate=1.0, batch_size=None, max_physical_batch_size=8)
    batches = iter(p.data_loader)
    x0, y0 = next(batches)
    F.cross_entropy(p.model(x0), y0).backward()
    p.optimizer.step()  # only accumulates: the logical batch has two micro-batches
    x1, y1 = next(batches)
    with pytest.raises(PrivacyViolation, match="not the current one") as refused:
        p.model(x0).sum().backward()  # the first micro-batch again: counted twice
    # The refusal names the micro-batches by step and index, not by their realised row counts
    # (private: a review told neighbouring datasets apart by "(10 rows" against "(11 rows").
    assert "micro-batch 0 of step 0 (poisson sampling)" in str(refused.value)
    assert "rows" not in str(refused.value)
    with pytest.raises(PrivacyViolation, match="refusing the step.*not the current one"):
        p.optimizer.step()
    p.optimizer.zero_grad()


def test_tensors_whose_rows_were_mixed_lose_the_tag_and_are_refused():
    """mixup-style x + x[perm] (rows of other examples) or a row selection drops the tag; the
    message names the operation."""
    model, data, p = _linear_private(sample_rate=1.0, batch_size=None)
    x, y = next(iter(p.data_loader))
    mixed = "model input 0 is computed from the examples of .* without being one row per example"
    with pytest.raises(PrivacyViolation, match=mixed):
        p.model(0.5 * x + 0.5 * x[torch.randperm(len(x))]).sum().backward()
    p.optimizer.zero_grad()
    x, y = next(iter(p.data_loader))
    with pytest.raises(PrivacyViolation, match=mixed):
        p.model(torch.roll(x, 1, 0)).sum().backward()



def test_a_training_loops_own_preprocessing_keeps_the_tag():
    """What loops do before the model: device moves, casts, scaling, slicing off a column,
    normalising with broadcast statistics, adding noise of the same shape."""
    model, data, p = _linear_private(sample_rate=1.0, batch_size=None)
    for x, y in p.data_loader:
        x = x.to("cpu").float()
        x = (x - x.new_zeros(4)) / torch.ones(1, 4) + 0.01 * torch.randn_like(x)
        x = torch.cat([x[:, :3], torch.zeros(1, 1).expand(x.shape[0], 1)], dim=1)
        F.cross_entropy(p.model(x.contiguous()), y.long()).backward()
        assert p.optimizer.step()
        break


def test_own_batch_is_the_ledgered_opt_out(tmp_path):
    """A caller who Poisson-samples itself hands batches in through own_batch with the realised
    logical size; the ledger says so for every such step, and more rows than declared are
    refused."""
    path = str(tmp_path / "ledger.jsonl")
    model, data, p = _linear_private(ledger_path=path, run_id="r")
    engine = p.privacy_engine
    x, y = data.tensors
    bx, by = engine.own_batch((x[:5], y[:5]), logical_batch_size=5)
    assert isinstance(bx, Examples)
    F.cross_entropy(p.model(bx), by).backward()
    assert p.optimizer.step()
    for half in (slice(0, 3), slice(3, 6)):  # one logical batch of two micro-batches
        bx, by = engine.own_batch((x[half], y[half]), logical_batch_size=6)
        F.cross_entropy(p.model(bx), by).backward()
    assert p.optimizer.step()
    bx, by = engine.own_batch((x[:4], y[:4]), logical_batch_size=3)  # declares fewer
    F.cross_entropy(p.model(bx), by).backward()
    with pytest.raises(PrivacyViolation, match=r"more rows reached the clipping .* \(4 rows, "
                                               r"logical_batch_size=3\)"):
        p.optimizer.step()
    p.optimizer.zero_grad()
    engine.ledger.close()
    ledger = dpzero.Ledger.open_read_only(path)
    assert [r.sampling for r in ledger.records] == ["caller", "caller"]
    assert ledger.caller_sampled_steps == 2
    with pytest.raises(ValueError, match="logical_batch_size must be an integer in \\[0, 16\\]"):
        engine.own_batch((x[:2], y[:2]), logical_batch_size=17)
    with pytest.raises(ValueError, match="row counts \\[2, 3\\]"):
        engine.own_batch((x[:2], y[:3]), logical_batch_size=3)


def test_a_submodule_called_directly_is_refused():
    model, data, p = _linear_private(sample_rate=1.0, batch_size=None)
    x, y = next(iter(p.data_loader))
    with pytest.raises(PrivacyViolation, match="outside a call of the model"):
        model[0](x).sum().backward()


def test_evaluation_on_other_data_is_harmless_and_a_backward_through_it_is_refused():
    """A forward on data from elsewhere — an evaluation, with or without torch.no_grad() —
    runs and registers nothing; only a backward through it is refused, and then the step."""
    model, data, p = _linear_private()
    with torch.no_grad():
        assert p.model(data.tensors[0]).shape == (16, 2)
    out = p.model(data.tensors[0])  # gradients enabled, as in many evaluation loops
    assert not p.privacy_engine.book.open
    x, y = next(iter(p.data_loader))
    F.cross_entropy(p.model(x), y).backward()  # the private loop goes on as if nothing happened
    assert p.optimizer.step()
    with pytest.raises(PrivacyViolation, match="do not come from the private data loader"):
        out.sum().backward()
    with pytest.raises((PrivacyViolation, RuntimeError)):
        p.optimizer.step()


# ---- the tag's rules, checked against where each row's data really went ----------------------

_W = torch.linspace(-1, 1, 15, dtype=torch.float64).view(3, 5)
_I = torch.eye(4, dtype=torch.float64)

MOVES = {  # op -> what it does to a [B, T, E] batch (B = T = 4: sizes coincide on purpose)
    "to": lambda x: x.to(torch.float32),
    "slice": lambda x: x[:, :-1],
    "ellipsis": lambda x: x[..., 0],
    "none": lambda x: x[None],
    "transpose": lambda x: x.transpose(0, 1),
    "permute": lambda x: x.permute(2, 0, 1),
    "t_of_2d": lambda x: x[:, :, 0].t(),
    "view": lambda x: x.view(4, 2, 2, 3),
    "view_swap": lambda x: x.reshape(4, 12).view(4, 4, 3),
    "view_merge": lambda x: x.reshape(16, 3),
    "flatten": lambda x: x.flatten(1),
    "unsqueeze": lambda x: x.unsqueeze(1),
    "squeeze": lambda x: x[:, :1].squeeze(1),
    "expand": lambda x: x.unsqueeze(1).expand(4, 2, 4, 3),
    "cat_shared": lambda x: torch.cat([torch.zeros(1, 1, 3).expand(4, 1, 3), x], 1),
    "cat_rows": lambda x: torch.cat([x, x], 0),
    "stack": lambda x: torch.stack([x, x], 1),
    "split": lambda x: x.split(2, dim=1)[1],
    "unbind": lambda x: x.unbind(1)[2],
    "sum": lambda x: x.sum(-1),
    "sum_rows": lambda x: x.sum(0),
    "cumsum": lambda x: x.cumsum(1),
    "cumsum_rows": lambda x: x.cumsum(0),
    "flip_rows": lambda x: x.flip(0),
    "perm": lambda x: x[torch.tensor([1, 0, 3, 2])],
    "row": lambda x: x[1:3],
    "add_other_rows": lambda x: x + x.flip(0),
    "add_shared": lambda x: x + torch.ones(4, 3),
    "add_unrelated": lambda x: x + torch.arange(4.0).view(4, 1, 1),
    "where": lambda x: torch.where(x > 1, x, 0.0),
    "pad": lambda x: F.pad(x, (1, 1)),
    "pad_rows": lambda x: F.pad(x, (0, 0, 0, 0, 1, 0)),
    # Combined with something computed from the batch: every row depends on every example.
    "center": lambda x: x - x.mean(0, keepdim=True),
    "scale_by_max": lambda x: x / x.abs().max(),
    "standardise": lambda x: (x - x.mean(0)) / x.std(0),
    "reduce_no_dims": lambda x: x.sum(dim=()),
    "new_zeros": lambda x: x + x.new_zeros(3),  # a factory: nothing of x's data
    "add_equal_rows": lambda x: x + torch.zeros(4, 4, 3, dtype=x.dtype),  # the same every row
    # What a model's frozen layers do (the probe follows the examples through them).
    "matmul_per_example": lambda x: torch.matmul(x, x.transpose(1, 2)),  # attention scores
    "bmm": lambda x: torch.bmm(x, x.transpose(1, 2)),
    "matmul_weight": lambda x: x @ _W,
    "matmul_rows": lambda x: x[:, 0] @ _W,
    "matmul_over_rows": lambda x: x.transpose(0, 2) @ x.transpose(0, 2).transpose(1, 2),
    "gram_rows": lambda x: x[:, 0] @ x[:, 0].t(),
    "matmul_other_rows": lambda x: x @ x.flip(0).transpose(1, 2),
    "matmul_unrelated": lambda x: torch.arange(4.0, dtype=x.dtype).view(4, 1, 1) * _I @ x,
    "linear": lambda x: F.linear(x, _W.t(), torch.ones(5, dtype=x.dtype)),
    "linear_over_rows": lambda x: F.linear(x.transpose(0, 2), torch.ones(5, 4, dtype=x.dtype)),
    "dropout": lambda x: (torch.manual_seed(0), F.dropout(x, 0.5, True))[1],
    "softmax": lambda x: F.softmax(x, dim=-1),
    "softmax_rows": lambda x: F.softmax(x, dim=0),
    "gelu": lambda x: F.gelu(x),
    "matmul_keywords": lambda x: torch.matmul(input=x, other=x.transpose(1, 2)),
    "linear_keywords": lambda x: F.linear(input=x, weight=_W.t()),
    "embedding": lambda x: F.embedding(_ids_of(x), torch.arange(1.0, 13.0).view(4, 3)),
    # Found by a review: example data written into a plain tensor (a preallocated buffer, a
    # weight renormalised by max_norm) carried it past the rules untagged.
    "copy_into_plain": lambda x: x + _into_plain(x, lambda u: u.copy_(x)).mean(0),
    "add_into_plain": lambda x: x + _into_plain(x, lambda u: u.add_(x)).mean(0),
    "out_into_plain": lambda x: x + _into_plain(x, lambda u: torch.add(x, 0, out=u)).mean(0),
    "matmul_out": lambda x: x + _into_plain(
        x[..., :1].expand(4, 4, 4), lambda u: torch.matmul(x, x.transpose(1, 2), out=u))[..., :3],
    "embedding_max_norm": lambda x: _renormed_lookup(x),
}


def _ids_of(x: torch.Tensor) -> torch.Tensor:
    """[4, 4] ids in 0..3 from a [4, 4, 3] batch, through tagged operations."""
    return (x > 0).long().sum(-1)


def _into_plain(like: torch.Tensor, write) -> torch.Tensor:
    """A plain tensor of ``like``'s shape that ``write`` fills with example data."""
    u = torch.zeros(tuple(like.shape), dtype=torch.float64)
    write(u)
    return u


def _renormed_lookup(x: torch.Tensor) -> torch.Tensor:
    """F.embedding with max_norm renormalises the looked-up rows of its weight in place: the
    weight then depends on every example's ids, and adding it to the rows mixes them."""
    weight = torch.arange(1.0, 13.0, dtype=torch.float64).view(4, 3)
    rows = F.embedding(_ids_of(x), weight, max_norm=1.0)
    return rows + weight.sum(0)


@pytest.mark.parametrize("name", sorted(MOVES))
def test_a_kept_tag_names_the_dim_that_holds_each_rows_data(name):
    """For each operation: if the output keeps the tag on dim b, then slice j along b depends on
    example j's data only (found by perturbing one example at a time and seeing which slices
    change); the row-mixing and row-selecting operations must drop the tag."""
    op = MOVES[name]
    token = MicroBatchToken(0, 0, 4, "poisson")
    data = torch.randn(4, 4, 3, dtype=torch.float64)
    out = op(tag(data, token))
    mixing = {"cat_rows", "sum_rows", "cumsum_rows", "flip_rows", "perm", "row",
              "add_other_rows", "add_unrelated", "pad_rows", "view_merge", "center",
              "scale_by_max", "standardise", "reduce_no_dims", "matmul_over_rows", "gram_rows",
              "matmul_other_rows", "matmul_unrelated", "linear_over_rows", "softmax_rows",
              "copy_into_plain", "add_into_plain", "out_into_plain", "matmul_out",
              "embedding_max_norm"}
    if name in mixing:
        assert not (isinstance(out, Examples) and out.dp_token is token), name
        return
    assert isinstance(out, Examples) and out.dp_token is token, name
    b = out.dp_bdim
    assert out.shape[b] == 4
    base = op(data)
    for r in range(4):
        moved = data.clone()
        moved[r] += 1.0 + torch.rand(4, 3, dtype=torch.float64)
        changed = (op(moved) != base).movedim(b, 0).reshape(4, -1).any(1)
        assert changed.tolist() == [j == r for j in range(4)], (name, r, changed)


WRITES = {  # in-place writes that may mix rows: each must leave x no longer accepted as examples
    "alias_copy": lambda x: x[:, 1:].copy_(x[torch.tensor([1, 0, 3, 2]), 1:]),  # CutMix
    "view_setitem": lambda x: x[:, :].__setitem__(0, x[1].clone()),
    "setitem_row": lambda x: x.__setitem__(0, x[1].clone()),
    "setitem_transposed": lambda x: x.__setitem__(slice(None), x.transpose(0, 1).clone()),
    "data": lambda x: x.data.__setitem__(0, x.data[1]),
    "numpy": lambda x: x.numpy().__setitem__(0, x.numpy()[1]),
    "out": lambda x: torch.mul(torch.ones(4, 4, 3, dtype=x.dtype), 1, out=x),
    "unknown_inplace": lambda x: x.index_fill_(0, torch.tensor([0]), 1.0),
    # A second review: a write a rule vouches for must not launder an earlier unseen one, and
    # memory handed out through a view or a copy-free conversion escapes all the same.
    "launder": lambda x: (x[:, 1:].copy_(x[torch.tensor([1, 0, 3, 2]), 1:]), x.div_(2.0)),
    "numpy_of_detached": lambda x: x.detach().numpy().__setitem__(0, x.detach().numpy()[1]),
    "data_of_view": lambda x: x[:, :].data.__setitem__(0, x.data[1].clone()),
}


@pytest.mark.parametrize("name", sorted(WRITES))
def test_writes_the_tag_cannot_vouch_for_withdraw_it(name):
    """Writes through an alias, a view, .data, numpy or out= (found by a review: CutMix written as
    x[:, a:].copy_(x[perm, a:]) kept x's tag), and row-selecting or misaligned __setitem__."""
    from dpzero.private.provenance.examples import untagged

    token = MicroBatchToken(0, 0, 4, "poisson")
    x = tag(torch.randn(4, 4, 3), token)
    WRITES[name](x)
    _, found, problem = untagged((x,), token)
    assert found == [] and problem is not None, name  # the model refuses it
    y = tag(torch.randn(4, 4, 3), token)
    y.mul_(2.0)  # a write a rule vouches for: still the examples
    y[:, 0] = 0.0
    _, found, problem = untagged((y,), token)
    assert [(i, b) for i, b, _ in found] == [(0, 0)] and problem is None


def _own_batch_rank(rank, world):
    model, data, p = _linear_private()
    x, y = data.tensors
    # The ranks disagree on the logical batch: 8 on rank 0, 9 on rank 1.
    bx, by = p.privacy_engine.own_batch((x[:4], y[:4]), logical_batch_size=8 + rank)
    F.cross_entropy(p.model(bx), by).backward()
    try:
        p.optimizer.step()
        outcome = "stepped"
    except PrivacyViolation as e:
        outcome = str(e)
    return outcome


@pytest.mark.multirank
def test_ranks_that_disagree_on_an_own_batch_size_all_refuse(tmp_path):
    """A review found: each rank checked rows against its own logical_batch_size, so ranks could
    split on refusing the step and then run mismatched collectives."""
    outcomes = ranks.spawn(_own_batch_rank, 2, tmp_path, timeout_s=60)
    for rank in range(2):
        got = outcomes[rank]
        assert "the ranks gave different logical batch sizes" in got, (rank, got)


LAUNDERED = {  # batch statistics brought back as "constants": each input must be refused
    "new_tensor": lambda x: x - x.new_tensor(x.mean(0)),
    "new_full": lambda x: x - x.new_full((1, 4, 3), x.mean()),
    "full_like": lambda x: torch.cat([x, torch.full_like(x[:, :1], x[:, 0].mean())], 1),
    "pad_value": lambda x: F.pad(x, (0, 1), value=x[:, 0].mean()),
    "index_in_list": lambda x: (x.__setitem__((slice(None), [x.mean((0, 2)).argmax()]), 0.0),
                                x)[1],
    "numpy_value": lambda x: (x.__setitem__((slice(None), 0),
                                            torch.from_numpy(x.mean().numpy())), x)[1],
    "empty_like": lambda x: torch.empty_like(x),
    "dlpack": lambda x: x - torch.from_dlpack(x.mean(0, keepdim=True)),
    "numpy": lambda x: x - torch.from_numpy(x.mean(0, keepdim=True).numpy()),
    "stale_copy": lambda x: (x[:, 1:].copy_(x[torch.tensor([1, 0, 3, 2]), 1:]), x * 1.0)[1],
    "numpy_then_clone": lambda x: (x.detach().numpy().__setitem__(0, 0.0), x.clone())[1],
}


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")  # new_tensor, on purpose
@pytest.mark.parametrize("name", sorted(LAUNDERED))
def test_batch_statistics_cannot_come_back_as_constants(name):
    """Reviews found x.new_tensor(x.mean(0)) and DLPack shed the taint (a per-batch
    standardisation moved the sum by 11-12), and a copy of a tensor written unseen inherited its
    tag (CutMix through a view, then x * 1.0: 2.8). Statistics written into other tensors, or
    moved through the host, are the caller's (documented)."""
    from dpzero.private.provenance.examples import untagged

    token = MicroBatchToken(0, 0, 4, "poisson")
    x = tag(torch.randn(4, 4, 3), token)
    _, found, problem = untagged((LAUNDERED[name](x),), token)
    assert found == [] and problem is not None, name
    fresh = tag(torch.randn(4, 4, 3), token)  # a statistic passed in directly
    _, found, problem = untagged((fresh, fresh.mean(0, keepdim=True)), token)
    assert problem is not None and "model input 1 is computed from the examples" in problem


class Permuted(nn.Module):
    """A layer that sees the examples in another order (sorting by length does this), with the
    order restored after it: dim 0 holds the examples, not in the loader's order."""

    def __init__(self):
        super().__init__()
        self.wte, self.mix, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, K)

    def forward(self, ids):
        h = self.wte(ids)
        order = torch.arange(h.shape[0]).flip(0)
        h = torch.tanh(self.mix(h[order]))[order.argsort()]
        return self.head(h.mean(1))


@pytest.mark.parametrize("batch", [2, T])
def test_a_model_that_permutes_its_examples_holds_2c_under_layer_clipping(batch):
    """Documented limit (provenance/root.py): a permutation between layers is not detected; flat
    clipping would pair rows of different examples across layers, layer clipping bounds each
    layer's rows on their own and so holds the bound."""
    ids, y = ids_and_labels(batch)
    assert refused_or_bounded(Permuted, [ids], y, clipping="layer") == "bounded"


HF_LABELS = {  # what training loops do to labels and ids: each keeps the tag
    "mlm_random_words": lambda ids: (lambda m: (ids.__setitem__(m, torch.randint(
        5, ids.shape)[m]), ids)[1])(torch.rand(ids.shape) < 0.3),
    "bos": lambda ids: (ids.__setitem__((slice(None), 0), torch.full((4,), 1)), ids)[1],
    "repeat": lambda ids: ids.repeat(1, 2),
    "pad_to_ignore": lambda ids: (lambda l: (l.__setitem__(l == 0, -100), l)[1])(ids.clone()),
    "prompt_mask": lambda ids: (lambda l: (l.__setitem__((1, slice(None, 2)), -100), l)[1])(
        ids.clone()),
    "masked_fill": lambda ids: ids.masked_fill(ids == 0, -100),
    "where": lambda ids: torch.where(ids == 0, torch.full_like(ids, -100), ids),
}


@pytest.mark.parametrize("name", sorted(HF_LABELS))
def test_label_masking_keeps_the_tag(name):
    """A third review found labels[labels == pad] = -100 refused: a constant written at any
    elements moves no example's data into another row."""
    from dpzero.private.provenance.examples import untagged

    token = MicroBatchToken(0, 0, 4, "poisson")
    ids = tag(torch.randint(0, 5, (4, 6)), token)
    _, found, problem = untagged((HF_LABELS[name](ids),), token)
    assert problem is None and [(i, b) for i, b, _ in found] == [(0, 0)], name
    x = tag(torch.randn(4, 3, 5), token)  # per-channel normalisation through views, in place
    x[:, 0].sub_(0.5).div_(2.0)
    x[:, 1].sub_(0.1)
    _, found, problem = untagged((x,), token)
    assert problem is None and len(found) == 1
    y = tag(torch.randn(4, 6), token)  # an index computed from the batch is not a constant
    y[:, y.mean(0).argmax()] = 0.0
    assert untagged((y,), token)[2] is not None


def _refusing_rank(rank, world, stage):
    model, data, p = _linear_private(n=32, sample_rate=1.0, batch_size=None, zero_stage=stage,
                                     max_physical_batch_size=4)
    batches = iter(p.data_loader)
    x, y = next(batches)
    try:  # rank 0 mixes its rows; rank 1 does nothing wrong
        F.cross_entropy(p.model(x.flip(0) if rank == 0 else x), y).backward()
        outcome = ["went on"]
    except PrivacyViolation as e:
        outcome = [str(e)[:60]]
    p.optimizer.zero_grad()
    for x, y in batches:  # then both go on together through the logical batch
        F.cross_entropy(p.model(x), y).backward()
        if p.optimizer.step():
            break
    outcome.append(p.privacy_engine.charges)
    return outcome


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [2, 3])
def test_a_forward_refused_on_one_rank_is_refused_on_every_rank(tmp_path, stage):
    """A third review found a rank that refused alone (lazily, at its backward) left the others
    in backward collectives it never ran: a hang at stage 3, mismatched micro-batches at stage
    2. Every rank now raises at that forward, and they go on together."""
    got = ranks.spawn(_refusing_rank, 2, tmp_path, stage, timeout_s=60)
    assert got[0][0].startswith("model input 0 is computed from the examples"), got
    assert got[1][0].startswith("another rank refused this forward"), got
    assert got[0][1] == got[1][1] == 1, got  # one step, taken together


def test_no_record_survives_a_freed_address():
    """A fourth review found the records keyed by address: a vouched write on a freed tensor let
    CutMix through a view on a new tensor at the same address pass, and an escaped storage
    refused a later tensor that reused it. The records hold their storages alive."""
    from dpzero.private.provenance.examples import untagged

    token = MicroBatchToken(0, 0, 64, "poisson")
    x = tag(torch.randn(64, 256), token)
    for _ in range(20):
        a = x.clone()
        a[:, :3].sub_(0.5)  # vouched: recorded for a's storage
        address = a.untyped_storage().data_ptr()
        del a
        b = x.clone()
        reused = b.untyped_storage().data_ptr() == address
        b[:, 128:].copy_(b[torch.randperm(64), 128:])  # through a view: no rule vouches
        assert untagged((b,), token)[2] is not None
        assert not reused  # the record keeps the old storage, and its address, taken
        del b
    img = x.clone()
    _ = img[0].numpy().copy()  # escaped
    del img
    assert untagged((x.clone(),), token)[2] is None  # a new tensor is not refused for it


def test_an_output_with_the_batch_size_past_dim_0_makes_the_shapes_ambiguous():
    # A generic module's recorded outputs count as its inputs do: with B = 4 examples, an output
    # [16, 4, 8] could be the batch in dim 1 or a coincidence of sizes, so a verdict cached for
    # this call pattern must not be reused without a probe. (The check once compared the batch
    # size against whole output shapes and never saw one.)
    from dpzero.private.provenance.records import CallRecord, ambiguous

    inputs = ((4, 16, 8),)
    assert ambiguous([CallRecord(0, inputs, (), ((16, 4, 8),))], 4)
    assert ambiguous([CallRecord(0, inputs, (), ((4, 16, 8), (2, 3, 4)))], 4)
    assert not ambiguous([CallRecord(0, inputs, (), ((4, 16, 8),))], 4)
    assert not ambiguous([CallRecord(0, inputs, (), ((16, 4, 8),))], 1)  # one row: nothing to mix
    # Inputs, positional and keyword, as before.
    assert ambiguous([CallRecord(0, ((16, 4),))], 4)
    assert ambiguous([CallRecord(0, ((4, 8),), (("mask", (8, 4)),))], 4)
    assert not ambiguous([CallRecord(0, ((4, 16), None))], 4)


class LateShared(nn.Module):
    """Inputs the probe finds shared by the batch that come from the examples only from the
    fourth forward call on (the probe and the rotated probe are calls 2 and 3): ``what`` "ids",
    a position table's [1, T] ids taken from example 0; "value", a generic module's shared
    tensor argument taken from the batch's mean."""

    def __init__(self, what):
        super().__init__()
        self.what, self.calls = what, 0
        self.wte, self.wpe, self.head = nn.Embedding(V, D), nn.Embedding(V, D), nn.Linear(D, K)
        self.scale = _Scale()

    def forward(self, ids):
        self.calls += 1
        late = self.calls > 3
        h = self.wte(ids)
        if self.what == "ids":
            h = h + self.wpe(ids[:1] if late else torch.arange(ids.shape[1])[None])
        else:
            h = self.scale(h, h.detach().mean((0, 1)) if late else torch.ones(D))
        return self.head(h.mean(1))


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(D))

    def forward(self, h, s):
        return h * self.w * s


@pytest.mark.parametrize("what", ["ids", "value"])
def test_a_shared_input_that_comes_from_the_examples_later_is_refused(what):
    """Note [premises]: the probe's verdict that an input is shared by the batch is held to the
    values it saw at every later call of the pattern, not only at the probe (a review: the
    shared-value and rotated-ids checks were one-shot per call pattern)."""
    from sensitivity import step_sum

    ids, y = ids_and_labels(8, seed=5)
    with pytest.raises(PrivacyViolation, match=r"found shared by the whole batch .* changed its "
                                               r"values at the same shape"):
        step_sum(lambda: LateShared(what), [ids], y, torch.ones(8), micro=2)


class SpreadPositions(nn.Module):
    """Position ids as Opacus users must write them, built in the training loop and passed
    beside the batch: torch.arange(T).expand(B, -1) (one row spread over the batch, stride 0)."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe, self.head = nn.Embedding(V, D), nn.Embedding(T, D), nn.Linear(D, K)

    def forward(self, ids, pos):
        return self.head(torch.tanh(self.wte(ids) + self.wpe(pos)).mean(1))


def _with_positions(model, ids):
    return model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1))


@pytest.mark.parametrize("batch", [2, T, T + 1])
def test_position_ids_spread_over_the_batch_train_and_hold_2c(batch):
    """Note [spread inputs]: a privacy review found them refused by the probe ("could not run
    the model's forward once more with one more example")."""
    ids, y = ids_and_labels(batch, seed=6)
    assert refused_or_bounded(SpreadPositions, [ids], y, call=_with_positions) == "bounded"


class OtherFirstDim(nn.Module):
    """A stride-0 input whose dim 0 is not the batch, with as many entries (B = T): a [T, T]
    additive bias spread from one row. Spreading it over B + 1 rows breaks the probe, which then
    runs with it as it came: trained as before."""

    def __init__(self):
        super().__init__()
        self.wte, self.head = nn.Embedding(V, D), nn.Linear(D, K)

    def forward(self, ids, bias):
        scores = self.wte(ids) @ self.wte(ids).transpose(1, 2) + bias  # [B, T, T]
        return self.head((scores.softmax(-1) @ self.wte(ids)).mean(1))


def test_a_spread_input_whose_first_dim_is_not_the_batch_is_probed_as_it_came():
    ids, y = ids_and_labels(T, seed=7)  # B = T
    call = lambda m, x: m(x, torch.zeros(1, T).expand(T, T))  # noqa: E731
    assert refused_or_bounded(OtherFirstDim, [ids], y, call=call) == "bounded"


def test_the_argument_walk_returns_exactly_pytrees_leaves():
    # Note [flat arguments] (provenance/examples.py): pytree's leaves, with list and tuple
    # subclasses that pytree keeps whole opened; against pytree.tree_leaves itself.
    import collections

    from torch.utils import _pytree as pytree

    from dpzero.private.provenance.examples import leaves

    token = MicroBatchToken(0, 0, 4, "poisson")
    x = tag(torch.randn(4, 3), token)
    w = nn.Parameter(torch.randn(3))
    pair = collections.namedtuple("Pair", "a b")
    trees = [
        ((x, w, 2, 1.5, None), {"dim": -1, "dtype": torch.float32, "out": None}),
        ([x, [w, (x, ...)]], {"size": torch.Size([4, 3]), "index": (slice(0, 2), 1)}),
        ({"b": x, "a": [torch.device("cpu"), torch.strided, True, 1j]}, {}),
        ((pair(x, w),), {}),                                   # a namedtuple: pytree's walk
        ((collections.OrderedDict(z=w, y=x),), {"k": pair(1, x)}),
        ((), {}),
        x,
    ]
    for tree in trees:
        got, want = leaves(tree), pytree.tree_leaves(tree)
        assert len(got) == len(want) and all(a is b or a == b for a, b in zip(got, want)), tree
        assert [type(a) for a in got] == [type(b) for b in want]
    # A list or tuple subclass pytree keeps whole, which torch reads as its tensors: opened.
    mine = _MyList([x, _MyTuple((w, 3))])
    assert pytree.tree_leaves(mine) == [mine]
    assert [id(a) for a in leaves(((mine,), {}))] == [id(x), id(w), id(3)]


class _MyList(list):
    pass


class _MyTuple(tuple):
    pass


def _loop_step(container):
    """One step whose training loop hands the model the batch's mean, computed through
    ``container`` (the input itself, or the inputs to torch.stack)."""
    torch.manual_seed(0)

    class TakesStat(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x, stat):
            return self.lin(x - stat)

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g),
                                          torch.randint(0, 3, (16,), generator=g))
    p = dpzero.make_private(TakesStat(), dataset=data, sample_rate=1.0, noise_multiplier=0.0,
                            allow_no_noise=True, max_grad_norm=1.0, seed=0)
    x, y = next(iter(p.data_loader))
    stat = torch.stack(container([x])).mean(1)
    F.cross_entropy(p.model(x, stat), y).backward()


@pytest.mark.parametrize("container", [list, tuple, _MyList, _MyTuple])
def test_a_batch_statistic_computed_through_any_list_is_refused(container):
    # Note [flat arguments]: pytree keeps a list subclass whole, and the stacked mean used to
    # come out neither tagged nor tainted.
    with pytest.raises(PrivacyViolation, match="computed from the examples"):
        _loop_step(container)


def test_a_batch_holding_tensors_in_a_list_subclass_is_refused():
    model = nn.Linear(4, 3)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,)))
    p = dpzero.make_private(model, dataset=data, batch_size=4, noise_multiplier=1.0,
                            max_grad_norm=1.0, seed=0)
    x, y = data.tensors[0][:4], data.tensors[1][:4]
    with pytest.raises(ValueError, match="inside _MyList, a list or tuple subclass"):
        p.privacy_engine.own_batch((_MyList([x]), y), logical_batch_size=4)
