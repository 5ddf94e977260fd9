"""Per-sample clipping cost for GPT-2-small-like Linear layers, three ways side by side in one run:

  (a) dpzero   torch.ops.dpzero.linear_clip: per-sample norms (ghost or direct by the cost rule
               2T^2 <= d_in d_out), flat clip factors and the clipped sum G^T diag(c) A, one call;
  (b) plain    the non-private weight-gradient GEMM G^T A that autograd runs (the baseline);
  (c) opacus   Opacus-style materialisation: per-sample gradients einsum("bto,bti->boi"), their
               norms, factors min(1, C/(n+1e-6)), then the clipped sum einsum("b,boi->oi").

Shapes: Linear 768->768 and 768->3072 (GPT-2 small), T in {128, 512}, B in {8, ..., 64}. Each
(shape, method) runs in a fresh subprocess so that its peak memory is its own:
  CPU   peak = the process's peak resident size during the first call (VmHWM, reset to the
        current size through /proc/self/clear_refs just before the call) minus its resident size
        before it (VmRSS), so it counts the output and every temporary, not the inputs; glibc's
        mmap threshold is fixed (MALLOC_MMAP_THRESHOLD_) so freed blocks leave the resident set.
        Where the reset is refused it falls back to the growth of ru_maxrss (RUSAGE_SELF), which
        can only under-count, and the results say so;
  CUDA  peak = torch.cuda.max_memory_allocated() during the first call - memory allocated before.
Time: one more fresh process per shape calls the methods interleaved (a, b, c, a, b, c, ...) after
a warm-up call of each, and reports each method's median of --repeats calls. A fourth column, (a')
"other path", times dpzero with the norm path the cost rule did NOT pick (memory and time), to show
what the memory-based rule costs or saves in time. On a GPU the table also gives achieved TFLOP/s
and GB/s against a model of the work: FLOPs of the algorithm as stated (ghost Grams
2BT^2(d_in+d_out), direct / per-sample / clipped-sum GEMMs 2BT d_in d_out, Opacus norms and sum
2B d_in d_out each) and compulsory bytes (inputs read once per pass, per-sample gradients written
once and read twice, outputs written once).

Usage: .venv/bin/python experiments/kernel_bench.py                 # CPU subset, a few minutes
       .venv/bin/python experiments/kernel_bench.py --full          # B = 8, 16, 32, 64
       .venv/bin/python experiments/kernel_bench.py --device cuda   # bf16 by default on CUDA
Results go to experiments/results/kernels.md (one section per device; a run replaces its own).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "kernels.md")
LAYERS = [(768, 768), (768, 3072)]
METHODS = ["dpzero", "other", "plain", "opacus"]
CLIP = 1.0


# ---- one measurement (child process) -------------------------------------------------------------

PEAK_RESET = False


def proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> bool:
    """Resets this process's peak resident set size (VmHWM) to its current size (Linux >= 4.0)."""
    global PEAK_RESET
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        PEAK_RESET = True
    except OSError:
        PEAK_RESET = False
    return PEAK_RESET


def child(spec: dict) -> dict:
    import torch

    import dpzero  # noqa: F401  (loads the dpzero ops)

    device = spec["device"]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[spec["dtype"]]
    b, t, d_in, d_out = spec["B"], spec["T"], spec["d_in"], spec["d_out"]
    gen = torch.Generator(device=device).manual_seed(0)
    A = torch.randn(b, t, d_in, device=device, dtype=dtype, generator=gen)
    G = torch.randn(b, t, d_out, device=device, dtype=dtype, generator=gen).mul_(0.01)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def dpzero_clip():
        return torch.ops.dpzero.linear_clip(A, G, CLIP, "flat", 0.01, False, False, 0)[0]

    other_method = 2 if torch.ops.dpzero.ghost_is_cheaper(t, d_in, d_out) else 1

    def dpzero_other():
        return torch.ops.dpzero.linear_clip(A, G, CLIP, "flat", 0.01, False, False, other_method)[0]

    def plain():
        return G.reshape(-1, d_out).t() @ A.reshape(-1, d_in)

    def opacus():
        psg = torch.einsum("bto,bti->boi", G, A)  # [B, d_out, d_in]
        norms = psg.reshape(b, -1).norm(2, dim=-1).float()
        factors = (CLIP / (norms + 1e-6)).clamp(max=1.0)
        return torch.einsum("b,boi->oi", factors.to(psg.dtype), psg)

    fns = {"dpzero": dpzero_clip, "other": dpzero_other, "plain": plain, "opacus": opacus}
    if spec["mode"] == "time":
        # All three methods in this one process, interleaved call by call, so that a change in
        # machine load hits them alike; each is warmed up first.
        for fn in fns.values():
            fn()
        times = {m: [] for m in METHODS}
        for _ in range(spec["repeats"]):
            for m in METHODS:
                sync()
                t0 = time.perf_counter()
                fns[m]()
                sync()
                times[m].append(time.perf_counter() - t0)
        return {
            "time_s": {m: statistics.median(v) for m, v in times.items()},
            "threads": torch.get_num_threads(),
        }

    fn = fns[spec["method"]]
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    elif reset_peak_rss():
        before = proc_status_kib("VmRSS")
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = fn()
    sync()
    if cuda:
        peak = torch.cuda.max_memory_allocated() - before
    elif PEAK_RESET:
        peak = (proc_status_kib("VmHWM") - before) * 1024
    else:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    return {"peak_bytes": peak, "checksum": float(out.double().sum()), "peak_reset": PEAK_RESET}


# ---- the grid (parent process) -------------------------------------------------------------------


def run_child(spec: dict) -> dict:
    # A fixed mmap threshold makes glibc return every large block to the OS when it is freed, so
    # resident memory tracks live tensors instead of keeping freed heap pages around for reuse.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {spec} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def model(method: str, b: int, t: int, d_in: int, d_out: int, esize: int, ghost: bool):
    """(FLOPs, compulsory bytes) of one call; `ghost` says which norm path dpzero takes."""
    inputs = b * t * (d_in + d_out) * esize
    gemm = 2 * b * t * d_in * d_out
    out = 4 * d_in * d_out
    if method == "plain":
        return gemm, inputs + out
    if method in ("dpzero", "other"):
        norms = 2 * b * t * t * (d_in + d_out) if ghost else gemm
        return norms + gemm, 2 * inputs + out
    psg = b * d_in * d_out * esize
    return gemm + 4 * b * d_in * d_out, inputs + 3 * psg + out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["fp32", "bf16", "fp16"],
        help="default fp32 on CPU, bf16 on CUDA",
    )
    parser.add_argument("--full", action="store_true", help="B = 8, 16, 32, 64 (default: 8, 32)")
    parser.add_argument(
        "--batches", default=None, help="comma-separated B values (overrides --full)"
    )
    parser.add_argument("--seqs", default="128,512", help="comma-separated T values")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return

    import torch

    import dpzero

    if args.device == "cuda" and not (torch.cuda.is_available() and dpzero._C.with_cuda):
        sys.exit("kernel_bench: --device cuda needs a GPU and dpzero built with its CUDA kernels")
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    esize = 4 if dtype == "fp32" else 2
    batches = [int(x) for x in (args.batches or ("8,16,32,64" if args.full else "8,32")).split(",")]
    seqs = [int(x) for x in args.seqs.split(",")]
    gpu = args.device == "cuda"

    # fmt: off
    head = ["layer", "T", "B", "path", "dpzero ms", "other path ms", "plain ms", "opacus ms",
            "dpzero/plain time", "other/plain time", "opacus/plain time",
            "dpzero MiB", "other path MiB", "plain MiB", "opacus MiB"]
    if gpu:
        head += [f"{m} TFLOP/s" for m in METHODS] + [f"{m} GB/s" for m in METHODS]
    # fmt: on
    rows = []
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head), flush=True)
    threads, peak_reset = None, True
    for d_in, d_out in LAYERS:
        for t in seqs:
            for b in batches:
                ghost = bool(torch.ops.dpzero.ghost_is_cheaper(t, d_in, d_out))
                base = {
                    "device": args.device,
                    "dtype": dtype,
                    "B": b,
                    "T": t,
                    "d_in": d_in,
                    "d_out": d_out,
                    "repeats": args.repeats,
                }
                res = {m: run_child({**base, "mode": "memory", "method": m}) for m in METHODS}
                timing = run_child({**base, "mode": "time"})
                threads = timing["threads"]
                for m in METHODS:
                    res[m]["time_s"] = timing["time_s"][m]
                    peak_reset = peak_reset and res[m]["peak_reset"]
                ref = res["opacus"]["checksum"]
                if abs(res["dpzero"]["checksum"] - ref) > 1e-2 * max(1.0, abs(ref)):
                    print(
                        "warning: dpzero and opacus clipped sums differ: "
                        f"{res['dpzero']['checksum']} vs {ref}",
                        file=sys.stderr,
                    )
                ms = {m: 1e3 * res[m]["time_s"] for m in METHODS}
                mib = {m: res[m]["peak_bytes"] / 2**20 for m in METHODS}
                row = [f"{d_in}->{d_out}", str(t), str(b), "ghost" if ghost else "direct"]
                row += [f"{ms[m]:.2f}" for m in METHODS]
                row += [f"{ms[m] / ms['plain']:.2f}" for m in ("dpzero", "other", "opacus")]
                row += [f"{mib[m]:.1f}" for m in METHODS]
                if gpu:
                    paths = {"dpzero": ghost, "other": not ghost}
                    work = {
                        m: model(m, b, t, d_in, d_out, esize, paths.get(m, False)) for m in METHODS
                    }
                    row += [f"{work[m][0] / res[m]['time_s'] / 1e12:.1f}" for m in METHODS]
                    row += [f"{work[m][1] / res[m]['time_s'] / 1e9:.0f}" for m in METHODS]
                rows.append(row)
                print("| " + " | ".join(row) + " |", flush=True)

    write_section(args, dtype, head, rows, threads, peak_reset)


def write_section(args, dtype, head, rows, threads, peak_reset) -> None:
    import torch

    if args.device == "cuda":
        where = f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
        memory = (
            "peak = torch.cuda.max_memory_allocated() during the first call minus the memory "
            "allocated before it (inputs excluded)"
        )
    else:
        cpu = platform.processor() or platform.machine()
        where = f"{cpu}, {os.cpu_count()} cores, {threads} torch threads"
        memory = (
            "peak resident memory of a fresh process per (shape, method) during the first call "
            "(VmHWM reset via /proc/self/clear_refs) minus its resident memory before it: output "
            "and temporaries, inputs excluded"
            if peak_reset
            else "growth of ru_maxrss (RUSAGE_SELF) over the first call in a fresh process per "
            "(shape, "
            "method); the peak reset was refused, so small peaks may be under-counted"
        )
    section = "\n".join(
        [
            f"<!-- kernel_bench:{args.device}:begin -->",
            f"## {args.device.upper()} ({dtype})",
            "",
            f"Run {datetime.date.today().isoformat()} on {where}; torch {torch.__version__}; "
            f"command `{' '.join(['experiments/kernel_bench.py', *sys.argv[1:]])}`.",
            f"Time: median of {args.repeats} calls per method, the methods interleaved in one "
            f"process after a warm-up call each. Memory: {memory}. Ratios are against (b), "
            "measured in the same run. 'other path' = dpzero forced onto the norm path the rule "
            "did not pick.",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
            *["| " + " | ".join(r) + " |" for r in rows],
            f"<!-- kernel_bench:{args.device}:end -->",
        ]
    )
    title = (
        "# Per-sample clipping kernels: time and memory\n\n"
        "Written by `experiments/kernel_bench.py` (see its docstring for what each column "
        "measures). (a) dpzero = `dpzero::linear_clip` (norms by the cost rule, flat clip, "
        "clipped sum), (b) plain = the non-private weight-gradient GEMM G^T A, (c) opacus = "
        "per-sample gradients materialised, then norms and the clipped sum. 'path' is the norm "
        "path the cost rule picks (ghost iff 2T^2 <= d_in d_out).\n"
    )
    text = open(args.out).read() if os.path.exists(args.out) else title
    pattern = re.compile(
        rf"<!-- kernel_bench:{args.device}:begin -->.*?<!-- kernel_bench:{args.device}:end -->",
        re.S,
    )
    text = (
        pattern.sub(lambda _: section, text)
        if pattern.search(text)
        else text.rstrip("\n") + "\n\n" + section
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text.rstrip("\n") + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
