// privacy/adaptive_clipping.h — adaptive clipping: a clip bound that follows a quantile of the
// per-sample gradient norms, estimated privately at each step (Andrew, Thakkar, McMahan and
// Ramaswamy, "Differentially Private Learning with Adaptive Clipping", NeurIPS 2021).
//
// Note [adaptive clipping]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// At step t the examples are clipped at C_t, as flat clipping does, and the step also releases
// how many of them the bound left unclipped:
//  * each example i of the batch has a share b_i in [0, 1] of being unclipped, read from its
//    certified gradient norm N̂_i: 1 up to C_t(1 − κ/2), 0 from C_t(1 + κ/2) on, linear between
//    (κ = kUnclippedRamp; a dropped example, whose norm is not finite, has 0);
//  * the step releases  s̃ = Σ_i (b_i − ½) + σ_b z,  z ~ N(0, 1) (Andrew et al., Algorithm 2):
//    centring makes the sum's sensitivity ½ under adding or removing one example, where the
//    plain count's would be 1;
//  * the unclipped fraction is estimated as  f̃ = s̃ / (qN) + ½,  qN the expected batch (the
//    realised batch size is private and is never divided by);
//  * the next bound is geometric (their eq. (3), with learning rate η towards the target
//    quantile γ):  C_{t+1} = clamp(C_t · exp(−η (f̃ − γ)), min_clipbound, max_clipbound).
// C_{t+1} is a function of released values only, so using it is post-processing.
//
// Why a share and not the paper's bit b_i = [N̂_i <= C_t]: the ½ needs each b_i to be a function
// of example i alone, and N̂_i is one only in real arithmetic. In floating point the other
// examples move it by roundings: torch's GEMMs (MKL's, cuBLAS's) compute a row differently as the
// batch's row count changes, and under a mean loss every gradient comes through 1/b. A bit is a
// step, so one example more flips every example whose norm lies within those roundings of C_t
// at once, and C_t is steered to where the norms are dense: identical examples at the bound
// moved the released count by as many examples as there were. A share moves by at most
// |ΔN̂_i| / (κ C_t) when N̂_i moves by ΔN̂_i, so adding or removing one example moves s̃ by at most
// ½ + Σ_j |ΔN̂_j| / (κ C_t), the other examples' roundings scaled by 1/κ: the same kind of
// floating-point slack the clipped sum has (each contribution moves by its rounding), never a
// jump. Shares are summed exactly, as integers in units of 2⁻²⁴ (kShareUnits), each floored
// (a step of at most 2⁻²⁴ per example). A mean loss makes every ΔN̂_i a rounding of 1/b as well,
// which the run's rules refuse: adaptive clipping takes loss_reduction="sum". The estimate
// follows the quantile of the norms smoothed over ±κ/2 of C_t, which differs from the paper's
// where the norms' density changes within that band.
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
// Opacus's AdaClipDPOptimizer takes the same five settings under the same names. Where it
// differs, dpzero's choice is the private one: Opacus noises the uncentred hard count, whose
// sensitivity is 1 while Theorem 1 is applied with ½, and divides by the realised batch size.
#pragma once

#include <cstdint>

#include "privacy/chacha20.h"

namespace dpzero::privacy {

// Note [adaptive clipping]: the width κ of the band around C over which an example's unclipped
// share falls from 1 to 0, as a fraction of C; and the unit the shares are summed in, 2^-24.
constexpr double kUnclippedRamp = 0.05;
constexpr double kShareUnits = 16777216.0;

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
