// The ghost kernels' paths by sequence length (Note [ghost roofline] in
// kernels/cuda/ghost_norm.cu): the rank-one path at T = 1 (Note [rank-one ghost] in
// kernels/per_sample_checks.h) against ||a||^2 ||g||^2 computed here, and the float64 GEMM-strip
// path (kernels/ghost_gemm.cpp, the CUDA kernels' long-sequence path, written in ATen) run on the
// CPU against the CPU kernel, which forms its Grams its own way. Both add the same float64 terms
// in other orders, so they agree within the certified rounding margin of Note [certified norms]:
// values whose terms cancel are compared against that margin, sums of positive terms relatively.
// With a GPU and the CUDA kernels, every CUDA path (rank one, the three fused tile sizes, the split
// tiles, GEMM strips) is checked against the CPU kernel; without one those tests are skipped.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#ifdef DPZERO_WITH_CUDA
#include "kernels/cuda/ghost_split_tiles.h"
#endif
#include "kernels/ghost_gemm.h"
#include "kernels/per_sample_checks.h"
#include "kernels/per_sample_ops.h"
#include "tests/cpp/torch/devices.h"

namespace dpzero {
namespace {

using testing::cuda_available;
using testing::devices;
using testing::kNoCuda;

using Pair = std::tuple<at::Tensor, at::Tensor>;

Pair ghost_op(const at::Tensor& a, const at::Tensor& g) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_ghost_sq_norms", "")
                             .typed<Pair(const at::Tensor&, const at::Tensor&)>();
  return op.call(a, g);
}

Pair token_ghost_op(const at::Tensor& ids, const at::Tensor& g, int64_t pad) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_token_ghost_sq_norms", "")
                             .typed<Pair(const at::Tensor&, const at::Tensor&, int64_t)>();
  return op.call(ids, g, pad);
}

Pair ghost_multi_op(const at::Tensor& a, at::TensorList gs) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_ghost_sq_norms_multi", "")
                             .typed<Pair(const at::Tensor&, at::TensorList)>();
  return op.call(a, gs);
}

int64_t set_chunk_bytes_op(int64_t bytes) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_set_chunk_bytes", "")
                             .typed<int64_t(int64_t)>();
  return op.call(bytes);
}

// std::sqrt of each entry of a float64 tensor, on the host: IEEE's correctly rounded square root,
// as the kernels take it (at::sqrt on the CPU may be a vectorised routine one ulp off).
at::Tensor host_sqrt(const at::Tensor& x) {
  at::Tensor out = x.to(at::kCPU).contiguous().clone();
  double* p = out.data_ptr<double>();
  for (int64_t i = 0; i < out.numel(); ++i) p[i] = std::sqrt(p[i]);
  return out;
}

// Two ghost values of the same inputs ([B] float64, any device) agree within twice the certified
// margin of Note [certified norms] (each is within c S^2 of the exact value), S [B] float64.
void expect_within_margin(const at::Tensor& got, const at::Tensor& want, const at::Tensor& s,
                          int64_t t, int64_t d_in, int64_t d_out, const std::string& what) {
  const double c = kernels::per_sample::ghost_error_coefficient(t, d_in, d_out);
  const at::Tensor g = got.to(at::kCPU), w = want.to(at::kCPU), s2 = s.to(at::kCPU).square();
  ASSERT_EQ(g.scalar_type(), at::kDouble) << what;
  ASSERT_EQ(g.sizes(), w.sizes()) << what;
  const at::Tensor err = (g - w).abs() - 2.0 * c * s2;
  EXPECT_LE(err.max().item<double>(), 0.0) << what << "\n got " << g << "\n want " << w;
}

// Relative agreement of two [B] float64 tensors (moved to the host), entry by entry.
void expect_rel(const at::Tensor& got, const at::Tensor& want, double rtol,
                const std::string& what) {
  const at::Tensor g = got.to(at::kCPU), w = want.to(at::kCPU);
  ASSERT_EQ(g.scalar_type(), at::kDouble) << what;
  ASSERT_EQ(g.sizes(), w.sizes()) << what;
  const at::Tensor err = (g - w).abs() - rtol * w.abs();
  EXPECT_LE(err.max().item<double>(), 0.0) << what << "\n got " << g << "\n want " << w;
}

// Note [shared inputs]: each layer's row of a CUDA _ghost_sq_norms_multi result `got` ([L, B]
// values and S) against the CPU op's `cpu`: the value within the certified margin (A of width
// d_in, T rows), S to 1e-12, a width-0 layer's row exactly 0 and, with `single_bits`, the single
// CUDA op's bits for that layer's G (`a_cuda`, `gs_cuda[l]`).
void expect_shared_rows(const Pair& got, const Pair& cpu, const at::Tensor& a_cuda,
                        const std::vector<at::Tensor>& gs_cuda,
                        const std::vector<int64_t>& widths, int64_t t, int64_t d_in,
                        bool single_bits, const std::string& context) {
  const auto& [values, norms] = got;
  const auto& [values_cpu, norms_cpu] = cpu;
  for (size_t l = 0; l < widths.size(); ++l) {
    const auto row = static_cast<int64_t>(l);
    const std::string what = context + " layer " + std::to_string(l);
    expect_within_margin(values[row], values_cpu[row], norms_cpu[row], t, d_in, widths[l],
                         "value " + what);
    expect_rel(norms[row], norms_cpu[row], 1e-12, "S " + what);
    if (widths[l] == 0) {
      EXPECT_EQ(values[row].abs().max().item<double>(), 0.0) << what;
      EXPECT_EQ(norms[row].abs().max().item<double>(), 0.0) << what;
    }
    if (single_bits) {
      const auto [value_one, s_one] = ghost_op(a_cuda, gs_cuda[l]);
      EXPECT_TRUE(at::equal(values[row], value_one)) << "single op's bits, " << what;
      EXPECT_TRUE(at::equal(norms[row], s_one)) << "single op's S bits, " << what;
    }
  }
}

// Note [rank-one ghost]: at T = 1, value = ||a||^2 ||g||^2 and S = sqrt(value) = ||a|| ||g||, for
// every input dtype, a strided A, a group of G's sharing A (_ghost_sq_norms_multi: each row the
// single op's bits), on every device present. The per-sample gradient g a^T is formed here in
// float64 and its squared norm taken entry by entry: the exact-arithmetic reference.
TEST(GhostPaths, RankOneIsTheSquaredNormOfThePerSampleGradient) {
  at::manual_seed(11);
  for (const at::Device device : devices()) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const auto opts = at::TensorOptions().device(device).dtype(dtype);
      const at::Tensor a = at::randn({7, 1, 37}, opts);
      const at::Tensor a_strided = at::randn({7, 1, 74}, opts).slice(2, 0, 74, 2);
      const at::Tensor g = at::randn({7, 1, 300}, opts);
      const at::Tensor g2 = at::randn({7, 1, 5}, opts);
      for (const at::Tensor& x : {a, a_strided}) {
        const std::string what = device.str() + " " + c10::toString(dtype);
        const at::Tensor x64 = x.to(at::kCPU, at::kDouble), g64 = g.to(at::kCPU, at::kDouble);
        const at::Tensor grads = at::bmm(g64.transpose(1, 2), x64);  // [B, d_out, d_in]
        const at::Tensor want = grads.square().sum({1, 2});
        const auto [value, s] = ghost_op(x, g);
        expect_rel(value, want, 1e-12, "value " + what);
        EXPECT_TRUE(at::equal(s.cpu(), host_sqrt(value))) << what;
        const auto [values, norms] = ghost_multi_op(x, {g, g2});
        EXPECT_TRUE(at::equal(values[0].cpu(), value.cpu())) << what;
        EXPECT_TRUE(at::equal(norms[0].cpu(), s.cpu())) << what;
        expect_rel(values[1],
                   x64.square().sum({1, 2}) * g2.to(at::kCPU, at::kDouble).square().sum({1, 2}),
                   1e-12, "multi row 1 " + what);
      }
    }
  }
}

// The rank-one path of an embedding: ||g||^2 and ||g|| for a kept token, 0 and 0 for padding
// (whose G row is NaN here and must not be read into the result), on every device present.
TEST(GhostPaths, RankOneTokensSkipPadding) {
  at::manual_seed(12);
  for (const at::Device device : devices()) {
    const at::Tensor ids = at::tensor({3, 0, 3, 1, 0}, at::kLong).view({5, 1}).to(device);
    at::Tensor g = at::randn({5, 1, 9}, at::kFloat);
    g.masked_fill_((ids.cpu() == 0).view({5, 1, 1}), std::numeric_limits<float>::quiet_NaN());
    const auto [value, s] = token_ghost_op(ids, g.to(device), /*pad=*/0);
    const at::Tensor q = g.to(at::kDouble).square().sum({1, 2});
    const at::Tensor kept = (ids.cpu() != 0).view({5});
    const at::Tensor want = at::where(kept, q, 0.0);
    expect_rel(value, want, 1e-13, "value " + device.str());
    expect_rel(s, at::where(kept, q.sqrt(), 0.0), 1e-13, "S " + device.str());
    const at::Tensor g_finite = g.nan_to_num();
    const auto [value_none, s_none] = token_ghost_op(ids, g_finite.to(device), /*pad=*/-1);
    expect_rel(value_none, g_finite.to(at::kDouble).square().sum({1, 2}), 1e-13,
               "no padding " + device.str());
  }
}

// The strips cover [0, T) in at most 8 blocks of >= 64 rows (all of T when T < 256), in order.
TEST(GhostPaths, GemmRowBlocksCoverTheSequence) {
  for (const int64_t t : {1, 2, 127, 128, 129, 255, 256, 300, 1023, 1024, 1025, 5000}) {
    const auto blocks = kernels::gemm_row_blocks(t);
    ASSERT_FALSE(blocks.empty());
    EXPECT_LE(blocks.size(), 8u) << "T=" << t;
    int64_t next = 0;
    for (const auto& [r0, r1] : blocks) {
      EXPECT_EQ(r0, next) << "T=" << t;
      EXPECT_GT(r1, r0) << "T=" << t;
      if (blocks.size() > 1) EXPECT_GE(r1 - r0, 64) << "T=" << t;
      next = r1;
    }
    EXPECT_EQ(next, t);
  }
}

// kernels/ghost_gemm.cpp (what CUDA runs from T = 256 on), run on the CPU: the same value and S as
// the CPU kernel to float64 rounding, with one and several row blocks, mixed input dtypes, chunks
// down to one sample, and for tokens with padding whose G rows are NaN.
TEST(GhostPaths, GemmStripsMatchTheCpuKernel) {
  at::manual_seed(13);
  struct Case {
    int64_t b, t, d_in, d_out;
  };
  for (const Case c : {Case{3, 2, 5, 4}, Case{4, 70, 9, 6}, Case{2, 300, 7, 5},
                       Case{2, 1030, 3, 4}}) {
    const at::Tensor a = at::randn({c.b, c.t, c.d_in}, at::kFloat);
    const at::Tensor g = at::randn({c.b, c.t, c.d_out}, at::kFloat);
    const std::string what = "b=" + std::to_string(c.b) + " t=" + std::to_string(c.t);
    const auto [value_cpu, s_cpu] = ghost_op(a, g);
    for (const int64_t budget : {int64_t{64} << 20, int64_t{1}}) {
      const int64_t previous = set_chunk_bytes_op(budget);
      const auto [value, s] = kernels::ghost_values_gemm(a, at::Tensor(), g, -1);
      set_chunk_bytes_op(previous);
      expect_within_margin(value, value_cpu, s_cpu, c.t, c.d_in, c.d_out, "value " + what);
      expect_rel(s, s_cpu, 1e-12, "S " + what);
    }
    const at::Tensor g_bf16 = g.to(at::kBFloat16);
    const auto [value_mixed, s_mixed] = kernels::ghost_values_gemm(a, at::Tensor(), g_bf16, -1);
    const auto [value_mixed_cpu, s_mixed_cpu] = ghost_op(a, g_bf16.to(at::kFloat));
    expect_within_margin(value_mixed, value_mixed_cpu, s_mixed_cpu, c.t, c.d_in, c.d_out,
                         "mixed dtypes " + what);

    const int64_t pad = 2;
    const at::Tensor ids = at::randint(5, {c.b, c.t}, at::kLong);
    at::Tensor g_tok = g.clone();
    g_tok.masked_fill_((ids == pad).unsqueeze(-1), std::numeric_limits<float>::quiet_NaN());
    const auto [tv_cpu, ts_cpu] = token_ghost_op(ids, g_tok, pad);
    const auto [tv, ts] = kernels::ghost_values_gemm(at::Tensor(), ids, g_tok, pad);
    ASSERT_TRUE(at::isfinite(tv).all().item<bool>()) << what;
    expect_within_margin(tv, tv_cpu, ts_cpu, c.t, 0, c.d_out, "token value " + what);
    expect_rel(ts, ts_cpu, 1e-12, "token S " + what);
  }
}

// Note [shared inputs]: the GEMM strips of several G's sharing one A (A's strips made once, what
// CUDA runs from T = 256 on), run on the CPU: each row the CPU kernel's value and S for that layer
// alone, within the certified margin, with mixed dtypes and chunks down to one sample.
TEST(GhostPaths, GemmStripsForSharedInputsMatchOneLayerAtATime) {
  at::manual_seed(15);
  for (const int64_t t : {2, 70, 300}) {
    const at::Tensor a = at::randn({3, t, 9}, at::kFloat);
    const std::vector<at::Tensor> gs = {at::randn({3, t, 6}, at::kFloat),
                                        at::randn({3, t, 11}, at::kFloat).to(at::kBFloat16),
                                        at::randn({3, t, 0}, at::kFloat),
                                        at::randn({3, t, 1}, at::kFloat)};
    for (const int64_t budget : {int64_t{64} << 20, int64_t{1}}) {
      const int64_t previous = set_chunk_bytes_op(budget);
      const auto [values, norms] = kernels::ghost_values_gemm_multi(a, gs);
      set_chunk_bytes_op(previous);
      ASSERT_EQ(values.sizes(), at::IntArrayRef({4, 3}));
      ASSERT_EQ(norms.sizes(), at::IntArrayRef({4, 3}));
      for (size_t l = 0; l < gs.size(); ++l) {
        const std::string what = "T=" + std::to_string(t) + " layer " + std::to_string(l) +
                                 " budget " + std::to_string(budget);
        const auto [value, s] = ghost_op(a, gs[l].to(at::kFloat));
        const auto row = static_cast<int64_t>(l);
        expect_within_margin(values[row], value, s, t, 9, gs[l].size(2), "value " + what);
        expect_rel(norms[row], s, 1e-12, "S " + what);
      }
    }
  }
}

// Note [ghost summation depth]: the bound covers every path's tree (CPU rows: 2T; fused CUDA
// tiles of 64 rows: 25 + P; GEMM strips: 2T; rank one: 0).
TEST(GhostPaths, SummationDepthCoversEveryPath) {
  for (int64_t t = 1; t <= 4096; t = t < 70 ? t + 1 : t * 2) {
    const double tiles = static_cast<double>((t + 63) / 64);
    EXPECT_GE(kernels::ghost_summation_depth(t), 2.0 * static_cast<double>(t)) << "T=" << t;
    EXPECT_GE(kernels::ghost_summation_depth(t), 25.0 + tiles * (tiles + 1.0) / 2.0) << "T=" << t;
  }
}

// CUDA twin: every CUDA path against the CPU kernel on the same inputs (float64 rounding apart):
// T = 1 (rank one), 2..16 (16-row tiles), 17..32 (32-row tiles), 33..255 (64-row tiles, one to
// four tile rows, remainders), 256+ (GEMM strips), for Linear inputs in every dtype and for tokens
// with padding whose G rows are NaN.
TEST(GhostPaths, CudaPathsMatchTheCpuKernel) {
  if (!cuda_available()) GTEST_SKIP() << kNoCuda;
  at::manual_seed(14);
  for (const int64_t t : {1, 2, 5, 16, 17, 32, 33, 64, 65, 130, 255, 256, 300}) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const at::Tensor a = at::randn({3, t, 40}, at::kFloat).to(dtype);
      const at::Tensor g = at::randn({3, t, 24}, at::kFloat).to(dtype);
      const std::string what = "T=" + std::to_string(t) + " " + c10::toString(dtype);
      const auto [value_cpu, s_cpu] = ghost_op(a, g);
      const auto [value, s] = ghost_op(a.cuda(), g.cuda());
      expect_within_margin(value, value_cpu, s_cpu, t, 40, 24, "value " + what);
      expect_rel(s, s_cpu, 1e-12, "S " + what);
    }
    const int64_t pad = 1;
    const at::Tensor ids = at::randint(4, {3, t}, at::kLong);
    at::Tensor g = at::randn({3, t, 24}, at::kFloat);
    g.masked_fill_((ids == pad).unsqueeze(-1), std::numeric_limits<float>::quiet_NaN());
    const auto [tv_cpu, ts_cpu] = token_ghost_op(ids, g, pad);
    const auto [tv, ts] = token_ghost_op(ids.cuda(), g.cuda(), pad);
    expect_within_margin(tv, tv_cpu, ts_cpu, t, 0, 24, "token value T=" + std::to_string(t));
    expect_rel(ts, ts_cpu, 1e-12, "token S T=" + std::to_string(t));
  }
}

int64_t set_ghost_gemm_min_rows_op(int64_t rows) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_set_ghost_gemm_min_rows", "")
                             .typed<int64_t(int64_t)>();
  return op.call(rows);
}

int64_t set_ghost_split_min_rows_op(int64_t rows) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_set_ghost_split_min_rows", "")
                             .typed<int64_t(int64_t)>();
  return op.call(rows);
}

constexpr int64_t kNever = int64_t{1} << 40;  // a length no test reaches

// Moves the CUDA ghost kernels' length switches (split tiles from `split_from`, GEMM strips from
// `strips_from`) while it lives, and puts them back after, a failed assertion included.
struct ForcedLengths {
  int64_t split_before, strips_before;
  ForcedLengths(int64_t split_from, int64_t strips_from)
      : split_before(set_ghost_split_min_rows_op(split_from)),
        strips_before(set_ghost_gemm_min_rows_op(strips_from)) {}
  ~ForcedLengths() {
    set_ghost_split_min_rows_op(split_before);
    set_ghost_gemm_min_rows_op(strips_before);
  }
};

// The switch between fused tiles and GEMM strips refuses a length without a Gram, naming it, and
// keeps what it had.
TEST(GhostPaths, TheStripLengthRefusesOneRow) {
  const int64_t before = set_ghost_gemm_min_rows_op(kernels::kGhostGemmMinRows);
  EXPECT_EQ(before, kernels::kGhostGemmMinRows);
  try {
    set_ghost_gemm_min_rows_op(1);
    ADD_FAILURE() << "rows = 1 was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rows must be >= 2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("got 1"), std::string::npos) << e.what();
  }
  EXPECT_EQ(set_ghost_gemm_min_rows_op(kernels::kGhostGemmMinRows), kernels::kGhostGemmMinRows);
}

// Either CUDA path at every length (what the roofline times to find the crossover): the fused
// tiles forced up to T = 300 and the GEMM strips forced down to T = 2, each against the CPU kernel
// within the certified margin, for Linear inputs and for tokens.
TEST(GhostPaths, EitherCudaPathAtEveryLengthMatchesTheCpuKernel) {
  if (!cuda_available()) GTEST_SKIP() << kNoCuda;
  at::manual_seed(15);
  for (const int64_t from : {int64_t{2}, kNever}) {  // strips everywhere, fused tiles everywhere
    const ForcedLengths forced(kNever, from);
    for (const int64_t t : {2, 17, 64, 130, 255, 256, 300}) {
      const std::string what = "T=" + std::to_string(t) + " strips from " + std::to_string(from);
      const at::Tensor a = at::randn({3, t, 40}), g = at::randn({3, t, 24});
      const auto [value_cpu, s_cpu] = ghost_op(a, g);
      const auto [value, s] = ghost_op(a.cuda(), g.cuda());
      expect_within_margin(value, value_cpu, s_cpu, t, 40, 24, "value " + what);
      expect_rel(s, s_cpu, 1e-12, "S " + what);
      const at::Tensor ids = at::randint(4, {3, t}, at::kLong);
      const auto [tv_cpu, ts_cpu] = token_ghost_op(ids, g, 1);
      const auto [tv, ts] = token_ghost_op(ids.cuda(), g.cuda(), 1);
      expect_within_margin(tv, tv_cpu, ts_cpu, t, 0, 24, "token value " + what);
      expect_rel(ts, ts_cpu, 1e-12, "token S " + what);
    }
  }
}

// CUDA twin of Note [shared inputs]: _ghost_sq_norms_multi on CUDA (A's Gram tile built once for
// up to four layers a launch, so six layers take two; GEMM strips from T = 256; rank one at
// T = 1) against the CPU op, row by row within the certified margin, on every path by T, in every
// dtype, for layers of different widths (one of width 0, whose row is exactly 0), and with A and
// G of different dtypes. Below T = 256 each row is also the single CUDA op's bits for that layer
// (the same tiles in the same order). The layers' rows are B apart in the tile sums and a launch
// covers at most 65535 samples: B = 65537 at T = 2 checks both offsets.
TEST(GhostPaths, CudaSharedInputsMatchTheCpuKernel) {
  if (!cuda_available()) GTEST_SKIP() << kNoCuda;
  at::manual_seed(16);
  const std::vector<int64_t> widths = {24, 7, 0, 64, 1, 33};
  for (const int64_t t : {1, 2, 16, 17, 32, 33, 130, 255, 256, 300}) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const at::Tensor a = at::randn({3, t, 40}, at::kFloat).to(dtype);
      std::vector<at::Tensor> gs, gs_cuda;
      for (const int64_t w : widths) {
        gs.push_back(at::randn({3, t, w}, at::kFloat).to(dtype));
        gs_cuda.push_back(gs.back().cuda());
      }
      expect_shared_rows(ghost_multi_op(a.cuda(), gs_cuda), ghost_multi_op(a, gs), a.cuda(),
                         gs_cuda, widths, t, 40, /*single_bits=*/t < 256,
                         "T=" + std::to_string(t) + " " + c10::toString(dtype));
    }
    const at::Tensor a = at::randn({3, t, 40}, at::kFloat);
    const at::Tensor g_bf16 = at::randn({3, t, 24}, at::kFloat).to(at::kBFloat16);
    const at::Tensor g = at::randn({3, t, 7}, at::kFloat);
    const auto [values_cpu, norms_cpu] = ghost_multi_op(a, {g_bf16.to(at::kFloat), g});
    const auto [values, norms] = ghost_multi_op(a.cuda(), {g_bf16.cuda(), g.cuda()});
    for (const int64_t row : {0, 1}) {
      const std::string what = "mixed dtypes T=" + std::to_string(t) + " layer " +
                               std::to_string(row);
      expect_within_margin(values[row], values_cpu[row], norms_cpu[row], t, 40,
                           row == 0 ? 24 : 7, "value " + what);
      expect_rel(norms[row], norms_cpu[row], 1e-12, "S " + what);
    }
  }
  const std::vector<int64_t> narrow = {1, 2, 1, 3, 1};
  const at::Tensor a = at::randn({65537, 2, 1}, at::kFloat);
  std::vector<at::Tensor> gs, gs_cuda;
  for (const int64_t w : narrow) {
    gs.push_back(at::randn({65537, 2, w}, at::kFloat));
    gs_cuda.push_back(gs.back().cuda());
  }
  const auto [values_cpu, norms_cpu] = ghost_multi_op(a, gs);
  const auto [values, norms] = ghost_multi_op(a.cuda(), gs_cuda);
  for (size_t l = 0; l < narrow.size(); ++l) {
    const auto row = static_cast<int64_t>(l);
    const std::string what = "B = 65537, layer " + std::to_string(l);
    expect_within_margin(values[row], values_cpu[row], norms_cpu[row], 2, 1, narrow[l],
                         "value " + what);
    expect_rel(norms[row], norms_cpu[row], 1e-12, "S " + what);
  }
}

// Whether the split tiles run on this process's GPU (sm_80 and later, code built for it); where
// they do not, the launchers take the fused tiles and the split-tile tests have nothing to test.
bool split_tiles_run_here() {
#ifdef DPZERO_WITH_CUDA
  return cuda_available() && kernels::split_tiles_supported(at::Device(at::kCUDA, 0));
#else
  return false;
#endif
}

constexpr const char* kNoSplitTiles =
    "no CUDA device with float64 tensor cores (sm_80+), or dpzero built without CUDA kernels";

// No length takes the split tiles until a device has measured them (kernels/per_sample_checks.h),
// and their switch refuses a length without a Gram, naming it, keeping what it had.
TEST(GhostPaths, TheSplitLengthIsOffByDefaultAndRefusesOneRow) {
  const int64_t before = set_ghost_split_min_rows_op(kernels::kGhostSplitMinRows);
  EXPECT_EQ(before, std::numeric_limits<int64_t>::max());
  try {
    set_ghost_split_min_rows_op(1);
    ADD_FAILURE() << "rows = 1 was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rows must be >= 2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("got 1"), std::string::npos) << e.what();
  }
  EXPECT_EQ(set_ghost_split_min_rows_op(before), kernels::kGhostSplitMinRows);
}

// Note [split tiles]: the split tiles forced at every length up to past the strips' default,
// against the CPU kernel within the certified margin. Tile rows one to five with remainders;
// every dtype; widths of one chunk and of many with a short last chunk (d_in = 700 at B = 3 cuts
// each operand into 64-feature chunks); tokens whose padding rows are NaN; the workspace budget
// down to one sample a launch; and a run repeated bit for bit (no atomics).
TEST(GhostPaths, CudaSplitTilesMatchTheCpuKernel) {
  if (!split_tiles_run_here()) GTEST_SKIP() << kNoSplitTiles;
  const ForcedLengths forced(/*split_from=*/2, /*strips_from=*/kNever);
  at::manual_seed(17);
  for (const int64_t t : {2, 5, 16, 33, 64, 65, 130, 255, 300}) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      for (const auto& [d_in, d_out] : {std::pair<int64_t, int64_t>{40, 24}, {700, 130}}) {
        const at::Tensor a = at::randn({3, t, d_in}, at::kFloat).to(dtype);
        const at::Tensor g = at::randn({3, t, d_out}, at::kFloat).to(dtype);
        const std::string what = "T=" + std::to_string(t) + " " + c10::toString(dtype) +
                                 " d_in=" + std::to_string(d_in);
        const auto [value_cpu, s_cpu] = ghost_op(a, g);
        for (const int64_t budget : {int64_t{64} << 20, int64_t{1}}) {
          const int64_t previous = set_chunk_bytes_op(budget);
          const auto [value, s] = ghost_op(a.cuda(), g.cuda());
          const auto [again, s_again] = ghost_op(a.cuda(), g.cuda());
          set_chunk_bytes_op(previous);
          const std::string at_budget = what + " budget " + std::to_string(budget);
          expect_within_margin(value, value_cpu, s_cpu, t, d_in, d_out, "value " + at_budget);
          expect_rel(s, s_cpu, 1e-12, "S " + at_budget);
          EXPECT_TRUE(at::equal(value, again)) << "repeat, " << at_budget;
          EXPECT_TRUE(at::equal(s, s_again)) << "repeat S, " << at_budget;
        }
      }
    }
    const int64_t pad = 1;
    const at::Tensor ids = at::randint(4, {3, t}, at::kLong);
    at::Tensor g = at::randn({3, t, 150}, at::kFloat);
    g.masked_fill_((ids == pad).unsqueeze(-1), std::numeric_limits<float>::quiet_NaN());
    const auto [tv_cpu, ts_cpu] = token_ghost_op(ids, g, pad);
    for (const int64_t budget : {int64_t{64} << 20, int64_t{1}}) {
      const int64_t previous = set_chunk_bytes_op(budget);
      const auto [tv, ts] = token_ghost_op(ids.cuda(), g.cuda(), pad);
      set_chunk_bytes_op(previous);
      const std::string what = "token T=" + std::to_string(t) + " budget " +
                               std::to_string(budget);
      ASSERT_TRUE(at::isfinite(tv).all().item<bool>()) << what;
      expect_within_margin(tv, tv_cpu, ts_cpu, t, 0, 150, "value " + what);
      expect_rel(ts, ts_cpu, 1e-12, "S " + what);
    }
  }
  // The paper rows' shape: at B = 32, T = 128, 768 -> 768 the grid of 96 tile pairs is split into
  // chunks wider than 64 features (160 where the device has 132 SMs), whose stages end off a
  // 64-feature boundary.
  const at::Tensor a = at::randn({32, 128, 768}, at::kFloat).to(at::kBFloat16);
  const at::Tensor g = at::randn({32, 128, 768}, at::kFloat).to(at::kBFloat16);
  const auto [value_cpu, s_cpu] = ghost_op(a, g);
  const auto [value, s] = ghost_op(a.cuda(), g.cuda());
  expect_within_margin(value, value_cpu, s_cpu, 128, 768, 768, "value B=32 T=128 768");
  expect_rel(s, s_cpu, 1e-12, "S B=32 T=128 768");
}

// The split tiles for layers sharing their input: nine layers (two launches of each phase: at
// most eight operands and eight layers a launch), one of width 0 (its row exactly 0), mixed
// dtypes, down to one sample a launch, against the CPU op row by row within the certified margin,
// and each row the single op's bits for that layer.
TEST(GhostPaths, CudaSplitTilesForSharedInputsMatchTheCpuKernel) {
  if (!split_tiles_run_here()) GTEST_SKIP() << kNoSplitTiles;
  const ForcedLengths forced(/*split_from=*/2, /*strips_from=*/kNever);
  at::manual_seed(18);
  const std::vector<int64_t> widths = {24, 7, 0, 64, 1, 33, 300, 16, 5};
  for (const int64_t t : {2, 17, 64, 130, 255}) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      const at::Tensor a = at::randn({3, t, 200}, at::kFloat).to(dtype);
      std::vector<at::Tensor> gs, gs_cuda;
      for (const int64_t w : widths) {
        gs.push_back(at::randn({3, t, w}, at::kFloat).to(dtype));
        gs_cuda.push_back(gs.back().cuda());
      }
      const auto [values_cpu, norms_cpu] = ghost_multi_op(a, gs);
      for (const int64_t budget : {int64_t{64} << 20, int64_t{1}}) {
        const int64_t previous = set_chunk_bytes_op(budget);
        const auto [values, norms] = ghost_multi_op(a.cuda(), gs_cuda);
        set_chunk_bytes_op(previous);
        ASSERT_EQ(values.sizes(), at::IntArrayRef({9, 3}));
        // Note [shared inputs]: the chunks do not depend on the other layers' widths.
        expect_shared_rows({values, norms}, {values_cpu, norms_cpu}, a.cuda(), gs_cuda, widths, t,
                           200, /*single_bits=*/true,
                           "T=" + std::to_string(t) + " " + c10::toString(dtype) + " budget " +
                               std::to_string(budget));
      }
    }
    const at::Tensor a = at::randn({3, t, 40}, at::kFloat);
    const at::Tensor g_bf16 = at::randn({3, t, 24}, at::kFloat).to(at::kBFloat16);
    const auto [values_cpu, norms_cpu] = ghost_multi_op(a, {g_bf16.to(at::kFloat)});
    const auto [values, norms] = ghost_multi_op(a.cuda(), {g_bf16.cuda()});
    expect_within_margin(values[0], values_cpu[0], norms_cpu[0], t, 40, 24,
                         "mixed dtypes T=" + std::to_string(t));
  }
}

}  // namespace
}  // namespace dpzero
