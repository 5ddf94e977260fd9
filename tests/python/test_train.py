"""dpzero train / report: config errors, the real data loaders, the budget guard, the report, and
small end-to-end jobs (one rank in process; two ranks through the torchrun-style launcher)."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import dpzero
import ranks
from dpzero import BudgetExhausted  # exported at the top level
from dpzero.train import ConfigError, config, datasets
from dpzero.train.report import write_report

# ---- config ----------------------------------------------------------------------------------

BASE = {"privacy": {"target_epsilon": 3.0}}


@pytest.mark.parametrize("raw, message", [
    ({"privacy": {}}, r"exactly one of target_epsilon and noise_multiplier"),
    ({"privacy": {"target_epsilon": 3.0, "noise_multiplier": 1.0}}, r"exactly one"),
    ({**BASE, "training": {"lr": "fast"}}, r"\[training\] lr must be a number, got 'fast'"),
    ({**BASE, "training": {"zero_stage": 4}}, r"\[training\] zero_stage must be one of .* got 4"),
    ({**BASE, "training": {"batch_size": 0}}, r"\[training\] batch_size must be >= 1, got 0"),
    ({**BASE, "trainig": {}}, r"unknown section \[trainig\]"),
    ({**BASE, "model": {"layers": 2}}, r"unknown key \[model\] layers"),
    ({"privacy": {"target_epsilon": -1.0}}, r"target_epsilon must be finite and > 0, got -1.0"),
    ({"privacy": {"target_epsilon": 3.0, "delta": 2.0}}, r"delta must be in \(0, 1\), \"auto\""),
    ({"privacy": {"target_epsilon": 3.0, "max_grad_norm": 0}}, r"max_grad_norm must be finite"),
    ({**BASE, "data": {"categories": ["computers"]}}, r"at least 2 classes"),
    ({**BASE, "data": {"test_fraction": 1.5}}, r"test_fraction must be in \(0, 1\), got 1.5"),
    ({**BASE, "model": {"kind": "cnn"}}, r"kind 'cnn' does not fit \[data\] dataset 'fortunes'"),
    ({**BASE, "training": {"baseline": "yes"}}, r"baseline must be true or false, got 'yes'"),
    ({**BASE, "training": {"timeout_s": 0}}, r"\[training\] timeout_s must be a number of "
     r"seconds > 0, got 0"),
    ({**BASE, "training": {"checkpoint_every": -1}}, r"\[training\] checkpoint_every must be "
     r">= 0 \(0 = no checkpoints\), got -1"),
    ({**BASE, "training": {"checkpoint_every": "often"}}, r"\[training\] checkpoint_every must "
     r"be \"auto\" or an integer, got 'often'"),
    ({**BASE, "training": {"keep_checkpoints": 0}}, r"\[training\] keep_checkpoints must be "
     r">= 1, got 0"),
    ({**BASE, "training": {"policy": "fast"}}, r"\[training\] policy must be one of "
     r"\['fixed', 'auto'\], got 'fast'"),
    ({**BASE, "training": {"memory_budget_gib": -1}}, r"\[training\] memory_budget_gib must be "
     r">= 0"),
    ({**BASE, "training": {"momentum": 1.0, "optimizer": "sgd"}}, r"\[training\] momentum "
     r"must be in \[0, 1\), got 1.0"),
    ({**BASE, "training": {"momentum": 0.9}}, r'momentum = 0.9 is SGD\'s; optimizer is "adamw"'),
    ({**BASE, "data": {"scale": "minmax"}}, r"\[data\] scale must be one of "
     r"\['standardize', 'unit'\], got 'minmax'"),
    ({**BASE, "model": {"padding": -1}}, r"\[model\] padding must be >= 0, got -1"),
    ({**BASE, "model": {"kind": "scatternet-linear"}}, r"kind 'scatternet-linear' does not fit "
     r"\[data\] dataset 'fortunes'"),
    ({**BASE, "model": {"groups": 4}}, r"\[model\] groups must divide the 81 ScatterNet "
     r"channels .* got 4"),
    ({**BASE, "data": {"test_limit": -1}}, r"\[data\] test_limit must be >= 0, got -1"),
    ({**BASE, "model": {"lora_rank": -2}}, r"\[model\] lora_rank must be >= 0 \(0 = no LoRA\), "
     r"got -2"),
    ({**BASE, "model": {"lora_alpha": 0}}, r"\[model\] lora_alpha must be > 0, got 0"),
    ({"privacy": {"target_epsilon": 3.0}, "data": {"dataset": "fashion-mnist"},
      "model": {"kind": "cnn", "lora_rank": 4}}, r"\[model\] lora_rank = 4 needs kind = "
     r"\"minilm\" .* got kind 'cnn'; set lora_rank = 0"),
    ({**BASE, "privacy": {"target_epsilon": 3.0, "bands": 0}},
     r"\[privacy\] bands must be an integer >= 1, got 0"),
    ({**BASE, "privacy": {"target_epsilon": 3.0, "bands": 2.5}},
     r"\[privacy\] bands must be an integer, got 2.5"),
    ({**BASE, "privacy": {"target_epsilon": 3.0, "bands": 2, "strategy": "sqrt"}},
     r"\[privacy\] strategy must be one of \['sqrt_prefix_sum', 'optimized'\], got 'sqrt'"),
    ({**BASE, "privacy": {"target_epsilon": 3.0, "strategy": "optimized"}},
     r"\[privacy\] strategy = 'optimized' needs bands > 1"),
    ({**BASE, "privacy": {"target_epsilon": 3.0, "isolation": "loose"}},
     r"\[privacy\] isolation must be one of \['detect', 'strict'\], got 'loose'"),
    ({**BASE, "training": {"loop": "keras"}}, r"\[training\] loop must be one of "
     r"\['engine', 'trainer'\], got 'keras'"),
    ({**BASE, "training": {"loop": "trainer", "policy": "auto"}}, r'policy = "auto" plans the '
     r'engine loop'),
    ({**BASE, "training": {"loop": "trainer", "batch_size": 100, "max_physical_batch_size": 32,
                           "world_size": 2}}, r"batch_size = 100 with loop = \"trainer\" must be "
     r"a multiple of max_physical_batch_size x world_size = 64"),
    ({**BASE, "training": {"loop": "trainer", "optimizer": "adam", "weight_decay": 0.1}},
     r'optimizer = "adam" with weight_decay = 0.1'),
    ({**BASE, "training": {"device": "gpu"}}, r"\[training\] device must be one of "
     r"\['auto', 'cpu', 'cuda'\], got 'gpu'"),
    ({**BASE, "training": {"precision": "fp16"}}, r'\[training\] precision = "fp16" is not '
     r"offered: .* use \"bf16\""),
    ({**BASE, "training": {"precision": "half"}}, r"\[training\] precision must be one of "
     r"\['fp32', 'bf16'\], got 'half'"),
])
def test_config_errors_name_the_key_and_value(raw, message):
    with pytest.raises(ConfigError, match=message):
        config.from_dict(raw)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[privacy\ntarget_epsilon = 3")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        config.load(str(bad))
    good = tmp_path / "job.toml"
    good.write_text('[privacy]\nnoise_multiplier = 1.2\ndelta = 1e-5\n[training]\nepochs = 2\n')
    cfg = config.load(str(good))
    assert cfg.privacy.noise_multiplier == 1.2 and cfg.training.epochs == 2.0
    assert cfg.output.dir == os.path.join("runs", "job")
    assert cfg.delta_for(1000) == 1e-5
    # The default: min(1e-5, 1/(10 N)), below 1/N; "1/N" only when asked for.
    assert config.from_dict(BASE).delta_for(1000) == 1e-5
    assert config.from_dict(BASE).delta_for(10**6) == 1e-7
    one_over_n = {**BASE, "privacy": {**BASE["privacy"], "delta": "1/N"}}
    assert config.from_dict(one_over_n).delta_for(1000) == 1e-3


def test_the_device_is_the_gpus_only_when_there_is_one_per_rank(monkeypatch):
    from dpzero.train import task

    gpus = torch.cuda.device_count()  # the machine's own count, the rule's reference
    assert task.device_kind("auto", gpus + 1) == "cpu"
    assert task.device_kind("cpu", 1) == "cpu"
    with pytest.raises(ConfigError, match=rf'device = "cuda" needs one GPU per rank: {gpus + 1} '
                                          rf"rank\(s\) on this machine, but it has {gpus} GPU"):
        task.device_kind("cuda", gpus + 1)
    if gpus:
        assert task.device_kind("auto", gpus) == task.device_kind("cuda", 1) == "cuda"
    # The rule for any machine (a GPU count given): one GPU per rank, or the CPU for "auto".
    assert [task.device_kind("auto", 2, g) for g in (0, 1, 2, 8)] == ["cpu", "cpu", "cuda", "cuda"]
    assert task.device_kind("cuda", 2, 2) == "cuda" and task.device_kind("cpu", 1, 8) == "cpu"
    with pytest.raises(ConfigError, match=r"2 rank\(s\) on this machine, but it has 1 GPU"):
        task.device_kind("cuda", 2, 1)
    # "auto" leaving GPUs idle says so, naming the world size that would use them.
    assert task.unused_gpus("auto", 2, 1).endswith("set [training] world_size = 1 to train on "
                                                   "the GPUs")
    assert [task.unused_gpus(c, 2, g) for c, g in (("auto", 0), ("auto", 2), ("cpu", 1))] == \
        [None] * 3
    # The ranks on this machine: world_size, or the launcher's count on a job over several nodes.
    cfg = config.from_dict({**BASE, "training": {"world_size": 16, "device": "cuda"}})
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert task.ranks_here(cfg) == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert task.ranks_here(cfg) == 8
    if gpus < 8:
        with pytest.raises(ConfigError, match=r"needs one GPU per rank: 8 rank\(s\)"):
            task.rank_device(cfg)


def test_default_checkpoint_cadence_bounds_the_work_a_crash_loses():
    # "auto": every ceil(steps / 10) steps, so a crash loses at most a tenth of the run (the
    # main job's 33 steps: every 4, where a fixed 50 checkpointed never).
    t = config.from_dict(BASE).training
    assert t.checkpoint_every == "auto"
    assert [t.checkpoint_interval(n) for n in (1, 9, 10, 33, 1000)] == [1, 1, 1, 4, 100]
    fixed = config.from_dict({**BASE, "training": {"checkpoint_every": 7}}).training
    assert fixed.checkpoint_interval(33) == 7
    assert config.from_dict({**BASE, "training": {"checkpoint_every": 0}}).training \
        .checkpoint_interval(33) == 0


def test_shipped_configs_parse():
    root = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
    names = sorted(f for f in os.listdir(root) if f.endswith(".toml"))
    assert "minilm-fortunes.toml" in names
    for name in names:
        config.load(os.path.join(root, name))


# ---- data --------------------------------------------------------------------------------------

needs_fortunes = pytest.mark.skipif(not os.path.isdir(datasets.FORTUNES_DIR),
                                    reason="Debian package fortunes not installed")
needs_fashion = pytest.mark.skipif(not os.path.isdir(datasets.FASHION_DIR),
                                   reason="Debian package dataset-fashion-mnist not installed")


@needs_fortunes
def test_fortunes_split_is_deterministic_and_never_leaks():
    cats = ["computers", "science", "politics", "people"]
    items = datasets.fortune_texts(cats)
    assert len(items) > 3000
    assert len({t for t, _ in items}) == len(items)  # duplicates dropped
    assert {y for _, y in items} == {0, 1, 2, 3}
    train, test = datasets.split_texts(items, 0.2)
    assert not ({t for t, _ in train} & {t for t, _ in test})
    assert len(train) + len(test) == len(items)
    assert 0.15 < len(test) / len(items) < 0.25
    train2, test2 = datasets.split_texts(list(reversed(items)), 0.2)
    assert train2 == train and test2 == test  # by content, not by position
    assert len({y for _, y in train[:100]}) == 4  # the fixed shuffle mixes the classes
    with pytest.raises(datasets.DatasetMissing, match="category 'no-such' not found"):
        datasets.fortune_texts(["computers", "no-such"])


@needs_fashion
def test_fashion_mnist_files():
    train, test = datasets.fashion_mnist(True), datasets.fashion_mnist(False)
    assert train.tensors[0].shape == (60000, 1, 28, 28)
    assert test.tensors[0].shape == (10000, 1, 28, 28)
    assert torch.bincount(train.tensors[1]).tolist() == [6000] * 10
    assert abs(train.tensors[0].mean().item()) < 1e-3  # standardised with its own statistics
    unit = datasets.fashion_mnist(True, scale="unit").tensors[0]  # pixels / 255
    assert unit.min().item() == 0.0 and unit.max().item() == 1.0
    assert torch.allclose((unit - 0.2860) / 0.3530, train.tensors[0])
    with pytest.raises(ValueError, match="got 'minmax'"):
        datasets.fashion_mnist(True, scale="minmax")


def test_idx_reader_rejects_damaged_files(tmp_path):
    bad = tmp_path / "x-idx1-ubyte.gz"
    with gzip.open(bad, "wb") as f:
        f.write(bytes([0, 0, 8, 1, 0, 0, 0, 5, 1, 2]))  # says 5 labels, holds 2
    with pytest.raises(ValueError, match=r"header says \[5\] .* file has 2"):
        datasets._read_idx(str(bad))
    with gzip.open(bad, "wb") as f:
        f.write(b"not an idx file")
    with pytest.raises(ValueError, match="is not an IDX file"):
        datasets._read_idx(str(bad))


# ---- budget guard ------------------------------------------------------------------------------

def test_budget_guard_stops_before_the_step_that_would_exceed_epsilon(tmp_path):
    torch.manual_seed(0)
    n = 200
    ds = torch.utils.data.TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    path = str(tmp_path / "ledger.jsonl")
    p = dpzero.make_private(model, dataset=ds, batch_size=50, target_epsilon=1.0,
                            target_delta=1e-5, epochs=2, max_grad_norm=1.0, seed=0,
                            accountant="rdp", ledger_path=path)
    engine = p.privacy_engine
    allowed = dpzero.get_steps(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.25,
                               noise_multiplier=engine.noise_multiplier, accountant="rdp")
    assert engine.max_steps == allowed >= 8  # at least the 2 epochs it was calibrated for
    taken = 0
    with pytest.raises(BudgetExhausted, match=r"budget epsilon=1 .* allows \d+ steps"):
        while True:
            for x, y in p.data_loader:
                p.optimizer.zero_grad()
                F.cross_entropy(p.model(x), y).backward()
                if p.optimizer.step():
                    taken += 1
    assert taken == allowed and engine.remaining_steps == 0
    before = engine.parameters()
    ledger = dpzero.Ledger.open_read_only(path)
    assert ledger.total_steps == allowed  # the refused step was not charged
    assert ledger.epsilon(1e-5, "rdp") <= 1.0
    assert all(torch.equal(before[k], v) for k, v in engine.parameters().items())


# ---- report ------------------------------------------------------------------------------------

@pytest.mark.job
def test_report_is_rebuilt_from_the_ledger_alone(tmp_path):
    ledger = dpzero.Ledger.create(str(tmp_path / "ledger.jsonl"), run_id="r1", dataset_size=1000,
                                  settings={"secure_mode": False})
    for t in range(30):
        ledger.append(first_step=t, q=0.05, sigma=1.1, max_grad_norm=1.0)
    ledger.close()
    data = write_report(str(tmp_path))
    assert data["delta"] == 1e-5  # no config: the default min(1e-5, 1/(10 N))
    rdp = dpzero.RDPAccountant()
    rdp.step(noise_multiplier=1.1, sample_rate=0.05, num_steps=30)
    got = {r["accountant"]: r for r in data["epsilon"]["results"]}
    assert got["rdp"]["epsilon"] == pytest.approx(rdp.get_epsilon(1e-5), rel=1e-12)
    prv = dpzero.PRVAccountant()
    prv.step(noise_multiplier=1.1, sample_rate=0.05, num_steps=30)
    assert got["prv"]["epsilon"] == pytest.approx(prv.get_epsilon(1e-5), rel=1e-9)
    assert data["phases"] == [{"q": 0.05, "sigma": 1.1, "steps": 30,
                               "expected_batch_size": 50.0}]
    assert data["curve"]["steps"][-1] == 30 and data["curve"]["rdp"][-1] == got["rdp"]["epsilon"]
    assert all(a <= b for a, b in zip(data["curve"]["rdp"], data["curve"]["rdp"][1:]))
    md = (tmp_path / "report.md").read_text()
    assert "seeded (Philox" in md and "ε (RDP) =" in md and "epsilon.png" in md
    # the privacy unit and the tuning caveat, in the report and its JSON
    assert "privacy unit: one training example" in md and "adding or removing" in md
    assert "not covered: settings" in md and data["not_covered"].startswith("settings")
    assert (tmp_path / "epsilon.png").stat().st_size > 1000
    out = subprocess.run([sys.executable, "-m", "dpzero", "report", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "30 steps" in out.stdout


def test_report_says_when_noise_was_off(tmp_path):
    ledger = dpzero.Ledger.create(str(tmp_path / "ledger.jsonl"), run_id="r2", dataset_size=100)
    ledger.append(first_step=0, q=0.1, sigma=0.0, max_grad_norm=1.0, noise=False)
    ledger.close()
    data = write_report(str(tmp_path))
    assert data["epsilon"] is None
    assert "no privacy guarantee" in (tmp_path / "report.md").read_text()


# ---- end to end --------------------------------------------------------------------------------

def _write_config(path, **sections):
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.job
@needs_fashion
def test_tramer_boneh_cnn_config_runs_on_a_subset(tmp_path):
    # configs/cnn-fashion-mnist-tb.toml as shipped, on 1024 examples for 2 epochs: its settings
    # reach the model (padding 2: 12x12 maps after the first pooling), the data ([0, 1] pixels)
    # and the optimizer (SGD momentum), and ε is the accountant's for its (σ, q, steps).
    from dpzero.train import runner, task

    shipped = os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                           "cnn-fashion-mnist-tb.toml")
    cfg = config.load(shipped)
    assert (cfg.model.padding, cfg.data.scale, cfg.training.momentum) == (2, "unit", 0.9)
    cfg.data.limit, cfg.training.epochs, cfg.training.batch_size = 1024, 2, 256
    cfg.training.max_physical_batch_size, cfg.output.dir = 128, str(tmp_path / "run")
    config.validate(cfg)
    model, train, _, _ = task.build(cfg)
    assert model.conv1(train.tensors[0][:1]).shape == (1, 16, 13, 13)
    assert train.tensors[0].min() == 0.0 and train.tensors[0].max() == 1.0
    result = runner.run_job(cfg)["private"]
    steps = 2 * int(1024 / 256)
    assert result["steps"] == steps and result["noise_multiplier"] == 2.15
    prv = dpzero.PRVAccountant()
    prv.step(noise_multiplier=2.15, sample_rate=256 / 1024, num_steps=steps)
    assert result["epsilon"] == pytest.approx(prv.get_epsilon(1e-5), rel=1e-9)
    assert result["accuracy"] > 0.2  # 10 classes: well above chance after 8 private steps
    # The engine ran SGD with momentum: the checkpoint manifest records its hyperparameters.
    root = str(tmp_path / "run" / "checkpoints")
    manifest = json.loads(open(os.path.join(dpzero.checkpoint.resolve(root),
                                            "manifest.json")).read())
    text = json.dumps(manifest)
    assert '"momentum": 0.9' in text and '"lr": 4.0' in text, text[:2000]


# ---- ScatterNet features and heads (Tramèr & Boneh 2021) -----------------------------------------

def test_scatter_features_of_an_image_depend_on_that_image_alone():
    # Note [fixed features and privacy]: an example's features are a function of that example
    # only, bit for bit, whatever else is in its chunk; and a constant image keeps its value in the low-pass
    # channel (the Gaussian low-pass sums to 1; reflect padding keeps the image constant) with
    # every wavelet channel 0 (Morlet wavelets have zero mean), which fixes the channel order.
    from dpzero.train.features import scatter_features

    torch.manual_seed(0)
    images = torch.rand(5, 1, 28, 28)
    alone = torch.cat([scatter_features(images[i:i + 1]) for i in range(5)])
    chunked = scatter_features(images, chunk=2)
    assert alone.shape == (5, 81, 7, 7)
    assert torch.equal(chunked, alone)  # bit for bit: no neighbour moves a row even by rounding
    other = images.clone()
    other[1:] = torch.rand(4, 1, 28, 28)
    assert torch.equal(scatter_features(other)[0], alone[0])
    flat = scatter_features(torch.full((1, 1, 28, 28), 0.25))[0]
    torch.testing.assert_close(flat[0], torch.full((7, 7), 0.25), rtol=0, atol=1e-5)
    assert flat[1:].abs().max() < 1e-5
    with pytest.raises(ValueError, match=r"\[n, 1, H, W\] images, got \[28, 28\]"):
        scatter_features(torch.rand(28, 28))


@pytest.mark.parametrize("head", ["scatternet-linear", "scatternet-cnn"])
def test_scatternet_heads_one_private_step_equals_naive_dp_sgd(head):
    # Both heads through make_private against the float64 torch.func step of
    # tests/python/private_reference.py: GroupNorm without affine parameters normalises each
    # example alone, so the per-sample gradients are the reference's.
    from private_reference import first_private_step, naive_dp_sgd_step

    from dpzero.train.models import ScatterNetCNN, ScatterNetLinear

    torch.manual_seed(3)
    model = (ScatterNetLinear if head == "scatternet-linear" else ScatterNetCNN)(10, groups=27)
    ref = __import__("copy").deepcopy(model)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 81, 7, 7).abs(),
                                        torch.randint(0, 10, (64,)))
    loss = lambda out, t: F.cross_entropy(out, t)  # noqa: E731
    c, sigma, lr, q = 0.1, 0.8, 2.0, 0.25
    p, x, y = first_private_step(model, ds, loss, sample_rate=q, noise_multiplier=sigma,
                                 max_grad_norm=c, seed=11, lr=lr, max_physical_batch_size=8)
    want = naive_dp_sgd_step(ref, loss, x, y, max_grad_norm=c, noise_multiplier=sigma, seed=11,
                             noise_index=0, lr=lr, expected_batch=q * len(ds))
    got = p.privacy_engine.parameters()
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=2e-5, rtol=1e-4)


@pytest.mark.job
@needs_fashion
def test_scatternet_config_runs_on_a_subset(tmp_path):
    # configs/scatternet-fashion-mnist.toml as shipped, on 1024 training and 1000 test examples:
    # the model is the linear head on 81x7x7 ScatterNet features with GroupNorm(27), the data
    # are the features of [0, 1] pixels, and ε is the accountant's for its (σ, q, steps), at
    # most the target.
    from dpzero.train import runner, task
    from dpzero.train.features import scatter_features

    shipped = os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                           "scatternet-fashion-mnist.toml")
    cfg = config.load(shipped)
    assert (cfg.model.kind, cfg.model.groups, cfg.data.scale) == ("scatternet-linear", 27, "unit")
    assert cfg.privacy.target_epsilon == 3.0  # σ calibrated by the PRV accountant
    cfg.data.limit, cfg.data.test_limit, cfg.training.epochs = 1024, 1000, 2
    cfg.training.batch_size, cfg.output.dir = 256, str(tmp_path / "run")
    config.validate(cfg)
    model, train, test, _ = task.build(cfg)
    assert isinstance(model.norm, torch.nn.GroupNorm) and model.norm.num_groups == 27
    assert model.fc.in_features == 81 * 7 * 7 and len(test) == 1000
    pixels = datasets.fashion_mnist(True, scale="unit").tensors[0][:3]
    torch.testing.assert_close(train.tensors[0][:3], scatter_features(pixels))
    result = runner.run_job(cfg)["private"]
    steps = 2 * int(1024 / 256)
    assert result["steps"] == steps and result["test_examples"] == 1000
    prv = dpzero.PRVAccountant()
    prv.step(noise_multiplier=result["noise_multiplier"], sample_rate=256 / 1024,
             num_steps=steps)
    assert result["epsilon"] == pytest.approx(prv.get_epsilon(1e-5), rel=1e-9)
    assert 2.9 < result["epsilon"] <= 3.0
    assert result["accuracy"] > 0.5  # 10 classes; linear on ScatterNet features learns fast


@pytest.mark.job
@needs_fashion
@pytest.mark.parametrize("loop", ["engine", "trainer"])
def test_bf16_precision_trains_under_autocast(tmp_path, loop):
    # The same run in fp32 and in bf16 (Philox noise from one seed, so both draw the same noise):
    # the bf16 forward's rounding moves the trained weights, by about bf16's resolution and no
    # more, and everything else (steps, σ, ε, where the run trained) is the same.
    from dpzero.train import runner

    got = {}
    for precision in ("fp32", "bf16"):
        cfg = config.from_dict({
            "model": {"kind": "cnn"},
            "data": {"dataset": "fashion-mnist", "limit": 256, "test_limit": 64},
            "privacy": {"noise_multiplier": 1.0, "secure_mode": False},
            "training": {"epochs": 1, "batch_size": 128, "max_physical_batch_size": 64,
                         "world_size": 1, "zero_stage": 0, "lr": 0.5, "optimizer": "sgd",
                         "checkpoint_every": 0, "baseline": False, "precision": precision,
                         "loop": loop, "device": "cpu"},
            "output": {"dir": str(tmp_path / precision)}})
        result = runner.run_job(cfg)["private"]
        assert (result["precision"], result["device"], result["steps"]) == (precision, "cpu", 2)
        got[precision] = (result, torch.load(tmp_path / precision / "model.pt"))
    (r32, m32), (r16, m16) = got["fp32"], got["bf16"]
    assert (r16["noise_multiplier"], r16["epsilon"]) == (r32["noise_multiplier"], r32["epsilon"])
    moved = [name for name in m32 if not torch.equal(m32[name], m16[name])]
    assert moved, "bf16 trained the same bits as fp32: the forward did not run under autocast"
    for name in m32:
        torch.testing.assert_close(m16[name], m32[name], rtol=0.05, atol=0.02,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.job
@needs_fashion
def test_cnn_job_on_fashion_mnist_two_ranks_through_the_launcher(tmp_path):
    cfg = tmp_path / "cnn.toml"
    _write_config(cfg, model={"kind": "cnn"}, data={"dataset": "fashion-mnist", "limit": 1024},
                  privacy={"noise_multiplier": 1.0, "max_grad_norm": 1.0, "accountant": "rdp"},
                  training={"epochs": 1, "batch_size": 128, "max_physical_batch_size": 64,
                            "lr": 0.01, "world_size": 2, "zero_stage": 2, "baseline": False},
                  output={"dir": str(tmp_path / "run")})
    out = subprocess.run([sys.executable, "-m", "dpzero", "train", str(cfg)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "private : test accuracy" in out.stdout
    run = tmp_path / "run"
    result = json.loads((run / "result.json").read_text())["private"]
    assert result["steps"] == 8 and result["test_examples"] == 10000
    assert 0 < result["epsilon"] < math.inf
    assert result["accuracy"] > 0.3  # 10 classes: well above chance after 8 private steps
    for name in ("ledger.jsonl", "metrics.jsonl", "config.json", "model.pt", "report.md",
                 "report.json", "epsilon.png", "accuracy.png", "private/diagnostics.jsonl",
                 "private/training.jsonl", "private/diagnostics.md", "private/loss.png"):
        assert (run / name).exists(), name
    ledger = dpzero.Ledger.open_read_only(str(run / "ledger.jsonl"))
    assert ledger.total_steps == 8
    assert result["delta"] == 1e-5  # the default, min(1e-5, 1/(10 N))
    assert ledger.epsilon(1e-5, "rdp") == pytest.approx(result["epsilon"], rel=1e-12)
    state = torch.load(run / "model.pt")
    assert set(state) == {"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                          "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    # Secure mode is the default, the report says so, and no run file carries a noise seed or
    # key (the model file holds the parameters only, asserted above).
    assert "secure (ChaCha20, OS-entropy key, never stored)" in (run / "report.md").read_text()
    assert json.loads((run / "report.json").read_text())["secure_mode"] is True
    for name in ("result.json", "report.json", "metrics.jsonl", "ledger.jsonl"):
        text = (run / name).read_text()
        assert '"key"' not in text and '"noise_seed"' not in text, name
        for line in text.splitlines():
            record = json.loads(line) if name.endswith("jsonl") else json.loads(text)
            assert _no_seed(record), (name, record)
            if not name.endswith("jsonl"):
                break


def _no_seed(record) -> bool:
    """No "seed" entry with a value anywhere in a JSON record."""
    if isinstance(record, dict):
        return all((k != "seed" or v is None) and _no_seed(v) for k, v in record.items())
    if isinstance(record, list):
        return all(_no_seed(v) for v in record)
    return True


class _Packed(torch.nn.Module):
    """A SentenceClassifier called on one tensor, [B, 2, L] = (input_ids, attention_mask)
    stacked, the one-input form tests/python/private_reference.py's loop takes."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, packed):
        return self.inner(packed[:, 0], packed[:, 1])


def test_minilm_lora_adapts_the_frozen_layers_only():
    # lora_rank = 4 under train_layers = 2: adapters on the query and value of layers 0-3,
    # layers 4-5 and the head trained in full, everything else frozen. The adapted projection
    # is W0 x + (alpha / r) B A x (Hu et al. 2022, eq. 3), checked by hand, and at the start
    # (B = 0) the model is the one without LoRA, same head.
    from dpzero.train.models import load_minilm

    torch.manual_seed(5)
    plain, tokenizer = load_minilm(None, 4, train_layers=2)
    torch.manual_seed(5)
    lora, _ = load_minilm(None, 4, train_layers=2, lora_rank=4, lora_alpha=8.0)
    trained = {n for n, p in lora.named_parameters() if p.requires_grad}
    adapters = {f"encoder.encoder.layer.{i}.attention.self.{w}.lora_{ab}.default.weight"
                for i in range(4) for w in ("query", "value") for ab in "AB"}
    full = {n for n, _ in lora.named_parameters()
            if n.startswith(("encoder.encoder.layer.4.", "encoder.encoder.layer.5."))}
    assert trained == adapters | full | {"head.weight", "head.bias"}
    assert next(iter(dict(lora.named_parameters()))).startswith("encoder.")  # order as before LoRA
    with pytest.raises(ValueError, match=r"lora_rank = 4 adapts the frozen layers, and "
                                         r"train_layers = 6 trains all 6"):
        load_minilm(None, 4, train_layers=6, lora_rank=4)
    batch = tokenizer(["a fortune", "another longer fortune for you"], padding=True,
                      return_tensors="pt")
    lora.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(lora(batch["input_ids"], batch["attention_mask"]),
                                   plain(batch["input_ids"], batch["attention_mask"]))
        query = lora.encoder.encoder.layer[1].attention.self.query
        torch.nn.init.normal_(query.lora_B["default"].weight)
        x = torch.randn(3, 384)
        a, b = query.lora_A["default"].weight, query.lora_B["default"].weight  # [4, 384], [384, 4]
        want = F.linear(x, query.base_layer.weight, query.base_layer.bias) + (8.0 / 4) * x @ a.T @ b.T
        torch.testing.assert_close(query(x), want)


def test_sentence_features_of_a_text_depend_on_that_text_alone():
    # kind "minilm-linear" trains on fixed embeddings (Note [fixed features and privacy]): a
    # text's embedding, padded to 24 among others, equals the mean of the encoder's last hidden
    # states over that text alone, unpadded, in eval mode (no dropout).
    from dpzero.train.features import sentence_features
    from dpzero.train.models import load_encoder

    encoder, tokenizer = load_encoder(None)
    texts = ["Computers are useless. They can only give you answers.", "ok",
             "The politician said nothing, at length, twice."]
    t = tokenizer(texts, padding="max_length", max_length=24, return_tensors="pt")
    encoder.train()
    got = sentence_features(encoder, t["input_ids"], t["attention_mask"])
    assert got.shape == (3, 384) and encoder.training  # mode restored
    encoder.eval()
    with torch.no_grad():
        for i, text in enumerate(texts):
            alone = tokenizer([text], return_tensors="pt")
            want = encoder(**alone).last_hidden_state[0].mean(0)
            torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-5)
    # Bit for bit, whatever the other texts and their padding: one example's presence must not
    # move another's row at all (a batched forward does, by rounding).
    other = tokenizer(["something else entirely, and much longer than the rest of them", texts[1]],
                      padding="max_length", max_length=30, return_tensors="pt")
    assert torch.equal(sentence_features(encoder, other["input_ids"],
                                         other["attention_mask"])[1], got[1])
    with pytest.raises(ValueError, match=r"one \[n, L\] shape, got \[3, 24\] and \[3, 23\]"):
        sentence_features(encoder, t["input_ids"], t["attention_mask"][:, 1:])


def _embed_rank(rank, world):
    from dpzero.train import task

    train, test = task.embedded(None, ("computers", "politics"), 0.2, 16, 25, 9, rank, world)
    return [train.tensors, test.tensors]


@pytest.mark.multirank
@needs_fortunes
def test_minilm_linear_features_are_split_over_the_ranks_and_gathered(tmp_path):
    # Two Gloo ranks each embed every other text and gather: both hold the same tensors, and
    # those are the embeddings of all texts computed here in one process, row for row and bit
    # for bit, with their labels (25 training texts: an uneven split).
    from dpzero.train import task
    from dpzero.train.features import sentence_features
    from dpzero.train.models import load_encoder

    per_rank = ranks.spawn(_embed_rank, 2, tmp_path, timeout_s=120)
    encoder, tokenizer = load_encoder(None)
    items = task.fortunes(["computers", "politics"], 0.2, 25, 9)
    threads = torch.get_num_threads()
    for split, split_items in enumerate(items):
        ids, mask, labels = datasets.tokenize(split_items, tokenizer, 16).tensors
        torch.set_num_threads(1)  # as each rank: a GEMM's blocking may follow the thread count
        try:
            want = sentence_features(encoder, ids, mask)
        finally:
            torch.set_num_threads(threads)
        for got in per_rank:
            assert torch.equal(got[split][0], per_rank[0][split][0])
            assert torch.equal(got[split][1], labels)
            assert torch.equal(got[split][0], want)  # each text encoded alone, on any rank
    assert [len(per_rank[0][s][1]) for s in (0, 1)] == [25, 9]


@pytest.mark.job
@needs_fortunes
def test_main_config_runs_on_a_subset(tmp_path):
    # configs/minilm-fortunes.toml as shipped (the README's main job), one rank in process on
    # 256 training and 100 test texts: a Linear head on 384-dimensional MiniLM embeddings,
    # every sample clipped at C = 0.1, ε the PRV accountant's for its (σ, q, steps) and at most
    # the target, and the baseline trained too.
    from dpzero.train import runner

    shipped = os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                           "minilm-fortunes.toml")
    cfg = config.load(shipped)
    assert (cfg.model.kind, cfg.privacy.max_grad_norm) == ("minilm-linear", 0.1)
    assert cfg.privacy.target_epsilon == 3.0 and cfg.training.baseline
    cfg.data.limit, cfg.data.test_limit, cfg.training.epochs = 256, 100, 2
    cfg.data.max_length = 32  # the shipped 128 only costs embedding time here
    cfg.privacy.secure_mode = False  # seeded noise: the accuracy bound below is deterministic
    cfg.training.batch_size, cfg.training.world_size = 64, 1
    cfg.output.dir = str(tmp_path / "run")
    config.validate(cfg)
    results = runner.run_job(cfg)
    priv = results["private"]
    steps = 2 * int(256 / 64)
    assert priv["steps"] == results["baseline"]["steps"] == steps
    assert priv["test_examples"] == 100 and priv["delta"] == 1e-5
    prv = dpzero.PRVAccountant()
    prv.step(noise_multiplier=priv["noise_multiplier"], sample_rate=64 / 256, num_steps=steps)
    assert priv["epsilon"] == pytest.approx(prv.get_epsilon(1e-5), rel=1e-9)
    assert 2.9 < priv["epsilon"] <= 3.0
    state = torch.load(tmp_path / "run" / "model.pt")
    assert {k: tuple(v.shape) for k, v in state.items()} == {"fc.weight": (4, 384),
                                                            "fc.bias": (4,)}
    assert priv["accuracy"] > 0.4  # 4 classes; above chance after 8 private steps


def test_minilm_lora_private_step_equals_naive_dp_sgd():
    # The job's LoRA model (adapters on all six layers, train_layers = 0, B nonzero so that A's
    # gradient is too) through make_private against the float64 torch.func step on real
    # MiniLM inputs: padding masks differ per example (the reference loops over the examples:
    # Hugging Face's mask code branches on the mask's values, which vmap cannot trace).
    from private_reference import first_private_step, naive_dp_sgd_step

    from dpzero.train.models import load_minilm

    torch.manual_seed(2)
    inner, tokenizer = load_minilm(None, 3, train_layers=0, lora_rank=2, lora_alpha=4.0)
    for name, p in inner.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    model = _Packed(inner).eval()  # no dropout: the reference draws none
    ref = __import__("copy").deepcopy(model)
    texts = [" ".join(["word"] * (1 + i % 5)) + f" {i}" for i in range(12)]
    t = tokenizer(texts, padding="max_length", max_length=8, truncation=True,
                  return_tensors="pt")
    ds = torch.utils.data.TensorDataset(torch.stack([t["input_ids"], t["attention_mask"]], 1),
                                        torch.arange(12) % 3)
    loss = lambda out, y: F.cross_entropy(out, y)  # noqa: E731
    c, sigma, lr, q = 0.05, 0.7, 1.0, 0.5
    p, x, y = first_private_step(model, ds, loss, sample_rate=q, noise_multiplier=sigma,
                                 max_grad_norm=c, seed=7, lr=lr, max_physical_batch_size=4)
    want = naive_dp_sgd_step(ref, loss, x, y, max_grad_norm=c, noise_multiplier=sigma, seed=7,
                             noise_index=0, lr=lr, expected_batch=q * len(ds), vectorized=False)
    got = p.privacy_engine.parameters()
    assert set(got) == set(want) and any("lora_A" in n for n in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=2e-5, rtol=1e-4)


@pytest.mark.job
@needs_fortunes
def test_minilm_job_single_rank_with_baseline(tmp_path):
    cfg = tmp_path / "small.toml"
    _write_config(cfg, model={"train_layers": 1},
                  data={"categories": ["computers", "politics"], "max_length": 24, "limit": 256},
                  privacy={"target_epsilon": 8.0},
                  training={"epochs": 1, "batch_size": 64, "max_physical_batch_size": 64,
                            "world_size": 1, "zero_stage": 3},
                  output={"dir": str(tmp_path / "run")})
    from dpzero.train import launch

    results = launch(str(cfg))
    priv, base = results["private"], results["baseline"]
    assert priv["epsilon"] <= 8.0 and base["epsilon"] == math.inf
    assert priv["steps"] == base["steps"] == 4
    run = tmp_path / "run"
    report = json.loads((run / "report.json").read_text())
    assert report["results"]["private"]["accuracy"] == priv["accuracy"]
    # The baseline was trained without privacy: nothing of it is released.
    assert "baseline" not in report["results"]
    assert "baseline" not in json.loads((run / "result.json").read_text())
    assert "baseline" not in (run / "metrics.jsonl").read_text()
    assert "| baseline" not in (run / "report.md").read_text()
    assert json.loads((run / "private" / "baseline.json").read_text())["accuracy"] == \
        base["accuracy"]
    assert "baseline (no privacy)" in (run / "private" / "diagnostics.md").read_text()
