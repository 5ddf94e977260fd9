"""What an Opacus user reaches for, switched by its import: ModuleValidator.validate / fix,
BatchMemoryManager, and the DP layers of opacus.layers. References: make_private's own refusal,
torch's group_norm, a run given the same physical-batch cap at make_private, torch's modules
built by keyword, and the per-example reference step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzero
from dpzero.private import PrivacyViolation
from dpzero.utils.batch_memory_manager import BatchMemoryManager
from dpzero.validators import ModuleValidator


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 48, 3, padding=1)
        self.bn = nn.BatchNorm1d(48)
        self.inorm = nn.InstanceNorm1d(48, affine=True, track_running_stats=True)
        self.head = nn.Linear(48 * 6, 3)

    def forward(self, x):
        return self.head(self.inorm(self.bn(self.conv(x))).flatten(1))


def _data(n=64):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 2, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def test_validate_names_what_make_private_refuses_and_fix_replaces_it():
    torch.manual_seed(0)
    model = Net()
    problems = ModuleValidator.validate(model)
    assert [p.split(" ")[0] for p in problems] == ["bn", "inorm"]
    assert "use GroupNorm" in problems[0] and "track_running_stats=False" in problems[1]
    with pytest.raises(PrivacyViolation) as refused:
        dpzero.make_private(model, dataset=_data(), batch_size=16, noise_multiplier=1.0,
                            max_grad_norm=1.0, seed=0)
    for p in problems:
        assert p in str(refused.value)
    with pytest.raises(PrivacyViolation):
        ModuleValidator.validate(model, strict=True)

    fixed = ModuleValidator.fix(model)
    assert ModuleValidator.validate(fixed) == [] and ModuleValidator.is_valid(fixed)
    assert isinstance(model.bn, nn.BatchNorm1d)  # the original is left as it was
    assert isinstance(fixed.bn, nn.GroupNorm) and fixed.bn.num_groups == 24  # 48 = 2 x 24
    x = torch.randn(5, 48, 6)
    torch.testing.assert_close(fixed.bn(x), F.group_norm(x, 24, model.bn.weight, model.bn.bias,
                                                         model.bn.eps))
    assert not fixed.inorm.track_running_stats and fixed.inorm.running_mean is None
    p = dpzero.make_private(fixed, dataset=_data(), batch_size=16, noise_multiplier=1.0,
                            max_grad_norm=1.0, seed=0)
    x, y = next(iter(p.data_loader))
    F.cross_entropy(p.model(x), y).backward()


def _run(cap_at_make_private, manager_cap):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(96, 4, generator=g), torch.randint(0, 2, (96,), generator=g))
    p = dpzero.make_private(model, data_loader=DataLoader(data, batch_size=32),
                            noise_multiplier=0.0, allow_no_noise=True, max_grad_norm=0.5,
                            seed=3, optimizer="sgd", lr=0.1,
                            max_physical_batch_size=cap_at_make_private)
    rows = []

    def epoch(loader):
        for x, y in loader:
            rows.append(len(x))
            F.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            p.optimizer.zero_grad()

    if manager_cap is None:
        epoch(p.data_loader)
    else:
        with BatchMemoryManager(data_loader=p.data_loader, max_physical_batch_size=manager_cap,
                                optimizer=p.optimizer) as loader:
            epoch(loader)
        assert p.data_loader.max_physical_batch_size == cap_at_make_private  # restored
    return rows, p.privacy_engine.charges, [q.detach().clone() for q in model.parameters()]


def test_batch_memory_manager_caps_the_micro_batches_and_changes_nothing_else():
    rows, charges, params = _run(None, 8)
    ref_rows, ref_charges, ref_params = _run(8, None)
    assert max(rows) <= 8 and rows == ref_rows and charges == ref_charges == 3
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="max_physical_batch_size must be an integer >= 1, got 0"):
        BatchMemoryManager(data_loader=_private_loader(), max_physical_batch_size=0)
    with pytest.raises(TypeError, match="got DataLoader"):
        BatchMemoryManager(data_loader=DataLoader(_data()), max_physical_batch_size=8)


def _private_loader():
    """A loader make_private returned, for the manager's argument checks."""
    model = nn.Linear(2, 2)
    data = TensorDataset(torch.randn(8, 2), torch.randint(0, 2, (8,)))
    return dpzero.make_private(model, dataset=data, batch_size=4, noise_multiplier=1.0,
                               max_grad_norm=1.0, seed=0).data_loader


def test_opacus_layers_are_torchs_modules_with_opacus_arguments():
    """dpzero.layers (was opacus.layers): torch's modules, built from Opacus's positional order
    (DPRNN's nonlinearity last, not fourth) and taking its state_init keyword; references:
    torch's modules built by keyword, the same weights."""
    from dpzero.layers import DPGRU, DPLSTM, DPMultiheadAttention, DPRNN

    assert DPMultiheadAttention is nn.MultiheadAttention
    x = torch.randn(3, 5, 4)
    cases = [(DPRNN(4, 6, 1, False, True, 0.0, True, 0, "relu"),
              nn.RNN(4, 6, num_layers=1, bias=False, batch_first=True, bidirectional=True,
                     nonlinearity="relu"), torch.randn(2, 3, 6)),
             (DPGRU(4, 6, 2, True, True), nn.GRU(4, 6, num_layers=2, batch_first=True),
              torch.randn(2, 3, 6)),
             (DPLSTM(4, 6, 1, True, True, 0.0, False, 2),
              nn.LSTM(4, 6, batch_first=True, proj_size=2),
              (torch.randn(1, 3, 2), torch.randn(1, 3, 6)))]
    for ours, torchs, state in cases:
        assert isinstance(ours, type(torchs))
        torchs.load_state_dict(ours.state_dict())  # same names and shapes
        torch.testing.assert_close(ours(x, state_init=state), torchs(x, state))
        torch.testing.assert_close(ours(x)[0], torchs(x)[0])
    with pytest.raises(ValueError, match="DPGRU: proj_size=3"):
        DPGRU(4, 6, proj_size=3)


def test_a_script_on_opacus_layers_trains_as_the_per_example_reference():
    from dpzero.layers import DPLSTM, DPMultiheadAttention
    from private_reference import first_step_error

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = DPLSTM(2, 8, batch_first=True)
            self.attn = DPMultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            h = self.rnn(x.transpose(1, 2))[0]
            return self.head(self.attn(h, h, h)[0].mean(1))

    torch.manual_seed(0)
    model = Net()
    start = copy.deepcopy(model)
    p = dpzero.make_private(model, dataset=_data(), batch_size=16, noise_multiplier=0.0,
                            allow_no_noise=True, max_grad_norm=1e-3, lr=1000.0, seed=0)
    kinds = {layer.name: type(layer.kind).__name__ for layer in p.privacy_engine.layers}
    assert kinds["rnn.l0.hh"] == "LinearKind" and kinds["attn.in_proj.q"] == "ProjectionKind"
    error = first_step_error(p, start, max_grad_norm=1e-3, lr=1000.0, expected_batch=16.0)
    assert error <= 1e-5, error

