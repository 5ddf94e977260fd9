"""The C++ front door (src/dp/privacy_engine.h, example experiments/cpp_api/private_train.cpp)
against the Python one (dpzero.make_private) and against the float64 torch.func DP-SGD step
(private_reference.naive_dp_sgd_step), on sklearn's digits: the same weights and batch take the
same step, and the noise is bit for bit the same (same seed, same charge index, same global
coordinates), on one rank and on two (Gloo, one process per rank)."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess

import pytest
import torch
import torch.jit._pickle
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import dpzero
import dpzero.noise
from private_reference import naive_dp_sgd_step

pytestmark = pytest.mark.multirank

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# build/ unless DPZERO_BUILD_DIR names another build folder (experiments/gpu/kit.sh builds into
# build-gpu/ or build-bare/ and says so there).
BINARY = os.path.join(ROOT, os.environ.get("DPZERO_BUILD_DIR") or "build", "experiments", "cpp_api",
                      "private_train")

# The example's model sizes (experiments/cpp_api/private_train.cpp).
FEATURES, HIDDEN, CLASSES = 64, 32, 10
VOCAB, LEN, WIDTH, HEADS, TOKEN_CLASSES = 17, 16, 32, 2, 4


class Mlp(nn.Module):
    """experiments/cpp_api/models.h's MlpImpl: same parameters, same order, same forward."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Transformer(nn.Module):
    """experiments/cpp_api/models.h's TransformerImpl."""

    def __init__(self):
        super().__init__()
        d = WIDTH
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(LEN, d)
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.lnf = nn.LayerNorm(d)
        self.head = nn.Linear(d, TOKEN_CLASSES)

    def forward(self, ids):
        b, t = ids.shape
        h = self.tok(ids) + self.pos(torch.arange(t, device=ids.device)[None])
        d, dh = WIDTH, WIDTH // HEADS
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, HEADS, dh).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(dh), -1)
        h = h + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        h = h + self.fc2(F.gelu(self.fc1(self.ln2(h))))
        return self.head(self.lnf(h).mean(1))


def digits(kind: str):
    """sklearn's digits (1797 examples): the MLP reads the 64 pixels (scaled to [0, 1]) and the
    10 classes; the transformer reads 16 tokens (2x2-pooled pixels, 0..16) and the class mod 4."""
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long)
    if kind == "mlp":
        return x / 16.0, y
    pooled = F.avg_pool2d(x.view(-1, 1, 8, 8), 2).view(-1, LEN)
    return pooled.round().long().clamp(0, VOCAB - 1), y % TOKEN_CLASSES


def run_example_ranks(args, world):
    """The example with `args` as one process per rank; each rank's output."""
    assert os.path.exists(BINARY), f"{BINARY} is not built (scripts/setup.sh builds it)"
    procs = [subprocess.Popen([BINARY] + args + ["--rank", str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}: {text}"
    return outputs


def run_cpp(tmp_path, kind, model, x, y, *, world=1, rows=None, zero_loss=False, **flags):
    """The example's exchange mode on `world` ranks; the parameters after its step."""
    inp, out = tmp_path / "in.pt", tmp_path / "out.pt"
    state = {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
             "x": x, "y": y}
    if rows is not None:
        state["rows"] = rows
    torch.save(state, inp)
    args = ["--model", kind, "--exchange", str(inp), str(out), "--world", str(world)]
    if world > 1:
        args += ["--init", f"file://{tmp_path}/rendezvous"]
    if zero_loss:
        args.append("--zero-loss")
    if flags.get("sigma") == 0.0:
        args.append("--allow-no-noise")
    for name, value in flags.items():
        args += ["--" + name.replace("_", "-"), str(value)]
    run_example_ranks(args, world)
    # torch::pickle_save tags a typed dict with its type (torch.jit._pickle.restore_type_tag).
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        return torch.load(out)


def run_python(kind, model, x, y, *, rows=None, zero_loss=False, sigma, clip, q, lr, seed,
               max_physical_batch_size=None):
    """dpzero.make_private's step 0 (its loader's Poisson batch, or own_batch of the first
    sum(rows) examples); the parameters after it, and the batch."""
    p = dpzero.make_private(model, dataset=torch.utils.data.TensorDataset(x, y), optimizer="sgd",
                            sample_rate=q, noise_multiplier=sigma, max_grad_norm=clip, lr=lr,
                            seed=seed, allow_no_noise=sigma == 0.0,
                            max_physical_batch_size=max_physical_batch_size)

    def backward(xb, yb):
        loss = F.cross_entropy(p.model(xb), yb)
        (loss * 0.0 if zero_loss else loss).backward()

    if rows is not None:
        n = sum(rows)
        xb, yb = p.privacy_engine.own_batch((x[:n], y[:n]), logical_batch_size=n)
        backward(xb, yb)
        assert p.optimizer.step()
        return p.privacy_engine.parameters(), x[:n], y[:n]
    xs, ys = [], []
    for xb, yb in p.data_loader:
        xs.append(xb)
        ys.append(yb)
        p.optimizer.zero_grad()
        backward(xb, yb)
        if p.optimizer.step():
            break
    return p.privacy_engine.parameters(), torch.cat(xs), torch.cat(ys)


def close(got, want, atol=2e-5):
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name].double(), want[name].double(), atol=atol, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


SETTINGS = {"clip": 0.5, "q": 0.02, "lr": 0.3, "seed": 1234}


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
@pytest.mark.parametrize("sigma", [0.0, 0.8])
def test_poisson_step_matches_python_and_reference(tmp_path, kind, sigma):
    """Step 0 through the C++ sampler and the Python loader, one rank, micro-batches of 8: the
    same Poisson batch, the same clipped sum and the same noise, within float32 rounding of the
    float64 torch.func step."""
    torch.manual_seed(3)
    model = Mlp() if kind == "mlp" else Transformer()
    reference = copy.deepcopy(model)
    x, y = digits(kind)
    got = run_cpp(tmp_path, kind, model, x, y, sigma=sigma, max_physical_batch_size=8,
                  **SETTINGS)
    py, xb, yb = run_python(kind, copy.deepcopy(model), x, y, sigma=sigma,
                            max_physical_batch_size=8, **SETTINGS)
    assert xb.shape[0] > 8  # several micro-batches
    close(got, py)
    want = naive_dp_sgd_step(reference, F.cross_entropy, xb, yb, max_grad_norm=SETTINGS["clip"],
                             noise_multiplier=sigma, seed=SETTINGS["seed"], noise_index=0,
                             lr=SETTINGS["lr"], expected_batch=SETTINGS["q"] * len(x))
    close(got, want)
    moved = max((got[n] - p.detach()).abs().max().item() for n, p in model.named_parameters())
    assert moved > 1e-4  # the step changed the model


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_two_ranks_match_python(tmp_path, kind):
    """The C++ example on two ranks (Gloo, one process each), each handing in its share of one
    logical batch: the step of the Python path on one rank with the whole batch."""
    torch.manual_seed(4)
    model = Mlp() if kind == "mlp" else Transformer()
    x, y = digits(kind)
    rows = [7, 5]
    got = run_cpp(tmp_path, kind, model, x, y, world=2, rows=rows, sigma=0.8, **SETTINGS)
    py, _, _ = run_python(kind, copy.deepcopy(model), x, y, rows=rows, sigma=0.8, **SETTINGS)
    close(got, py)


@pytest.mark.parametrize("world", [1, 2])
def test_noise_is_bit_identical(tmp_path, world):
    """With the loss multiplied by 0 every clipped sum is exactly 0 and the update is the noise
    alone: the C++ front door on 1 or 2 ranks and the Python one draw it bit for bit the same, and
    it is σC·z(seed, 0, j) at every global coordinate j (in named_parameters() order)."""
    torch.manual_seed(5)
    model = Transformer()
    x, y = digits("transformer")
    sigma = 1.3
    got = run_cpp(tmp_path, "transformer", model, x, y, world=world, rows=[6] * world,
                  zero_loss=True, sigma=sigma, **SETTINGS)
    py, _, _ = run_python("transformer", copy.deepcopy(model), x, y, rows=[6] * world,
                          zero_loss=True, sigma=sigma, **SETTINGS)
    assert list(got) == list(py)
    for name in py:
        assert torch.equal(got[name], py[name]), name
    source = dpzero.noise.NoiseSource(seed=SETTINGS["seed"])
    offset = 0
    scale = SETTINGS["lr"] / (SETTINGS["q"] * len(x))
    for name, p in model.named_parameters():
        z = source.add_(torch.zeros(p.numel()), sigma * SETTINGS["clip"], 0, offset)
        offset += p.numel()
        torch.testing.assert_close(got[name], p.detach() - scale * z.view(p.shape), rtol=0,
                                   atol=1e-6)


def test_example_trains_the_same_on_two_ranks(tmp_path):
    """The example's training mode (Poisson sampling, 100 steps, a ledger): two ranks (Gloo, one
    process each) end where one rank does, and the ledger holds every step."""
    def train(world):
        ledger = tmp_path / f"ledger{world}.jsonl"
        args = ["--model", "transformer", "--steps", "100", "--lr", "2", "--seed", "0", "--world",
                str(world), "--ledger", str(ledger), "--max-physical-batch-size", "16"]
        if world > 1:
            args += ["--init", f"file://{tmp_path}/rendezvous{world}"]
        outputs = run_example_ranks(args, world)
        steps = sum(json.loads(line).get("kind") == "steps" for line in open(ledger))
        return outputs[0].strip().splitlines()[-1], steps

    one, steps_one = train(1)
    two, steps_two = train(2)
    assert steps_one == steps_two == 100
    # "trained 60 steps on W rank(s): accuracy A, epsilon E at delta D"
    assert one.replace("on 1 rank", "on 2 rank") == two, (one, two)
    assert float(one.split("accuracy ")[1].split(",")[0]) > 0.9  # it learnt (chance: 0.25)


# ---- one set of rules (Note [one set of rules] in src/dp/run.h) ---------------------------------
# Each row: make_private's settings (beside BASE) and what the ledger path holds beforehand. Both
# front doors must refuse with the same text, or, for the rows that train, write the same ledger
# byte for byte.

BASE = {"noise_multiplier": 0.8, "max_grad_norm": 0.5, "sample_rate": 0.02, "lr": 0.3,
        "seed": 1234}
# make_private's keyword -> the C++ example's flag.
FLAGS = {"noise_multiplier": "--sigma", "max_grad_norm": "--clip", "sample_rate": "--q",
         "lr": "--lr", "seed": "--seed", "secure_mode": "--secure-mode",
         "max_physical_batch_size": "--max-physical-batch-size",
         "loss_reduction": "--loss-reduction", "epsilon_budget": "--epsilon-budget",
         "budget_delta": "--budget-delta", "ledger_path": "--ledger", "run_id": "--run-id",
         "bands": "--bands", "freeze": "--freeze", "strategy": "--strategy",
         "steps": "--strategy-rows"}  # make_private's run length is the C++ strategy_rows


def ledger_of(path, *, run_id="other", dataset_size=1797, sigma=0.8, q=0.02, noise=True,
              settings=None):
    """A ledger at `path` holding two steps of another run's (or this run's) settings."""
    ledger = dpzero.accounting.Ledger.create(str(path), run_id=run_id, dataset_size=dataset_size,
                                             settings=settings or {})
    ledger.append(first_step=0, last_step=1, q=q, sigma=sigma, max_grad_norm=0.5, noise=noise)
    ledger.close()


# (name, settings beside BASE (None removes one), the ledger's content beforehand, what the
# refusal must say; None: the row trains one step).
ROWS = [
    ("sigma<0", {"noise_multiplier": -1.0}, None, "noise_multiplier must be finite and >= 0, got -1"),
    ("sigma=0", {"noise_multiplier": 0.0}, None, "pass allow_no_noise=True"),
    ("sigma-nan", {"noise_multiplier": math.nan}, None, "got nan"),
    ("C=0", {"max_grad_norm": 0.0}, None, "max_grad_norm must be > 0, got 0"),
    ("C subnormal", {"max_grad_norm": 1e-42}, None, "max_grad_norm must be at least 2^-64"),
    ("C=inf with noise", {"max_grad_norm": math.inf}, None, "noise needs a finite max_grad_norm"),
    ("sigma*C overflows", {"noise_multiplier": 1e200, "max_grad_norm": 1e200}, None,
     "noise_multiplier * max_grad_norm must be finite, got 1e+200 * 1e+200"),
    ("sigma*C past float32", {"noise_multiplier": 1e30, "max_grad_norm": 1e10}, None,
     "must be finite, got 1e+30 * 1e+10 (above float32's 3.4028234663852886e+38)"),
    ("q=0", {"sample_rate": 0.0}, None, "sample_rate must be in (0, 1], got 0"),
    ("q>1", {"sample_rate": 1.5}, None, "sample_rate must be in (0, 1], got 1.5"),
    ("cap<1", {"max_physical_batch_size": -1}, None, "max_physical_batch_size must be >= 1"),
    ("reduction", {"loss_reduction": "max"}, None, "loss_reduction must be 'mean' or 'sum'"),
    ("budget<0", {"epsilon_budget": -1.0, "budget_delta": 1e-5}, None,
     "epsilon_budget must be finite and > 0, got -1"),
    ("budget=inf", {"epsilon_budget": math.inf, "budget_delta": 1e-5}, None,
     "epsilon_budget must be finite and > 0, got inf"),
    ("budget without delta", {"epsilon_budget": 3.0}, None, "needs budget_delta"),
    ("budget delta>1", {"epsilon_budget": 3.0, "budget_delta": 1.5}, None,
     "budget_delta must be in (0, 1), got 1.5"),
    ("budget without noise", {"epsilon_budget": 3.0, "budget_delta": 1e-5,
                              "noise_multiplier": 0.0, "allow_no_noise": True}, None,
     "cannot be kept without noise"),
    ("seed in secure mode", {"secure_mode": True}, None, "seed=1234 with secure_mode=True"),
    ("budget spent", {"epsilon_budget": 1e-3, "budget_delta": 1e-5}, None,
     "allows 0 steps at sigma=0.8, q=0.02; 0 are charged"),
    ("ledger of another run id", {"run_id": "mine"}, {},
     'belongs to run "other", expected run "mine"'),
    ("ledger of another dataset", {}, {"dataset_size": 10}, "is for a dataset of 10 examples"),
    ("ledger at another sigma", {}, {"run_id": "x", "sigma": 2.0}, "holds steps at sigma=2, q=0.02"),
    ("ledger at another q", {}, {"run_id": "x", "q": 0.5}, "holds steps at sigma=0.8, q=0.5"),
    ("ledger without noise", {}, {"run_id": "x", "noise": False}, "records steps without noise"),
    ("bands=0", {"bands": 0}, None, "bands must be >= 1, got 0"),
    ("bands > N", {"bands": 1800}, None, "bands=1800 splits the data into that many partitions"),
    ("bands without noise", {"bands": 2, "noise_multiplier": 0.0, "allow_no_noise": True}, None,
     "use bands=1"),
    ("ledger of other bands", {"bands": 4}, {"run_id": "x"}, "bands=1, this run has bands=4"),
    # The banded strategy (Note [run strategy]).
    ("unknown strategy", {"bands": 4, "strategy": "cubic"}, None,
     "strategy must be 'sqrt_prefix_sum' or 'optimized', got 'cubic'"),
    ("strategy with one band", {"strategy": "optimized", "steps": 50}, None,
     "strategy='optimized' with bands=1"),
    ("optimized without a length", {"bands": 4, "strategy": "optimized"}, None,
     "needs strategy_rows >= 1 (make_private: epochs or steps), got 0"),
    ("ledger of another strategy", {"bands": 4, "strategy": "optimized", "steps": 50},
     {"run_id": "x", "settings": {"bands": 4, "strategy": "sqrt_prefix_sum"}},
     "strategy='sqrt_prefix_sum', this run has strategy='optimized' fitted to 50 rows"),
    ("ledger of another length", {"bands": 4, "strategy": "optimized", "steps": 50},
     {"run_id": "x", "settings": {"bands": 4, "strategy": "optimized", "strategy_rows": 60}},
     "strategy='optimized' fitted to 60 rows, this run has strategy='optimized' fitted to 50"),
    ("edited strategy coefficients", {"bands": 4},
     {"run_id": "x", "settings": {"bands": 4, "strategy": "sqrt_prefix_sum",
                                  "strategy_coefficients": [1.0, 0.5]}},
     "has strategy_coefficients [1.0,0.5]; it must be 4 finite numbers, the first 1, the "
     "square root's"),
    # A parameter frozen after the backward: the step refuses (Note [trained set]).
    ("trained set changed", {"freeze": "fc1.bias"}, None,
     "trainable parameters changed since the model was made private (trainable or frozen "
     "since: ['fc1.bias'])"),
    # Rows that train one step: the same ledger from either door (and, seeded, the same model).
    ("new ledger", {}, None, None),
    ("new ledger with a run id", {"run_id": "r7"}, None, None),
    ("continued ledger", {"run_id": "x"}, {"run_id": "x"}, None),
    ("no noise", {"noise_multiplier": 0.0, "allow_no_noise": True}, None, None),
    ("secure mode, the default without a seed", {"seed": None}, None, None),
    ("secure_mode=False without a seed", {"seed": None, "secure_mode": False}, None, None),
    ("banded", {"bands": 4}, None, None),
    ("banded, optimized", {"bands": 4, "strategy": "optimized", "steps": 50}, None, None),
    ("banded, continued", {"bands": 4, "run_id": "x"},
     {"run_id": "x", "settings": {"bands": 4, "strategy": "sqrt_prefix_sum",
                                  "strategy_coefficients": [1.0, 0.5, 0.375, 0.3125]}}, None),
]


def python_door(settings, x, y):
    """make_private and one step: (the refusal's text or None, the parameters after it)."""
    torch.manual_seed(0)
    settings = dict(settings)
    freeze = settings.pop("freeze", None)  # after the backward, before the step
    try:
        model = Mlp()
        p = dpzero.make_private(model, dataset=torch.utils.data.TensorDataset(x, y),
                                optimizer="sgd", **settings)
        for xb, yb in p.data_loader:
            F.cross_entropy(p.model(xb), yb).backward()
            if freeze is not None:
                dict(model.named_parameters())[freeze].requires_grad_(False)
            if p.optimizer.step():
                break
        params = p.privacy_engine.parameters()
        p.privacy_engine.detach()
    except (ValueError, RuntimeError) as e:  # LedgerError, BudgetExhausted: RuntimeErrors
        return str(e), None
    return None, params


def cpp_door(tmp_path, settings, x, y):
    """The C++ example's exchange mode with the same settings and one step: (the refusal's text
    or None, the parameters after it)."""
    torch.manual_seed(0)
    inp, out = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"params": {n: p.detach().clone() for n, p in Mlp().named_parameters()},
                "x": x, "y": y}, inp)
    args = [BINARY, "--model", "mlp", "--exchange", str(inp), str(out)]
    for name, value in settings.items():
        if name == "allow_no_noise":
            args += ["--allow-no-noise"] if value else []
        else:
            args += [FLAGS[name], str(value).lower() if isinstance(value, bool) else str(value)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        assert done.returncode == 1 and done.stderr.startswith("private_train: "), done.stderr
        return done.stderr[len("private_train: "):].rstrip("\n"), None
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        return None, torch.load(out)


@pytest.mark.parametrize("name, settings, ledger, why", ROWS, ids=[r[0] for r in ROWS])
def test_both_front_doors_refuse_alike_and_write_the_same_ledger(tmp_path, monkeypatch, name,
                                                                 settings, ledger, why):
    """Note [one set of rules]: every row through dpzero.make_private and through the C++
    PrivacyEngine (its example program): the same refusal, word for word, naming its cause, with
    a ledger that was there left as it was; or one step, the same ledger byte for byte
    (SOURCE_DATE_EPOCH fixes the header's time) and, when seeded, the same model."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    x, y = digits("mlp")
    path = tmp_path / "ledger.jsonl"
    settings = {k: v for k, v in {**BASE, **settings, "ledger_path": str(path)}.items()
                if v is not None}
    outcomes, models, ledgers = [], [], []
    for door in (python_door, lambda s, x, y: cpp_door(tmp_path, s, x, y)):
        if path.exists():
            path.unlink()
        if ledger is not None:
            ledger_of(path, **ledger)
        before = path.read_bytes() if path.exists() else None
        refusal, model = door(settings, x, y)
        outcomes.append(refusal)
        models.append(model)
        ledgers.append(path.read_bytes() if path.exists() else None)
        if refusal is not None and before is not None:
            assert ledgers[-1] == before  # a refused run leaves the ledger as it was
    assert outcomes[0] == outcomes[1], outcomes
    assert ledgers[0] == ledgers[1]
    if why is not None:
        assert outcomes[0] is not None and why in outcomes[0], outcomes[0]
        return
    assert outcomes[0] is None, outcomes[0]
    header, *steps = [json.loads(line) for line in ledgers[0].decode().splitlines()]
    if ledger is None:  # the header this run wrote
        assert header["settings"]["secure_mode"] == ("seed" not in settings
                                                     and settings.get("secure_mode") is not False)
    held = 2 if ledger is not None else 0  # one step more than the ledger held
    assert sum(s["last_step"] - s["first_step"] + 1 for s in steps) == held + 1
    if "seed" in settings:
        close(models[1], models[0])
