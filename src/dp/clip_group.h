// src/dp/clip_group.h — one clipping group's per-sample norms and clip factors: the book's
// completion of a group (design.md §2 step 3), from the certified squared norms its parts
// reported in the backward; the book (book.h) calls it when a group completes.
//
// Terms (book.h): a *part* is one call of a DP layer in the micro-batch; a
// *component* is a set of parts that share a parameter (a tied embedding and output head, a
// layer called twice); a *group* is a set of components clipped together with one threshold.
//
// Note [certified group norms]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every part's squared norms arrive certified: [B] float32, never below the exact squared norm of
// that part's per-sample gradient (Note [certified norms] in kernels/per_sample/common.h). The
// group norm must stay certified, so that a clip factor never lets a contribution exceed its
// threshold:
//  * a component of one part has squared norm sq (exact in float64);
//  * a component of several parts has norm at most the sum of the parts' norms (the triangle
//    inequality on the shared parameter's gradient, which is the sum of the parts'): n = Σ √sq_p,
//    computed in float64 (each √ correctly rounded, each add within one ulp) and multiplied by
//    1 + 1e-12, which covers the relative rounding of up to 4000 parts;
//  * components hold disjoint parameters, so the group's squared norm is the sum of theirs
//    (float64, relative error below m·2⁻⁵³ for m components);
//  * the norm √total, multiplied by 1 + 1e-12 (covering the sum's rounding for up to 9000
//    components and the square root's own), is rounded up to float32.
// NaN and ±Inf pass through unchanged (a non-finite norm drops the sample: privacy/clipping.h).
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

namespace dpzero::dp {

// One group's clip factors, in one pass (dpzero::_group_clip): `components` holds, per
// component, the [B] float32 certified squared norms of its parts as delivered (at least one part
// each, all of B rows, one device); each is scaled by Note [mean loss]'s mean² (mean = 1: as
// given), the group's certified norms formed (Note [certified group norms]), the factors taken
// against max_norm (privacy/clipping.h) and scaled for the delivered gradients (Note [mean loss]).
// -> (factors [B] float32, certified group norms [B] float32). A factor is 0 exactly where the
// norm is not finite (the sample is dropped).
std::tuple<at::Tensor, at::Tensor> group_clip(
    const std::vector<std::vector<at::Tensor>>& components, int64_t mean, double max_norm,
    const std::string& mode, double gamma);

// Certified per-sample norms of one group, mean 1: group_clip's norms.
at::Tensor group_norms(const std::vector<std::vector<at::Tensor>>& components);

// Note [mean loss] (book.h): under loss_reduction="mean" over a micro-batch of b rows, autograd
// delivers G / b. The book clips the per-sample gradients b·g_i without copying G:
//  * their squared norms are the delivered ones times b², rounded up to float32;
//  * the factor applied to the delivered g_i is c_i·b rounded toward zero, so that
//    round_down(c_i b)·‖g_i‖ ≤ c_i‖b g_i‖ ≤ C.
// b = 1 returns the input unchanged.
at::Tensor mean_scaled_sq(const at::Tensor& sq, int64_t b);       // [B] float32 -> [B] float32
at::Tensor mean_scaled_factors(const at::Tensor& factors, int64_t b);  // [B] f32 -> [B] f32

// [B] float32 never below the exact sum of 1 to 8 certified squared norms ([B] float32 each: the
// parts of one layer call, a weight's and its bias's): summed in float64, whose relative error
// (at most 7·2⁻⁵³) the factor 1 + 1e-15 covers, rounded up to float32.
at::Tensor certified_sum(const std::vector<at::Tensor>& sqs);

// float64 -> float32 rounded toward +inf; toward 0 (x >= 0). NaN and ±Inf unchanged.
at::Tensor round_up_f32(const at::Tensor& x);
at::Tensor round_down_f32(const at::Tensor& x);

}  // namespace dpzero::dp
