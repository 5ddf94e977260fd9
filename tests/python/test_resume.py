"""Resuming a private run at another world size and ZeRO stage (issue 10): a run checkpointed
after 2 steps on two Gloo ranks at stage 2 and continued for 2 more in one process at stage 1
ends where the same run without interruption ends (reference: the uninterrupted single-process
run, which the sharding-invariance tests tie to every world size and stage)."""

import datetime
import json

import torch
import torch.multiprocessing as mp

import dpzero

from test_private import EXTRA, SeqNet, seq_data, take_steps


def _make(stage):
    torch.manual_seed(6)
    return dpzero.make_private(SeqNet(tied=True), dataset=seq_data(48), sample_rate=0.2,
                               noise_multiplier=0.8, max_grad_norm=0.5, clipping="flat",
                               zero_stage=stage, seed=77, optimizer="adam", lr=0.01,
                               max_physical_batch_size=3, **EXTRA)


def _first_half(rank, world_size, store_path, ckpt, state_path):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=300))
    try:
        p = _make(stage=2)
        take_steps(p, 2)
        dpzero.checkpoint.save(p.privacy_engine.sharded, ckpt, step=2)
        if rank == 0:
            with open(state_path, "w") as f:
                json.dump(p.privacy_engine.state_dict(), f)
        del p
        import gc

        gc.collect()
    finally:
        dist.destroy_process_group()


def test_a_private_run_resumed_at_another_world_size_matches_the_uninterrupted_run(tmp_path):
    ckpt, state_path = str(tmp_path / "ckpt"), str(tmp_path / "engine.json")
    mp.spawn(_first_half, args=(2, str(tmp_path / "store"), ckpt, state_path), nprocs=2,
             join=True)

    resumed = _make(stage=1)  # one process, another stage
    dpzero.checkpoint.load(resumed.privacy_engine.sharded, ckpt)
    with open(state_path) as f:
        resumed.privacy_engine.load_state_dict(json.load(f))
    assert resumed.privacy_engine.charges == 2
    take_steps(resumed, 2)

    reference = _make(stage=0)
    take_steps(reference, 4)
    engine = resumed.privacy_engine
    assert engine.charges == 4 and engine.last_step_stats["noise_index"] == 3
    assert engine.accountant.history == reference.privacy_engine.accountant.history
    want = reference.privacy_engine.parameters()
    for name, value in engine.parameters().items():
        torch.testing.assert_close(value, want[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
