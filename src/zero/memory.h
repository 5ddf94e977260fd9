// src/zero/memory.h — the model-state memory a ZeRO stage predicts per rank (Rajbhandari et al.
// 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", §5.1 and Fig. 1),
// to set beside what ZeroState::memory() measures.
//
// With Ψ parameters, W ranks, p bytes per compute parameter, g bytes per gradient element and
// K bytes of optimizer state per parameter (fp32 master copy included under mixed precision):
//
//   stage 0 (data parallel)  (p + g + K)·Ψ
//   stage 1 (P_os)           (p + g)·Ψ + K·Ψ/W
//   stage 2 (P_os+g)         p·Ψ + (g + K)·Ψ/W
//   stage 3 (P_os+g+p)       (p + g + K)·Ψ/W
//
// The paper's figures are the 16-bit Adam case p = g = 2, K = 12 (4 master + 4 + 4 moments):
// 4Ψ + 12Ψ/W, 2Ψ + 14Ψ/W, 16Ψ/W. The engine's measured bytes equal these with Ψ replaced by the
// padded flat sizes (UnitLayout: alignment and equal shards), so the two differ only by padding.
#pragma once

#include <cstdint>

#include "src/zero/optim.h"
#include "src/zero/stage.h"

namespace dpzero::zero {

struct ModelStateBytes {
  double params = 0;     // p-term: compute parameters
  double grads = 0;      // g-term: persistent gradients
  double optimizer = 0;  // K-term: optimizer state, fp32 master included
  double total() const { return params + grads + optimizer; }
};

// psi: parameter count; world_size >= 1; param_bytes, grad_bytes > 0; optimizer_bytes >= 0 (K).
// Throws naming a value out of range.
ModelStateBytes predict_model_state_bytes(Stage stage, double psi, int64_t world_size,
                                          double param_bytes, double grad_bytes,
                                          double optimizer_bytes);

// K for an optimizer (bytes of fp32 state per parameter: SGD 4 with momentum else 0; Adam/AdamW
// 8, 12 with AMSGrad) plus 4 for a separate fp32 master when `mixed`.
double optimizer_bytes_per_param(const OptimizerOptions& options, bool mixed);

}  // namespace dpzero::zero
