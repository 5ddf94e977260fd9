// accounting/banded.h — what a banded-noise run costs: the DP-SGD steps its privacy equals.
//
// Note [amplified banded accounting]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A run with b-banded correlated noise (Note [banded strategies] in privacy/banded.h) releases,
// at its rows t = 0, 1, ..., the gradient sums plus the noise C⁻¹z (C lower triangular with b
// bands, its columns scaled to norm at most 1, z ~ N(0, σ²C²) per row). Choquette-Choo et al.
// 2023, "(Amplified) Banded Matrix Factorization: A unified approach to private training"
// (NeurIPS), §4, the amplification of b-banded strategies: when the data are split into b fixed
// partitions and row t Poisson-samples only partition t mod b, each example at rate q (Note
// [cyclic poisson] in privacy/poisson.h), the mechanism over n rows is exactly as private as
// DP-SGD with ⌈n / b⌉ steps at rate q and noise multiplier σ. Columns b or more apart have disjoint supports, so an example's
// participations, at least b rows apart, are independent Gaussian releases of sensitivity at most
// one column norm; amplification by sampling then applies to each as in DP-SGD. (JAX Privacy's
// DpsgdTrainingAccountant charges the same: ⌈steps / cycle_length⌉ Poisson-sampled Gaussians.)
//
// A row is the sampler's step t, which only increases within a run and is never reused across a
// resume (a run continues after the last row its ledger holds). A row that was refused before
// its charge, or charged and never applied, released nothing of its partition: the run is the
// mechanism over rows 0..n−1 with those rows' contributions zero, and n is one more than the last
// row charged. So the equivalent steps are ⌈n / b⌉ for n = last charged row + 1, an upper bound on
// the rows any one partition took part in. At b = 1 this is the ordinary run, but its ledger is
// counted charge by charge (a replayed step is charged again, Note [noise index] in
// src/dp/private_step.h): b = 1 keeps that rule.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace dpzero::accounting {

// ⌈rows / bands⌉: the DP-SGD steps a banded run over rows 0..rows−1 equals. Throws
// std::invalid_argument for rows < 0 or bands < 1.
inline int64_t banded_equivalent_steps(int64_t rows, int64_t bands) {
  if (rows < 0) throw std::invalid_argument("banded rows must be >= 0, got " + std::to_string(rows));
  if (bands < 1)
    throw std::invalid_argument("bands must be >= 1, got " + std::to_string(bands));
  return rows / bands + (rows % bands != 0 ? 1 : 0);
}

// The DP-SGD steps a run has spent: its charges at b = 1 (each counts, a replayed step too:
// Note [noise index] in src/dp/private_step.h), ⌈rows / b⌉ with b > 1 bands (rows: one more than
// the last step charged).
inline int64_t equivalent_steps(int64_t charges, int64_t rows, int64_t bands) {
  return bands == 1 ? charges : banded_equivalent_steps(rows, bands);
}

}  // namespace dpzero::accounting
