// kernels/per_sample_ops.h — the per-sample gradient ops of every layer kind (schemas in
// kernels/ops.cpp): squared norms, clipped sums and the fused clip, written once as ATen
// compositions that run on any device. The only backend-specific piece, the ghost-norm Gram
// reduction, is reached through the dispatcher (dpzero::_ghost_sq_norms and
// dpzero::_token_ghost_sq_norms: kernels/cpu/ghost_norm.cpp, kernels/cuda/ghost_norm.cu), so
// kernels/per_sample.cpp registers these functions once, for every backend.
//
// Note [per-sample ops]
// A DP layer sees its input A and output gradient G for a micro-batch of B samples; any leading
// dims after the batch dim are flattened into a sequence length T, so A is [B, T, d_in] and G is
// [B, T, d_out]. Sample i's weight gradient is G_i^T A_i ([d_out, d_in]).
//  * *_sq_norms return ||g_i||^2 per sample ([B] float32) as a CERTIFIED UPPER BOUND: never below
//    the exact squared norm of the exact per-sample gradient of the inputs as given, nor below the
//    squared norm of what the layer's clipped sum adds for the sample (per unit factor), and
//    above them only by rounding margins (Note [certified norms], Note [clipped-sum rounding]). The ghost or direct path is chosen by
//    Note [ghost or direct] (kernels/per_sample_checks.h); loops run a chunk of samples at a time
//    (at most a chunk of per-sample gradients or Grams exists at once, none outlives the op).
//  * *_clipped_sum return sum_i c_i g_i (float32, the parameter's shape) for per-sample factors
//    c [B] float32: for a Linear layer G^T diag(c) A, the GEMMs that replace autograd's
//    weight-gradient GEMM (book-keeping, "BK", Bu et al. 2023, "Differentially private
//    optimization on large model at small cost": keep (A, G) from the one backward pass, then
//    weighted GEMMs; one per sample, batched, as Note [clipped-sum rounding] needs). A sample whose factor is 0 or non-finite contributes exactly
//    nothing, even when its A or G holds NaN/Inf (its rows are zeroed, not multiplied by 0).
//  * *_clip (group / layer-wise clipping) compute the norms, the factors for threshold C
//    (privacy::clip_factor through dpzero::clip_factors: flat min(1, C/(||g||+1e-6)) or automatic
//    C/(||g||+gamma), factor 0 for a NaN/Inf norm, counted) and the clipped sum in one call.
// Precision: inputs float32 / bfloat16 / float16, outputs float32. Norms are computed in float64
// from exact float64 copies of the inputs and rounded up (Note [certified norms]). Clipped sums
// are full-IEEE float32 GEMMs and sums (never TF32 or oneDNN bf16: Note [fp32 matmul precision]),
// on float32 operands: low-precision inputs are upcast exactly, chunk by chunk. We do not run the
// clipped-sum GEMM on bf16/fp16 operands: that would round c_i * G_i to the input precision and
// could leave a clipped contribution up to 2^-8 (bf16) above its threshold, breaking the
// sensitivity bound. Bias clipped sums and the fused direct Linear path sum in float64.
// B = 0 (an empty micro-batch) gives empty norms and a zero clipped sum.
// Caller contracts (the ops cannot check them; the engine must):
//  * Batch first: dim 0 of every input is the sample dim. A layer fed [T, B, d] (a
//    batch_first=False attention or RNN input) must be transposed by the caller; otherwise the
//    "samples" are time steps and the clipping protects nothing.
//  * LayerNorm / RMSNorm normalise over the last `normalized_ndim` dims of the input
//    (= len(normalized_shape) of the module; default 1) and use the eps the caller passes.
//    torch.nn.RMSNorm(eps=None) means torch.finfo(input.dtype).eps: the caller passes that value.
//  * Embedding: the ops compute the gradient of a plain lookup. nn.Embedding(scale_grad_by_freq=
//    True) divides each row's gradient by the id's frequency in the whole micro-batch, so a
//    sample's gradient depends on the other samples; the engine must reject such modules.
//  * Conv: zero padding given as ints; other padding modes and 'same'/'valid' strings: pad the
//    input first and pass 0.
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

inline at::Tensor certify_op(const at::Tensor& value, const c10::optional<at::Tensor>& s,
                             double coef, Step step, bool f32 = false, double margin = 0.0) {
  using Signature = at::Tensor(const at::Tensor&, const c10::optional<at::Tensor>&, double,
                               int64_t, bool, double);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_certify", "")
                             .typed<Signature>();
  return op.call(value, s, coef, static_cast<int64_t>(step), f32, margin);
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
//    ~T^1.5 2^-24 (1e-4 at T = 128).
//  * across samples: the contributions must be added as whole, bounded terms. One GEMM over the
//    K = B T rows of all samples would let one sample's rows, which may be huge and cancel only
//    among themselves, absorb the partial sums of the samples before them (a privacy review
//    measured a neighbouring dataset moving the sum by 14 C that way). So with T >= 2 each
//    sample's contribution is formed alone (a batched GEMM, one product per sample) and the
//    contributions are then summed; at T = 1 each row is a whole contribution and one GEMM is the
//    same sum. The embedding sums each sample's rows per id first, for the same reason.
// What remains is the rounding of the sum of bounded terms (at most gamma_B sum_i ||c_i g_i||,
// each term <= C) and of the float32 accumulation across micro-batches and ranks: a relative
// error of the aggregate, bounded by the clip norms, not by any sample's S.

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

// ---- Linear (and HF Conv1D): A [B, T, d_in], G [B, T, d_out] ------------------------------------

// Certified ||G_i^T A_i||_F^2 by the ghost kernel: [B] float64 (float32, rounded up, when `f32`).
inline at::Tensor ghost_linear_sq_norms(const at::Tensor& a, const at::Tensor& g,
                                        bool f32 = false) {
  const auto [value, s] = ghost_sq_norms(a, g);
  return certify_op(value, s, 2.0 * ghost_error_coefficient(a.size(1), a.size(2), g.size(2)),
                    Step::kGhost, f32, clipped_sum_margin(a.size(1)));
}

// Certified ||G_i^T A_i||_F^2 by instantiating G_i^T A_i in float64 for a chunk of samples at a
// time: [B] float64.
inline at::Tensor direct_sq_norms(const at::Tensor& a, const at::Tensor& g) {
  const int64_t b = a.size(0), t = a.size(1), d_in = a.size(2), d_out = g.size(2);
  at::Tensor out = at::empty({b}, a.options().dtype(at::kDouble));
  const double e = rounding_gamma(static_cast<double>(t));
  // Per sample: its float64 gradient, float64 copies of its rows and their squares.
  const int64_t chunk = samples_per_chunk(b, 8 * (d_in * d_out + 2 * t * (d_in + d_out + 1)));
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk), c = i1 - i0;
    const at::Tensor a64 = f64(a.slice(0, i0, i1)), g64 = f64(g.slice(0, i0, i1));
    at::Tensor per_sample = at::bmm(g64.transpose(1, 2), a64);  // [c, d_out, d_in], ours
    const at::Tensor q = per_sample.reshape({c, -1}).square_().sum(1);
    const at::Tensor s = (row_norms(a64) * row_norms(g64)).sum(1);
    out.slice(0, i0, i1).copy_(certify_op(q, s, direct_coefficient(e, d_in * d_out + 1),
                                          Step::kDirect, /*f32=*/false, clipped_sum_margin(t)));
  }
  return out;
}

// Note [kept per-sample gradients]
// A bias's or a LayerNorm / RMSNorm weight's per-sample gradient is one d-vector per sample, far
// smaller than the [T, d] rows it is summed from. So besides the norm-only and clipped-sum-only
// ops there are *_per_sample ops that return the per-sample gradients themselves ([B, d] float64,
// formed in float64 exactly as the norm ops form them) together with their certified squared
// norms, and per_sample_clipped_sum, which adds c_i times those very rows. Under book-keeping the
// engine keeps these rows from the backward instead of the layer's input and output gradient:
// one float64 pass over [B, T, d] instead of two (one for the norms, one for the clipped sum).

// Bias per-sample gradients sum_t G_{i,t} and their certified squared norms: ([B, d] float64,
// [B] float64, or float32 rounded up when `f32`). G [B, T, d].
inline std::tuple<at::Tensor, at::Tensor> bias_per_sample_btd(const at::Tensor& g,
                                                              bool f32 = false) {
  auto [grads, s] = row_sums(g);
  const double e = rounding_gamma(static_cast<double>(g.size(1)));
  return {grads, certify_op(grads, s, direct_coefficient(e, g.size(2) + 1), Step::kRows, f32)};
}

// Certified ||sum_t G_{i,t}||^2 (a sample's bias gradient is the sum of its output-gradient rows):
// [B] float64. G [B, T, d].
inline at::Tensor bias_sq_norms_btd(const at::Tensor& g) { return std::get<1>(bias_per_sample_btd(g)); }

// Certified [B] float64 (weight, plus bias when `bias`; float32 rounded up when `f32`).
inline at::Tensor linear_sq_norms_btd(const at::Tensor& a, const at::Tensor& g, NormMethod method,
                                      bool bias, bool f32 = false) {
  const bool ghost = use_ghost(method, a.size(1), a.size(2), g.size(2));
  if (!bias && ghost) return ghost_linear_sq_norms(a, g, f32);
  const at::Tensor sq = ghost ? ghost_linear_sq_norms(a, g) : direct_sq_norms(a, g);
  if (!bias) return f32 ? to_f32_up(sq) : sq;
  return certify_op(sq, bias_sq_norms_btd(g), 0.0, Step::kAdd, f32);
}

// Note [host factors]
// On the host the [c] float32 factors of a clipped sum are read once, as numbers: a sample is
// kept iff its factor is finite and non-zero. The narrower operand is multiplied by the factors in
// the one pass of dpzero::_scale_rows, which writes a dropped sample's rows as zeros (never
// multiplied by 0, which would keep a NaN); the other operand is copied with zeroed rows only
// when some sample is dropped, and used as it is otherwise. On a device the operands take
// _scale_rows both (a masked copy of the wider one: whether any sample is dropped is not known on
// the host without a wait), and nothing is decided on the host.

// The [c] float32 factors (check_scale) as host values.
inline std::vector<float> host_factors(const at::Tensor& scale) {
  const at::Tensor s = scale.contiguous();
  const float* p = s.data_ptr<float>();
  return std::vector<float>(p, p + s.numel());
}

inline bool host_kept(float factor) { return std::isfinite(factor) && factor != 0.0f; }

// x [c, ...] on the host with row i multiplied by scale[i] (`multiply`), and the rows of samples
// whose factor is not kept set to zero; without `multiply`, x itself when every sample is kept
// (its dropped rows zeroed in place when `owned`). Note [host factors].
inline at::Tensor host_rows(const at::Tensor& x, const at::Tensor& scale,
                            const std::vector<float>& factors, bool multiply, bool owned) {
  if (multiply) return scale_rows(x, scale, /*multiply=*/true);
  if (std::all_of(factors.begin(), factors.end(), host_kept)) return x;
  if (!owned) return scale_rows(x, scale, /*multiply=*/false);
  at::Tensor out = x;
  for (size_t i = 0; i < factors.size(); ++i) {
    if (!host_kept(factors[i])) out.select(0, static_cast<int64_t>(i)).zero_();
  }
  return out;
}

// Samples [i0, i1) of x (dim 0): x itself when that is all of it (no slice op).
inline at::Tensor sample_range(const at::Tensor& x, int64_t i0, int64_t i1) {
  return i0 == 0 && i1 == x.size(0) ? x : x.slice(0, i0, i1);
}

// out += sum_i c_i G_i^T A_i ([d_out, d_in]) or its transpose ([d_in, d_out]) when `transposed`.
// One float32 GEMM per chunk over K = chunk * T; the narrower operand carries the factors.
// `host`: scale, a and g are on the host (Note [host factors]; host_factors_apply).
inline void add_linear_clipped_sum(at::Tensor& out, const at::Tensor& a, const at::Tensor& g,
                                   const at::Tensor& scale, bool host, bool transposed) {
  const int64_t b = a.size(0), t = a.size(1), d_in = a.size(2), d_out = g.size(2);
  if (b == 0 || t == 0) return;
  // Per sample: float32 copies of its rows and, with T >= 2 on a device, its own contribution
  // (Note [clipped-sum rounding]; the host holds kHostSlabBytes of them for the whole chunk).
  const int64_t chunk = samples_per_chunk(
      b, 8 * t * (d_in + d_out) + (t >= 2 && !host ? 4 * d_in * d_out : 0), /*device=*/!host);
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor c = sample_range(scale, i0, i1);
    at::Tensor ac = f32(sample_range(a, i0, i1)), gc = f32(sample_range(g, i0, i1));
    const bool a_owned = a.scalar_type() != at::kFloat, g_owned = g.scalar_type() != at::kFloat;
    if (host) {
      const std::vector<float> factors = host_factors(c);
      const bool scale_g = d_out <= d_in;
      gc = host_rows(gc, c, factors, /*multiply=*/scale_g, g_owned);
      ac = host_rows(ac, c, factors, /*multiply=*/!scale_g, a_owned);
    } else {  // one pass over each operand: the narrower scaled, the other masked
      const bool scale_g = d_out <= d_in;
      gc = scale_rows(gc, c, /*multiply=*/scale_g);
      ac = scale_rows(ac, c, /*multiply=*/!scale_g);
    }
    if (t >= 2) {  // each sample's contribution alone, then their sum (Note [clipped-sum rounding])
      const at::Tensor left = transposed ? ac : gc, right = transposed ? gc : ac;  // [c, T, .]
      const int64_t rows = left.size(2), cols = right.size(2);
      // On the host, in slabs of output rows whose per-sample products stay within
      // kHostSlabBytes: a product of the whole weight per sample, written to memory and read back
      // to be summed, cost twice the one GEMM's time on 768 x 3072 (experiments/results/
      // private.md); on a device, one batched GEMM (one launch).
      const int64_t slab =
          host ? std::max<int64_t>(1, kHostSlabBytes / (4 * left.size(0) * std::max<int64_t>(cols, 1)))
               : rows;
      for (int64_t r0 = 0; r0 < rows; r0 += slab) {
        const int64_t n = std::min(slab, rows - r0);
        const at::Tensor l = n == rows ? left : left.narrow(2, r0, n);
        at::Tensor dest = n == rows ? out : out.narrow(0, r0, n);
        dest.add_(at::bmm(l.transpose(1, 2), right).sum(0));  // [c, n, cols] -> [n, cols]
      }
      continue;
    }
    const at::Tensor a2 = ac.reshape({-1, d_in}), g2 = gc.reshape({-1, d_out});
    if (transposed) {
      out.addmm_(a2.t(), g2);
    } else {
      out.addmm_(g2.t(), a2);
    }
  }
}

// Whether a clipped sum reads its factors on the host: scale, a and g all there (Note [host
// factors]).
inline bool host_factors_apply(const at::Tensor& scale, const at::Tensor& a, const at::Tensor& g) {
  return host_path(scale) && host_path(a) && host_path(g);
}

// sum_i c_i sum_t G_{i,t}: [d] float32, summed in float64. G [B, T, d].
inline at::Tensor bias_clipped_sum_btd(const at::Tensor& g, const at::Tensor& scale) {
  const at::Tensor sums = std::get<0>(row_sums(g));  // [B, d] float64
  return f32(scale_rows(sums, scale, /*multiply=*/true).sum(0));
}

// Public: A [B, ..., d_in], G [B, ..., d_out] -> [B] float32.
inline at::Tensor linear_sq_norms(const at::Tensor& A, const at::Tensor& G, bool bias,
                                  int64_t method) {
  constexpr const char* op = "linear_sq_norms";
  const NormMethod m = check_method(op, method);
  check_layer_pair(op, A, "A", G);
  const Fp32MatmulGuard precision;
  return linear_sq_norms_btd(as_btd(op, "A", A), as_btd(op, "G", G), m, bias, /*f32=*/true);
}

// Note [shared inputs]
// Layers that read the same input tensor (a transformer's query, key and value projections; a
// gated MLP's gate and up projections) share the A-side Gram of the ghost norm. linear_sq_norms_multi
// takes A once and each layer's G and returns each layer's certified norm, equal to what
// linear_sq_norms would return for that layer alone (same kernel arithmetic, same margin); on the
// ghost path A's float64 copy and Gram strips are made once for all of them
// (dpzero::_ghost_sq_norms_multi: kernels/cpu/ghost_norm.cpp, and a generic loop for the devices
// whose kernel does not stage the A Gram).

// _ghost_sq_norms of A against each G, one layer at a time (any device).
inline std::tuple<at::Tensor, at::Tensor> ghost_sq_norms_multi_generic(const at::Tensor& a,
                                                                       at::TensorList gs) {
  TORCH_CHECK(!gs.empty(), "dpzero::_ghost_sq_norms_multi: G must hold at least one tensor");
  std::vector<at::Tensor> values, norms;
  for (const at::Tensor& g : gs) {
    auto [v, n] = ghost_sq_norms(a, g);
    values.push_back(v);
    norms.push_back(n);
  }
  return {at::stack(values), at::stack(norms)};
}

// Public: A [B, ..., d_in], G[l] [B, ..., d_out_l] -> [L, B] float32 certified squared norms.
inline at::Tensor linear_sq_norms_multi(const at::Tensor& A, at::TensorList G, int64_t method) {
  constexpr const char* op = "linear_sq_norms_multi";
  const NormMethod m = check_method(op, method);
  TORCH_CHECK(!G.empty(), "dpzero::", op, ": G must hold at least one tensor");
  for (const at::Tensor& g : G) check_layer_pair(op, A, "A", g);
  const Fp32MatmulGuard precision;
  const at::Tensor a = as_btd(op, "A", A);
  std::vector<at::Tensor> gs, out(G.size());
  std::vector<size_t> ghost_rows;
  for (size_t l = 0; l < G.size(); ++l) {
    const at::Tensor g = as_btd(op, "G", G[l]);
    if (use_ghost(m, a.size(1), a.size(2), g.size(2))) {
      gs.push_back(g);
      ghost_rows.push_back(l);
    } else {
      out[l] = to_f32_up(direct_sq_norms(a, g));
    }
  }
  if (!gs.empty()) {
    using Signature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::TensorList);
    static const auto multi = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("dpzero::_ghost_sq_norms_multi", "")
                                  .typed<Signature>();
    const auto [values, s] = multi.call(a, gs);
    for (size_t k = 0; k < gs.size(); ++k) {
      const double c = ghost_error_coefficient(a.size(1), a.size(2), gs[k].size(2));
      out[ghost_rows[k]] = certify_op(values[static_cast<int64_t>(k)], s[static_cast<int64_t>(k)],
                                      2.0 * c, Step::kGhost, /*f32=*/true,
                                      clipped_sum_margin(a.size(1)));
    }
  }
  return at::stack(out);
}

// Note [accumulating clipped sums]
// Each *_clipped_sum op returns a new tensor; the in-place add_*_clipped_sum_ ops add the same sum
// into `self` instead, typically the parameter's slot of the engine's flat gradient buffer (Note
// [private accumulator] in src/zero/param_group.h). The arithmetic is the returned op's with self
// in place of the zeros it starts from (the GEMMs run with beta = 1, index_add adds into self), so
// the result equals self + (returned sum) up to float32 rounding order, never more: the same
// clipped contributions, each added once. What it saves is a parameter-sized zero fill, the new
// tensor and the pass that adds it into the buffer (measured: experiments/results/private.md).

// sum_i scale_i G_i^T A_i added into *self, or into new zeros when self is null; returns the
// accumulator. `op` names the public op in the argument checks.
inline at::Tensor linear_clipped_sum_into(const char* op, at::Tensor* self, const at::Tensor& A,
                                          const at::Tensor& G, const at::Tensor& scale,
                                          bool transposed) {
  check_layer_pair(op, A, "A", G);
  const at::Tensor a = as_btd(op, "A", A), g = as_btd(op, "G", G);
  check_scale(op, scale, a.size(0), G);
  const int64_t d_in = a.size(2), d_out = g.size(2);
  const std::vector<int64_t> shape =
      transposed ? std::vector<int64_t>{d_in, d_out} : std::vector<int64_t>{d_out, d_in};
  at::Tensor out;
  if (self == nullptr) {
    out = at::zeros(shape, a.options().dtype(at::kFloat));
  } else {
    check_accumulator(op, *self, shape, A, "A");
    out = *self;
  }
  const Fp32MatmulGuard precision;
  add_linear_clipped_sum(out, a, g, scale, host_factors_apply(scale, a, g), transposed);
  return out;
}

// Public in-place: self [d_out, d_in] float32 (nn.Linear's weight layout), or [d_in, d_out] when
// `transposed` (HF Conv1D: y = x W + b, W [d_in, d_out]), += sum_i scale_i G_i^T A_i. A [B, ...,
// d_in], G [B, ..., d_out], scale [B].
inline at::Tensor& add_linear_clipped_sum_(at::Tensor& self, const at::Tensor& A,
                                           const at::Tensor& G, const at::Tensor& scale,
                                           bool transposed) {
  linear_clipped_sum_into("add_linear_clipped_sum_", &self, A, G, scale, transposed);
  return self;
}

// Public: A [B, ..., d_in], G [B, ..., d_out], scale [B] -> [d_out, d_in] float32 (nn.Linear's
// weight layout) or [d_in, d_out] when `transposed` (HF Conv1D: y = x W + b, W [d_in, d_out]).
inline at::Tensor linear_clipped_sum(const at::Tensor& A, const at::Tensor& G,
                                     const at::Tensor& scale, bool transposed) {
  return linear_clipped_sum_into("linear_clipped_sum", nullptr, A, G, scale, transposed);
}

// Public: G [B, d] or [B, ..., d] (the bias dim last) -> [B] float32.
inline at::Tensor bias_sq_norms(const at::Tensor& G) {
  constexpr const char* op = "bias_sq_norms";
  check_floating(op, "G", G);
  const Fp32MatmulGuard precision;
  return std::get<1>(bias_per_sample_btd(as_btd(op, "G", G), /*f32=*/true));
}

// Public: G [B, ..., d], scale [B] -> [d] float32.
inline at::Tensor bias_clipped_sum(const at::Tensor& G, const at::Tensor& scale) {
  constexpr const char* op = "bias_clipped_sum";
  check_floating(op, "G", G);
  const at::Tensor g = as_btd(op, "G", G);
  check_scale(op, scale, g.size(0), G);
  const Fp32MatmulGuard precision;
  return bias_clipped_sum_btd(g, scale);
}

// Public: G [B, ..., d] -> (per-sample bias gradients [B, d] float64, certified squared norms [B]
// float32) (Note [kept per-sample gradients]).
inline std::tuple<at::Tensor, at::Tensor> bias_per_sample(const at::Tensor& G) {
  constexpr const char* op = "bias_per_sample";
  check_floating(op, "G", G);
  const Fp32MatmulGuard precision;
  return bias_per_sample_btd(as_btd(op, "G", G), /*f32=*/true);
}

// Public: per-sample gradients [B, ...] (float64 or float32), scale [B] float32 -> sum_i c_i
// grads_i ([...] float32, summed in float64). A sample whose factor is 0 or non-finite contributes
// exactly nothing, even when its row holds NaN/Inf (Note [kept per-sample gradients]).
// Whether per_sample_clipped_sum takes its host pass: float64 rows and float32 factors on the CPU.
inline bool host_clipped_sum_applies(const at::Tensor& grads, const at::Tensor& scale) {
  return host_path(grads) && grads.scalar_type() == at::kDouble &&
         scale.scalar_type() == at::kFloat;
}

// The host pass: acc [d] = sum_i scale_i grads_i in float64, samples in order, the rows of
// dropped samples never read. grads [B, ...] float64, scale [B] float32, d = prod(grads.shape[1:])
// (from the shape, not numel / B: B = 0 still sums to [d] zeros).
inline std::vector<double> host_clipped_sum(const at::Tensor& grads, const at::Tensor& scale,
                                            int64_t d) {
  const at::Tensor g = grads.contiguous(), c = scale.contiguous();
  const int64_t b = g.size(0);
  std::vector<double> acc(static_cast<size_t>(d), 0.0);
  const double* pg = g.data_ptr<double>();
  const float* pc = c.data_ptr<float>();
  for (int64_t i = 0; i < b; ++i) {
    if (!host_kept(pc[i])) continue;
    const double ci = pc[i];
    for (int64_t j = 0; j < d; ++j) acc[static_cast<size_t>(j)] += ci * pg[i * d + j];
  }
  return acc;
}

inline void check_per_sample_clipped_sum_args(const char* op, const at::Tensor& grads,
                                              const at::Tensor& scale) {
  TORCH_CHECK(grads.dim() >= 1, "dpzero::", op, ": grads must be [B, ...], got a 0-d tensor");
  TORCH_CHECK(grads.scalar_type() == at::kDouble || grads.scalar_type() == at::kFloat, "dpzero::",
              op, ": grads must be float64 or float32, got ", grads.scalar_type());
  check_scale(op, scale, grads.size(0), grads);
}

inline at::Tensor per_sample_clipped_sum(const at::Tensor& grads, const at::Tensor& scale) {
  constexpr const char* op = "per_sample_clipped_sum";
  check_per_sample_clipped_sum_args(op, grads, scale);
  if (host_clipped_sum_applies(grads, scale)) {
    const std::vector<int64_t> shape = grads.sizes().slice(1).vec();
    const int64_t d = c10::multiply_integers(shape);
    const std::vector<double> acc = host_clipped_sum(grads, scale, d);
    at::Tensor out = at::empty(shape, grads.options().dtype(at::kFloat));
    float* po = out.data_ptr<float>();
    for (int64_t j = 0; j < d; ++j) po[j] = static_cast<float>(acc[static_cast<size_t>(j)]);
    return out;
  }
  const at::Tensor rows = scale_rows(f64(grads), scale, /*multiply=*/true);
  return f32(rows.sum(0));
}

// dest += per_sample_clipped_sum(grads, scale), dest float32 holding prod(grads.shape[1:])
// elements (a parameter's slot). On the host pass, a contiguous dest gets each float32 sum added
// by the same float32 addition as ATen's add_, with no result tensor in between (Note
// [accumulating clipped sums]).
inline void add_per_sample_clipped_sum_(at::Tensor& dest, const at::Tensor& grads,
                                        const at::Tensor& scale) {
  constexpr const char* op = "add_per_sample_clipped_sum_";
  check_per_sample_clipped_sum_args(op, grads, scale);
  const int64_t d = c10::multiply_integers(grads.sizes().slice(1));
  TORCH_CHECK(dest.scalar_type() == at::kFloat && dest.numel() == d, "dpzero::", op,
              ": the destination must be float32 with ", d, " elements, got ", dest.scalar_type(),
              " ", dest.sizes());
  if (host_clipped_sum_applies(grads, scale) && dest.is_cpu() && dest.is_contiguous()) {
    const std::vector<double> acc = host_clipped_sum(grads, scale, d);
    float* pd = dest.data_ptr<float>();
    for (int64_t j = 0; j < d; ++j) pd[j] = pd[j] + static_cast<float>(acc[static_cast<size_t>(j)]);
    return;
  }
  const at::Tensor sum = per_sample_clipped_sum(grads, scale);
  dest.add_(sum.sizes() == dest.sizes() ? sum : sum.view(dest.sizes()));
}

inline at::Tensor no_bias_grad(const at::Tensor& like) {
  return at::zeros({0}, like.options().dtype(at::kFloat));
}

// The fused clip on the direct path: per chunk of samples, G_i^T A_i is instantiated once in
// float64 and serves both the certified norm and the clipped sum (layer-wise clipping needs no
// other layer's norm), so the chunk costs one batched GEMM plus one pass over its per-sample
// gradients instead of a second GEMM; the per-sample gradients die with the chunk. The clipped
// sum adds c_i times the very gradient whose norm was certified, in float64.
// a [B, T, d_in], g [B, T, d_out].
inline ClipResult linear_clip_direct(const at::Tensor& a, const at::Tensor& g, double max_norm,
                                     c10::string_view mode, double gamma, bool bias,
                                     bool transposed) {
  const int64_t b = a.size(0), t = a.size(1), d_in = a.size(2), d_out = g.size(2);
  const int64_t n = d_out * d_in;
  const auto f64_opts = a.options().dtype(at::kDouble);
  at::Tensor grad_w = at::zeros({1, n}, f64_opts);
  at::Tensor sq = at::empty({b}, f64_opts);
  at::Tensor factors = at::zeros({b}, a.options().dtype(at::kFloat));
  at::Tensor nonfinite = at::zeros({}, a.options().dtype(at::kLong));
  const double e = rounding_gamma(static_cast<double>(t));
  // Per sample: its float64 gradient, float64 copies of its rows and their squares.
  const int64_t chunk = samples_per_chunk(b, 8 * (n + 2 * t * (d_in + d_out + 1)));
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk), c = i1 - i0;
    const at::Tensor gc = g.slice(0, i0, i1);
    const at::Tensor a64 = f64(a.slice(0, i0, i1)), g64 = f64(gc);
    at::Tensor per_sample = at::bmm(g64.transpose(1, 2), a64).reshape({c, n});  // [c, n]
    // sum of squares as a batched dot: no temporary of the gradient's size.
    const at::Tensor q = at::bmm(per_sample.unsqueeze(1), per_sample.unsqueeze(2)).reshape({c});
    at::Tensor sq_c = certify_direct(q, (row_norms(a64) * row_norms(g64)).sum(1), e, n + 1);
    if (bias) sq_c = add_up(sq_c, bias_sq_norms_btd(gc));
    auto [f_c, n_c] = clip_from_sq_norms(sq_c, max_norm, mode, gamma);
    // Factor 0 comes only with a non-finite norm; zero those samples' rows (0 * NaN = NaN). On
    // CPU only when there is one (the count is at hand); on CUDA always (asking would sync).
    if (!host_path(per_sample) || n_c.item<int64_t>() > 0) {
      per_sample = scale_rows(per_sample, f_c, /*multiply=*/false);
    }
    grad_w.addmm_(f64(f_c).unsqueeze(0), per_sample);
    sq.slice(0, i0, i1).copy_(sq_c);
    factors.slice(0, i0, i1).copy_(f_c);
    nonfinite.add_(n_c);
  }
  const at::Tensor w = f32(grad_w).view({d_out, d_in});
  at::Tensor grad_b = bias ? bias_clipped_sum_btd(g, factors) : no_bias_grad(g);
  return {transposed ? w.t().contiguous() : w, grad_b, to_f32_up(sq), factors, nonfinite};
}

// Public fused op: (grad_weight, grad_bias or [0], sq_norms [B], factors [B], non-finite count).
inline ClipResult linear_clip(const at::Tensor& A, const at::Tensor& G, double max_norm,
                              c10::string_view mode, double gamma, bool bias, bool transposed,
                              int64_t method) {
  constexpr const char* op = "linear_clip";
  const NormMethod m = check_method(op, method);
  check_layer_pair(op, A, "A", G);
  check_clip_op_args(op, max_norm, mode, gamma);
  const Fp32MatmulGuard precision;
  const at::Tensor a = as_btd(op, "A", A), g = as_btd(op, "G", G);
  if (!use_ghost(m, a.size(1), a.size(2), g.size(2))) {
    return linear_clip_direct(a, g, max_norm, mode, gamma, bias, transposed);
  }
  const at::Tensor sq = linear_sq_norms_btd(a, g, m, bias);
  auto [factors, nonfinite] = clip_from_sq_norms(sq, max_norm, mode, gamma);
  at::Tensor grad_w = linear_clipped_sum(A, G, factors, transposed);
  at::Tensor grad_b = bias ? bias_clipped_sum_btd(g, factors) : no_bias_grad(G);
  return {grad_w, grad_b, to_f32_up(sq), factors, nonfinite};
}

// ---- Embedding: ids [B, ...], G [B, ..., d], weight [V, d] --------------------------------------

// Note [embedding rows]
// The direct path of an embedding: the rows sample i touches, r_v = sum_{t: id_t = v} G_{i,t} for
// each distinct v != pad, summed in float64; ||g_i||^2 = sum_v ||r_v||^2 and S_i = sum_{t: id_t !=
// pad} ||G_{i,t}|| (Note [certified norms]: each entry of r_v is a sum of at most T terms, e =
// gamma_T, and q sums at most T d squares). dpzero::_embedding_rows returns (q, S), raw float64.
// Its generic version (any device; registered in per_sample.cpp) builds the rows of a chunk of
// samples by one index_add over the runs of sorted (sample, token) keys, with no host read (the
// private backward never waits on the device: tests/python/test_sync_free.py); the CPU kernel
// (kernels/cpu/row_sums.cpp), and on CUDA kernels/cuda/row_sums.cu for T <= 2048, sort each
// sample's tokens by id and stream each run of equal ids through one [d] float64 accumulator
// (per column, on CUDA), so they hold no [c, U, d] rows and do T d work per sample: less than the
// ghost path's 2 T^2 d in both time and memory, and the CPU takes this path whatever the shape
// (Note [ghost or direct]: embedding_uses_ghost). A padding token's row is skipped, never read into a
// sum, so a NaN there reaches nothing.

// ids [B, T] int64, G [B, T, d] -> (q [B], S [B]) float64 (Note [embedding rows]); pad >= 0, or
// -1 for none.
inline std::tuple<at::Tensor, at::Tensor> embedding_rows_generic(const at::Tensor& ids,
                                                                 const at::Tensor& g,
                                                                 int64_t num_embeddings,
                                                                 int64_t pad) {
  check_embedding_rows_args(ids, g, num_embeddings, pad);
  const int64_t b = g.size(0), t = g.size(1), d = g.size(2);
  at::Tensor q = at::empty({b}, g.options().dtype(at::kDouble));
  at::Tensor s = at::empty({b}, g.options().dtype(at::kDouble));
  const int64_t chunk = samples_per_pass_chunk(b, 8 * (4 * t * d + 2 * t) + 48 * t, host_path(g));
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk), c = i1 - i0;
    const at::Tensor id = ids.slice(0, i0, i1);                            // [c, T]
    const at::Tensor real = id != pad;                                     // [c, T]
    const at::Tensor sample = at::arange(c, id.options()).unsqueeze(1);    // [c, 1]
    const at::Tensor keys = (sample * num_embeddings + id).reshape({-1});  // [c*T]
    // A select, not a multiply: a padding token's G row may hold NaN.
    const at::Tensor g64 = at::where(real.unsqueeze(-1), f64(g.slice(0, i0, i1)), 0);
    // Runs of equal keys in sorted order are the rows r_v; their number is never asked for (a
    // unique() would wait on the device for it): there are at most c*T, and the unused ones stay
    // zero. The segment of each sorted token: the count of run starts up to it, minus one.
    const auto [sorted, order] = keys.sort();
    const at::Tensor starts = at::ones_like(sorted, sorted.options().dtype(at::kLong));
    starts.slice(0, 1).copy_(sorted.slice(0, 1) != sorted.slice(0, 0, -1));
    const at::Tensor segment = starts.cumsum(0) - 1;  // [c*T]
    const at::Tensor rows = at::zeros({c * t, d}, g64.options())
                                .index_add_(0, segment, g64.reshape({-1, d}).index_select(0, order));
    // Every token of a run has the run's sample: its owner, written once per token.
    const at::Tensor owner = at::zeros({c * t}, segment.options())
                                 .scatter_(0, segment, sorted.div(num_embeddings, "trunc"));
    q.slice(0, i0, i1).copy_(
        at::zeros({c}, g64.options()).index_add_(0, owner, rows.square().sum(1)));
    s.slice(0, i0, i1).copy_(row_norms(g64).sum(1));
  }
  return {q, s};
}

inline std::tuple<at::Tensor, at::Tensor> embedding_rows(const at::Tensor& ids,
                                                         const at::Tensor& g,
                                                         int64_t num_embeddings, int64_t pad) {
  using Signature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                       int64_t, int64_t);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_embedding_rows", "")
                             .typed<Signature>();
  return op.call(ids, g, num_embeddings, pad);
}

// Certified direct path (Note [embedding rows]). ids [B, T] int64, G [B, T, d] -> [B] float64.
inline at::Tensor embedding_direct_sq_norms(const at::Tensor& ids, const at::Tensor& g,
                                            int64_t num_embeddings, int64_t pad) {
  const auto [q, s] = embedding_rows(ids, g, num_embeddings, pad);
  return certify_op(q, s,
                    direct_coefficient(rounding_gamma(static_cast<double>(g.size(1))),
                                       g.size(1) * g.size(2) + 1),
                    Step::kDirect, /*f32=*/false, clipped_sum_margin(g.size(1)));
}

// ids [B, ...] -> [B, T] int64; checks the id range on CPU (on CUDA that would cost a device sync
// in the backward pass; the forward's embedding lookup has already checked the same ids).
inline at::Tensor flat_ids(const char* op, const at::Tensor& ids, int64_t num_embeddings) {
  int64_t t = 1;
  for (int64_t k = 1; k < ids.dim(); ++k) t *= ids.size(k);
  at::Tensor flat = ids.reshape({ids.size(0), t}).to(at::kLong);
  if (host_path(ids) && flat.numel() > 0) {
    const int64_t lo = flat.min().item<int64_t>(), hi = flat.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < num_embeddings, "dpzero::", op,
                ": ids must be in [0, num_embeddings) = [0, ", num_embeddings, "), got ",
                lo < 0 ? lo : hi);
  }
  return flat;
}

inline at::Tensor embedding_grad_btd(const at::Tensor& G, const at::Tensor& ids_flat) {
  return G.reshape({ids_flat.size(0), ids_flat.size(1), G.size(-1)});
}

// Certified [B] float64 (the checks done).
inline at::Tensor embedding_sq_norms_f64(const char* op, const at::Tensor& ids, const at::Tensor& G,
                                         int64_t num_embeddings,
                                         std::optional<int64_t> padding_idx, NormMethod method) {
  check_embedding_args(op, ids, G, num_embeddings);
  const int64_t pad = normalize_padding_idx(op, padding_idx, num_embeddings);
  const at::Tensor id = flat_ids(op, ids, num_embeddings);
  const at::Tensor g = embedding_grad_btd(G, id);
  const int64_t t = g.size(1), d = g.size(2);
  if (embedding_uses_ghost(method, t, num_embeddings, d, host_path(g))) {
    const auto [value, s] = token_ghost_sq_norms(id, g, pad);
    return certify_op(value, s, 2.0 * ghost_error_coefficient(t, 0, d), Step::kGhost,
                      /*f32=*/false, clipped_sum_margin(t));
  }
  return embedding_direct_sq_norms(id, g, num_embeddings, pad);
}

// Public: ids [B, ...], G [B, ..., d] -> [B] float32. padding_idx as in torch.nn.Embedding:
// padding tokens get no gradient.
inline at::Tensor embedding_sq_norms(const at::Tensor& ids, const at::Tensor& G,
                                     int64_t num_embeddings, std::optional<int64_t> padding_idx,
                                     int64_t method) {
  constexpr const char* op = "embedding_sq_norms";
  const NormMethod m = check_method(op, method);
  const Fp32MatmulGuard precision;
  return to_f32_up(embedding_sq_norms_f64(op, ids, G, num_embeddings, padding_idx, m));
}

// The embedding clipped sum added into *self, or into new zeros when self is null; returns the
// accumulator. `op` names the public op in the argument checks. The padding row gets nothing.
// out [V, d] float32 (contiguous) += each sample's rows [c, T, d] float32 summed per id, sample by
// sample (Note [clipped-sum rounding]): on the host, one loop that sorts a sample's tokens by id
// and adds each run of one id into a row of its own before out, with no ATen calls (the
// per-sample sums of the device path cost a dozen of them, which at small sizes is most of the
// layer's time). Padding tokens (id `pad`) are skipped.
inline void add_embedding_rows_per_sample(at::Tensor& out, const at::Tensor& ids,
                                          const at::Tensor& rows, int64_t pad) {
  const at::Tensor r = rows.contiguous(), id = ids.contiguous();
  const int64_t c = r.size(0), t = r.size(1), d = r.size(2);
  const float* pr = r.data_ptr<float>();
  const int64_t* pi = id.data_ptr<int64_t>();
  float* po = out.data_ptr<float>();
  std::vector<int64_t> order(static_cast<size_t>(t));
  std::vector<float> acc(static_cast<size_t>(d));
  for (int64_t i = 0; i < c; ++i) {
    const int64_t* ids_i = pi + i * t;
    for (int64_t k = 0; k < t; ++k) order[static_cast<size_t>(k)] = k;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t x, int64_t y) { return ids_i[x] < ids_i[y]; });
    for (int64_t k = 0; k < t;) {
      const int64_t v = ids_i[order[static_cast<size_t>(k)]];
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (; k < t && ids_i[order[static_cast<size_t>(k)]] == v; ++k) {
        const float* row = pr + (i * t + order[static_cast<size_t>(k)]) * d;
        for (int64_t j = 0; j < d; ++j) acc[static_cast<size_t>(j)] += row[j];
      }
      if (v == pad) continue;  // padding tokens get no gradient
      float* dest = po + v * d;
      for (int64_t j = 0; j < d; ++j) dest[j] += acc[static_cast<size_t>(j)];
    }
  }
}

inline at::Tensor embedding_clipped_sum_into(const char* op, at::Tensor* self,
                                             const at::Tensor& ids, const at::Tensor& G,
                                             const at::Tensor& scale, int64_t num_embeddings,
                                             std::optional<int64_t> padding_idx) {
  check_embedding_args(op, ids, G, num_embeddings);
  const int64_t pad = normalize_padding_idx(op, padding_idx, num_embeddings);
  const at::Tensor id = flat_ids(op, ids, num_embeddings);
  const at::Tensor g = embedding_grad_btd(G, id);
  const int64_t b = g.size(0), t = g.size(1), d = g.size(2);
  check_scale(op, scale, b, G);
  at::Tensor out;
  if (self == nullptr) {
    out = at::zeros({num_embeddings, d}, G.options().dtype(at::kFloat));
  } else {
    check_accumulator(op, *self, {num_embeddings, d}, G, "G");
    out = *self;
  }
  const Fp32MatmulGuard precision;
  const bool host = host_factors_apply(scale, G, G);
  // Per sample: float32 copies of its rows, and (T >= 2) its per-id sums.
  const int64_t chunk = samples_per_chunk(b, 8 * t * d + (t >= 2 ? 4 * t * d + 32 * t : 0));
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor idc = id.slice(0, i0, i1);
    const at::Tensor c = scale.slice(0, i0, i1), gc = f32(g.slice(0, i0, i1));
    at::Tensor rows = host ? host_rows(gc, c, host_factors(c), /*multiply=*/true,
                                       /*owned=*/false)  // Note [host factors]
                           : scale_rows(gc, c, /*multiply=*/true);
    if (t >= 2 && host && out.is_contiguous()) {
      add_embedding_rows_per_sample(out, idc, rows, pad);
      continue;
    }
    rows.masked_fill_((idc == pad).unsqueeze(-1), 0);  // padding tokens get no gradient
    if (t < 2) {
      out.index_add_(0, idc.reshape({-1}), rows.reshape({-1, d}));
      continue;
    }
    // Note [clipped-sum rounding]: each sample's rows summed per id alone (the key sample * V +
    // id names one sample's id), then the per-sample sums added into the rows of their ids.
    // Without a host read (torch.unique would wait for the device to size its result): the keys
    // sorted, each token numbered by its run of equal keys, the runs summed into n = c T rows (the
    // rows past the last run stay zero, and adding them to row 0 changes nothing).
    const at::Tensor sample = at::arange(i1 - i0, idc.options()).unsqueeze(1);
    const at::Tensor keys = (sample * num_embeddings + idc).reshape({-1});  // [n]
    const auto [sorted, order] = at::sort(keys);
    const at::Tensor starts = at::ones_like(sorted, sorted.options().dtype(at::kLong));
    starts.slice(0, 1).copy_(sorted.slice(0, 1) != sorted.slice(0, 0, -1));
    const at::Tensor run_sorted = starts.cumsum(0) - 1;  // [n]: the run of each sorted token
    const at::Tensor run = at::empty_like(run_sorted).scatter_(0, order, run_sorted);
    at::Tensor sums = at::zeros({keys.size(0), d}, rows.options());
    sums.index_add_(0, run, rows.reshape({-1, d}));
    const at::Tensor run_key = at::zeros_like(sorted).scatter_(0, run_sorted, sorted);
    out.index_add_(0, run_key.remainder(num_embeddings), sums);
  }
  return out;
}

// Public in-place: self [V, d] float32 += sum_i scale_i (embedding gradient of sample i); ids
// [B, ...], G [B, ..., d], scale [B].
inline at::Tensor& add_embedding_clipped_sum_(at::Tensor& self, const at::Tensor& ids,
                                              const at::Tensor& G, const at::Tensor& scale,
                                              int64_t num_embeddings,
                                              std::optional<int64_t> padding_idx) {
  embedding_clipped_sum_into("add_embedding_clipped_sum_", &self, ids, G, scale, num_embeddings,
                             padding_idx);
  return self;
}

// Public: ids [B, ...], G [B, ..., d], scale [B] -> [V, d] float32 (the padding row stays 0).
inline at::Tensor embedding_clipped_sum(const at::Tensor& ids, const at::Tensor& G,
                                        const at::Tensor& scale, int64_t num_embeddings,
                                        std::optional<int64_t> padding_idx) {
  return embedding_clipped_sum_into("embedding_clipped_sum", nullptr, ids, G, scale,
                                    num_embeddings, padding_idx);
}

// Public fused op: (grad_weight [V, d], sq_norms [B], factors [B], non-finite count).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> embedding_clip(
    const at::Tensor& ids, const at::Tensor& G, int64_t num_embeddings, double max_norm,
    c10::string_view mode, double gamma, std::optional<int64_t> padding_idx, int64_t method) {
  constexpr const char* op = "embedding_clip";
  const NormMethod m = check_method(op, method);
  check_clip_op_args(op, max_norm, mode, gamma);
  const Fp32MatmulGuard precision;
  const at::Tensor sq = embedding_sq_norms_f64(op, ids, G, num_embeddings, padding_idx, m);
  auto [factors, nonfinite] = clip_from_sq_norms(sq, max_norm, mode, gamma);
  at::Tensor grad_w = embedding_clipped_sum(ids, G, factors, num_embeddings, padding_idx);
  return {grad_w, to_f32_up(sq), factors, nonfinite};
}

// ---- LayerNorm / RMSNorm: input x [B, ..., normalized_shape] (raw, before normalisation), G like x
// The op computes x̂ itself from the raw input and eps, in float64, so a hook keeps only the layer
// input it already has. Normalisation is over the last `normalized_ndim` dims, flattened into d
// (the dims between the batch dim and those are flattened into T).
//   LayerNorm (Ba et al. 2016, "Layer normalization"): x̂ = (x - mean) / sqrt(var + eps), var
//   biased, as torch.nn.LayerNorm;  RMSNorm (Zhang & Sennrich 2019, "Root mean square layer
//   normalization"): x̂ = x / sqrt(mean(x^2) + eps), as torch.nn.RMSNorm.
// Per-sample gradients: weight sum_t G_{i,t} ⊙ x̂_{i,t}, bias sum_t G_{i,t} (both normalized_shape).

inline void check_norm_layer_args(const char* op, const at::Tensor& x, const at::Tensor& g,
                                  double eps, int64_t normalized_ndim) {
  check_floating(op, "input", x);
  check_floating(op, "G", g);
  check_same_device(op, "G", g, x, "input");
  TORCH_CHECK(x.dim() >= 2 && x.sizes() == g.sizes(), "dpzero::", op,
              ": input and G must both be [B, ..., d] of one shape, got input ", x.sizes(),
              " and G ", g.sizes());
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, "dpzero::", op,
              ": eps must be finite and >= 0, got ", eps);
  TORCH_CHECK(normalized_ndim >= 1 && normalized_ndim < x.dim(), "dpzero::", op,
              ": normalized_ndim must be in [1, input.dim() - 1] = [1, ", x.dim() - 1, "], got ",
              normalized_ndim);
}

// x [B, ..., normalized_shape] viewed as [B, T, d], d = the product of the normalized dims.
inline at::Tensor as_norm_btd(const at::Tensor& x, int64_t normalized_ndim) {
  const int64_t first = x.dim() - normalized_ndim;
  int64_t t = 1, d = 1;
  for (int64_t k = 1; k < first; ++k) t *= x.size(k);
  for (int64_t k = first; k < x.dim(); ++k) d *= x.size(k);
  return x.reshape({x.size(0), t, d});
}

inline std::vector<int64_t> normalized_shape(const at::Tensor& x, int64_t normalized_ndim) {
  return x.sizes().slice(static_cast<size_t>(x.dim() - normalized_ndim)).vec();
}

// Per-sample weight gradients sum_t G_{i,t} ⊙ x̂_{i,t} and their certified squared norms:
// ([B, d] float64, [B] float64, or float32 rounded up when `f32`). x, g [B, T, d].
inline std::tuple<at::Tensor, at::Tensor> layer_norm_per_sample_btd(const at::Tensor& x,
                                                                    const at::Tensor& g,
                                                                    double eps, bool rms,
                                                                    bool f32 = false) {
  auto [grads, s] = norm_row_sums(x, g, eps, rms);
  const double e = rounding_gamma(static_cast<double>(x.size(1) + 1));
  return {grads, certify_op(grads, s, direct_coefficient(e, x.size(2) + 1), Step::kRows, f32)};
}

// Certified [B] float64 (weight, plus bias when `bias`). x, g [B, T, d].
inline at::Tensor layer_norm_sq_norms_btd(const at::Tensor& x, const at::Tensor& g, double eps,
                                          bool rms, bool bias) {
  const at::Tensor out = std::get<1>(layer_norm_per_sample_btd(x, g, eps, rms));
  return bias ? add_up(out, bias_sq_norms_btd(g)) : out;
}

// Public: -> (per-sample weight gradients [B, *normalized_shape] float64, certified squared norms
// [B] float32) (Note [kept per-sample gradients]); the bias's come from bias_per_sample.
inline std::tuple<at::Tensor, at::Tensor> layer_norm_per_sample(const at::Tensor& input,
                                                                const at::Tensor& G, double eps,
                                                                bool rms,
                                                                int64_t normalized_ndim) {
  constexpr const char* op = "layer_norm_per_sample";
  check_norm_layer_args(op, input, G, eps, normalized_ndim);
  const Fp32MatmulGuard precision;
  auto [grads, sq] = layer_norm_per_sample_btd(as_norm_btd(input, normalized_ndim),
                                               as_norm_btd(G, normalized_ndim), eps, rms,
                                               /*f32=*/true);
  std::vector<int64_t> shape = normalized_shape(input, normalized_ndim);
  shape.insert(shape.begin(), input.size(0));
  return {grads.reshape(shape), sq};
}

// Public: -> [B] float32 (weight, plus bias when `bias`).
inline at::Tensor layer_norm_sq_norms(const at::Tensor& input, const at::Tensor& G, double eps,
                                      bool rms, bool bias, int64_t normalized_ndim) {
  constexpr const char* op = "layer_norm_sq_norms";
  check_norm_layer_args(op, input, G, eps, normalized_ndim);
  const Fp32MatmulGuard precision;
  return to_f32_up(layer_norm_sq_norms_btd(as_norm_btd(input, normalized_ndim),
                                           as_norm_btd(G, normalized_ndim), eps, rms, bias));
}

// Public: scale [B] -> weight gradient [normalized_shape] float32 (summed in float64).
inline at::Tensor layer_norm_clipped_sum(const at::Tensor& input, const at::Tensor& G,
                                         const at::Tensor& scale, double eps, bool rms,
                                         int64_t normalized_ndim) {
  constexpr const char* op = "layer_norm_clipped_sum";
  check_norm_layer_args(op, input, G, eps, normalized_ndim);
  const at::Tensor x = as_norm_btd(input, normalized_ndim), g = as_norm_btd(G, normalized_ndim);
  check_scale(op, scale, x.size(0), G);
  const Fp32MatmulGuard precision;
  const at::Tensor sums = std::get<0>(norm_row_sums(x, g, eps, rms));  // [B, d] float64
  const at::Tensor out = scale_rows(sums, scale, /*multiply=*/true).sum(0);
  return f32(out).reshape(normalized_shape(input, normalized_ndim));
}

// Public fused op: (grad_weight, grad_bias or [0], sq_norms, factors, non-finite count); the
// gradients have the normalized shape.
inline ClipResult layer_norm_clip(const at::Tensor& input, const at::Tensor& G, double eps,
                                  double max_norm, c10::string_view mode, double gamma, bool rms,
                                  bool bias, int64_t normalized_ndim) {
  constexpr const char* op = "layer_norm_clip";
  check_norm_layer_args(op, input, G, eps, normalized_ndim);
  check_clip_op_args(op, max_norm, mode, gamma);
  const Fp32MatmulGuard precision;
  const at::Tensor g = as_norm_btd(G, normalized_ndim);
  const at::Tensor sq =
      layer_norm_sq_norms_btd(as_norm_btd(input, normalized_ndim), g, eps, rms, bias);
  auto [factors, nonfinite] = clip_from_sq_norms(sq, max_norm, mode, gamma);
  at::Tensor grad_w = layer_norm_clipped_sum(input, G, factors, eps, rms, normalized_ndim);
  at::Tensor grad_b = bias ? bias_clipped_sum_btd(g, factors).reshape(
                                 normalized_shape(input, normalized_ndim))
                           : no_bias_grad(G);
  return {grad_w, grad_b, to_f32_up(sq), factors, nonfinite};
}

// ---- Conv1d / Conv2d: input [B, C_in, (H,) W], G [B, C_out, (H_out,) W_out] ---------------------
// Through im2col: the unfolded input U_i [C_in*K, L] (K = kernel numel, L = output positions)
// turns group j's convolution into a Linear layer with A = U_i[rows of group j]^T [L, C_in/g*K]
// and G = G_i[channels of group j]^T [L, C_out/g] (Bu et al. 2022, ghost clipping of convolutions
// via unfold). Padding is zeros ('same'/'valid' strings and other padding modes: pad the input
// first and pass 0).

struct ConvGeometry {
  at::IntArrayRef kernel_size, stride, padding, dilation;  // as given (1 or 2 dims)
  std::vector<int64_t> k2, s2, p2, d2;                     // the 2-D im2col arguments
  int64_t groups, c_in, c_out, kernel_numel, positions;
};

inline ConvGeometry check_conv_args(const char* op, const at::Tensor& input, const at::Tensor& G,
                                    at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                    at::IntArrayRef padding, at::IntArrayRef dilation,
                                    int64_t groups) {
  check_floating(op, "input", input);
  check_floating(op, "G", G);
  check_same_device(op, "G", G, input, "input");
  const int64_t nd = static_cast<int64_t>(kernel_size.size());
  TORCH_CHECK(nd == 1 || nd == 2, "dpzero::", op,
              ": kernel_size must have 1 (Conv1d) or 2 (Conv2d) entries, got ", kernel_size);
  TORCH_CHECK(static_cast<int64_t>(stride.size()) == nd &&
                  static_cast<int64_t>(padding.size()) == nd &&
                  static_cast<int64_t>(dilation.size()) == nd,
              "dpzero::", op, ": stride, padding and dilation must have ", nd,
              " entries like kernel_size, got stride ", stride, ", padding ", padding,
              ", dilation ", dilation);
  TORCH_CHECK(input.dim() == nd + 2 && G.dim() == nd + 2 && input.size(0) == G.size(0),
              "dpzero::", op, ": input must be [B, C_in, ", nd == 2 ? "H, W" : "L",
              "] and G [B, C_out, ", nd == 2 ? "H_out, W_out" : "L_out", "], got input ",
              input.sizes(), " and G ", G.sizes());
  TORCH_CHECK(groups >= 1 && input.size(1) % groups == 0 && G.size(1) % groups == 0, "dpzero::", op,
              ": groups must be >= 1 and divide C_in = ", input.size(1), " and C_out = ", G.size(1),
              ", got ", groups);
  ConvGeometry geo{kernel_size, stride, padding,       dilation,  {}, {}, {},
                   {},          groups, input.size(1), G.size(1), 1,  1};
  for (int64_t k = 0; k < nd; ++k) {
    TORCH_CHECK(kernel_size[k] >= 1 && stride[k] >= 1 && padding[k] >= 0 && dilation[k] >= 1,
                "dpzero::", op,
                ": need kernel_size, stride, dilation >= 1 and padding >= 0, got "
                "kernel_size ",
                kernel_size, ", stride ", stride, ", padding ", padding, ", dilation ", dilation);
    const int64_t in = input.size(2 + k);
    const int64_t want =
        (in + 2 * padding[k] - dilation[k] * (kernel_size[k] - 1) - 1) / stride[k] + 1;
    TORCH_CHECK(G.size(2 + k) == want, "dpzero::", op, ": G's spatial dim ", k, " is ",
                G.size(2 + k), " but the convolution of input ", input.sizes(), " gives ", want);
    geo.kernel_numel *= kernel_size[k];
    geo.positions *= want;
  }
  if (nd == 1) {  // Conv1d as a Conv2d of height 1.
    geo.k2 = {1, kernel_size[0]};
    geo.s2 = {1, stride[0]};
    geo.p2 = {0, padding[0]};
    geo.d2 = {1, dilation[0]};
  } else {
    geo.k2 = kernel_size.vec();
    geo.s2 = stride.vec();
    geo.p2 = padding.vec();
    geo.d2 = dilation.vec();
  }
  return geo;
}

// Samples [i0, i1) unfolded: [c, C_in*K, L] float32 (exact copies of the inputs, and zeros).
inline at::Tensor unfold(const ConvGeometry& geo, const at::Tensor& input, int64_t i0, int64_t i1) {
  at::Tensor x = f32(input.slice(0, i0, i1));
  if (geo.kernel_size.size() == 1) x = x.unsqueeze(2);
  return at::im2col(x, geo.k2, geo.d2, geo.p2, geo.s2);
}

// Group j of an unfolded chunk as a Linear layer: (A [c, L, C_in/g*K], G [c, L, C_out/g]).
inline std::pair<at::Tensor, at::Tensor> conv_group(const ConvGeometry& geo, const at::Tensor& cols,
                                                    const at::Tensor& g3, int64_t j) {
  const int64_t kin = geo.c_in / geo.groups * geo.kernel_numel, kout = geo.c_out / geo.groups;
  return {cols.narrow(1, j * kin, kin).transpose(1, 2),
          g3.narrow(1, j * kout, kout).transpose(1, 2)};
}

inline int64_t conv_chunk(const ConvGeometry& geo, int64_t b) {
  return samples_per_chunk(b, 8 * geo.positions * (geo.c_in * geo.kernel_numel + geo.c_out));
}

// Certified [B] float64 (weight, plus bias when `bias`), the checks done.
inline at::Tensor conv_sq_norms_f64(const ConvGeometry& geo, const at::Tensor& input,
                                    const at::Tensor& G, NormMethod method, bool bias) {
  const int64_t b = input.size(0);
  const at::Tensor g3 = G.reshape({b, geo.c_out, geo.positions});  // [B, C_out, L]
  at::Tensor out = at::empty({b}, input.options().dtype(at::kDouble));
  const int64_t chunk = conv_chunk(geo, b);
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor cols = unfold(geo, input, i0, i1);
    const at::Tensor gc = g3.slice(0, i0, i1);
    at::Tensor sq;
    for (int64_t j = 0; j < geo.groups; ++j) {
      auto [a_j, g_j] = conv_group(geo, cols, gc, j);
      const at::Tensor part = linear_sq_norms_btd(a_j, g_j, method, /*bias=*/false);
      sq = j == 0 ? part : add_up(sq, part);
    }
    out.slice(0, i0, i1).copy_(sq);
  }
  return bias ? add_up(out, bias_sq_norms_btd(g3.transpose(1, 2))) : out;
}

// Public: -> [B] float32 (weight, plus bias when `bias`).
inline at::Tensor conv_sq_norms(const at::Tensor& input, const at::Tensor& G,
                                at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                                bool bias, int64_t method) {
  constexpr const char* op = "conv_sq_norms";
  const NormMethod m = check_method(op, method);
  const ConvGeometry geo =
      check_conv_args(op, input, G, kernel_size, stride, padding, dilation, groups);
  const Fp32MatmulGuard precision;
  return to_f32_up(conv_sq_norms_f64(geo, input, G, m, bias));
}

// Public: scale [B] -> weight gradient [C_out, C_in/groups, *kernel_size] float32.
inline at::Tensor conv_clipped_sum(const at::Tensor& input, const at::Tensor& G,
                                   const at::Tensor& scale, at::IntArrayRef kernel_size,
                                   at::IntArrayRef stride, at::IntArrayRef padding,
                                   at::IntArrayRef dilation, int64_t groups) {
  constexpr const char* op = "conv_clipped_sum";
  const ConvGeometry geo =
      check_conv_args(op, input, G, kernel_size, stride, padding, dilation, groups);
  const int64_t b = input.size(0);
  check_scale(op, scale, b, G);
  const Fp32MatmulGuard precision;
  const int64_t kin = geo.c_in / groups * geo.kernel_numel, kout = geo.c_out / groups;
  at::Tensor out = at::zeros({geo.c_out, kin}, input.options().dtype(at::kFloat));
  const at::Tensor g3 = G.reshape({b, geo.c_out, geo.positions});
  const bool host = host_factors_apply(scale, input, G);
  const int64_t chunk = conv_chunk(geo, b);
  for (int64_t i0 = 0; i0 < b; i0 += chunk) {
    const int64_t i1 = std::min(b, i0 + chunk);
    const at::Tensor cols = unfold(geo, input, i0, i1);
    const at::Tensor gc = g3.slice(0, i0, i1);
    for (int64_t j = 0; j < groups; ++j) {
      auto [a_j, g_j] = conv_group(geo, cols, gc, j);
      at::Tensor out_j = out.narrow(0, j * kout, kout);
      add_linear_clipped_sum(out_j, a_j, g_j, scale.slice(0, i0, i1),
                             host, /*transposed=*/false);
    }
  }
  std::vector<int64_t> shape{geo.c_out, geo.c_in / groups};
  for (int64_t k : kernel_size) shape.push_back(k);
  return out.reshape(shape);
}

// Public fused op: (grad_weight, grad_bias [C_out] or [0], sq_norms, factors, non-finite count).
inline ClipResult conv_clip(const at::Tensor& input, const at::Tensor& G,
                            at::IntArrayRef kernel_size, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                            double max_norm, c10::string_view mode, double gamma, bool bias,
                            int64_t method) {
  constexpr const char* op = "conv_clip";
  const NormMethod m = check_method(op, method);
  const ConvGeometry geo =
      check_conv_args(op, input, G, kernel_size, stride, padding, dilation, groups);
  check_clip_op_args(op, max_norm, mode, gamma);
  const Fp32MatmulGuard precision;
  const at::Tensor sq = conv_sq_norms_f64(geo, input, G, m, bias);
  auto [factors, nonfinite] = clip_from_sq_norms(sq, max_norm, mode, gamma);
  at::Tensor grad_w =
      conv_clipped_sum(input, G, factors, kernel_size, stride, padding, dilation, groups);
  at::Tensor grad_b =
      bias ? bias_clipped_sum_btd(G.flatten(2).transpose(1, 2), factors) : no_bias_grad(G);
  return {grad_w, grad_b, to_f32_up(sq), factors, nonfinite};
}

}  // namespace per_sample
}  // namespace dpzero::kernels
