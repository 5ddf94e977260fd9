"""The replace-one sensitivity of one private step, measured (design.md §3 "Sensitivity").

Two neighbouring datasets D and D' differ in one example: in D' its loss is weighted by -1e6 (an
outlier whose gradient is a million times the others', pointing the other way, so that its
clipped contribution changes by between C and 2C whatever the example's own gradient was). One
private step is taken on each through ``make_private``'s own loader with q = 1 (every example, in
micro-batches of ``micro``), no noise, a summed loss and SGD with lr = q N, so that the parameters
move by exactly the sum of the clipped per-example gradients. Replace-one DP-SGD with clip norm C
needs the two sums to differ by at most 2 C in L2: each example's clipped contribution has norm
<= C. A layer that clips rows which are
not examples (a position table's rows when B = T) lets the outlier's gradient into every row, and
the difference grows with the number of rows.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import dpzero
from dpzero.private import PrivacyViolation


def step_sum(make_model: Callable[[], nn.Module], inputs: Sequence[torch.Tensor],
             labels: torch.Tensor, weights: torch.Tensor, *, max_grad_norm: float = 1.0,
             micro: int = None, clipping: str = "flat", seed: int = 0,
             call: Callable = None, isolation: str = "detect") -> torch.Tensor:
    """The pre-noise sum of clipped per-example gradients of one step (flattened, float64).
    ``call(model, *inputs)``: how the training loop calls the model (default: model(*inputs))."""
    torch.manual_seed(seed)
    model = make_model()
    before = {n: t.detach().clone() for n, t in model.named_parameters() if t.requires_grad}
    n = len(labels)
    data = torch.utils.data.TensorDataset(*inputs, labels, weights)
    p = dpzero.make_private(model, dataset=data, sample_rate=1.0, noise_multiplier=0.0,
                            allow_no_noise=True, max_grad_norm=max_grad_norm, optimizer="sgd",
                            lr=float(n), clipping=clipping, loss_reduction="sum", seed=seed,
                            max_physical_batch_size=micro or n, isolation=isolation)
    for *xs, y, w in p.data_loader:
        out = call(p.model, *xs) if call is not None else p.model(*xs)
        (w * F.cross_entropy(out, y, reduction="none")).sum().backward()
        if p.optimizer.step():
            break
    after = p.privacy_engine.parameters()
    return torch.cat([(before[k] - after[k]).flatten().double() for k in sorted(after)])


def replace_one_movement(make_model, inputs, labels, *, outlier: int = 0, **kwargs) -> float:
    """|| sum(D) - sum(D') || for D' = D with example ``outlier`` weighted -1e6."""
    weights = torch.ones(len(labels))
    base = step_sum(make_model, inputs, labels, weights, **kwargs)
    weights[outlier] = -1e6
    moved = step_sum(make_model, inputs, labels, weights, **kwargs)
    return (base - moved).norm().item()


def refused_or_bounded(make_model, inputs, labels, *, max_grad_norm: float = 1.0,
                       **kwargs) -> str:
    """"refused" if make_private or the step refuses the model; otherwise asserts the 2C bound
    (and that the outlier moved the sum at all) and returns "bounded"."""
    try:
        moved = replace_one_movement(make_model, inputs, labels, max_grad_norm=max_grad_norm,
                                     **kwargs)
    except PrivacyViolation:
        return "refused"
    assert moved <= 2 * max_grad_norm * (1 + 1e-5), f"moved {moved} > 2C = {2 * max_grad_norm}"
    assert moved >= max_grad_norm * (1 - 1e-5), f"moved {moved} < C: the outlier was dropped"
    return "bounded"
