"""The DP-ZeRO paper's configurations (Bu, Chiu, Liu, Zha, Karypis, "Zero redundancy distributed
learning with differential privacy", arXiv 2311.11822 / MLSys 2026), written down so that the
harness (experiments/run.py) can set our model-state predictions beside the published figures and
a GPU machine can run the same rows.

Sources, and how sure each value is:
  * published figures: as quoted in this project's brief (DP / non-DP throughput about 81-84% at
    ZeRO-1/2 and 94-95% at ZeRO-3 for ViT-Gigantic and GPT2-XL; mixed-precision DP using 46-74% of
    the full-precision non-DP model-state memory; one A100, GPT-2, batch 100: non-DP / book-keeping
    / ghost clipping / Opacus = 341 / 274 / 209 / out of memory examples/s). A research pass in
    this session could not reach the paper's tables (only its abstract is in the offline corpora),
    so these are not independently checked here;
  * hardware: A100-40GB, micro-batch 4 per GPU (the brief); 8 GPUs is the GPU count of the authors'
    released DP-ZeRO scripts (awslabs/fast-differential-privacy, run_ZERO1.sh / run_ZERO23.sh), not
    read from the paper;
  * model shapes: ViT-Gigantic = timm's vit_gigantic_patch14_224 (depth 48, width 1664, 16 heads,
    MLP 8192, patch 14, 224 px), the default model of the authors' DP-ZeRO CIFAR script (100
    classes); GPT-2 small / medium / large / XL = the public GPT-2 configurations (Radford et al.
    2019; vocabulary 50257, context 1024); E2E-length sequences = 100 tokens (max_seq_len of the
    authors' E2E scripts).

Model-state prediction (src/zero/memory.h, Rajbhandari et al. 2020 §5.1): per GPU, with p bytes
per compute parameter, g per gradient element and K of optimizer state (Adam: 8, plus a 4-byte
fp32 master under mixed precision):
  non-DP fp32 p = 4, g = 4, K = 8;   non-DP mixed p = 2, g = 2, K = 12;
  DP fp32     p = 4, g = 4, K = 8;   DP mixed (dpzero) p = 2, g = 4, K = 12 — dpzero keeps
  clipped sums in fp32 up to the reduction (design.md §4), so its DP gradients cost 4 bytes where
  a 16-bit non-DP reduction costs 2.
Activations, per-sample norms and the book-keeping (A, G) buffers are not model state and are not
in these figures (the predicted peak-memory table adds them).
"""

from __future__ import annotations

import os

import torch

from dpzero import _C

GIB = 2.0**30
A100_BYTES = 40 * GIB
GPUS = 8
MICRO_BATCH = 4


def vit_params(depth, width, mlp, patch=14, image=224, classes=100) -> int:
    tokens = (image // patch) ** 2 + 1
    block = (3 * width * width + 3 * width) + (width * width + width) \
        + (width * mlp + mlp) + (mlp * width + width) + 4 * width
    return (depth * block + patch * patch * 3 * width + width  # patch embedding
            + tokens * width + width  # position embedding, class token
            + 2 * width + width * classes + classes)  # final norm, head


def gpt2_params(layers, width, vocab=50257, context=1024) -> int:
    block = 4 * width + (3 * width * width + 3 * width) + (width * width + width) \
        + (4 * width * width + 4 * width) + (4 * width * width + width)
    return layers * block + vocab * width + context * width + 2 * width  # head tied to wte


MODELS = [  # name, parameters, what it is
    ("ViT-Gigantic", vit_params(48, 1664, 8192), "depth 48, width 1664, 16 heads, MLP 8192, "
     "patch 14, 224 px (timm vit_gigantic_patch14_224), 100 classes"),
    ("GPT2-XL", gpt2_params(48, 1600), "48 layers, d 1600, 25 heads, vocab 50257"),
    ("GPT2-large", gpt2_params(36, 1280), "36 layers, d 1280, 20 heads"),
    ("GPT2-medium", gpt2_params(24, 1024), "24 layers, d 1024, 16 heads"),
    ("GPT2-small", gpt2_params(12, 768), "12 layers, d 768, 12 heads"),
]

BYTES = {  # (dp, precision) -> (p, g, K)
    (False, "fp32"): (4, 4, 8), (False, "mixed"): (2, 2, 12),
    (True, "fp32"): (4, 4, 8), (True, "mixed"): (2, 4, 12),
}

PUBLISHED = [
    "DP / non-DP throughput, ViT-Gigantic and GPT2-XL: about 81-84% at ZeRO-1 and ZeRO-2, 94-95% "
    "at ZeRO-3.",
    "Mixed-precision DP model-state memory: 46-74% of full-precision non-DP.",
    "One A100, GPT-2, batch 100 (E2E): non-DP 341, book-keeping DP 274, ghost clipping DP 209, "
    "Opacus out of memory (examples/s).",
]


def predict(psi: int, stage: int, dp: bool, precision: str, world: int = GPUS) -> float:
    p, g, k = BYTES[(dp, precision)]
    return _C.zero.predict_model_state_bytes(stage, float(psi), world, p, g, k)["total"]


def table() -> list[str]:
    lines = ["| model | parameters | stage | non-DP fp32 GiB | non-DP mixed GiB | DP fp32 GiB | "
             "DP mixed GiB | DP mixed / non-DP fp32 | DP mixed fits A100-40GB (model state) | "
             "GPU measured |", "|" + "---|" * 10]
    for name, psi, _ in MODELS[:2]:
        for stage in (1, 2, 3):
            v = {(dp, prec): predict(psi, stage, dp, prec) for dp in (False, True)
                 for prec in ("fp32", "mixed")}
            ratio = v[(True, "mixed")] / v[(False, "fp32")]
            fits = "yes" if v[(True, "mixed")] < A100_BYTES else "no"
            lines.append(
                f"| {name} | {psi / 1e9:.3f} B | {stage} | {v[(False, 'fp32')] / GIB:.1f} | "
                f"{v[(False, 'mixed')] / GIB:.1f} | {v[(True, 'fp32')] / GIB:.1f} | "
                f"{v[(True, 'mixed')] / GIB:.1f} | {ratio:.2f} | {fits} | not yet run |")
    return lines


def single_gpu_table() -> list[str]:
    lines = ["| model | parameters | non-DP fp32 GiB (stage 0, W = 1) | DP mixed GiB | published "
             "examples/s (non-DP / BK / ghost / Opacus) | GPU measured |", "|" + "---|" * 6]
    for name, psi, _ in MODELS[2:]:
        published = "341 / 274 / 209 / OOM (batch 100; the brief says 'GPT-2', size not stated)" \
            if name == "GPT2-small" else ""
        lines.append(f"| {name} | {psi / 1e6:.0f} M | {predict(psi, 0, False, 'fp32', 1) / GIB:.2f}"
                     f" | {predict(psi, 0, True, 'mixed', 1) / GIB:.2f} | {published} | "
                     "not yet run |")
    return lines


def _meta_gpt2(layers, width, heads):
    import transformers
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=1024,
                                  attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16)


def _meta_vit():
    import transformers
    cfg = transformers.ViTConfig(hidden_size=1664, num_hidden_layers=48, num_attention_heads=16,
                                 intermediate_size=8192, patch_size=14, image_size=224,
                                 num_labels=100, attn_implementation="eager")
    with torch.device("meta"):
        return transformers.ViTForImageClassification(cfg).to(torch.bfloat16)


SHAPES = {  # name -> (meta model builder, unit prefix, units, a micro-batch -> loss)
    "GPT2-XL": (lambda: _meta_gpt2(48, 1600, 25), "transformer.h", 48, "text"),
    "GPT2-large": (lambda: _meta_gpt2(36, 1280, 20), "transformer.h", 36, "text"),
    "GPT2-medium": (lambda: _meta_gpt2(24, 1024, 16), "transformer.h", 24, "text"),
    "GPT2-small": (lambda: _meta_gpt2(12, 768, 12), "transformer.h", 12, "text"),
    "ViT-Gigantic": (_meta_vit, "vit.layers", 48, "image"),
}
E2E_TOKENS = 100


def shape_profile_of(name: str, micro_batch: int, clipping: str = "flat"):
    """dpzero.planner's shape profile (Note [shape profile]) of a paper model in bf16 with Adam and
    fp32 masters (p = 2, K = 12), on E2E-length sequences (GPT-2) or 224 px images (ViT)."""
    import torch.nn.functional as F
    from dpzero.planner.shapes import shape_profile

    build, prefix, n, kind = SHAPES[name]

    def forward_loss(model):
        if kind == "text":
            ids = torch.zeros(micro_batch, E2E_TOKENS, dtype=torch.long, device="meta")
            logits = model(ids).logits
            return F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
        x = torch.zeros(micro_batch, 3, 224, 224, dtype=torch.bfloat16, device="meta")
        y = torch.zeros(micro_batch, dtype=torch.long, device="meta")
        return F.cross_entropy(model(x).logits.float(), y)

    return shape_profile(build, forward_loss, micro_batch, units=[f"{prefix}.{i}" for i in range(n)],
                         clipping=clipping, param_bytes=2, optimizer_bytes=12)


def peak_table() -> list[str]:
    """Predicted peak memory per GPU (model state + activations + the DP book-keeping terms) of
    the private runs, bf16 with fp32 masters, flat clipping, under each memory policy."""
    from dpzero.planner import Policy, predict

    lines = ["| model | GPUs | micro-batch | stage | peak GiB, no checkpointing | fits | "
             "peak GiB, every block checkpointed | fits | activations / book-keeping GiB "
             "(no checkpointing) |", "|" + "---|" * 9]
    rows = [("ViT-Gigantic", GPUS, MICRO_BATCH), ("GPT2-XL", GPUS, MICRO_BATCH),
            ("GPT2-large", 1, 25), ("GPT2-medium", 1, 25), ("GPT2-small", 1, 25),
            ("GPT2-small", 1, 100)]
    for name, world, micro in rows:
        prof = shape_profile_of(name, micro)
        stages = (1, 2, 3) if world > 1 else (0,)
        for stage in stages:
            none = predict(prof, Policy(stage, 0), world)
            every = predict(prof, Policy(stage, len(prof.units)), world)
            lines.append(
                f"| {name} | {world} | {micro} | {stage} | {none.peak_bytes / GIB:.1f} | "
                f"{'yes' if none.peak_bytes < A100_BYTES else 'no'} | "
                f"{every.peak_bytes / GIB:.1f} | "
                f"{'yes' if every.peak_bytes < A100_BYTES else 'no'} | "
                f"{prof.terms['activations'] / GIB:.1f} / {prof.terms['book'] / GIB:.1f} |")
    return lines


def reading() -> str:
    psi = 1e9  # the ratios do not depend on the size
    ours = [predict(psi, s, True, "mixed") / predict(psi, s, False, "fp32") for s in (1, 2, 3)]
    half = [_C.zero.predict_model_state_bytes(s, psi, GPUS, 2, 2, 12)["total"]
            / predict(psi, s, False, "fp32") for s in (1, 2, 3)]
    return (
        "Reading: under ZeRO's formulas DP mixed / non-DP fp32 model state is "
        + " / ".join(f"{r:.2f}" for r in ours) + f" at stages 1 / 2 / 3 (W = {GPUS}). dpzero "
        "reduces DP gradients in fp32 (a 16-bit reduction could round a clipped contribution "
        "above C, design.md §4), 4 bytes per gradient element where a 16-bit reduction spends 2; "
        "with 16-bit gradients the same formulas give " + " / ".join(f"{r:.2f}" for r in half)
        + ". Inside the published 46-74%: " + where_inside(ours, "fp32 gradients") + "; "
        + where_inside(half, "16-bit gradients") + ". The published range is a measured one "
        "(how it counts is not restated in the brief); the GPU rows (`experiments/gpu/"
        "paper_rows.sh`, when a GPU is lent; none was in this session) are where the two can be "
        "compared.")


def where_inside(ratios, label) -> str:
    inside = [str(s) for s, r in zip((1, 2, 3), ratios) if 0.46 <= r <= 0.74]
    return f"with {label} stage{'s' if len(inside) != 1 else ''} " + (
        ", ".join(inside) if inside else "none")


def write_paper_table(path: str) -> str:
    from bench_common import write_marked_section
    lines = [
        f"Model-state bytes per GPU predicted by dpzero's ZeRO formulas (src/zero/memory.h) for "
        f"W = {GPUS} GPUs, Adam, micro-batch {MICRO_BATCH} per GPU (activations not included); "
        "published figures beside them. Written by `experiments/run.py --paper`; the sources and "
        "their certainty are in experiments/paper_configs.py.", "",
        "Models: " + "; ".join(f"{n} = {d} ({p / 1e9:.3f} B parameters)" for n, p, d in MODELS), "",
        "### Multi-GPU (ZeRO stages 1-3)", ""] + table() + [
        "", "### Single GPU (GPT-2 on E2E-length sequences, T = 100)", ""] + single_gpu_table() + [
        "", "### Predicted peak memory per GPU of the private runs (A100-40GB)", "",
        "bf16 compute with fp32 master weights, AdamW, flat clipping (book-keeping); GPT-2 on "
        f"{E2E_TOKENS}-token sequences, ViT on 224 px images. Peak = model state (ZeRO's "
        "formulas) + the step's transient from a shape profile on the meta device (Note [shape "
        "profile] in python/dpzero/planner/shapes.py: saved activations, the logits' gradient, and "
        "the clipping book's stored layer inputs and output gradients, which checkpointing does "
        "not shrink; at stage 3 also the gathered units: the root unit and two blocks). Predictions, not measurements: the GPU rows measure.", ""] + peak_table() + [
        "", "### Published figures (as quoted in the project's brief; not re-read from the paper here)", ""] + [
        f"- {p}" for p in PUBLISHED] + [
        "", reading()]
    write_marked_section(path, "paper", "# DP-ZeRO paper configurations: predicted model-state "
                         "memory beside the published figures\n",
                         "<!-- paper:begin -->\n" + "\n".join(lines) + "\n<!-- paper:end -->")
    return path
