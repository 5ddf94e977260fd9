// privacy/adaptive_clipping.h — adaptive clipping: a clip bound that follows a quantile of the
// per-sample gradient norms, estimated privately at each step (Andrew, Thakkar, McMahan and
// Ramaswamy, "Differentially Private Learning with Adaptive Clipping", NeurIPS 2021).
//
// Note [adaptive clipping]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// At step t the examples are clipped at C_t, as flat clipping does, and the step also releases
// how many of them the bound left unclipped:
//  * each example i of the batch gives the bit b_i = 1 when its certified gradient norm is at
//    most C_t (it was not scaled down), else 0 (a dropped example, whose norm is not finite,
//    gives 0);
//  * the step releases  s̃ = Σ_i (b_i − ½) + σ_b z,  z ~ N(0, 1) (Andrew et al., Algorithm 2):
//    centring the bits makes the sum's sensitivity ½ under adding or removing one example,
//    where the plain count's would be 1;
//  * the unclipped fraction is estimated as  f̃ = s̃ / (qN) + ½,  qN the expected batch (the
//    realised batch size is private and is never divided by);
//  * the next bound is geometric (their eq. (3), with learning rate η towards the target
//    quantile γ):  C_{t+1} = clamp(C_t · exp(−η (f̃ − γ)), min_clipbound, max_clipbound).
// C_{t+1} is a function of released values only, so using it is post-processing.
//
// Privacy (Andrew et al., Theorem 1): the step releases two Gaussian sums of the same sampled
// batch, the clipped gradient sum (sensitivity C_t, noise σ_Δ C_t) and s̃ (sensitivity ½, noise
// σ_b). Normalised by their noise, the pair is one Gaussian mechanism of sensitivity
// √(σ_Δ⁻² + (2σ_b)⁻²), so the step costs what DP-SGD's step with noise multiplier z costs when
//     z⁻² = σ_Δ⁻² + (2σ_b)⁻²,   i.e.   σ_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2),
// which needs 2σ_b > z. The run's noise_multiplier is z: the accountant, the budget and the
// ledger all read z, and the gradient's noise is drawn with σ_Δ > z. The count's noise is a
// draw of its own stream (privacy/streams.h) at the step's charge index, the same on every rank.
//
// Floating point: b_i is read from the certified norm the clipping itself uses, so the ½ holds
// only if that norm is a function of example i alone, bit for bit: a rounding that moves with
// the other examples moves every example whose norm lies within it of C_t across the bound at
// once (a bit is a step, where the clipped sum only moves by the rounding), and C_t is steered
// to where the norms are dense. Two premises make it so:
//  * the loss is a sum. Under a mean loss autograd delivers each gradient through the rounding
//    of 1/b, b the micro-batch's size (Note [mean loss] in src/dp/book.h), so adding one example
//    to identical ones at the bound flips them all. The run's rules refuse adaptive clipping
//    with loss_reduction="mean";
//  * the kernels compute each row's norm, and the backward each row's gradient, the same way
//    whatever the other rows are. test_adaptive_clipping.py's
//    test_identical_examples_at_the_bound_move_the_count_by_half drives identical examples at
//    the bound through every path, and test_a_rows_norm_is_the_same_in_every_batch compares a
//    row's certified norms across batch sizes; on a device whose libraries pick a GEMM by the
//    batch's size, the GPU kit's pytest stage runs both.
// An example whose norm lies in (C_t − 10⁻⁶, C_t] counts as unclipped although flat's factor
// C_t/(N̂ + 10⁻⁶) scales it by less than 10⁻⁶/C_t: the bit is of the norm, not of the factor.
//
// Opacus's AdaClipDPOptimizer takes the same five settings under the same names. Two things
// differ, both on the side of privacy: it adds σ_b noise to the uncentred count, whose
// sensitivity is 1 while Theorem 1 is applied with ½, and it divides by the realised batch size.
#pragma once

#include <cstdint>

#include "privacy/chacha20.h"

namespace dpzero::privacy {

struct AdaptiveClipping {
  double target_unclipped_quantile = 0.5;  // γ in [0, 1]: the fraction of examples left unclipped
  double clipbound_learning_rate = 0.2;    // η > 0, finite
  double min_clipbound = 0.0;              // > 0, at most the initial max_grad_norm
  double max_clipbound = 0.0;              // finite, at least the initial max_grad_norm
  double unclipped_num_std = 0.0;          // σ_b >= 0, finite; > z/2 when the run has noise z > 0
};

// Throws std::invalid_argument naming the first bad setting and its value, given the run's
// noise multiplier z and its initial bound C.
void check_adaptive_clipping(const AdaptiveClipping& a, double noise_multiplier,
                             double max_grad_norm);

// Throws std::invalid_argument naming `clip` unless it lies in [min_clipbound, max_clipbound]
// (a bound restored from a checkpoint).
void check_clipbound(const AdaptiveClipping& a, double clip);

// Note [adaptive clipping]'s σ_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) for z > 0; 0 for z = 0.
double gradient_noise_multiplier(const AdaptiveClipping& a, double noise_multiplier);

// Note [adaptive clipping]'s C_{t+1} from C_t = `clip`, the released centred count s̃
// (`noisy_centred_count`) and the expected batch qN.
double next_clipbound(const AdaptiveClipping& a, double clip, double noisy_centred_count,
                      double expected_batch);

// Note [adaptive clipping]'s z for the count of the step at charge index `step` (Note [noise
// index] in src/dp/private_step.h): coordinate 0 of kClipCountStream (streams.h), drawn as the
// gradient noise is, from the run's Philox seed or from secure mode's key (Note [secure noise]).
double count_noise_draw(uint64_t seed, uint32_t step);
double count_noise_draw(const ChaCha20Key& key, uint32_t step);

}  // namespace dpzero::privacy
