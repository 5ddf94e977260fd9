// The noise contract (DESIGN.md §3 "Noise"): over any shard plan and world size, the union of the
// ranks' noised shards equals the single-tensor noise bit for bit, every global coordinate is drawn
// exactly once and padding is never touched. Reference: dpzero::add_noise_ on one full tensor and
// privacy::noise_draw evaluated coordinate by coordinate.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "kernels/cpu/noise_simd.h"
#include "privacy/noise.h"
#include "privacy/secure_noise.h"
#include "src/zero/shard_noise.h"
#include "src/zero/shard_plan.h"

namespace dpzero {
namespace {

at::Tensor& add_noise(at::Tensor& t, double stddev, int64_t seed, int64_t step, int64_t offset) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::add_noise_", "")
                             .typed<at::Tensor&(at::Tensor&, double, int64_t, int64_t, int64_t)>();
  return op.call(t, stddev, seed, step, offset);
}

// The CPU draw of coordinate j computed on its own: block j / 2 in lane 0 of a lane group (Note
// [cpu noise lanes]) where the CPU has the lanes, the scalar privacy::noise_draw otherwise.
float cpu_draw(uint64_t seed, uint32_t step, uint64_t j) {
  if (!kernels::noise_simd::available()) return privacy::noise_draw(seed, step, j);
  float z[2 * kernels::noise_simd::kBlocks];
  kernels::noise_simd::philox_normal_blocks(seed, step, privacy::kNoiseStream, j / 2, z);
  return z[j % 2];
}

double cpu_secure_draw(const privacy::ChaCha20Key& key, uint32_t step, uint64_t j) {
  if (!kernels::noise_simd::available()) return privacy::secure_noise_draw(key, step, j);
  double z[2 * kernels::noise_simd::kBlocks];
  kernels::noise_simd::secure_normal_pairs(key.w, step, privacy::kNoiseStream, j / 2, z);
  return z[j % 2];
}

// The op draws coordinate j in whatever lane its group puts it; computed alone (in lane 0) it
// must be the same bits, for offsets that put it in every lane. And the lane draw must be the
// scalar header draw up to the rounding of the math library (SLEEF's log/sincos against libm's):
// a few float ulps.
TEST(AddNoiseOp, MatchesPerCoordinateDraw) {
  const int64_t n = 1001, seed = 42, step = 7;
  const double stddev = 2.5;
  for (const int64_t offset : {int64_t{0}, int64_t{13}, int64_t{6}, (int64_t{1} << 33) + 5}) {
    at::Tensor x = at::zeros({n}, at::kFloat);
    add_noise(x, stddev, seed, step, offset);
    const float* data = x.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t j = static_cast<uint64_t>(offset + i);
      const float expected = static_cast<float>(stddev) * cpu_draw(seed, step, j);
      ASSERT_EQ(data[i], expected) << "offset=" << offset << " i=" << i;  // 0 + s*z is exact
      const float scalar = privacy::noise_draw(seed, step, j);
      ASSERT_NEAR(cpu_draw(seed, step, j), scalar, 4e-7 * (1.0 + std::abs(scalar)))
          << "offset=" << offset << " i=" << i;
    }
  }
}

// A first block (or pair) for the lane-equality tests below: any magnitude, and every eighth call
// a group that crosses the 2^32 boundary of the counter's low word.
uint64_t random_first_block(std::mt19937_64& rng, int call) {
  if (call % 8 == 0) return (uint64_t{1} << 32) - 1 - rng() % kernels::noise_simd::kBlocks;
  return rng() >> (rng() % 64);
}

// Note [cpu noise lanes]: on an AVX-512 CPU the op draws in sixteen lanes, and those must be the
// AVX2 lanes' bits exactly (else a run mixing the two kinds of CPU would not be world-size
// invariant). Random (seed, step, first block) triples, block indices across the 2^32 boundary
// of the counter's low word included; 2^21 coordinates.
TEST(AddNoiseOp, SixteenLanesAreTheEightLanesBitForBit) {
  if (!kernels::noise_simd::wide_available()) GTEST_SKIP() << "this CPU has no AVX-512F + DQ";
  constexpr int kDraws = 2 * kernels::noise_simd::kBlocks;
  std::mt19937_64 rng(20261201);
  for (int call = 0; call < (1 << 21) / kDraws; ++call) {
    const uint64_t seed = rng();
    const auto step = static_cast<uint32_t>(rng());
    const uint64_t first = random_first_block(rng, call);
    float narrow[kDraws], wide[kDraws];
    kernels::noise_simd::philox_normal_blocks_avx2(seed, step, privacy::kNoiseStream, first, narrow);
    kernels::noise_simd::philox_normal_blocks_avx512(seed, step, privacy::kNoiseStream, first, wide);
    for (int k = 0; k < kDraws; ++k) {
      ASSERT_EQ(std::memcmp(&narrow[k], &wide[k], sizeof(float)), 0)
          << "seed=" << seed << " step=" << step << " block=" << first + k / 2 << " lane " << k % 2
          << ": " << narrow[k] << " vs " << wide[k];
    }
  }
}

// The same for the secure draws (ChaCha20 and the fp64 Box–Muller sum): 2^20 coordinates.
TEST(AddSecureNoiseOp, SixteenLanesAreTheEightLanesBitForBit) {
  if (!kernels::noise_simd::wide_available()) GTEST_SKIP() << "this CPU has no AVX-512F + DQ";
  constexpr int kDraws = 2 * kernels::noise_simd::kBlocks;
  std::mt19937_64 rng(1201);
  for (int call = 0; call < (1 << 20) / kDraws; ++call) {
    uint32_t key[8];
    for (uint32_t& word : key) word = static_cast<uint32_t>(rng());
    const auto step = static_cast<uint32_t>(rng());
    const uint64_t first = random_first_block(rng, call);
    double narrow[kDraws], wide[kDraws];
    kernels::noise_simd::secure_normal_pairs_avx2(key, step, privacy::kNoiseStream, first, narrow);
    kernels::noise_simd::secure_normal_pairs_avx512(key, step, privacy::kNoiseStream, first, wide);
    for (int k = 0; k < kDraws; ++k) {
      ASSERT_EQ(std::memcmp(&narrow[k], &wide[k], sizeof(double)), 0)
          << "step=" << step << " pair=" << first + k / 2 << " lane " << k % 2 << ": " << narrow[k]
          << " vs " << wide[k];
    }
  }
}

// With the lanes switched off (dpzero::_set_noise_lanes, as on a CPU without AVX2) the ops are
// the scalar header draws exactly.
TEST(AddNoiseOp, WithoutLanesIsTheScalarDraw) {
  static const auto set_lanes = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("dpzero::_set_noise_lanes", "")
                                    .typed<bool(bool)>();
  const bool previous = set_lanes.call(false);
  const privacy::ChaCha20Key key{{9u, 8u, 7u, 6u, 5u, 4u, 3u, 2u}};
  at::Tensor x = at::zeros({301}, at::kFloat);
  at::Tensor y = at::zeros({301}, at::kDouble);
  add_noise(x, 1.0, 5, 2, 17);
  static const auto secure =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpzero::add_secure_noise_", "")
          .typed<at::Tensor&(at::Tensor&, double, c10::IntArrayRef, int64_t, int64_t)>();
  secure.call(y, 1.0, std::vector<int64_t>(key.w, key.w + 8), 2, 17);
  set_lanes.call(previous);
  for (int64_t i = 0; i < 301; ++i) {
    ASSERT_EQ(x.data_ptr<float>()[i], privacy::noise_draw(5, 2, 17 + i)) << "i=" << i;
    ASSERT_EQ(y.data_ptr<double>()[i], privacy::secure_noise_draw(key, 2, 17 + i)) << "i=" << i;
  }
}

TEST(AddSecureNoiseOp, MatchesPerCoordinateDraw) {
  const privacy::ChaCha20Key key{{1u, 2u, 3u, 0xdeadbeefu, 5u, 6u, 7u, 0x80000000u}};
  const std::vector<int64_t> key_words(key.w, key.w + 8);
  const int64_t n = 515, step = 3;
  const double stddev = 0.75;
  for (const int64_t offset : {int64_t{0}, int64_t{9}, (int64_t{1} << 34) + 3}) {
    at::Tensor x = at::zeros({n}, at::kDouble);
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("dpzero::add_secure_noise_", "")
            .typed<at::Tensor&(at::Tensor&, double, c10::IntArrayRef, int64_t, int64_t)>();
    op.call(x, stddev, key_words, step, offset);
    const double* data = x.data_ptr<double>();
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t j = static_cast<uint64_t>(offset + i);
      ASSERT_EQ(data[i], stddev * cpu_secure_draw(key, step, j)) << "offset=" << offset << " i=" << i;
      const double scalar = privacy::secure_noise_draw(key, step, j);
      ASSERT_NEAR(cpu_secure_draw(key, step, j), scalar, 1e-14 * (1.0 + std::abs(scalar)))
          << "offset=" << offset << " i=" << i;
    }
  }
}

TEST(AddNoiseOp, RejectsBadArgumentsNamingThem) {
  at::Tensor x = at::zeros({8}, at::kFloat);
  EXPECT_THROW(
      {
        try {
          add_noise(x, -1.0, 1, 0, 0);
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("got -1"), std::string::npos) << e.what();
          throw;
        }
      },
      c10::Error);
  EXPECT_THROW(add_noise(x, 1.0, 1, -3, 0), c10::Error);
  EXPECT_THROW(add_noise(x, 1.0, 1, 0, -5), c10::Error);
  at::Tensor d = at::zeros({8}, at::kDouble);
  EXPECT_THROW(add_noise(d, 1.0, 1, 0, 0), c10::Error);
  at::Tensor strided = at::zeros({8, 2}, at::kFloat).t();
  EXPECT_THROW(add_noise(strided, 1.0, 1, 0, 0), c10::Error);
}

TEST(ShardNoise, UnionOfShardsEqualsSingleTensorForRandomPlans) {
  std::mt19937_64 rng(1234);
  for (int trial = 0; trial < 40; ++trial) {
    // A unit of 1..6 parameters with random sizes and a random global start.
    const int num_params = 1 + static_cast<int>(rng() % 6);
    const int64_t global_start = static_cast<int64_t>(rng() % 50);
    std::vector<zero::ParamSpec> params;
    int64_t g = global_start;
    for (int p = 0; p < num_params; ++p) {
      const int64_t numel = static_cast<int64_t>(rng() % 300);
      params.push_back({numel, g});
      g += numel;
    }
    const int64_t total = g - global_start;
    const int64_t seed = static_cast<int64_t>(rng()), step = static_cast<int64_t>(rng() % 1000);
    at::Tensor reference = at::zeros({total}, at::kFloat);
    add_noise(reference, 1.5, seed, step, global_start);

    for (int64_t world : {1, 2, 3, 4, 8}) {
      const int64_t alignment = 1 + static_cast<int64_t>(rng() % 8);
      zero::UnitLayout layout(params, world, alignment);
      ASSERT_EQ(layout.padded_numel() % world, 0);
      // Each rank noises its own shard of a zeroed flat buffer; padding must stay exactly zero.
      at::Tensor flat = at::full({layout.padded_numel()}, 0.0f, at::kFloat);
      std::vector<int> draws(static_cast<size_t>(total), 0);
      int64_t noised = 0;
      for (int64_t r = 0; r < world; ++r) {
        at::Tensor shard = flat.narrow(0, r * layout.shard_numel(), layout.shard_numel());
        noised += zero::add_shard_noise_(shard, layout, r, 1.5, zero::NoiseKey{false, seed, {}}, step);
        for (const auto& run : layout.runs_for_rank(r)) {
          for (int64_t k = 0; k < run.length; ++k) ++draws[run.global_offset + k - global_start];
        }
      }
      EXPECT_EQ(noised, total) << "world " << world;
      for (int64_t j = 0; j < total; ++j) ASSERT_EQ(draws[j], 1) << "coordinate " << j;
      // Gather the flat buffer back to global order and compare bit for bit; padding untouched.
      at::Tensor gathered = at::empty({total}, at::kFloat);
      at::Tensor is_param = at::zeros({layout.padded_numel()}, at::kBool);
      for (const auto& run : layout.runs()) {
        gathered.narrow(0, run.global_offset - global_start, run.length)
            .copy_(flat.narrow(0, run.local_offset, run.length));
        is_param.narrow(0, run.local_offset, run.length).fill_(true);
      }
      EXPECT_TRUE(at::equal(gathered, reference)) << "world " << world << " trial " << trial;
      EXPECT_TRUE(at::equal(flat.masked_select(is_param.logical_not()),
                            at::zeros({layout.padded_numel() - total}, at::kFloat)));
    }
  }
}

TEST(ShardNoise, LowPrecisionShardsGetFp32MathRoundedOnce) {
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    at::Tensor x = at::full({257}, 1.0, dtype);
    add_noise(x, 0.5, 9, 3, 100);
    at::Tensor ref = at::ones({257}, at::kFloat);
    add_noise(ref, 0.5, 9, 3, 100);
    EXPECT_TRUE(at::equal(x, ref.to(dtype))) << dtype;
  }
}

TEST(ShardNoise, SecureKeyShardsUnionEqualsSingleTensor) {
  const std::vector<int64_t> key = {11, 22, 33, 44, 55, 66, 77, 88};
  zero::UnitLayout layout({{37, 0}, {50, 37}}, 3, 4);
  at::Tensor reference = at::zeros({87}, at::kDouble);
  static const auto secure_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpzero::add_secure_noise_", "")
          .typed<at::Tensor&(at::Tensor&, double, c10::IntArrayRef, int64_t, int64_t)>();
  secure_op.call(reference, 2.0, key, 5, 0);
  at::Tensor flat = at::zeros({layout.padded_numel()}, at::kDouble);
  for (int64_t r = 0; r < 3; ++r) {
    at::Tensor shard = flat.narrow(0, r * layout.shard_numel(), layout.shard_numel());
    zero::add_shard_noise_(shard, layout, r, 2.0, zero::NoiseKey{true, 0, key}, 5);
  }
  at::Tensor gathered = at::empty({87}, at::kDouble);
  for (const auto& run : layout.runs()) {
    gathered.narrow(0, run.global_offset, run.length).copy_(flat.narrow(0, run.local_offset, run.length));
  }
  EXPECT_TRUE(at::equal(gathered, reference));
}

TEST(UnitLayoutTest, RejectsOverlapAndBadWorldSize) {
  EXPECT_THROW(zero::UnitLayout({{10, 0}, {10, 5}}, 2), std::invalid_argument);
  // A zero-size parameter between two overlapping ones must not hide the overlap.
  EXPECT_THROW(zero::UnitLayout({{10, 0}, {0, 5}, {10, 8}}, 2), std::invalid_argument);
  // An overlap with a parameter that is not the sorted neighbour: [0,100) contains [20,30).
  EXPECT_THROW(zero::UnitLayout({{100, 0}, {5, 10}, {10, 20}}, 2), std::invalid_argument);
  EXPECT_THROW(zero::UnitLayout({{10, std::numeric_limits<int64_t>::max() - 5}}, 1),
               std::invalid_argument);
  EXPECT_THROW(zero::UnitLayout({{10, 0}}, 0), std::invalid_argument);
  EXPECT_THROW(zero::UnitLayout({{-1, 0}}, 1), std::invalid_argument);
}

TEST(ShardPlanTest, UnitsMustCoverEveryCoordinateExactlyOnce) {
  using zero::ShardPlan;
  using zero::UnitLayout;
  // Root unit holding embeddings [0, 100) and final norm [300, 310); one block [100, 300).
  EXPECT_NO_THROW(ShardPlan({UnitLayout({{100, 0}, {10, 300}}, 2), UnitLayout({{200, 100}}, 2)}, 310));
  // Two units both claiming [100, 110): a coordinate noised twice.
  EXPECT_THROW(ShardPlan({UnitLayout({{110, 0}}, 2), UnitLayout({{200, 100}}, 2)}, 300),
               std::invalid_argument);
  // A gap [100, 120): coordinates never noised.
  EXPECT_THROW(ShardPlan({UnitLayout({{100, 0}}, 2), UnitLayout({{180, 120}}, 2)}, 300),
               std::invalid_argument);
  // Coverage short of the model's coordinate count, and mixed world sizes.
  EXPECT_THROW(ShardPlan({UnitLayout({{100, 0}}, 2)}, 101), std::invalid_argument);
  EXPECT_THROW(ShardPlan({UnitLayout({{100, 0}}, 2), UnitLayout({{1, 100}}, 4)}, 101),
               std::invalid_argument);
}

}  // namespace
}  // namespace dpzero
