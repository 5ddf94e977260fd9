// src/zero/shard_noise.cpp — noise on a rank's shard through the dpzero::add_noise_ op.
#include "src/zero/shard_noise.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

namespace dpzero::zero {

int64_t add_shard_noise_(at::Tensor& shard, const UnitLayout& layout, int64_t rank, double stddev,
                         const NoiseKey& key, int64_t step) {
  TORCH_CHECK(shard.dim() == 1 && shard.numel() == layout.shard_numel(),
              "add_shard_noise_: shard must be 1-D with ", layout.shard_numel(),
              " elements (the layout's shard size), got shape ", shard.sizes());
  static const auto philox_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpzero::add_noise_", "")
          .typed<at::Tensor&(at::Tensor&, double, int64_t, int64_t, int64_t)>();
  static const auto secure_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpzero::add_secure_noise_", "")
          .typed<at::Tensor&(at::Tensor&, double, c10::IntArrayRef, int64_t, int64_t)>();
  int64_t noised = 0;
  for (const CoordinateRun& run : layout.runs_for_rank(rank)) {
    at::Tensor piece = shard.narrow(0, run.local_offset, run.length);
    if (key.secure) {
      secure_op.call(piece, stddev, key.key, step, run.global_offset);
    } else {
      philox_op.call(piece, stddev, key.seed, step, run.global_offset);
    }
    noised += run.length;
  }
  return noised;
}

}  // namespace dpzero::zero
