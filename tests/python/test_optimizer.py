"""DPOptimizer is a torch.optim.Optimizer: torch's and transformers' LR
schedulers, hyperparameters changed between steps, hooks, closures and state_dict round trips.

Reference: a float64 copy of the model trained by torch.optim itself, with the same scheduler, on
DP-SGD gradients from a loop of single-example backward passes (clipped in float64 to C, summed,
divided by the expected batch size q·N), on the very batches the private loader gave. σ = 0 so the
trajectories are comparable; C is small enough that nearly every example clips.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import dpzero
import ranks
from dpzero import PrivacyEngine

N, D, K, C = 48, 5, 3, 0.05
STEPS = 6


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(N, D, generator=g),
                                          torch.randint(0, K, (N,), generator=g))


def _model(seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, K))


def _clipped_mean_grad(ref: nn.Module, x, y, expected_batch):
    """sum_i clip(g_i, C) / (q N), g_i from one example's own backward, float64."""
    total = [torch.zeros_like(p) for p in ref.parameters()]
    for i in range(len(x)):
        ref.zero_grad()
        F.cross_entropy(ref(x[i:i + 1].double()), y[i:i + 1]).backward()
        grads = [p.grad.detach().clone() for p in ref.parameters()]
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
        factor = min(1.0, C / norm) if norm > 0 else 1.0  # flat clipping (design.md §2 step 3)
        for t, g in zip(total, grads):
            t += factor * g
    return [t / expected_batch for t in total]


class _Plateau:
    """ReduceLROnPlateau on a metric that never improves: the lr halves every step."""

    def __init__(self, optimizer):
        self.inner = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5,
                                                                patience=0)

    def step(self):
        self.inner.step(1.0)


SCHEDULES = {
    "ReduceLROnPlateau": (_Plateau, "sgd"),
    "StepLR": (lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5), "sgd"),
    "LambdaLR": (lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1.0 / (k + 1)), "sgd"),
    "CosineAnnealingLR": (lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS),
                          "adam"),
    "OneCycleLR-momentum": (lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=0.5, total_steps=STEPS), "sgd"),
    "OneCycleLR-betas": (lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=0.05, total_steps=STEPS), "adamw"),
    "linear-warmup": (lambda o: __import__("transformers").get_linear_schedule_with_warmup(
        o, num_warmup_steps=2, num_training_steps=STEPS), "adam"),
}


def _torch_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.2, momentum=0.9, weight_decay=0.01)
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    return cls(params, lr=0.02, betas=(0.8, 0.95), weight_decay=0.01)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedulers_drive_the_private_step_as_torch_optim(name):
    make_scheduler, kind = SCHEDULES[name]
    data, model = _data(), _model()
    ref = copy.deepcopy(model).double()
    ref_opt = _torch_optimizer(kind, ref.parameters())
    ref_sched = make_scheduler(ref_opt)

    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=_torch_optimizer(kind, model.parameters()),
        data_loader=torch.utils.data.DataLoader(data, batch_size=12), noise_multiplier=0.0,
        max_grad_norm=C, allow_no_noise=True, seed=5)
    assert isinstance(optimizer, torch.optim.Optimizer)
    sched = make_scheduler(optimizer)
    lrs, ref_lrs = [], []
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        F.cross_entropy(model(x), y).backward()
        assert optimizer.step() is True
        optimizer.zero_grad()
        sched.step()
        lrs.append(optimizer.param_groups[0]["lr"])

        for p, g in zip(ref.parameters(), _clipped_mean_grad(ref, x, y, 12.0)):
            p.grad = g
        ref_opt.step()
        used = dict(ref_opt.param_groups[0])  # the hyperparameters of this step
        ref_sched.step()
        ref_lrs.append(ref_opt.param_groups[0]["lr"])
    assert lrs == pytest.approx(ref_lrs, rel=1e-12)
    if "OneCycle" in name:  # the cycled momentum / betas of the last step reached the engine
        opts = engine.sharded.zero_state.optimizer_options
        if kind == "sgd":
            assert opts["momentum"] == pytest.approx(used["momentum"], rel=1e-12)
        else:
            assert opts["betas"] == pytest.approx(used["betas"], rel=1e-12)
    got = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    want = torch.cat([p.detach().flatten() for p in ref.parameters()])
    start = torch.cat([p.detach().double().flatten() for p in _model().parameters()])
    rel = float((got - want).norm() / (want - start).norm())
    assert rel <= 1e-5, rel


def test_an_invalid_hyperparameter_is_refused_with_nothing_charged():
    data, model = _data(), _model()
    p = dpzero.make_private(model, dataset=data, batch_size=12, noise_multiplier=1.0,
                            max_grad_norm=C, optimizer="adam", seed=0)
    before = [t.detach().clone() for t in model.parameters()]
    for bad, match in (({"lr": -0.5}, "lr must be >= 0, got -0.5"),
                       ({"amsgrad": True}, "amsgrad cannot change"),
                       ({"betas": "fast"}, "'betas'.*'fast'")):
        _assert_refused_at_step(p, 0, bad, match)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _assert_refused_at_step(p, index, change, match):
    """With ``change`` written into param_groups[index], a private step is refused with a
    ValueError matching ``match`` and nothing charged; the group is restored after."""
    group = p.optimizer.param_groups[index]
    saved = {k: group[k] for k in change}
    group.update(change)
    x, y = next(iter(p.data_loader))
    F.cross_entropy(p.model(x), y).backward()
    with pytest.raises(ValueError, match=match):
        p.optimizer.step()
    p.optimizer.zero_grad()
    group.update(saved)
    assert p.privacy_engine.charges == 0


def test_step_hooks_closure_and_single_group():
    data, model = _data(), _model()
    p = dpzero.make_private(model, dataset=data, batch_size=12, noise_multiplier=1.0,
                            max_grad_norm=C, seed=0)
    calls = []

    def hooked(opt):
        opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", type(o).__name__)))
        opt.register_step_post_hook(lambda o, a, k: calls.append(("post", type(o).__name__)))

    plain = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    hooked(plain)
    hooked(p.optimizer)
    handle = register_optimizer_step_post_hook(
        lambda o, a, k: calls.append(("global", type(o).__name__)))
    try:
        plain.step()
        want = [(what, "DPOptimizer") for what, _ in calls]  # torch's own order
        calls.clear()
        batches = iter(p.data_loader)

        def closure():
            x, y = next(batches)
            loss = F.cross_entropy(p.model(x), y)
            loss.backward()
            return loss

        loss = p.optimizer.step(closure)
    finally:
        handle.remove()
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    assert calls == want and len(want) == 3 and p.privacy_engine.charges == 1
    with pytest.raises(ValueError, match="parameter groups are fixed when make_private attaches"):
        p.optimizer.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})


def _run(kind, steps, seed=3, resume_from=None, stage=0):
    """Private training with a scheduler and seeded noise; returns (params, state) after
    `steps` steps, having loaded `resume_from` (model, optimizer, scheduler, privacy engine state
    dicts) first."""
    data, model = _data(), _model()
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=_torch_optimizer(kind, model.parameters()),
        data_loader=torch.utils.data.DataLoader(data, batch_size=12), noise_multiplier=0.7,
        max_grad_norm=C, seed=seed, zero_stage=stage)
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
    if resume_from is not None:
        model.load_state_dict(resume_from["model"])
        optimizer.load_state_dict(resume_from["optimizer"])
        sched.load_state_dict(resume_from["scheduler"])
        engine.load_state_dict(resume_from["privacy"])
    taken = 0
    while taken < steps:
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            sched.step()
            taken += 1
            if taken == steps:
                break
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": sched.state_dict(), "privacy": engine.state_dict()}
    return list(engine.parameters().values()), state  # fp32 masters (gathered at stage 3)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_state_dicts_round_trip_through_a_checkpoint(tmp_path, kind):
    straight, _ = _run(kind, 5)
    _, state = _run(kind, 2)
    torch.save(state, tmp_path / "ckpt.pt")
    resumed, after = _run(kind, 3, resume_from=torch.load(tmp_path / "ckpt.pt"))
    for a, b in zip(straight, resumed):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    saved = after["optimizer"]
    names = {"sgd": {"momentum_buffer"}, "adamw": {"step", "exp_avg", "exp_avg_sq"}}[kind]
    assert set(saved["state"][0]) == names
    assert saved["param_groups"][0]["initial_lr"] == pytest.approx(0.1 / 25)
    if kind == "adamw":
        assert float(saved["state"][0]["step"]) == 5.0


def test_state_dict_matches_torch_optim_state():
    """After σ = 0 steps, the state dict equals the float64 reference optimizer's state."""
    data, model = _data(), _model()
    ref = copy.deepcopy(model).double()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.02, betas=(0.8, 0.95))
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.02, betas=(0.8, 0.95)),
        data_loader=torch.utils.data.DataLoader(data, batch_size=12), noise_multiplier=0.0,
        max_grad_norm=C, allow_no_noise=True, seed=5)
    for step, (x, y) in enumerate(loader):
        if step == 3:
            break
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        for p, g in zip(ref.parameters(), _clipped_mean_grad(ref, x, y, 12.0)):
            p.grad = g
        ref_opt.step()
    got, want = optimizer.state_dict(), ref_opt.state_dict()
    assert got["param_groups"][0].keys() == want["param_groups"][0].keys()
    for i in want["state"]:
        for name, value in want["state"][i].items():
            torch.testing.assert_close(got["state"][i][name].double(), value.double(),
                                       rtol=1e-4, atol=1e-9)


def test_load_state_dict_refuses_a_mismatch_and_mid_batch():
    _, state = _run("sgd", 1)
    data, model = _data(), _model()
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=_torch_optimizer("sgd", model.parameters()),
        data_loader=torch.utils.data.DataLoader(data, batch_size=12), noise_multiplier=0.7,
        max_grad_norm=C, seed=3, max_physical_batch_size=4)
    bad = copy.deepcopy(state["optimizer"])
    bad["state"][0]["momentum_buffer"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"momentum_buffer.*parameter 0.*\(3, 3\).*\(8, 5\)"):
        optimizer.load_state_dict(bad)
    bad = copy.deepcopy(state["optimizer"])
    bad["param_groups"][0]["params"] = [0]
    with pytest.raises(ValueError,
                       match="group 0 of the state dict has 1 parameters, this optimizer's 4"):
        optimizer.load_state_dict(bad)
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    assert optimizer.step() is False  # seed 3: more than 4 rows, so mid logical batch
    with pytest.raises(RuntimeError, match="between steps"):
        optimizer.load_state_dict(state["optimizer"])


def _decay_groups(kind, model, weight_decay=0.1):
    """The usual fine-tuning split: matrices decay, biases do not."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    exempt = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": exempt, "weight_decay": 0.0}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.2, momentum=0.9)
    return (torch.optim.Adam if kind == "adam" else torch.optim.AdamW)(groups, lr=0.02)


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_weight_decay_groups_train_as_torch_optim(kind):
    """Note [weight decay runs]: groups that differ in weight_decay alone train as torch.optim's
    groups (with a warmup schedule driving both), and the state dict keeps torch's groups."""
    import transformers

    data, model = _data(), _model()
    ref = copy.deepcopy(model).double()
    ref_opt = _decay_groups(kind, ref)
    ref_sched = transformers.get_linear_schedule_with_warmup(ref_opt, 2, STEPS)
    uniform = copy.deepcopy(ref)  # the same run with every parameter decaying
    uniform_opt = _decay_groups(kind, uniform)
    uniform_opt.param_groups[1]["weight_decay"] = 0.1
    uniform_sched = transformers.get_linear_schedule_with_warmup(uniform_opt, 2, STEPS)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=_decay_groups(kind, model),
        data_loader=torch.utils.data.DataLoader(data, batch_size=12), noise_multiplier=0.0,
        max_grad_norm=C, allow_no_noise=True, seed=5)
    sched = transformers.get_linear_schedule_with_warmup(optimizer, 2, STEPS)
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        sched.step()
        for r, (o, s) in ((ref, (ref_opt, ref_sched)), (uniform, (uniform_opt, uniform_sched))):
            for p, g in zip(r.parameters(), _clipped_mean_grad(r, x, y, 12.0)):
                p.grad = g
            o.step()
            s.step()
    start = torch.cat([p.detach().double().flatten() for p in _model().parameters()])
    got = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    for other, bound in ((ref, 1e-5), (uniform, None)):
        want = torch.cat([p.detach().flatten() for p in other.parameters()])
        rel = float((got - want).norm() / (want - start).norm())
        if bound is not None:
            assert rel <= bound, rel
        else:  # the exemption is not a no-op: against uniform decay the run is far off
            assert rel > 1e-3, rel
    saved, want = optimizer.state_dict(), ref_opt.state_dict()
    assert [g["params"] for g in saved["param_groups"]] == [[0, 1], [2, 3]] == [
        g["params"] for g in want["param_groups"]]
    assert [g["weight_decay"] for g in saved["param_groups"]] == [0.1, 0.0]
    for i in want["state"]:
        for name, value in want["state"][i].items():
            torch.testing.assert_close(saved["state"][i][name].double(), value.double(),
                                       rtol=1e-4, atol=1e-9)
    # Torch's own optimizer takes the state dict, and so does a new private one.
    _decay_groups(kind, _model()).load_state_dict(saved)
    fresh = _model()
    again = dpzero.make_private(fresh, dataset=data, batch_size=12, noise_multiplier=0.0,
                                allow_no_noise=True, max_grad_norm=C,
                                optimizer=_decay_groups(kind, fresh), seed=5)
    again.optimizer.load_state_dict(saved)
    assert again.optimizer.state_dict()["param_groups"] == saved["param_groups"]


def test_weight_decay_groups_refuse_what_the_engine_cannot_apply():
    data = _data()

    def attach(optimizer, model):
        return dpzero.make_private(model, dataset=data, batch_size=12, noise_multiplier=1.0,
                                   max_grad_norm=C, optimizer=optimizer, seed=0)

    model = _model()
    groups = _decay_groups("adamw", model)
    groups.param_groups[1]["lr"] = 0.5
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['lr'\] = 0.5 differs from "
                                         r"param_groups\[0\]\['lr'\] = 0.02"):
        attach(groups, model)
    model = _model()
    groups = _decay_groups("adamw", model)
    groups.param_groups[1]["weight_decay"] = 0.2
    with pytest.raises(ValueError, match=r"weight_decay values \[0.1, 0.2\]"):
        attach(groups, model)
    model = _model()
    groups = _decay_groups("adamw", model)
    groups.param_groups[1]["betas"] = list(groups.param_groups[0]["betas"])  # equal, as a list
    attach(groups, model)
    model = _model()
    with pytest.raises(ValueError, match=r"weight_decay=0.3 with an optimizer of 2 parameter "
                                         r"groups"):
        dpzero.make_private(model, dataset=data, batch_size=12, noise_multiplier=1.0,
                            max_grad_norm=C, optimizer=_decay_groups("adamw", model),
                            weight_decay=0.3, seed=0)
    model = _model()
    with pytest.raises(ValueError, match=r"does not hold 2 of the model's 4 trainable "
                                         r"parameters \(first: '2.weight'\)"):
        attach(torch.optim.SGD(model[0].parameters(), lr=0.1), model)
    with pytest.raises(ValueError, match="holds 4 parameters that are not the model's"):
        attach(torch.optim.SGD(list(_model().parameters()) + list(model.parameters()), lr=0.1),
               model)
    # At a step, with nothing charged: one lr for every group, and the exemption stays.
    model = _model()
    p = attach(_decay_groups("adamw", model), model)
    for change, match in (({"lr": 0.3}, r"param_groups\[1\]\['lr'\] = 0.3 differs"),
                          ({"weight_decay": 0.1}, r"exempt from weight decay were fixed at "
                                                  r"make_private as \[1\]")):
        _assert_refused_at_step(p, 1, change, match)


def _sharded_rank(rank, world, resume):
    _, state = _run("adamw", 2, stage=3)
    params, _ = _run("adamw", 3, stage=3, resume_from=torch.load(resume))
    return state["optimizer"], params


@pytest.mark.multirank
def test_state_dict_gathers_and_scatters_zero3_shards(tmp_path):
    """Two ZeRO-3 ranks give the one-rank stage-0 state dict, and resume from it to the same
    parameters as an uninterrupted one-rank run."""
    _, single = _run("adamw", 2)
    straight, _ = _run("adamw", 5)
    torch.save(single, tmp_path / "single.pt")
    results = ranks.spawn(_sharded_rank, 2, tmp_path, str(tmp_path / "single.pt"), timeout_s=120)
    for rank in range(2):
        optimizer, params = results[rank]
        assert optimizer["param_groups"] == single["optimizer"]["param_groups"]
        for i, entries in single["optimizer"]["state"].items():
            for name, value in entries.items():
                torch.testing.assert_close(optimizer["state"][i][name], value, rtol=1e-5,
                                           atol=1e-8)
        for a, b in zip(params, straight):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("stage,precision", [(3, None), (0, "bf16"), (2, "bf16")])
def test_module_state_dict_reads_and_writes_the_master(stage, precision):
    """Note [module state dicts]: where the engine holds the parameter values (stage 3 frees
    them, bf16 compute keeps a separate fp32 master), model.state_dict() gives the fp32 masters
    and model.load_state_dict() writes them; the next step starts from the loaded values."""
    data, model = _data(), _model()
    p = dpzero.make_private(model, dataset=data, batch_size=12, noise_multiplier=0.0,
                            max_grad_norm=C, allow_no_noise=True, seed=0, zero_stage=stage,
                            mixed_precision=precision, lr=20.0)  # updates well above fp32 rounding
    saved = p.model.state_dict()
    masters = p.privacy_engine.parameters()
    # keep_vars=True asks for the Parameter objects: nothing gathered (rank 0 alone may ask).
    assert all(isinstance(v, nn.Parameter) for k, v in p.model.state_dict(keep_vars=True).items()
               if k in saved and k in masters)
    # The plain model's names: the state dict loads into the model without make_private.
    assert sorted(saved) == sorted(masters) == sorted(_model().state_dict())
    for name, value in masters.items():
        assert torch.equal(saved[name], value)
    target = {k: torch.randn_like(v) for k, v in saved.items()}
    # Opacus's names (its GradSampleModule's "_module." prefix) load as well.
    result = p.model.load_state_dict({"_module." + k: v for k, v in target.items()})
    assert result.missing_keys == [] and result.unexpected_keys == []
    for name, value in p.privacy_engine.parameters().items():
        assert torch.equal(value, target[name]), name
    result = p.model.load_state_dict(target)
    assert result.missing_keys == [] and result.unexpected_keys == []
    # One σ = 0 step from the loaded values equals the float64 reference from them.
    ref = _model()
    ref.load_state_dict(target)
    ref = ref.double()
    x, y = next(iter(p.data_loader))
    if precision is None:
        F.cross_entropy(p.model(x), y).backward()
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(p.model(x), y)
        loss.backward()
    assert p.optimizer.step()
    grads = _clipped_mean_grad(ref, x, y, 12.0)
    got = p.privacy_engine.parameters()
    tol = 1e-5 if precision is None else 2e-2  # bf16 compute rounds the forward
    for (name, r), g in zip(ref.named_parameters(), grads):
        want = r.detach() - 20.0 * g
        moved = float((20.0 * g).norm())
        assert float((got[name].double() - want).norm()) <= tol * moved, name
    with pytest.raises(RuntimeError, match=r"size mismatch for 0\.weight"):
        p.model.load_state_dict(dict(target, **{"0.weight": torch.zeros(2, 2)}))
