"""Resuming a private run at another world size and ZeRO stage: a run checkpointed
after 2 steps on two Gloo ranks at stage 2 and continued for 2 more in one process at stage 1
ends where the same run without interruption ends (reference: the uninterrupted single-process
run, which the sharding-invariance tests tie to every world size and stage)."""

import json

import pytest
import torch

import dpzero
import ranks

from test_private import EXTRA, SeqNet, seq_data, take_steps


def _make(stage):
    torch.manual_seed(6)
    return dpzero.make_private(SeqNet(tied=True), dataset=seq_data(48), sample_rate=0.2,
                               noise_multiplier=0.8, max_grad_norm=0.5, clipping="flat",
                               zero_stage=stage, seed=77, optimizer="adam", lr=0.01,
                               max_physical_batch_size=3, **EXTRA)


def _first_half(rank, world_size, ckpt):
    """Two steps at stage 2, a sharded checkpoint; rank 0's engine state as JSON text."""
    p = _make(stage=2)
    take_steps(p, 2)
    dpzero.checkpoint.save(p.privacy_engine.sharded, ckpt, step=2)
    state = json.dumps(p.privacy_engine.state_dict()) if rank == 0 else None
    del p
    import gc

    gc.collect()
    return state


@pytest.mark.multirank
def test_a_private_run_resumed_at_another_world_size_matches_the_uninterrupted_run(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    state = ranks.spawn(_first_half, 2, tmp_path, ckpt)[0]

    resumed = _make(stage=1)  # one process, another stage
    dpzero.checkpoint.load(resumed.privacy_engine.sharded, ckpt)
    resumed.privacy_engine.load_state_dict(json.loads(state))
    assert resumed.privacy_engine.charges == 2
    take_steps(resumed, 2)

    reference = _make(stage=0)
    take_steps(reference, 4)
    engine = resumed.privacy_engine
    assert engine.charges == 4 and engine.last_step["noise_index"] == 3
    assert engine.accountant.history == reference.privacy_engine.accountant.history
    want = reference.privacy_engine.parameters()
    for name, value in engine.parameters().items():
        torch.testing.assert_close(value, want[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _secure(stage=1):
    torch.manual_seed(6)
    return dpzero.make_private(SeqNet(), dataset=seq_data(48), sample_rate=0.2,
                               noise_multiplier=0.8, max_grad_norm=0.5, zero_stage=stage,
                               optimizer="adam", lr=0.01, secure_mode=True,
                               max_physical_batch_size=3, **EXTRA)


def _files_bytes(root):
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def test_secure_mode_checkpoints_hold_no_key_unless_asked(tmp_path):
    """Security: a secure-mode checkpoint (engine state in its metadata) holds neither
    seed nor key, in any encoding; with include_secrets=True it holds the key, and a run restored
    from it continues with exactly the original's noise and sampling."""
    import struct

    p = _secure()
    take_steps(p, 1)
    engine = p.privacy_engine
    key = list(engine.noise_source.key)
    assert len(key) == 8 and len(set(key)) == 8  # 256 bits from the OS
    needles = [struct.pack("<8I", *key), struct.pack("<8q", *key), struct.pack(">8I", *key)]
    needles += [str(w).encode() for w in key if w >= 10**6]  # JSON / text
    plain = tmp_path / "plain"
    state = engine.state_dict()
    assert state["seed"] is None and "key" not in state
    dpzero.checkpoint.save(engine.sharded, plain, step=1, metadata={"privacy_engine": state})
    blob = _files_bytes(plain)
    assert len(blob) > 1000 and not [n for n in needles if n in blob]

    asked = tmp_path / "asked"
    dpzero.checkpoint.save(engine.sharded, asked, step=1,
                           metadata={"privacy_engine": engine.state_dict(include_secrets=True)})
    assert str(key[0]).encode() in _files_bytes(asked)  # the detector above can see a key

    restored = _secure()
    assert restored.privacy_engine.noise_source.key != key  # a fresh run has its own key
    meta = dpzero.checkpoint.load(restored.privacy_engine.sharded, asked)["metadata"]
    restored.privacy_engine.load_state_dict(meta["privacy_engine"])
    take_steps(p, 2)
    take_steps(restored, 2)
    want = engine.parameters()
    for name, value in restored.privacy_engine.parameters().items():
        torch.testing.assert_close(value, want[name], atol=1e-6, rtol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")

    seeded = _make(stage=1)
    with pytest.raises(ValueError, match="holds a secure-mode key, this engine is seeded"):
        seeded.privacy_engine.load_state_dict(engine.state_dict(include_secrets=True) | {
            "sample_rate": seeded.privacy_engine.sample_rate})


@pytest.mark.parametrize("key, value, message", [
    ("sample_rate", 0.25, r"state_dict: sample_rate is 0.25, this engine has 0.2"),
    ("noise_multiplier", 1.1, r"state_dict: noise_multiplier is 1.1, this engine has 0.8"),
    ("max_grad_norm", 2.0, r"state_dict: max_grad_norm is 2.0, this engine has 0.5"),
    ("dataset_size", 50, r"state_dict: dataset_size is 50, this engine has 48"),
    ("history", None, r"state_dict: missing entries \['history'\]"),
])
def test_an_engine_state_of_other_settings_is_refused_and_changes_nothing(key, value, message):
    source = _make(stage=0)
    take_steps(source, 2)
    state = source.privacy_engine.state_dict()
    if value is None:
        del state[key]
    else:
        state[key] = value
    target = _make(stage=0)
    before = (target.privacy_engine.charges, target.privacy_engine.next_step,
              list(target.privacy_engine.accountant.history))
    with pytest.raises(ValueError, match=message):
        target.privacy_engine.load_state_dict(state)
    engine = target.privacy_engine
    assert (engine.charges, engine.next_step, list(engine.accountant.history)) == before
