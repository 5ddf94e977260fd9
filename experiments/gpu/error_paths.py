"""experiments/gpu/error_paths.py — does an op's error crash the process, and when? (check.sh's errors
stage, a diagnosis of the first H200 run: experiments/results/gpu.md.)

On the lent H200 every CUDA test whose expected error message held a number died of SIGSEGV,
while errors without a number were raised and caught, and the same errors pass on the CPU build
and in the CUDA build's GoogleTests. Each case below raises one of dpzero's argument errors in a
fresh process, on the CPU and on the GPU, with and without a number in the message, so the
outcome separates "CUDA tensors" from "this Python process" as the condition; torch's own
numbered error and dpzero's on CPU tensors after CUDA's initialisation separate "dpzero's code"
from "the process's C++ locale or libstdc++". It also prints which
libstdc++ the process maps and which compiler built dpzero._C (a libstdc++ older than the headers
dpzero was compiled against is one way number formatting can fail inside a process and not in a
native test binary).

    python experiments/gpu/error_paths.py        (needs dpzero importable; prints one line a case)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, Optional

CASES = {
    # the error without a number: "G must hold at least one tensor"
    "no number": "ops.linear_sq_norms_multi(t(3, 5, 4), [])",
    # with sizes in it: "... must share all but their last dim, got A [3, 5, 4] and G [3, 6, 2]"
    "sizes": "ops.linear_sq_norms_multi(t(3, 5, 4), [t(3, 5, 2), t(3, 6, 2)])",
    # with integers in it: "normalized_ndim must be in [1, input.dim() - 1] = [1, 2], got 4"
    "integers": "ops.layer_norm_sq_norms(t(2, 3, 4), t(2, 3, 4), 1e-5, False, False, 4)",
    # torch's own error with numbers: "The size of tensor a (2) must match ... (3)"; if this one
    # dies too, the process (its C++ locale, its libstdc++) is at fault, not dpzero
    "torch's": "t(2) + t(3)",
}
# On the GPU also: dpzero's numbered error on CPU tensors once CUDA is initialised (a library
# that CUDA loads could have replaced the global C++ locale).
AFTER_CUDA_INIT = ("after CUDA init",
                   "torch.zeros(1, device='cuda'); torch.cuda.synchronize(); "
                   "ops.linear_sq_norms_multi(torch.randn(3, 5, 4), [torch.randn(3, 6, 2)])")
PROLOGUE = """
import torch, dpzero
ops = torch.ops.dpzero
def t(*shape):
    return torch.randn(*shape, device={device!r})
try:
    {call}
    print("no error raised")
except RuntimeError as e:
    print("raised and caught:", str(e).splitlines()[0][:100])
"""


def run_case(device: str, call: str, env: Optional[Dict[str, str]] = None) -> str:
    """The case's outcome in a fresh process (``env``: variables added to this one's)."""
    r = subprocess.run([sys.executable, "-c", PROLOGUE.format(device=device, call=call)],
                       capture_output=True, text=True, timeout=60,
                       env=None if env is None else {**os.environ, **env})
    if r.returncode < 0:
        return f"CRASHED (signal {-r.returncode})"
    return r.stdout.strip() or f"rc={r.returncode}: {r.stderr.strip()[-300:]}"


def toolchain_libstdcxx() -> Optional[str]:
    """The libstdc++ of the compiler that built dpzero (g++ -print-file-name), or None."""
    try:
        path = subprocess.run(["g++", "-print-file-name=libstdc++.so.6"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return os.path.realpath(path) if os.path.isabs(path) and os.path.exists(path) else None


def backtrace(device: str, call: str) -> str:
    """The last frames of a crashing case under gdb (or the toolkit's cuda-gdb)."""
    gdb = shutil.which("gdb") or shutil.which("cuda-gdb")
    if gdb is None:
        return "no gdb or cuda-gdb on this machine"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(PROLOGUE.format(device=device, call=call))
    try:
        r = subprocess.run([gdb, "-q", "-batch", "-ex", "run", "-ex", "bt 25",
                            "-ex", "info sharedlibrary libstdc",
                            "--args", sys.executable, f.name],
                           capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        return f"{gdb} timed out"
    finally:
        os.unlink(f.name)
    frames = [line for line in r.stdout.splitlines()
              if line.startswith(("#", "Thread", "Program received", "0x", "From"))]
    return "\n".join(frames[-40:]) or r.stdout[-3000:]


def process_facts() -> None:
    import torch
    import dpzero
    maps = open("/proc/self/maps").read().splitlines()
    libs = sorted({line.split()[-1] for line in maps if "libstdc++" in line or "libgcc_s" in line})
    print("libstdc++ / libgcc_s mapped after import torch, dpzero:", ", ".join(libs) or "none")
    print("dpzero._C:", dpzero._C.__file__, "CUDA kernels:", dpzero._C.with_cuda,
          "torch CUDA:", torch.cuda.is_available())
    comment = subprocess.run(["readelf", "-p", ".comment", dpzero._C.__file__], capture_output=True,
                             text=True).stdout
    print("compilers in dpzero._C's .comment:",
          "; ".join(sorted({line.split("]", 1)[-1].strip() for line in comment.splitlines()
                            if "]" in line})) or "unknown")


LOCALE_CLASSIC = "_ZNSt6locale7classicEv"  # std::locale::classic()
EXPORTERS = """
import subprocess, torch, dpzero
if torch.cuda.is_available():
    torch.zeros(1, device="cuda"); torch.cuda.synchronize()
libs = sorted({line.split()[-1] for line in open("/proc/self/maps")
               if ".so" in line.split()[-1]})
for lib in libs:
    out = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True,
                         text=True).stdout
    if "%s" in out:
        print(lib)
""" % LOCALE_CLASSIC


def locale_exporters() -> str:
    """The mapped libraries (after CUDA's initialisation where there is a GPU) that define
    std::locale::classic(): more than one means two C++ runtimes' locales in one process."""
    r = subprocess.run([sys.executable, "-c", EXPORTERS], capture_output=True, text=True,
                       timeout=120)
    return ", ".join(r.stdout.split()) or f"none found (rc={r.returncode}: {r.stderr[-200:]})"


def main() -> None:
    process_facts()
    print("std::locale::classic() defined by:", locale_exporters(), flush=True)
    import torch
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    crashed = []
    for device in devices:
        for name, call in CASES.items():
            outcome = run_case(device, call)
            print(f"{device:4} {name:9} {outcome}", flush=True)
            if outcome.startswith("CRASHED"):
                crashed.append((device, name, call))
    if "cuda" in devices:
        name, call = AFTER_CUDA_INIT
        outcome = run_case("cpu", call)
        print(f"cpu  {name} {outcome}", flush=True)
        if outcome.startswith("CRASHED"):
            crashed.append(("cpu", name, call))
    # Each crash again with the C locale and with the toolchain's libstdc++ preloaded: a crash
    # that either one cures names the locale or a second C++ runtime as the cause.
    preload = toolchain_libstdcxx()
    variants = [("LC_ALL=C", {"LC_ALL": "C"})]
    if preload:
        variants.append((f"LD_PRELOAD={preload}", {"LD_PRELOAD": preload}))
    for device, name, call in crashed:
        for label, env in variants:
            print(f"{device:4} {name:9} with {label}: {run_case(device, call, env)}", flush=True)
    if crashed:
        device, name, call = crashed[0]
        print(f"backtrace of {device} {name}:\n{backtrace(device, call)}", flush=True)


if __name__ == "__main__":
    main()
