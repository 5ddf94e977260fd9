"""Activation checkpointing and optimizer offload under DP (Note [recomputed forwards]
in private/book.py, private/checkpointing.py; Note [master weights] in src/zero/flat_param.h).

Reference: the same private run without checkpointing (same seeds, dropout active), which the
other private tests tie to torch.func per-sample gradients and a naive DP-SGD loop. Checkpointing
must change nothing of the step — every stage, flat and layer-wise clipping, one and two ranks,
dpzero's switch and Hugging Face's — while really recomputing (each checkpointed layer runs its
forward twice per micro-batch) and really saving memory (fewer tensors saved for backward).
"""

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import dpzero
import ranks
from dpzero.private import PrivacyViolation

V, T, D, K = 23, 6, 8, 3


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.2)  # masks must be reproduced by the recompute

    def forward(self, h):
        return h + self.fc2(self.drop(torch.tanh(self.fc1(self.ln(h)))))


class Net(nn.Module):
    def __init__(self, blocks=2):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(D) for _ in range(blocks)])
        self.head = nn.Linear(D, K)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(1))


def data(n=40):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randint(0, V, (n, T), generator=g),
                                          torch.randint(0, K, (n,), generator=g))


def run(checkpointing, stage, clipping, steps=3, model=None, **kw):
    torch.manual_seed(3)
    p = dpzero.make_private(model or Net(), dataset=data(), sample_rate=0.3, noise_multiplier=0.7,
                            max_grad_norm=0.5, clipping=clipping, zero_stage=stage, seed=5,
                            optimizer="adam", lr=0.01, max_physical_batch_size=5,
                            activation_checkpointing=checkpointing, **kw)
    fc1 = p.model.blocks[0].fc1
    forwards = []
    # The forward and its recompute; not the provenance probe's (Note [batch provenance]).
    fc1.register_forward_pre_hook(lambda *_: forwards.append(1)
                                  if p.privacy_engine.book.probe is None else None)
    taken, micro = 0, 0
    while taken < steps:
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            F.cross_entropy(p.model(x), y).backward()
            micro += 1
            if p.optimizer.step():
                taken += 1
                if taken == steps:
                    break
    return p, len(forwards) / micro


def assert_same(a, b, atol=0.0):
    for name, value in a.items():
        torch.testing.assert_close(b[name], value, atol=atol, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("clipping", ["flat", "layer"])
def test_checkpointing_changes_nothing_of_the_private_step(stage, clipping):
    plain, once = run(None, stage, clipping)
    every_unit, twice = run(True, stage, clipping)
    assert once == 1 and twice == 2  # the blocks' layers really ran again in the backward
    want = plain.privacy_engine.parameters()
    assert_same(want, every_unit.privacy_engine.parameters())
    assert every_unit.privacy_engine.charges == plain.privacy_engine.charges == 3
    if stage == 3:  # checkpointing chosen by module class: the blocks only
        by_class, twice = run(Block, stage, clipping)
        assert twice == 2
        assert_same(want, by_class.privacy_engine.parameters())


def test_checkpointing_saves_activations():
    """What autograd keeps for the backward, counted with saved-tensor hooks: a checkpointed block
    keeps its input only, not the activations inside it (the book's own A and G are kept or not
    by the clipping mode, as without checkpointing)."""
    def saved_bytes(checkpointing):
        p, _ = run(checkpointing, 0, "layer", steps=1)
        x, _ = p.privacy_engine.own_batch(data()[:5], logical_batch_size=5)
        total = []

        def pack(t):
            total.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.cross_entropy(p.model(x), torch.zeros(5, dtype=torch.long))
        loss.backward()
        p.optimizer.zero_grad()
        return sum(total)

    plain, checkpointed = saved_bytes(None), saved_bytes(Block)
    assert checkpointed < 0.7 * plain, (checkpointed, plain)


def test_reentrant_checkpointing_is_refused_and_the_step_with_it():
    class Reentrant(Net):
        def forward(self, ids):
            h = self.emb(ids)
            for block in self.blocks:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
            return self.head(h.mean(1))

    torch.manual_seed(3)
    p = dpzero.make_private(Reentrant(), dataset=data(), sample_rate=0.3, noise_multiplier=0.7,
                            max_grad_norm=0.5, seed=5)
    x, y = next(iter(p.data_loader))
    with pytest.raises(PrivacyViolation, match=r"reentrant activation checkpointing "
                                               r"\(use_reentrant=True\)"):
        F.cross_entropy(p.model(x), y).backward()
    with pytest.raises(PrivacyViolation, match="refusing the step"):
        p.optimizer.step()
    assert p.privacy_engine.charges == 0


@pytest.mark.parametrize("spec, message", [
    (["blocks.7"], r"the model has no submodule 'blocks.7'"),
    (["blocks", "blocks.0"], r"\['blocks.0'\] lie inside other modules of the list"),
    ("blocks.0", r"must be True, a list of module names or a module class, got 'blocks.0'"),
    (nn.GRU, r"the model has no module of that class"),
])
def test_bad_checkpointing_choices_are_named_and_nothing_is_attached(spec, message):
    model = Net()
    with pytest.raises(ValueError, match=message):
        dpzero.make_private(model, dataset=data(), sample_rate=0.3, noise_multiplier=0.7,
                            max_grad_norm=0.5, activation_checkpointing=spec)
    assert all("forward" not in vars(m) for m in model.modules())


def test_detach_removes_the_checkpoint_wrappers():
    p, _ = run(Block, 0, "flat", steps=1)
    model = p.privacy_engine.detach()
    assert all("forward" not in vars(m) for m in model.modules())


# ---- two ranks ---------------------------------------------------------------------------------

def _two_ranks(rank, world):
    results = {}
    for checkpointing in (None, True):
        p, forwards = run(checkpointing, 3, "flat")
        results[checkpointing] = (p.privacy_engine.parameters(), forwards)
        del p
    import gc

    gc.collect()
    return results


@pytest.mark.multirank
def test_two_ranks_at_stage_3_checkpointing_changes_nothing(tmp_path):
    """Each rank draws its own dropout masks, so the reference is the same two-rank run without
    checkpointing."""
    got = ranks.spawn(_two_ranks, 2, tmp_path, timeout_s=120)[0]
    (want, once), (params, twice) = got[None], got[True]
    assert once == 1 and twice == 2
    assert_same(want, params)


# ---- Hugging Face ------------------------------------------------------------------------------

def _gpt2(dropout=0.1):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=8, n_embd=16, n_layer=2, n_head=2,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                  attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg)


def _gpt2_run(model, **kw):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 50, (24, 8), generator=g)
    ds = torch.utils.data.TensorDataset(ids)
    torch.manual_seed(4)
    p = dpzero.make_private(model, dataset=ds, sample_rate=0.25, noise_multiplier=0.9,
                            max_grad_norm=0.3, seed=9, optimizer="adamw", lr=1e-2, zero_stage=3,
                            units=["transformer.wte", "transformer.wpe", "transformer.h.0",
                                   "transformer.h.1", "transformer.ln_f"],
                            max_physical_batch_size=4, **kw)
    model.train()
    taken = 0
    while taken < 2:
        for (x,) in p.data_loader:
            p.optimizer.zero_grad()
            logits = p.model(x).logits
            F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
            if p.optimizer.step():
                taken += 1
                if taken == 2:
                    break
    return p.privacy_engine.parameters()


def test_hugging_face_gpt2_with_its_own_switch_and_with_ours():
    want = _gpt2_run(_gpt2())
    hf = _gpt2()
    hf.activation_checkpointing_enable()  # Hugging Face's switch, non-reentrant by default
    assert hf.transformer.gradient_checkpointing
    # The tied embedding's two contributions (wte, lm_head) meet in another order when the
    # blocks' backward is recomputed: the sums agree to float32 rounding.
    assert_same(want, _gpt2_run(hf), atol=1e-7)
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    ours = _gpt2_run(_gpt2(), activation_checkpointing=GPT2Block)  # no key/value cache
    assert_same(want, ours, atol=1e-7)


def test_hugging_face_reentrant_checkpointing_is_refused_up_front():
    model = _gpt2()
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match=r"module 'transformer' \(GPT2Model\) uses reentrant "
                                         r"activation checkpointing"):
        dpzero.make_private(model, dataset=data(), sample_rate=0.3, noise_multiplier=0.7,
                            max_grad_norm=0.5)
    assert all("forward" not in vars(m) for m in model.modules())


# ---- optimizer offload ---------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("clipping", ["flat", "layer"])
def test_optimizer_offload_changes_nothing_of_the_private_step(stage, clipping):
    """offload_optimizer keeps the fp32 master and Adam's state in host memory as a separate
    tensor (on CPU parameters, the same memory kind: the arithmetic is the same ops on the same
    values), with and without checkpointing."""
    plain, _ = run(None, stage, clipping)
    offloaded, _ = run(None, stage, clipping, offload_optimizer=True)
    both, _ = run(True, stage, clipping, offload_optimizer=True)
    assert offloaded.privacy_engine.sharded.memory()["master_params"] > 0  # the separate master
    want = plain.privacy_engine.parameters()
    assert_same(want, offloaded.privacy_engine.parameters())
    assert_same(want, both.privacy_engine.parameters())


@pytest.mark.parametrize("clipping", ["flat", "layer"])
def test_parameter_offload_changes_nothing_of_the_private_step(clipping):
    """Stage 3 with offload_params (Note [parameter offload]): the owned shards are the fp32
    master in host memory; the private step is the same, with and without checkpointing."""
    plain, _ = run(None, 3, clipping)
    offloaded, _ = run(None, 3, clipping, offload_params=True)
    both, _ = run(True, 3, clipping, offload_params=True)
    assert offloaded.privacy_engine.sharded.zero_state.offload_params
    want = plain.privacy_engine.parameters()
    assert_same(want, offloaded.privacy_engine.parameters())
    assert_same(want, both.privacy_engine.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="parameter offload to the host needs a GPU")
@pytest.mark.parametrize("clipping", ["flat", "layer"])
def test_parameter_offload_from_cuda_keeps_the_private_step(clipping):
    """On a GPU the host shard is pinned CPU memory and every gather copies it to the device
    (Note [parameter offload]); the clipped sums are formed on the device and handed to the
    engine there. Same seeds: the same step as without offload, to float32 rounding (the
    optimizer runs on the host)."""
    def cuda_run(**kw):
        torch.manual_seed(3)
        data_ = data()
        p = dpzero.make_private(Net().cuda(), dataset=data_, sample_rate=0.3,
                                noise_multiplier=0.7, max_grad_norm=0.5, clipping=clipping,
                                zero_stage=3, seed=5, optimizer="adam", lr=0.01,
                                max_physical_batch_size=5, **kw)
        for _ in range(2):
            for x, y in p.data_loader:
                p.optimizer.zero_grad()
                F.cross_entropy(p.model(x.cuda()), y.cuda()).backward()
                if p.optimizer.step():
                    break
        return p

    plain, offloaded = cuda_run(), cuda_run(offload_params=True)
    memory = offloaded.privacy_engine.sharded.memory()
    assert memory["params"] == 0 and memory["host"] > 0
    want = plain.privacy_engine.parameters()
    got = offloaded.privacy_engine.parameters()
    for name, value in want.items():
        torch.testing.assert_close(got[name].to(value.device), value, rtol=1e-5, atol=1e-6)


def test_hugging_face_gpt2_checkpointed_whole_with_its_broadcast_position_ids():
    # Checkpointing the whole GPT2Model recomputes wpe's lookup of the [1, T] position ids, which
    # the DP layer expands to the batch (Note [broadcast positions]): the recompute must expand
    # them too, or it saves other tensors than the original call (torch's CheckpointError). The
    # reference is the same run without checkpointing.
    from transformers.models.gpt2.modeling_gpt2 import GPT2Model

    want = _gpt2_run(_gpt2())
    ours = _gpt2_run(_gpt2(), activation_checkpointing=GPT2Model)  # no key/value cache
    assert_same(want, ours, atol=1e-7)
