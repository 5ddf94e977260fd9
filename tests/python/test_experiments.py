"""The experiments harness's written-down configurations (experiments/paper_configs.py) against
independent references: parameter counts from the Hugging Face models built on the meta device,
model-state predictions from ZeRO's formulas (Rajbhandari et al. 2020, §5.1) written out here."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "experiments"))
import paper_configs  # noqa: E402

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("layers, width, heads", [(12, 768, 12), (24, 1024, 16), (48, 1600, 25)])
def test_gpt2_parameter_counts_match_hugging_face(layers, width, heads):
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    assert paper_configs.gpt2_params(layers, width) == model.num_parameters()


def test_vit_gigantic_parameter_count_matches_hugging_face():
    config = transformers.ViTConfig(hidden_size=1664, num_hidden_layers=48, num_attention_heads=16,
                                    intermediate_size=8192, patch_size=14, image_size=224,
                                    num_labels=100)
    with torch.device("meta"):
        model = transformers.ViTForImageClassification(config)
    assert paper_configs.vit_params(48, 1664, 8192) == model.num_parameters()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_predictions_follow_zero_formulas(stage):
    psi, w = 1.5e9, paper_configs.GPUS
    # ZeRO §5.1 with p, g bytes per parameter / gradient and K of optimizer state
    def formula(p, g, k):
        return {1: (p + g) * psi + k * psi / w, 2: p * psi + (g + k) * psi / w,
                3: (p + g + k) * psi / w}[stage]
    assert paper_configs.predict(psi, stage, False, "mixed") == pytest.approx(formula(2, 2, 12))
    assert paper_configs.predict(psi, stage, False, "fp32") == pytest.approx(formula(4, 4, 8))
    # dpzero keeps DP gradients in fp32 up to the reduction (design.md §4)
    assert paper_configs.predict(psi, stage, True, "mixed") == pytest.approx(formula(2, 4, 12))


# ---- paired per-round ratios (experiments/bench_common.py) ----------------------------------------


def test_paired_ratios_are_the_quartiles_of_per_round_ratios():
    import statistics

    import bench_common

    # System a is 10% slower than b in every round while the machine's speed drifts 3x over the
    # run: the absolute times' interquartile ranges overlap (a tie by the old verdict), the paired
    # ratios are 1.1 with no spread.
    drift = [1.0, 1.5, 2.0, 2.5, 3.0, 1.2, 1.8]
    a = [1.1 * x for x in drift]
    qa, qb = statistics.quantiles(a, n=4), statistics.quantiles(drift, n=4)
    assert qa[0] < qb[2]
    assert bench_common.paired_ratios({"a": a, "b": drift}, "a", "b") == pytest.approx(
        (1.1, 1.1, 1.1))
    # Rounds in another order: the quartiles of the round-by-round ratios, nothing else.
    b = drift[3:] + drift[:3]
    want_q1, want_med, want_q3 = statistics.quantiles([x / y for x, y in zip(a, b)], n=4)
    assert bench_common.paired_ratios({"a": a, "b": b}, "a", "b") == pytest.approx(
        (want_med, want_q1, want_q3))
    # Rounds that do not line up are a wiring error, not a ratio; a missing system gives none.
    with pytest.raises(RuntimeError, match="aligned rounds"):
        bench_common.paired_ratios({"a": [1.0, 2.0], "b": [1.0]}, "a", "b")
    assert bench_common.paired_ratios({"a": [1.0]}, "a", "b") is None


@pytest.mark.job
@pytest.mark.parametrize("script, args", [
    ("private_bench.py", []), ("run.py", ["--grid", "cpu"]), ("generic_bench.py", ["--no-write"]),
    ("host_overhead.py", ["--no-write"])])
def test_a_benchmark_without_its_baseline_names_the_script_that_installs_it(script, args):
    # Opacus made unimportable (a None entry in sys.modules hides an installed package from
    # importlib), as on a fresh machine that ran scripts/setup.sh but not scripts/bench.sh.
    import subprocess
    here = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "experiments"))
    code = ("import runpy, sys; sys.modules['opacus'] = None; "
            f"sys.argv = [{script!r}] + {args!r}; sys.path.insert(0, {here!r}); "
            f"runpy.run_path({os.path.join(here, script)!r}, run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "'opacus' is not installed" in done.stderr and "scripts/bench.sh" in done.stderr, \
        done.stderr[-2000:]


def test_the_roofline_work_model_counts_what_torch_counts(tmp_path):
    """experiments/roofline.py: its stated FLOPs of the Gram and Opacus rows are the matmul FLOPs
    torch's FlopCounterMode counts in the same computations (plus the elementwise dot and norm
    that FlopCounterMode leaves out), and a tiny run writes its section."""
    import roofline
    from torch.utils.flop_counter import FlopCounterMode

    b, t, d_in, d_out = 2, 8, 16, 12
    kernels = roofline.kernels("cpu", torch.float32, b, t, d_in, d_out)
    for name, elementwise in (("bmm64", 2 * b * t * t), ("opacus", 2 * b * d_in * d_out)):
        fn, flops, *_ = kernels[name]
        with FlopCounterMode(display=False) as counter:
            fn()
        assert flops == counter.get_total_flops() + elementwise, name
    out = tmp_path / "roofline.md"
    assert roofline.main(["--seqs", "8", "--layers", "16x12", "--batch", "2", "--repeats", "1",
                          "--out", str(out)]) == 0
    text = out.read_text()
    assert "<!-- roofline:cpu:begin -->" in text and "<!-- roofline:cpu:end -->" in text
    rows = [line for line in text.splitlines() if line.startswith("| 16->12 | 8 |")]
    assert [r.split(" | ")[2] for r in rows] == list(kernels)
    assert "Ghost or direct: the rule picks the faster path in" in text
