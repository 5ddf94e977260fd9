// Note [correlated noise on shards] (src/dp/correlated_noise.h): the noise a ZeRO update adds,
// charge after charge, is C⁻¹z computed densely in float64 (C the strategy's matrix inverted by
// torch's linear algebra, z the single-process counter-based draws of the whole model), for every
// world size and stage, bit for bit the same across them, with a charge index never applied still
// in the history; and one band with c_0 = 1 is DP-SGD's StepNoise, bit for bit.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include "privacy/banded.h"
#include "src/comm/collectives.h"
#include "src/dp/correlated_noise.h"
#include "src/dp/step_noise.h"
#include "src/zero/state.h"
#include "tests/cpp/torch/ranks.h"

namespace dpzero::dp {
namespace {

constexpr int64_t kSteps = 6, kCoords = 15;
constexpr double kStd = 0.75, kLr = 0.5, kScale = 0.25;
constexpr int64_t kSeed = 11;

std::vector<at::Tensor> params() {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  std::vector<at::Tensor> out;
  for (int64_t n : {5, 7, 3}) out.push_back(at::randn({n}, gen).requires_grad_());
  return out;
}

// [steps, padded_numel] in the unit's flat layout -> [steps, kCoords] in global order.
at::Tensor global(const at::Tensor& flat, const zero::UnitLayout& layout) {
  std::vector<at::Tensor> parts;
  for (size_t i = 0; i < layout.params().size(); ++i)
    parts.push_back(flat.narrow(1, layout.flat_offsets()[i], layout.params()[i].numel));
  return at::cat(parts, 1);
}

// Each step's update divided by −lr·scale·stddev: the noise w_k [kSteps, kCoords], on every rank
// of a `world`-rank run at `stage`, charges `charges` (rank 0's; the others are checked equal).
at::Tensor noise_of_run(int world, zero::Stage stage, const privacy::BandedToeplitz& strategy,
                        const std::vector<int64_t>& charges) {
  std::vector<at::Tensor> per_rank(world);
  testing::run_ranks(world, std::chrono::seconds(120), [&](int rank, auto pg) {
    zero::ZeroConfig config;
    config.stage = stage;
    config.optimizer.lr = kLr;
    zero::ZeroState state({{"unit", params(), {"a", "b", "c"}, {0, 5, 12}}}, kCoords, config, pg);
    CorrelatedNoise noise(strategy, NoiseKey{false, kSeed, {}});
    std::vector<at::Tensor> steps;
    at::Tensor before = state.full_parameters(0).clone();
    for (int64_t k : charges) {
      const int64_t padded = state.unit_at(0).flat().layout().padded_numel();
      state.add_unit_grad(0, torch::zeros({padded}), /*release_params=*/true, /*donated=*/true);
      CorrelatedNoise::Step step = noise.at(k, kStd);
      state.noisy_step(&step, kScale);
      const at::Tensor after = state.full_parameters(0).clone();
      steps.push_back((after - before).to(at::kDouble) / (-kLr * kScale * kStd));
      before = after;
    }
    per_rank[rank] = global(at::stack(steps), state.unit_at(0).flat().layout());
  });
  for (int r = 1; r < world; ++r) EXPECT_TRUE(at::equal(per_rank[r], per_rank[0])) << r;
  return per_rank[0];
}

// C⁻¹ z densely: z_k(j) for k < kSteps over [0, coords), C [kSteps, kSteps] from the
// coefficients, solved by torch's inverse in float64.
at::Tensor dense_reference(const privacy::BandedToeplitz& strategy, int64_t coords = kCoords) {
  static const auto add_noise =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpzero::add_noise_", "")
          .typed<at::Tensor&(at::Tensor&, double, int64_t, int64_t, int64_t)>();
  at::Tensor z = torch::zeros({kSteps, coords});
  for (int64_t k = 0; k < kSteps; ++k) {
    at::Tensor row = z[k];
    add_noise.call(row, 1.0, kSeed, k, 0);
  }
  at::Tensor c = torch::zeros({kSteps, kSteps}, at::kDouble);
  const std::vector<double>& coef = strategy.coefficients();
  for (int64_t t = 0; t < kSteps; ++t)
    for (int64_t k = 0; k < static_cast<int64_t>(coef.size()) && k <= t; ++k) c[t][t - k] = coef[k];
  return at::matmul(at::linalg_inv(c), z.to(at::kDouble));  // [kSteps, coords]
}

std::vector<int64_t> consecutive() {
  std::vector<int64_t> k(kSteps);
  for (int64_t i = 0; i < kSteps; ++i) k[i] = i;
  return k;
}

TEST(CorrelatedNoise, IsTheStrategysInverseAppliedToTheDrawsOnEveryLayout) {
  const auto strategy = privacy::BandedToeplitz::sqrt_prefix_sum(4);
  const at::Tensor want = dense_reference(strategy);
  at::Tensor first;
  for (int world : {1, 2, 3}) {
    for (zero::Stage stage : {zero::Stage::k0, zero::Stage::k1, zero::Stage::k2, zero::Stage::k3}) {
      const at::Tensor got = noise_of_run(world, stage, strategy, consecutive());
      EXPECT_TRUE(at::allclose(got, want, /*rtol=*/1e-4, /*atol=*/1e-5))
          << "world " << world << " stage " << static_cast<int>(stage) << ": " << got << want;
      if (!first.defined()) first = got;
      EXPECT_TRUE(at::equal(got, first)) << "world " << world << " stage "
                                         << static_cast<int>(stage);  // bit for bit
    }
  }
}

TEST(CorrelatedNoise, AChargeNeverAppliedStaysInTheHistory) {
  // Charges 0, 1, 3, 4, 5: charge 2 failed after it was charged. The updates at 3, 4 and 5 are
  // those of the run that applied 2, which are C⁻¹z's rows 3..5.
  const auto strategy = privacy::BandedToeplitz::sqrt_prefix_sum(3);
  const at::Tensor want = dense_reference(strategy);
  const at::Tensor got = noise_of_run(1, zero::Stage::k0, strategy, {0, 1, 3, 4, 5});
  EXPECT_TRUE(at::allclose(got.narrow(0, 2, 3), want.narrow(0, 3, 3), 1e-4, 1e-5));
  CorrelatedNoise noise(strategy, NoiseKey{false, kSeed, {}});
  EXPECT_THROW(noise.at(-1, kStd), std::invalid_argument);
  EXPECT_THROW(noise.at(0, -1.0), std::invalid_argument);
}

// Two units each keep their own history: the second unit's coordinates [15, 24) get the dense
// C⁻¹z of theirs; charges that go back, and a step applied twice, are refused; c_0 must be 1.
TEST(CorrelatedNoise, EachUnitKeepsItsOwnHistoryAndADrawIsNeverReused) {
  const auto strategy = privacy::BandedToeplitz::sqrt_prefix_sum(3);
  const at::Tensor want = dense_reference(strategy, 24);
  testing::run_ranks(2, std::chrono::seconds(120), [&](int rank, auto pg) {
    zero::ZeroConfig config;
    config.stage = zero::Stage::k2;
    config.optimizer.lr = kLr;
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
    std::vector<at::Tensor> first{at::randn({15}, gen).requires_grad_()};
    std::vector<at::Tensor> second{at::randn({9}, gen).requires_grad_()};
    zero::ZeroState state({{"u0", first, {"a"}, {0}}, {"u1", second, {"b"}, {15}}}, 24, config, pg);
    CorrelatedNoise noise(strategy, NoiseKey{false, kSeed, {}});
    at::Tensor before = state.full_parameters(1).clone();
    for (int64_t k = 0; k < kSteps; ++k) {
      for (int64_t u = 0; u < 2; ++u) {
        const int64_t padded = state.unit_at(u).flat().layout().padded_numel();
        state.add_unit_grad(u, torch::zeros({padded}), true, true);
      }
      CorrelatedNoise::Step step = noise.at(k, kStd);
      state.noisy_step(&step, kScale);
      const at::Tensor after = state.full_parameters(1).clone();
      const at::Tensor w = (after - before).narrow(0, 0, 9).to(at::kDouble) /
                           (-kLr * kScale * kStd);
      EXPECT_TRUE(at::allclose(w, want[k].narrow(0, 15, 9), 1e-4, 1e-5)) << "rank " << rank
                                                                          << " charge " << k;
      before = after;
      if (k == 2) {  // the same step again: its draws are never added twice
        for (int64_t u = 0; u < 2; ++u) {
          const int64_t padded = state.unit_at(u).flat().layout().padded_numel();
          state.add_unit_grad(u, torch::zeros({padded}), true, true);
        }
        EXPECT_THROW(state.noisy_step(&step, kScale), std::logic_error);
        state.zero_grad();
        EXPECT_THROW(noise.at(2, kStd), std::invalid_argument);  // goes back
        before = state.full_parameters(1).clone();
      }
    }
    EXPECT_EQ(noise.last(0), kSteps - 1);
    EXPECT_EQ(noise.last(1), kSteps - 1);
  });
  EXPECT_THROW(CorrelatedNoise(privacy::BandedToeplitz({2.0, 0.5}), NoiseKey{false, 1, {}}),
               std::invalid_argument);
}

// The general path with a second band of 0 (w_k = z_k exactly) against DP-SGD's StepNoise, and
// the one-band shortcut, which is StepNoise's own call, bit for bit.
TEST(CorrelatedNoise, OneBandIsDpSgdBitForBit) {
  const at::Tensor general =
      noise_of_run(2, zero::Stage::k3, privacy::BandedToeplitz({1.0, 0.0}), consecutive());
  for (zero::Stage stage : {zero::Stage::k0, zero::Stage::k3}) {
    const at::Tensor correlated =
        noise_of_run(2, stage, privacy::BandedToeplitz::identity(), consecutive());
    std::vector<at::Tensor> per_rank(2);
    testing::run_ranks(2, std::chrono::seconds(120), [&](int rank, auto pg) {
      zero::ZeroConfig config;
      config.stage = stage;
      config.optimizer.lr = kLr;
      zero::ZeroState state({{"unit", params(), {"a", "b", "c"}, {0, 5, 12}}}, kCoords, config,
                            pg);
      std::vector<at::Tensor> steps;
      at::Tensor before = state.full_parameters(0).clone();
      for (int64_t k = 0; k < kSteps; ++k) {
        const int64_t padded = state.unit_at(0).flat().layout().padded_numel();
        state.add_unit_grad(0, torch::zeros({padded}), true, true);
        StepNoise step(kStd, NoiseKey{false, kSeed, {}}, k);
        state.noisy_step(&step, kScale);
        const at::Tensor after = state.full_parameters(0).clone();
        steps.push_back((after - before).to(at::kDouble) / (-kLr * kScale * kStd));
        before = after;
      }
      per_rank[rank] = global(at::stack(steps), state.unit_at(0).flat().layout());
    });
    EXPECT_TRUE(at::equal(correlated, per_rank[0])) << static_cast<int>(stage);
    EXPECT_TRUE(at::allclose(general, per_rank[0], 1e-6, 1e-7)) << static_cast<int>(stage);
  }
}

}  // namespace
}  // namespace dpzero::dp
