"""The model's and the data's own random draws under a private run (Note [the model's own
randomness] in private/generators.py): keyed by the run's secret, never by torch's public seed.

A privacy review moved one step's clipped sum 3.6 times its bound 2C by replacing one example
with a longer one: with dynamic padding and dropout, every later example's mask shifted, and the
masks were a known function of torch.manual_seed and the step index. The clipping argument holds
only while the draws are unknown to whoever sees the release, so these tests ask where the draws
come from: a secure run's differ from another's with the same torch seed; a seeded run's follow
its own seed and nothing else (not torch's seed, not a generator state set between steps, as a
checkpoint's load sets it); DataLoader workers draw from the run's secret, numpy too, and not
all alike.
"""

from __future__ import annotations

import random

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpzero
from dpzero.private.generators import RunGenerators

D, K, N = 4, 3, 24


class _Draws(nn.Module):
    """Records one torch draw per forward on a micro-batch of the loader (dropout's source); the
    provenance probe's forwards restore the generator, so they are not told apart."""

    def __init__(self):
        super().__init__()
        self.fc, self.seen = nn.Linear(D, K), []

    def forward(self, x):
        self.seen.append(float(torch.rand(())))
        return self.fc(x)


class _Fetched(torch.utils.data.Dataset):
    """Each fetch draws once from torch, Python's random and numpy (an augmentation's sources)."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(N, D, generator=g), torch.randint(0, K, (N,), generator=g)

    def __len__(self):
        return N

    def __getitem__(self, i):
        draws = torch.tensor([float(torch.rand(())), random.random(), numpy.random.rand()])
        return self.x[i], self.y[i], draws


def _run(torch_seed, seed=None, steps=3, num_workers=0, between=None):
    """The model's draws and the fetched examples' draws over ``steps`` steps of a run (seeded
    with ``seed``, else secure), torch, Python and numpy seeded with ``torch_seed`` first;
    ``between(step)`` runs after each step."""
    torch.manual_seed(torch_seed)
    random.seed(torch_seed)
    numpy.random.seed(torch_seed)
    model = _Draws()
    p = dpzero.make_private(model, dataset=_Fetched(), sample_rate=0.25, noise_multiplier=1.0,
                            max_grad_norm=1.0, seed=seed, num_workers=num_workers)
    fetched = []
    while p.privacy_engine.steps_taken < steps:
        for x, y, draws in p.data_loader:
            fetched.append(draws)
            F.cross_entropy(p.model(x), y).backward()
            if p.optimizer.step():
                if between is not None:
                    between(p.privacy_engine.steps_taken)
                if p.privacy_engine.steps_taken == steps:
                    break
    return model.seen, torch.cat(fetched)


def test_a_secure_runs_draws_are_not_those_of_torchs_seed():
    """Two secure runs after torch.manual_seed(0): the model's draws and the augmentations'
    differ at every step (they were equal: a function of the public seed and the step)."""
    seen_a, fetched_a = _run(0)
    seen_b, fetched_b = _run(0)
    assert len(seen_a) >= 3 and len(seen_b) >= 3
    assert all(a != b for a, b in zip(seen_a, seen_b))
    n = min(len(fetched_a), len(fetched_b))
    assert (fetched_a[:n] != fetched_b[:n]).all()


def test_a_seeded_runs_draws_follow_its_seed_and_not_torchs():
    """The same dpzero seed under two torch seeds gives the same draws (reproducible from the
    run's seed alone, which is as secret as its noise); another dpzero seed gives others."""
    seen_a, fetched_a = _run(0, seed=3)
    seen_b, fetched_b = _run(1, seed=3)
    assert seen_a == seen_b and torch.equal(fetched_a, fetched_b)
    seen_c, fetched_c = _run(0, seed=4)
    assert all(a != c for a, c in zip(seen_a, seen_c))


def test_the_state_between_steps_reaches_no_later_step():
    """What a checkpoint saves between steps (and what its load sets) is not what the next
    step draws from: generators set to a known state after each step change nothing."""
    def known(step):
        torch.manual_seed(123)
        random.seed(123)
        numpy.random.seed(123)

    seen_a, fetched_a = _run(0, seed=3)
    seen_b, fetched_b = _run(0, seed=3, between=known)
    assert seen_a == seen_b and torch.equal(fetched_a, fetched_b)


def test_workers_draw_from_the_runs_secret_each_its_own():
    """With DataLoader workers, the augmentations' draws come from the run's secret (two secure
    runs after the same torch and numpy seeds differ), and numpy's differ between workers (torch
    leaves numpy's forked state the same in every worker)."""
    _, fetched_a = _run(0, steps=2, num_workers=2)
    _, fetched_b = _run(0, steps=2, num_workers=2)
    n = min(len(fetched_a), len(fetched_b))
    assert (fetched_a[:n] != fetched_b[:n]).all()
    # Every example's numpy draw is distinct: two workers forked alike would repeat each other's.
    assert len(set(fetched_a[:, 2].tolist())) == len(fetched_a)


def test_the_seeds_are_keyed_by_purpose_rank_and_step():
    """RunGenerators.seed: a function of (secret, purpose, rank, step), different for each
    change of one of them; an unknown purpose is refused, naming it."""
    g = RunGenerators(3, rank=0)
    seeds = {g.seed(p, t) for p in (b"fetch", b"forward", b"iter", b"between") for t in range(4)}
    seeds |= {RunGenerators(3, rank=1).seed(b"fetch", 0), RunGenerators(4, rank=0).seed(b"fetch", 0),
              RunGenerators([3] * 8, rank=0).seed(b"fetch", 0)}
    assert len(seeds) == 19 and all(0 <= s < 2 ** 63 for s in seeds)
    assert RunGenerators(3, rank=0).seed(b"forward", 2) == g.seed(b"forward", 2)
    with pytest.raises(ValueError, match="purpose must be one of .* got b'dropout'"):
        g.seed(b"dropout", 0)
