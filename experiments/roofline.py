"""The per-sample norm and clipped-sum kernels against the device's own ceilings, in one run.

Ceilings, measured first in the same process on the same device (no datasheet figures): the
GEMM rate in float64, float32 (TF32 on a GPU, as torch allows it there for this measurement),
bfloat16, and the copy rate (a clone: bytes read plus written). Then each kernel, at every T of
--seqs and layer of --layers (d_in -> d_out), B = --batch:

  ghost      dpzero::_ghost_sq_norms: the float64 Grams <A_i A_i^T, G_i G_i^T> (fused tiles below
             T = 256 on a GPU, GEMM strips from it; Note [ghost roofline])
  ghost tiles, ghost split, ghost strips  (CUDA only) the same op with its path forced through
             dpzero::_set_ghost_split_min_rows and _set_ghost_gemm_min_rows: the fused tiles, the
             split tiles (float64 tensor-core Grams, features split over blocks: Note [split
             tiles]) or the float64 GEMM strips, at every T, so the table shows which path each T
             wants on the device (by default the fused tiles below T = 256 and the strips from
             there; no T takes the split tiles until this table has been read)
  ghost x3   dpzero::_ghost_sq_norms_multi: three output gradients sharing A (query, key, value:
             A's Gram built once, Note [shared inputs]); its ms column is per layer, its rates
             are the whole call's ("ghost x3 split": the same on the split tiles, CUDA only)
  bmm64      the same float64 arithmetic as plain batched GEMMs: bmm(A, A^T), bmm(G, G^T), their
             dot; what the ghost kernel must beat
  bmm32      the same in the inputs' dtype (TF32 on a GPU for float32): what a ghost norm costs
             without float64 and so without its certification
  opacus     Opacus's per-layer path: per-sample gradients einsum("bto,bti->boi") and their norms
  products   dpzero::_add_sample_products_: the clipped sum sum_i c_i G_i^T A_i, each sample's
             product formed alone in float32 (Note [fused sample products]); against the IEEE
             float32 GEMM rate, since the clipped sum never rounds to TF32 (Note [clipped-sum
             rounding])
  products bmm  the same sum the way a batched GEMM forms it: bmm(G^T, A) in float32, written per
             sample, then summed over the samples (the path the fused op replaces)

Ghost or direct. A second table asks whether the layer-wise rule of Note [ghost or direct] (ghost
iff 2T^2 <= d_in d_out, Bu et al.'s mixed ghost clipping) picks the faster path on this device: for
each layer of --rule-layers and T of --seqs it times dpzero::linear_sq_norms with the path forced
(method 1 ghost, 2 direct; both certified) and gives the rule's pick, the faster one and their
ratio. Where the two disagree, the device wants another threshold than the memory rule.

Work model: FLOPs as the algorithm states them (Gram kernels 2BT^2(d_in + d_out) + 2BT^2 for
the dot; opacus 2BT d_in d_out + 2B d_in d_out; products 2BT d_in d_out) and compulsory bytes (the inputs read once: a
lower bound on any kernel's traffic, so the copy-rate ceiling is an upper bound on its rate; the
per-sample gradients opacus materialises may stay in a cache). Each row gives the time (median of
--repeats, the kernels of one shape interleaved), TFLOP/s, GB/s, the arithmetic intensity, the
ceiling that bounds the kernel (its dtype's GEMM rate where the intensity is past that rate's
ridge point, the copy rate below it) and the fraction of that ceiling reached. A Gram kernel that
builds only one triangle of each symmetric Gram does half the stated FLOPs, so it can pass 100 %
(up to 200 %) of its ceiling; the GEMM-based rows build both.

    .venv/bin/python experiments/roofline.py                      # CPU: B = 4, T = 64..256
    .venv/bin/python experiments/roofline.py --device cuda        # B = 32, T = 64..512, bf16
Results go to experiments/results/roofline.md (one section per device; a run replaces its own).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dpzero  # noqa: E402
from bench_common import dpzero_version, median_seconds, write_marked_section  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "roofline.md")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def timer(device: str, fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of fn after one warm-up call."""
    return median_seconds(fn, repeats, torch.cuda.synchronize if device == "cuda" else
                          (lambda: None))


def ceilings(device: str, repeats: int) -> dict:
    """Measured rates: each dtype's GEMM rate (FLOP/s, the best of two square sizes; "fp32" with
    TF32 allowed on a GPU, "fp32-ieee" without it) and the copy rate (bytes read plus written per
    second, into a buffer allocated beforehand)."""
    sizes = (4096, 8192) if device == "cuda" else (1024, 2048)
    rates = {}
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # the float32 ceiling on a GPU is TF32's
    try:
        for name, dtype in (("fp64", torch.float64), ("fp32", torch.float32),
                            ("bf16", torch.bfloat16)):
            for n in sizes:
                x = torch.randn(n, n, device=device).to(dtype)
                y = torch.randn(n, n, device=device).to(dtype)
                rate = 2 * n ** 3 / timer(device, lambda: x @ y, repeats)
                rates[name] = max(rates.get(name, 0.0), rate)
        torch.backends.cuda.matmul.allow_tf32 = False
        for n in sizes:
            x, y = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
            rate = 2 * n ** 3 / timer(device, lambda: x @ y, repeats)
            rates["fp32-ieee"] = max(rates.get("fp32-ieee", 0.0), rate)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    src = torch.randn((256 if device == "cuda" else 64) << 18, device=device)  # 256 / 64 MiB
    dst = torch.empty_like(src)
    rates["copy"] = 2 * src.numel() * 4 / timer(device, lambda: dst.copy_(src), repeats)
    return rates


def kernels(device: str, dtype: torch.dtype, b: int, t: int, d_in: int, d_out: int):
    """{name: (fn, FLOPs, bytes, ceiling dtype name)} for one shape."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(b, t, d_in, device=device, generator=gen).to(dtype)
    gs = [torch.randn(b, t, d_out, device=device, generator=gen).to(dtype) for _ in range(3)]
    g = gs[0]
    ops = torch.ops.dpzero
    esize = a.element_size()
    gram = 2 * b * t * t * (d_in + d_out) + 2 * b * t * t
    inputs = b * t * (d_in + d_out) * esize
    low = "fp32" if dtype == torch.float32 else "bf16"

    def bmm(x_a, x_g):
        ga = torch.bmm(x_a, x_a.transpose(1, 2))
        gg = torch.bmm(x_g, x_g.transpose(1, 2))
        return (ga * gg).sum((1, 2))

    def opacus():
        psg = torch.einsum("bto,bti->boi", g, a)
        return psg.reshape(b, -1).norm(2, dim=-1)

    factors = torch.ones(b, device=device)
    sums = torch.zeros(d_out, d_in, device=device)

    def products_bmm():
        per_sample = torch.bmm(g.float().transpose(1, 2), a.float())  # [B, d_out, d_in]
        return sums.add_(per_sample.sum(0))

    products = 2 * b * t * d_in * d_out
    products_bytes = inputs + 2 * 4 * d_in * d_out  # and the sum read and written
    never = 1 << 40

    def forced(split_from, strips_from, op=lambda: ops._ghost_sq_norms(a, g)):
        def run():
            split_before = ops._set_ghost_split_min_rows(split_from)
            strips_before = ops._set_ghost_gemm_min_rows(strips_from)
            try:
                return op()
            finally:
                ops._set_ghost_gemm_min_rows(strips_before)
                ops._set_ghost_split_min_rows(split_before)
        return run

    paths = {} if device != "cuda" else {
        "ghost tiles": (forced(never, never), gram, inputs, "fp64"),
        "ghost split": (forced(2, never), gram, inputs, "fp64"),
        "ghost strips": (forced(never, 2), gram, inputs, "fp64")}
    multi_gram = 2 * b * t * t * (d_in + 3 * d_out) + 3 * 2 * b * t * t
    multi_inputs = b * t * (d_in + 3 * d_out) * esize
    multi = lambda: ops._ghost_sq_norms_multi(a, gs)  # noqa: E731
    multi_paths = {} if device != "cuda" else {
        "ghost x3 split (per layer)": (forced(2, never, multi), multi_gram, multi_inputs, "fp64",
                                       3)}
    return {
        "ghost": (lambda: ops._ghost_sq_norms(a, g), gram, inputs, "fp64"),
        **paths,
        "ghost x3 (per layer)": (multi, multi_gram, multi_inputs, "fp64", 3),
        **multi_paths,
        "bmm64": (lambda: bmm(a.double(), g.double()), gram, inputs, "fp64"),
        "bmm32" if dtype == torch.float32 else "bmm16": (lambda: bmm(a, g), gram, inputs, low),
        "opacus": (opacus, 2 * b * t * d_in * d_out + 2 * b * d_in * d_out, inputs, low),
        "products": (lambda: ops._add_sample_products_(sums, g, a, factors), products,
                     products_bytes, "fp32-ieee"),
        "products bmm": (products_bmm, products, products_bytes, "fp32-ieee"),
    }


def rule_table(device: str, dtype: torch.dtype, b: int, seqs, layers, repeats: int) -> list:
    """The ghost-or-direct table (module docstring): each shape's rule pick against the faster
    path, both timed with the path forced."""
    ops = torch.ops.dpzero
    lines = ["| layer | T | ghost ms | direct ms | the rule picks | faster | rule / faster |",
             "|---|---|---|---|---|---|---|"]
    agree = 0
    for d_in, d_out in layers:
        for t in seqs:
            gen = torch.Generator(device=device).manual_seed(1)
            a = torch.randn(b, t, d_in, device=device, generator=gen).to(dtype)
            g = torch.randn(b, t, d_out, device=device, generator=gen).to(dtype)
            ms = {m: 1e3 * timer(device, lambda m=m: ops.linear_sq_norms(a, g, False, m), repeats)
                  for m in (1, 2)}
            pick = 1 if bool(ops.ghost_is_cheaper(t, d_in, d_out)) else 2
            fast = min(ms, key=ms.get)
            agree += pick == fast
            name = {1: "ghost", 2: "direct"}
            lines.append(f"| {d_in}->{d_out} | {t} | {ms[1]:.3f} | {ms[2]:.3f} | {name[pick]} | "
                         f"{name[fast]} | {ms[pick] / ms[fast]:.2f} |")
            print(lines[-1], flush=True)
    total = len(layers) * len(seqs)
    return [f"Ghost or direct: the rule picks the faster path in {agree} of {total} shapes.", ""] \
        + lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                        help="the inputs' dtype (default fp32 on CPU, bf16 on CUDA)")
    parser.add_argument("--batch", type=int, default=None, help="B (default 4 on CPU, 32 on CUDA)")
    parser.add_argument("--seqs", default=None, help="T values (default 64,128,256; CUDA adds 512)")
    parser.add_argument("--layers", default="768x768,768x3072",
                        help="d_in x d_out, comma-separated")
    parser.add_argument("--rule-layers", default="64x64,256x256,768x768,768x3072",
                        help="d_in x d_out of the ghost-or-direct table, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not (torch.cuda.is_available() and dpzero._C.with_cuda):
        sys.exit("roofline: --device cuda needs a GPU and dpzero built with its CUDA kernels")
    dtype_name = args.dtype or ("bf16" if cuda else "fp32")
    dtype = DTYPES[dtype_name]
    b = args.batch or (32 if cuda else 4)
    seqs = [int(x) for x in (args.seqs or ("64,128,256,512" if cuda else "64,128,256")).split(",")]
    layers = [tuple(int(v) for v in x.split("x")) for x in args.layers.split(",")]

    peak = ceilings(args.device, args.repeats)
    lines = ["| ceiling | rate |", "|---|---|"]
    lines += [f"| {name} GEMM | {peak[name] / 1e12:.2f} TFLOP/s |"
              for name in ("fp64", "fp32", "fp32-ieee", "bf16")]
    lines += [f"| copy | {peak['copy'] / 1e9:.0f} GB/s |", ""]
    head = ["layer", "T", "kernel", "ms", "TFLOP/s", "GB/s", "FLOP/byte", "bound by",
            "of the ceiling"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    print("\n".join(lines), flush=True)
    for d_in, d_out in layers:
        for t in seqs:
            ks = kernels(args.device, dtype, b, t, d_in, d_out)
            for name, (fn, flops, nbytes, rate_name, *per) in ks.items():
                seconds = timer(args.device, fn, args.repeats)
                intensity = flops / nbytes
                ridge = peak[rate_name] / peak["copy"]
                compute_bound = intensity >= ridge
                ceiling = peak[rate_name] if compute_bound else intensity * peak["copy"]
                achieved = flops / seconds
                row = [f"{d_in}->{d_out}", str(t), name,
                       f"{1e3 * seconds / (per[0] if per else 1):.3f}",
                       f"{achieved / 1e12:.2f}", f"{nbytes / seconds / 1e9:.0f}",
                       f"{intensity:.0f}",
                       f"{rate_name} GEMM" if compute_bound else "copy rate",
                       f"{achieved / ceiling:.0%}"]
                lines.append("| " + " | ".join(row) + " |")
                print(lines[-1], flush=True)
    lines += ["", *rule_table(args.device, dtype, b, seqs,
                              [tuple(int(v) for v in x.split("x"))
                               for x in args.rule_layers.split(",")], args.repeats)]
    if not args.no_write:
        where = (f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}" if cuda else
                 f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                 f"{torch.get_num_threads()} torch threads")
        section = [f"<!-- roofline:{args.device}:begin -->",
                   f"## {args.device.upper()} ({dtype_name} inputs, B = {b})", "",
                   f"Run {datetime.date.today().isoformat()} on {where}; "
                   f"torch {torch.__version__}; "
                   f"{dpzero_version()}; command `experiments/roofline.py "
                   f"{' '.join(sys.argv[1:])}`.", ""] + lines + \
                  [f"<!-- roofline:{args.device}:end -->"]
        write_marked_section(args.out, f"roofline:{args.device}",
                             "# The norm and clipped-sum kernels against the device's "
                             "ceilings\n\nWritten by `experiments/roofline.py` (its docstring "
                             "says what each column measures).\n", "\n".join(section))
    return 0


if __name__ == "__main__":
    sys.exit(main())
