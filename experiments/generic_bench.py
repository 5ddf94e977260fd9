"""dpzero against Opacus on the modules Opacus asks to swap for its own layers, an LSTM and a
multi-head-attention classifier, and on a convolutional network with GroupNorm (the shape Opacus's
ModuleValidator.fix gives a ResNet): one private step each, side by side in one process.

Systems (each a full step: forward, backward with per-sample clipping, noise, update):
  torch             non-private PyTorch (the floor)
  dpzero            dpzero.make_private: the LSTM's weights (recurrent.py) and
                    MultiheadAttention's projections (attention.py) as DP Linear layers,
                    Embedding and Linear, all through the kernels
  opacus-functorch  Opacus 1.6, grad_sample_mode="functorch" (torch.func for every layer)
  opacus-hooks      Opacus 1.6, grad_sample_mode="hooks" (its grad samplers). Both Opacus modes
                    refuse nn.LSTM and nn.MultiheadAttention at make_private
                    (ShouldReplaceModuleError); the table says so
  opacus-dp-layers  Opacus 1.6 hooks with the model rewritten to Opacus's DPLSTM /
                    DPMultiheadAttention (what Opacus asks its users to swap in; the CNN has
                    nothing to swap, so its row is opacus-hooks')

The CNN (``--models cnn``) takes images of 3 x seq x seq (32: CIFAR-10's shape).

Timing: rounds interleave one step of every system; the table gives each system's median step
time and its median paired ratio to dpzero (experiments/bench_common.py). Every system's first
update is checked against a per-example float64 reference (σ = 0) before timing.

    scripts/bench.sh experiments/generic_bench.py           # installs opacus, writes results
    .venv/bin/python experiments/generic_bench.py --rounds 5 --no-write
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dpzero  # noqa: E402
from bench_common import (dpzero_version, interleaved_steps, paired_ratios,  # noqa: E402
                          require_baseline)

V, D, H, K = 1000, 64, 128, 4
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "generic.md")


class LSTMNet(nn.Module):
    def __init__(self, lstm_cls=nn.LSTM):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.lstm = lstm_cls(D, H, batch_first=True)
        self.head = nn.Linear(H, K)

    def forward(self, ids):
        out, _ = self.lstm(self.emb(ids))
        return self.head(out[:, -1])


class MHANet(nn.Module):
    def __init__(self, mha_cls=nn.MultiheadAttention):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        # Batch-first for both: Opacus's hooks take every layer's dim 0 as the examples, so its
        # DPMultiheadAttention must be batch-first too (sequence-first, its linears would be
        # clipped per position: wrong when B = T, a shape error otherwise).
        self.attn = mha_cls(D, 4, batch_first=True)
        self.head = nn.Linear(D, K)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(self.attn(h, h, h, need_weights=False)[0].mean(1))


def _block(c_in: int, c_out: int, stride: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False),
                         nn.GroupNorm(min(32, c_out // 2), c_out), nn.ReLU())


class CNNNet(nn.Sequential):
    """Six 3 x 3 convolutions with GroupNorm, widths 32 -> 128, two strided."""

    def __init__(self):
        super().__init__(_block(3, 32, 1), _block(32, 32, 1), _block(32, 64, 2),
                         _block(64, 64, 1), _block(64, 128, 2), _block(128, 128, 1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, K))


def build(model_name: str, swap: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if model_name == "cnn":
        return CNNNet()
    if model_name == "lstm":
        if swap:
            from opacus.layers import DPLSTM
            return LSTMNet(DPLSTM)
        return LSTMNet()
    if swap:
        from opacus.layers import DPMultiheadAttention
        return MHANet(DPMultiheadAttention)
    return MHANet()


class System:
    def __init__(self, name: str, model_name: str, batch: int, seq: int, sigma: float,
                 clip: float, lr: float):
        self.name = name
        inputs = torch.randn(4 * batch, 3, seq, seq, generator=torch.Generator().manual_seed(1)) \
            if model_name == "cnn" else \
            torch.randint(0, V, (4 * batch, seq), generator=torch.Generator().manual_seed(1))
        self.data = torch.utils.data.TensorDataset(
            inputs, torch.randint(0, K, (4 * batch,), generator=torch.Generator().manual_seed(2)))
        self.x, self.y = self.data.tensors[0][:batch], self.data.tensors[1][:batch]
        model = build(model_name, swap=name == "opacus-dp-layers")
        if name == "opacus-dp-layers":  # same initial values as the others
            ref = build(model_name)
            _copy_values(ref, model, model_name)
        self.start = copy.deepcopy(model)
        if name == "torch":
            self.model = model
            self.opt = torch.optim.SGD(model.parameters(), lr=lr)
        elif name == "dpzero":
            self.p = dpzero.make_private(model, dataset=self.data, batch_size=batch,
                                         noise_multiplier=sigma, max_grad_norm=clip, lr=lr,
                                         allow_no_noise=sigma == 0, seed=0)
            self.model = model
        else:
            from opacus import PrivacyEngine

            mode = "functorch" if name == "opacus-functorch" else "hooks"
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            loader = torch.utils.data.DataLoader(self.data, batch_size=batch)
            self.model, self.opt, _ = PrivacyEngine().make_private(
                module=model, optimizer=opt, data_loader=loader, noise_multiplier=sigma,
                max_grad_norm=clip, poisson_sampling=False, grad_sample_mode=mode)

    def step(self) -> None:
        if self.name == "dpzero":
            x, y = self.p.privacy_engine.own_batch((self.x, self.y),
                                                   logical_batch_size=len(self.x))
            F.cross_entropy(self.p.model(x), y).backward()
            self.p.optimizer.step()
            self.p.optimizer.zero_grad()
            return
        self.opt.zero_grad()
        F.cross_entropy(self.model(self.x), self.y).backward()
        self.opt.step()

    def params(self) -> dict:
        if self.name == "dpzero":
            return self.p.privacy_engine.parameters()
        m = self.model._module if hasattr(self.model, "_module") else self.model
        return {n: p.detach() for n, p in m.named_parameters()}


def _copy_values(src: nn.Module, dst: nn.Module, model_name: str) -> None:
    """Opacus's DP layers hold the same weights under other names (and DPLSTM splits no
    biases differently): copy what maps one to one, by shape and order."""
    s = [p for p in src.parameters()]
    d = [p for p in dst.parameters()]
    with torch.no_grad():
        for a, b in zip(s, d):
            if a.shape == b.shape:
                b.copy_(a)


def reference(system: System, clip: float, lr: float) -> dict:
    ref = copy.deepcopy(system.start).double()
    params = dict(ref.named_parameters())
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(len(system.x)):
        ref.zero_grad()
        x = system.x[i:i + 1]
        F.cross_entropy(ref(x.double() if x.is_floating_point() else x),
                        system.y[i:i + 1]).backward()
        norm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in params.values()))
        for n, p in params.items():
            total[n] += min(1.0, clip / norm) * p.grad
    return {n: p.detach() - lr * total[n] / len(system.x) for n, p in params.items()}


def check(model_name, batch, seq, clip, lr) -> dict:
    """Relative update error of each system's first σ = 0 step against the reference."""
    out = {}
    for name in ("dpzero", "opacus-functorch", "opacus-hooks", "opacus-dp-layers"):
        if model_name == "cnn" and name == "opacus-dp-layers":
            continue
        try:
            s = System(name, model_name, batch, seq, 0.0, clip, lr)
            want = reference(s, clip, lr)
            s.step()
            got = s.params()
            start = dict(s.start.named_parameters())
            num = sum(float((got[n].double() - w).pow(2).sum()) for n, w in want.items())
            den = sum(float((w - start[n].detach().double()).pow(2).sum())
                      for n, w in want.items())
            out[name] = math.sqrt(num / den)
        except Exception as e:  # noqa: BLE001 - reported in the table
            out[name] = f"{type(e).__name__}: {str(e)[:80]}"
    return out


def run(model_name, batch, seq, rounds, warmup, systems, failures: dict) -> dict:
    built = {}
    for name in systems:
        try:
            built[name] = System(name, model_name, batch, seq, 1.0, 1.0, 0.05)
        except Exception as e:  # noqa: BLE001 - a system that cannot run is named
            failures[name] = f"{type(e).__name__}: {str(e)[:160]}"
            print(f"  {name}: cannot build ({failures[name]})", flush=True)
    return interleaved_steps(built, rounds, warmup, failures, verbose=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--models", default="lstm,mha")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    require_baseline("opacus", "generic_bench.py")
    warnings.filterwarnings("ignore")
    systems = ["torch", "dpzero", "opacus-functorch", "opacus-hooks", "opacus-dp-layers"]
    lines = []
    for model_name in args.models.split(","):
        errors = check(model_name, 8, 8, 1e-3, 1e4)  # lr: updates far above fp32 rounding
        failures: dict = {}
        # The CNN has no layer to swap: Opacus's DP-layers row would be its hooks row again.
        ran = [s for s in systems if not (model_name == "cnn" and s == "opacus-dp-layers")]
        times = run(model_name, args.batch, args.seq, args.rounds, args.warmup, ran, failures)
        shape = f"3 × {args.seq} × {args.seq} images" if model_name == "cnn" else \
            f"T = {args.seq}"
        lines += [f"### {model_name.upper()} (batch {args.batch}, {shape})", "",
                  "| system | median step (ms) | × dpzero (paired, IQR) | update error vs "
                  "reference (σ = 0) |", "|---|---|---|---|"]
        for name in ran:
            if name not in times:
                why = failures.get(name, "").replace("|", "/")
                lines.append(f"| {name} | does not run: {why} | | |")
                continue
            med = statistics.median(times[name]) * 1e3
            ratio = paired_ratios(times, name, "dpzero")
            rtxt = f"{ratio[0]:.2f} ({ratio[1]:.2f}–{ratio[2]:.2f})" if ratio else ""
            err = errors.get(name, "")
            etxt = f"{err:.1e}" if isinstance(err, float) else (err or "not checked")
            lines.append(f"| {name} | {med:.1f} | {rtxt} | {etxt} |")
        lines.append("")
        print("\n".join(lines[-(len(ran) + 5):]), flush=True)
    if not args.no_write:
        header = ["# LSTM, MultiheadAttention and a GroupNorm CNN against Opacus", "",
                  "Written by `experiments/generic_bench.py` "
                  f"({args.rounds} interleaved rounds after {args.warmup} warm-up; "
                  f"dpzero {dpzero_version()}; {os.cpu_count()} CPU cores, torch threads "
                  f"{torch.get_num_threads()}). σ = 1, C = 1, SGD. A ratio above 1 is slower "
                  "than dpzero.", ""]
        with open(RESULTS, "w") as f:
            f.write("\n".join(header + lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
