// kernels/ops.cpp — the one schema of dpzero's torch ops (TORCH_LIBRARY(dpzero, ...)).
// Each op has one implementation file per backend: kernels/cpu/<op>.cpp and kernels/cuda/<op>.cu.
#include <torch/library.h>

TORCH_LIBRARY(dpzero, m) {
  // In place: self[i] += std * z(seed, step, offset + i) for every i (Note [noise ownership] in
  // privacy/noise.h). self: [n] any shape, contiguous, float32 / bfloat16 / float16 (fp32 math).
  // seed is a 64-bit key given as int64 (its bits are used as uint64); 0 <= step < 2^32;
  // offset >= 0 is the global coordinate index of self's first element.
  m.def("add_noise_(Tensor(a!) self, float std, int seed, int step, int offset) -> Tensor(a!)");
  // Secure mode (Note [secure noise] in privacy/secure_noise.h): the same contract with the draw
  // from ChaCha20 under a 256-bit key given as eight 32-bit words (0 <= w < 2^32), fp64 math and
  // the sum-of-normals mitigation. self: contiguous float32 / float64 / bfloat16 / float16.
  m.def("add_secure_noise_(Tensor(a!) self, float std, int[] key, int step, int offset) -> Tensor(a!)");
  // Per-sample clip factors from per-sample norms (privacy/clipping.h): norms [B] float32;
  // mode "flat" (min(1, C/(n+1e-6))) or "automatic" (C/(n+gamma)). Returns factors [B] float32
  // (0 for NaN/Inf norms) and the count of such non-finite norms as a 0-dim int64 tensor.
  m.def("clip_factors(Tensor norms, float max_norm, str mode, float gamma=0.01) -> (Tensor, Tensor)");
}
