// kernels/certify.h — the directed-rounding arithmetic of certified norms, written once for the
// host and the device: what dpzero::_certify and dpzero::_group_clip compute per sample
// (schemas in kernels/ops.cpp; kernels/cpu/certify.cpp and kernels/cuda/certify.cu run these
// same functions over a [B] vector, one pass, one launch). The bounds are Note [certified norms]
// (kernels/per_sample/common.h) and Note [certified group norms] (src/dp/clip_group.h); the clip
// factor is privacy/clipping.h's.
//
// Every step is a sequence of IEEE float64 operations each rounded to nearest once: both
// implementation files are compiled without multiply-add contraction (-ffp-contract=off,
// nvcc -fmad=false), so a CPU and a CUDA run give the same bits, except for kRows, whose sum of
// squares the CUDA kernel reduces in another order (the bound covers any order). NaN passes
// through every step unchanged (a non-finite norm drops its sample: privacy/clipping.h).
#pragma once

#include <cmath>
#include <cstdint>

#include "privacy/clipping.h"
#include "privacy/host_device.h"

namespace dpzero::kernels::certify {

// What one _certify call computes from the per-sample value v (float64, or float32 widened
// exactly), the per-sample S of Note [certified norms] (float64), the call's coefficient and its
// margin m (Note [clipped-sum rounding] in kernels/per_sample/common.h: the certifying steps then
// bound (||W|| + m S / 2)^2, not ||W||^2; m = 0: no margin).
enum class Step : int64_t {
  kGhost = 0,      // b = up(max(v, 0) + S² coef), coef = 2c (the ghost margin);
                   // with m > 0: kDirect of b with coef m                            -> float64
  kDirect = 1,     // z = up(up(√v) + S (coef + m)), up(z²); coef = 2 (e + 2 γ_n)    -> float64
  kRows = 2,       // kDirect of q = Σ_j v[i, j]² (v [B, n], kept per-sample gradients) -> float64
  kAdd = 3,        // up(v + S): two certified bounds added (a weight's and its bias's) -> float64
  kNorm = 4,       // f32_up(up(√v)): the float32 norm a fused clip hands clip_factors -> float32
  kRoundUp = 5,    // f32_up(v)                                                    -> float32
  kRoundDown = 6,  // f32_down(v), v >= 0                                          -> float32
  kScaleUp = 7,    // f32_up(v coef (1 + 1e-15)): Note [mean loss]'s squared norms  -> float32
  kScaleDown = 8,  // f32_down(v coef): Note [mean loss]'s factors                 -> float32
  kSumUp = 9,      // f32_up(Σ_p v[p, i] (1 + 1e-15)), v [P, B]: certified_sum      -> float32
};
constexpr int64_t kSteps = 10;

// Steps whose result is float64 (a `f32` call rounds it up to float32 as kRoundUp would).
DPZERO_HOST_DEVICE bool gives_f64(Step step) {
  return step == Step::kGhost || step == Step::kDirect || step == Step::kRows ||
         step == Step::kAdd;
}

// x stepped one ulp toward +inf if positive: >= the exact result of the one rounding that made
// x. 0, negatives, NaN and +inf unchanged.
DPZERO_HOST_DEVICE double up_one(double x) { return x > 0 ? nextafter(x, INFINITY) : x; }

// float64 -> float32 rounded toward +inf (above float32's range: +inf; NaN unchanged).
DPZERO_HOST_DEVICE float f32_up(double x) {
  const float f = static_cast<float>(x);
  return static_cast<double>(f) < x ? nextafterf(f, INFINITY) : f;
}

// float64 -> float32 rounded toward 0, for x >= 0 (NaN unchanged).
DPZERO_HOST_DEVICE float f32_down(double x) {
  const float f = static_cast<float>(x);
  return static_cast<double>(f) > x ? nextafterf(f, 0.0f) : f;
}

// Note [certified norms], ghost path: the bound from the raw Gram value and S.
DPZERO_HOST_DEVICE double ghost_bound(double value, double s, double coef) {
  return up_one((value < 0.0 ? 0.0 : value) + s * s * coef);  // (NaN < 0 is false: kept)
}

// Note [certified norms], direct paths: the bound from q, the computed sum of squares, and S.
DPZERO_HOST_DEVICE double direct_bound(double q, double s, double coef) {
  const double z = up_one(up_one(sqrt(q)) + s * coef);
  return up_one(z * z);
}

// kSumUp's last rounding: a sum of certified float32 parts, formed in float64 from 0 in their
// order, padded by 1 + 1e-15 (which covers up to 8 additions' relative error) and rounded up.
DPZERO_HOST_DEVICE float sum_up(double total) { return f32_up(total * (1.0 + 1e-15)); }

// A call given `rest` (dpzero::_certify): its float32 result r and the same sample's certified
// squared norm of other parameters, added as kSumUp adds the two parts [r, rest].
DPZERO_HOST_DEVICE float plus_rest(float r, float rest) {
  double total = 0.0;
  total += static_cast<double>(r);
  total += static_cast<double>(rest);
  return sum_up(total);
}

// kRows with f32 of one sample's kept row x [n] (float64) and its S: q summed in row order from 0,
// then direct_bound with coef (the call's coef + margin) and rounded up to float32. A call given
// `rest_rows` adds this for the rest's row through plus_rest: for a rest formed on the host, the
// bits of a kRows call of its own (kernels/cpu/certify.cpp's loop) then plus_rest.
DPZERO_HOST_DEVICE float rows_bound(const double* x, int64_t n, double s, double coef) {
  double q = 0.0;
  for (int64_t j = 0; j < n; ++j) q += x[j] * x[j];
  return f32_up(direct_bound(q, s, coef));
}

// A call's rest per sample (dpzero::_certify's rest, or rest_rows with rest_s and rest_coef): a
// certified float32 value, or a kept row certified by rows_bound; none when neither is given.
struct Rest {
  const float* value = nullptr;
  const double* rows = nullptr;  // [B, n]
  const double* s = nullptr;     // [B]
  int64_t n = 0;
  double coef = 0.0;
  bool has_rows = false;  // rows given (null when n = 0: each row's bound is then S's alone)

  DPZERO_HOST_DEVICE bool any() const { return value != nullptr || has_rows; }
  DPZERO_HOST_DEVICE float at(int64_t i) const {
    return value != nullptr ? value[i] : rows_bound(rows + i * n, n, s[i], coef);
  }
};

// The steps that take one value per sample (all but kRows and kSumUp, which reduce first).
DPZERO_HOST_DEVICE double elementwise(Step step, double v, double s, double coef, double margin) {
  switch (step) {
    case Step::kGhost: {
      const double b = ghost_bound(v, s, coef);
      return margin > 0.0 ? direct_bound(b, s, margin) : b;
    }
    case Step::kDirect: return direct_bound(v, s, coef + margin);
    case Step::kAdd: return up_one(v + s);
    case Step::kNorm: return f32_up(up_one(sqrt(v)));
    case Step::kRoundUp: return f32_up(v);
    case Step::kRoundDown: return f32_down(v);
    case Step::kScaleUp: return f32_up(v * coef * (1.0 + 1e-15));
    case Step::kScaleDown: return f32_down(v * coef);
    default: return NAN;  // kRows, kSumUp: not elementwise (the callers never pass them)
  }
}

// ---- a clipping group, per sample (dpzero::_group_clip) -----------------------------------------

// The relative padding of Note [certified group norms].
constexpr double kGroupPad = 1.0 + 1e-12;

// Sample i's certified group norm (float32) from its parts' certified squared norms sq[p * b + i]
// (float32, as delivered), the parts grouped by component in order (sizes[c] parts each, c <
// components), each first scaled by Note [mean loss]'s mean² (kScaleUp; mean = 1: as given):
//  * a component of one part: its squared norm;
//  * of several parts: (Σ_p √sq_p · kGroupPad)², the triangle bound on the shared parameter;
//  * the group: f32_up(√(Σ_components) · kGroupPad).
DPZERO_HOST_DEVICE float group_norm(const float* sq, const int64_t* sizes, int64_t components,
                                    int64_t b, int64_t i, int64_t mean) {
  const double mean_sq = static_cast<double>(mean) * static_cast<double>(mean);  // exact
  double total = 0.0;
  int64_t p = 0;
  for (int64_t c = 0; c < components; ++c) {
    double part_sq = 0.0;
    if (sizes[c] == 1) {
      part_sq = mean == 1 ? static_cast<double>(sq[p * b + i])
                          : static_cast<double>(f32_up(sq[p * b + i] * mean_sq * (1.0 + 1e-15)));
      ++p;
    } else {
      double n = 0.0;
      for (int64_t k = 0; k < sizes[c]; ++k, ++p) {
        const double one =
            mean == 1 ? static_cast<double>(sq[p * b + i])
                      : static_cast<double>(f32_up(sq[p * b + i] * mean_sq * (1.0 + 1e-15)));
        n += sqrt(one);
      }
      n *= kGroupPad;
      part_sq = n * n;
    }
    total += part_sq;
  }
  return f32_up(sqrt(total) * kGroupPad);
}

// Sample i's factor for the delivered gradient: clip_factor of its group norm against the
// float32 threshold, then Note [mean loss]'s scaling f32_down(c · mean) (mean = 1: as is).
DPZERO_HOST_DEVICE float group_factor(float norm, float threshold, privacy::ClipMode mode,
                                      float gamma, int64_t mean) {
  const float c = privacy::clip_factor(norm, threshold, mode, gamma);
  return mean == 1 ? c : f32_down(static_cast<double>(c) * static_cast<double>(mean));
}

}  // namespace dpzero::kernels::certify
