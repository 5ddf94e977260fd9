"""A naive DP-SGD step, independent of dpzero's clipping code: per-sample gradients from
``torch.func`` (vmap of grad over the UNPATCHED model), explicit clipping in float64, the noise
vector drawn for all D coordinates in one call, and a plain SGD update.

Clipping groups follow design.md §2 step 3: a "layer" is a module with trainable parameters of its
own; tied layers (sharing a parameter) and layers called several times per example are evaluated
on an untied copy (one tensor per use) so each use's per-sample gradient is known, and their norm
is the sum of the uses' norms (triangle inequality).
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.func import functional_call, grad, vmap


def per_sample_grads(model: nn.Module, loss_fn: Callable, inputs: torch.Tensor,
                     targets: torch.Tensor) -> Dict[str, torch.Tensor]:
    """name -> [B, *shape] per-sample gradients of loss_fn(model(x_i), y_i) (one example each)."""
    params = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)
              if p.requires_grad}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def one(p, x, y):
        out = functional_call(model, (p, buffers), (x.unsqueeze(0),), tie_weights=False)
        return loss_fn(out, y.unsqueeze(0))

    return vmap(grad(one), in_dims=(None, 0, 0), randomness="same")(params, inputs, targets)


def per_sample_grads_loop(model: nn.Module, loss_fn: Callable, inputs: torch.Tensor,
                          targets: torch.Tensor) -> Dict[str, torch.Tensor]:
    """per_sample_grads by one backward per example, for models whose forward vmap cannot trace
    (Hugging Face's attention masks branch on their values)."""
    named = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    rows = []
    for i in range(inputs.shape[0]):
        loss = loss_fn(model(inputs[i:i + 1]), targets[i:i + 1])
        rows.append(torch.autograd.grad(loss, [p for _, p in named], allow_unused=True))
    return {n: torch.stack([g if g is not None else torch.zeros_like(p) for g in
                            (row[k] for row in rows)])
            for k, (n, p) in enumerate(named)}


def untie(model: nn.Module, example=None) -> Tuple[nn.Module, Dict[str, str]]:
    """A copy in which every use of a shared parameter has its own tensor (same values), and the
    name of the original parameter each of the copy's copies (its canonical name in ``model``).

    A parameter held by several modules (tied) gets one tensor per module. A module called
    several times per example (ALBERT's layers shared across depth), counted on ``example`` (one
    example's inputs), gets one copy of its own parameters per call: call j of a forward runs
    with copy j, a child module ``_use{j}`` of the module (j >= 1; the module's own parameters
    for call 0). Only childless modules can be unrolled so; others raise."""
    clone = copy.deepcopy(model)
    canon_clone = {id(p): n for n, p in clone.named_parameters() if p.requires_grad}
    seen = set()
    for module in clone.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) in seen:
                module._parameters[name] = nn.Parameter(p.detach().clone(),
                                                        requires_grad=p.requires_grad)
                if p.requires_grad:
                    canon_clone[id(module._parameters[name])] = canon_clone[id(p)]
            seen.add(id(p))
    # canonical names of the clone's parameters are the model's (deepcopy keeps the names)
    if example is not None:
        _unroll_calls(clone, example, canon_clone)
    tied_to = {n: canon_clone[id(p)] for n, p in
               clone.named_parameters(remove_duplicate=False) if p.requires_grad}
    return clone, tied_to


def _unroll_calls(clone: nn.Module, example, canon_clone: Dict[int, str]) -> None:
    calls: Dict[int, int] = {}
    owners = [m for m in clone.modules()
              if any(p.requires_grad for p in m.parameters(recurse=False))]
    handles = [m.register_forward_pre_hook(
        lambda mod, args: calls.__setitem__(id(mod), calls.get(id(mod), 0) + 1)) for m in owners]
    try:
        with torch.no_grad(), torch.random.fork_rng():
            clone(example)
    finally:
        for h in handles:
            h.remove()
    repeated = [m for m in owners if calls.get(id(m), 0) > 1]
    for module in repeated:
        if len(module._modules):
            raise ValueError(f"{type(module).__name__} is called {calls[id(module)]} times per "
                             "example and has children: the reference cannot unroll it")
        uses = [module]
        for j in range(1, calls[id(module)]):
            use = copy.copy(module)
            use.__dict__ = dict(module.__dict__)
            use._modules = {}
            use._parameters = {}
            for name, p in module._parameters.items():
                if p is None:
                    use._parameters[name] = None
                    continue
                use._parameters[name] = nn.Parameter(p.detach().clone(),
                                                     requires_grad=p.requires_grad)
                if p.requires_grad:
                    canon_clone[id(use._parameters[name])] = canon_clone[id(p)]
            module._modules[f"_use{j}"] = use
            uses.append(use)
        forward = type(module).forward
        count = [0]

        def dispatch(*args, uses=uses, forward=forward, count=count, **kwargs):
            if count[0] >= len(uses):  # more calls than counted: a copy would be reused
                raise RuntimeError(f"{type(uses[0]).__name__} was called more than the "
                                   f"{len(uses)} times counted per example")
            target = uses[count[0]]
            count[0] += 1
            return forward(target, *args, **kwargs)

        module.forward = dispatch
        clone.register_forward_pre_hook(lambda mod, args, count=count: count.__setitem__(0, 0))


def naive_dp_sgd_step(model: nn.Module, loss_fn: Callable, inputs, targets, *, max_grad_norm,
                      noise_multiplier: float, seed: int, noise_index: int, lr: float,
                      expected_batch: float, clipping: str = "flat", gamma: float = 0.01,
                      groups: Optional[Sequence[Sequence[str]]] = None,
                      vectorized: bool = True) -> Dict[str, torch.Tensor]:
    """The parameters (canonical names, tied once) after one DP-SGD step from ``model``;
    ``vectorized = False`` takes the per-sample gradients one example at a time."""
    canonical = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # untied parameter name -> canonical name of the parameter it copies
    untied, tied_to = untie(model, inputs[:1])
    ps = (per_sample_grads if vectorized else per_sample_grads_loop)(untied, loss_fn, inputs,
                                                                      targets)
    ps = {n: g.double() for n, g in ps.items()}
    b = inputs.shape[0]

    def layer_of(name):
        return name.rsplit(".", 1)[0] if "." in name else ""

    # layer (module use) -> its per-sample squared norm
    layer_sq: Dict[str, torch.Tensor] = {}
    for name, g in ps.items():
        layer_sq.setdefault(layer_of(name), torch.zeros(b, dtype=torch.float64))
        layer_sq[layer_of(name)] += g.flatten(1).pow(2).sum(1)
    # components: layers sharing a canonical parameter
    comp_of: Dict[str, str] = {}
    for name in ps:
        canon = tied_to[name]
        comp_of.setdefault(layer_of(name), canon)
    # union layers whose parameters map to the same canonical parameter
    parent = {l: l for l in layer_sq}

    def find(x):
        while parent[x] != x:
            x = parent[x]
        return x

    first_user: Dict[str, str] = {}
    for name in ps:
        canon, layer = tied_to[name], layer_of(name)
        if canon in first_user:
            parent[find(layer)] = find(first_user[canon])
        else:
            first_user[canon] = layer
    components: Dict[str, List[str]] = {}
    for layer in layer_sq:
        components.setdefault(find(layer), []).append(layer)

    def comp_sq(layers):
        if len(layers) == 1:
            return layer_sq[layers[0]]
        n = sum(layer_sq[l].sqrt() for l in layers)
        return n * n

    # clipping groups -> list of component keys and thresholds
    comps = list(components)
    if clipping in ("flat", "automatic"):
        group_list = [comps]
    elif clipping == "layer":
        group_list = [[c] for c in comps]
    else:
        group_list = []
        for prefixes in groups:
            group_list.append([c for c in comps if any(
                l == p or l.startswith(p + ".") for l in components[c] for p in prefixes)])
    k = len(group_list)
    thresholds = [max_grad_norm / math.sqrt(k)] * k if clipping in ("layer", "group") \
        else [max_grad_norm]
    factor_of_layer: Dict[str, torch.Tensor] = {}
    for comps_g, c in zip(group_list, thresholds):
        norm = sum(comp_sq(components[cc]) for cc in comps_g).sqrt()
        if clipping == "automatic":
            f = c / (norm + gamma)
        else:
            f = torch.clamp(c / (norm + 1e-6), max=1.0)
        f = torch.where(torch.isfinite(norm), f, torch.zeros_like(f))
        for cc in comps_g:
            for layer in components[cc]:
                factor_of_layer[layer] = f
    summed = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in canonical}
    for name, g in ps.items():
        f = factor_of_layer[layer_of(name)].view(-1, *([1] * (g.dim() - 1)))
        summed[tied_to[name]] += (f * g).sum(0)
    total = sum(p.numel() for _, p in canonical)
    noise = torch.zeros(total, dtype=torch.float32)
    if noise_multiplier > 0:
        torch.ops.dpzero.add_noise_(noise, noise_multiplier * max_grad_norm, seed, noise_index, 0)
    out, offset = {}, 0
    for n, p in canonical:
        z = noise[offset:offset + p.numel()].view(p.shape).double()
        offset += p.numel()
        out[n] = (p.detach().double() - lr * (summed[n] + z) / expected_batch).float()
    return out


def first_private_step(model: nn.Module, dataset, loss: Callable, **kwargs):
    """The other side of the comparison: ``dpzero.make_private`` (SGD) trained through its loader
    until its first private step; returns (PrivateTraining, the logical batch's inputs, targets),
    the batch being every micro-batch of step 0 concatenated."""
    import dpzero

    p = dpzero.make_private(model, dataset=dataset, optimizer="sgd", **kwargs)
    xs, ys = [], []
    for x, y in p.data_loader:
        xs.append(x)
        ys.append(y)
        p.optimizer.zero_grad()
        loss(p.model(x), y).backward()
        if p.optimizer.step():
            break
    return p, torch.cat(xs), torch.cat(ys)


def clipped_step_by_example(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *,
                            max_grad_norm: float, lr: float, expected_batch: float,
                            must_clip: bool = False) -> Dict[str, torch.Tensor]:
    """Parameters (canonical names) after one DP-SGD step without noise on a float64 copy of
    ``model``: each example's whole gradient of its cross-entropy through torch's autograd (a tied
    parameter's uses summed, hooks and custom autograd functions as they run), clipped flat,
    ``min(1, C / (||g|| + 1e-6))`` (privacy/clipping.h), summed, divided by the expected batch.
    ``must_clip``: assert that every example's norm exceeds C (so every example is clipped)."""
    ref = copy.deepcopy(model).double()
    params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(len(inputs)):
        ref.zero_grad()
        x = inputs[i:i + 1]
        x = x.double() if x.is_floating_point() else x
        loss = torch.nn.functional.cross_entropy(ref(x), targets[i:i + 1])
        loss.backward()
        grads = {n: p.grad if p.grad is not None else torch.zeros_like(p)
                 for n, p in params.items()}
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
        assert not must_clip or norm > max_grad_norm, (i, norm)
        for n, g in grads.items():
            total[n] += min(1.0, max_grad_norm / (norm + 1e-6)) * g
    return {n: p.detach() - lr * total[n] / expected_batch for n, p in params.items()}


def first_step_error(private, start: nn.Module, *, max_grad_norm: float, lr: float,
                     expected_batch: float) -> float:
    """One σ = 0 step of ``private`` (make_private's result) on its loader's first batch, every
    example clipped, and its relative update error against :func:`clipped_step_by_example` on
    ``start`` (a copy of the model before make_private)."""
    ids, y = next(iter(private.data_loader))
    torch.nn.functional.cross_entropy(private.model(ids), y).backward()
    assert private.optimizer.step()
    want = clipped_step_by_example(start, ids.as_subclass(torch.Tensor),
                                   y.as_subclass(torch.Tensor), max_grad_norm=max_grad_norm,
                                   lr=lr, expected_batch=expected_batch, must_clip=True)
    got = private.privacy_engine.parameters()
    assert sorted(got) == sorted(want)
    num = sum(float((got[n].double() - want[n]).pow(2).sum()) for n in want)
    den = sum(float((want[n] - start.get_parameter(n).detach().double()).pow(2).sum())
              for n in want)
    return math.sqrt(num / den)


def parameters_after_steps(private, steps: int) -> Dict[str, torch.Tensor]:
    """The engine's parameters after ``steps`` logical steps of ``private`` (make_private's
    result) on its loader, the loss cross-entropy."""
    taken = 0
    for ids, y in private.data_loader:
        torch.nn.functional.cross_entropy(private.model(ids), y).backward()
        if private.optimizer.step():
            private.optimizer.zero_grad()
            taken += 1
            if taken == steps:
                break
    return private.privacy_engine.parameters()


def private_without_noise(make_model: Callable[[], nn.Module], dataset, *, max_grad_norm: float,
                          lr: float, batch_size: int = 8):
    """(a copy of the model as it starts, make_private's result on it at σ = 0): the model from
    ``make_model`` after torch.manual_seed(0), the run seeded 1. The setup of a step compared
    with :func:`clipped_step_by_example` (:func:`first_step_error`)."""
    import dpzero

    torch.manual_seed(0)
    model = make_model()
    start = copy.deepcopy(model)
    return start, dpzero.make_private(model, dataset=dataset, batch_size=batch_size,
                                      noise_multiplier=0.0, max_grad_norm=max_grad_norm,
                                      allow_no_noise=True, lr=lr, seed=1)
