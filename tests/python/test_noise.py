"""The sharded-noise contract from Python (design.md §3 "Noise").

References: an independent pure-Python Philox4x32-10 (philox_reference.py) for the op's values and
a single-process full-tensor draw for the sharded union, including across real Gloo process groups.
"""

import itertools
import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ranks
from devices import DEVICES
from dpzero._C import shard as shard_ops  # shard plans and sharded noise
from philox_reference import chacha20_block, noise, philox4x32_10, secure_noise


def test_reference_philox_matches_published_vector():
    # Guards the reference itself (Random123 kat_vectors).
    assert philox4x32_10(
        [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0]
    ) == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_reference_chacha20_matches_rfc8439():
    key = [0x03020100, 0x07060504, 0x0B0A0908, 0x0F0E0D0C, 0x13121110, 0x17161514, 0x1B1A1918,
           0x1F1E1D1C]
    assert chacha20_block(key, 1, [0x09000000, 0x4A000000, 0])[:4] == [
        0xE4E7F110, 0x15593BD1, 0x1FDD0F50, 0xC47120A3]


@pytest.mark.parametrize("offset,n", [(0, 5), (3, 8), (1 << 33, 3)])
def test_add_secure_noise_matches_independent_reference(offset, n):
    key = [0xDEADBEEF, 1, 2, 3, 4, 5, 6, 0xFFFFFFFF]
    x = torch.zeros(n, dtype=torch.float64)
    torch.ops.dpzero.add_secure_noise_(x, 1.0, key, 42, offset)
    np.testing.assert_allclose(x.numpy(), secure_noise(key, 42, offset, n), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("offset,n", [(0, 9), (3, 17), (1 << 33, 6)])
@pytest.mark.parametrize("seed", [0, 12345, -7])
def test_add_noise_matches_independent_reference(offset, n, seed):
    x = torch.zeros(n)
    torch.ops.dpzero.add_noise_(x, 1.0, seed, 11, offset)
    ref = noise(seed, 11, offset, n)
    # float32 libm (logf/cosf) may differ from numpy's float32 routines in the last ulp.
    np.testing.assert_allclose(x.numpy(), ref, rtol=2e-6, atol=2e-6)


def test_add_noise_scales_and_adds_in_place():
    x = torch.full((64,), 3.0)
    y = x.clone()
    out = torch.ops.dpzero.add_noise_(x, 0.0, 5, 1, 0)
    assert out.data_ptr() == x.data_ptr() and torch.equal(x, y)  # std = 0 changes nothing
    torch.ops.dpzero.add_noise_(x, 2.0, 5, 1, 0)
    z = torch.zeros(64)
    torch.ops.dpzero.add_noise_(z, 1.0, 5, 1, 0)
    torch.testing.assert_close(x, y + 2.0 * z, rtol=0, atol=1e-6)


def test_add_noise_rejects_bad_values_naming_them():
    x = torch.zeros(4)
    with pytest.raises(RuntimeError, match="got -0.5"):
        torch.ops.dpzero.add_noise_(x, -0.5, 0, 0, 0)
    with pytest.raises(RuntimeError, match="step must be in"):
        torch.ops.dpzero.add_noise_(x, 1.0, 0, 2**32, 0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        torch.ops.dpzero.add_noise_(torch.zeros(4, dtype=torch.float64), 1.0, 0, 0, 0)


def _full_noise(layout_params, seed, step, std):
    start = min(g for _, g in layout_params)
    total = sum(n for n, _ in layout_params)
    ref = torch.zeros(total)
    torch.ops.dpzero.add_noise_(ref, std, seed, step, start)
    return ref, start


def _gather_global(flat, layout, start, total):
    out = torch.empty(total)
    for run in layout.runs():
        out[run.global_offset - start : run.global_offset - start + run.length] = flat[
            run.local_offset : run.local_offset + run.length
        ]
    return out


@pytest.mark.parametrize("boundaries", ["even", "parameters"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_union_of_shards_equals_single_tensor(world_size, boundaries):
    params = [(37, 100), (0, 137), (5, 137), (250, 142)]
    ref, start = _full_noise(params, seed=99, step=3, std=0.7)
    layout = shard_ops.UnitLayout(params, world_size, alignment=4, boundaries=boundaries)
    flat = torch.zeros(layout.padded_numel)
    for r in range(world_size):
        shard = flat[r * layout.shard_numel : (r + 1) * layout.shard_numel]
        shard_ops.add_shard_noise_(shard, layout, r, 0.7, 99, 3)
    assert torch.equal(_gather_global(flat, layout, start, ref.numel()), ref)
    owned = sorted(
        (run.global_offset, run.length) for r in range(world_size) for run in layout.runs_for_rank(r)
    )
    covered = [g + k for g, n in owned for k in range(n)]
    assert covered == list(range(start, start + ref.numel()))  # each coordinate exactly once


def _rank_main(rank, world_size, params, seed, step, std):
    layout = shard_ops.UnitLayout(params, world_size, alignment=2)
    shard = torch.zeros(layout.shard_numel)
    shard_ops.add_shard_noise_(shard, layout, rank, std, seed, step)
    flat = torch.empty(layout.padded_numel)
    dist.all_gather_into_tensor(flat, shard)
    return flat


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_ranks_reproduce_single_process_noise(tmp_path, world_size):
    params = [(101, 0), (64, 101), (7, 165)]
    flat = ranks.spawn(_rank_main, world_size, tmp_path, params, 2024, 17, 1.3)[0]
    layout = shard_ops.UnitLayout(params, world_size, alignment=2)
    ref, start = _full_noise(params, seed=2024, step=17, std=1.3)
    assert torch.equal(_gather_global(flat, layout, start, ref.numel()), ref)


def _optimal_capacity(sizes, bins):
    """Brute force: the smallest largest group over every split of `sizes` (in order) into at
    most `bins` contiguous groups."""
    best = sum(sizes)
    n = len(sizes)
    for cuts in itertools.combinations(range(1, n), min(bins - 1, n - 1)):
        bounds = (0,) + cuts + (n,)
        best = min(best, max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("alignment", [1, 4])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ragged_plan_keeps_parameters_whole_with_the_smallest_shards(world_size, alignment):
    # Note [ragged plans]: every parameter inside one rank's shard, shards as small as any
    # contiguous split allows (brute force over all splits), coverage checked by ShardPlan.
    rng = random.Random(world_size * 10 + alignment)
    for _ in range(30):
        numels = [rng.choice([0, 1, 3, 8, 17, 64, 100]) for _ in range(rng.randint(1, 7))]
        params, offset = [], 0
        for n in numels:
            params.append((n, offset))
            offset += n
        layout = shard_ops.UnitLayout(params, world_size, alignment=alignment,
                                   boundaries="parameters")
        m = layout.shard_numel
        assert layout.padded_numel == m * world_size
        for (n, _), start in zip(params, layout.flat_offsets):
            assert start % alignment == 0
            assert start // m == (start + max(n, 1) - 1) // m, (params, layout.flat_offsets)
        aligned = [(n + alignment - 1) // alignment * alignment for n in numels]
        best = _optimal_capacity(aligned, world_size)
        assert m == max(best, alignment), (numels, m, best)
        shard_ops.ShardPlan([layout], offset)  # covers [0, D) exactly once
    with pytest.raises(ValueError, match="must be 'even' or 'parameters', got 'blocks'"):
        shard_ops.UnitLayout([(4, 0)], 2, boundaries="blocks")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_union_of_shards_bitwise_on_each_device(device, dtype):
    # Twin of the CPU test body for every device present: shards vs one full tensor, same device.
    params = [(1000, 0), (333, 1000), (4097, 1333)]
    total = sum(n for n, _ in params)
    ref = torch.zeros(total, dtype=dtype, device=device)
    torch.ops.dpzero.add_noise_(ref, 1.0, 77, 5, 0)
    for world_size in (2, 3, 8):
        layout = shard_ops.UnitLayout(params, world_size, alignment=8)
        flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        for r in range(world_size):
            shard_ops.add_shard_noise_(flat[r * layout.shard_numel:(r + 1) * layout.shard_numel],
                                    layout, r, 1.0, 77, 5)
        got = torch.empty_like(ref)
        for run in layout.runs():
            got[run.global_offset:run.global_offset + run.length] = flat[
                run.local_offset:run.local_offset + run.length]
        assert torch.equal(got, ref)


SECURE_KEY = [0xDEADBEEF, 1, 2, 3, 4, 5, 6, 0xFFFFFFFF]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_secure_union_of_shards_bitwise_on_each_device(device, dtype):
    # The secure twin of test_union_of_shards_bitwise_on_each_device: shards vs one full tensor on
    # the same device, every coordinate drawn once (a second draw would add z again), padding 0.
    params = [(1000, 0), (333, 1000), (4097, 1333)]
    total = sum(n for n, _ in params)
    ref = torch.zeros(total, dtype=dtype, device=device)
    torch.ops.dpzero.add_secure_noise_(ref, 1.0, SECURE_KEY, 5, 0)
    for world_size in (2, 3, 8):
        layout = shard_ops.UnitLayout(params, world_size, alignment=8)
        flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        for r in range(world_size):
            shard_ops.add_shard_noise_(flat[r * layout.shard_numel:(r + 1) * layout.shard_numel],
                                       layout, r, 1.0, SECURE_KEY, 5)
        got = torch.empty_like(ref)
        is_param = torch.zeros(layout.padded_numel, dtype=torch.bool, device=device)
        for run in layout.runs():
            got[run.global_offset:run.global_offset + run.length] = flat[
                run.local_offset:run.local_offset + run.length]
            is_param[run.local_offset:run.local_offset + run.length] = True
        assert torch.equal(got, ref)
        assert torch.count_nonzero(flat[~is_param]) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("secure", [False, True], ids=["philox", "secure"])
def test_noise_runs_are_the_per_run_draws(device, secure):
    # Note [noise launches]: one call over a table of runs (gaps, an empty run, global offsets out
    # of order and past 2^32, more runs than one CUDA launch takes) is the per-run calls, bit for
    # bit, and leaves the elements between runs alone.
    rng = random.Random(5)
    runs, local = [], 1
    for r in range(300):
        length = 0 if r == 7 else rng.randint(1, 30)
        runs.append((local, length, rng.randrange(1 << 34)))
        local += length + rng.randint(0, 3)
    x = torch.randn(local + 2, dtype=torch.float32).to(device)
    batched, per_run = x.clone(), x.clone()
    flat = [v for run in runs for v in run]
    if secure:
        torch.ops.dpzero.add_secure_noise_runs_(batched, 0.5, SECURE_KEY, 4, flat)
    else:
        torch.ops.dpzero.add_noise_runs_(batched, 0.5, 8, 4, flat)
    for loc, length, glob in runs:
        piece = per_run[loc:loc + length]
        if secure:
            torch.ops.dpzero.add_secure_noise_(piece, 0.5, SECURE_KEY, 4, glob)
        else:
            torch.ops.dpzero.add_noise_(piece, 0.5, 8, 4, glob)
    assert torch.equal(batched, per_run)
    with pytest.raises(RuntimeError, match=r"run 1 \(local 2, length 3\) overlaps"):
        torch.ops.dpzero.add_noise_runs_(x, 1.0, 0, 0, [0, 4, 0, 2, 3, 10])
    # Disjoint in x, one global coordinate twice: the same draw on two elements would cancel in
    # their difference.
    with pytest.raises(RuntimeError,
                       match=r"runs 0 \(global 10, length 3\) and 1 \(global 12, length 2\) share"):
        torch.ops.dpzero.add_noise_runs_(x, 1.0, 0, 0, [0, 3, 10, 5, 2, 12])


@pytest.mark.gpu
@pytest.mark.skipif("cuda" not in DEVICES, reason="no CUDA device or CUDA kernels not built")
def test_cuda_noise_matches_cpu_to_float_ulps():
    # Note [cuda noise draw] in kernels/cuda/noise.cu: within 1e-5 (1 + |z|).
    x_cpu = torch.zeros(1 << 16)
    x_gpu = torch.zeros(1 << 16, device="cuda")
    torch.ops.dpzero.add_noise_(x_cpu, 1.0, 3, 9, 123)
    torch.ops.dpzero.add_noise_(x_gpu, 1.0, 3, 9, 123)
    torch.testing.assert_close(x_gpu.cpu(), x_cpu, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif("cuda" not in DEVICES, reason="no CUDA device or CUDA kernels not built")
def test_cuda_secure_noise_matches_cpu_to_double_ulps():
    # kernels/cuda/secure_noise.cu: within 1e-9 (1 + |z|) (a few fp64 ulps but at tiny radii).
    x_cpu = torch.zeros(1 << 16, dtype=torch.float64)
    x_gpu = torch.zeros(1 << 16, dtype=torch.float64, device="cuda")
    torch.ops.dpzero.add_secure_noise_(x_cpu, 1.0, SECURE_KEY, 9, 123)
    torch.ops.dpzero.add_secure_noise_(x_gpu, 1.0, SECURE_KEY, 9, 123)
    torch.testing.assert_close(x_gpu.cpu(), x_cpu, rtol=1e-9, atol=1e-9)


def _secure_key_rank(rank, world_size, store, out_dir):
    import dpzero.zero
    from dpzero.noise import NoiseSource

    group = dpzero.zero.new_process_group("gloo", f"file://{store}", rank, world_size)
    torch.save(NoiseSource(secure_mode=True, group=group).key,
               os.path.join(out_dir, f"key{rank}.pt"))


@pytest.mark.multirank
def test_secure_key_is_rank_0s_over_a_group_made_without_torch_distributed(tmp_path):
    """Secure mode over a process group from dpzero.zero.new_process_group (torch.distributed
    not initialised): every rank holds rank 0's key, so every rank draws the same noise."""
    mp.spawn(_secure_key_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2,
             join=True)
    keys = [torch.load(tmp_path / f"key{r}.pt") for r in range(2)]
    assert len(keys[0]) == 8 and keys[0] == keys[1]
