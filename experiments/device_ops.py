"""Operators and kernel launches of a private step on the path a GPU takes, counted on any machine.

``dpzero::_set_device_path(True)`` (Note [device path] in kernels/per_sample_checks.h) sends CPU
tensors down the branches a GPU takes, and a dispatch mode sees every ATen call, those made from
dpzero's C++ too, as tests/python/test_device_path.py counts them. A call that only makes a view
(view, select, slice, transpose, ...) launches nothing on a GPU; every other call is counted as a
launch. On a GPU each launch costs a few microseconds of host time whatever its size, so a step of
small layers is bounded by these counts (Note [CUDA graphs] in src/dp/private_step.h).

The model: BertForSequenceClassification from its config (2 layers, hidden 32, 2 heads,
intermediate 64, vocabulary 100, T = 16, eager attention), flat clipping, σ = 1, ZeRO stage 0,
SGD; the second step (the first probes). The reference: the same model under plain torch SGD.

    .venv/bin/python experiments/device_ops.py            # writes experiments/results/host.md
    .venv/bin/python experiments/device_ops.py --no-write
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dpzero  # noqa: E402
from bench_common import dpzero_version, write_marked_section  # noqa: E402
from dpzero.private.trainable import Observer  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "host.md")
# ATen operators that return a view or metadata and launch no kernel on a GPU.
VIEWS = {"view", "_unsafe_view", "as_strided", "select", "slice", "narrow", "t", "transpose",
         "permute", "expand", "unsqueeze", "squeeze", "detach", "alias", "split", "unbind",
         "split_with_sizes", "unsafe_split", "unflatten", "diagonal", "lift_fresh",
         "_reshape_alias"}


# Calls that read a device value on the host.
READS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.item.default"}


class Count(Observer):  # kept inside the step's checks (Note [checks alone])
    """Every ATen call of its scope by name, and the copies to the CPU among them."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.host_copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        # A copy to the CPU: a device-to-host read on the path a GPU takes. (A .cpu() of a CPU
        # tensor copies nothing and dispatches nothing: the reads the step makes copy explicitly.)
        if func is torch.ops.aten._to_copy.default and \
                torch.device((kwargs or {}).get("device") or "meta").type == "cpu":
            self.host_copies += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def launches(self) -> int:
        return launches(self.ops)

    @property
    def reads(self) -> int:
        return sum(self.ops[name] for name in READS) + self.host_copies


def launches(ops: collections.Counter) -> int:
    """The calls of ``ops`` (by name) that are not views."""
    return sum(n for name, n in ops.items() if name.split(".")[1] not in VIEWS)


def bert():
    import transformers

    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def batch(b: int, t: int = 16):
    g = torch.Generator().manual_seed(b)
    return torch.randint(0, 100, (b, t), generator=g), torch.randint(0, 2, (b,), generator=g)


def private_step(b: int):
    """(forward, backward, step) Counts of the second private step, and the DP layer count."""
    model = bert()
    ids, y = batch(b)
    p = dpzero.make_private(model, dataset=torch.utils.data.TensorDataset(ids, y),
                            sample_rate=0.5, noise_multiplier=1.0, max_grad_norm=1.0, seed=0,
                            optimizer="sgd", lr=0.1)
    for _ in range(2):
        x, labels = p.privacy_engine.own_batch((ids, y), logical_batch_size=b)
        with Count() as forward:
            loss = F.cross_entropy(p.model(input_ids=x).logits, labels)
        with Count() as backward:
            loss.backward()
        with Count() as step:
            p.optimizer.step()
        p.optimizer.zero_grad()
    layers = sum(1 for m in model.modules()
                 if isinstance(m, (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm)))
    return (forward, backward, step), layers


def plain_step(b: int) -> Count:
    """The Count of the second non-private step (forward, backward, SGD) of the same model."""
    model = bert()
    ids, y = batch(b)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        with Count() as count:
            F.cross_entropy(model(input_ids=ids).logits, y).backward()
            opt.step()
        opt.zero_grad()
    return count


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    previous = torch.ops.dpzero._set_device_path(True)
    try:
        (small, layers), (large, _) = private_step(4), private_step(24)
        plain = plain_step(4)
    finally:
        torch.ops.dpzero._set_device_path(previous)
    lines = ["| | operators, B = 4 | B = 24 | launches, B = 4 | B = 24 |", "|---|---|---|---|---|"]
    for name, a, b in zip(("private forward", "private backward", "private optimizer step"),
                          small, large):
        lines.append(f"| {name} | {a.total} | {b.total} | {a.launches} | {b.launches} |")
    lines.append(f"| non-private step | {plain.total} | | {plain.launches} | |")
    private = sum((c.ops for c in small), collections.Counter())
    extra = launches(private) - plain.launches
    lines += ["", f"{layers} DP layers: the private step launches {extra} kernels more than the "
              f"non-private one, {extra / layers:.1f} per DP layer "
              f"({(sum(private.values()) - plain.total) / layers:.1f} operators with the "
              "views). The largest differences in launches:", "",
              "| operator | private − non-private |", "|---|---|"]
    diff = {k: private[k] - plain.ops[k] for k in set(private) | set(plain.ops)
            if private[k] != plain.ops[k] and k.split(".")[1] not in VIEWS}
    for name, n in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:args.top]:
        lines.append(f"| `{name}` | {n:+d} |")
    print("\n".join(lines))
    if not args.no_write:
        section = ["<!-- ops:begin -->", "## Operators and launches of a private step", "",
                   f"Written by `experiments/device_ops.py` ({dpzero_version()}): the path a GPU "
                   "takes, counted on the CPU; a launch is an operator that is not a view.", ""]
        write_marked_section(RESULTS, "ops", "# Host overhead of a private step\n",
                             "\n".join(section + lines + ["<!-- ops:end -->"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
