// kernels/per_sample/common.h — what the per-sample ops of every layer kind share (Note
// [per-sample ops] in kernels/per_sample_ops.h): full-precision float32 matmuls, certified norms,
// the backend kernels and clip factors through the dispatcher, the row sums of biases and
// norm-layer weights, and the clip factors read on the host (Note [host factors]).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/string_view.h>

#include "kernels/certify.h"
#include "kernels/clip_checks.h"
#include "kernels/per_sample_checks.h"
#include "kernels/sample_products_checks.h"

namespace dpzero::kernels {
namespace per_sample {

using ClipResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// ---- full-precision float32 matmuls -------------------------------------------------------------

// Note [fp32 matmul precision]
// The float32 GEMMs of the clipped sums must run in IEEE float32. Under
// torch.backends.cuda.matmul.allow_tf32 = True or set_float32_matmul_precision("high"/"medium"),
// cuBLAS (and cuBLASLt) round both operands to TF32 (10 mantissa bits), so c_i G_i would carry a
// relative error of ~2^-11 and a clipped contribution could exceed its threshold; "medium" also
// lets oneDNN run CPU float32 matmuls in bf16 arithmetic. Every public op therefore holds an
// Fp32MatmulGuard: on entry it switches the CUDA matmul precision from TF32 to IEEE and the
// oneDNN (MKLDNN) one from TF32 / BF16 to IEEE (through at::Context's float32Precision API, and
// the legacy float32MatmulPrecision kept consistent with it, which cuBLASLt checks), and on exit
// it restores what it found; it also holds an at::NoTF32Guard (thread-local, read by the cuBLAS
// handle). These settings are process-wide, so the guard is too: re-entrant and counted, the first
// op to enter saves and switches, the last to leave restores. While an op runs, other threads'
// float32 matmuls also run at full precision (slower, never less accurate), and a change another
// thread makes to the setting meanwhile is overwritten when the last op leaves. A GEMM is set up
// on the host when it is enqueued, so restoring before an asynchronous CUDA GEMM has run is safe.
// Restoring writes back the effective (resolved) precision; a per-backend setting that was unset
// and inherited its value stays unset whenever that gives the same effective value.
class Fp32MatmulGuard {
 public:
  Fp32MatmulGuard() { enter(); }
  ~Fp32MatmulGuard() { leave(); }
  Fp32MatmulGuard(const Fp32MatmulGuard&) = delete;
  Fp32MatmulGuard& operator=(const Fp32MatmulGuard&) = delete;

 private:
  using Backend = at::Float32Backend;
  using Precision = at::Float32Precision;
  using Legacy = at::Float32MatmulPrecision;

  struct State {
    std::mutex mutex;
    int64_t depth = 0;       // ops inside a guard, all threads
    bool changed = false;    // the outermost guard switched something
    bool cuda_changed = false;
    Precision cuda = Precision::NONE, mkldnn = Precision::NONE;  // as found (resolved)
    Legacy legacy = Legacy::HIGHEST;                             // as found, when cuda_changed
  };

  static State& state() {
    static State s;
    return s;
  }

  static Precision matmul(Backend backend) {
    return at::globalContext().float32Precision(backend, at::Float32Op::MATMUL);
  }

  // The legacy float32MatmulPrecision, read while the CUDA matmul precision is TF32. Torch refuses
  // to report a legacy value that contradicts the per-backend settings (the two APIs mixed); the
  // check that fails tells the value: with CUDA at TF32, allowTF32CuBLAS() fails iff the legacy
  // value is "highest"; otherwise the MKLDNN check failed, which it does for BF16 unless the value
  // is "medium" and for TF32 unless it is "high".
  static Legacy read_legacy(Precision mkldnn) {
    at::Context& ctx = at::globalContext();
    try {
      return ctx.float32MatmulPrecision();
    } catch (const c10::Error&) {
    }
    try {
      (void)ctx.allowTF32CuBLAS();
    } catch (const c10::Error&) {
      return Legacy::HIGHEST;
    }
    return mkldnn == Precision::BF16 ? Legacy::HIGH : Legacy::MEDIUM;
  }

  // Sets backend's matmul precision back to `found`: unset (inheriting) if that resolves to it.
  static void restore(Backend backend, Precision found) {
    at::Context& ctx = at::globalContext();
    ctx.setFloat32Precision(backend, at::Float32Op::MATMUL, Precision::NONE);
    if (matmul(backend) != found) ctx.setFloat32Precision(backend, at::Float32Op::MATMUL, found);
  }

  static void enter() {
    State& st = state();
    const std::lock_guard<std::mutex> lock(st.mutex);
    if (st.depth > 0) {
      ++st.depth;
      return;
    }
    switch_to_ieee(st);
    st.depth = 1;  // only once switched: if a setter threw, the next op starts over
  }

  static void switch_to_ieee(State& st) {
    st.cuda = matmul(Backend::CUDA);
    st.mkldnn = matmul(Backend::MKLDNN);
    st.cuda_changed = st.cuda == Precision::TF32;
    const bool mkldnn_changed = st.mkldnn == Precision::TF32 || st.mkldnn == Precision::BF16;
    st.changed = st.cuda_changed || mkldnn_changed;
    if (!st.changed) return;
    at::Context& ctx = at::globalContext();
    if (st.cuda_changed) {
      st.legacy = read_legacy(st.mkldnn);
      if (st.legacy == Legacy::HIGHEST) {  // a mixed setting: IEEE agrees with "highest" again
        ctx.setFloat32Precision(Backend::CUDA, at::Float32Op::MATMUL, Precision::IEEE);
      } else {
        ctx.setFloat32MatmulPrecision("highest");  // legacy, CUDA and MKLDNN matmuls: IEEE
      }
    }
    if (mkldnn_changed) {
      ctx.setFloat32Precision(Backend::MKLDNN, at::Float32Op::MATMUL, Precision::IEEE);
    }
  }

  static void leave() {
    State& st = state();
    const std::lock_guard<std::mutex> lock(st.mutex);
    if (--st.depth > 0 || !st.changed) return;
    if (st.cuda_changed && st.legacy != Legacy::HIGHEST) {
      at::globalContext().setFloat32MatmulPrecision(st.legacy == Legacy::MEDIUM ? "medium"
                                                                                 : "high");
    }
    if (st.cuda_changed) restore(Backend::CUDA, st.cuda);
    restore(Backend::MKLDNN, st.mkldnn);
    st.changed = false;
  }

  at::NoTF32Guard no_tf32_;
};

// ---- certified norms ----------------------------------------------------------------------------

// Note [certified norms]
// Privacy needs every reported ||g_i||^2 to be AT LEAST the exact value: the clip picks c_i with
// c_i * ||g_i||_reported <= C, so an under-report lets sample i's contribution exceed C. The
// reductions behind a norm sum signed terms, and their rounding error scales with the sum of the
// terms' magnitudes, not with the result; in cancelling inputs (rows of one sample pointing the
// same way with alternating signs, or one token repeated with cancelling gradients) the result is
// tiny next to those magnitudes. In float32 the ghost norm came out anywhere from -13x to 18x the
// exact value there, and an input ~1e-25 made a float32 Gram underflow to 0. So every path works
// in float64 on exact float64 copies of the inputs (every float32 / bf16 / fp16 value is a float64
// value; a product of two of them is exact in float64 and can neither under- nor overflow), and
// reports its value plus a rigorous bound on its rounding error, rounded up.
//
// Model (Higham 2002, "Accuracy and Stability of Numerical Algorithms", §2.2, §3.1, §4.2): u =
// 2^-53, gamma_n = n u / (1 - n u). A float64 sum whose addition tree has depth h (h <= n - 1 for
// n terms in any order) is sum_j x_j (1 + theta_j), |theta_j| <= gamma_h; a length-n inner
// product, in any order, with or without FMA, is off by at most gamma_n sum_j |x_j y_j|. We assume
// the BLAS forms each GEMM entry as such an inner product (MKL, OpenBLAS and cuBLAS do; a
// Strassen-like GEMM would not), and IEEE round-to-nearest +, *, sqrt in float64.
//
// S_i = sum_t ||a_t|| ||g_t|| (Linear; the rows of sample i) bounds the exact norm,
// ||G_i^T A_i||_F <= sum_t ||g_t a_t^T||_F = S_i (triangle inequality), and S_i^2 bounds the sums
// of magnitudes below, so a margin proportional to S_i^2 never exceeds S_i^2 times a tiny factor.
//
// Ghost path: the Grams come out as ĜA = A A^T + E_A, |E_A[s,t]| <= gamma_{d_in} ||a_s|| ||a_t||
// (Cauchy-Schwarz on sum_k |a_sk a_tk|), likewise ĜG with gamma_{d_out}. Each product term
// ĜA[s,t] ĜG[s,t] (one more rounding) is within ((1+u)(1+gamma_{d_in})(1+gamma_{d_out}) - 1)
// m_st of the exact (a_s.a_t)(g_s.g_t) and at most (1+u)(1+gamma_{d_in})(1+gamma_{d_out}) m_st in
// magnitude, m_st = ||a_s|| ||a_t|| ||g_s|| ||g_t||; their sum adds gamma_N of the magnitudes, N =
// ghost_summation_depth(T) (Note [ghost summation depth], kernels/per_sample_checks.h). With
// sum_{s,t} m_st = S^2:
//   |ghost - exact| <= c S^2,   c = (1+gamma_N)(1+u)(1+gamma_{d_in})(1+gamma_{d_out}) - 1
//                                 <= sigma (1 + sigma),  sigma = gamma_N + gamma_{d_in}
//                                                               + gamma_{d_out} + u
// (prod (1 + x_j) - 1 <= e^sigma - 1 <= sigma + sigma^2 for sigma <= 1), and we report
//   up(max(ghost, 0) + 2 c S^2)        (the exact value is >= 0, so clamping only helps),
// with S read off the computed Gram diagonals, ||a_t|| ||g_t|| = sqrt(ĜA[t,t] ĜG[t,t]).
// Embedding: the A-Gram is an exact 0/1 indicator (d_in = 0), and the pairs it selects have
// sum_{s,t: id_s = id_t != pad} ||g_s|| ||g_t|| <= (sum_{t: id_t != pad} ||g_t||)^2 = S^2.
//
// Direct paths (Linear per-sample gradients, bias sums, embedding rows, LayerNorm sums over T):
// the gradient W = sum_t w_t is formed in float64 as Ŵ with ||Ŵ - W||_F <= e S, S = sum_t
// ||w_t||_F (e = gamma_T: each entry is a length-T inner product or sum, and the entrywise
// bounds sum_t |w_t| have norm <= S; LayerNorm also rounds the product G ⊙ x̂: gamma_{T+1}). The
// squared norm q sums n - 1 squares, each rounded once, so q >= (1 - gamma_n) ||Ŵ||^2. Then (for
// gamma_n <= 1/2, using ||Ŵ|| <= (1 + e) S)
//   ||W|| <= ||Ŵ|| + e S <= (1 + gamma_n) sqrt(q) + e S <= sqrt(q) + (e + 2 gamma_n) S,
// and we report up(z * z), z = up(up(sqrt(q)) + 2 (e + 2 gamma_n) S).
//
// Rounding of the bound itself: up() steps a positive float64 result one ulp toward +inf, which
// makes it >= the exact result of the single round-to-nearest operation that produced it. The
// factor 2 on each margin absorbs the downward rounding of S (a sum of non-negative terms, off by
// a relative gamma_{d + T + 2} << 1/4) and of the margin's own products. A layer's float64 total
// (weight plus bias, Conv groups) is added with up(), then converted to float32 rounding toward
// +inf (to_f32_up); the fused ops hand clip_factors the norm to_f32_up(up(sqrt(total))). So the
// float32 norm the clip sees is >= the exact one, and c_i * exact norm <= C holds exactly (the
// clip's own guarantee, privacy/clipping.h). An all-zero gradient has S = 0 and stays exactly 0.
//
// Cost: for rows that do not cancel, ||g||^2 >= S^2 / T (Cauchy-Schwarz), so the ghost margin
// inflates the norm by a relative ~2 (N + d_in + d_out) T u (~1e-9 at T = 512, d = 3072), the
// direct one by less. Only inputs that cancel strongly (S^2 >> ||g||^2) see more, and there it
// replaces a wrong norm with a safe one.
// The clipped sums are float32: the layers whose sum is formed from A and G add their rounding to
// the norm (Note [clipped-sum rounding]), which costs more than these margins (a relative
// ~T^1.5 2^-24 for rows that do not cancel), and form each sample's contribution alone. LayerNorm's
// x̂ is computed in float64 and taken as given (its relative error is ~(d + 3) u unless the
// variance is below ~2^-26 of the squared mean).

constexpr double kUnitRoundoff = 1.0 / 9007199254740992.0;  // u = 2^-53

// gamma_n = n u / (1 - n u) (Higham 2002, Lemma 3.1), for n u <= 1e-3.
inline double rounding_gamma(double n) {
  const double nu = n * kUnitRoundoff;
  TORCH_CHECK(nu <= 1e-3, "dpzero: a reduction over ", n,
              " terms is too long for the certified float64 error bound (Note [certified norms])");
  return nu / (1.0 - nu);
}

// c of Note [certified norms] for the ghost path: sigma (1 + sigma).
inline double ghost_error_coefficient(int64_t T, int64_t d_in, int64_t d_out) {
  const double sigma = rounding_gamma(ghost_summation_depth(T)) +
                       rounding_gamma(static_cast<double>(d_in)) +
                       rounding_gamma(static_cast<double>(d_out)) + kUnitRoundoff;
  return sigma * (1.0 + sigma);
}

// The certification steps (up, to_f32_up, the ghost and direct bounds) are dpzero::_certify: the
// IEEE operations of kernels/certify.h, written once for the host and the device, one pass and
// one launch per call on [B] vectors (kernels/cpu/certify.cpp, kernels/cuda/certify.cu).
using certify::Step;

// A bias's kept rows [B, n] float64, their S [B] and the coefficient a kRows certification of them
// takes (coef + margin): what _certify's rest_rows certifies in the weight's own pass.
struct KeptRest {
  at::Tensor rows, s;
  double coef = 0.0;
  bool defined() const { return rows.defined(); }
};

inline at::Tensor certify_op(const at::Tensor& value, const c10::optional<at::Tensor>& s,
                             double coef, Step step, bool f32 = false, double margin = 0.0,
                             const c10::optional<at::Tensor>& rest = c10::nullopt,
                             const KeptRest& rest_rows = {}) {
  using Signature = at::Tensor(const at::Tensor&, const c10::optional<at::Tensor>&, double,
                               int64_t, bool, double, const c10::optional<at::Tensor>&,
                               const c10::optional<at::Tensor>&,
                               const c10::optional<at::Tensor>&, double);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_certify", "")
                             .typed<Signature>();
  const bool rows = rest_rows.defined();
  return op.call(value, s, coef, static_cast<int64_t>(step), f32, margin, rest,
                 rows ? c10::optional<at::Tensor>(rest_rows.rows) : c10::nullopt,
                 rows ? c10::optional<at::Tensor>(rest_rows.s) : c10::nullopt, rest_rows.coef);
}

// Note [clipped-sum rounding]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A clip factor bounds sample i's contribution only if the contribution the clipped sum actually
// adds is bounded, and the clipped sums are float32. Two kinds of rounding enter them:
//  * inside a sample: its contribution c_i G_i^T A_i is a sum over its T rows; formed alone in
//    float32 (c_i g_t rounded once, then a length-T inner product per entry), it is within
//    ((1 + u)(1 + gamma_T) - 1) c_i S_i of the exact one, u = 2^-24, S_i = sum_t ||g_t|| ||a_t||
//    (Higham 2002 §3.1 as in Note [certified norms]). S_i can dwarf ||G_i^T A_i|| (rows that
//    cancel), so the norm the clip sees adds that rounding: the layers whose clipped sum is formed
//    from A and G certify (||W_i|| + kappa_T S_i)^2 with kappa_T = that factor, through
//    _certify's margin m = 2 kappa_T (clipped_sum_margin; the 2 absorbs the rounding of S and of
//    the margin's own arithmetic, as the other margins do). Then ||computed contribution|| <= C.
//    For rows that do not cancel (S_i <= sqrt(T) ||W_i||) the margin costs a relative
//    ~T^1.5 2^-24 (1e-4 at T = 128). Per-sample gradients kept in float64 (a bias's and a norm
//    layer's row sums, Note [kept per-sample gradients]; the generic path's) are scaled by c_i in
//    float64 and rounded to float32 once per entry, which grows the norm by up to 2^-24
//    relative: their certified norms carry m = clipped_sum_margin(1) (S_i bounds the row sum's
//    norm), and rows kept as they are added (the generic path's, a Conv's) the factor 1 + 2^-22
//    on their squared norms (kept_rows_sq_norms). A privacy review measured 1 + 2.5e-8 C
//    without them.
//  * across samples: the contributions must be added as whole, bounded terms. One GEMM over the
//    K = B T rows of all samples would let one sample's rows, which may be huge and cancel only
//    among themselves, absorb the partial sums of the samples before them (a privacy review
//    measured a neighbouring dataset moving the sum by 14 C that way). So with T >= 2 each
//    sample's contribution is formed alone and only then added: on the host up to T = 64, tile
//    by tile in registers from zero (kernels/cpu/sample_products_simd.h; a fused multiply-add per
//    row, the same gamma_T bound), on a device by dpzero::_add_sample_products_ (Note [fused
//    sample products] in kernels/cuda/sample_products.cu: c_i times each left row as it is
//    staged, then the product in registers from zero, the same bound), otherwise by a
//    batched GEMM, one product per sample, summed after; at T = 1 each row is a whole
//    contribution and one GEMM is the same sum. The
//    embedding sums each sample's rows per id first, for the same reason (Note [embedding sums]
//    in kernels/embedding_sums.h).
// What remains is the rounding of the sum of bounded terms (at most gamma_B sum_i ||c_i g_i||,
// each term <= C) and of the float32 accumulation across micro-batches and ranks: a relative
// error of the aggregate, bounded by the clip norms, not by any sample's S.
// 16-bit training adds no term here: bfloat16 and float16 operands (under autocast or with
// 16-bit parameters) are converted to float32 before anything is formed, exactly (every 16-bit
// value is a float32), so the bounds above hold as stated; the forward's own 16-bit rounding only
// changes which A and G the clip sees, and the clip bounds whatever it sees.
// (tests/python/test_clipped_sum_rounding.py drives the worst case in all four precisions.)

// Unit roundoff of float32 (round to nearest).
constexpr double kF32UnitRoundoff = 1.0 / 16777216.0;  // 2^-24

// The bytes of per-sample products a host clipped sum holds at once (Note [clipped-sum rounding]).
constexpr int64_t kHostSlabBytes = int64_t{8} << 20;

// m = 2 kappa_T of Note [clipped-sum rounding] for a float32 clipped sum whose samples have T
// rows each.
inline double clipped_sum_margin(int64_t t) {
  const double n = static_cast<double>(std::max<int64_t>(t, 1));
  const double nu = n * kF32UnitRoundoff;
  TORCH_CHECK(nu <= 0.01, "dpzero: a float32 clipped sum over ", t,
              " rows per sample is too long for its certified rounding bound (Note [clipped-sum "
              "rounding])");
  const double gamma = nu / (1.0 - nu);
  return 2.0 * ((1.0 + kF32UnitRoundoff) * (1.0 + gamma) - 1.0);
}

// x + y (float64, >= 0) rounded up.
inline at::Tensor add_up(const at::Tensor& x, const at::Tensor& y) {
  return certify_op(x, y, 0.0, Step::kAdd);
}

// float64 -> float32, rounded toward +inf (a value above float32's range becomes +inf, a
// non-finite norm: the sample is dropped and counted).
inline at::Tensor to_f32_up(const at::Tensor& x) {
  return certify_op(x, c10::nullopt, 0.0, Step::kRoundUp);
}

// Certified squared norms [B] float32 of per-sample gradients kept as rows, per parameter
// [B, ...] float32 or float64 (undefined: not trained; at least one defined): the generic
// path's, and a Conv's (Note [kept conv gradients] in conv.h). The rows are what the clipped
// sum adds, scaled by c_i (per_sample_clipped_sum), so their own norm is what must be bounded:
// float64 squares of their entries (exact), summed. -> float64 (kept_rows_sq_norms: float32).
inline at::Tensor kept_rows_sq_norms_f64(const std::vector<at::Tensor>& grads) {
  at::Tensor total;
  for (const at::Tensor& t : grads) {
    if (!t.defined()) continue;
    const at::Tensor flat = t.to(at::kDouble).reshape({t.size(0), -1});  // [B, numel]
    // A float64 sum of n non-negative terms is off by at most (n - 1) 2^-53 relative.
    const at::Tensor s = (flat * flat).sum(1) * (1.0 + static_cast<double>(flat.size(1)) * 2.3e-16);
    total = total.defined() ? total + s : s;
  }
  TORCH_CHECK(total.defined(), "dpzero::kept_rows_sq_norms: no trained parameter's per-sample "
              "gradients were given");
  // The clipped sum rounds c_i g_i to float32 once per entry, which grows its norm by up to
  // 2^-24 relative (Note [clipped-sum rounding]): squared, at most 1 + 2^-23 + 2^-48 < 1 + 2^-22,
  // which with 1e-15 for this arithmetic bounds it.
  return total * ((1.0 + 0x1p-22) * (1.0 + 1e-15));
}

inline at::Tensor kept_rows_sq_norms(const std::vector<at::Tensor>& grads) {
  return to_f32_up(kept_rows_sq_norms_f64(grads));
}

// The coefficient of S in the direct bound of Note [certified norms]: 2 (e + 2 gamma_n).
inline double direct_coefficient(double e, int64_t n) {
  return 2.0 * (e + 2.0 * rounding_gamma(static_cast<double>(n)));
}

// Certified bound from q = the computed sum of n - 1 squares of a float64 gradient within e * S of
// the exact one (q, s: [c] float64).
inline at::Tensor certify_direct(const at::Tensor& q, const at::Tensor& s, double e, int64_t n) {
  return certify_op(q, s, direct_coefficient(e, n), Step::kDirect);
}

// ---- backend kernels and clip factors, through the dispatcher -----------------------------------

// Note [ghost norm]
// ||G_i^T A_i||_F^2 = sum_{s,t} (a_s . a_t)(g_s . g_t) = <A_i A_i^T, G_i G_i^T> (Goodfellow 2015;
// Li et al. 2022, ghost clipping for sequences): two T x T Grams, no d_out x d_in gradient.
// For an embedding the input rows are one-hot, so a_s . a_t = [id_s = id_t], and a padding token's
// row gets no gradient, so its terms drop out: sum_{s,t} [id_s = id_t != padding_idx] g_s . g_t.
// Backends: kernels/cpu/ghost_norm.cpp (batched float64 GEMM Grams, a chunk of samples at a time)
// and kernels/cuda/ghost_norm.cu (one fused kernel over Gram tiles in shared memory, float64
// accumulation, no [B, T, T]; float64 GEMM strips for long sequences, Note [ghost roofline]
// there); at T = 1 both take the rank-one path (Note [rank-one ghost] in
// kernels/per_sample_checks.h). All return the raw float64 value together with S of Note
// [certified norms], read off the Gram diagonals (||a_t||^2 = (A A^T)[t, t]) at no extra pass
// over A and G; the layer ops add the margin.

// [B, T, d_in], [B, T, d_out] -> ([B] <A_i A_i^T, G_i G_i^T>, [B] sum_t ||a_t|| ||g_t||), float64.
inline std::tuple<at::Tensor, at::Tensor> ghost_sq_norms(const at::Tensor& a, const at::Tensor& g) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpzero::_ghost_sq_norms", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&)>();
  return op.call(a, g);
}

// ids [B, T] int64, G [B, T, d] -> ([B] sum_{s,t} [id_s = id_t != pad] g_s . g_t,
// [B] sum_{t: id_t != pad} ||g_t||), float64.
inline std::tuple<at::Tensor, at::Tensor> token_ghost_sq_norms(const at::Tensor& ids,
                                                               const at::Tensor& g, int64_t pad) {
  using Signature =
      std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_token_ghost_sq_norms", "")
                             .typed<Signature>();
  return op.call(ids, g, pad);
}

// Certified squared norms [B] float64 -> (factors [B] float32, non-finite count) by
// privacy::clip_factor, on the float32 norms to_f32_up(up(sqrt(sq))) (Note [certified norms]).
inline std::tuple<at::Tensor, at::Tensor> clip_from_sq_norms(const at::Tensor& sq, double max_norm,
                                                             c10::string_view mode, double gamma) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::clip_factors", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, double,
                                                                       c10::string_view, double)>();
  return op.call(certify_op(sq, c10::nullopt, 0.0, Step::kNorm), max_norm, mode, gamma);
}

// The fused ops check the clip arguments first, naming themselves, even when B = 0.
inline void check_clip_op_args(const char* op, double max_norm, c10::string_view mode,
                               double gamma) {
  check_clip_args(op, at::empty({0}, at::kFloat), max_norm, mode, gamma);
}

// ---- helpers ------------------------------------------------------------------------------------

inline at::Tensor f32(const at::Tensor& x) { return as_dtype(x, at::kFloat); }
inline at::Tensor f64(const at::Tensor& x) { return as_dtype(x, at::kDouble); }

// Euclidean norms of the rows of x [c, T, d] float64: [c, T] float64 (one fused reduction).
inline at::Tensor row_norms(const at::Tensor& x) {
  return at::linalg_vector_norm(x, 2, at::IntArrayRef{-1});
}

// x [c, ...] (float32 or float64) times c_i per sample (`multiply`) or as it is, with the rows of
// dropped samples (factor 0 or non-finite) set to 0, not multiplied by 0, which would keep a
// NaN: a new tensor of x's dtype, in one pass (dpzero::_scale_rows: kernels/cpu/scale_rows.cpp,
// kernels/cuda/scale_rows.cu). scale [c] float32.
inline at::Tensor scale_rows(const at::Tensor& x, const at::Tensor& scale, bool multiply) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpzero::_scale_rows", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, bool)>();
  return op.call(x, scale, multiply);
}

// out [rows, cols] float32 += sum_i scale_i left_i^T right_i (left [c, T, rows], right [c, T,
// cols], float32 / bfloat16 / float16; scale [c] float32), each sample's product formed alone and
// a dropped sample skipped (dpzero::_add_sample_products_: kernels/cpu/sample_products.cpp,
// kernels/cuda/sample_products.cu, Note [fused sample products] there).
inline void add_scaled_sample_products(at::Tensor& out, const at::Tensor& left,
                                       const at::Tensor& right, const at::Tensor& scale) {
  using Signature =
      at::Tensor&(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_add_sample_products_", "")
                             .typed<Signature>();
  op.call(out, left, right, scale, 0);
}

// out (a slice of a result) = x summed over `dim`.
inline void sum_into(at::Tensor out, const at::Tensor& x, int64_t dim) { at::sum_out(out, x, dim); }

// ---- row sums (the direct path of biases and norm-layer weights) --------------------------------

// Note [row sums]
// The direct path of a bias and of a norm layer's weight sums T rows per sample in float64 and
// needs S = sum_t ||row_t|| for Note [certified norms]: dpzero::_row_sums (rows G_t) and
// dpzero::_norm_row_sums (rows G_t ⊙ x̂_t, x̂ formed in float64 from the raw input). Each is one
// pass over [B, T, d]. The generic implementations below (ATen, any device; registered as
// CompositeExplicitAutograd in per_sample.cpp) work chunk by chunk on float64 copies; the CPU
// kernels (kernels/cpu/row_sums.cpp) and the CUDA kernels (kernels/cuda/row_sums.cu, all samples
// in one launch) read the inputs once, accumulating in float64 registers, with no float64
// copies. All add each row to its sample's sum in row order (depth T - 1 per entry, as the e =
// gamma_T of Note [certified norms] assumes).

// G [B, T, d] -> (sums [B, d] float64 = sum_t G_t, S [B] float64 = sum_t ||G_t||).
inline std::tuple<at::Tensor, at::Tensor> row_sums_generic(const at::Tensor& g) {
  check_floating("_row_sums", "G", g);
  TORCH_CHECK(g.dim() == 3, "dpzero::_row_sums: G must be [B, T, d], got shape ", g.sizes());
  const int64_t b = g.size(0), t = g.size(1), d = g.size(2);
  at::Tensor sums = at::empty({b, d}, g.options().dtype(at::kDouble));
  at::Tensor s = at::empty({b}, g.options().dtype(at::kDouble));
  const int64_t chunk = samples_per_pass_chunk(b, 8 * (2 * t * d + 2 * d + t), host_path(g));
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor g64 = f64(g.slice(0, i0, i1));
    sum_into(sums.slice(0, i0, i1), g64, 1);
    sum_into(s.slice(0, i0, i1), row_norms(g64), 1);
  }
  return {sums, s};
}

// x̂ in float64. LayerNorm's variance is the two-pass one, mean((x - mean)^2): as accurate as
// at::var_mean's Welford update and, on the CPU, ~5x faster (0.34 against 1.86 ms for [16, 128,
// 256] float64 on 2 cores).
inline at::Tensor normalized(const at::Tensor& x64, double eps, bool rms) {
  if (rms) return x64 * at::rsqrt(x64.square().mean(at::IntArrayRef{-1}, /*keepdim=*/true) + eps);
  const at::Tensor centered = x64 - x64.mean(at::IntArrayRef{-1}, /*keepdim=*/true);
  const at::Tensor var = centered.square().mean(at::IntArrayRef{-1}, /*keepdim=*/true);
  return centered * at::rsqrt(var + eps);
}

// x, G [B, T, d] -> (sums [B, d] float64 = sum_t G_t ⊙ x̂_t, S [B] float64 = sum_t ||G_t ⊙ x̂_t||).
inline std::tuple<at::Tensor, at::Tensor> norm_row_sums_generic(const at::Tensor& x,
                                                                const at::Tensor& g, double eps,
                                                                bool rms) {
  check_floating("_norm_row_sums", "x", x);
  check_floating("_norm_row_sums", "G", g);
  TORCH_CHECK(x.dim() == 3 && x.sizes() == g.sizes(),
              "dpzero::_norm_row_sums: x and G must both be [B, T, d], got ", x.sizes(), " and ",
              g.sizes());
  const int64_t b = x.size(0), t = x.size(1), d = x.size(2);
  at::Tensor sums = at::empty({b, d}, x.options().dtype(at::kDouble));
  at::Tensor s = at::empty({b}, x.options().dtype(at::kDouble));
  const int64_t chunk = samples_per_pass_chunk(b, 48 * t * d + 16 * (t + d), host_path(x));
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor terms = f64(g.slice(0, i0, i1)) * normalized(f64(x.slice(0, i0, i1)), eps, rms);
    sum_into(sums.slice(0, i0, i1), terms, 1);
    sum_into(s.slice(0, i0, i1), row_norms(terms), 1);
  }
  return {sums, s};
}

inline std::tuple<at::Tensor, at::Tensor> row_sums(const at::Tensor& g) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpzero::_row_sums", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&)>();
  return op.call(g);
}

inline std::tuple<at::Tensor, at::Tensor> norm_row_sums(const at::Tensor& x, const at::Tensor& g,
                                                        double eps, bool rms) {
  using Signature =
      std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double, bool);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_norm_row_sums", "")
                             .typed<Signature>();
  return op.call(x, g, eps, rms);
}

// Note [host factors]
// On the host the [c] float32 factors of a clipped sum are read once, as numbers: a sample is
// kept iff its factor is finite and non-zero. The narrower operand is multiplied by the factors in
// the one pass of dpzero::_scale_rows, which writes a dropped sample's rows as zeros (never
// multiplied by 0, which would keep a NaN); the other operand is copied with zeroed rows only
// when some sample is dropped, and used as it is otherwise. On a device nothing is decided on the
// host: a Linear or Conv clipped sum over T >= 2 rows goes to dpzero::_add_sample_products_,
// which reads each factor in the kernel and skips a dropped sample whole (Note [fused sample
// products]); otherwise (T = 1, a bias) the operands take _scale_rows both (a masked copy of the
// wider one: whether any sample is dropped is not known on the host without a wait).

// The [c] float32 factors (check_scale) as host values.
inline std::vector<float> host_factors(const at::Tensor& scale) {
  const at::Tensor s = scale.contiguous();
  const float* p = s.data_ptr<float>();
  return std::vector<float>(p, p + s.numel());
}


// x [c, ...] on the host with row i multiplied by scale[i] (`multiply`), and the rows of samples
// whose factor is not kept set to zero; without `multiply`, x itself when every sample is kept
// (its dropped rows zeroed in place when `owned`). Note [host factors].
inline at::Tensor host_rows(const at::Tensor& x, const at::Tensor& scale,
                            const std::vector<float>& factors, bool multiply, bool owned) {
  if (multiply) return scale_rows(x, scale, /*multiply=*/true);
  if (std::all_of(factors.begin(), factors.end(), sample_products::adds)) return x;
  if (!owned) return scale_rows(x, scale, /*multiply=*/false);
  at::Tensor out = x;
  for (size_t i = 0; i < factors.size(); ++i) {
    if (!sample_products::adds(factors[i])) out.select(0, static_cast<int64_t>(i)).zero_();
  }
  return out;
}

// Whether a clipped sum reads its factors on the host: scale, a and g all there (Note [host
// factors]).
inline bool host_factors_apply(const at::Tensor& scale, const at::Tensor& a, const at::Tensor& g) {
  return host_path(scale) && host_path(a) && host_path(g);
}

}  // namespace per_sample
}  // namespace dpzero::kernels
