"""Does the planner's model (python/dpzero/planner/, Notes [planner profile], [planner memory
model], [planner time model]) predict what the runs measure? The CPU grid's GPT-2-style shapes
(experiments/run.py) on two Gloo ranks, private (σ 1, C 1, AdamW), in each memory policy the
planner considers for them: ZeRO stages 1-3, no / the first half / every block checkpointed;
flat and layer-wise clipping.

For each shape and clipping mode:
  profile   ``dpzero.planner.profile`` on two fresh Gloo ranks of one thread each (timed probes at
            stage 2, memory probes at stages 1 and 3, each with and without checkpointing), and
            the all-gather bandwidth;
  predict   peak live bytes per rank and step time for every policy;
  measure   each policy alone in fresh processes: peak live tensor bytes per rank, counted by
            dpzero's tracking CPU allocator from before the model is built
            (``dpzero.planner.measure.tracked``: storage bytes on every thread, not RSS; max over
            ranks, over two steps after two warm-up steps), and step times interleaved round by
            round as in run.py (median and IQR of the max over ranks).
Then: the error of each peak prediction, and whether the predicted order of the policies' step
times agrees with the measured order for every pair whose measured IQRs do not overlap.

Usage: .venv/bin/python experiments/plan_check.py [--shapes gpt-4x256,gpt-6x512]
Writes experiments/results/plan-cpu.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run as R  # noqa: E402

from dpzero.planner import Policy, Profile, measure_collectives, predict, profile, tracked  # noqa
from bench_common import dpzero_version  # noqa: E402

MIB = 2.0**20
CFG = dict(device="cpu", threads=1, warmup=2, repeats=6)
SYSTEMS = {  # harness name -> (stage, checkpointed blocks: 0, "half" or "all")
    "dp1-{c}": (1, 0), "dp2-{c}": (2, 0), "dp3-{c}": (3, 0),
    "dp1-{c}-ckpthalf": (1, "half"), "dp2-{c}-ckpthalf": (2, "half"),
    "dp3-{c}-ckpthalf": (3, "half"),
    "dp1-{c}-ckpt": (1, "all"), "dp2-{c}-ckpt": (2, "all"), "dp3-{c}-ckpt": (3, "all"),
}


def profile_rank(rank, world, store, shape_name, clipping, out):
    warnings.filterwarnings("ignore")
    shape = R.SHAPES[shape_name]
    with R.rank_session(rank, world, store, CFG):
        idx, tgt = R.local(R.batches(shape, world)[0], rank, shape["micro_batch"], "cpu")
        loss = R.SequenceLoss()
        prof = profile(lambda: R.make_model(shape, "cpu"), lambda m: loss(m(idx), tgt), len(idx),
                       units=[f"blocks.{i}" for i in range(shape["layers"])], clipping=clipping,
                       optimizer="adamw", optimizer_kwargs=R.ADAMW, threads=1,
                       group=dist.group.WORLD)
        if rank == 0:
            torch.save(prof.to_dict(), out)


def bandwidth_rank(rank, world, store, out):
    with R.rank_session(rank, world, store, CFG):
        bw = measure_collectives()
        if rank == 0:
            torch.save(bw, out)


def memory_rank(rank, world, store, shape_name, name, out):
    warnings.filterwarnings("ignore")
    shape = R.SHAPES[shape_name]
    with R.rank_session(rank, world, store, CFG):
        data = R.batches(shape, world)
        micro = shape["micro_batch"]
        with tracked() as t:
            system = R.System(R.parse(name), shape, world, "cpu", R.dataset_for(shape, world))
            for k in range(2):
                system.step(*R.local(data[k], rank, micro, "cpu"))
            t.mark("steps")
            for k in range(2):
                system.step(*R.local(data[2 + k], rank, micro, "cpu"))
        peak = torch.tensor([t.peak_since("steps")], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if rank == 0:
            torch.save(int(peak.item()), out)
        del system


def iqr(values):
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def check_shape(shape_name, tmp):
    rows, notes = [], []
    bw = R.spawn(bandwidth_rank, 2, tmp, f"bw_{shape_name}")
    for clipping in ("flat", "layer"):
        prof = Profile.from_dict(R.spawn(profile_rank, 2, tmp, f"p_{shape_name}_{clipping}",
                                         shape_name, clipping))
        names = [n.format(c=clipping) for n in SYSTEMS]
        t0 = time.time()
        timing = R.spawn(R.timing_rank, 2, tmp, f"t_{shape_name}_{clipping}",
                         R.SHAPES[shape_name], names, CFG)
        for name, (stage, ckpt) in zip(names, SYSTEMS.values()):
            n = len(prof.units)
            policy = Policy(stage, {0: 0, "half": n // 2, "all": n}[ckpt])
            pred = predict(prof, policy, 2, bw)
            measured = R.spawn(memory_rank, 2, tmp, f"m_{shape_name}_{name}", shape_name, name)
            times = timing["times"].get(name)
            rows.append(dict(shape=shape_name, clipping=clipping, system=name,
                             policy=policy.label(len(prof.units)),
                             predicted_MiB=pred.peak_bytes / MIB, measured_MiB=measured / MIB,
                             error=pred.peak_bytes / measured - 1.0,
                             predicted_ms=pred.step_s * 1e3,
                             measured_ms=statistics.median(times) * 1e3 if times else None,
                             iqr_ms=tuple(x * 1e3 for x in iqr(times)) if times else None,
                             breakdown={k: v / MIB for k, v in pred.memory.items()}))
        print(f"{shape_name} {clipping}: {time.time() - t0:.0f} s", flush=True)
        notes.append((shape_name, clipping, prof, bw))
    return rows, notes


def ranking(rows):
    """Pairs of policies (same shape and clipping) whose measured IQRs do not overlap: does the
    predicted order agree?"""
    agree, total, wrong = 0, 0, []
    groups = {}
    for r in rows:
        groups.setdefault((r["shape"], r["clipping"]), []).append(r)
    for group in groups.values():
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                if a["iqr_ms"] is None or b["iqr_ms"] is None:
                    continue
                if a["iqr_ms"][1] < b["iqr_ms"][0] or b["iqr_ms"][1] < a["iqr_ms"][0]:
                    total += 1
                    same = (a["measured_ms"] < b["measured_ms"]) == \
                        (a["predicted_ms"] < b["predicted_ms"])
                    agree += same
                    if not same:
                        wrong.append(f"{a['system']} vs {b['system']} ({a['shape']})")
    return agree, total, wrong


def write(rows, notes, args, elapsed):
    agree, total, wrong = ranking(rows)
    worst = max(abs(r["error"]) for r in rows)
    lines = [
        "# The planner's model against measured runs (CPU, two Gloo ranks)", "",
        f"Run {datetime.date.today()} on {platform.machine()}, {os.cpu_count()} cores; torch "
        f"{torch.__version__}; dpzero {dpzero_version()}; {elapsed:.0f} s. Written by "
        "`.venv/bin/python experiments/plan_check.py` (its docstring says how each figure is "
        "measured).", "",
        "Peak: live tensor bytes per rank (dpzero's tracking CPU allocator, not RSS), "
        "predicted from a two-rank profile of the same model (Note [planner memory model] in "
        "python/dpzero/planner/model.py). The profile probes each stage with no and with every "
        "block checkpointed, so those rows compare a probe with a run of the same policy "
        "(they test the probe and the model-state formulas); the -ckpthalf rows are "
        "interpolated by the model. Step: one micro-batch of 4 per rank; predicted by Note "
        "[planner time model] from the stage-2 probes' times.", "",
        "| shape | system | policy | predicted peak MiB | measured peak MiB | error | "
        "predicted step ms | measured step ms (IQR) |",
        "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = "" if r["measured_ms"] is None else \
            f"{r['measured_ms']:.0f} ({r['iqr_ms'][0]:.0f}–{r['iqr_ms'][1]:.0f})"
        lines.append(f"| {r['shape']} | {r['system']} | {r['policy']} | "
                     f"{r['predicted_MiB']:.1f} | {r['measured_MiB']:.1f} | "
                     f"{100 * r['error']:+.1f}% | {r['predicted_ms']:.0f} | {ms} |")
    lines += ["", f"Largest peak error: {100 * worst:.1f}% (target: within 10%).", "",
              f"Ranking by step time: {agree} of {total} pairs whose measured IQRs do not "
              f"overlap are ordered as predicted" + (f"; wrong: {', '.join(wrong)}" if wrong
                                                     else "") + ".", "",
              "Profiles (two ranks, one thread each; MiB and ms):", ""]
    for shape, clipping, prof, bw in notes:
        lines.append(f"- {shape} {clipping}: between {prof.between['none'] / MIB:.1f}, "
                     f"workspace {prof.workspace / MIB:.1f}, transient none / all at stage "
                     f"2 {prof.transient['none'] / MIB:.1f} / {prof.transient['all'] / MIB:.1f}"
                     + "".join(f", {s} {t['none'] / MIB:.1f} / {t['all'] / MIB:.1f}"
                               for s, t in sorted(prof.transient_at.items())) + "; "
                     f"compute none / all {1e3 * prof.compute_s['none']:.0f} / "
                     f"{1e3 * prof.compute_s['all']:.0f}, optimizer "
                     f"{1e3 * prof.optimizer_s:.0f}; all-gather {bw[0] / 1e9:.2f} GB/s, "
                     f"{1e6 * bw[1]:.0f} µs per call")
    lines.append("")
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="gpt-4x256,gpt-6x512")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "plan-cpu.md"))
    args = parser.parse_args()
    start = time.time()
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            r, n = check_shape(shape, tmp)
            rows += r
            notes += n
    write(rows, notes, args, time.time() - start)


if __name__ == "__main__":
    main()
