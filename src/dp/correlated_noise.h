// src/dp/correlated_noise.h — noise correlated across steps on the coordinates each rank updates:
// the banded matrix factorization mechanism's noise (Note [banded strategies] in
// privacy/banded.h gives the strategy and its mathematics).
//
// Note [correlated noise on shards]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The noise of charge k on global coordinate j is
//   w_k(j) = (z_k(j) − Σ_{i=1}^{b−1} c_i · w_{k−i}(j)) / c_0,
// z_k(j) the counter-based draw DP-SGD adds there (Note [noise ownership] in privacy/noise.h).
// Each coordinate's recursion reads its own past only, so a rank keeps the b − 1 previous w's of
// exactly the coordinates it updates: (b − 1) × its shard of each unit (the whole unit at stage
// 0). The sequence is the same, bit for bit, for any number of ranks and any stage on one kind of
// device: the same draws and the same float32 operations per coordinate, each rounded once (a
// product, then a difference; c_0 is 1, so there is no quotient, which CUDA forms as a product by
// the reciprocal), so no vector width or fused multiply-add can round one coordinate differently
// from another layout's. A charge index never applied (a step charged and then failed, Note
// [noise index] in private_step.h) still has its w: a unit that reaches charge k with its history
// at k' < k − 1 first forms the w's of k' + 1 .. k − 1 without adding them, so the history is
// always C⁻¹z at consecutive charge indices from charge 0. A resumed run's fresh object thus
// recomputes the history from the counters on its first charge (k draws of the shard), and its
// noise continues exactly when the key is the same (a seeded run; secure mode draws a new key at
// a resume, whose noise is then a fresh C⁻¹z' on the remaining rows, as private). A unit's noise is added once per charge: a step applied twice is
// refused. (The private step passes its row, the sampler's step t, as k: Note [banded steps] in
// private_step.h.)
#pragma once

#include <cstdint>
#include <deque>
#include <map>

#include <ATen/core/Tensor.h>

#include "privacy/banded.h"
#include "src/dp/step_noise.h"
#include "src/zero/gradient_noise.h"

namespace dpzero::dp {

class CorrelatedNoise {
 public:
  // The strategy's c_0 must be 1 (std::invalid_argument otherwise: scale the stddev instead).
  CorrelatedNoise(privacy::BandedToeplitz strategy, NoiseKey key);

  // The noise of charge k, `stddev` (σ·C times the strategy's normalisation, the caller's)
  // times w_k, as the GradientNoise the ZeRO state's update adds. Throws std::invalid_argument
  // for a bad stddev or a k at or before a unit's last one (a charge index never goes back); its
  // add_ throws std::logic_error when a unit has had charge k already (a step applied twice).
  class Step final : public zero::GradientNoise {
   public:
    void add_(at::Tensor& grad, int64_t unit, const zero::UnitLayout& layout, int64_t rank,
              bool whole) override;

   private:
    friend class CorrelatedNoise;
    Step(CorrelatedNoise& owner, int64_t k, double stddev)
        : owner_(owner), k_(k), stddev_(stddev) {}
    CorrelatedNoise& owner_;
    int64_t k_;
    double stddev_;
  };
  Step at(int64_t k, double stddev);

  const privacy::BandedToeplitz& strategy() const { return strategy_; }
  // Unit `unit`'s last charge index with a w (-1: none yet).
  int64_t last(int64_t unit) const;

 private:
  struct History {
    int64_t last = -1;
    std::deque<at::Tensor> w;  // newest first, at most b − 1, each like the unit's gradient
  };
  // Forms w_k of the coordinates `like` holds from the unit's history, keeps it (b > 1) and
  // returns it.
  at::Tensor advance(History& h, int64_t k, const at::Tensor& like,
                     const zero::UnitLayout& layout, int64_t rank, bool whole);

  privacy::BandedToeplitz strategy_;
  NoiseKey key_;
  std::map<int64_t, History> units_;
};

}  // namespace dpzero::dp
