"""An independent, pure-Python Philox4x32-10 and Gaussian draw, written from the published
algorithm (Salmon et al., SC'11, §4) — the reference the C++ noise op is checked against.

Deliberately plain Python integers (no numpy) so it shares no code or arithmetic shortcuts with
the C++ header; float32 rounding is reproduced with numpy's float32 scalars only at the end.
"""

from __future__ import annotations

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
MASK = 0xFFFFFFFF
NOISE_STREAM = int.from_bytes(b"nois", "big")  # 0x6e6f6973


def philox4x32_10(counter, key):
    c = list(counter)
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + W0) & MASK, (k1 + W1) & MASK
        p0, p1 = M0 * c[0], M1 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & MASK, p1 & MASK, ((p0 >> 32) ^ c[3] ^ k1) & MASK, p0 & MASK]
    return c


def uniform_open01(bits: int) -> np.float32:
    return np.float32(((bits >> 9) << 1) | 1) * np.float32(2.0**-24)


def normal4(seed: int, step: int, block: int, stream: int = NOISE_STREAM):
    seed &= (1 << 64) - 1
    words = philox4x32_10(
        [block & MASK, (block >> 32) & MASK, step & MASK, stream], [seed & MASK, seed >> 32]
    )
    out = []
    for a, b in ((words[0], words[1]), (words[2], words[3])):
        u1, u2 = uniform_open01(a), uniform_open01(b)
        r = np.sqrt(np.float32(-2.0) * np.log(u1))
        theta = np.float32(6.283185307179586) * u2
        out += [r * np.cos(theta), r * np.sin(theta)]
    return out


def noise(seed: int, step: int, offset: int, n: int) -> np.ndarray:
    """z(seed, step, j) for j in [offset, offset + n), as float64 values of float32 math."""
    out = np.empty(n, dtype=np.float64)
    for i in range(n):
        j = offset + i
        out[i] = float(normal4(seed, step, j // 4)[j % 4])
    return out
