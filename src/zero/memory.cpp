// src/zero/memory.cpp — ZeRO's model-state formulas (memory.h).
#include "src/zero/memory.h"

#include <c10/util/Exception.h>

namespace dpzero::zero {

ModelStateBytes predict_model_state_bytes(Stage stage, double psi, int64_t world_size,
                                          double param_bytes, double grad_bytes,
                                          double optimizer_bytes) {
  TORCH_CHECK(psi >= 0, "parameter count must be >= 0, got ", psi);
  TORCH_CHECK(world_size >= 1, "world_size must be >= 1, got ", world_size);
  TORCH_CHECK(param_bytes > 0, "bytes per parameter must be > 0, got ", param_bytes);
  TORCH_CHECK(grad_bytes > 0, "bytes per gradient element must be > 0, got ", grad_bytes);
  TORCH_CHECK(optimizer_bytes >= 0, "optimizer bytes per parameter must be >= 0, got ",
              optimizer_bytes);
  const double w = static_cast<double>(world_size);
  ModelStateBytes out;
  out.params = param_bytes * psi / (stage == Stage::k3 ? w : 1.0);
  out.grads = grad_bytes * psi / (stage == Stage::k2 || stage == Stage::k3 ? w : 1.0);
  out.optimizer = optimizer_bytes * psi / (stage == Stage::k0 ? 1.0 : w);
  return out;
}

double optimizer_bytes_per_param(const OptimizerOptions& options, bool mixed) {
  double k = mixed ? 4.0 : 0.0;
  if (options.kind == OptimizerKind::kSgd) {
    k += options.momentum != 0.0 ? 4.0 : 0.0;
  } else {
    k += options.amsgrad ? 12.0 : 8.0;
  }
  return k;
}

}  // namespace dpzero::zero
