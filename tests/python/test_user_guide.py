"""Every Python block of docs/user-guide.md is a whole program: each runs by itself in an empty
folder, as a reader would run it after copying it into a file. A block headed ```python gpu runs
where there is a GPU; ```python torchrun=N runs as N ranks under torch's launcher. Reference: the
program's own exit status (each block prints or asserts what it shows)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from ranks import torchrun

pytestmark = pytest.mark.job

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GUIDE = os.path.join(ROOT, "docs", "user-guide.md")


def _blocks():
    with open(GUIDE) as f:
        text = f.read()
    found = []
    for m in re.finditer(r"^```python([^\n]*)\n(.*?)^```$", text, flags=re.M | re.S):
        line = text.count("\n", 0, m.start()) + 1
        found.append(pytest.param(m.group(1).strip(), m.group(2), id=f"line{line}"))
    return found


def test_the_guide_has_blocks_of_every_kind():
    kinds = {b.values[0] for b in _blocks()}
    assert {"", "gpu", "torchrun=2"} <= kinds, kinds


@pytest.mark.parametrize("kind, code", _blocks())
def test_a_guide_block_runs_by_itself(tmp_path, kind, code):
    script = tmp_path / "block.py"
    script.write_text(code)
    env = dict(os.environ)  # the dpzero this test imports: the installed one, or PYTHONPATH's
    if kind == "gpu" and not torch.cuda.is_available():
        pytest.skip("a GPU block")
    if kind.startswith("torchrun="):
        out = torchrun([script], int(kind.split("=")[1]), env=env, cwd=tmp_path)
    else:
        assert kind in ("", "gpu"), kind
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]


def _shell_lines():
    with open(GUIDE) as f:
        text = f.read()
    lines = []
    for m in re.finditer(r"^```(?:bash|sh)\n(.*?)^```$", text, flags=re.M | re.S):
        command = m.group(1).replace("\\\n", " ")
        lines += [line.split("#")[0].strip() for line in command.splitlines()
                  if line.strip() and not line.startswith("#")]
    return lines


@pytest.mark.parametrize("line", [l for l in _shell_lines()
                                  if l.split()[0] == "dpzero" and l.split()[1] in
                                  ("budget", "calibrate")])
def test_a_guide_accounting_command_runs(tmp_path, line):
    out = subprocess.run([sys.executable, "-m", "dpzero", *line.split()[1:]], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]


def test_every_file_a_guide_command_names_is_in_the_repository():
    # The jobs, sweeps and benchmarks the guide shows run elsewhere in the suite (test_train.py
    # runs each config on a subset, test_install.py the install line); here their files exist.
    named = {word for line in _shell_lines() for word in line.split()
             if re.match(r"^(configs|experiments|scripts)/\S+\.(toml|py|sh)$", word)}
    assert named, "the guide names no config, script or benchmark"
    missing = sorted(w for w in named if not os.path.exists(os.path.join(ROOT, w)))
    assert not missing, missing
