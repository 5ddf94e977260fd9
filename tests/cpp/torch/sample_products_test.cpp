// The host clipped sum's per-sample products (kernels/cpu/sample_products_simd.h): every entry is
// std::fma over the sample's rows from zero, then added to out, sample after sample; the AVX2 and
// AVX-512 kernels give those bits exactly, for every tile edge, row range and row stride, and the
// ATen entry refuses what it cannot do rather than doing it otherwise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "kernels/cpu/sample_products.h"
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

// One sample's rows that are huge and cancel (its product is exactly 0) leave the other samples'
// products in place; summed as one GEMM over all rows, they would absorb the partial sum before
// them (Note [clipped-sum rounding]).
TEST(SampleProducts, CancellingRowsOfOneSampleLeaveTheOthersIntact) {
  if (!simd::available()) GTEST_SKIP() << "this CPU has no AVX2 and FMA";
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
  at::Tensor out = at::zeros({rows, cols});
  ASSERT_TRUE(kernels::add_sample_products(out, left, right));
  const at::Tensor want = (at::arange(cols, at::kFloat) + 1.0).expand({rows, cols});
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

}  // namespace
}  // namespace dpzero
