"""The agreements Python code makes across ranks (python/csrc/comm_bindings.cpp), over real Gloo
process groups. Reference: the sums and rank 0's values computed here from each rank's inputs."""

import pytest
import torch.distributed as dist

import ranks
from dpzero import _C

pytestmark = pytest.mark.multirank


def _values(rank):
    return [rank + 1, -(10 ** 12) * rank, (1 << 62) if rank == 0 else 0], [0.5 * rank, -1.25]


def _comm_rank(rank, world):
    ints, floats = _values(rank)
    group = dist.group.WORLD
    return dict(sum=_C.comm.all_reduce_sum(group, ints),
                sum_float=_C.comm.all_reduce_sum_float64(group, floats),
                from_root=_C.comm.broadcast(group, ints, 0),
                from_last=_C.comm.broadcast(group, ints, world - 1))


def test_sums_and_broadcasts_over_gloo(tmp_path):
    world = 3
    got = ranks.spawn(_comm_rank, world, tmp_path, timeout_s=60)
    inputs = [_values(r) for r in range(world)]
    want = dict(sum=[sum(v[0][i] for v in inputs) for i in range(3)],
                sum_float=[sum(v[1][i] for v in inputs) for i in range(2)],
                from_root=inputs[0][0], from_last=inputs[-1][0])
    for rank in range(world):
        assert got[rank] == want, rank
