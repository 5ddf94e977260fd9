// The host clipped sum's per-sample products (kernels/cpu/sample_products_simd.h): every entry is
// std::fma over the sample's rows from zero, then added to out, sample after sample; the AVX2 and
// AVX-512 kernels give those bits exactly, for every tile edge, row range and row stride, and the
// ATen entry refuses what it cannot do rather than doing it otherwise.
// The device path's op, dpzero::_add_sample_products_ (Note [fused sample products] in
// kernels/cuda/sample_products.cu): on every device within the rounding bound of a float64 sum,
// dropped samples skipped (their NaN rows never read), one sample's cancelling rows leaving the
// others intact; on CUDA the host reference's bits for every split count.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <random>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "kernels/cpu/sample_products.h"
#include "kernels/sample_products_checks.h"
#include "tests/cpp/torch/devices.h"
#include "kernels/cpu/sample_products_simd.h"
#include "tests/cpp/torch/spread_values.h"

namespace dpzero {
namespace {

namespace simd = kernels::sample_products_simd;

// The reference: each sample's product entry by std::fma from zero in row order, then out + it.
void reference(float* out, int64_t ld, const float* left, const float* right, int64_t c, int64_t t,
               int64_t rows, int64_t cols, int64_t r0, int64_t r1) {
  for (int64_t i = 0; i < c; ++i) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t k = 0; k < cols; ++k) {
        float p = 0.0f;
        for (int64_t s = 0; s < t; ++s)
          p = std::fma(left[(i * t + s) * rows + r], right[(i * t + s) * cols + k], p);
        out[r * ld + k] = out[r * ld + k] + p;
      }
    }
  }
}

void expect_reference_bits(bool wide, const std::string& name) {
  std::mt19937 rng(7);
  for (int64_t c : {1, 3}) {
    for (int64_t t : {1, 2, 5, 16}) {
      for (int64_t rows : {1, 5, 6, 7, 12, 13, 25}) {
        for (int64_t cols : {1, 7, 8, 15, 16, 17, 31, 32, 33, 47, 64}) {
          const int64_t ld = cols + 3;  // a row stride past the row, left untouched
          const std::vector<float> left = testing::spread_values(rng, c * t * rows, 12);
          const std::vector<float> right = testing::spread_values(rng, c * t * cols, 12);
          const std::vector<float> start = testing::spread_values(rng, rows * ld, 12);
          const int64_t r0 = rows > 5 ? 2 : 0, r1 = rows > 7 ? rows - 1 : rows;
          std::vector<float> want = start, got = start;
          reference(want.data(), ld, left.data(), right.data(), c, t, rows, cols, r0, r1);
          kernels::add_sample_rows(got.data(), ld, left.data(), right.data(), c, t, rows, cols,
                                   r0, r1, wide);
          ASSERT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)))
              << name << ": c " << c << ", t " << t << ", rows " << rows << ", cols " << cols;
        }
      }
    }
  }
}

TEST(SampleProducts, AvxLanesGiveTheFmaReferenceBits) {
  if (!simd::available()) GTEST_SKIP() << "this CPU has no AVX2 and FMA";
  expect_reference_bits(/*wide=*/false, "avx2");
}

TEST(SampleProducts, Avx512LanesGiveTheFmaReferenceBits) {
  if (!simd::wide_available()) GTEST_SKIP() << "this CPU has no AVX-512F";
  expect_reference_bits(/*wide=*/true, "avx512");
}

// One sample's rows that are huge and cancel (its product is exactly 0) between two others:
// (left [3, 2, 3], right [3, 2, 20], the exact sum of the products [3, 20]).
struct Cancelling {
  at::Tensor left, right, want;
};

Cancelling cancelling_rows() {
  const int64_t rows = 3, cols = 20;
  at::Tensor left = at::zeros({3, 2, rows}), right = at::zeros({3, 2, cols});
  left[0][0].fill_(1.0);
  right[0][0] = at::arange(cols, at::kFloat);
  left[1][0].fill_(1e8);
  left[1][1].fill_(-1e8);
  right[1][0].fill_(1.0);
  right[1][1].fill_(1.0);
  left[2][0].fill_(0.5);
  right[2][0].fill_(2.0);
  return {left, right, (at::arange(cols, at::kFloat) + 1.0).expand({rows, cols})};
}

// The cancelling rows leave the other samples' products in place; summed as one GEMM over all
// rows, they would absorb the partial sum before them (Note [clipped-sum rounding]).
TEST(SampleProducts, CancellingRowsOfOneSampleLeaveTheOthersIntact) {
  if (!simd::available()) GTEST_SKIP() << "this CPU has no AVX2 and FMA";
  const auto [left, right, want] = cancelling_rows();
  at::Tensor out = at::zeros(want.sizes());
  ASSERT_TRUE(kernels::add_sample_products(out, left, right));
  EXPECT_TRUE(at::equal(out, want)) << out;
}

TEST(SampleProducts, TheAtenEntryMatchesTheFloat64SumAndRefusesWhatItCannotDo) {
  if (!simd::available()) GTEST_SKIP() << "this CPU has no AVX2 and FMA";
  at::manual_seed(3);
  const at::Tensor left = at::randn({4, 9, 70}), right = at::randn({4, 9, 45});
  at::Tensor out = at::randn({70, 45});
  const at::Tensor want = out.to(at::kDouble) +
                         at::einsum("itr,itk->rk", {left.to(at::kDouble), right.to(at::kDouble)});
  ASSERT_TRUE(kernels::add_sample_products(out, left, right));
  EXPECT_TRUE(at::allclose(out.to(at::kDouble), want, 1e-5, 1e-5));
  // A transposed view of the destination (column stride > 1): refused, untouched.
  at::Tensor base = at::zeros({45, 70});
  at::Tensor view = base.t();
  EXPECT_FALSE(kernels::add_sample_products(view, left, right));
  EXPECT_EQ(0, base.count_nonzero().item<int64_t>());
  at::Tensor f64 = at::zeros({70, 45}, at::kDouble);
  EXPECT_FALSE(kernels::add_sample_products(f64, left, right));
  at::Tensor wrong = at::zeros({70, 44});
  EXPECT_FALSE(kernels::add_sample_products(wrong, left, right));
  // A destination that is an operand's memory, or whose entries share memory: refused, so the
  // caller's path (which forms the products before writing) handles it.
  at::Tensor memory = at::randn({70 * 45});
  at::Tensor aliased = memory.view({70, 45});
  const at::Tensor inside = memory.narrow(0, 0, 2 * 9 * 70).view({2, 9, 70});
  EXPECT_FALSE(kernels::add_sample_products(aliased, inside, at::randn({2, 9, 45})));
  at::Tensor expanded = at::zeros({1, 45}).expand({70, 45});
  EXPECT_FALSE(kernels::add_sample_products(expanded, left, right));
  // An accepted write is an in-place op: the version counter moves.
  at::Tensor fresh = at::zeros({70, 45});
  const auto version = fresh._version();
  ASSERT_TRUE(kernels::add_sample_products(fresh, left, right));
  EXPECT_GT(fresh._version(), version);
  at::Tensor long_out = at::zeros({3, 5});
  EXPECT_FALSE(kernels::add_sample_products(long_out, at::ones({2, 65, 3}), at::ones({2, 65, 5})));
  EXPECT_EQ(0, long_out.count_nonzero().item<int64_t>());
}

// ---- dpzero::_add_sample_products_ -------------------------------------------------------------

at::Tensor& products_op(at::Tensor& self, const at::Tensor& left, const at::Tensor& right,
                        const at::Tensor& scale, int64_t splits) {
  using Signature =
      at::Tensor&(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_add_sample_products_", "")
                             .typed<Signature>();
  return op.call(self, left, right, scale, splits);
}

// The float64 sum self + sum_i c_i left_i^T right_i over the samples that add, and the bound of
// its float32 rounding: gamma_{T + c + 2} (|self| + sum_i |c_i| sum_t |l_t| |r_t|) per entry
// (Note [fused sample products]: each product within (1 + u)(1 + gamma_T) - 1 of c_i S_i, then
// at most c + 1 additions).
std::pair<at::Tensor, at::Tensor> float64_sum(const at::Tensor& self, const at::Tensor& left,
                                              const at::Tensor& right, const at::Tensor& scale) {
  const at::Tensor f = scale.cpu().to(at::kDouble);
  const at::Tensor keep = at::isfinite(f).logical_and(f != 0);
  const at::Tensor c = at::where(keep, f, at::zeros_like(f));
  const at::Tensor l = left.cpu().to(at::kDouble), r = right.cpu().to(at::kDouble);
  // Dropped samples' rows may be NaN: zero them before they meet their zero factor.
  const at::Tensor mask = keep.view({-1, 1, 1});
  const at::Tensor lk = at::where(mask, l, at::zeros_like(l));
  const at::Tensor rk = at::where(mask, r, at::zeros_like(r));
  const at::Tensor s0 = self.cpu().to(at::kDouble);
  const at::Tensor sum = s0 + at::einsum("i,itr,itk->rk", {c, lk, rk});
  const at::Tensor abs_sum = s0.abs() + at::einsum("i,itr,itk->rk", {c.abs(), lk.abs(), rk.abs()});
  const double n = static_cast<double>(left.size(1) + left.size(0) + 2);
  const double u = std::ldexp(1.0, -24);
  return {sum, abs_sum * (n * u / (1.0 - n * u))};
}

// The kept-sample rule, written without std::isfinite so device code can call it: finite and
// non-zero, against the standard library's classification.
TEST(SampleProducts, AFactorAddsIffItIsFiniteAndNonZero) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float f : {0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max(),
                  -std::numeric_limits<float>::max(), 1e-30f, 1.0f}) {
    EXPECT_EQ(kernels::sample_products::adds(f), std::isfinite(f) && f != 0.0f) << f;
  }
}

TEST(SampleProducts, TheOpIsTheFloat64SumWithinItsBoundOnEveryDevice) {
  at::manual_seed(11);
  const std::vector<at::ScalarType> dtypes{at::kFloat, at::kBFloat16, at::kHalf};
  for (const at::Device device : testing::devices()) {
    int64_t case_index = 0;
    for (int64_t rows : {1, 63, 64, 65, 130}) {
      for (int64_t cols : {1, 17, 64, 100}) {
        for (int64_t t : {2, 15, 16, 17, 40}) {
          const int64_t c = 1 + (case_index % 5);
          const at::ScalarType lt = dtypes[case_index % 3], rt = dtypes[(case_index / 3) % 3];
          ++case_index;
          at::Tensor left = at::randn({c, t, rows}).to(lt), right = at::randn({c, t, cols}).to(rt);
          at::Tensor scale = at::rand({c}) + 0.1;
          if (c >= 3) {  // a dropped sample: factor 0 and NaN rows, or an infinite factor
            scale[1] = (case_index % 2) ? 0.0 : std::numeric_limits<double>::infinity();
            left[1][0].fill_(std::numeric_limits<double>::quiet_NaN());
          }
          const at::Tensor start = at::randn({rows, cols});
          const auto [want, bound] = float64_sum(start, left, right, scale);
          at::Tensor self = start.to(device);
          products_op(self, left.to(device), right.to(device), scale.to(device), 0);
          const at::Tensor err = (self.cpu().to(at::kDouble) - want).abs();
          ASSERT_TRUE(at::isfinite(self.cpu()).all().item<bool>()) << device;
          EXPECT_TRUE((err <= bound).all().item<bool>())
              << device << ": rows " << rows << ", cols " << cols << ", T " << t << ", c " << c
              << ", worst excess " << (err - bound).max().item<double>();
        }
      }
    }
  }
}

TEST(SampleProducts, TheOpsCancellingRowsOfOneSampleLeaveTheOthersIntact) {
  for (const at::Device device : testing::devices()) {
    for (int64_t splits : {1, 2, 3}) {
      if (device.is_cpu() && splits > 1) continue;  // a CUDA launch choice
      const auto [left, right, want] = cancelling_rows();
      at::Tensor out = at::zeros(want.sizes(), device);
      products_op(out, left.to(device), right.to(device), at::ones({3}, device), splits);
      EXPECT_TRUE(at::equal(out.cpu(), want)) << device << ", splits " << splits << out;
    }
  }
}

// A kept sample whose unscaled product leaves float32's range (rows of 2^64 that cancel, so
// 2^64 * 2^64 = 2^128 overflows; a factor of 2^-110, which a certified norm near 1e33 gives): its
// scaled rows keep the sum finite, on every device and split count. Powers of two make every step
// exact: the sample adds 2^18 - 2^18 = 0, the other one 0.5 * 1 * 3.
TEST(SampleProducts, AKeptSampleWhoseUnscaledProductOverflowsStaysFinite) {
  for (const at::Device device : testing::devices()) {
    for (int64_t splits : {1, 2}) {
      if (device.is_cpu() && splits > 1) continue;
      const float big = std::ldexp(1.0f, 64);
      const at::Tensor left = at::tensor({big, -big, 1.0f, 0.0f}).view({2, 2, 1});
      const at::Tensor right = at::tensor({big, big, 3.0f, 0.0f}).view({2, 2, 1});
      const at::Tensor scale = at::tensor({std::ldexp(1.0f, -110), 0.5f});
      at::Tensor out = at::zeros({1, 1}, device);
      products_op(out, left.to(device), right.to(device), scale.to(device), splits);
      EXPECT_EQ(out.item<float>(), 1.5f) << device << ", splits " << splits;
    }
  }
}

// The CUDA kernel's arithmetic written out on the host: samples in contiguous runs of
// ceil(c / min(splits, 8, c)); run 0 starts from self, each later run from zero; within a run each
// sample that adds contributes p = std::fma over its rows from zero in row order of its left
// entries times c_i (each product rounded alone) and its right entries, added in order; then the
// later runs' sums are added into self in run order.
std::vector<float> cuda_reference(const std::vector<float>& self, const at::Tensor& left,
                                  const at::Tensor& right, const std::vector<float>& scale,
                                  int64_t splits) {
  const at::Tensor l = left.to(at::kFloat).contiguous(), r = right.to(at::kFloat).contiguous();
  const float* lp = l.data_ptr<float>();
  const float* rp = r.data_ptr<float>();
  const int64_t c = l.size(0), t = l.size(1), rows = l.size(2), cols = r.size(2);
  const int64_t n = std::min<int64_t>({splits, int64_t{8}, c});  // the kernel's kMaxSplits
  const int64_t per = (c + n - 1) / n, used = (c + per - 1) / per;
  std::vector<float> out = self;
  std::vector<std::vector<float>> runs(used, std::vector<float>(rows * cols, 0.0f));
  runs[0] = self;
  for (int64_t z = 0; z < used; ++z) {
    for (int64_t i = z * per; i < std::min(c, (z + 1) * per); ++i) {
      if (!kernels::sample_products::adds(scale[i])) continue;
      for (int64_t e = 0; e < rows * cols; ++e) {
        const int64_t row = e / cols, col = e % cols;
        float p = 0.0f;
        for (int64_t s = 0; s < t; ++s) {
          volatile float scaled = scale[i] * lp[(i * t + s) * rows + row];  // as __fmul_rn
          p = std::fma(scaled, rp[(i * t + s) * cols + col], p);
        }
        runs[z][e] = runs[z][e] + p;
      }
    }
  }
  out = runs[0];
  for (int64_t z = 1; z < used; ++z)
    for (int64_t e = 0; e < rows * cols; ++e) out[e] = out[e] + runs[z][e];
  return out;
}

// The reference the CUDA test holds the kernel to is itself the float64 sum within its bound,
// here, for every split count (so a CUDA failure is the kernel's, not the reference's).
TEST(SampleProducts, TheCudaReferenceIsTheFloat64SumWithinItsBound) {
  std::mt19937 rng(6);
  at::manual_seed(6);
  const int64_t c = 7, t = 33, rows = 9, cols = 11;
  const at::Tensor left = at::randn({c, t, rows}).to(at::kBFloat16);
  const at::Tensor right = at::randn({c, t, cols});
  std::vector<float> scale(c);
  for (int64_t i = 0; i < c; ++i) scale[i] = (i % 4 == 2) ? 0.0f : 0.25f + 0.1f * i;
  const std::vector<float> start = testing::spread_values(rng, rows * cols, 6);
  const at::Tensor self = at::from_blob(const_cast<float*>(start.data()), {rows, cols}).clone();
  const at::Tensor factors = at::from_blob(scale.data(), {c}).clone();
  const auto [want, bound] = float64_sum(self, left, right, factors);
  for (int64_t splits : {1, 2, 3, 8}) {
    const std::vector<float> got = cuda_reference(start, left, right, scale, splits);
    const at::Tensor err =
        (at::from_blob(const_cast<float*>(got.data()), {rows, cols}).to(at::kDouble) - want).abs();
    EXPECT_TRUE((err <= bound).all().item<bool>()) << "splits " << splits;
  }
}

TEST(SampleProducts, CudaGivesTheHostReferenceBitsForEverySplitCount) {
  if (!testing::cuda_available()) GTEST_SKIP() << testing::kNoCuda;
  std::mt19937 rng(5);
  at::manual_seed(5);
  for (int64_t splits : {1, 2, 3, 8}) {
    for (const auto& [c, t, rows, cols] : std::vector<std::array<int64_t, 4>>{
             {7, 33, 65, 70}, {3, 2, 1, 129}, {9, 16, 64, 64}, {1, 128, 130, 3}}) {
      const at::Tensor left = at::randn({c, t, rows}).to(at::kBFloat16);
      const at::Tensor right = at::randn({c, t, cols});
      std::vector<float> scale(c);
      for (int64_t i = 0; i < c; ++i) scale[i] = (i % 4 == 2) ? 0.0f : 0.25f + 0.1f * i;
      const std::vector<float> start = testing::spread_values(rng, rows * cols, 6);
      const std::vector<float> want = cuda_reference(start, left, right, scale, splits);
      at::Tensor self =
          at::from_blob(const_cast<float*>(start.data()), {rows, cols}).clone().cuda();
      const at::Tensor factors = at::from_blob(scale.data(), {c}).clone().cuda();
      products_op(self, left.cuda(), right.cuda(), factors, splits);
      const at::Tensor got = self.cpu().contiguous();
      ASSERT_EQ(0, std::memcmp(want.data(), got.data_ptr<float>(), want.size() * sizeof(float)))
          << "splits " << splits << ", c " << c << ", T " << t << ", rows " << rows << ", cols "
          << cols;
    }
  }
}

TEST(SampleProducts, TheOpRefusesBadArgumentsNamingThem) {
  for (const at::Device device : testing::devices()) {
    const auto o = at::TensorOptions().device(device);
    const auto refuses = [&](at::Tensor self, const at::Tensor& l, const at::Tensor& r,
                             const at::Tensor& s, int64_t splits, const std::string& words) {
      try {
        products_op(self, l, r, s, splits);
        ADD_FAILURE() << device << ": accepted, wanted \"" << words << "\"";
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
      }
    };
    const at::Tensor l = at::ones({2, 3, 4}, o), r = at::ones({2, 3, 5}, o), s = at::ones({2}, o);
    refuses(at::zeros({4, 5}, o.dtype(at::kDouble)), l, r, s, 0, "self must be a [rows, cols] float32");
    refuses(at::zeros({4, 6}, o), l, r, s, 0, "[rows, cols] = [4, 6]");
    refuses(at::zeros({4, 5}, o), l.to(at::kDouble), r, s, 0, "float32, bfloat16 or float16");
    refuses(at::zeros({4, 5}, o), l, r, at::ones({3}, o), 0, "scale must be [2] float32");
    refuses(at::zeros({4, 5}, o), l, r, s, -1, "splits must be >= 0");
    refuses(at::zeros({5, 4}, o).t(), l, r, s, 0, "unit column stride");
    at::Tensor memory = at::zeros({2 * 3 * 5}, o);
    refuses(memory.narrow(0, 0, 20).view({4, 5}), l, memory.view({2, 3, 5}), s, 0,
            "shares memory with an operand");
    if (!device.is_cpu())
      refuses(at::zeros({4, 5}, o), l.cpu(), r, s, 0, "an operand is on cpu");
  }
}

}  // namespace
}  // namespace dpzero
