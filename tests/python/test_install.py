"""Installing dpzero as a library: the user guide's one pip command into an environment that has
torch, and a clear refusal at import when torch is of another minor version than the one dpzero
was built against. Reference: the installed package imported from outside the checkout, and
torch's own version string."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_a_torch_of_another_minor_version_is_refused_at_import():
    # A build for torch 2.10 (the generated _build_info says so) meets this environment's torch.
    code = ("import sys, types; sys.modules['dpzero._build_info'] = "
            "types.SimpleNamespace(TORCH_VERSION='2.10.0+cpu'); import dpzero")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0
    assert (f"dpzero was built against torch 2.10.0+cpu, but this environment has torch "
            f"{torch.__version__}. Install torch 2.10.x") in out.stderr, out.stderr[-2000:]
    same = code.replace("2.10.0+cpu", torch.__version__.split("+")[0])
    ok = subprocess.run([sys.executable, "-c", same], capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]


def _user_guide_install_command() -> str:
    with open(os.path.join(ROOT, "docs", "user-guide.md")) as f:
        text = f.read()
    found = re.findall(r"^pip install --no-build-isolation \S+$", text, flags=re.M)
    assert len(found) == 1, found
    return found[0]


def _configured(build_dir: str, name: str, default: str) -> str:
    """The value of a CMake cache entry of an existing build folder, or default."""
    try:
        with open(os.path.join(build_dir, "CMakeCache.txt")) as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split("=", 1)[1].strip()
    except FileNotFoundError:
        pass
    return default


@pytest.mark.job
def test_pip_install_into_an_environment_that_has_torch(tmp_path):
    # A fresh virtual environment that reaches this one's packages (torch, the build tools)
    # through a .pth file, after its own: the way a user's environment with torch would be. Then
    # the guide's command, and dpzero used from outside the checkout: the new install, not the
    # one this environment already holds.
    env_dir = tmp_path / "env"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv",
                    str(env_dir)], check=True, timeout=300)
    python = env_dir / "bin" / "python"
    new_site = subprocess.run([str(python), "-c", "import sysconfig; "
                               "print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(new_site, "with-torch.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")

    # The command runs on this checkout and so reuses its build folder (pyproject's build-dir):
    # the install compiles only what changed since this environment's own install. Sources
    # copied elsewhere would compile everything again, CUDA kernels included (five minutes on
    # CI's two cores: the compiler cache keys a compile by the absolute paths outside the
    # source folder, and a CI clone's environment is in a new folder each time); that the
    # committed sources build from a clean tree is what CI's own clean clone shows. The build
    # folder keeps its GoogleTest setting, so ctest's targets stay.
    env = dict(os.environ, PATH=f"{env_dir / 'bin'}:{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    env["DPZERO_BUILD_TESTS"] = _configured(os.path.join(ROOT, "build"), "DPZERO_BUILD_TESTS",
                                            default="OFF")
    command = _user_guide_install_command().split()
    command[-1] = ROOT  # the guide's path/to/dpzero
    built = subprocess.run([str(python), "-m", *command], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=1500)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]

    check = ("import dpzero, os; print(os.path.dirname(dpzero.__file__)); "
             "a = dpzero.PRVAccountant(); a.step(noise_multiplier=1.0, sample_rate=0.01, "
             "num_steps=100); print(a.get_epsilon(1e-5))")
    out = subprocess.run([str(python), "-c", check], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    where, eps = out.stdout.split()
    assert where == os.path.join(new_site, "dpzero")  # the new install, not this environment's
    import dpzero
    reference = dpzero.PRVAccountant()
    reference.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=100)
    assert float(eps) == reference.get_epsilon(1e-5)
    cli = subprocess.run([str(env_dir / "bin" / "dpzero"), "budget", "-q", "0.01", "-s", "1.0",
                          "--steps", "100", "--delta", "1e-5"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-2000:]
