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
import subprocess
import sys

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpzero
from dpzero.private.generators import RunGenerators
from philox_reference import chacha20_block

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


def _reference_words(key, nonce):
    """The reseed's words written from RFC 8439's block function (philox_reference's own
    ChaCha20): blocks 0..39 under ``key`` at ``nonce``."""
    return [w for block in range(40) for w in chacha20_block(list(key), block, list(nonce))]


def test_a_reseed_sets_the_whole_twister_state_from_chacha20_of_the_runs_key():
    """Note [the model's own randomness] (src/dp/generators.h): the generator key is ChaCha20 of
    the run's seed at the generator stream; a reseed's words are ChaCha20 under it at (purpose
    and rank, step, micro-batch). torch's draws equal an independent MT19937 (numpy's) keyed
    with the 624 words, not what a 32-bit seed gives (torch's manual_seed keeps 32 bits: a review
    found two steps of one run drawing the same stream); numpy draws from the eight extra
    words; each of purpose, rank, step and micro-batch moves the words."""
    seed = 0x1234_5678_9ABC
    g = RunGenerators(seed, rank=1)
    want_key = chacha20_block([seed & 0xFFFFFFFF, seed >> 32, 0, 0, 0, 0, 0, 0], 0,
                              [0, 0, 0x67656E73])[:8]
    assert g.key == want_key
    g.reseed("forward", 2, 3)
    got = torch.rand(16, dtype=torch.float32)
    numpy_got = numpy.random.rand()
    words = _reference_words(want_key, [(3 << 24) | 1, 2, 3])
    twister = numpy.random.MT19937()
    twister.state = {"bit_generator": "MT19937",
                     "state": {"key": numpy.array(words[:624], dtype=numpy.uint32), "pos": 624}}
    raw = twister.random_raw(16)
    assert torch.equal(got, torch.tensor((raw & 0xFFFFFF) * 2.0 ** -24, dtype=torch.float32))
    assert numpy_got == numpy.random.RandomState(numpy.array(words[626:634],
                                                             dtype=numpy.uint32)).rand()
    torch.manual_seed((((words[625] << 32) | words[624]) >> 1) & 0xFFFFFFFF)
    assert not torch.equal(torch.rand(16), got)  # what a 32-bit seed would have drawn
    firsts = set()
    for purpose, rank, step, index in [("forward", 1, 2, 3), ("fetch", 1, 2, 3),
                                       ("forward", 0, 2, 3), ("forward", 1, 3, 3),
                                       ("forward", 1, 2, 4)]:
        RunGenerators(seed, rank).reseed(purpose, step, index)
        firsts.add(float(torch.rand(())))
    assert len(firsts) == 5
    with pytest.raises(ValueError, match="purpose must be one of .* got 'dropout'"):
        g.reseed("dropout", 0)


class _States(nn.Module):
    """Records its draw in each forward on a loader batch (dropout's source) and the CPU
    generator's state after it."""

    def __init__(self):
        super().__init__()
        self.fc, self.draws, self.states = nn.Linear(D, K), [], []

    def forward(self, x):
        self.draws.append(float(torch.rand(())))
        self.states.append(torch.get_rng_state())
        return self.fc(x)


def _released_states(save_at, tmp_path):
    """A seeded run of two steps whose first step is dropped once after its first micro-batch;
    ``save_at`` names where a checkpoint is saved ("handed": after a hand-out, before the
    forward; "backward": after a micro-batch's backward; "dropped": after the drop; None: no
    save). Returns ((the states the released steps' forwards passed through, their draws),
    (the checkpoint's path, its saved CPU state), the private bundle)."""
    torch.manual_seed(0)
    model = _States()
    data = torch.utils.data.TensorDataset(torch.randn(N, D), torch.randint(0, K, (N,)))
    p = dpzero.make_private(model, dataset=data, sample_rate=0.5, noise_multiplier=1.0,
                            max_grad_norm=1.0, seed=5, max_physical_batch_size=4)
    saved = []

    def save(where):
        if where == save_at:  # the saved state is the hook's (checked against the file below)
            saved.append(dpzero.checkpoint.save(p.privacy_engine.sharded, tmp_path / where,
                                                step=0))
            saved.append(p.privacy_engine.sharded.rng_states()["cpu"])

    it = iter(p.data_loader)
    x, y = next(it)
    save("handed")
    F.cross_entropy(p.model(x), y).backward()
    save("backward")
    p.optimizer.zero_grad()  # dropped: the loader hands step 0 out again
    save("dropped")
    model.states.clear()
    model.draws.clear()
    while p.privacy_engine.charges < 2:
        for x, y in p.data_loader:
            F.cross_entropy(p.model(x), y).backward()
            if p.optimizer.step() and p.privacy_engine.charges == 2:
                break
    return (model.states, model.draws), saved, p


@pytest.mark.parametrize("save_at", ["handed", "backward", "dropped"])
def test_a_checkpoint_holds_no_generator_state_a_released_step_draws_from(save_at, tmp_path):
    """A checkpoint saved after a micro-batch was handed out held the state its dropout then drew
    from; one saved after a dropped batch, the state the batch drew from when handed out again
    and released (a review regenerated both steps' dropout from it). A private model's
    checkpoint now saves the states of purpose "saved", which nothing draws from, and leaves the
    live ones as they were: the released draws are those of a run that saved nothing."""
    (released, draws), (path, state), p = _released_states(save_at, tmp_path)
    (_, plain), _, _ = _released_states(None, tmp_path / "plain")
    assert draws and draws == plain  # the save left the live states as they were
    assert not any(torch.equal(state, s) for s in released)
    assert float(_draw_after(state)) not in draws  # what a loaded checkpoint would draw
    dpzero.checkpoint.load(p.privacy_engine.sharded, path)  # between steps: restores it
    assert torch.equal(torch.get_rng_state(), state)
    p.privacy_engine.detach()  # a plain model's checkpoint saves the live state
    live = torch.get_rng_state()
    path = dpzero.checkpoint.save(p.privacy_engine.sharded, tmp_path / "detached", step=9)
    torch.manual_seed(1)
    dpzero.checkpoint.load(p.privacy_engine.sharded, path)
    assert torch.equal(torch.get_rng_state(), live)


def _draw_after(state):
    g = torch.Generator()
    g.set_state(state)
    return torch.rand((), generator=g)


def test_a_private_loader_with_workers_runs_under_spawn(tmp_path):
    """DataLoader workers started by spawn (macOS's and Windows's default, forkserver Linux's
    from Python 3.14) are handed the collate function and the worker seeding by pickling: the
    default collate was a closure and the loader died before its first batch."""
    script = tmp_path / "spawn.py"
    script.write_text(
        "import torch, torch.nn.functional as F, dpzero\n"
        "if __name__ == '__main__':\n"
        "    torch.multiprocessing.set_start_method('spawn')\n"
        "    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))\n"
        "    data = torch.utils.data.TensorDataset(x, y)\n"
        "    p = dpzero.make_private(torch.nn.Linear(4, 3), dataset=data, sample_rate=0.5,\n"
        "                            noise_multiplier=1.0, max_grad_norm=1.0, num_workers=1)\n"
        "    for x, y in p.data_loader:\n"
        "        F.cross_entropy(p.model(x), y).backward()\n"
        "        if p.optimizer.step():\n"
        "            break\n"
        "    print('charges', p.privacy_engine.charges)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "charges 1" in done.stdout


class _CudaDraws(nn.Module):
    """Records one CUDA draw per forward (dropout on a GPU draws from the CUDA generator)."""

    def __init__(self):
        super().__init__()
        self.fc, self.seen = nn.Linear(D, K), []

    def forward(self, x):
        self.seen.append(float(torch.rand((), device=x.device)))
        return self.fc(x)


def _cuda_draws(torch_seed, seed=None):
    torch.manual_seed(torch_seed)
    model = _CudaDraws().cuda()
    data = torch.utils.data.TensorDataset(torch.randn(N, D), torch.randint(0, K, (N,)))
    p = dpzero.make_private(model, dataset=data, sample_rate=0.25, noise_multiplier=1.0,
                            max_grad_norm=1.0, seed=seed)
    while p.privacy_engine.steps_taken < 2:
        for x, y in p.data_loader:
            F.cross_entropy(p.model(x.cuda()), y.cuda()).backward()
            if p.optimizer.step() and p.privacy_engine.steps_taken == 2:
                break
    return model.seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_follow_the_runs_secret_not_torchs_seed():
    """The CUDA generator (dropout's on a GPU) is keyed by the run's secret too: two secure runs
    after torch.manual_seed(0) draw differently, a seeded run alike under any torch seed."""
    a, b = _cuda_draws(0), _cuda_draws(0)
    assert a and all(x != y for x, y in zip(a, b))
    assert _cuda_draws(0, seed=3) == _cuda_draws(1, seed=3)
