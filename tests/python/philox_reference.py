"""Independent pure-Python references, written from the published algorithms, that the C++ noise
ops are checked against: Philox4x32-10 (Salmon et al., SC'11, §4), ChaCha20 (RFC 8439 §2.3), and the
Gaussian transforms of Note [noise ownership] / Note [secure noise] / Note [gaussian tail].

Plain Python integers for the block functions (no numpy), so they share no code or arithmetic
shortcuts with the C++ headers; numpy float32 scalars reproduce the fp32 rounding of the default
path, Python floats (fp64) the secure path.
"""

from __future__ import annotations

import math

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


def _rotl(x, n):
    return ((x << n) | (x >> (32 - n))) & MASK


def chacha20_block(key, counter, nonce):
    """RFC 8439 §2.3: 16 output words for 8 key words, a 32-bit counter and 3 nonce words."""
    init = [0x61707865, 0x3320646E, 0x79622D32, 0x6B206574, *key, counter, *nonce]
    s = list(init)

    def qr(a, b, c, d):
        s[a] = (s[a] + s[b]) & MASK; s[d] = _rotl(s[d] ^ s[a], 16)  # noqa: E702
        s[c] = (s[c] + s[d]) & MASK; s[b] = _rotl(s[b] ^ s[c], 12)  # noqa: E702
        s[a] = (s[a] + s[b]) & MASK; s[d] = _rotl(s[d] ^ s[a], 8)  # noqa: E702
        s[c] = (s[c] + s[d]) & MASK; s[b] = _rotl(s[b] ^ s[c], 7)  # noqa: E702

    for _ in range(10):
        qr(0, 4, 8, 12); qr(1, 5, 9, 13); qr(2, 6, 10, 14); qr(3, 7, 11, 15)  # noqa: E702
        qr(0, 5, 10, 15); qr(1, 6, 11, 12); qr(2, 7, 8, 13); qr(3, 4, 9, 14)  # noqa: E702
    return [(a + b) & MASK for a, b in zip(s, init)]


def radius64(hi: int, lo: int) -> float:
    """sqrt(-2 ln u1) for u1 = (m + 1/2) 2^-64, m = hi 2^32 + lo (Note [gaussian tail])."""
    m = (hi << 32) | lo
    return math.sqrt(2.0 * max(0.0, 64 * math.log(2.0) - math.log(float(m) + 0.5)))


def uniform_open01_f32(bits: int) -> np.float32:
    return np.float32(((bits >> 9) << 1) | 1) * np.float32(2.0**-24)


def normal2(seed: int, step: int, block: int, stream: int = NOISE_STREAM):
    seed &= (1 << 64) - 1
    w = philox4x32_10([block & MASK, (block >> 32) & MASK, step & MASK, stream],
                      [seed & MASK, seed >> 32])
    r = np.float32(radius64(w[0], w[1]))
    theta = np.float32(6.283185307179586) * uniform_open01_f32(w[2])
    return [r * np.cos(theta), r * np.sin(theta)]


def noise(seed: int, step: int, offset: int, n: int) -> np.ndarray:
    """z(seed, step, j) for j in [offset, offset + n), as float64 values of float32 math."""
    out = np.empty(n, dtype=np.float64)
    for i in range(n):
        j = offset + i
        out[i] = float(normal2(seed, step, j // 2)[j % 2])
    return out


def secure_noise(key, step: int, offset: int, n: int) -> np.ndarray:
    """Secure mode's z(key, t, j): ChaCha20 block j // 2, whose words 4p..4p+3 (p = 0..3) are four
    fp64 Box-Muller pairs; coordinate j sums output j % 2 (cosine, sine) of each, halved."""
    out = np.empty(n, dtype=np.float64)
    for i in range(n):
        j = offset + i
        pair = j // 2
        w = chacha20_block(list(key), pair & MASK, [(pair >> 32) & MASK, step, NOISE_STREAM])
        total = 0.0
        for p in range(4):
            a = w[4 * p: 4 * p + 4]
            r = radius64(a[0], a[1])
            u2 = (((((a[2] << 32) | a[3]) >> 12) << 1) | 1) * 2.0**-53
            total += r * (math.cos if j % 2 == 0 else math.sin)(2 * math.pi * u2)
        out[i] = total / 2
    return out
