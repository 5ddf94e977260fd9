"""The agreements Python code makes across ranks (python/csrc/comm_bindings.cpp), over real Gloo
process groups. Reference: the sums and rank 0's values computed here from each rank's inputs."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dpzero import _C

pytestmark = pytest.mark.multirank


def _values(rank):
    return [rank + 1, -(10 ** 12) * rank, (1 << 62) if rank == 0 else 0], [0.5 * rank, -1.25]


def _comm_rank(rank, world, store, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        ints, floats = _values(rank)
        group = dist.group.WORLD
        got = dict(sum=_C.comm.all_reduce_sum(group, ints),
                   sum_float=_C.comm.all_reduce_sum_float64(group, floats),
                   from_root=_C.comm.broadcast(group, ints, 0),
                   from_last=_C.comm.broadcast(group, ints, world - 1))
        torch.save(got, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_sums_and_broadcasts_over_gloo(tmp_path):
    world = 3
    out = str(tmp_path / "out")
    mp.spawn(_comm_rank, args=(world, str(tmp_path / "store"), out), nprocs=world, join=True)
    inputs = [_values(r) for r in range(world)]
    want = dict(sum=[sum(v[0][i] for v in inputs) for i in range(3)],
                sum_float=[sum(v[1][i] for v in inputs) for i in range(2)],
                from_root=inputs[0][0], from_last=inputs[-1][0])
    for rank in range(world):
        assert torch.load(f"{out}.{rank}") == want, rank
