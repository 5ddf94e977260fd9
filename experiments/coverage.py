"""Which modules dpzero trains privately, and by which path: a coverage table.

For every torch.nn layer type that holds parameters, and for small Hugging Face models of many
families built from configs (no download), one private step at σ = 0 is compared with an
independent reference: a float64 copy of the unpatched model, one example at a time through
torch's autograd, each example's gradient clipped to C in float64, summed, divided by the expected
batch size, applied as one SGD step. C is small enough that every example clips. Each row records
the path the model's parameters took (kernel: dpzero's per-sample ops; generic: torch.func on the
module, fallback.py) and the result: equal to the reference (relative update error <= 1e-5);
equal to it scaled by s in [1 - 1e-3, 1] (every example clipped slightly harder: the certified
margin for float32 clipped sums, Note [clipped-sum rounding] in kernels/per_sample/common.h); or
refused with dpzero's reason.

    .venv/bin/python experiments/coverage.py            # writes experiments/results/coverage.md
    .venv/bin/python experiments/coverage.py --only gpt2,lstm
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
import traceback
import warnings
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import dpzero
from dpzero.private import PrivacyViolation
from dpzero.private import attention, recurrent
from dpzero.private.fallback import FuncKind

B, T, K, N = 8, 6, 3, 32          # expected batch, sequence length, classes, dataset size
C, LR, TOLERANCE = 1e-3, 1000.0, 1e-5
MARGIN = 1e-3  # the most harder clipping a row may call a rounding margin (_scaled)
RESULTS = os.path.join(os.path.dirname(__file__), "results", "coverage.md")


class Case(NamedTuple):
    name: str
    group: str                     # "torch.nn" or "Hugging Face"
    build: Callable[[], nn.Module]  # a model mapping one batch row to [K] logits
    inputs: Callable[[torch.Generator], torch.Tensor]  # [N, ...] dataset inputs


class Row(NamedTuple):
    name: str
    group: str
    path: str
    result: str
    seconds: float


# ---- torch.nn layers ---------------------------------------------------------------------------

class Head(nn.Module):
    """layer(x) -> flatten -> Linear to K logits, with the layer's own input and output
    conventions handled by ``call``."""

    def __init__(self, layer: nn.Module, out_features: int, call=None):
        super().__init__()
        self.layer = layer
        self.call = call
        self.head = nn.Linear(out_features, K)

    def forward(self, x):
        y = self.call(self.layer, x) if self.call is not None else self.layer(x)
        return self.head(y.flatten(1))


def _floats(*shape):
    return lambda g: torch.randn(N, *shape, generator=g)


def _ids(vocab):
    return lambda g: torch.randint(0, vocab, (N, T), generator=g)


def _torch_cases() -> List[Case]:
    d = 8
    cases = [
        ("Linear", lambda: Head(nn.Linear(d, d), d), _floats(d)),
        ("Bilinear", lambda: Head(nn.Bilinear(d, d, d), d, lambda m, x: m(x, x.flip(-1))),
         _floats(d)),
        ("Embedding", lambda: Head(nn.Embedding(11, d), T * d), _ids(11)),
        ("EmbeddingBag", lambda: Head(nn.EmbeddingBag(11, d, mode="mean"), d), _ids(11)),
        ("Conv1d", lambda: Head(nn.Conv1d(3, 4, 3), 4 * 6), _floats(3, 8)),
        ("Conv2d", lambda: Head(nn.Conv2d(3, 4, 3, padding=1), 4 * 25), _floats(3, 5, 5)),
        ("Conv3d", lambda: Head(nn.Conv3d(2, 3, 2), 3 * 27), _floats(2, 4, 4, 4)),
        ("ConvTranspose1d", lambda: Head(nn.ConvTranspose1d(3, 2, 3), 2 * 10), _floats(3, 8)),
        ("ConvTranspose2d", lambda: Head(nn.ConvTranspose2d(3, 2, 2), 2 * 36), _floats(3, 5, 5)),
        ("ConvTranspose3d", lambda: Head(nn.ConvTranspose3d(2, 2, 2), 2 * 125),
         _floats(2, 4, 4, 4)),
        ("LayerNorm", lambda: Head(nn.LayerNorm(d), d), _floats(d)),
        ("RMSNorm", lambda: Head(nn.RMSNorm(d), d), _floats(d)),
        ("GroupNorm", lambda: Head(nn.GroupNorm(2, 4), 4 * 6), _floats(4, 6)),
        ("InstanceNorm1d (affine)", lambda: Head(nn.InstanceNorm1d(4, affine=True), 4 * 6),
         _floats(4, 6)),
        ("InstanceNorm2d (affine)", lambda: Head(nn.InstanceNorm2d(3, affine=True), 3 * 16),
         _floats(3, 4, 4)),
        ("BatchNorm1d", lambda: Head(nn.BatchNorm1d(d), d), _floats(d)),
        ("BatchNorm2d", lambda: Head(nn.BatchNorm2d(3), 3 * 16), _floats(3, 4, 4)),
        ("PReLU", lambda: Head(nn.PReLU(d), d), _floats(d)),
        ("MultiheadAttention", lambda: Head(nn.MultiheadAttention(d, 2, batch_first=True), T * d,
                                            lambda m, x: m(x, x, x)[0]), _floats(T, d)),
        ("RNN", lambda: Head(nn.RNN(d, d, batch_first=True), T * d, lambda m, x: m(x)[0]),
         _floats(T, d)),
        ("LSTM (2 layers, bidirectional)",
         lambda: Head(nn.LSTM(d, d, num_layers=2, bidirectional=True, batch_first=True),
                      T * 2 * d, lambda m, x: m(x)[0]), _floats(T, d)),
        ("LSTM (proj_size)", lambda: Head(nn.LSTM(d, d, proj_size=4, batch_first=True), T * 4,
                                          lambda m, x: m(x)[0]), _floats(T, d)),
        ("GRU (seq-first)", lambda: Head(nn.GRU(d, d), T * d,
                                         lambda m, x: m(x.transpose(0, 1))[0].transpose(0, 1)),
         _floats(T, d)),
        ("RNNCell", lambda: Head(nn.RNNCell(d, d), d), _floats(d)),
        ("LSTMCell", lambda: Head(nn.LSTMCell(d, d), d, lambda m, x: m(x)[0]), _floats(d)),
        ("GRUCell", lambda: Head(nn.GRUCell(d, d), d), _floats(d)),
        ("TransformerEncoderLayer",
         lambda: Head(nn.TransformerEncoderLayer(d, 2, 16, dropout=0.0, batch_first=True), T * d),
         _floats(T, d)),
        ("TransformerDecoderLayer",
         lambda: Head(nn.TransformerDecoderLayer(d, 2, 16, dropout=0.0, batch_first=True), T * d,
                      lambda m, x: m(x, x)), _floats(T, d)),
        ("Transformer", lambda: Head(nn.Transformer(d, 2, 1, 1, 16, dropout=0.0,
                                                    batch_first=True), T * d,
                                     lambda m, x: m(x, x)), _floats(T, d)),
    ]
    return [Case(n, "torch.nn", b, i) for n, b, i in cases]


# ---- Hugging Face families -----------------------------------------------------------------------

class Pooled(nn.Module):
    """A Hugging Face base model with mean pooling and a linear head: ids -> [K] logits."""

    def __init__(self, model: nn.Module, width: int, kind: str):
        super().__init__()
        self.model, self.kind = model, kind
        self.head = nn.Linear(width, K)

    def forward(self, x):
        if self.kind == "vision":
            out = self.model(pixel_values=x)
        elif self.kind == "seq2seq":
            out = self.model(input_ids=x, decoder_input_ids=x, use_cache=False)
        elif self.kind == "ssm":
            out = self.model(input_ids=x, use_cache=False)
        else:
            out = self.model(input_ids=x, use_cache=False) if self.kind == "decoder" else \
                self.model(input_ids=x)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        if h.dim() == 4:  # convolutional feature maps [B, C, H, W]
            h = h.flatten(2).transpose(1, 2)
        return self.head(h.mean(1))


def _tiny(config_cls, **kw):
    """A small config with every dropout probability 0 (the reference and the private step must
    compute one function; dropout in kernel layers is fine under DP, but not comparable here)."""
    config = config_cls(**kw)
    for key, value in list(config.to_dict().items()):
        if isinstance(value, float) and "drop" in key:  # dropout, attn_pdrop, drop_path_rate
            setattr(config, key, 0.0)
    return config


def _hf_cases() -> List[Case]:
    import transformers as tr

    v, h = 50, 16
    text = dict(vocab_size=v, hidden_size=h, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=32)
    llama_like = dict(text, num_key_value_heads=1, max_position_embeddings=32)
    pixels = lambda g: torch.randn(N, 3, 32, 32, generator=g)  # noqa: E731
    specs = [
        ("BERT", "BertConfig", text, "encoder"),
        ("RoBERTa", "RobertaConfig", dict(text, pad_token_id=1), "encoder"),
        ("DistilBERT", "DistilBertConfig", dict(vocab_size=v, dim=h, n_layers=2, n_heads=2,
                                                hidden_dim=32), "encoder"),
        ("ALBERT", "AlbertConfig", dict(text, embedding_size=8), "encoder"),
        ("ELECTRA", "ElectraConfig", dict(text, embedding_size=8), "encoder"),
        ("DeBERTa-v2", "DebertaV2Config", dict(text, max_relative_positions=16), "encoder"),
        ("GPT-2", "GPT2Config", dict(vocab_size=v, n_embd=h, n_layer=2, n_head=2,
                                     n_positions=32), "decoder"),
        ("GPT-Neo", "GPTNeoConfig", dict(vocab_size=v, hidden_size=h, num_layers=2,
                                         num_heads=2, attention_types=[[["global"], 2]],
                                         max_position_embeddings=32), "decoder"),
        ("GPT-J", "GPTJConfig", dict(vocab_size=v, n_embd=h, n_layer=2, n_head=2,
                                     rotary_dim=4, n_positions=32), "decoder"),
        ("GPT-NeoX", "GPTNeoXConfig", dict(text, max_position_embeddings=32), "decoder"),
        ("OPT", "OPTConfig", dict(vocab_size=v, hidden_size=h, num_hidden_layers=2,
                                  num_attention_heads=2, ffn_dim=32, word_embed_proj_dim=h,
                                  max_position_embeddings=32), "decoder"),
        ("BLOOM", "BloomConfig", dict(vocab_size=v, hidden_size=h, n_layer=2, n_head=2),
         "decoder"),
        ("Falcon", "FalconConfig", dict(vocab_size=v, hidden_size=h, num_hidden_layers=2,
                                        num_attention_heads=2), "decoder"),
        ("Llama", "LlamaConfig", llama_like, "decoder"),
        ("Mistral", "MistralConfig", llama_like, "decoder"),
        ("Qwen2", "Qwen2Config", llama_like, "decoder"),
        ("Gemma", "GemmaConfig", dict(llama_like, head_dim=8), "decoder"),
        ("Phi", "PhiConfig", dict(text, max_position_embeddings=32), "decoder"),
        ("Phi-3", "Phi3Config", dict(llama_like, pad_token_id=0), "decoder"),
        ("T5", "T5Config", dict(vocab_size=v, d_model=h, d_kv=8, d_ff=32, num_layers=2,
                                num_heads=2), "seq2seq"),
        ("mT5", "MT5Config", dict(vocab_size=v, d_model=h, d_kv=8, d_ff=32, num_layers=2,
                                  num_heads=2), "seq2seq"),
        ("UMT5", "UMT5Config", dict(vocab_size=v, d_model=h, d_kv=8, d_ff=32, num_layers=2,
                                    num_heads=2), "seq2seq"),
        ("BART", "BartConfig", dict(vocab_size=v, d_model=h, encoder_layers=1, decoder_layers=1,
                                    encoder_attention_heads=2, decoder_attention_heads=2,
                                    encoder_ffn_dim=32, decoder_ffn_dim=32,
                                    max_position_embeddings=32), "seq2seq"),
        ("ViT", "ViTConfig", dict(hidden_size=h, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, image_size=32, patch_size=8), "vision"),
        ("ConvNeXt", "ConvNextConfig", dict(hidden_sizes=[8, 16], depths=[1, 1],
                                            num_stages=2, image_size=32), "vision"),
        ("ResNet (BatchNorm)", "ResNetConfig", dict(hidden_sizes=[8, 16], depths=[1, 1],
                                                    embedding_size=8), "vision"),
        ("Mamba", "MambaConfig", dict(vocab_size=v, hidden_size=h, state_size=4,
                                      num_hidden_layers=2, expand=2, conv_kernel=3), "ssm"),
    ]
    cases = []
    for name, cls_name, kw, kind in specs:
        cls = getattr(tr, cls_name, None)
        if cls is None:
            continue

        def build(cls=cls, kw=kw, kind=kind, name=name):
            torch.manual_seed(0)
            config = _tiny(cls, **kw)
            model = tr.AutoModel.from_config(config)
            width = getattr(config, "hidden_size", None) or getattr(config, "d_model", None) \
                or getattr(config, "dim", None)
            if kind == "vision" and hasattr(config, "hidden_sizes"):
                width = config.hidden_sizes[-1]
            return Pooled(model, width, kind)

        cases.append(Case(name, "Hugging Face", build,
                          pixels if kind == "vision" else (lambda g: torch.randint(
                              3, v, (N, T), generator=g))))
    return cases


# ---- one row -------------------------------------------------------------------------------------

def _reference(model: nn.Module, x, y) -> Dict[str, torch.Tensor]:
    """The tests' per-example float64 reference (tests/python/private_reference.py), whose clip
    factor is privacy/clipping.h's."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
    from private_reference import clipped_step_by_example

    return clipped_step_by_example(model, x, y, max_grad_norm=C, lr=LR, expected_batch=float(B))


def _tied_error(start: nn.Module, x, y, got) -> Optional[float]:
    """The relative update error against tests/python/private_reference.py's DP-SGD step, which
    clips parameters used by several calls per example as dpzero documents (design.md §2.3: an
    untied copy with one tensor per use, clipped on the sum of the uses' norms); None where it
    cannot run (a module with children called several times cannot be unrolled)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
    from private_reference import naive_dp_sgd_step

    try:
        want = naive_dp_sgd_step(copy.deepcopy(start).double(), F.cross_entropy,
                                 x.as_subclass(torch.Tensor), y.as_subclass(torch.Tensor),
                                 max_grad_norm=C, noise_multiplier=0.0, seed=0, noise_index=0,
                                 lr=LR, expected_batch=float(B))
    except Exception:  # noqa: BLE001 - the row then says it is an upper bound
        return None
    num = sum(float((got[n].double() - w).pow(2).sum()) for n, w in want.items())
    den = sum(float((w - start.get_parameter(n).detach().double()).pow(2).sum())
              for n, w in want.items())
    return math.sqrt(num / den) if den > 0 else None


def _shared_uses(model: nn.Module, x) -> List[str]:
    """Trainable parameters used by more than one module call in one forward: a module called
    several times (ALBERT's layers shared across depth) or a parameter tied between modules
    (BART's shared token embedding in the encoder and the decoder), counted on the unpatched
    model."""
    calls: Dict[str, int] = {}
    handles = [m.register_forward_pre_hook(
        lambda mod, args, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
        for name, m in model.named_modules(remove_duplicate=False)
        if any(p.requires_grad for p in m.parameters(recurse=False))]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    uses: Dict[int, int] = {}
    names: Dict[int, str] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        for pname, p in m.named_parameters(recurse=False):
            if p.requires_grad and calls.get(name):
                uses[id(p)] = uses.get(id(p), 0) + calls[name]
                names.setdefault(id(p), f"{name}.{pname}" if name else pname)
    return sorted(names[i] for i, n in uses.items() if n > 1)


def _path(engine) -> str:
    generic = sorted({type(l.module).__name__ for l in engine.layers
                      if isinstance(l.kind, FuncKind)})
    kernel = sorted({type(l.module.owner).__name__  # the module whose projection it is
                     if isinstance(l.module, (attention.Projection, recurrent.Projection))
                     else type(l.module).__name__ for l in engine.layers
                     if not isinstance(l.kind, FuncKind)})
    parts = []
    if kernel:
        parts.append("kernel: " + ", ".join(kernel))
    if generic:
        parts.append("generic: " + ", ".join(generic))
    return "; ".join(parts)


def run_case(case: Case) -> Row:
    start_time = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    inputs = case.inputs(g)
    labels = torch.randint(0, K, (N,), generator=g)
    torch.manual_seed(0)
    model = case.build()
    model.train()
    start = copy.deepcopy(model)
    data = torch.utils.data.TensorDataset(inputs, labels)
    try:
        p = dpzero.make_private(model, dataset=data, batch_size=B, noise_multiplier=0.0,
                                max_grad_norm=C, allow_no_noise=True, lr=LR, seed=1)
    except PrivacyViolation as e:
        return Row(case.name, case.group, "refused at make_private",
                   "refused: " + _first_reason(str(e)), time.perf_counter() - start_time)
    path = _path(p.privacy_engine)
    x, y = next(iter(p.data_loader))
    try:
        F.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
    except PrivacyViolation as e:
        return Row(case.name, case.group, path, "refused: " + _first_reason(str(e)),
                   time.perf_counter() - start_time)
    repeated = _shared_uses(start, x.as_subclass(torch.Tensor)[:1])
    want = _reference(start, x.as_subclass(torch.Tensor), y.as_subclass(torch.Tensor))
    got = p.privacy_engine.parameters()
    num = sum(float((got[n].double() - w).pow(2).sum()) for n, w in want.items())
    den = sum(float((w - start.get_parameter(n).detach().double()).pow(2).sum())
              for n, w in want.items())
    err = math.sqrt(num / den) if den > 0 else math.sqrt(num)
    tied_err = _tied_error(start, x, y, got) if repeated and err > TOLERANCE else None
    if err <= TOLERANCE:
        result = f"equal to the reference ({err:.1e})"
    elif tied_err is not None and tied_err <= TOLERANCE:
        result = (f"equal to the tie-aware reference ({tied_err:.1e}): {len(repeated)} "
                  "parameters used by several calls per example (tied, or shared across depth), "
                  f"e.g. {repeated[0]!r}, clipped on the sum of their uses' norms (design.md "
                  "§2.3)")
    elif repeated:
        # design.md §2.3: a parameter used by several calls per example (tied, or a layer
        # shared across depth) is clipped on the sum of its uses' norms, an upper bound on the
        # norm of their sum: private, and clipped harder than the reference.
        result = (f"clipped on an upper bound of the norm ({err:.1e} from the reference): "
                  f"{len(repeated)} parameters are used by more than one call per example "
                  f"(tied or shared across depth), e.g. {repeated[0]!r}")
    else:
        scale, residual = _scaled(start, want, got)
        if residual <= TOLERANCE and 1 - MARGIN <= scale <= 1:
            # Note [clipped-sum rounding] (kernels/per_sample/common.h): a layer whose clipped
            # sum is formed in float32 certifies its norm with a margin for that rounding, so
            # every example is clipped slightly harder than the exact norm asks.
            result = (f"equal to the reference scaled by {scale:.6f} (residual {residual:.1e}): "
                      f"clipped {1 - scale:.1e} harder, the certified margin for float32 "
                      "clipped sums")
        else:
            result = f"DIFFERS from the reference ({err:.1e})"
    return Row(case.name, case.group, path, result, time.perf_counter() - start_time)


def _scaled(start: nn.Module, want, got) -> Tuple[float, float]:
    """(s, r): dpzero's update as s times the reference's (least squares) and the relative
    residual of that fit."""
    steps = {n: (got[n].double() - start.get_parameter(n).detach().double(),
                 w - start.get_parameter(n).detach().double()) for n, w in want.items()}
    norm2 = sum(float(r.pow(2).sum()) for _, r in steps.values())
    if norm2 == 0:
        return 1.0, math.inf
    scale = sum(float((g * r).sum()) for g, r in steps.values()) / norm2
    residual = sum(float((g - scale * r).pow(2).sum()) for g, r in steps.values())
    return scale, math.sqrt(residual / norm2)


def _first_reason(message: str) -> str:
    lines = [l.strip() for l in message.splitlines() if l.strip()]
    text = lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]
    return text.replace("|", "/")[:400]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated case names (case-insensitive prefixes)")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    warnings.filterwarnings("ignore")
    cases = _torch_cases() + _hf_cases()
    if args.only:
        wanted = [w.strip().lower() for w in args.only.split(",")]
        cases = [c for c in cases if any(c.name.lower().startswith(w) for w in wanted)]
    rows = []
    for case in cases:
        try:
            row = run_case(case)
        except Exception as e:  # noqa: BLE001 - a crash is a row of the table too
            traceback.print_exc()
            row = Row(case.name, case.group, "-", f"ERROR {type(e).__name__}: {e}"[:300], 0.0)
        print(f"{row.group:13s} {row.name:32s} {row.result[:70]:70s} {row.path}", flush=True)
        rows.append(row)
    if not args.only:
        _write(rows, args.out)
    bad = [r for r in rows if r.result.startswith(("DIFFERS", "ERROR"))]
    return 1 if bad else 0


def _write(rows: List[Row], path: str) -> None:
    import transformers

    lines = [
        "# Coverage: which modules train privately, and how",
        "",
        "Written by `experiments/coverage.py` (run it to refresh this file). One private step at "
        f"σ = 0 (C = {C}, every example clipped; lr = {LR}; expected batch {B}) against a float64 "
        "per-example autograd reference on the unpatched model; *equal* means a relative update "
        f"error ≤ {TOLERANCE:g}; *scaled by s* that dpzero's update is s times the reference's "
        f"to within {TOLERANCE:g}, with 1 − {MARGIN:g} ≤ s ≤ 1: every example clipped slightly "
        "harder, by the certified margin for float32 clipped sums (Note [clipped-sum rounding] "
        "in kernels/per_sample/common.h). Path: *kernel* modules have dpzero's per-sample ops "
        "(MultiheadAttention: its projections, python/dpzero/private/attention.py; LSTM, GRU "
        "and RNN: their weights, python/dpzero/private/recurrent.py), *generic* "
        "ones go through `torch.func` (python/dpzero/private/fallback.py).",
        "",
        f"torch {torch.__version__}, transformers {transformers.__version__}, dpzero at "
        f"{_revision()}; {os.cpu_count()} CPU cores.",
        "",
    ]
    for group in ("torch.nn", "Hugging Face"):
        lines += [f"## {group}", "", "| model | result | path |", "|---|---|---|"]
        lines += [f"| {r.name} | {r.result} | {r.path} |" for r in rows if r.group == group]
        lines.append("")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines))


def _revision() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(__file__)).stdout.strip() or "?"
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
