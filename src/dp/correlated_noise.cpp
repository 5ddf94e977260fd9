// src/dp/correlated_noise.cpp — see correlated_noise.h (Note [correlated noise on shards]).
#include "src/dp/correlated_noise.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

#include <ATen/ATen.h>

namespace dpzero::dp {

CorrelatedNoise::CorrelatedNoise(privacy::BandedToeplitz strategy, NoiseKey key)
    : strategy_(std::move(strategy)), key_(std::move(key)) {
  if (strategy_.coefficients()[0] != 1.0)
    throw std::invalid_argument(
        "CorrelatedNoise: the strategy's diagonal c_0 must be 1, got " +
        std::to_string(strategy_.coefficients()[0]) +
        "; divide the strategy by c_0 (the noise's stddev takes the factor)");
  if (key_.secure && key_.key.size() != 8)
    throw std::invalid_argument("CorrelatedNoise: a secure noise key has 8 32-bit words, got " +
                                std::to_string(key_.key.size()));
}

CorrelatedNoise::Step CorrelatedNoise::at(int64_t k, double stddev) {
  if (!(std::isfinite(stddev) && stddev >= 0.0))
    throw std::invalid_argument("CorrelatedNoise: stddev must be finite and >= 0, got " +
                                std::to_string(stddev));
  if (k < 0)
    throw std::invalid_argument("CorrelatedNoise: charge index must be >= 0, got " +
                                std::to_string(k));
  for (const auto& [unit, h] : units_)
    if (k <= h.last)
      throw std::invalid_argument("CorrelatedNoise: charge index " + std::to_string(k) +
                                  " is not after unit " + std::to_string(unit) + "'s last, " +
                                  std::to_string(h.last) + " (a charge index never goes back)");
  return Step(*this, k, stddev);
}

int64_t CorrelatedNoise::last(int64_t unit) const {
  const auto it = units_.find(unit);
  return it == units_.end() ? -1 : it->second.last;
}

at::Tensor CorrelatedNoise::advance(History& h, int64_t k, const at::Tensor& like,
                                    const zero::UnitLayout& layout, int64_t rank, bool whole) {
  const std::vector<double>& c = strategy_.coefficients();
  at::Tensor w = at::zeros_like(like);  // z_k on the held coordinates (padding stays 0)
  if (whole) {
    add_unit_noise_(w, layout, 1.0, key_, k);
  } else {
    add_shard_noise_(w, layout, rank, 1.0, key_, k);
  }
  for (size_t i = 1; i < c.size() && i <= h.w.size(); ++i) w.sub_(h.w[i - 1].mul(c[i]));
  h.w.push_front(w);
  if (static_cast<int64_t>(h.w.size()) > strategy_.bands() - 1) h.w.pop_back();
  h.last = k;
  return w;
}

void CorrelatedNoise::Step::add_(at::Tensor& grad, int64_t unit, const zero::UnitLayout& layout,
                                 int64_t rank, bool whole) {
  History& h = owner_.units_[unit];
  if (k_ <= h.last)  // this step already added here, or a later one: a draw is never reused
    throw std::logic_error("CorrelatedNoise: charge " + std::to_string(k_) + " reached unit " +
                           std::to_string(unit) + " whose last charge is " +
                           std::to_string(h.last) + "; a step's noise is added once");
  if (owner_.strategy_.coefficients() == std::vector<double>{1.0}) {
    // One band with c_0 = 1 is DP-SGD: the same op call as StepNoise, so the same bits.
    StepNoise(stddev_, owner_.key_, k_).add_(grad, unit, layout, rank, whole);
    h.last = k_;
    return;
  }
  // Note [correlated noise on shards]: the w's of charges never applied first, unadded.
  for (int64_t skipped = h.last + 1; skipped < k_; ++skipped)
    owner_.advance(h, skipped, grad, layout, rank, whole);
  const at::Tensor w = owner_.advance(h, k_, grad, layout, rank, whole);
  if (stddev_ != 0.0) grad.add_(w.mul(stddev_));
}

}  // namespace dpzero::dp
