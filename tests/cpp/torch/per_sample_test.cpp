// Per-sample gradient ops from C++ (kernels/per_sample_ops.h; the full torch.func comparison lives
// in tests/python/test_kernels.py): for Linear layers the ghost norm and the direct path agree with
// each other and with explicitly instantiated per-sample gradients (float64), the automatic choice
// follows the cost rule, the clipped sum equals the sum of scaled per-sample gradients, norms are
// certified upper bounds even for cancelling inputs, the chunk budget can be overridden, and the
// ops run IEEE float32 matmuls whatever the global matmul precision, which they leave as found.
// Runs on CPU, and on CUDA too when a GPU and the CUDA kernels are present.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "kernels/per_sample_checks.h"
#include "kernels/per_sample_ops.h"
#include "tests/cpp/common/error_message.h"
#include "tests/cpp/torch/devices.h"

namespace dpzero {
namespace {

using testing::cuda_available;
using testing::devices;
using testing::kNoCuda;

at::Tensor linear_sq_norms(const at::Tensor& a, const at::Tensor& g, bool bias, int64_t method) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpzero::linear_sq_norms", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, bool, int64_t)>();
  return op.call(a, g, bias, method);
}

at::Tensor linear_clipped_sum(const at::Tensor& a, const at::Tensor& g, const at::Tensor& scale,
                              bool transposed) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpzero::linear_clipped_sum", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>();
  return op.call(a, g, scale, transposed);
}

int64_t set_chunk_bytes_op(int64_t bytes) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_set_chunk_bytes", "")
                             .typed<int64_t(int64_t)>();
  return op.call(bytes);
}

bool ghost_is_cheaper_op(int64_t t, int64_t d_in, int64_t d_out) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::ghost_is_cheaper", "")
                             .typed<bool(int64_t, int64_t, int64_t)>();
  return op.call(t, d_in, d_out);
}

// Per-sample weight gradients G_i^T A_i in float64: [B, d_out, d_in].
at::Tensor per_sample_grads(const at::Tensor& a, const at::Tensor& g) {
  const at::Tensor a3 = a.to(at::kCPU, at::kDouble).reshape({a.size(0), -1, a.size(-1)});
  const at::Tensor g3 = g.to(at::kCPU, at::kDouble).reshape({g.size(0), -1, g.size(-1)});
  return at::bmm(g3.transpose(1, 2), a3);
}

void expect_close(const at::Tensor& got, const at::Tensor& want, double rtol,
                  const std::string& what) {
  ASSERT_EQ(got.scalar_type(), at::kFloat) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const at::Tensor g = got.to(at::kCPU, at::kDouble);
  const double scale = want.abs().max().item<double>();
  const double err = (g - want).abs().max().item<double>();
  EXPECT_LE(err, rtol * scale) << what << ": max error " << err << " of " << scale;
}

struct Shape {
  std::vector<int64_t> lead;  // [B] or [B, T] or [B, T1, T2]
  int64_t d_in, d_out;
};

const std::vector<Shape> kShapes = {
    {{4, 6}, 5, 7},    {{1, 9}, 8, 3},    {{5}, 6, 4},     {{3, 1}, 7, 5},
    {{2, 3, 4}, 5, 6}, {{3, 70}, 45, 37}, {{2, 40}, 3, 2}, {{2, 33}, 64, 40},
};

std::vector<int64_t> with_last(std::vector<int64_t> lead, int64_t d) {
  lead.push_back(d);
  return lead;
}

// Note [clipped-sum rounding]: a Linear's certified squared norm is (||W_i|| + m S_i)^2, S_i =
// sum_t ||a_t|| ||g_t||, m = 2 ((1 + u)(1 + gamma_T) - 1), u = 2^-24; computed here from the
// Note's formula in float64 from the inputs.
at::Tensor with_clip_margin(const at::Tensor& sq, const at::Tensor& a, const at::Tensor& g) {
  const at::Tensor a3 = a.dim() == 2 ? a.unsqueeze(1) : a.flatten(1, -2);
  const at::Tensor g3 = g.dim() == 2 ? g.unsqueeze(1) : g.flatten(1, -2);
  const at::Tensor s = (at::linalg_vector_norm(a3.to(at::kCPU, at::kDouble), 2, {-1}) *
                        at::linalg_vector_norm(g3.to(at::kCPU, at::kDouble), 2, {-1}))
                           .sum(1);
  const double u = std::ldexp(1.0, -24), nu = static_cast<double>(a3.size(1)) * u;
  const double m = 2.0 * ((1.0 + u) * (1.0 + nu / (1.0 - nu)) - 1.0);
  return (sq.to(at::kCPU, at::kDouble).sqrt() + m * s).square();
}

TEST(PerSampleLinear, GhostEqualsDirectEqualsInstantiatedGradients) {
  at::manual_seed(7);
  for (const at::Device device : devices()) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      for (const Shape& s : kShapes) {
        const auto opts = at::TensorOptions().device(device).dtype(dtype);
        const at::Tensor a = at::randn(with_last(s.lead, s.d_in), opts);
        const at::Tensor g = at::randn(with_last(s.lead, s.d_out), opts);
        const at::Tensor want =
            with_clip_margin(per_sample_grads(a, g).square().sum({1, 2}), a, g);
        const std::string what = std::string(device.str()) + " " + c10::toString(dtype) + " " +
                                 c10::str(a.sizes()) + " x " + c10::str(g.sizes());
        const at::Tensor ghost = linear_sq_norms(a, g, false, 1);
        const at::Tensor direct = linear_sq_norms(a, g, false, 2);
        expect_close(ghost, want, 2e-5, "ghost " + what);
        expect_close(direct, want, 2e-5, "direct " + what);
        expect_close(ghost, direct.to(at::kDouble).cpu(), 2e-5, "ghost vs direct " + what);
      }
    }
  }
}

TEST(PerSampleLinear, AutoFollowsTheCostRule) {
  EXPECT_TRUE(kernels::ghost_is_cheaper(24, 32, 36));  // 2 * 576 = 1152 <= 1152
  EXPECT_FALSE(kernels::ghost_is_cheaper(25, 32, 36));
  EXPECT_TRUE(ghost_is_cheaper_op(512, 768, 3072));
  EXPECT_FALSE(ghost_is_cheaper_op(2048, 768, 3072));
  EXPECT_FALSE(ghost_is_cheaper_op(int64_t{1} << 40, int64_t{1} << 40, int64_t{1} << 40));
  EXPECT_THROW(ghost_is_cheaper_op(-1, 2, 2), c10::Error);
  at::manual_seed(8);
  for (const at::Device device : devices()) {
    for (const Shape& s : kShapes) {
      const auto opts = at::TensorOptions().device(device);
      const at::Tensor a = at::randn(with_last(s.lead, s.d_in), opts);
      const at::Tensor g = at::randn(with_last(s.lead, s.d_out), opts);
      int64_t t = 1;
      for (size_t k = 1; k < s.lead.size(); ++k) t *= s.lead[k];
      const int64_t expected = kernels::ghost_is_cheaper(t, s.d_in, s.d_out) ? 1 : 2;
      // The paths sum in different orders; auto is bit-identical to the one the rule names.
      EXPECT_TRUE(
          at::equal(linear_sq_norms(a, g, false, 0), linear_sq_norms(a, g, false, expected)))
          << device << " T=" << t << " d_in=" << s.d_in << " d_out=" << s.d_out;
    }
  }
}

TEST(PerSampleLinear, ClippedSumIsTheScaledSumOfPerSampleGradients) {
  at::manual_seed(9);
  for (const at::Device device : devices()) {
    for (const Shape& s : kShapes) {
      const auto opts = at::TensorOptions().device(device);
      const at::Tensor a = at::randn(with_last(s.lead, s.d_in), opts);
      const at::Tensor g = at::randn(with_last(s.lead, s.d_out), opts);
      at::Tensor scale = at::rand({s.lead[0]}, opts);
      if (s.lead[0] > 1) scale[0] = 0.0;
      const at::Tensor want =
          (per_sample_grads(a, g) * scale.to(at::kCPU, at::kDouble).view({-1, 1, 1})).sum(0);
      expect_close(linear_clipped_sum(a, g, scale, false), want, 2e-5, "linear");
      expect_close(linear_clipped_sum(a, g, scale, true), want.t().contiguous(), 2e-5, "conv1d");
    }
  }
}

TEST(PerSampleLinear, EmptyMicroBatch) {
  for (const at::Device device : devices()) {
    const auto opts = at::TensorOptions().device(device);
    for (int64_t method : {0, 1, 2}) {
      const at::Tensor sq =
          linear_sq_norms(at::zeros({0, 4, 3}, opts), at::zeros({0, 4, 5}, opts), true, method);
      EXPECT_EQ(sq.numel(), 0);
      EXPECT_EQ(sq.scalar_type(), at::kFloat);
    }
    const at::Tensor sum = linear_clipped_sum(
        at::zeros({0, 4, 3}, opts), at::zeros({0, 4, 5}, opts), at::zeros({0}, opts), false);
    EXPECT_TRUE(at::equal(sum, at::zeros({5, 3}, opts)));
  }
}

TEST(PerSampleLinear, RejectsBadMethodNamingIt) {
  try {
    linear_sq_norms(at::zeros({2, 3}), at::zeros({2, 4}), false, 7);
    FAIL() << "method 7 accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("got 7"), std::string::npos) << e.what();
  }
}

// Every row of a sample is one shared row a; g_t = sign_t * (a shared row) + 5e-4 noise with as
// many +1 as -1 signs: the per-sample gradient is ~10^4 times smaller than sum_t ||a_t|| ||g_t||.
// In float32 the ghost norm of such a sample was off by up to 3x in either direction.
TEST(PerSampleLinear, NormsAreCertifiedUpperBoundsUnderCancellation) {
  at::manual_seed(10);
  const int64_t b = 4, t = 128, d = 256;
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor a64 = at::randn({b, 1, d}, f64).expand({b, t, d});
  at::Tensor signs = at::ones({b, t, 1}, f64);
  signs.slice(1, t / 2, t).fill_(-1.0);
  signs = signs.index_select(1, at::randperm(t));
  const at::Tensor g64 = signs * at::randn({b, 1, d}, f64) + 5e-4 * at::randn({b, t, d}, f64);
  for (const at::Device device : devices()) {
    const at::Tensor a = a64.to(device, at::kFloat), g = g64.to(device, at::kFloat);
    const at::Tensor want = per_sample_grads(a, g).square().sum({1, 2}).to(at::kCPU);
    const at::Tensor bound = with_clip_margin(want, a, g);  // Note [clipped-sum rounding]
    for (int64_t method : {1, 2}) {
      const at::Tensor got = linear_sq_norms(a, g, false, method).to(at::kCPU, at::kDouble);
      EXPECT_TRUE(at::all(got >= want).item<bool>())
          << device << " method " << method << ": " << (got / want);
      EXPECT_TRUE(at::all(got <= bound * 1.01).item<bool>())
          << device << " method " << method << ": " << (got / bound);
    }
  }
}

TEST(PerSampleChunks, BudgetOverrideSetsChunkSizes) {
  const int64_t prev = set_chunk_bytes_op(100);
  EXPECT_EQ(prev, kernels::kChunkBytes);
  EXPECT_EQ(kernels::samples_per_chunk(7, 30), 3);  // 7 = 3 + 3 + 1
  EXPECT_EQ(kernels::samples_per_chunk(7, 200), 1);
  EXPECT_EQ(kernels::samples_per_chunk(2, 30), 2);
  EXPECT_EQ(kernels::samples_per_chunk(7, 30, /*device=*/true), 3);  // a test's budget holds
  EXPECT_EQ(set_chunk_bytes_op(prev), 100);
  EXPECT_EQ(kernels::samples_per_chunk(7, 30), 7);
  // The default budget: 64 MiB on the host, 1 GiB for a device's per-sample products.
  EXPECT_EQ(kernels::samples_per_chunk(100, int64_t{16} << 20), 4);
  EXPECT_EQ(kernels::samples_per_chunk(100, int64_t{16} << 20, /*device=*/true), 64);
  EXPECT_THROW(set_chunk_bytes_op(0), c10::Error);
}

// The matmul precision settings as at::Context reports them.
std::vector<int> matmul_precision_state() {
  const at::Context& ctx = at::globalContext();
  const auto matmul = [&](at::Float32Backend backend) {
    return static_cast<int>(ctx.float32Precision(backend, at::Float32Op::MATMUL));
  };
  return {static_cast<int>(ctx.float32MatmulPrecision()), matmul(at::Float32Backend::CUDA),
          matmul(at::Float32Backend::MKLDNN)};
}

void reset_matmul_precision() {
  at::Context& ctx = at::globalContext();
  ctx.setFloat32MatmulPrecision("highest");
  ctx.setFloat32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL,
                          at::Float32Precision::NONE);
  ctx.setFloat32Precision(at::Float32Backend::MKLDNN, at::Float32Op::MATMUL,
                          at::Float32Precision::NONE);
}

// "high" makes cuBLAS round float32 matmul operands to TF32, "medium" also lets oneDNN run CPU
// float32 matmuls in bf16: either would move the clipped sum by ~1e-3. The ops switch to IEEE for
// their duration and restore the setting.
TEST(PerSampleLinear, ClippedSumRunsIeeeFp32AndRestoresThePrecisionSetting) {
  at::manual_seed(11);
  for (const at::Device device : devices()) {
    const auto opts = at::TensorOptions().device(device);
    const at::Tensor a = at::randn({8, 64, 96}, opts), g = at::randn({8, 64, 80}, opts);
    const at::Tensor scale = at::rand({8}, opts);
    const at::Tensor want =
        (per_sample_grads(a, g) * scale.to(at::kCPU, at::kDouble).view({-1, 1, 1})).sum(0);
    reset_matmul_precision();
    const at::Tensor ieee = linear_clipped_sum(a, g, scale, false);
    for (const char* precision : {"high", "medium"}) {
      at::globalContext().setFloat32MatmulPrecision(precision);
      const std::vector<int> before = matmul_precision_state();
      const at::Tensor got = linear_clipped_sum(a, g, scale, false);
      EXPECT_EQ(matmul_precision_state(), before) << device << " " << precision;
      reset_matmul_precision();
      expect_close(got, want, 2e-5, std::string(device.str()) + " " + precision);
      if (device.is_cpu()) {
        EXPECT_TRUE(at::equal(got, ieee)) << precision;
      }
    }
  }
}

// The generic dpzero::_embedding_rows (CUDA's past one block's sort) and the CPU kernel give the same
// q and S to float64 rounding, whatever the chunking of the generic loop (down to one sample per
// chunk), with repeated ids, samples of padding only, T = 1, and NaN in padding tokens' rows.
TEST(PerSampleEmbedding, GenericRowsMatchTheCpuKernel) {
  at::manual_seed(7);
  struct Case {
    int64_t b, t, v, d, pad;
  };
  for (const Case c : {Case{5, 9, 4, 6, 0}, Case{3, 1, 5, 3, -1}, Case{2, 40, 50, 7, 3},
                       Case{6, 12, 3, 5, 2}}) {
    at::Tensor ids = at::randint(c.v, {c.b, c.t}, at::kLong);
    at::Tensor g = at::randn({c.b, c.t, c.d}, at::kFloat);
    if (c.pad >= 0) {
      ids[0].fill_(c.pad);  // a sample of padding only: q = S = 0
      g.masked_fill_((ids == c.pad).unsqueeze(-1), std::numeric_limits<float>::quiet_NaN());
    }
    const auto [q_cpu, s_cpu] = kernels::per_sample::embedding_rows(ids, g, c.v, c.pad);
    ASSERT_TRUE(at::isfinite(q_cpu).all().item<bool>() && at::isfinite(s_cpu).all().item<bool>());
    for (const int64_t budget : {int64_t{64} << 20, int64_t{1}}) {
      const int64_t previous = set_chunk_bytes_op(budget);
      const auto [q, s] = kernels::per_sample::embedding_rows_generic(ids, g, c.v, c.pad);
      set_chunk_bytes_op(previous);
      EXPECT_TRUE(at::allclose(q, q_cpu, 1e-13, 0.0)) << "b=" << c.b << " t=" << c.t << " budget="
                                                     << budget << "\n" << q << q_cpu;
      EXPECT_TRUE(at::allclose(s, s_cpu, 1e-13, 0.0)) << "b=" << c.b << " t=" << c.t << " budget="
                                                     << budget << "\n" << s << s_cpu;
    }
    if (c.pad >= 0) {
      EXPECT_EQ(q_cpu[0].item<double>(), 0.0);
      EXPECT_EQ(s_cpu[0].item<double>(), 0.0);
    }
  }
}

// The CUDA row kernels (kernels/cuda/row_sums.cu) against the CPU kernels, an independent
// implementation: the same sums and S to float64 rounding (the orders of the row statistics' and
// squares' reductions differ, and CUDA fuses multiply-adds), for biases, LayerNorm and RMSNorm
// rows and embedding rows; shapes past one tile of columns, one flush of rows and one warp of
// samples, the largest sort (T = 2048); 16-bit and non-contiguous inputs; padding-only samples and
// NaN in padding rows (never read); T past one block's sort (the generic version). A second run
// repeats the first bit for bit (no atomics; the generic version's index_add_ has them).
TEST(PerSampleRows, CudaKernelsMatchTheCpuKernels) {
  if (!cuda_available()) GTEST_SKIP() << kNoCuda;
  namespace ps = kernels::per_sample;
  at::manual_seed(13);
  auto close = [](const at::Tensor& cuda, const at::Tensor& cpu) {
    return at::allclose(cuda.cpu(), cpu, 1e-12, 1e-300);
  };
  // A column sum may cancel; S_i bounds each of sample i's |entries| sums, so it scales the
  // tolerance of the sums.
  auto close_sums = [](const at::Tensor& cuda, const at::Tensor& cpu, const at::Tensor& s) {
    return (cuda.cpu() - cpu).abs().le(1e-12 * s.unsqueeze(1)).all().item<bool>();
  };
  struct Shape {
    int64_t b, t, d;
  };
  for (const Shape c : {Shape{3, 1, 5}, Shape{2, 40, 300}, Shape{33, 7, 256}, Shape{4, 65, 513},
                        Shape{2, 0, 5}, Shape{2, 3, 0}}) {
    for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const at::Tensor x = at::randn({c.b, c.t, c.d}).to(dtype);
      const at::Tensor g = at::randn({c.b, c.t, c.d}).to(dtype);
      const auto [sums, s] = ps::row_sums(g);
      const auto [sums_c, s_c] = ps::row_sums(g.cuda());
      EXPECT_TRUE(close_sums(sums_c, sums, s) && close(s_c, s))
          << "row sums " << c.b << "x" << c.t << "x" << c.d << " " << dtype;
      const auto [again, s_again] = ps::row_sums(g.cuda());
      EXPECT_TRUE(at::equal(again, sums_c) && at::equal(s_again, s_c));
      for (const bool rms : {false, true}) {
        const auto [nsums, ns] = ps::norm_row_sums(x, g, 1e-5, rms);
        const auto [nsums_c, ns_c] = ps::norm_row_sums(x.cuda(), g.cuda(), 1e-5, rms);
        EXPECT_TRUE(close_sums(nsums_c, nsums, ns) && close(ns_c, ns))
            << "norm rows rms=" << rms << " " << c.b << "x" << c.t << "x" << c.d << " " << dtype;
      }
    }
  }
  // A float32 activation with a bfloat16 gradient (both read as float32), and transposed
  // (non-contiguous) inputs.
  const at::Tensor x = at::randn({2, 9, 17}), g = at::randn({2, 9, 17}).to(at::kBFloat16);
  const auto [msums, ms] = ps::norm_row_sums(x, g, 1e-5, false);
  const auto [msums_c, ms_c] = ps::norm_row_sums(x.cuda(), g.cuda(), 1e-5, false);
  EXPECT_TRUE(close_sums(msums_c, msums, ms) && close(ms_c, ms));
  const at::Tensor gt = at::randn({2, 17, 9}).transpose(1, 2);
  const auto [tsums, ts] = ps::row_sums(gt);
  const auto [tsums_c, ts_c] = ps::row_sums(gt.cuda());
  EXPECT_TRUE(close_sums(tsums_c, tsums, ts) && close(ts_c, ts));
  struct Emb {
    int64_t b, t, v, d, pad;
  };
  for (const Emb c : {Emb{5, 9, 4, 6, 0}, Emb{3, 1, 5, 3, -1}, Emb{2, 40, 50, 300, 3},
                      Emb{40, 33, 3, 5, 2}, Emb{2, 2048, 37, 5, 4}, Emb{2, 2100, 37, 5, 4}}) {
    at::Tensor ids = at::randint(c.v, {c.b, c.t}, at::kLong);
    at::Tensor g = at::randn({c.b, c.t, c.d}, at::kFloat);
    if (c.pad >= 0) {
      ids[0].fill_(c.pad);  // a sample of padding only: q = S = 0
      g.masked_fill_((ids == c.pad).unsqueeze(-1), std::numeric_limits<float>::quiet_NaN());
    }
    const auto [q, s] = ps::embedding_rows(ids, g, c.v, c.pad);
    const auto [q_c, s_c] = ps::embedding_rows(ids.cuda(), g.cuda(), c.v, c.pad);
    EXPECT_TRUE(close(q_c, q) && close(s_c, s)) << "embedding rows b=" << c.b << " t=" << c.t
                                                << "\n" << q_c << q;
    // No atomics at any length (past 2048 tokens the sort is ATen's, the passes the same).
    const auto [q_again, s_again] = ps::embedding_rows(ids.cuda(), g.cuda(), c.v, c.pad);
    EXPECT_TRUE(at::equal(q_again, q_c) && at::equal(s_again, s_c)) << "b=" << c.b << " t=" << c.t;
  }
}

// dpzero::_certify (kernels/certify.h) on every device against ATen compositions of the same
// roundings written here (torch's nextafter and casts, an independent implementation): the same
// floats for every step but kRows, and for kRows (the sums of squares reduced in another order) a
// value at least the exact one (long double) and within a few ulps of the composition's. NaN, inf,
// values past float32's range, 0 and negatives included. Mutations tried: up() without its ulp
// step; f32_up rounding to nearest; the ghost margin without its factor 2.
TEST(PerSampleCertification, EveryStepMatchesItsAtenComposition) {
  namespace ps = kernels::per_sample;
  using Step = kernels::certify::Step;
  at::manual_seed(11);
  const double inf = std::numeric_limits<double>::infinity();
  const auto up = [&](const at::Tensor& v) {  // one ulp toward +inf where positive
    return at::where(v > 0, at::nextafter(v, at::full({}, inf, v.options())), v);
  };
  const auto f32_up = [&](const at::Tensor& v) {
    const at::Tensor f = v.to(at::kFloat);
    return at::where(f.to(at::kDouble) < v,
                     at::nextafter(f, at::full({}, float(inf), f.options())), f);
  };
  const auto f32_down = [&](const at::Tensor& v) {
    const at::Tensor f = v.to(at::kFloat);
    return at::where(f.to(at::kDouble) > v, at::nextafter(f, at::zeros({}, f.options())), f);
  };
  // IEEE sqrt, correctly rounded, element by element: torch's vectorized float64 sqrt on the CPU
  // can be an ulp off, which the bounds of Note [certified norms] do not allow.
  const auto sqrt = [](const at::Tensor& v) {
    at::Tensor out = v.contiguous().clone();
    double* p = out.data_ptr<double>();
    for (int64_t i = 0; i < out.numel(); ++i) p[i] = std::sqrt(p[i]);
    return out;
  };
  const auto same = [](const at::Tensor& got, const at::Tensor& want) {
    return at::allclose(got.cpu(), want, 0.0, 0.0, /*equal_nan=*/true);
  };
  at::Tensor x = at::randn({64}, at::kDouble) * 1e3;
  x[0] = std::numeric_limits<double>::quiet_NaN();
  x[1] = inf;
  x[2] = 1e300;  // above float32's range: +inf
  x[3] = 0.0;
  x[4] = -2.5;
  const at::Tensor pos = x.abs();
  const at::Tensor ghost = at::randn({64}, at::kDouble), s = at::rand({64}, at::kDouble);
  const at::Tensor q = at::rand({64}, at::kDouble) * 1e4;
  const at::Tensor f = at::rand({64}, at::kFloat);
  const at::Tensor parts = at::rand({3, 64}, at::kFloat) * 1e5;
  const double c = 3e-14, k = 7e-13;
  for (const at::Device device : devices()) {
    const auto on = [&](const at::Tensor& t) { return t.to(device); };
    const auto run = [&](const at::Tensor& v, const c10::optional<at::Tensor>& sv, double coef,
                         Step step, bool f32 = false) {
      return ps::certify_op(on(v), sv ? c10::optional<at::Tensor>(on(*sv)) : c10::nullopt, coef,
                            step, f32);
    };
    const std::string where = device.str();
    EXPECT_TRUE(same(run(x, {}, 0, Step::kRoundUp), f32_up(x))) << where;
    EXPECT_TRUE(same(run(pos, {}, 0, Step::kRoundDown), f32_down(pos))) << where;
    EXPECT_TRUE(same(run(ghost, s, 2 * c, Step::kGhost), up(at::clamp_min(ghost, 0) + s * s * (2 * c))))
        << where;
    EXPECT_TRUE(same(run(ghost, s, 2 * c, Step::kGhost, true),
                     f32_up(up(at::clamp_min(ghost, 0) + s * s * (2 * c))))) << where;
    const at::Tensor z = up(up(sqrt(q)) + s * k);
    EXPECT_TRUE(same(run(q, s, k, Step::kDirect), up(z * z))) << where;
    EXPECT_TRUE(same(run(q, s, 0, Step::kAdd), up(q + s))) << where;
    EXPECT_TRUE(same(run(pos, {}, 0, Step::kNorm), f32_up(up(sqrt(pos))))) << where;
    EXPECT_TRUE(same(run(f, {}, 49.0, Step::kScaleUp),
                     f32_up(f.to(at::kDouble) * 49.0 * (1.0 + 1e-15)))) << where;
    EXPECT_TRUE(same(run(f, {}, 13.0, Step::kScaleDown), f32_down(f.to(at::kDouble) * 13.0)))
        << where;
    const at::Tensor p64 = parts.to(at::kDouble);
    EXPECT_TRUE(same(run(parts, {}, 0, Step::kSumUp),
                     f32_up((p64[0] + p64[1] + p64[2]) * (1.0 + 1e-15)))) << where;
    // `rest`, a second certified float32 squared norm: added to the float32 result as kSumUp
    // adds two parts, so a call with rest is the call without it and certified_sum after.
    const at::Tensor rest = at::rand({64}, at::kFloat) * 1e3, rest64 = rest.to(at::kDouble);
    for (const Step step : {Step::kGhost, Step::kDirect, Step::kRoundUp}) {
      const bool certifies = step != Step::kRoundUp;
      const at::Tensor& v = step == Step::kGhost ? ghost : step == Step::kDirect ? q : x;
      const double coef = step == Step::kGhost ? 2 * c : step == Step::kDirect ? k : 0.0;
      const c10::optional<at::Tensor> sv =
          certifies ? c10::optional<at::Tensor>(s) : c10::nullopt;
      const at::Tensor alone = run(v, sv, coef, step, certifies);
      const at::Tensor with_rest =
          ps::certify_op(on(v), certifies ? c10::optional<at::Tensor>(on(s)) : c10::nullopt, coef,
                         step, certifies, 0.0, on(rest));
      EXPECT_TRUE(same(with_rest, f32_up((alone.cpu().to(at::kDouble) + rest64) * (1.0 + 1e-15))))
          << where << " step " << static_cast<int>(step);
      EXPECT_TRUE(same(with_rest, run(at::stack({alone.cpu(), rest}), {}, 0, Step::kSumUp).cpu()))
          << where << " step " << static_cast<int>(step);
    }
    EXPECT_THROW(ps::certify_op(on(x), c10::nullopt, 0.0, Step::kRoundDown, false, 0.0, on(rest)),
                 c10::Error) << where;
    const at::Tensor grads = at::randn({16, 300}, at::kDouble), sums = at::rand({16}, at::kDouble);
    const at::Tensor rows = run(grads, sums, k, Step::kRows).cpu();
    const at::Tensor zr = up(up(sqrt(grads.square().sum(1))) + sums * k);
    EXPECT_TRUE(at::allclose(rows, up(zr * zr), 1e-14, 0.0)) << where << rows - up(zr * zr);
    for (int64_t i = 0; i < 16; ++i) {
      long double exact = 0.0L;
      for (int64_t j = 0; j < 300; ++j) {
        const long double v = grads[i][j].item<double>();
        exact += v * v;
      }
      EXPECT_GE(static_cast<long double>(rows[i].item<double>()), exact) << where << " row " << i;
    }
    // rest_rows: a bias's kept rows certified in the same pass, as a kRows call with f32 on the
    // CPU (row order) then added as rest; on every device, for every step that takes a rest.
    const at::Tensor bias = at::randn({64, 7}, at::kDouble) * 30, bias_s = at::rand({64}) * 300;
    const ps::KeptRest kept{on(bias), on(bias_s.to(at::kDouble)), 3e-9};
    const at::Tensor bias_sq = ps::certify_op(bias, bias_s.to(at::kDouble), 3e-9, Step::kRows,
                                              true);  // the CPU's bits, its rows in order
    for (const Step step : {Step::kGhost, Step::kDirect, Step::kRoundUp}) {
      const bool certifies = step != Step::kRoundUp;
      const at::Tensor& v = step == Step::kGhost ? ghost : step == Step::kDirect ? q : x;
      const double coef = step == Step::kGhost ? 2 * c : step == Step::kDirect ? k : 0.0;
      const c10::optional<at::Tensor> sv =
          certifies ? c10::optional<at::Tensor>(on(s)) : c10::nullopt;
      const at::Tensor with_rows =
          ps::certify_op(on(v), sv, coef, step, certifies, 0.0, c10::nullopt, kept);
      const at::Tensor with_rest = ps::certify_op(on(v), sv, coef, step, certifies, 0.0,
                                                  on(bias_sq));
      EXPECT_TRUE(same(with_rows, with_rest.cpu())) << where << " step " << static_cast<int>(step);
    }
    EXPECT_THROW(ps::certify_op(on(x), c10::nullopt, 0.0, Step::kRoundUp, false, 0.0,
                                on(bias_sq), kept),
                 c10::Error) << where;  // one rest or the other
    // Rows of no entries still add their S's bound (their null data pointer once made the call
    // drop them); rest_rows needs a result of one value per sample (a [2, 3] value read rows past
    // the end); rest_s and rest_coef need rest_rows.
    const at::Tensor empty_rows = at::zeros({64, 0}, at::kDouble);
    const ps::KeptRest empty_kept{on(empty_rows), on(bias_s.to(at::kDouble)), 3e-9};
    const at::Tensor empty_sq =
        ps::certify_op(empty_rows, bias_s.to(at::kDouble), 3e-9, Step::kRows, true);
    ASSERT_TRUE(empty_sq.gt(0).all().item<bool>());
    EXPECT_TRUE(same(ps::certify_op(on(x), c10::nullopt, 0.0, Step::kRoundUp, false, 0.0,
                                    c10::nullopt, empty_kept),
                     ps::certify_op(on(x), c10::nullopt, 0.0, Step::kRoundUp, false, 0.0,
                                    on(empty_sq)).cpu()))
        << where;
    const ps::KeptRest two_rows{on(at::ones({2, 1}, at::kDouble)), on(at::ones({2, 3},
                                at::kDouble)), 0.0};
    const std::string wide = testing::error_message<c10::Error>([&] {
      ps::certify_op(on(at::ones({2, 3}, at::kDouble)), c10::nullopt, 0.0, Step::kRoundUp, false,
                     0.0, c10::nullopt, two_rows);
    });
    EXPECT_TRUE(testing::contains(wide, "got value of shape [2, 3]")) << wide;
    using Signature = at::Tensor(const at::Tensor&, const c10::optional<at::Tensor>&, double,
                                 int64_t, bool, double, const c10::optional<at::Tensor>&,
                                 const c10::optional<at::Tensor>&,
                                 const c10::optional<at::Tensor>&, double);
    const auto certify = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_certify", "")
                             .typed<Signature>();
    const std::string alone = testing::error_message<c10::Error>([&] {
      certify.call(on(x), c10::nullopt, 0.0, static_cast<int64_t>(Step::kRoundUp), false, 0.0,
                   c10::nullopt, c10::nullopt, on(s), 0.5);
    });
    EXPECT_TRUE(testing::contains(alone, "go with rest_rows, which was not given (rest_coef 0.5)"))
        << alone;
    // kRows with f32 takes rest as the other steps do (a norm layer's weight, its bias's norm).
    const at::Tensor rows_f32 = run(grads, sums, k, Step::kRows, true);
    const at::Tensor rows_rest = ps::certify_op(on(grads), on(sums), k, Step::kRows, true, 0.0,
                                                on(rest.slice(0, 0, 16)));
    EXPECT_TRUE(same(rows_rest, run(at::stack({rows_f32.cpu(), rest.slice(0, 0, 16)}), {}, 0,
                                    Step::kSumUp).cpu()))
        << where;
  }
}

// dpzero::_scale_rows on every device: row i times its factor, or as it is, and zeros (not NaN)
// for a factor of 0 or NaN/inf, float32 and float64, non-contiguous x. Reference: a loop over rows.
TEST(PerSampleClippedSum, ScaleRowsScalesKeptRowsAndZerosDroppedOnes) {
  namespace ps = kernels::per_sample;
  at::manual_seed(14);
  const at::Tensor scale = at::tensor({0.5f, 0.0f, 2.0f, std::numeric_limits<float>::quiet_NaN(),
                                       std::numeric_limits<float>::infinity(), 1.0f});
  for (const at::Device device : devices()) {
    for (const auto dtype : {at::kFloat, at::kDouble}) {
      at::Tensor x = at::randn({6, 5, 4}, dtype).transpose(1, 2);  // non-contiguous
      x[1][0][0] = std::numeric_limits<double>::quiet_NaN();
      x[3][2][1] = std::numeric_limits<double>::infinity();
      for (const bool multiply : {true, false}) {
        const at::Tensor got = ps::scale_rows(x.to(device), scale.to(device), multiply).cpu();
        ASSERT_EQ(got.scalar_type(), dtype);
        for (int64_t i = 0; i < 6; ++i) {
          const float c = scale[i].item<float>();
          const at::Tensor want = !std::isfinite(c) || c == 0.0f ? at::zeros_like(x[i])
                                  : multiply ? x[i] * at::scalar_tensor(c, dtype) : x[i];
          EXPECT_TRUE(got[i].equal(want)) << device << " " << dtype << " row " << i;
        }
      }
    }
  }
}

// Note [accumulating clipped sums]: adding kept per-sample rows into a parameter's slot in place
// gives the slot exactly what adding per_sample_clipped_sum's result would (the same float32
// addition of the same float64-summed values), drops the samples whose factor is zero or
// non-finite (their NaN rows are never read), and leaves the rest of the buffer alone.
TEST(PerSampleClippedSum, InPlaceAddIntoASlotIsTheOutOfPlaceSumAdded) {
  namespace ps = kernels::per_sample;
  at::manual_seed(12);
  const at::Tensor grads = at::randn({5, 3, 7}, at::kDouble);
  grads[1][2][3] = std::numeric_limits<double>::quiet_NaN();
  grads[3][0][0] = std::numeric_limits<double>::infinity();
  const at::Tensor scale = at::tensor({0.5f, 0.0f, 0.25f, std::numeric_limits<float>::quiet_NaN(),
                                       1.0f});
  const at::Tensor buffer = at::randn({40}, at::kFloat);
  const at::Tensor before = buffer.clone();
  at::Tensor slot = buffer.as_strided({3, 7}, {7, 1}, 10);  // as the book views its slots
  const at::Tensor want = buffer.clone();
  want.narrow(0, 10, 21).add_(ps::per_sample_clipped_sum(grads, scale).view({21}));
  ps::add_per_sample_clipped_sum_(slot, grads, scale);
  EXPECT_TRUE(buffer.equal(want)) << buffer - want;
  // From scratch: samples 0, 2 and 4 only, summed in float64.
  const at::Tensor sum = grads[0] * 0.5 + grads[2] * 0.25 + grads[4];
  const at::Tensor added = (buffer - before).narrow(0, 10, 21).view({3, 7}).to(at::kDouble);
  EXPECT_TRUE(at::allclose(added, sum, 1e-5, 1e-5)) << added - sum;
  EXPECT_TRUE(buffer.narrow(0, 0, 10).equal(before.narrow(0, 0, 10)));
  EXPECT_TRUE(buffer.narrow(0, 31, 9).equal(before.narrow(0, 31, 9)));
  // The other paths: a strided destination and float32 rows (ATen's sum and add_), an inf and a
  // -0 factor; and a destination of the wrong size or dtype is refused, naming it.
  const at::Tensor rows32 = grads.to(at::kFloat);
  const at::Tensor scale2 = at::tensor({0.5f, -0.0f, 0.25f, std::numeric_limits<float>::infinity(),
                                        1.0f});
  at::Tensor wide = at::zeros({21, 2}, at::kFloat);
  at::Tensor strided = wide.select(1, 0).view({3, 7});
  ps::add_per_sample_clipped_sum_(strided, rows32, scale2);
  const at::Tensor got = wide.select(1, 0).view({3, 7}).to(at::kDouble);
  EXPECT_TRUE(at::allclose(got, sum, 1e-5, 1e-5)) << got - sum;
  EXPECT_TRUE(wide.select(1, 1).eq(0).all().item<bool>());
  at::Tensor small = at::zeros({20}, at::kFloat), doubles = at::zeros({21}, at::kDouble);
  EXPECT_THROW(ps::add_per_sample_clipped_sum_(small, grads, scale), c10::Error);
  EXPECT_THROW(ps::add_per_sample_clipped_sum_(doubles, grads, scale), c10::Error);
}

// dpzero::add_per_sample_clipped_sum_ on every device against a reference written out here: the
// float64 sum of c_i g_ij over the kept samples, chunk by chunk of 32 samples and then over the
// chunks (Note [kept sums in chunks]), one float32 addition into self; a dropped sample (factor 0,
// -0, NaN, Inf) is not read, so its NaN / Inf rows change nothing. The same bits on the CPU and on
// CUDA. One chunk and three (the last one short), float64 and float32 rows, a strided self, B = 0,
// and the argument errors naming the bad value.
TEST(PerSampleClippedSum, TheOpAddsTheFloat64SumOfKeptRowsOnEveryDevice) {
  const auto op = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("dpzero::add_per_sample_clipped_sum_", "")
                      .typed<at::Tensor&(at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  at::manual_seed(41);
  const int64_t d = 5000;  // over one CPU task and many CUDA blocks
  for (const int64_t b : {int64_t{7}, int64_t{75}}) {
    const at::Tensor rows = at::randn({b, 2, d / 2}, at::kDouble) * 3;
    rows[1][0][3] = std::numeric_limits<double>::quiet_NaN();
    rows[4][1][7] = std::numeric_limits<double>::infinity();
    at::Tensor scale = at::rand({b}, at::kFloat);
    scale[1] = 0.0f;
    scale[4] = nan;
    scale[5] = -0.0f;
    scale[6] = inf;
    const at::Tensor self0 = at::randn({2, d / 2}, at::kFloat);
    for (const at::ScalarType dtype : {at::kDouble, at::kFloat}) {
      const at::Tensor g = rows.to(dtype).to(at::kDouble).contiguous();  // the values read
      at::Tensor want = self0.clone();
      const double* pg = g.data_ptr<double>();
      const float* pc = scale.data_ptr<float>();
      float* pw = want.data_ptr<float>();
      for (int64_t j = 0; j < d; ++j) {
        double total = 0.0;
        for (int64_t i0 = 0; i0 < b; i0 += 32) {
          double part = 0.0;
          for (int64_t i = i0; i < std::min(b, i0 + 32); ++i) {
            if (!std::isfinite(pc[i]) || pc[i] == 0.0f) continue;
            const volatile double term = static_cast<double>(pc[i]) * pg[i * d + j];
            part += term;
          }
          total += part;
        }
        pw[j] = pw[j] + static_cast<float>(total);
      }
      for (const at::Device device : devices()) {
        at::Tensor self = self0.to(device, /*non_blocking=*/false, /*copy=*/true);
        op.call(self, rows.to(dtype).to(device), scale.to(device));
        EXPECT_TRUE(self.cpu().equal(want)) << device << " " << dtype << " B = " << b << " "
                                            << (self.cpu() - want).abs().max();
        // A strided self: every other entry of a wider buffer, the rest untouched.
        at::Tensor wide = at::zeros({d, 2}, at::TensorOptions(device).dtype(at::kFloat));
        wide.select(1, 0).copy_(self0.view({d}));
        at::Tensor strided = wide.select(1, 0);
        op.call(strided, rows.to(dtype).to(device), scale.to(device));
        EXPECT_TRUE(wide.select(1, 0).cpu().equal(want.view({d}))) << device << " " << dtype;
        EXPECT_TRUE(wide.select(1, 1).eq(0).all().item<bool>()) << device;
      }
    }
  }
  for (const at::Device device : devices()) {
    const auto on = at::TensorOptions(device);
    at::Tensor self0 = at::randn({7}, at::kFloat);
    self0[0] = -0.0f;
    // B = 0 adds +0.0 to every entry (a -0 becomes +0 on every device: the same bits), and the
    // write moves self's version counter, as any in-place op's does.
    at::Tensor same = self0.to(device, /*non_blocking=*/false, /*copy=*/true);
    const auto version = same._version();
    op.call(same, at::zeros({0, 7}, on.dtype(at::kDouble)), at::zeros({0}, on.dtype(at::kFloat)));
    EXPECT_GT(same._version(), version) << device;
    EXPECT_TRUE(same.cpu().view(at::kInt).equal((self0 + 0.0f).view(at::kInt))) << device;
    // Errors name the bad value; self may not share memory with the rows.
    const at::Tensor rows = at::randn({3, 7}, on.dtype(at::kFloat));
    const at::Tensor scale = at::ones({3}, on.dtype(at::kFloat));
    at::Tensor small = at::zeros({6}, on.dtype(at::kFloat));
    try {
      op.call(small, rows, scale);
      ADD_FAILURE() << "a short accumulator was accepted on " << device;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("float32 with 7 elements"),
                std::string::npos) << e.what_without_backtrace();
    }
    at::Tensor inside = rows[0];
    EXPECT_THROW(op.call(inside, rows, scale), c10::Error) << device;
  }
}

}  // namespace
}  // namespace dpzero
