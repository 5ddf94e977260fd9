"""The bad-input matrix at make_private (issue 10, docs/reliability.md): every invalid privacy
parameter is refused before anything is attached, with a ValueError naming the bad value, and an
unreachable target epsilon names the target and the sigma range searched."""

import pytest
import torch

import dpzero

from test_private import SeqNet, seq_data

NAN, INF = float("nan"), float("inf")
NOISE = dict(noise_multiplier=1.0, max_grad_norm=1.0)
TARGET = dict(target_delta=1e-5, epochs=1, max_grad_norm=1.0)


SIGMA_MSG = r"noise_multiplier must be finite and >= 0, got "
Q_MSG = r"sample rate must be in \(0, 1\], got "


@pytest.mark.parametrize("kwargs, message", [
    (dict(noise_multiplier=-1.0, max_grad_norm=1.0), SIGMA_MSG + "-1.0"),
    (dict(noise_multiplier=NAN, max_grad_norm=1.0), SIGMA_MSG + "nan"),
    (dict(noise_multiplier=INF, max_grad_norm=1.0), SIGMA_MSG + "inf"),
    (dict(noise_multiplier=1.0, max_grad_norm=NAN), r"max_grad_norm must be > 0, got nan"),
    (dict(noise_multiplier=1.0, max_grad_norm=0.0), r"max_grad_norm must be > 0, got 0.0"),
    (dict(target_epsilon=-1.0, **TARGET), r"target epsilon must be > 0 and finite, got -1"),
    (dict(target_epsilon=3.0, target_delta=1.5, epochs=1, max_grad_norm=1.0),
     r"delta must be in \(0, 1\), got 1.5"),
    (dict(sample_rate=0.0, **NOISE), Q_MSG + "0.0"),
    (dict(sample_rate=NAN, **NOISE), Q_MSG + "nan"),
    (dict(sample_rate=1.5, **NOISE), Q_MSG + "1.5"),
], ids=["sigma<0", "sigma-nan", "sigma-inf", "C-nan", "C-0", "eps<0", "delta>1", "q=0", "q-nan",
        "q>1"])
def test_invalid_privacy_parameters_are_named_and_nothing_is_attached(kwargs, message):
    model = SeqNet()
    before = {n: type(m).forward for n, m in model.named_modules()}
    batch = {} if "sample_rate" in kwargs else dict(batch_size=8)
    with pytest.raises(ValueError, match=message):
        dpzero.make_private(model, dataset=seq_data(), seed=1, **batch, **kwargs)
    # no DP forward patched, no hook left behind
    assert all("forward" not in vars(m) for m in model.modules())
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())
    assert {n: type(m).forward for n, m in model.named_modules()} == before


def test_an_unreachable_target_epsilon_names_the_target_and_the_sigma_range():
    with pytest.raises(ValueError, match=r"target epsilon 1e-09 cannot be reached with sigma in "
                                         r"\[0, 1e\+06\]: epsilon at sigma \d+ is 0\.00"):
        dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, seed=1,
                            target_epsilon=1e-9, **TARGET)
