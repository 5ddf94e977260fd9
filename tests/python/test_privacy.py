"""privacy/: statistical tests of the noise generators, the Poisson sampler and clipping.

Thresholds: each check fails for a correct generator with probability < 1e-6 (two-sided normal
bounds at z = 5.33, P = 1e-7; the Kolmogorov–Smirnov bound from the DKW inequality
P(D > x) <= 2 exp(-2 n x^2); chi-square quantiles computed with mpmath).
"""

import math

import mpmath
import pytest
import torch

import ranks
from dpzero._C import privacy
from dpzero.data import PoissonBatchSampler, dp_data_loader

N_DRAWS = 10_000_000
Z = 5.33  # two-sided normal tail 1e-7


def _draws(kind, step=3, n=N_DRAWS, offset=0):
    x = torch.zeros(n, dtype=torch.float64 if kind == "secure" else torch.float32)
    if kind == "secure":
        torch.ops.dpzero.add_secure_noise_(x, 1.0, list(range(1, 9)), step, offset)
    else:
        torch.ops.dpzero.add_noise_(x, 1.0, 2024, step, offset)
    return x.double()


@pytest.fixture(scope="module", params=["philox", "secure"])
def draws(request):
    return request.param, _draws(request.param)


def test_mean_and_variance(draws):
    kind, z = draws
    n = z.numel()
    assert abs(z.mean().item()) < Z / math.sqrt(n), kind
    assert abs(z.var().item() - 1.0) < Z * math.sqrt(2.0 / n), kind


def test_kolmogorov_smirnov_against_standard_normal(draws):
    kind, z = draws
    n = z.numel()
    s, _ = torch.sort(z)
    cdf = torch.special.ndtr(s)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = torch.maximum(i / n - cdf, cdf - (i - 1) / n).max().item()
    bound = math.sqrt(math.log(2 / 1e-7) / (2 * n))  # DKW: P(D > bound) <= 1e-7
    assert d < bound, (kind, d, bound)


def test_no_correlation_between_neighbours_or_steps(draws):
    kind, z = draws
    for lag in (1, 2, 3, 4, 5):  # within and across Philox / ChaCha blocks
        r = (z[:-lag] * z[lag:]).mean().item()
        assert abs(r) < Z / math.sqrt(z.numel() - lag), (kind, lag, r)
    nxt = _draws(kind, step=4, n=2_000_000)
    r = (z[:2_000_000] * nxt).mean().item()
    assert abs(r) < Z / math.sqrt(2_000_000), (kind, "consecutive steps", r)


def test_secure_noise_shards_union_bitwise_and_key_checks():
    key = privacy.entropy_key()
    assert len(key) == 8 and all(0 <= w < 2**32 for w in key)
    assert privacy.entropy_key() != key
    full = torch.zeros(1001, dtype=torch.float64)
    torch.ops.dpzero.add_secure_noise_(full, 0.5, key, 9, 40)
    for cut in (1, 2, 3, 500, 1000):
        a = torch.zeros(cut, dtype=torch.float64)
        b = torch.zeros(1001 - cut, dtype=torch.float64)
        torch.ops.dpzero.add_secure_noise_(a, 0.5, key, 9, 40)
        torch.ops.dpzero.add_secure_noise_(b, 0.5, key, 9, 40 + cut)
        assert torch.equal(torch.cat([a, b]), full)
    with pytest.raises(RuntimeError, match="8 words"):
        torch.ops.dpzero.add_secure_noise_(full, 1.0, key[:7], 0, 0)
    with pytest.raises(RuntimeError, match="got -1"):
        torch.ops.dpzero.add_secure_noise_(full, 1.0, [-1] + key[1:], 0, 0)


# ---- Poisson sampler ------------------------------------------------------------------------------

def _chi2_quantile(df, tail=1e-6):
    """x with P(chi2_df > x) = tail, by bisection on mpmath's regularised upper gamma."""
    lo, hi = 0.0, df + 200.0 + 20 * math.sqrt(df)
    for _ in range(200):
        mid = (lo + hi) / 2
        if mpmath.gammainc(df / 2, mid / 2, mpmath.inf, regularized=True) > tail:
            lo = mid
        else:
            hi = mid
    return hi


def test_batch_sizes_follow_binomial():
    n, q, steps = 1000, 0.05, 3000
    sizes = [len(privacy.poisson_logical_batch(77, t, n, q)) for t in range(steps)]
    pmf = [math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(n + 1)]
    # Bins with expected count >= 5; the two tails pooled into the end bins.
    bins, acc_p, edges = [], 0.0, []
    for k in range(n + 1):
        acc_p += pmf[k]
        if acc_p * steps >= 5 and (1 - sum(pmf[: k + 1])) * steps >= 5:
            bins.append(acc_p)
            edges.append(k)
            acc_p = 0.0
    bins.append(acc_p)
    edges.append(n)
    observed = [0] * len(bins)
    for s in sizes:
        observed[next(i for i, e in enumerate(edges) if s <= e)] += 1
    chi2 = sum((o - p * steps) ** 2 / (p * steps) for o, p in zip(observed, bins))
    assert chi2 < _chi2_quantile(len(bins) - 1), chi2


def test_inclusion_independent_across_examples_and_steps():
    n, q, steps = 4000, 0.3, 300
    ind = torch.zeros(steps, n, dtype=torch.float64)
    for t in range(steps):
        ind[t, privacy.poisson_logical_batch(5, t, n, q)] = 1.0
    x = (ind - q) / math.sqrt(q * (1 - q))  # standardised indicators
    assert abs(x.mean().item()) < Z / math.sqrt(x.numel())
    r_examples = (x[:, :-1] * x[:, 1:]).mean().item()
    r_steps = (x[:-1] * x[1:]).mean().item()
    assert abs(r_examples) < Z / math.sqrt(steps * (n - 1)), r_examples
    assert abs(r_steps) < Z / math.sqrt((steps - 1) * n), r_steps


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_union_over_ranks_equals_single_process_sample(world_size):
    n, q, steps, m = 503, 0.1, 20, 7
    samplers = [PoissonBatchSampler(n, q, steps, seed=11, rank=r, world_size=world_size,
                                    max_physical_batch_size=m) for r in range(world_size)]
    for t in range(steps):
        schedules = [s.schedule(t) for s in samplers]
        counts = {len(sc.micro_batches) for sc in schedules}
        assert len(counts) == 1  # all ranks agree on the micro-batch count
        union = sorted(k for sc in schedules for mb in sc.micro_batches for k in mb)
        assert union == privacy.poisson_logical_batch(11, t, n, q)
        assert all(len(mb) <= m for sc in schedules for mb in sc.micro_batches)


def test_data_loader_yields_schedule_and_shaped_empty_batches():
    data = torch.utils.data.TensorDataset(torch.randn(50, 3), torch.arange(50))
    loader = dp_data_loader(data, sample_rate=0.02, steps=40, seed=3, max_physical_batch_size=2)
    sampler = loader.batch_sampler
    expected = [mb for _, sc in sampler.logical_batches() for mb in sc.micro_batches]
    got = list(loader)
    assert len(got) == len(expected)
    saw_empty = False
    for (x, y), idx in zip(got, expected):
        assert y.tolist() == idx
        assert x.shape == (len(idx), 3)
        saw_empty |= len(idx) == 0
    assert saw_empty  # q·N = 1: some of 40 steps are empty (P(no empty step) ~ 1e-6)


def test_the_samplers_length_is_the_expected_count_whatever_the_batches():
    """len() of the sampler (and so of a loader over it) depends on q, N, the steps, the ranks
    and the cap only: the realised micro-batch count followed the sampled batch sizes, and a
    review read one example's membership off len(p.data_loader) under add/remove neighbours."""
    n, q, steps, m = 200, 0.05, 20, 2
    lengths, realised = set(), set()
    for seed in range(12):
        sampler = PoissonBatchSampler(n, q, steps, seed, max_physical_batch_size=m)
        lengths.add(len(sampler))
        realised.add(sum(1 for _ in sampler))
    assert lengths == {steps * math.ceil(q * n / m)}  # 5 micro-batches a step of 10 rows
    assert len(realised) > 1  # the realised counts do differ between seeds
    two_ranks = PoissonBatchSampler(n, q, steps, 0, rank=1, world_size=2, max_physical_batch_size=m)
    assert len(two_ranks) == steps * math.ceil(q * n / 2 / m)
    assert len(PoissonBatchSampler(n, q, steps, 0)) == steps  # no cap: one a step


def test_sampler_rejects_bad_values_naming_them():
    with pytest.raises(ValueError, match="1.5"):
        PoissonBatchSampler(10, 1.5, 3, seed=0)
    with pytest.raises(ValueError, match="got 5"):
        PoissonBatchSampler(10, 0.1, 3, seed=0, rank=5, world_size=2)
    with pytest.raises(ValueError, match="got 0"):
        PoissonBatchSampler(10, 0.1, 3, seed=0, max_physical_batch_size=0)


# ---- clipping policies --------------------------------------------------------------------------

def test_clip_factors_op_matches_formulas_and_counts_invalid_norms():
    norms = torch.tensor([0.0, 0.5, 1.0, 3.0, float("nan"), float("inf"), 1e6, -0.5])
    f, bad = torch.ops.dpzero.clip_factors(norms, 1.0, "flat")
    n64 = norms.double()
    expected = torch.clamp(1.0 / (n64 + 1e-6), max=1.0)
    expected[4:6] = 0.0
    expected[7] = 0.0
    torch.testing.assert_close(f.double(), expected, rtol=2e-7, atol=0)
    assert bad.item() == 3  # NaN, inf, negative
    f, _ = torch.ops.dpzero.clip_factors(norms, 2.0, "automatic", 0.01)
    expected = 2.0 / (n64 + 0.01)
    expected[4:6] = 0.0
    expected[7] = 0.0
    torch.testing.assert_close(f.double(), expected, rtol=2e-7, atol=0)


def test_clip_factors_bound_each_sample_by_C_exactly():
    torch.manual_seed(0)
    norms = torch.exp2(torch.empty(200_000, dtype=torch.float64).uniform_(-20, 40)).float()
    for mode in ("flat", "automatic"):
        f, _ = torch.ops.dpzero.clip_factors(norms, 1.5, mode)
        assert (norms.double() * f.double() <= 1.5).all(), mode
    with pytest.raises(RuntimeError, match="'ghost'"):
        torch.ops.dpzero.clip_factors(norms, 1.0, "ghost")
    with pytest.raises(RuntimeError, match="got -1"):
        torch.ops.dpzero.clip_factors(norms, -1.0, "flat")


def test_group_thresholds():
    t = privacy.group_thresholds(3.0, 3)
    assert sum(c * c for c in t) == pytest.approx(9.0)
    t = privacy.group_thresholds(1.0, 2, [1.0, 3.0])
    assert t[1] / t[0] == pytest.approx(math.sqrt(3.0))
    with pytest.raises(ValueError, match="-2"):
        privacy.group_thresholds(1.0, 2, [1.0, -2.0])


# ---- secure mode end to end: NoiseSource and the sampler ---------------------------------------

def _secure_rank(rank, world_size):
    import torch.distributed as dist

    from dpzero.noise import NoiseSource

    src = NoiseSource(secure_mode=True)  # every rank draws entropy; rank 0's key wins
    x = torch.zeros(10, dtype=torch.float64)
    src.add_(x, 1.0, 0, 10 * rank)  # rank r owns coordinates [10r, 10r + 10)
    parts = [torch.zeros(10, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(parts, x)
    return {"noise": torch.cat(parts), "key": src.sampler_seed}


@pytest.mark.multirank
def test_secure_key_is_shared_by_all_ranks(tmp_path):
    saved = ranks.spawn(_secure_rank, 3, tmp_path)[0]
    ref = torch.zeros(30, dtype=torch.float64)
    torch.ops.dpzero.add_secure_noise_(ref, 1.0, saved["key"], 0, 0)
    assert torch.equal(saved["noise"], ref)  # one key, so the shards form one noise vector


def test_secure_sampler_differs_from_philox_and_partitions():
    from dpzero.noise import NoiseSource

    src = NoiseSource(secure_mode=True)
    key = src.sampler_seed
    assert len(key) == 8 and src.seed is None
    batch = privacy.poisson_logical_batch(key, 4, 2000, 0.05)
    union = sorted(k for r in range(2) for mb in PoissonBatchSampler(
        2000, 0.05, 1, seed=key, rank=r, world_size=2, start_step=4).schedule(4).micro_batches
        for k in mb)
    assert union == batch
    assert privacy.sampler_uniform(key, 4, 7) != privacy.sampler_uniform(12345, 4, 7)
    default = NoiseSource(seed=2**64 - 1)
    x = torch.zeros(8)
    default.add_(x, 1.0, 0, 0)
    y = torch.zeros(8)
    torch.ops.dpzero.add_noise_(y, 1.0, -1, 0, 0)  # the same 64 bits as int64
    assert torch.equal(x, y)
