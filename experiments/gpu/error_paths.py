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

import subprocess
import sys

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


def run_case(device: str, call: str) -> str:
    r = subprocess.run([sys.executable, "-c", PROLOGUE.format(device=device, call=call)],
                       capture_output=True, text=True, timeout=60)
    if r.returncode < 0:
        return f"CRASHED (signal {-r.returncode})"
    return r.stdout.strip() or f"rc={r.returncode}: {r.stderr.strip()[-300:]}"


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


def main() -> None:
    process_facts()
    import torch
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for name, call in CASES.items():
            print(f"{device:4} {name:9} {run_case(device, call)}", flush=True)
    if "cuda" in devices:
        name, call = AFTER_CUDA_INIT
        print(f"cpu  {name} {run_case('cpu', call)}", flush=True)


if __name__ == "__main__":
    main()
