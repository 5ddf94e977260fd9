"""Host overhead of a private step: a model so small that arithmetic is negligible, so
the step time is framework time, private against non-private, with Opacus alongside.

The model is a GPT-2 of 12 layers, width 64, 4 heads (transformers' GPT2LMHeadModel from a
config), T = 16, B = 4, one torch thread: 0.6 M parameters, about 40 MFLOP a step, which the
machine does in about a millisecond; the rest is Python and dispatch.

Systems (each a full step: forward, backward, clipping where private, noise, update; SGD):
  torch            non-private PyTorch (the floor)
  dpzero           dpzero.make_private at ZeRO stage 0, flat clipping, σ = 1
  opacus-hooks     Opacus 1.6, grad_sample_mode="hooks" (its grad samplers; torch.func for the
                   modules it has none for, such as transformers' Conv1D), given position ids
                   [B, T] (with GPT-2's own [1, T] its step fails)
  opacus-functorch Opacus 1.6, grad_sample_mode="functorch", the same

Timing: rounds interleave one step of every system; the table gives each system's median step
time, its median paired ratio to torch (experiments/bench_common.py), and for dpzero the
functions its step spends its own time in (cProfile over separate rounds, after the timing).

    scripts/bench.sh experiments/host_overhead.py            # installs opacus, writes results
    .venv/bin/python experiments/host_overhead.py --rounds 5 --no-write
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dpzero  # noqa: E402
from bench_common import (dpzero_version, interleaved_steps, paired_ratios,  # noqa: E402
                          require_baseline, write_marked_section)

LAYERS, WIDTH, HEADS, T, B, VOCAB = 12, 64, 4, 16, 4, 256
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "host.md")
SYSTEMS = ("torch", "dpzero", "opacus-hooks", "opacus-functorch")


def build() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=WIDTH, n_layer=LAYERS,
                                  n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: logits [B, T, V], ids [B, T]."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


class Logits(torch.nn.Module):
    """ids [B, T] -> logits [B, T, V]. ``expand_positions``: pass position ids [B, T] (Opacus
    computes per-sample gradients only for layers whose input has the batch's rows, and GPT-2's
    own position ids are [1, T]: its step fails stacking [B] and [1] norms without this)."""

    def __init__(self, model: torch.nn.Module, expand_positions: bool = False) -> None:
        super().__init__()
        self.m, self.expand_positions = model, expand_positions

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.expand_positions:
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            return self.m(ids, position_ids=positions).logits
        return self.m(ids).logits


class System:
    def __init__(self, name: str) -> None:
        self.name = name
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, VOCAB, (8 * B, T), generator=g)
        self.data = torch.utils.data.TensorDataset(ids, ids)
        self.x = ids[:B]
        model = Logits(build(), expand_positions=name.startswith("opacus"))
        if name == "torch":
            self.model, self.opt = model, torch.optim.SGD(model.parameters(), lr=0.01)
        elif name == "dpzero":
            self.p = dpzero.make_private(model, dataset=self.data, batch_size=B,
                                         noise_multiplier=1.0, max_grad_norm=1.0, lr=0.01,
                                         seed=0)
        else:
            from opacus import PrivacyEngine

            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            loader = torch.utils.data.DataLoader(self.data, batch_size=B)
            self.model, self.opt, _ = PrivacyEngine().make_private(
                module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
                max_grad_norm=1.0, poisson_sampling=False,
                grad_sample_mode="hooks" if name == "opacus-hooks" else "functorch")

    def step(self) -> None:
        if self.name == "dpzero":
            (x,) = self.p.privacy_engine.own_batch((self.x,), logical_batch_size=B)
            lm_loss(self.p.model(x), x).backward()
            self.p.optimizer.step()
            self.p.optimizer.zero_grad()
            return
        self.opt.zero_grad()
        lm_loss(self.model(self.x), self.x).backward()
        self.opt.step()


def timed(rounds: int, warmup: int, failures: dict) -> dict:
    built = {}
    for name in SYSTEMS:
        try:
            built[name] = System(name)
        except Exception as e:  # noqa: BLE001 - a system that cannot run is named
            failures[name] = f"{type(e).__name__}: {str(e)[:160]}"
    return interleaved_steps(built, rounds, warmup, failures)


def profile_dpzero(rounds: int, top: int) -> list:
    """(function, calls per step, own ms per step, cumulative ms per step) of the dpzero step's
    heaviest functions by own time."""
    s = System("dpzero")
    for _ in range(2):
        s.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(rounds):
        s.step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    rows = []
    for (path, line, fn), (_, calls, own, cum, _) in stats.items():
        where = path.split("site-packages/")[-1] if "site-packages/" in path else \
            os.path.basename(path)
        rows.append((f"{where}:{line} {fn}", calls / rounds, 1e3 * own / rounds,
                     1e3 * cum / rounds))
    rows.sort(key=lambda r: -r[2])
    return rows[:top]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile-rounds", type=int, default=10)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    require_baseline("opacus", "host_overhead.py")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    failures: dict = {}
    times = timed(args.rounds, args.warmup, failures)
    lines = [f"GPT-2, {LAYERS} layers, width {WIDTH}, {HEADS} heads, vocabulary {VOCAB}; "
             f"T = {T}, B = {B}; one torch thread.", "",
             "| system | median step (ms) | × torch (paired, IQR) | over torch (ms) |",
             "|---|---|---|---|"]
    floor = statistics.median(times["torch"]) * 1e3 if "torch" in times else None
    for name in SYSTEMS:
        if name not in times:
            lines.append(f"| {name} | does not run: {failures.get(name, '')} | | |")
            continue
        med = statistics.median(times[name]) * 1e3
        ratio = paired_ratios(times, name, "torch")
        rtxt = f"{ratio[0]:.2f} ({ratio[1]:.2f}–{ratio[2]:.2f})" if ratio else ""
        over = f"{med - floor:+.1f}" if floor is not None else ""
        lines.append(f"| {name} | {med:.1f} | {rtxt} | {over} |")
    lines += ["", f"dpzero's step by own time (cProfile, {args.profile_rounds} steps; the "
              "profiler's own cost inflates call-heavy rows):", "",
              "| function | calls / step | own ms / step | cumulative ms / step |",
              "|---|---|---|---|"]
    for fn, calls, own, cum in profile_dpzero(args.profile_rounds, 25):
        lines.append(f"| `{fn}` | {calls:.0f} | {own:.2f} | {cum:.2f} |")
    print("\n".join(lines), flush=True)
    if not args.no_write:
        section = ["<!-- host:begin -->",
                   "Written by `experiments/host_overhead.py` "
                   f"({args.rounds} interleaved rounds after {args.warmup} warm-up; "
                   f"{dpzero_version()}; {os.cpu_count()} CPU cores). σ = 1, C = 1, SGD. The "
                   "target: dpzero ≤ 1.2× torch.", ""] + lines + ["<!-- host:end -->"]
        write_marked_section(RESULTS, "host", "# Host overhead of a private step\n",
                             "\n".join(section))
    return 0


if __name__ == "__main__":
    sys.exit(main())
