"""Opacus's whole PrivacyEngine signature, switched by its import (Note [Opacus's arguments] in
python/dpzero/private/opacus_entry.py): grad_sample_mode (and "ghost"'s criterion), noise_generator,
wrap_model, the arguments refused, save_checkpoint / load_checkpoint. References: a per-example
autograd loop (private_reference.clipped_step_by_example), per-example losses computed one example
at a time, and an uninterrupted run of the same seed."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpzero import PrivacyEngine
from dpzero.private.opacus_entry import PrivateCriterion

from private_reference import clipped_step_by_example

N, BATCH = 96, 24


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _loader():
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g))
    return DataLoader(data, batch_size=BATCH)


def _first_step(grad_sample_mode, **kwargs):
    """An Opacus script's first step (the criterion make_private returns under "ghost", else
    F.cross_entropy); returns (the model before, the model after, the step's inputs, targets)."""
    model = _model()
    before = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    out = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=_loader(), noise_multiplier=0.0,
        max_grad_norm=0.05, grad_sample_mode=grad_sample_mode, allow_no_noise=True,
        noise_generator=torch.Generator().manual_seed(7), **kwargs)
    if grad_sample_mode == "ghost":
        model, optimizer, criterion, loader = out
    else:
        (model, optimizer, loader), criterion = out, F.cross_entropy
    xs, ys = [], []
    for x, y in loader:
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        xs.append(x)
        ys.append(y)
        if optimizer.step():
            break
    return before, model, torch.cat(xs), torch.cat(ys)


@pytest.mark.parametrize("grad_sample_mode", ["hooks", "functorch", "ew", "ghost"])
def test_every_grad_sample_mode_steps_as_a_per_example_loop(grad_sample_mode):
    before, model, x, y = _first_step(grad_sample_mode)
    assert len(x) > 0
    expected = clipped_step_by_example(before, x.as_subclass(torch.Tensor).double(),
                                       y.as_subclass(torch.Tensor), max_grad_norm=0.05, lr=0.5,
                                       expected_batch=BATCH, must_clip=True)
    for name, p in model.state_dict().items():
        torch.testing.assert_close(p.double(), expected[name], rtol=1e-5, atol=1e-6)


def test_ghost_mode_returns_the_criterion_as_opacus_does():
    model = _model()
    out = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(), data_loader=_loader(), noise_multiplier=1.0,
        max_grad_norm=1.0, grad_sample_mode="ghost")
    assert len(out) == 4 and isinstance(out[2], PrivateCriterion)
    plain = _model()
    assert len(PrivacyEngine().make_private(
        module=plain, optimizer=torch.optim.SGD(plain.parameters(), lr=0.1),
        data_loader=_loader(), noise_multiplier=1.0, max_grad_norm=1.0)) == 3


def test_the_ghost_criterion_gives_each_example_its_own_loss():
    g = torch.Generator().manual_seed(3)
    logits, targets = torch.randn(5, 4, generator=g), torch.tensor([0, 3, 1, 1, 2])
    weight = torch.tensor([1.0, 2.0, 0.5, 3.0])
    ce = nn.CrossEntropyLoss(weight=weight)
    by_example = torch.stack([F.cross_entropy(logits[i:i + 1], targets[i:i + 1], weight=weight,
                                              reduction="sum") for i in range(5)])
    torch.testing.assert_close(PrivateCriterion(ce, "mean")(logits, targets), by_example.mean())
    assert ce.reduction == "mean"  # put back after the call
    torch.testing.assert_close(
        PrivateCriterion(nn.CrossEntropyLoss(weight=weight, reduction="sum"), "sum")(
            logits, targets), by_example.sum())

    # shape=[B, T, V]: each sequence's loss is the mean over its own labelled tokens.
    B, T, V = 3, 5, 7
    seq_logits = torch.randn(B, T, V, generator=g)
    seq_targets = torch.randint(0, V, (B, T), generator=g)
    seq_targets[0, 3:] = -100
    seq_targets[2, 1:] = -100
    own = torch.stack([F.cross_entropy(seq_logits[i], seq_targets[i]) for i in range(B)])
    loss = PrivateCriterion(nn.CrossEntropyLoss(), "mean")(
        seq_logits.reshape(B * T, V), seq_targets.reshape(B * T), shape=(B, T, V))
    torch.testing.assert_close(loss, own.mean())

    # A criterion with several losses per row (MSELoss): each row's own mean, then the batch's.
    pred, goal = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    rows = torch.stack([F.mse_loss(pred[i], goal[i]) for i in range(4)])
    torch.testing.assert_close(PrivateCriterion(nn.MSELoss(), "mean")(pred, goal), rows.mean())

    with pytest.raises(ValueError, match="reduction='sum' but loss_reduction='mean'"):
        PrivateCriterion(nn.CrossEntropyLoss(reduction="sum"), "mean")


@pytest.mark.parametrize("argument, match", [
    (dict(batch_first=False), "batch_first=False"),
    (dict(grad_sample_mode="ghost_fsdp"), "dpzero shards the model itself"),
    (dict(grad_sample_mode="no_op"), "grad_sample_mode='no_op'"),
    (dict(grad_sample_mode="vmap"), "grad_sample_mode must be one of"),
    (dict(clipping="per_layer", max_grad_norm=[1.0, 1.0, 1.0, 1.0]), "clipping='per_layer'"),
    (dict(clipping="adaptive"), "clipping='adaptive'"),
    (dict(poisson_sampling=False), "poisson_sampling=False"),
    (dict(noise_generator=torch.Generator(), seed=3), "both noise_generator and seed=3"),
])
def test_what_dpzero_cannot_honour_is_refused_before_anything_is_touched(argument, match):
    model = _model()
    settings = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    data_loader=_loader(), noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match=match):
        PrivacyEngine().make_private(**{**settings, **argument})
    PrivacyEngine().make_private(**settings)  # the refused call left the model as it was
    with pytest.raises(ValueError, match="secure_mode=True"):
        PrivacyEngine(secure_mode=True).make_private(
            **{**settings, "module": _model()}, noise_generator=torch.Generator())


def test_a_noise_generator_must_be_seeded_and_a_refusal_leaves_it_as_it_was():
    model = _model()
    settings = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    data_loader=_loader(), max_grad_norm=1.0)
    with pytest.raises(ValueError, match="torch's default seed"):
        PrivacyEngine().make_private(**settings, noise_multiplier=1.0,
                                     noise_generator=torch.Generator())
    g = torch.Generator().manual_seed(4)
    before = g.get_state()
    with pytest.raises(ValueError, match="noise_multiplier"):
        PrivacyEngine().make_private(**settings, noise_multiplier=-1.0, noise_generator=g)
    assert torch.equal(g.get_state(), before)


def _trained(generator_seed, steps=2):
    model = _model()
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=_loader(), noise_multiplier=1.0, max_grad_norm=1.0,
        noise_generator=torch.Generator().manual_seed(generator_seed))
    taken = 0
    for x, y in loader:
        F.cross_entropy(model(x), y).backward()
        taken += optimizer.step()
        optimizer.zero_grad()
        if taken == steps:
            break
    assert engine.secure_mode is False
    return [p.detach().clone() for p in model.parameters()]


def test_a_seeded_noise_generator_makes_the_run_reproducible():
    first, again, other = _trained(11), _trained(11), _trained(12)
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(not torch.equal(a, b) for a, b in zip(first, other))


def test_wrap_model_false_trains_the_callers_own_model_and_cleanup_detaches():
    wrapped_before, wrapped, _, _ = _first_step("hooks")
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    hooks, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=_loader(), noise_multiplier=0.0,
        max_grad_norm=0.05, allow_no_noise=True, wrap_model=False,
        noise_generator=torch.Generator().manual_seed(7))
    for x, y in loader:
        F.cross_entropy(model(x), y).backward()  # the caller's own model
        if optimizer.step():
            break
    for a, b in zip(model.parameters(), wrapped.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    hooks.cleanup()
    x, y = _loader().dataset[:4]
    F.cross_entropy(model(x), y).backward()  # plain autograd again
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(RuntimeError):
        optimizer.step()

    # Opacus's GradSampleModule.to_standard_module(): the plain module back, detached.
    plain = _model()
    engine = PrivacyEngine()
    wrapped, optimizer, _ = engine.make_private(
        module=plain, optimizer=torch.optim.SGD(plain.parameters(), lr=0.1),
        data_loader=_loader(), noise_multiplier=1.0, max_grad_norm=1.0)
    assert wrapped.to_standard_module() is plain
    F.cross_entropy(plain(x), y).backward()
    assert all(p.grad is not None for p in plain.parameters())
    with pytest.raises(RuntimeError):
        optimizer.step()


def _engine_run(tmp_path, save_after=None, load=False, steps=4):
    """Steps 0..steps-1 of one seeded run; saves after ``save_after`` steps, or loads the saved
    file and takes the remaining steps. Returns (parameters, engine)."""
    model = _model()
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        data_loader=_loader(), noise_multiplier=1.0, max_grad_norm=1.0,
        noise_generator=torch.Generator().manual_seed(5))
    path = tmp_path / "ckpt.pt"
    if load:
        extra = engine.load_checkpoint(path=path, module=model, optimizer=optimizer)
        assert extra == {"epoch": 3}
    while engine.charges < steps:
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if engine.charges == save_after:
                engine.save_checkpoint(path=path, module=model, optimizer=optimizer,
                                       checkpoint_dict={"epoch": 3})
            if engine.charges == steps:
                break
    return [p.detach().clone() for p in model.parameters()], engine


def test_save_and_load_checkpoint_continue_the_run_as_if_uninterrupted(tmp_path):
    straight, engine = _engine_run(tmp_path, save_after=2)
    resumed, engine_resumed = _engine_run(tmp_path, load=True)
    assert engine_resumed.charges == engine.charges == 4
    assert engine_resumed.get_epsilon(1e-5) == pytest.approx(engine.get_epsilon(1e-5))
    for a, b in zip(straight, resumed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_checkpoint_is_written_whole_or_not_at_all_and_others_are_refused(tmp_path):
    model = _model()
    engine = PrivacyEngine()
    model, optimizer, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=_loader(), noise_multiplier=1.0, max_grad_norm=1.0)
    path = tmp_path / "ckpt.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer)
    written = path.read_bytes()
    with pytest.raises(Exception):  # a lambda cannot be pickled: the save fails midway
        engine.save_checkpoint(path=path, module=model, optimizer=optimizer,
                               checkpoint_dict={"bad": lambda: 0})
    assert path.read_bytes() == written and os.listdir(tmp_path) == ["ckpt.pt"]
    extra = torch.load(path, weights_only=True)  # nothing but tensors and plain values
    assert set(extra) == {"module_state_dict", "optimizer_state_dict",
                          "privacy_engine_state_dict"}

    # A file of a run with another σ is refused before the model or optimizer is touched.
    torch.manual_seed(9)  # other weights than _model()'s
    other = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    other_engine = PrivacyEngine()
    other, other_optimizer, _ = other_engine.make_private(
        module=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9),
        data_loader=_loader(), noise_multiplier=2.0, max_grad_norm=1.0)
    other_file = tmp_path / "other.pt"
    other_engine.save_checkpoint(path=other_file, module=other, optimizer=other_optimizer)
    kept = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="noise_multiplier is 2.0"):
        engine.load_checkpoint(path=other_file, module=model, optimizer=optimizer)
    for name, value in model.state_dict().items():
        assert torch.equal(value, kept[name]), name
        assert not torch.equal(value, other.state_dict()[name]), name

    opacus_file = tmp_path / "opacus.pt"
    torch.save({"module_state_dict": model.state_dict(),
                "privacy_accountant_state_dict": {"history": []}}, opacus_file)
    with pytest.raises(ValueError, match="holds no 'privacy_engine_state_dict'"):
        engine.load_checkpoint(path=opacus_file, module=model)
    with pytest.raises(ValueError, match="noise_scheduler"):
        engine.save_checkpoint(path=path, module=model, noise_scheduler=object())
