// tests/cpp/accounting/rdp_test.cpp — the RDP accountant: log A_alpha against high-precision
// values, the closed-form edge cases, the (eps, delta) conversions against the formula evaluated
// by hand, monotonicity and bad-input properties. Published end-to-end values are checked in
// reference_cases_test.cpp.
#include <gtest/gtest.h>

#include <utility>

#include "tests/cpp/common/error_message.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "accounting/rdp.h"

namespace dpzero::accounting {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

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

// log A_alpha computed with mpmath at 50 significant digits (python3 + mpmath 1.3.0):
//  - integer alpha: the closed-form binomial sum of [MTZ19, §3.3] in exact mpmath arithmetic;
//  - fractional alpha: mp.quad of E_{z~N(0,sigma^2)}[L^alpha - 1 - alpha (L - 1)],
//    L = 1 + q expm1((2z - 1) / (2 sigma^2)), split at -40 sigma, 0, z0, 1, alpha, alpha + 40 sigma,
//    then log A = log1p(that) (the direct definition of A_alpha, independent of the series).
// The first five are the cases named in accounting_cases.json ("rdp_log_moment_check"); the
// others cover tiny q (A - 1 ~ 1e-11), q = 1/2 (slowly converging alternating tail), a large
// fractional order with a wide erfc transition, and large sigmas (the Gauss-Hermite branch).
struct LogACase {
  double q, sigma, alpha, log_a;
};
const LogACase kLogACases[] = {
    {1e-6, 1.0, 27.0, 8.7695113048484978803e-10},
    {1e-3, 1.0, 2.0, 1.7182803522145153698e-6},
    {0.01, 10.0, 20.0, 0.00019129699912842962637},
    {0.99, 0.1, 256.0, 3263997.4271140211413},
    {0.01, 2.5, 1.5, 6.5007089718803973675e-6},
    {1e-5, 1.0, 1.5, 6.443469797574268478e-11},
    {0.5, 1.0, 1.1, 0.015613047568549312276},
    {0.5, 20.0, 100.5, 3.3329870206892187597},
    {0.04, 1.5, 3.9, 0.0053162863787931897766},
    {0.9, 2.0, 2.5, 0.39202971110620596459},
    {0.2, 0.8, 7.25, 23.733634452307022912},
    {1e-5, 1e5, 1.5, 3.7500000001874987385e-21},
    {0.5, 1000.0, 1.01, 1.2625001609687251013e-9},
    {0.3, 1e5, 256.5, 2.949108765895696046e-7},
    {0.01, 300.0, 20.5, 2.2208501895826954553e-7},
};

TEST(ComputeLogA, MatchesHighPrecisionValues) {
  for (const LogACase& c : kLogACases) {
    const double got = compute_log_a(c.q, c.sigma, c.alpha);
    EXPECT_NEAR(got, c.log_a, 1e-10 * c.log_a)
        << "q=" << c.q << " sigma=" << c.sigma << " alpha=" << c.alpha;
  }
}

TEST(ComputeLogA, QZeroIsZeroAndQOneIsPlainGaussian) {
  for (const double alpha : {1.5, 2.0, 7.3, 32.0}) {
    EXPECT_EQ(compute_log_a(0.0, 1.3, alpha), 0.0);
    // Gaussian mechanism: RDP alpha / (2 sigma^2), i.e. log A = alpha (alpha-1) / (2 sigma^2).
    EXPECT_DOUBLE_EQ(compute_log_a(1.0, 2.0, alpha), alpha * (alpha - 1.0) / 8.0);
  }
}

TEST(ComputeLogA, ContinuousAcrossIntegerOrders) {
  // The fractional series and the integer sum are different formulas; they must meet.
  for (const double q : {0.001, 0.05, 0.5}) {
    for (const double alpha : {2.0, 5.0, 40.0}) {
      const double below = compute_log_a(q, 1.1, alpha - 1e-9);
      const double at = compute_log_a(q, 1.1, alpha);
      const double above = compute_log_a(q, 1.1, alpha + 1e-9);
      EXPECT_LE(below, at * (1 + 1e-7)) << q << " " << alpha;
      EXPECT_LE(at, above * (1 + 1e-7)) << q << " " << alpha;
      EXPECT_NEAR(below, at, 1e-6 * at) << q << " " << alpha;
      EXPECT_NEAR(above, at, 1e-6 * at) << q << " " << alpha;
    }
  }
}

TEST(ComputeLogA, ContinuousWhereTheFractionalMethodChanges) {
  // Fractional orders switch from the erfc series to Gauss-Hermite quadrature at sigma = 100
  // (for alpha <= 50); the two methods must agree there.
  for (const double q : {1e-4, 0.05, 0.6}) {
    for (const double alpha : {1.05, 4.5, 33.3}) {
      const double series = compute_log_a(q, 100.0 * (1.0 - 1e-13), alpha);
      const double quadrature = compute_log_a(q, 100.0, alpha);
      EXPECT_NEAR(series, quadrature, 1e-9 * quadrature) << q << " " << alpha;
    }
  }
}

TEST(ComputeRdp, IsStepsTimesPerStepValue) {
  const std::vector<double> orders = {1.5, 2.0, 10.0};
  const std::vector<double> rdp = compute_rdp(0.02, 1.1, 1000, orders);
  ASSERT_EQ(rdp.size(), orders.size());
  for (std::size_t i = 0; i < orders.size(); ++i) {
    const double per_step = compute_log_a(0.02, 1.1, orders[i]) / (orders[i] - 1.0);
    EXPECT_NEAR(rdp[i], 1000.0 * per_step, 1e-12 * rdp[i]);
  }
  EXPECT_EQ(compute_rdp(0.02, 1.1, 0, orders), std::vector<double>(3, 0.0));
  EXPECT_EQ(compute_rdp(0.0, 1.1, 500, orders), std::vector<double>(3, 0.0));
}

TEST(DefaultOrders, MatchTheDocumentedGrids) {
  const std::vector<double> opacus = opacus_default_orders();
  ASSERT_EQ(opacus.size(), 99u + 52u);
  EXPECT_DOUBLE_EQ(opacus.front(), 1.1);
  EXPECT_DOUBLE_EQ(opacus[98], 10.9);
  EXPECT_EQ(opacus[99], 12.0);
  EXPECT_EQ(opacus.back(), 63.0);
  const std::vector<double> tfp = tfp_default_orders();
  ASSERT_EQ(tfp.size(), 10u + 59u + 3u);
  EXPECT_EQ(tfp.front(), 1.25);
  EXPECT_EQ(tfp[9], 4.5);
  EXPECT_EQ(tfp[10], 5.0);
  EXPECT_EQ(tfp[68], 63.0);
  EXPECT_EQ(tfp.back(), 512.0);
}

TEST(RdpToEpsilon, IsBalleEtAlTheorem21MinimisedOverOrders) {
  // Values of r + log((a-1)/a) - (log(delta) + log(a)) / (a-1) evaluated in Python:
  // a=2, r=1, delta=1e-5: 11.126631103850338; a=2, r=1, delta=1e-6: 13.429216196844383;
  // a=10, r=0.5, delta=1e-6: 1.673853424894421.
  const RdpEpsilon single = rdp_to_epsilon({2.0}, {1.0}, 1e-5);
  EXPECT_NEAR(single.epsilon, 11.126631103850338, 1e-12);
  EXPECT_EQ(single.best_order, 2.0);
  EXPECT_TRUE(single.order_on_edge);
  const RdpEpsilon two = rdp_to_epsilon({2.0, 10.0}, {1.0, 0.5}, 1e-6);
  EXPECT_NEAR(two.epsilon, 1.673853424894421, 1e-12);
  EXPECT_EQ(two.best_order, 10.0);
}

TEST(RdpToDelta, IsTheInverseFormulaMinimisedOverOrdersAndCapped) {
  // exp((a-1)(r - eps + log(1 - 1/a)) - log(a)) evaluated in Python for eps = 3:
  // a=2, r=1: 0.03383382080915317; a=10, r=0.5: 6.554759205176379e-12.
  EXPECT_NEAR(rdp_to_delta({2.0}, {1.0}, 3.0), 0.03383382080915317, 1e-15);
  EXPECT_NEAR(rdp_to_delta({2.0, 10.0}, {1.0, 0.5}, 3.0), 6.554759205176379e-12, 1e-24);
  EXPECT_EQ(rdp_to_delta({2.0}, {50.0}, 0.0), 1.0);
}

TEST(RdpToEpsilon, OrderOnEdgeFlagsTheGridEnds) {
  // Tiny privacy loss: the largest order wins; huge loss: the smallest order wins.
  std::vector<double> orders = {2.0, 4.0, 8.0, 16.0};
  RdpAccountant small(orders);
  small.step(1e-4, 5.0, 10);
  const RdpEpsilon low = small.epsilon(1e-5);
  EXPECT_EQ(low.best_order, 16.0);
  EXPECT_TRUE(low.order_on_edge);
  RdpAccountant large(orders);
  large.step(1.0, 0.3, 100);
  const RdpEpsilon high = large.epsilon(1e-5);
  EXPECT_EQ(high.best_order, 2.0);
  EXPECT_TRUE(high.order_on_edge);
  RdpAccountant middle(opacus_default_orders());
  middle.step(0.04, 1.5, 2250);
  EXPECT_FALSE(middle.epsilon(1e-5).order_on_edge);
}

TEST(RdpAccountant, ComposesPhasesAdditively) {
  const std::vector<double> orders = {1.5, 3.0, 12.0};
  RdpAccountant accountant(orders);
  accountant.step(0.01, 1.0, 100);
  accountant.add(Phase{0.02, 2.0, 50});
  const std::vector<double> a = compute_rdp(0.01, 1.0, 100, orders);
  const std::vector<double> b = compute_rdp(0.02, 2.0, 50, orders);
  for (std::size_t i = 0; i < orders.size(); ++i) EXPECT_EQ(accountant.rdp()[i], a[i] + b[i]);
  ASSERT_EQ(accountant.phases().size(), 2u);
  EXPECT_EQ(accountant.phases()[1].steps, 50);
  EXPECT_EQ(accountant.epsilon(1e-5).epsilon,
            rdp_to_epsilon(orders, accountant.rdp(), 1e-5).epsilon);
}

// Note [nothing released]: no step that samples is (0, 0)-DP, as the PRV accountant says
// (PrvProperties.NothingToAccountGivesZero); Theorem 21 alone would give 0.10 at delta = 1e-5.
TEST(RdpAccountant, NothingToAccountGivesZero) {
  RdpAccountant empty;
  const std::vector<double> zeros(empty.orders().size(), 0.0);
  ASSERT_GT(rdp_to_epsilon(empty.orders(), zeros, 1e-5).epsilon, 0.1);  // Theorem 21 alone
  EXPECT_EQ(empty.epsilon(1e-5).epsilon, 0.0);
  EXPECT_FALSE(empty.epsilon(1e-5).order_on_edge);
  EXPECT_EQ(empty.get_epsilon(1e-9), 0.0);
  EXPECT_EQ(empty.delta(0.0), 0.0);
  RdpAccountant unused;
  unused.step(0.0, 1.0, 1000);  // q = 0: never sampled
  unused.step(0.5, 1.0, 0);     // no steps
  EXPECT_EQ(unused.rdp(), zeros);
  EXPECT_EQ(unused.get_epsilon(1e-5), 0.0);
  EXPECT_EQ(unused.delta(0.5), 0.0);
  RdpAccountant once;
  once.step(0.01, 1.0, 1);
  EXPECT_GT(once.get_epsilon(1e-5), 0.0);
  EXPECT_GT(once.delta(0.0), 0.0);
  // A step that samples goes through the conversion even where its curve is all zeros (2 sigma^2
  // overflows): the accountant says what Theorem 21 says, not (0, 0).
  RdpAccountant huge;
  huge.step(1.0, 1e160, 1);
  EXPECT_EQ(huge.get_epsilon(1e-5), rdp_to_epsilon(huge.orders(), huge.rdp(), 1e-5).epsilon);
  EXPECT_GT(huge.get_epsilon(1e-5), 0.0);
}

TEST(RdpProperties, EpsilonGrowsWithStepsAndQAndFallsWithSigma) {
  double previous = 0.0;
  for (const int64_t steps : {1, 10, 100, 1000, 10000, 100000}) {
    const double eps = rdp_epsilon(0.01, 1.0, steps, 1e-5);
    EXPECT_GT(eps, previous) << steps;
    previous = eps;
  }
  previous = 0.0;
  for (const double q : {1e-4, 1e-3, 0.01, 0.1, 0.5, 1.0}) {
    const double eps = rdp_epsilon(q, 1.0, 100, 1e-5);
    EXPECT_GT(eps, previous) << q;
    previous = eps;
  }
  previous = std::numeric_limits<double>::infinity();
  for (const double sigma : {0.5, 0.8, 1.0, 2.0, 5.0, 20.0}) {
    const double eps = rdp_epsilon(0.01, sigma, 1000, 1e-5);
    EXPECT_LT(eps, previous) << sigma;
    previous = eps;
  }
}

TEST(RdpProperties, EpsilonIsNeverNegative) {
  EXPECT_EQ(rdp_epsilon(0.01, 1e6, 10, 0.5), 0.0);
  // q = 0: RDP 0, and for a large delta the conversion term alone is negative: clamped to 0.
  EXPECT_EQ(rdp_epsilon(0.0, 1.0, 1000, 0.9), 0.0);
  for (const double sigma : {1e3, 1e5, 1e7}) {
    for (const double delta : {1e-10, 1e-5, 0.1, 0.9}) {
      EXPECT_GE(rdp_epsilon(0.5, sigma, 1, delta), 0.0) << sigma << " " << delta;
    }
  }
}

TEST(RdpProperties, EpsilonAndDeltaRoundTrip) {
  RdpAccountant accountant;
  accountant.step(0.02, 1.2, 5000);
  for (const double delta : {1e-9, 1e-6, 1e-5, 1e-3}) {
    const double eps = accountant.epsilon(delta).epsilon;
    ASSERT_GT(eps, 0.0);
    EXPECT_NEAR(accountant.delta(eps), delta, 1e-9 * delta) << delta;
  }
  for (const double eps : {0.5, 1.0, 4.0, 10.0}) {
    const double delta = accountant.delta(eps);
    ASSERT_GT(delta, 0.0);
    ASSERT_LT(delta, 1.0);
    EXPECT_NEAR(accountant.epsilon(delta).epsilon, eps, 1e-9 * eps) << eps;
  }
}

TEST(RdpProperties, DeltaFallsWithEpsilonAndNeverExceedsOne) {
  RdpAccountant accountant;
  accountant.step(0.1, 0.7, 1000);
  double previous = 1.0;
  for (const double eps : {0.0, 1.0, 5.0, 20.0, 80.0}) {
    const double delta = accountant.delta(eps);
    EXPECT_LE(delta, previous) << eps;
    EXPECT_LE(delta, 1.0);
    EXPECT_GE(delta, 0.0);
    previous = delta;
  }
  EXPECT_EQ(accountant.delta(0.0), 1.0);
}

TEST(RdpBadInputs, ThrowWithTheValue) {
  const std::vector<double> orders = {2.0, 3.0};
  EXPECT_NE(invalid_argument_message([&] { compute_rdp(1.5, 1.0, 10, orders); }).find("1.5"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { compute_rdp(-0.1, 1.0, 10, orders); }).find("-0.1"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { compute_rdp(0.1, 0.0, 10, orders); }).find("got 0"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { compute_rdp(0.1, -2.5, 10, orders); }).find("-2.5"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { compute_rdp(0.1, 1.0, -7, orders); }).find("-7"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { compute_rdp(0.1, 1.0, 10, {}); }).find("empty"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { compute_rdp(0.1, 1.0, 10, {2.0, 1.0}); }).find("got 1"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { compute_rdp(0.1, 1.0, 10, {0.5}); }).find("0.5"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { compute_rdp(0.1, 1.0, 10, {kNaN}); }).find("nan"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { compute_log_a(0.1, 1.0, 0.9); }).find("0.9"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { RdpAccountant bad(std::vector<double>{}); })
                .find("empty"),
            std::string::npos);
  RdpAccountant accountant(orders);
  EXPECT_NE(invalid_argument_message([&] { accountant.step(2.0, 1.0, 1); }).find("got 2"),
            std::string::npos);
  EXPECT_TRUE(accountant.phases().empty());  // a rejected phase is not recorded
  for (const double delta : {0.0, 1.0, -1e-5, 1.5}) {
    EXPECT_NE(invalid_argument_message([&] { accountant.epsilon(delta); })
                  .find("got " + format_double(delta)),
              std::string::npos);
  }
  EXPECT_NE(invalid_argument_message([&] { accountant.delta(-1.0); }).find("got -1"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { rdp_to_epsilon({2.0}, {-0.5}, 1e-5); }).find("-0.5"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { rdp_to_epsilon({2.0}, {kNaN}, 1e-5); }).find("nan"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { rdp_to_epsilon({2.0, 3.0}, {1.0}, 1e-5); })
                .find("1 values for 2 orders"),
            std::string::npos);
}

TEST(RdpInfiniteCurve, InfiniteRdpAtAllOrdersGivesInfiniteEpsilon) {
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(rdp_to_epsilon({2.0, 3.0}, {inf, inf}, 1e-5).epsilon, inf);
  EXPECT_EQ(rdp_to_delta({2.0, 3.0}, {inf, inf}, 5.0), 1.0);
  // One finite order is enough for a finite bound.
  EXPECT_LT(rdp_to_epsilon({2.0, 3.0}, {inf, 0.1}, 1e-5).epsilon, inf);
}

}  // namespace
}  // namespace dpzero::accounting
