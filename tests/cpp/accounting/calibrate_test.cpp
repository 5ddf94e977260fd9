// tests/cpp/accounting/calibrate_test.cpp — noise calibration with the RDP accountant: the
// returned sigma / step count checked against RdpAccountant itself (the contract), edge cases and
// errors that name the target and bracket. Published sigmas are checked in
// reference_cases_test.cpp.
#include <gtest/gtest.h>

#include <utility>

#include "tests/cpp/common/error_message.h"

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "accounting/calibrate.h"

namespace dpzero::accounting {
namespace {

template <typename F>
std::string invalid_argument_message(F&& f) {
  return testing::error_message<std::invalid_argument>(std::forward<F>(f));
}

double rdp_epsilon(double q, double sigma, int64_t steps, double delta,
                   const std::vector<double>& orders = opacus_default_orders()) {
  RdpAccountant accountant(orders);
  accountant.step(q, sigma, steps);
  return accountant.epsilon(delta).epsilon;
}

TEST(NoiseMultiplierForEpsilon, MeetsTargetWithinTolerance) {
  struct Case {
    double target, delta, q;
    int64_t steps;
  };
  for (const Case& c : {Case{1.0, 1e-5, 0.01, 1000}, Case{3.0, 1e-6, 0.001, 50000},
                        Case{8.0, 1e-5, 0.2, 300}, Case{0.5, 1e-5, 1.0, 10}}) {
    CalibrationOptions options;
    options.epsilon_tolerance = 0.005;
    const double sigma = noise_multiplier_for_epsilon(c.target, c.delta, c.q, c.steps, options);
    const double eps = rdp_epsilon(c.q, sigma, c.steps, c.delta);
    EXPECT_LE(eps, c.target) << c.target << " " << c.q;
    EXPECT_GE(eps, c.target - options.epsilon_tolerance) << c.target << " " << c.q;
  }
}

TEST(NoiseMultiplierForEpsilon, SmallerTargetNeedsMoreNoise) {
  double previous = 0.0;
  for (const double target : {20.0, 8.0, 2.0, 0.5}) {
    const double sigma = noise_multiplier_for_epsilon(target, 1e-5, 0.01, 5000);
    EXPECT_GT(sigma, previous) << target;
    previous = sigma;
  }
}

TEST(NoiseMultiplierForEpsilon, UsesTheGivenOrders) {
  CalibrationOptions options;
  options.orders = {2.0, 4.0, 8.0, 16.0, 32.0};
  const double sigma = noise_multiplier_for_epsilon(2.0, 1e-5, 0.02, 2000, options);
  const double eps = rdp_epsilon(0.02, sigma, 2000, 1e-5, options.orders);
  EXPECT_LE(eps, 2.0);
  EXPECT_GE(eps, 2.0 - options.epsilon_tolerance);
}

TEST(NoiseMultiplierForEpsilon, ExplicitBracket) {
  CalibrationOptions options;
  options.sigma_min = 0.5;
  options.sigma_max = 4.0;
  const double sigma = noise_multiplier_for_epsilon(8.0, 1e-5, 0.04, 2000, options);
  EXPECT_GT(sigma, 0.5);
  EXPECT_LE(sigma, 4.0);
  EXPECT_LE(rdp_epsilon(0.04, sigma, 2000, 1e-5), 8.0);
  // A lower end that already meets the target is the answer.
  options.sigma_min = 3.0;
  options.sigma_max = 10.0;
  EXPECT_EQ(noise_multiplier_for_epsilon(8.0, 1e-5, 0.04, 2000, options), 3.0);
}

TEST(NoiseMultiplierForEpsilon, UnreachableTargetNamesTargetAndBracket) {
  CalibrationOptions options;
  options.sigma_max = 2.0;
  const std::string bracket_message = invalid_argument_message(
      [&] { noise_multiplier_for_epsilon(0.01, 1e-5, 0.04, 2000, options); });
  EXPECT_NE(bracket_message.find("target epsilon 0.01"), std::string::npos) << bracket_message;
  EXPECT_NE(bracket_message.find("[0, 2]"), std::string::npos) << bracket_message;
  // Automatic bracket: sigma would have to exceed 1e6.
  const std::string auto_message = invalid_argument_message(
      [&] { noise_multiplier_for_epsilon(1e-9, 1e-5, 1.0, 1000000); });
  EXPECT_NE(auto_message.find("target epsilon 1e-09"), std::string::npos) << auto_message;
  EXPECT_NE(auto_message.find(format_double(1e6) + "]"), std::string::npos) << auto_message;
}

TEST(NoiseMultiplierForEpsilon, BadInputsNameTheValue) {
  for (const double target : {0.0, -1.0}) {
    const std::string message = invalid_argument_message(
        [&] { noise_multiplier_for_epsilon(target, 1e-5, 0.01, 100); });
    EXPECT_NE(message.find("target epsilon"), std::string::npos) << message;
    EXPECT_NE(message.find("got " + format_double(target)), std::string::npos) << message;
  }
  EXPECT_NE(invalid_argument_message([] { noise_multiplier_for_epsilon(1.0, 2.0, 0.01, 100); })
                .find("got 2"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([] { noise_multiplier_for_epsilon(1.0, 1e-5, 1.5, 100); })
                .find("got 1.5"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([] { noise_multiplier_for_epsilon(1.0, 1e-5, 0.01, -4); })
                .find("got -4"),
            std::string::npos);
  // q = 0 or no steps: epsilon is 0 for every sigma, nothing to calibrate.
  EXPECT_NE(invalid_argument_message([] { noise_multiplier_for_epsilon(1.0, 1e-5, 0.0, 100); })
                .find("q = 0"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([] { noise_multiplier_for_epsilon(1.0, 1e-5, 0.1, 0); })
                .find("steps = 0"),
            std::string::npos);
  CalibrationOptions options;
  options.sigma_min = 5.0;
  options.sigma_max = 1.0;
  EXPECT_NE(invalid_argument_message(
                [&] { noise_multiplier_for_epsilon(1.0, 1e-5, 0.01, 100, options); })
                .find("[5, 1]"),
            std::string::npos);
  options = CalibrationOptions{};
  options.epsilon_tolerance = 0.0;
  EXPECT_NE(invalid_argument_message(
                [&] { noise_multiplier_for_epsilon(1.0, 1e-5, 0.01, 100, options); })
                .find("epsilon_tolerance"),
            std::string::npos);
}

TEST(StepsForEpsilon, IsTheLargestStepCountWithinTarget) {
  struct Case {
    double target, delta, q, sigma;
  };
  for (const Case& c : {Case{1.0, 1e-5, 0.01, 1.0}, Case{8.0, 1e-5, 0.04, 1.5},
                        Case{3.0, 1e-6, 0.001, 0.8}}) {
    const int64_t steps = steps_for_epsilon(c.target, c.delta, c.q, c.sigma);
    ASSERT_GT(steps, 0);
    EXPECT_LE(rdp_epsilon(c.q, c.sigma, steps, c.delta), c.target) << c.target;
    EXPECT_GT(rdp_epsilon(c.q, c.sigma, steps + 1, c.delta), c.target) << c.target;
  }
}

TEST(StepsForEpsilon, InvertsNoiseMultiplierForEpsilon) {
  // Calibrate sigma for 2000 steps; that sigma must allow at least those 2000 steps.
  const double sigma = noise_multiplier_for_epsilon(8.0, 1e-5, 0.04, 2000);
  EXPECT_GE(steps_for_epsilon(8.0, 1e-5, 0.04, sigma), 2000);
}

TEST(StepsForEpsilon, EdgeCases) {
  // One step already exceeds the target.
  EXPECT_EQ(steps_for_epsilon(0.1, 1e-5, 1.0, 0.5), 0);
  // q = 0: never any privacy loss.
  EXPECT_EQ(steps_for_epsilon(1.0, 1e-5, 0.0, 1.0), std::numeric_limits<int64_t>::max());
  EXPECT_NE(invalid_argument_message([] { steps_for_epsilon(-2.0, 1e-5, 0.1, 1.0); })
                .find("got -2"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([] { steps_for_epsilon(1.0, 1e-5, 0.1, 0.0); })
                .find("sigma"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([] { steps_for_epsilon(1.0, 0.0, 0.1, 1.0); })
                .find("delta"),
            std::string::npos);
}

// A PRV search whose probes reach the PRV method's refusal region (tiny sigma: FFT size cap)
// must treat those probes as "epsilon above target" and still return a sigma that meets it.
TEST(CalibratePrv, ProbesInPrvRefusalRegionCountAsAboveTarget) {
  CalibrationOptions options;
  options.accountant = AccountantKind::kPrv;
  options.sigma_min = 0.05;  // the first probe: PRV refuses here (grid far beyond its cap)
  const double sigma = noise_multiplier_for_epsilon(40.0, 1e-5, 1.0, 2000, options);
  PrvAccountant check;
  check.add(Phase{1.0, sigma, 2000});
  const double eps = check.epsilon(1e-5).upper;
  EXPECT_LE(eps, 40.0);
  EXPECT_GE(eps, 40.0 - 0.5);  // and not absurdly over-noised
}

TEST(CalibratePrv, StepsForEpsilonReportsPrvRefusalInsteadOfZero) {
  CalibrationOptions options;
  options.accountant = AccountantKind::kPrv;
  // delta = 1e-30 lies below the PRV FFT's round-off floor: the method refuses every probe.
  try {
    steps_for_epsilon(20.0, 1e-30, 0.01, 1.0, options);
    FAIL() << "expected a runtime_error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("PRV"), std::string::npos) << e.what();
  }
  // RDP answers the same question with a positive count.
  EXPECT_GT(steps_for_epsilon(20.0, 1e-30, 0.01, 1.0), 0);
}

}  // namespace
}  // namespace dpzero::accounting
