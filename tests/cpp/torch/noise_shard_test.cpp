// The noise contract (design.md §3 "Noise"): over any shard plan and world size, the union of the
// ranks' noised shards equals the single-tensor noise bit for bit, every global coordinate is drawn
// exactly once and padding is never touched; a shard's runs drawn in one call (Note [noise
// launches]) are the per-run draws. Reference: dpzero::add_noise_ on one full tensor and
// privacy::noise_draw evaluated coordinate by coordinate. The Philox and secure tests run on CUDA
// too (their CudaNoise twins) when a GPU and the CUDA kernels are present, and are skipped
// otherwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "kernels/cpu/noise_simd.h"
#include "privacy/noise.h"
#include "privacy/secure_noise.h"
#include "src/dp/step_noise.h"
#include "src/zero/shard_plan.h"
#include "tests/cpp/torch/devices.h"

namespace dpzero {
namespace {

using testing::cuda_available;
using testing::devices;
using testing::kNoCuda;

at::Tensor& add_noise(at::Tensor& t, double stddev, int64_t seed, int64_t step, int64_t offset) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::add_noise_", "")
                             .typed<at::Tensor&(at::Tensor&, double, int64_t, int64_t, int64_t)>();
  return op.call(t, stddev, seed, step, offset);
}

at::Tensor& add_secure_noise(at::Tensor& t, double stddev, c10::IntArrayRef key, int64_t step,
                             int64_t offset) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpzero::add_secure_noise_", "")
          .typed<at::Tensor&(at::Tensor&, double, c10::IntArrayRef, int64_t, int64_t)>();
  return op.call(t, stddev, key, step, offset);
}

at::Tensor& add_noise_runs(at::Tensor& t, double stddev, int64_t seed, int64_t step,
                           c10::IntArrayRef runs) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpzero::add_noise_runs_", "")
          .typed<at::Tensor&(at::Tensor&, double, int64_t, int64_t, c10::IntArrayRef)>();
  return op.call(t, stddev, seed, step, runs);
}

at::Tensor& add_secure_noise_runs(at::Tensor& t, double stddev, c10::IntArrayRef key,
                                  int64_t step, c10::IntArrayRef runs) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpzero::add_secure_noise_runs_", "")
          .typed<at::Tensor&(at::Tensor&, double, c10::IntArrayRef, int64_t, c10::IntArrayRef)>();
  return op.call(t, stddev, key, step, runs);
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

// The single-tensor draw of `key` into t, which holds global coordinates [offset, offset + n).
void add_whole(at::Tensor& t, double stddev, const dp::NoiseKey& key, int64_t step,
               int64_t offset) {
  if (key.secure) {
    add_secure_noise(t, stddev, key.key, step, offset);
  } else {
    add_noise(t, stddev, key.seed, step, offset);
  }
}

// design.md §3 "Noise" over random plans, on `device` in `dtype`: units of 1..6 parameters of
// random sizes at a random global start, world sizes 1..8 with random alignment. Each rank noises
// its own shard of a zeroed flat buffer; gathered back to global order the buffer is the
// single-tensor draw bit for bit (so every coordinate was drawn exactly once: a second draw would
// add z again, a missed one leave 0) and padding is still exactly 0.
void expect_union_of_shards_is_the_whole_draw(at::Device device, at::ScalarType dtype,
                                              bool secure) {
  std::mt19937_64 rng(1234);
  const auto opts = at::TensorOptions().device(device).dtype(dtype);
  for (int trial = 0; trial < 40; ++trial) {
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
    dp::NoiseKey key{secure, static_cast<int64_t>(rng()), {}};
    if (secure) {
      for (int w = 0; w < 8; ++w) key.key.push_back(static_cast<int64_t>(rng() >> 32));
    }
    const int64_t step = static_cast<int64_t>(rng() % 1000);
    at::Tensor reference = at::zeros({total}, opts);
    add_whole(reference, 1.5, key, step, global_start);

    for (int64_t world : {1, 2, 3, 4, 8}) {
      const int64_t alignment = 1 + static_cast<int64_t>(rng() % 8);
      zero::UnitLayout layout(params, world, alignment);
      ASSERT_EQ(layout.padded_numel() % world, 0);
      at::Tensor flat = at::zeros({layout.padded_numel()}, opts);
      int64_t noised = 0;
      for (int64_t r = 0; r < world; ++r) {
        at::Tensor shard = flat.narrow(0, r * layout.shard_numel(), layout.shard_numel());
        noised += dp::add_shard_noise_(shard, layout, r, 1.5, key, step);
      }
      EXPECT_EQ(noised, total) << "world " << world;
      at::Tensor gathered = at::empty({total}, opts);
      at::Tensor is_param = at::zeros({layout.padded_numel()}, opts.dtype(at::kBool));
      for (const auto& run : layout.runs()) {
        gathered.narrow(0, run.global_offset - global_start, run.length)
            .copy_(flat.narrow(0, run.local_offset, run.length));
        is_param.narrow(0, run.local_offset, run.length).fill_(true);
      }
      EXPECT_TRUE(at::equal(gathered.cpu(), reference.cpu()))
          << device << " " << dtype << " secure=" << secure << " world " << world << " trial "
          << trial;
      EXPECT_EQ(flat.masked_select(is_param.logical_not()).abs().sum().item<double>(), 0.0)
          << "padding touched: " << device << " world " << world << " trial " << trial;
    }
  }
}

TEST(ShardNoise, UnionOfShardsEqualsSingleTensorForRandomPlans) {
  expect_union_of_shards_is_the_whole_draw(at::kCPU, at::kFloat, /*secure=*/false);
}

TEST(ShardNoise, SecureUnionOfShardsEqualsSingleTensorForRandomPlans) {
  expect_union_of_shards_is_the_whole_draw(at::kCPU, at::kDouble, /*secure=*/true);
  expect_union_of_shards_is_the_whole_draw(at::kCPU, at::kFloat, /*secure=*/true);
}

// Note [noise launches]: dpzero::add_noise_runs_ / add_secure_noise_runs_ over a table of runs
// (gaps, odd offsets in both numberings, empty runs, runs out of global order, more than one
// CUDA launch's 128) equal the per-run single-offset calls bit for bit, and leave every element
// outside the runs as it was. On every device present.
TEST(NoiseRuns, BatchedDrawIsThePerRunDraw) {
  std::mt19937_64 rng(77);
  const std::vector<int64_t> key = {5, 6, 7, 8, 9, 10, 11, 0xffffffff};
  for (const at::Device device : devices()) {
    for (const int num_runs : {1, 3, 40, 300}) {
      std::vector<int64_t> table;
      int64_t local = static_cast<int64_t>(rng() % 3);
      // Each run's global range lies in its own 64-coordinate slot, slots in shuffled order, so
      // runs never share a coordinate (the op refuses that) yet come out of global order.
      std::vector<int64_t> slots(static_cast<size_t>(num_runs));
      std::iota(slots.begin(), slots.end(), int64_t{0});
      std::shuffle(slots.begin(), slots.end(), rng);
      for (int r = 0; r < num_runs; ++r) {
        const int64_t length = r % 7 == 3 ? 0 : 1 + static_cast<int64_t>(rng() % 40);
        const int64_t global = slots[static_cast<size_t>(r)] * 64 +
                               static_cast<int64_t>(rng() % 24) +
                               (r % 5 == 0 ? (int64_t{1} << 33) : 0);
        table.insert(table.end(), {local, length, global});
        local += length + static_cast<int64_t>(rng() % 4);  // gaps of 0..3 elements
      }
      const int64_t n = local + 5;
      for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) {
        const auto opts = at::TensorOptions().device(device).dtype(dtype);
        const at::Tensor start = at::randn({n}, opts.dtype(at::kFloat)).to(dtype);
        for (const bool secure : {false, true}) {
          if (dtype == at::kDouble && !secure) continue;  // the Philox op takes 32- and 16-bit
          at::Tensor batched = start.clone(), per_run = start.clone();
          if (secure) {
            add_secure_noise_runs(batched, 0.7, key, 9, table);
          } else {
            add_noise_runs(batched, 0.7, 42, 9, table);
          }
          for (int r = 0; r < num_runs; ++r) {
            const int64_t l = table[3 * r], len = table[3 * r + 1], gl = table[3 * r + 2];
            at::Tensor piece = per_run.narrow(0, l, len);
            if (secure) {
              add_secure_noise(piece, 0.7, key, 9, gl);
            } else {
              add_noise(piece, 0.7, 42, 9, gl);
            }
          }
          EXPECT_TRUE(at::equal(batched.cpu(), per_run.cpu()))
              << device << " " << dtype << " secure=" << secure << " runs " << num_runs;
          EXPECT_FALSE(at::equal(batched.cpu(), start.cpu())) << "nothing drawn";
        }
      }
    }
  }
}

// What a rank draws with add_shard_noise_ (one op call for the shard's runs) is, element by
// element, what per-run single-offset calls on its runs give: its own coordinates' draws, and
// nothing in any element outside its runs (a sentinel value there stays as it was).
TEST(ShardNoise, EachRankDrawsExactlyItsRunsInOneCall) {
  std::mt19937_64 rng(99);
  for (const at::Device device : devices()) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<zero::ParamSpec> params;
      int64_t g = static_cast<int64_t>(rng() % 9);
      for (int p = 0; p < 1 + static_cast<int>(rng() % 8); ++p) {
        const int64_t numel = static_cast<int64_t>(rng() % 100);
        params.push_back({numel, g});
        g += numel + (p % 2 == 0 ? 0 : 1000);  // some parameters continue each other, some not
      }
      const int64_t world = 1 + static_cast<int64_t>(rng() % 4);
      zero::UnitLayout layout(params, world, 1 + static_cast<int64_t>(rng() % 4));
      for (const bool secure : {false, true}) {
        const dp::NoiseKey key{secure, 3, secure ? std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8}
                                                   : std::vector<int64_t>{}};
        const at::ScalarType dtype = secure ? at::kDouble : at::kFloat;
        for (int64_t r = 0; r < world; ++r) {
          const auto opts = at::TensorOptions().device(device).dtype(dtype);
          at::Tensor shard = at::full({layout.shard_numel()}, 0.25, opts);
          at::Tensor expected = shard.clone();
          int64_t owned = 0;
          for (const auto& run : layout.runs_for_rank(r)) {
            at::Tensor piece = expected.narrow(0, run.local_offset, run.length);
            add_whole(piece, 2.0, key, 4, run.global_offset);
            owned += run.length;
          }
          EXPECT_EQ(dp::add_shard_noise_(shard, layout, r, 2.0, key, 4), owned);
          EXPECT_TRUE(at::equal(shard.cpu(), expected.cpu()))
              << device << " secure=" << secure << " rank " << r << " trial " << trial;
        }
      }
    }
  }
}

TEST(NoiseRuns, RejectsBadTablesNamingThem) {
  at::Tensor x = at::zeros({10}, at::kFloat);
  const auto expect_error = [&](const std::vector<int64_t>& runs, const std::string& needle) {
    try {
      add_noise_runs(x, 1.0, 1, 0, runs);
      ADD_FAILURE() << "accepted " << c10::IntArrayRef(runs);
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error({0, 5}, "got 2 values");
  expect_error({8, 3, 0}, "(local 8, length 3, global 0)");
  expect_error({-1, 3, 0}, "(local -1, length 3, global 0)");
  expect_error({0, 3, -4}, "global -4");
  expect_error({0, 4, 0, 3, 2, 100}, "run 1 (local 3, length 2) overlaps");
  expect_error({5, 2, 0, 0, 2, 9}, "run 1 (local 0, length 2) overlaps or precedes");
  expect_error({0, 2, std::numeric_limits<int64_t>::max() - 1}, "overflows int64");
  // Disjoint in x but sharing global coordinates: neighbours, and a run inside one that is not
  // its neighbour in x.
  expect_error({0, 4, 100, 4, 2, 102},
               "runs 0 (global 100, length 4) and 1 (global 102, length 2) share");
  expect_error({0, 2, 50, 2, 2, 10, 4, 6, 45},
               "runs 2 (global 45, length 6) and 0 (global 50, length 2) share");
  EXPECT_NO_THROW(add_noise_runs(x, 1.0, 1, 0, std::vector<int64_t>{0, 0, 0, 0, 10, 3}));
  EXPECT_NO_THROW(add_noise_runs(x, 1.0, 1, 0, std::vector<int64_t>{}));
}

// CUDA twins of the CPU shard tests: the union of the ranks' shards is the single-tensor draw bit
// for bit on the device (every coordinate once, padding untouched), for the Philox draw and the
// secure one (the secure CUDA draw had no test before).
TEST(CudaNoise, UnionOfShardsEqualsSingleTensorForRandomPlans) {
  if (!cuda_available()) GTEST_SKIP() << kNoCuda;
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    expect_union_of_shards_is_the_whole_draw(at::kCUDA, dtype, /*secure=*/false);
  }
}

TEST(CudaNoise, SecureUnionOfShardsEqualsSingleTensorForRandomPlans) {
  if (!cuda_available()) GTEST_SKIP() << kNoCuda;
  for (const at::ScalarType dtype : {at::kDouble, at::kFloat, at::kBFloat16}) {
    expect_union_of_shards_is_the_whole_draw(at::kCUDA, dtype, /*secure=*/true);
  }
}

// The devices' draws agree within what Note [cuda noise draw] (kernels/cuda/noise.cu) and
// kernels/cuda/secure_noise.cu document: |cuda - cpu| <= tol (1 + |cpu|) with tol = 1e-5 for the
// float Philox draw and 1e-9 for the fp64 secure draw, over 2^16 coordinates at an odd offset.
TEST(CudaNoise, DrawsAgreeWithTheCpuWithinTheDocumentedTolerance) {
  if (!cuda_available()) GTEST_SKIP() << kNoCuda;
  const int64_t n = int64_t{1} << 16, offset = 123;
  const std::vector<int64_t> key = {0xdeadbeef, 1, 2, 3, 4, 5, 6, 0xffffffff};
  for (const bool secure : {false, true}) {
    const at::ScalarType dtype = secure ? at::kDouble : at::kFloat;
    at::Tensor cpu = at::zeros({n}, dtype);
    at::Tensor gpu = at::zeros({n}, at::TensorOptions(at::kCUDA).dtype(dtype));
    const dp::NoiseKey k{secure, 3, secure ? key : std::vector<int64_t>{}};
    add_whole(cpu, 1.0, k, 9, offset);
    add_whole(gpu, 1.0, k, 9, offset);
    const double tol = secure ? 1e-9 : 1e-5;
    const at::Tensor excess = (gpu.cpu() - cpu).abs() - tol * (1.0 + cpu.abs());
    EXPECT_LE(excess.max().item<double>(), 0.0) << "secure=" << secure;
    EXPECT_GT(cpu.abs().sum().item<double>(), 0.0);
  }
}

// One launch of 128 runs whose longest is far beyond what the launch's blocks cover in one pass
// (grid.x is capped), at global offsets past 2^33: the grid-stride loop of every run must still
// draw each element, as the CPU does (within the tolerance above; the CUDA per-run call shares the
// kernel, so the CPU is the independent reference here).
TEST(CudaNoise, LongRunsInOneLaunchAgreeWithTheCpu) {
  if (!cuda_available()) GTEST_SKIP() << kNoCuda;
  const std::vector<int64_t> key = {0xdeadbeef, 1, 2, 3, 4, 5, 6, 0xffffffff};
  std::vector<int64_t> table;
  int64_t local = 0;
  for (int64_t r = 0; r < 128; ++r) {
    const int64_t length = r == 5 ? (int64_t{1} << 20) + 3 : 1 + (r * 37) % 500;
    table.insert(table.end(), {local, length, (int64_t{1} << 33) + (127 - r) * (int64_t{1} << 21)});
    local += length + 1;
  }
  for (const bool secure : {false, true}) {
    const at::ScalarType dtype = secure ? at::kDouble : at::kFloat;
    at::Tensor cpu = at::zeros({local}, dtype);
    at::Tensor gpu = at::zeros({local}, at::TensorOptions(at::kCUDA).dtype(dtype));
    if (secure) {
      add_secure_noise_runs(cpu, 1.0, key, 4, table);
      add_secure_noise_runs(gpu, 1.0, key, 4, table);
    } else {
      add_noise_runs(cpu, 1.0, 8, 4, table);
      add_noise_runs(gpu, 1.0, 8, 4, table);
    }
    const double tol = secure ? 1e-9 : 1e-5;
    const at::Tensor excess = (gpu.cpu() - cpu).abs() - tol * (1.0 + cpu.abs());
    EXPECT_LE(excess.max().item<double>(), 0.0) << "secure=" << secure;
    // Every element inside a run was drawn (a zero draw has probability 0); the gaps were not.
    at::Tensor inside = at::zeros({local}, at::kBool);
    for (size_t r = 0; r < table.size() / 3; ++r) {
      inside.narrow(0, table[3 * r], table[3 * r + 1]).fill_(true);
    }
    EXPECT_TRUE((gpu.cpu() != 0).eq(inside).all().item<bool>()) << "secure=" << secure;
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
    dp::add_shard_noise_(shard, layout, r, 2.0, dp::NoiseKey{true, 0, key}, 5);
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
