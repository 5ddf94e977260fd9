"""The user guide's Opacus script ("Coming from Opacus"), run as written: its code block is read
from docs/user-guide.md and executed as it stands, and its training part again on a GRU (through
the kernels, Note [recurrence through the kernels]), so the guide stays true. Resuming from such a checkpoint is checked against an
uninterrupted run in test_optimizer.py."""

import os
import re

import torch
from torch import nn

GUIDE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "user-guide.md")


def _script() -> str:
    text = open(GUIDE).read()
    section = text[text.index("## Coming from Opacus"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _inputs():
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(6, 16)
            self.rnn = nn.GRU(16, 8, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.rnn(torch.tanh(self.body(x)))[0][:, -1])

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 5, 6, generator=g),
                                          torch.randint(0, 3, (64,), generator=g))
    return Net(), torch.utils.data.DataLoader(data, batch_size=16)


def _check(scope, tmp_path, steps):
    engine = scope["engine"]
    assert engine.charges == steps  # one epoch of the loader: 1 / q logical steps
    assert 0 < engine.get_epsilon(1e-5) < float("inf")
    saved = torch.load(tmp_path / "ckpt.pt")
    assert set(saved) == {"model", "optimizer", "scheduler", "privacy"}
    assert set(saved["optimizer"]["state"][0]) == {"momentum_buffer"}
    assert saved["scheduler"]["last_epoch"] == steps


def test_the_user_guide_script_runs_unchanged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(_script(), GUIDE, "exec"), scope)
    _check(scope, tmp_path, len(scope["train_loader"]))


def test_the_user_guide_script_trains_a_gru(tmp_path, monkeypatch):
    # The script from its optimizer on, with the model and loader of _inputs.
    monkeypatch.chdir(tmp_path)
    script = _script()
    imports = "\n".join(line for line in script.splitlines() if line.startswith(("from ", "import ")))
    training = script[script.index("optimizer = torch.optim.SGD"):]
    model, loader = _inputs()
    scope = {"model": model, "train_loader": loader, "steps": 4}
    exec(compile(imports + "\n" + training, GUIDE, "exec"), scope)
    _check(scope, tmp_path, 4)
