// kernels/per_sample_checks.h — what the CPU and CUDA per-sample gradient ops share besides their
// math: argument checks (both backends reject the same inputs with the same messages), the
// ghost-vs-direct cost rule (Note [ghost or direct]), the `method` argument, the [B, *, d] ->
// [B, T, d] flattening, the sample-chunk size that bounds temporary memory, and the summation
// depth of the ghost kernels that the certified norms rely on (Note [certified norms] in
// kernels/per_sample/common.h).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include "kernels/sample_products_checks.h"  // disjoint

namespace dpzero::kernels {

// Note [device path]
// Where the per-sample ops choose by device for speed alone (clip factors and clipped sums on the
// host, Note [host factors]; asking whether a sample was dropped; the embedding's ghost-or-direct
// rule; the size of pass chunks),
// the CPU takes its branch through host_path(x) and every other device the device branch: the
// same values by other operations. The internal op dpzero::_set_device_path (tests only) sends
// CPU tensors down the device branches too, so that a test on a machine without a GPU can count
// the operators and host reads of the path a GPU takes. One value for the whole process.
inline std::atomic<bool>& device_path_forced() {
  static std::atomic<bool> forced{false};
  return forced;
}

// Whether `x` takes the host branch of a choice made for speed (Note [device path]).
inline bool host_path(const at::Tensor& x) {
  return x.is_cpu() && !device_path_forced().load(std::memory_order_relaxed);
}

// Note [ghost or direct]
// A layer's per-sample squared gradient norm ||G_i^T A_i||_F^2 (A_i: [T, d_in], G_i: [T, d_out])
// can be computed two ways:
//  * ghost norm: <A_i A_i^T, G_i G_i^T> (Goodfellow 2015, "Efficient per-example gradient
//    computations"; Li et al. 2022, "Large language models can be strong differentially private
//    learners", "ghost clipping"), holding two T x T Grams per sample;
//  * direct: instantiate G_i^T A_i ([d_out, d_in]) and take its squared Frobenius norm.
// Per sample the ghost path needs 2 T^2 numbers and the direct path d_in d_out, so we take the
// ghost path iff 2 T^2 <= d_in d_out (the layer-wise choice of "mixed ghost clipping", Bu et al.
// 2022, "Scalable and efficient training of large convolutional neural networks with differential
// privacy"; design.md §2 step 3). Both are computed in float64 and returned as certified upper
// bounds of the exact value (Note [certified norms] in kernels/per_sample/common.h): each is at
// least the exact squared norm and exceeds it by at most a margin of order (T + d_in + d_out) *
// 2^-53 * S^2, S = sum_t ||a_t|| ||g_t||, so the two paths agree far below fp32 resolution except
// in inputs that cancel so strongly that S^2 exceeds the squared norm ~10^5-fold or more.
// Layer kinds map onto (T, d_in, d_out) as follows: Linear / HF Conv1D (T, d_in, d_out);
// Conv1d/2d per group (output positions, C_in/groups * kernel numel, C_out/groups); Embedding
// (T, min(T, V), d): a sample touches at most min(T, V) rows of the [V, d] table, and those rows
// are all the direct path instantiates (on the CPU, which streams them, `auto` always takes the
// embedding's direct path: embedding_uses_ghost below).
inline bool ghost_is_cheaper(int64_t T, int64_t d_in, int64_t d_out) {
  TORCH_CHECK(T >= 0 && d_in >= 0 && d_out >= 0,
              "dpzero::ghost_is_cheaper: T, d_in and d_out must be >= 0, got T=", T,
              ", d_in=", d_in, ", d_out=", d_out);
  // 128-bit products: 2 T^2 and d_in d_out overflow int64 for T, d >= 2^31.
  const unsigned __int128 ghost = 2 * static_cast<unsigned __int128>(T) * static_cast<uint64_t>(T);
  const unsigned __int128 direct =
      static_cast<unsigned __int128>(d_in) * static_cast<uint64_t>(d_out);
  return ghost <= direct;
}

// The `method` argument of the *_sq_norms ops: 0 = auto (Note [ghost or direct]), 1 = ghost,
// 2 = direct.
enum class NormMethod : int64_t { kAuto = 0, kGhost = 1, kDirect = 2 };

inline NormMethod check_method(const char* op, int64_t method) {
  TORCH_CHECK(method >= 0 && method <= 2, "dpzero::", op,
              ": method must be 0 (auto), 1 (ghost) or 2 (direct), got ", method);
  return static_cast<NormMethod>(method);
}

inline bool use_ghost(NormMethod method, int64_t T, int64_t d_in, int64_t d_out) {
  if (method == NormMethod::kAuto) return ghost_is_cheaper(T, d_in, d_out);
  return method == NormMethod::kGhost;
}

// Note [rank-one ghost]
// With T = 1 (a [B, d] input, or one position per sample) the per-sample gradient g a^T is rank
// one and ||g a^T||_F^2 = ||a||^2 ||g||^2 exactly: the ghost value with 1 x 1 Grams. Both backends'
// _ghost_sq_norms, _ghost_sq_norms_multi and _token_ghost_sq_norms take this path at T = 1
// instead of their Gram machinery (on CUDA a whole 32 x 32 tile for one entry): per sample the two
// squared row norms qa = sum_k a_k^2, qg = sum_k g_k^2 in float64 (each square exact, each sum
// within gamma_d of the exact one, as a Gram diagonal is), value = qa * qg (one rounding) and
// S = sqrt(value) = ||a|| ||g||, read the way the Gram paths read S off the diagonals. For an
// embedding, value = qg and S = sqrt(qg) unless the token is padding (then 0 and 0, the G row
// never read into them). So the values are what the Gram paths compute for T = 1, up to the order
// of the d additions inside qa and qg, and Note [certified norms] certifies them unchanged (the
// summation depth is 0 here). The cost rule needs no exception: at T = 1 the ghost path holds two
// numbers per sample and reads the rows once, so "ghost iff 2 <= d_in d_out" picks it for every
// layer but a 1 x 1 one, and on the CUDA embedding path likewise.

// An embedding's path: as use_ghost with (T, min(T, V), d), except that on the CPU `auto` is
// always direct: the CPU kernel of Note [embedding rows] (kernels/per_sample/embedding.h) holds one
// [d] row per thread and does T d work per sample against the ghost path's 2 T^2 d.
inline bool embedding_uses_ghost(NormMethod method, int64_t T, int64_t num_embeddings, int64_t d,
                                 bool cpu) {
  if (method == NormMethod::kAuto && cpu) return false;
  return use_ghost(method, T, std::min(T, num_embeddings), d);
}

// Temporaries of the chunked loops (Grams, per-sample gradients, float64 copies) stay under this
// many bytes per chunk unless a single sample needs more.
constexpr int64_t kChunkBytes = int64_t{64} << 20;

// The budget in force: kChunkBytes unless the internal op dpzero::_set_chunk_bytes (tests only:
// a tiny budget makes every loop run several chunks with a remainder) has replaced it. One value
// for the whole process, read by every chunked loop when it starts.
inline std::atomic<int64_t>& chunk_bytes_budget() {
  static std::atomic<int64_t> budget{kChunkBytes};
  return budget;
}

// Sets the budget (bytes >= 1) and returns the previous one.
inline int64_t set_chunk_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 1, "dpzero::_set_chunk_bytes: bytes must be >= 1, got ", bytes);
  return chunk_bytes_budget().exchange(bytes);
}

// A device's budget for loops whose temporaries are per-sample products (the clipped sums of Note
// [clipped-sum rounding]): a GPU holds far more than the CPU's cache-sized budget wants, and each
// further chunk is a few more launches (B = 32 at width 768 would take 8 chunks of 64 MiB).
constexpr int64_t kDeviceChunkBytes = int64_t{1} << 30;

// How many samples one chunk holds when each needs `bytes_per_sample` bytes of temporaries;
// `device`: the device budget applies, unless a test has set the budget.
inline int64_t samples_per_chunk(int64_t num_samples, int64_t bytes_per_sample,
                                 bool device = false) {
  const int64_t set = chunk_bytes_budget().load();
  const int64_t budget = device && set == kChunkBytes ? kDeviceChunkBytes : set;
  const int64_t per = std::max<int64_t>(1, bytes_per_sample);
  return std::max<int64_t>(1, std::min<int64_t>(num_samples, budget / per));
}

// Note [pass chunks]
// The float64 passes that are elementwise work and reductions (bias sums, LayerNorm terms,
// embedding rows, their norms) gain nothing from large chunks, and on the CPU their temporaries
// cost more when large: a tensor of many MiB comes from fresh pages, and faulting them in took
// longer than the pass itself (a [16, 128, 1024] float32 -> float64 copy: ~2.9 ms inside a BERT
// step, ~0.1 ms when the allocator can recycle the memory). So they take chunks of at most
// kPassChunkBytes (or the chunk budget, when a test has made it smaller); GEMM-backed loops (Grams,
// per-sample gradients, clipped-sum GEMMs) keep the full budget, where chunk size buys speed.
// That is a CPU rule: on a GPU the allocator recycles device memory, and a chunk of one sample
// means a dozen launches per sample, so other devices take the full budget (and the CUDA kernels
// of kernels/cuda/row_sums.cu make these passes without chunks at all).
constexpr int64_t kPassChunkBytes = int64_t{2} << 20;

// A Conv's loops (kernels/per_sample/conv.h) hold each sample's patches, [L, K * C_in] floats
// in float32 and again in float64, far more than its gradient: on the CPU, chunks of the full
// budget spent more time faulting in and streaming these copies than in their GEMMs, and chunks
// of kConvChunkBytes keep them within reach of the caches (experiments/results/kernels.md, "Conv
// chunks").
constexpr int64_t kConvChunkBytes = int64_t{16} << 20;

inline int64_t samples_per_pass_chunk(int64_t num_samples, int64_t bytes_per_sample, bool cpu) {
  const int64_t budget =
      cpu ? std::min(kPassChunkBytes, chunk_bytes_budget().load()) : chunk_bytes_budget().load();
  const int64_t per = std::max<int64_t>(1, bytes_per_sample);
  return std::max<int64_t>(1, std::min<int64_t>(num_samples, budget / per));
}

// The sequence length from which the CUDA ghost kernels take the float64 GEMM strips instead of
// the fused tiles (Note [ghost roofline] in kernels/cuda/ghost_norm.cu): kGhostGemmMinRows unless
// the internal op dpzero::_set_ghost_gemm_min_rows (tests and benchmarks: the roofline times
// both paths at every T to find the device's crossover) has replaced it. Both paths certify the
// same way at every T (Note [ghost summation depth] bounds them together), so the choice is
// speed alone. One value for the whole process.
constexpr int64_t kGhostGemmMinRows = 256;

inline std::atomic<int64_t>& ghost_gemm_min_rows() {
  static std::atomic<int64_t> rows{kGhostGemmMinRows};
  return rows;
}

// Moves one of the ghost kernels' sequence-length switches (this one and ghost_split_min_rows
// below) to `rows` >= 2 (T = 1 always takes the rank-one path); returns the previous length.
inline int64_t set_length_switch(std::atomic<int64_t>& length, const char* op, int64_t rows) {
  TORCH_CHECK(rows >= 2, "dpzero::", op, ": rows must be >= 2 (T = 1 takes the rank-one path), "
              "got ", rows);
  return length.exchange(rows);
}

inline int64_t set_ghost_gemm_min_rows(int64_t rows) {
  return set_length_switch(ghost_gemm_min_rows(), "_set_ghost_gemm_min_rows", rows);
}

// The sequence length from which the CUDA ghost kernels below ghost_gemm_min_rows() take the split
// tiles (Note [split tiles] in kernels/cuda/ghost_split_tiles.cu: float64 tensor-core Grams with
// the features split over blocks) instead of the fused tiles. No length takes them by default:
// they replace a kernel that ran on a GPU, and the default moves only once a device has timed
// both (experiments/roofline.py, rows "ghost tiles" and "ghost split") and run their GoogleTests.
// The internal op dpzero::_set_ghost_split_min_rows sets it (tests, benchmarks). Both tile kernels
// certify the same way (Note [ghost summation depth]), so the choice is speed alone. One value for
// the whole process.
constexpr int64_t kGhostSplitMinRows = std::numeric_limits<int64_t>::max();

inline std::atomic<int64_t>& ghost_split_min_rows() {
  static std::atomic<int64_t> rows{kGhostSplitMinRows};
  return rows;
}

inline int64_t set_ghost_split_min_rows(int64_t rows) {
  return set_length_switch(ghost_split_min_rows(), "_set_ghost_split_min_rows", rows);
}

// Note [ghost summation depth]
// The ghost kernels sum the T^2 products (a_s . a_t)(g_s . g_t) (or the token Gram's entries) in
// float64 in a fixed tree, and Note [certified norms] needs a bound N on the number of roundings
// any one product passes through on its way into the result (Higham 2002, "Accuracy and Stability
// of Numerical Algorithms", §4.2: a sum of n terms in any order is off by at most gamma_{h} times
// the sum of the terms' magnitudes, h the depth of the addition tree):
//  * CPU (kernels/cpu/ghost_norm.cpp): each Gram row s is summed over t (<= T - 1 additions), then
//    the row sums are added up (<= T - 1 more): depth <= 2T;
//  * CUDA, fused tiles (kernels/cuda/ghost_norm.cu, T < ghost_gemm_min_rows()): a thread adds its
//    R x R tile entries (R <= 4: 16), a warp shuffle tree (5), a block tree over the warps' sums
//    (5), then at::sum over the P = n(n+1)/2 tile partials of n = ceil(T/(16R)) tile rows (depth
//    <= P - 1 in whatever order ATen sums): depth <= 25 + P, largest at R = 4 (64-row tiles);
//  * CUDA, split tiles (kernels/cuda/ghost_split_tiles.cu, from ghost_split_min_rows()): the same
//    tree over 64-row tiles (a thread's 16 entries, 5, 5, then P); their Gram entries are added
//    from feature chunks, which Note [certified norms] covers as an inner product in another order;
//  * CUDA, GEMM strips (kernels/ghost_gemm.cpp, from ghost_gemm_min_rows()): each row's
//    off-diagonal and diagonal parts are summed (<= max(r0, rows) - 1 <= T - 1), joined (1), and
//    the T row values summed (<= T - 1): depth <= 2T;
//  * the rank-one path (Note [rank-one ghost], T = 1): one product, no sum: depth 0.
// The bound below covers every backend and path at every T, whichever path a T takes.
inline double ghost_summation_depth(int64_t T) {
  const double tiles = static_cast<double>((T + 63) / 64);
  return std::max(2.0 * static_cast<double>(T), 25.0 + tiles * (tiles + 1.0) / 2.0);
}

inline void check_floating(const char* op, const char* name, const at::Tensor& x) {
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, "dpzero::", op, ": ", name,
              " must be float32, bfloat16 or float16, got ", t);
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& x,
                              const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK(x.device() == ref.device(), "dpzero::", op, ": ", name, " is on ", x.device(),
              " but ", ref_name, " is on ", ref.device());
}

// x in dtype `type`: x itself when it has it. Tensor::to returns x then too, but only after a
// trip through the dispatcher, and the private backward makes hundreds of such calls per step on
// tensors already in the dtype wanted (experiments/results/host.md).
inline at::Tensor as_dtype(const at::Tensor& x, at::ScalarType type) {
  return x.scalar_type() == type ? x : x.to(type);
}

// [B, d] or [B, ..., d] viewed as [B, T, d] with T the product of the middle dims (1 for [B, d]);
// a [B, T, d] is returned as it is.
inline at::Tensor as_btd(const char* op, const char* name, const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 2, "dpzero::", op, ": ", name,
              " must be [B, d] or [B, ..., d], got shape ", x.sizes());
  if (x.dim() == 3) return x;
  int64_t t = 1;
  for (int64_t k = 1; k + 1 < x.dim(); ++k) t *= x.size(k);
  return x.reshape({x.size(0), t, x.size(-1)});
}

// A layer input and output gradient that share their leading dims: A [B, ..., d_in], G [B, ...,
// d_out].
inline void check_layer_pair(const char* op, const at::Tensor& a, const char* a_name,
                             const at::Tensor& g) {
  check_floating(op, a_name, a);
  check_floating(op, "G", g);
  check_same_device(op, "G", g, a, a_name);
  TORCH_CHECK(a.dim() >= 2 && a.dim() == g.dim() &&
                  a.sizes().slice(0, a.dim() - 1) == g.sizes().slice(0, g.dim() - 1),
              "dpzero::", op, ": ", a_name,
              " [B, ..., d_in] and G [B, ..., d_out] must share all but "
              "their last dim, got ",
              a_name, " ", a.sizes(), " and G ", g.sizes());
}

// The accumulator of an in-place clipped-sum op (add_*_clipped_sum_): float32, the parameter's
// shape, on the data's device. It may be a view (a parameter's slot in a flat gradient buffer).
inline void check_accumulator(const char* op, const at::Tensor& self, at::IntArrayRef shape,
                              const at::Tensor& data, const char* data_name) {
  TORCH_CHECK(self.scalar_type() == at::kFloat, "dpzero::", op,
              ": self (the accumulator) must be float32, got ", self.scalar_type());
  TORCH_CHECK(self.sizes() == shape, "dpzero::", op, ": self (the accumulator) must have shape ",
              shape, ", got ", self.sizes());
  check_same_device(op, "self", self, data, data_name);
}

// Per-sample scale factors c: [B] float32 on the data's device.
inline void check_scale(const char* op, const at::Tensor& scale, int64_t num_samples,
                        const at::Tensor& data) {
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == num_samples, "dpzero::", op,
              ": scale must be [B] = [", num_samples, "], got shape ", scale.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat, "dpzero::", op, ": scale must be float32, got ",
              scale.scalar_type());
  check_same_device(op, "scale", scale, data, "G");
}

// Kept per-sample gradients grads [B, ...] (float64 / float32) and their factors scale [B] float32
// on grads' device: per_sample_clipped_sum's and add_per_sample_clipped_sum_'s (`op`) operands.
// `entry` ("" or "[k]") names the pair's place in a list of them.
inline void check_per_sample_clipped_sum_args(const char* op, const at::Tensor& grads,
                                              const at::Tensor& scale,
                                              const std::string& entry = "") {
  TORCH_CHECK(grads.dim() >= 1, "dpzero::", op, ": grads", entry,
              " must be [B, ...], got a 0-d tensor");
  TORCH_CHECK(grads.scalar_type() == at::kDouble || grads.scalar_type() == at::kFloat, "dpzero::",
              op, ": grads", entry, " must be float64 or float32, got ", grads.scalar_type());
  check_scale(op, scale, grads.size(0), grads);
}

// dpzero::add_per_sample_clipped_sum_ on any backend: the operands above, and self float32 with
// prod(grads.shape[1:]) elements (any shape: a parameter's slot) on their device, sharing memory
// with neither of them. `op` names the call.
inline void check_add_per_sample_clipped_sum(const at::Tensor& self, const at::Tensor& grads,
                                             const at::Tensor& scale,
                                             const char* op = "add_per_sample_clipped_sum_",
                                             const std::string& entry = "") {
  check_per_sample_clipped_sum_args(op, grads, scale, entry);
  const int64_t d = c10::multiply_integers(grads.sizes().slice(1));
  TORCH_CHECK(self.scalar_type() == at::kFloat && self.numel() == d, "dpzero::", op, ": self",
              entry, " (the accumulator) must be float32 with ", d, " elements (grads", entry, " ",
              grads.sizes(), " less the sample dim), got ", self.scalar_type(), " of shape ",
              self.sizes());
  check_same_device(op, "self", self, grads, "grads");
  TORCH_CHECK(sample_products::disjoint(self, grads) && sample_products::disjoint(self, scale),
              "dpzero::", op, ": self", entry, " shares memory with grads", entry,
              " or scale; add into another tensor");
}

// dpzero::_add_per_sample_clipped_sums_: each pair (self[k], grads[k]) as above, under one scale,
// and no self sharing memory with another self or with another pair's grads (the pairs' adds are
// independent, so a backend may run them at once and in any order). The pairs' byte spans are
// sorted and swept once, n log n where comparing every two is quadratic in a group's hundreds of
// pairs. A span overlapping an earlier one overlaps the span reaching furthest so far; if those
// two are both grads (which may overlap), the earlier span and the furthest one overlap each
// other and were compared when the later of them was swept.
inline void check_add_per_sample_clipped_sums(at::TensorList self, at::TensorList grads,
                                              const at::Tensor& scale) {
  constexpr const char* op = "_add_per_sample_clipped_sums_";
  TORCH_CHECK(self.size() == grads.size(), "dpzero::", op, ": ", self.size(),
              " accumulators (self) for ", grads.size(), " gradients (grads)");
  struct Span {
    uintptr_t begin, end;
    size_t pair;
    bool self;
  };
  std::vector<Span> spans;
  const auto add_span = [&](const at::Tensor& x, size_t pair, bool is_self) {
    if (x.numel() == 0) return;
    int64_t last = 0;
    for (int64_t d = 0; d < x.dim(); ++d) last += (x.size(d) - 1) * x.stride(d);
    const auto begin = reinterpret_cast<uintptr_t>(x.const_data_ptr());
    spans.push_back({begin, begin + static_cast<uintptr_t>((last + 1) * x.element_size()), pair,
                     is_self});
  };
  for (size_t k = 0; k < self.size(); ++k) {
    check_add_per_sample_clipped_sum(self[k], grads[k], scale, op, "[" + std::to_string(k) + "]");
    add_span(self[k], k, true);
    add_span(grads[k], k, false);
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& x, const Span& y) { return x.begin < y.begin; });
  const Span* furthest = nullptr;
  for (const Span& span : spans) {
    if (furthest != nullptr && span.begin < furthest->end && (span.self || furthest->self)) {
      const Span& a = furthest->self ? *furthest : span;
      const Span& b = furthest->self ? span : *furthest;
      TORCH_CHECK(false, "dpzero::", op, ": self[", a.pair, "] shares memory with ",
                  b.self ? "self[" : "grads[", b.pair, "]; ",
                  b.self ? "each pair adds into memory of its own" : "add into another tensor");
    }
    if (furthest == nullptr || span.end > furthest->end) furthest = &span;
  }
}

// Embedding token ids [B, ...] (int32 / int64) and output gradient [B, ..., d].
inline void check_embedding_args(const char* op, const at::Tensor& ids, const at::Tensor& g,
                                 int64_t num_embeddings) {
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, "dpzero::", op,
              ": ids must be int64 or int32, got ", ids.scalar_type());
  check_floating(op, "G", g);
  check_same_device(op, "G", g, ids, "ids");
  TORCH_CHECK(
      ids.dim() >= 1 && g.dim() == ids.dim() + 1 && g.sizes().slice(0, ids.dim()) == ids.sizes(),
      "dpzero::", op, ": G must be ids.shape + [d], got ids ", ids.sizes(), " and G ", g.sizes());
  TORCH_CHECK(num_embeddings >= 1, "dpzero::", op, ": num_embeddings must be >= 1, got ",
              num_embeddings);
}

// torch.nn.Embedding's convention: padding_idx in [-V, V), negative counts from the end; None
// means no padding. Returns the id in [0, V), or -1 for none.
inline int64_t normalize_padding_idx(const char* op, std::optional<int64_t> padding_idx,
                                     int64_t num_embeddings) {
  if (!padding_idx.has_value()) return -1;
  const int64_t p = *padding_idx;
  TORCH_CHECK(p >= -num_embeddings && p < num_embeddings, "dpzero::", op,
              ": padding_idx must be in [-num_embeddings, num_embeddings) = [", -num_embeddings,
              ", ", num_embeddings, "), got ", p);
  return p < 0 ? p + num_embeddings : p;
}

// The internal ghost kernels' inputs, already flattened by the layer ops: A [B, T, d_in] (or the
// token ids [B, T]) and G [B, T, d_out].
inline void check_ghost_args(const char* op, const at::Tensor& a, const char* a_name,
                             const at::Tensor& g) {
  check_floating(op, "G", g);
  check_same_device(op, a_name, a, g, "G");
  TORCH_CHECK(g.dim() == 3, "dpzero::", op, ": G must be [B, T, d_out], got shape ", g.sizes());
  const int64_t want_dim = a.is_floating_point() ? 3 : 2;
  TORCH_CHECK(a.dim() == want_dim && a.size(0) == g.size(0) && a.size(1) == g.size(1),
              "dpzero::", op, ": ", a_name, " must be [B, T", want_dim == 3 ? ", d_in]" : "]",
              " with B, T of G ", g.sizes(), ", got shape ", a.sizes());
  if (want_dim == 3) check_floating(op, a_name, a);
}

// The inputs of dpzero::_token_ghost_sq_norms and dpzero::_embedding_rows (`op`) on any backend:
// ids [B, T] int64, G [B, T, d], and a padding index >= 0 or -1 for none.
inline void check_token_ghost_args(const at::Tensor& ids, const at::Tensor& g, int64_t padding_idx,
                                   const char* op = "_token_ghost_sq_norms") {
  check_ghost_args(op, ids, "ids", g);
  TORCH_CHECK(ids.scalar_type() == at::kLong, "dpzero::", op, ": ids must be int64, got ",
              ids.scalar_type());
  TORCH_CHECK(padding_idx >= -1, "dpzero::", op,
              ": padding_idx must be >= 0 or -1 (none), got ", padding_idx);
}

inline void check_embedding_rows_args(const at::Tensor& ids, const at::Tensor& g,
                                      int64_t num_embeddings, int64_t padding_idx) {
  check_token_ghost_args(ids, g, padding_idx, "_embedding_rows");
  TORCH_CHECK(num_embeddings >= 1, "dpzero::_embedding_rows: num_embeddings must be >= 1, got ",
              num_embeddings);
}

}  // namespace dpzero::kernels
