// tests/cpp/accounting/prv_test.cpp — the PRV accountant (accounting/prv.h) and its numerical
// pieces (accounting/prv_numerics.h), each checked against an independent reference:
//  * published values (tests/reference/accounting_cases.json): Opacus's PRV epsilon upper
//    bounds and PRV noise calibration, and the exact mu-GDP curve of the q = 1 composition;
//  * both directions of the neighbouring relation (remove and add, Note [PRV directions] in
//    prv.cpp): one step against mpmath quadrature, 300 steps against a rigorously rounded
//    numpy composition, and the reported bounds as the max over the two directions;
//  * identities of privacy random variables (E[e^-Y] = 1, E[e^{(a-1)Y}] = A_a of [MTZ19], and
//    the add direction's moments as the remove direction's reflected ones);
//  * the RDP accountant (PRV upper bound <= RDP epsilon);
//  * a pure-noise region of the FFT for the round-off estimate, an oversized window for the
//    Chernoff wrap-around bound;
// plus monotonicity, round trips and the documented failure modes.
#include <gtest/gtest.h>

#include "tests/cpp/common/error_message.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "accounting/calibrate.h"
#include "accounting/prv.h"
#include "accounting/prv_numerics.h"
#include "accounting/rdp.h"
#include "accounting/types.h"

namespace dpzero::accounting {
namespace {

using nlohmann::json;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

json load_reference() {
  std::ifstream in(DPZERO_REFERENCE_CASES);
  if (!in) throw std::runtime_error(std::string("cannot open ") + DPZERO_REFERENCE_CASES);
  return json::parse(in);
}

const json& reference() {
  static const json cases = load_reference();
  return cases;
}

PrvAccountant single(double q, double sigma, int64_t steps) {
  PrvAccountant accountant;
  accountant.step(q, sigma, steps);
  return accountant;
}

// Exact privacy curve of mu-GDP [Dong, Roth, Su 2019, Cor. 2.13]:
//   delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2),
// with Phi through erfc and e^eps folded into the log of the second term (no overflow).
double gdp_delta(double mu, double eps) {
  const double a = 0.5 * std::erfc((eps / mu - mu / 2.0) / std::sqrt(2.0));
  const double b = std::exp(eps + std::log(0.5 * std::erfc((eps / mu + mu / 2.0) / std::sqrt(2.0))));
  return a - b;
}

// ---------------------------------------------------------------------------------------------
// Published reference values
// ---------------------------------------------------------------------------------------------

TEST(PrvReference, EpsilonUpperMatchesPublishedValues) {
  const json& cases = reference().at("prv_epsilon_upper");
  ASSERT_FALSE(cases.empty());
  for (const json& c : cases) {
    const double q = c.at("q");
    const double sigma = c.at("sigma");
    const int64_t steps = c.at("steps");
    const double delta = c.at("delta");
    const double expected = c.at("epsilon");
    const double tol = c.at("abs_tol");
    PrvOptions options;
    options.eps_error = 0.01;
    options.delta_error = delta / 1000.0;
    const PrvEpsilon eps = single(q, sigma, steps).epsilon(delta, options);
    EXPECT_NEAR(eps.upper, expected, tol)
        << "q = " << q << ", sigma = " << sigma << ", steps = " << steps << ", delta = " << delta;
    // The defaults are the same options.
    EXPECT_EQ(single(q, sigma, steps).epsilon(delta).upper, eps.upper);
  }
}

TEST(PrvReference, NoiseMultiplierMatchesPublishedValues) {
  const json& cases = reference().at("prv_noise_multiplier");
  ASSERT_FALSE(cases.empty());
  for (const json& c : cases) {
    const double q = c.at("q");
    // Opacus: steps = int(epochs / sample_rate), truncation of the double quotient.
    const int64_t steps = c.contains("steps") ? c.at("steps").get<int64_t>()
                                              : static_cast<int64_t>(c.at("epochs").get<double>() / q);
    CalibrationOptions options;
    options.accountant = AccountantKind::kPrv;
    const double sigma = noise_multiplier_for_epsilon(c.at("target_epsilon"), c.at("delta"), q,
                                                      steps, options);
    EXPECT_NEAR(sigma, c.at("sigma").get<double>(), c.at("abs_tol").get<double>())
        << "q = " << q << ", steps = " << steps;
  }
}

TEST(PrvReference, GaussianExactCompositionIsBracketed) {
  const json& cases = reference().at("gaussian_exact").at("cases");
  ASSERT_FALSE(cases.empty());
  for (const json& c : cases) {
    PrvAccountant accountant;
    double mu2 = 0.0;  // mu^2 = sum steps / sigma^2
    if (c.contains("phases")) {
      for (const json& p : c.at("phases")) {
        accountant.step(1.0, p.at("sigma"), p.at("steps"));
        mu2 += p.at("steps").get<double>() / std::pow(p.at("sigma").get<double>(), 2);
      }
    } else {
      accountant.step(1.0, c.at("sigma"), c.at("steps"));
      mu2 = c.at("steps").get<double>() / std::pow(c.at("sigma").get<double>(), 2);
    }
    const double mu = std::sqrt(mu2);
    for (const double eps : c.at("eps").get<std::vector<double>>()) {
      const double exact = gdp_delta(mu, eps);
      const PrvDelta d = accountant.delta(eps);
      EXPECT_LE(d.lower, exact) << "mu = " << mu << ", eps = " << eps;
      EXPECT_GE(d.upper, exact) << "mu = " << mu << ", eps = " << eps;
      EXPECT_LE(d.lower, d.estimate);
      EXPECT_LE(d.estimate, d.upper);
      // Not vacuous: the bracket is the eps_error shift of a steep curve plus 2 delta_error.
      EXPECT_LT(d.upper - d.lower, 0.02 + 1e-9) << "mu = " << mu << ", eps = " << eps;
      // The estimate itself is close to the exact value (discretisation error is second order).
      EXPECT_NEAR(d.estimate, exact, 1e-4 * exact + 1e-9) << "mu = " << mu << ", eps = " << eps;
    }
  }
}

// Exact delta(eps) of each direction of one step. Computed for this test with mpmath 1.3.0
// (mp.dps = 50) by quadrature over x of
//   remove: int p(x) (1 - e^{eps - L(x)})_+ dx,   add: int q0(x) (1 - e^{eps + L(x)})_+ dx,
// p = (1-q) npdf(x, 0, s) + q npdf(x, 1, s), q0 = npdf(x, 0, s), L = log(p / q0), i.e.
// E_P[(1 - e^{eps - loss})_+] for P = p, loss = L (remove) and P = q0, loss = -L (add). The
// kink x* (L(x*) = eps, resp. -eps) was found by 250 bisection steps on [-200, 200], and
// mp.quad integrated over [x*, x* + s/2, x* + s, ..., x* + 32 s, inf] (remove), resp.
// [-inf, x* - 32 s, ..., x* - s/2, x*] (add). Cross-check: the closed forms
// P(L > eps) - e^eps Q(L > eps) through mp.ncdf agreed to >= 42 digits. The add direction is 0
// exactly for eps >= -log(1 - q) (its loss never exceeds -log(1-q)); at eps = 0 both are the
// total variation distance.
struct SingleStepCase {
  double q;
  double sigma;
  double eps;
  double remove;
  double add;
};

const std::vector<SingleStepCase>& single_step_cases() {
  static const std::vector<SingleStepCase> cases = {
      {0.01, 0.8, 0.05, 8.8311969351709169e-4, 0.0},
      {0.01, 0.8, 0.005, 3.6111305612907242e-3, 1.4634090022407109e-3},
      {0.01, 0.8, 0.0, 4.6802894190259892e-3, 4.6802894190259892e-3},
      {0.3, 1.0, 0.05, 0.10047872446166875, 0.086911348067390232},
      {0.5, 0.9, 0.1, 0.18340020952002300, 0.16155989788828706},
      {0.1, 0.6, 0.05, 0.050939991343175000, 0.024525019782850650},
      {0.01, 0.8, 2.0, 5.6081461454759810e-9, 0.0},  // large eps
      {0.2, 0.5, 5.0, 8.8424261150562568e-4, 0.0},  // large eps
  };
  return cases;
}

TEST(PrvReference, SingleStepBothDirectionsMatchQuadrature) {
  for (const SingleStepCase& c : single_step_cases()) {
    const std::vector<Phase> phases = {Phase{c.q, c.sigma, 1}};
    const PrvDelta remove =
        prv_detail::directional_delta(phases, prv_detail::PrvDirection::kRemove, c.eps);
    const PrvDelta add =
        prv_detail::directional_delta(phases, prv_detail::PrvDirection::kAdd, c.eps);
    // Each direction's bounds hold its own exact curve.
    EXPECT_LE(remove.lower, c.remove) << c.q << " " << c.sigma << " " << c.eps;
    EXPECT_GE(remove.upper, c.remove) << c.q << " " << c.sigma << " " << c.eps;
    EXPECT_LE(add.lower, c.add) << c.q << " " << c.sigma << " " << c.eps;
    EXPECT_GE(add.upper, c.add) << c.q << " " << c.sigma << " " << c.eps;
    // The accountant's bounds hold the privacy profile, the max of the two.
    const double worst = std::max(c.remove, c.add);
    const PrvDelta d = single(c.q, c.sigma, 1).delta(c.eps);
    EXPECT_LE(d.lower, worst) << c.q << " " << c.sigma << " " << c.eps;
    EXPECT_GE(d.upper, worst) << c.q << " " << c.sigma << " " << c.eps;
    EXPECT_LE(d.lower, d.estimate);
    EXPECT_LE(d.estimate, d.upper);
    // Not vacuous: a single step's curve shifted by eps_error = 0.01 either way.
    EXPECT_LT(d.upper - d.lower, 0.01 + 0.5 * worst) << c.q << " " << c.sigma << " " << c.eps;
  }
}

TEST(PrvReference, ComposedBothDirectionsMatchRoundedComposition) {
  // q = 0.01, sigma = 0.8, 300 steps. Reference brackets computed for this test with numpy
  // 2.4.6 / scipy 1.17.1: each step's loss (cell masses from the closed-form CDFs (PRV-3) and
  // (PRV-4) through scipy.special.ndtr) rounded UP to the grid k h (pessimistic: the composed
  // sum is >= the true one pointwise, so its delta is >= the true delta, as
  // x -> (1 - e^{eps - x})_+ is non-decreasing) and rounded DOWN (optimistic, <=), h = 2e-6;
  // 300-fold composition by numpy.fft.rfft / irfft (power 300 of the spectrum) on 2^23 points,
  // window about [-3.2, 13.6] (remove) and [-13.6, 3.2] (add); 300 times the per-step tail beyond
  // |loss| = 12 (< 1e-38 per step), the Chernoff bound of the composed mass outside the window
  // (< 1e-26, from the discrete steps' moment generating function) and twice the FFT's negative
  // mass (< 4e-14) added to the pessimistic and subtracted from the optimistic value; printed
  // rounded outwards to 1e-11.
  // So the exact delta of each direction lies in [down, up].
  // The add direction is the SMALLER one here (at eps = 0 the two agree, both being the total
  // variation distance); with the max over directions the accountant must still bracket both.
  struct Case {
    double eps;
    double remove_down, remove_up;
    double add_down, add_up;
  };
  const std::vector<Phase> phases = {Phase{0.01, 0.8, 300}};
  const PrvAccountant accountant = single(0.01, 0.8, 300);
  for (const Case& c : {Case{0.0, 0.12582993606, 0.12607335939, 0.12581114206, 0.12609214776},
                        Case{0.05, 0.10661731455, 0.10683524020, 0.10342661586, 0.10368261116},
                        Case{0.5, 0.01687473261, 0.01692192090, 0.00511763327, 0.00514844361},
                        Case{1.0, 0.00142770587, 0.00143205361, 0.00000150656, 0.00000152878}}) {
    const PrvDelta remove =
        prv_detail::directional_delta(phases, prv_detail::PrvDirection::kRemove, c.eps);
    const PrvDelta add =
        prv_detail::directional_delta(phases, prv_detail::PrvDirection::kAdd, c.eps);
    EXPECT_LE(remove.lower, c.remove_down) << c.eps;
    EXPECT_GE(remove.upper, c.remove_up) << c.eps;
    EXPECT_LE(add.lower, c.add_down) << c.eps;
    EXPECT_GE(add.upper, c.add_up) << c.eps;
    // The estimates are much closer than eps_error makes the bounds (discretisation error is
    // second order): within the reference bracket widened by 1e-5.
    EXPECT_NEAR(remove.estimate, 0.5 * (c.remove_down + c.remove_up),
                0.5 * (c.remove_up - c.remove_down) + 1e-5)
        << c.eps;
    EXPECT_NEAR(add.estimate, 0.5 * (c.add_down + c.add_up), 0.5 * (c.add_up - c.add_down) + 1e-5)
        << c.eps;
    const PrvDelta d = accountant.delta(c.eps);
    EXPECT_LE(d.lower, std::max(c.remove_down, c.add_down)) << c.eps;
    EXPECT_GE(d.upper, std::max(c.remove_up, c.add_up)) << c.eps;
  }
}

// ---------------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------------

struct PrvRun {
  double q;
  double sigma;
  int64_t steps;
};

const std::vector<PrvRun>& property_runs() {
  static const std::vector<PrvRun> runs = {
      {0.01, 1.0, 1000}, {0.1, 2.0, 300}, {0.004, 0.9, 5000}, {1.0, 5.0, 20}, {0.5, 1.2, 10}};
  return runs;
}

TEST(PrvProperties, EstimateLiesWithinBounds) {
  for (const PrvRun& r : property_runs()) {
    const PrvAccountant accountant = single(r.q, r.sigma, r.steps);
    for (const double delta : {1e-3, 1e-5, 1e-8}) {
      const PrvEpsilon e = accountant.epsilon(delta);
      EXPECT_GE(e.lower, 0.0);
      EXPECT_LE(e.lower, e.estimate) << r.q << " " << r.sigma << " " << r.steps << " " << delta;
      EXPECT_LE(e.estimate, e.upper) << r.q << " " << r.sigma << " " << r.steps << " " << delta;
      // The width is 2 eps_error plus the effect of +-delta_error.
      EXPECT_LT(e.upper - e.lower, 0.05);
    }
    for (const double eps : {0.0, 0.5, 2.0}) {
      const PrvDelta d = accountant.delta(eps);
      EXPECT_GE(d.lower, 0.0);
      EXPECT_LE(d.lower, d.estimate);
      EXPECT_LE(d.estimate, d.upper);
      EXPECT_LE(d.upper, 1.0);
    }
  }
}

TEST(PrvProperties, UpperBoundIsBelowRdp) {
  for (const PrvRun& r : property_runs()) {
    for (const double delta : {1e-5, 1e-7}) {
      RdpAccountant rdp;
      rdp.step(r.q, r.sigma, r.steps);
      const double prv_upper = single(r.q, r.sigma, r.steps).epsilon(delta).upper;
      EXPECT_LE(prv_upper, rdp.epsilon(delta).epsilon)
          << r.q << " " << r.sigma << " " << r.steps << " " << delta;
    }
  }
}

TEST(PrvProperties, EpsilonIsMonotone) {
  const double delta = 1e-5;
  auto eps = [&](double q, double sigma, int64_t steps) {
    return single(q, sigma, steps).epsilon(delta).estimate;
  };
  double previous = 0.0;
  for (const int64_t steps : {1, 10, 100, 1000, 5000}) {
    const double e = eps(0.02, 1.0, steps);
    EXPECT_GT(e, previous) << "steps = " << steps;
    previous = e;
  }
  previous = 0.0;
  for (const double q : {0.001, 0.01, 0.05, 0.2, 1.0}) {
    const double e = eps(q, 2.0, 200);
    EXPECT_GT(e, previous) << "q = " << q;
    previous = e;
  }
  previous = std::numeric_limits<double>::infinity();
  for (const double sigma : {0.7, 1.0, 1.5, 3.0, 10.0}) {
    const double e = eps(0.05, sigma, 500);
    EXPECT_LT(e, previous) << "sigma = " << sigma;
    previous = e;
  }
  // delta(eps) falls as eps grows.
  const PrvAccountant accountant = single(0.05, 1.0, 500);
  double previous_delta = 1.0;
  for (const double e : {0.0, 0.5, 1.0, 2.0, 4.0}) {
    const double d = accountant.delta(e).estimate;
    EXPECT_LT(d, previous_delta) << "eps = " << e;
    previous_delta = d;
  }
}

TEST(PrvProperties, DeltaAndEpsilonRoundTrip) {
  // Each bound is a max over the two directions (Note [PRV directions]); the round trip holds
  // for the max because it holds for the direction attaining it and the other one stays below.
  std::vector<PrvRun> runs = property_runs();
  runs.push_back({0.01, 0.8, 300});  // large delta, where both directions are close
  for (const PrvRun& r : runs) {
    const PrvAccountant accountant = single(r.q, r.sigma, r.steps);
    const std::vector<double> deltas =
        r.steps == 300 && r.q == 0.01 ? std::vector<double>{0.1, 0.01, 1e-5}
                                      : std::vector<double>{1e-4, 1e-6};
    for (const double delta : deltas) {
      PrvOptions options;
      options.delta_error = delta / 1000.0;  // the same budget in both directions
      const PrvEpsilon e = accountant.epsilon(delta, options);
      ASSERT_GT(e.lower, 0.0);
      // The estimates invert each other.
      EXPECT_NEAR(accountant.delta(e.estimate, options).estimate, delta, 1e-6 * delta);
      // eps upper = eps~(delta - delta_error) + eta, so delta's upper bound there is delta again;
      // the same for the lower bounds.
      EXPECT_NEAR(accountant.delta(e.upper, options).upper, delta, 1e-6 * delta);
      EXPECT_NEAR(accountant.delta(e.lower, options).lower, delta, 1e-6 * delta);
    }
  }
}

TEST(PrvProperties, ReportsTheWorseOfBothDirections) {
  // (D1) and (D2) of Note [PRV directions]: the accountant's bounds are the elementwise max of
  // the two directions' bounds, each computed with the full error budget.
  namespace pd = prv_detail;
  std::vector<PrvRun> runs = property_runs();
  runs.push_back({0.01, 0.8, 300});
  runs.push_back({0.01, 0.8, 1});
  for (const PrvRun& r : runs) {
    const PrvAccountant accountant = single(r.q, r.sigma, r.steps);
    for (const double eps : {0.0, 0.005, 0.05, 0.5, 2.0}) {
      const PrvDelta d = accountant.delta(eps);
      const PrvDelta remove =
          pd::directional_delta(accountant.phases(), pd::PrvDirection::kRemove, eps);
      const PrvDelta add =
          pd::directional_delta(accountant.phases(), pd::PrvDirection::kAdd, eps);
      EXPECT_EQ(d.lower, std::max(remove.lower, add.lower))
          << r.q << " " << r.steps << " " << eps;
      EXPECT_EQ(d.estimate, std::max(remove.estimate, add.estimate));
      EXPECT_EQ(d.upper, std::max(remove.upper, add.upper));
    }
    for (const double delta : {1e-3, 1e-5}) {
      const PrvEpsilon e = accountant.epsilon(delta);
      const PrvEpsilon remove =
          pd::directional_epsilon(accountant.phases(), pd::PrvDirection::kRemove, delta);
      const PrvEpsilon add =
          pd::directional_epsilon(accountant.phases(), pd::PrvDirection::kAdd, delta);
      EXPECT_EQ(e.lower, std::max(remove.lower, add.lower))
          << r.q << " " << r.steps << " " << delta;
      EXPECT_EQ(e.estimate, std::max(remove.estimate, add.estimate));
      EXPECT_EQ(e.upper, std::max(remove.upper, add.upper));
    }
  }
  // q = 1: the two directions are the same Gaussian PLRV and give identical results.
  const std::vector<Phase> gaussian = {Phase{1.0, 2.0, 50}};
  const PrvDelta remove = pd::directional_delta(gaussian, pd::PrvDirection::kRemove, 1.0);
  const PrvDelta add = pd::directional_delta(gaussian, pd::PrvDirection::kAdd, 1.0);
  EXPECT_EQ(remove.lower, add.lower);
  EXPECT_EQ(remove.estimate, add.estimate);
  EXPECT_EQ(remove.upper, add.upper);
  // A run mixing q = 1 and q < 1 phases has two different directions and still works.
  PrvAccountant mixed;
  mixed.step(1.0, 5.0, 10);
  mixed.step(0.02, 1.0, 200);
  const PrvEpsilon e = mixed.epsilon(1e-5);
  EXPECT_LE(e.lower, e.estimate);
  EXPECT_LE(e.estimate, e.upper);
  EXPECT_GT(e.estimate, single(0.02, 1.0, 200).epsilon(1e-5).estimate);
}

TEST(PrvProperties, PhasesComposeInAnyOrderAndSplitAnywhere) {
  PrvAccountant ab;
  ab.step(0.02, 1.0, 300);
  ab.step(0.1, 3.0, 50);
  PrvAccountant ba;
  ba.step(0.1, 3.0, 50);
  ba.step(0.02, 1.0, 300);
  PrvAccountant split;
  split.step(0.02, 1.0, 100);
  split.step(0.1, 3.0, 50);
  split.step(0.02, 1.0, 200);
  const PrvEpsilon e_ab = ab.epsilon(1e-5);
  EXPECT_NEAR(e_ab.upper, ba.epsilon(1e-5).upper, 1e-9);  // FFT products in another order
  EXPECT_NEAR(e_ab.upper, split.epsilon(1e-5).upper, 1e-9);
  // More phases cost more privacy than either alone.
  EXPECT_GT(e_ab.estimate, single(0.02, 1.0, 300).epsilon(1e-5).estimate);
  EXPECT_GT(e_ab.estimate, single(0.1, 3.0, 50).epsilon(1e-5).estimate);
  EXPECT_EQ(split.phases().size(), 3u);
}

TEST(PrvProperties, NothingToAccountGivesZero) {
  PrvAccountant empty;
  const PrvEpsilon e = empty.epsilon(1e-5);
  EXPECT_EQ(e.lower, 0.0);
  EXPECT_EQ(e.estimate, 0.0);
  EXPECT_EQ(e.upper, 0.0);
  PrvAccountant unused;
  unused.step(0.0, 1.0, 1000);  // q = 0: never sampled
  unused.step(0.5, 1.0, 0);     // no steps
  EXPECT_EQ(unused.epsilon(1e-5).upper, 0.0);
  EXPECT_EQ(unused.delta(0.0).upper, 0.0);
}

TEST(PrvProperties, EpsilonIsNeverNegative) {
  // Barely private runs: the estimate would be negative without the clamp at 0.
  for (const PrvRun& r : std::vector<PrvRun>{{1e-4, 50.0, 1}, {1e-3, 20.0, 10}, {1.0, 1000.0, 1}}) {
    for (const double delta : {0.5, 0.1, 1e-3}) {
      const PrvEpsilon e = single(r.q, r.sigma, r.steps).epsilon(delta);
      EXPECT_GE(e.lower, 0.0);
      EXPECT_GE(e.estimate, 0.0);
      EXPECT_GE(e.upper, 0.0);
      EXPECT_TRUE(std::isfinite(e.upper));
      EXPECT_LE(e.upper, 0.1) << r.q << " " << r.sigma << " " << delta;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Failure modes and bad inputs
// ---------------------------------------------------------------------------------------------

TEST(PrvFailure, VeryLargeEpsilonAsksForLargerEpsError) {
  // sigma = 0.3, q = 1, 10^4 steps: eps ~ 10^4; the lattice would need ~10^8 points.
  const PrvAccountant accountant = single(1.0, 0.3, 10000);
  const std::string message =
      testing::error_message<std::runtime_error>([&] { accountant.epsilon(1e-5); });
  EXPECT_NE(message.find("eps_error"), std::string::npos) << message;
  EXPECT_THROW(accountant.delta(1.0), std::runtime_error);
}

TEST(PrvFailure, TinySigmaIsRefusedNotHung) {
  // One step's PRV spans ~1/(2 sigma^2) = 5e5 nats: refused before any allocation.
  const PrvAccountant accountant = single(0.01, 1e-3, 10);
  EXPECT_THROW(accountant.epsilon(1e-5), std::runtime_error);
}

TEST(PrvFailure, TinyDeltaIsBelowRoundOff) {
  const PrvAccountant accountant = single(0.04, 1.5, 2249);
  const std::string message =
      testing::error_message<std::runtime_error>([&] { accountant.epsilon(1e-30); });
  EXPECT_NE(message.find("delta"), std::string::npos) << message;
}

TEST(PrvFailure, DeltaErrorAlmostDeltaCannotCertify) {
  PrvOptions options;
  options.delta_error = 1e-5 * (1.0 - 1e-12);  // valid, but leaves no room for round-off
  const std::string message = testing::error_message<std::runtime_error>(
      [&] { single(0.01, 1.0, 100).epsilon(1e-5, options); });
  EXPECT_NE(message.find("decrease delta_error"), std::string::npos) << message;
}

TEST(PrvFailure, MeshTooFineForMemoryAsksForLargerEpsError) {
  PrvOptions options;
  options.eps_error = 1e-6;
  const std::string message = testing::error_message<std::runtime_error>(
      [&] { single(0.04, 1.5, 2249).epsilon(1e-5, options); });
  EXPECT_NE(message.find("increase eps_error"), std::string::npos) << message;
}

TEST(PrvFailure, BadInputsNameTheValue) {
  const PrvAccountant accountant = single(0.01, 1.0, 100);
  for (const double delta : {0.0, 1.0, -0.5, 1.5}) {
    const std::string message =
        testing::error_message<std::invalid_argument>([&] { accountant.epsilon(delta); });
    EXPECT_NE(message.find(format_double(delta)), std::string::npos) << message;
  }
  EXPECT_NE(testing::error_message<std::invalid_argument>([&] { accountant.epsilon(kNaN); }).find("nan"),
            std::string::npos);
  for (const double eps_error : {0.0, -0.01, kNaN}) {
    PrvOptions options;
    options.eps_error = eps_error;
    const std::string message =
        testing::error_message<std::invalid_argument>([&] { accountant.epsilon(1e-5, options); });
    EXPECT_NE(message.find("eps_error"), std::string::npos) << message;
    EXPECT_NE(message.find(format_double(eps_error)), std::string::npos) << message;
    EXPECT_THROW(accountant.delta(1.0, options), std::invalid_argument);
  }
  {
    PrvOptions options;
    options.delta_error = -1e-9;
    const std::string message =
        testing::error_message<std::invalid_argument>([&] { accountant.epsilon(1e-5, options); });
    EXPECT_NE(message.find("delta_error"), std::string::npos) << message;
    EXPECT_NE(message.find("-1e-09"), std::string::npos) << message;
    EXPECT_THROW(accountant.delta(1.0, options), std::invalid_argument);
  }
  {
    PrvOptions options;
    options.delta_error = 1e-5;  // not smaller than delta
    const std::string message =
        testing::error_message<std::invalid_argument>([&] { accountant.epsilon(1e-5, options); });
    EXPECT_NE(message.find("1e-05"), std::string::npos) << message;
  }
  EXPECT_NE(testing::error_message<std::invalid_argument>([&] { accountant.delta(-1.0); }).find("-1"),
            std::string::npos);
  PrvAccountant bad;
  EXPECT_NE(testing::error_message<std::invalid_argument>([&] { bad.step(1.5, 1.0, 1); }).find("1.5"),
            std::string::npos);
  EXPECT_NE(testing::error_message<std::invalid_argument>([&] { bad.step(0.1, -2.0, 1); }).find("-2"),
            std::string::npos);
  EXPECT_NE(testing::error_message<std::invalid_argument>([&] { bad.step(0.1, 1.0, -3); }).find("-3"),
            std::string::npos);
  EXPECT_TRUE(bad.phases().empty());
}

// ---------------------------------------------------------------------------------------------
// Numerical pieces (prv_numerics.h)
// ---------------------------------------------------------------------------------------------

namespace pd = prv_detail;

TEST(PrvNumerics, GaussianCaseCdfIsTheGaussianPlrv) {
  // q = 1: Y ~ N(1/(2 sigma^2), 1/sigma^2).
  for (const double sigma : {0.5, 1.0, 7.0}) {
    const pd::SubsampledGaussianPrv prv(1.0, sigma);
    const double mean = 0.5 / (sigma * sigma);
    for (const double t : {-3.0, -0.2, 0.0, 0.1, 0.5, 2.0, 6.0}) {
      const double x = (t - mean) * sigma;
      EXPECT_NEAR(prv.cdf(t), 0.5 * std::erfc(-x / std::sqrt(2.0)), 1e-15);
      const double sf = 0.5 * std::erfc(x / std::sqrt(2.0));
      EXPECT_NEAR(prv.sf(t), sf, 1e-13 * sf + 1e-300);
    }
    EXPECT_NEAR(prv.truncated_mean(-50.0, 50.0), mean, 1e-13);
  }
}

TEST(PrvNumerics, CdfAndSurvivalAreComplementaryAndMonotone) {
  for (const double q : {1e-4, 0.01, 0.3, 0.999}) {
    for (const double sigma : {0.6, 1.5, 10.0}) {
      const pd::SubsampledGaussianPrv prv(q, sigma);
      EXPECT_EQ(prv.cdf(prv.support_lower()), 0.0);
      double previous = 0.0;
      for (int i = 1; i <= 400; ++i) {
        const double t = prv.support_lower() + 1e-6 * std::pow(1.06, i);
        const double c = prv.cdf(t);
        EXPECT_GE(c, previous) << q << " " << sigma << " " << t;
        EXPECT_NEAR(c + prv.sf(t), 1.0, 4e-16) << q << " " << sigma << " " << t;
        previous = c;
      }
    }
  }
}

TEST(PrvNumerics, DiscretePrvHasPrivacyLossIdentities) {
  // For a PRV Y of (P, Q): E[e^{-Y}] = E_P[Q/P] = 1, and E[e^{(a-1) Y}] = E_Q[(P/Q)^a] = A_a,
  // the Renyi moment of [MTZ19] computed independently by rdp.h. The discretised truncated
  // variable keeps both up to truncation (~1e-12) and its O(h^2) cell-collapse error.
  for (const double q : {0.003, 0.05, 0.5, 1.0}) {
    for (const double sigma : {0.8, 2.0}) {
      const pd::SubsampledGaussianPrv prv(q, sigma);
      const double tail = 1e-40;  // so that the tilted moments miss nothing either
      const double h = 1e-4;
      const pd::DiscretePrv d =
          pd::discretise(prv, h, prv.lower_quantile(tail), prv.upper_quantile(tail), 1 << 22);
      // The quantiles are bisection results mapped back through (PRV-1): equal to the target up
      // to the round trip, which in the far lower tail of q < 1 is accurate to ~1e-4 relative.
      EXPECT_LE(d.dropped, 2.0 * tail * (1.0 + 1e-3));
      EXPECT_LE(std::fabs(d.shift), 0.5 * h);
      EXPECT_NEAR(d.log_mgf(-1.0), 0.0, 1e-8) << q << " " << sigma;
      for (const double alpha : {2.0, 3.0}) {
        const double log_a = compute_log_a(q, sigma, alpha);
        EXPECT_NEAR(d.log_mgf(alpha - 1.0), log_a, 1e-8 * std::max(1.0, log_a))
            << q << " " << sigma << " " << alpha;
      }
    }
  }
}

TEST(PrvNumerics, AddDirectionCdfAndSurvivalAreComplementaryAndMonotone) {
  // (PRV-4): the add direction lives on (-inf, -log(1-q)); walk down from the supremum.
  for (const double q : {1e-4, 0.01, 0.3, 0.999}) {
    for (const double sigma : {0.6, 1.5, 10.0}) {
      const pd::SubsampledGaussianPrv prv(q, sigma, pd::PrvDirection::kAdd);
      EXPECT_EQ(prv.direction(), pd::PrvDirection::kAdd);
      EXPECT_EQ(prv.support_lower(), -std::numeric_limits<double>::infinity());
      EXPECT_EQ(prv.support_upper(), -std::log1p(-q));
      EXPECT_EQ(prv.cdf(prv.support_upper()), 1.0);
      EXPECT_EQ(prv.sf(prv.support_upper()), 0.0);
      double previous = 1.0;
      for (int i = 1; i <= 400; ++i) {
        const double t = prv.support_upper() - 1e-6 * std::pow(1.06, i);
        const double c = prv.cdf(t);
        EXPECT_LE(c, previous) << q << " " << sigma << " " << t;
        EXPECT_NEAR(c + prv.sf(t), 1.0, 4e-16) << q << " " << sigma << " " << t;
        previous = c;
      }
      // The quantiles bracket the bulk from the correct sides.
      EXPECT_LE(prv.cdf(prv.lower_quantile(1e-12)), 1e-12);
      EXPECT_LE(prv.sf(prv.upper_quantile(1e-12)), 1e-12);
      EXPECT_LT(prv.lower_quantile(1e-12), prv.upper_quantile(1e-12));
    }
  }
  // q = 1: the add direction is the remove direction (the symmetric Gaussian PLRV).
  const pd::SubsampledGaussianPrv gaussian(1.0, 2.0, pd::PrvDirection::kAdd);
  EXPECT_EQ(gaussian.direction(), pd::PrvDirection::kRemove);
}

TEST(PrvNumerics, AddDirectionMomentsAreTheReflectedRemoveMoments) {
  // With M0 = N(0, s^2), M1 the mixture: the add PRV Y' = log(M0/M1) under M0 and the remove
  // PRV Y = log(M1/M0) under M1 have E[e^{l Y'}] = int M0^{1+l} M1^{-l} = E[e^{(-1-l) Y}].
  // In particular E[e^{-a Y'}] = E_{M0}[(M1/M0)^a] = A_a, computed independently by rdp.h
  // [MTZ19], E[e^{-Y'}] = 1, and E[e^{(a-1) Y'}] = E_{M1}[(M0/M1)^a] = B_a <= A_a [MTZ19].
  // The two discretisations are independent (different supports, cells and mean shifts).
  for (const double q : {0.003, 0.05, 0.5}) {
    for (const double sigma : {0.8, 2.0}) {
      const double tail = 1e-40;
      const double h = 1e-4;
      const pd::SubsampledGaussianPrv remove_prv(q, sigma, pd::PrvDirection::kRemove);
      const pd::SubsampledGaussianPrv add_prv(q, sigma, pd::PrvDirection::kAdd);
      const pd::DiscretePrv remove =
          pd::discretise(remove_prv, h, remove_prv.lower_quantile(tail),
                         remove_prv.upper_quantile(tail), 1 << 22);
      const pd::DiscretePrv add = pd::discretise(add_prv, h, add_prv.lower_quantile(tail),
                                                 add_prv.upper_quantile(tail), 1 << 22);
      EXPECT_LE(add.dropped, 2.0 * tail * (1.0 + 1e-3)) << q << " " << sigma;
      EXPECT_LE(std::fabs(add.shift), 0.5 * h);
      // Means of PRVs are KL divergences: E[Y'] = KL(M0 || M1) > 0, E[Y] = KL(M1 || M0) > 0.
      EXPECT_GT(add.continuous_mean, 0.0);
      EXPECT_GT(remove.continuous_mean, 0.0);
      EXPECT_NEAR(add.log_mgf(-1.0), 0.0, 1e-8) << q << " " << sigma;
      for (const double lambda : {-3.0, -0.5, 0.5, 1.0, 2.0}) {
        const double expected = remove.log_mgf(-1.0 - lambda);
        EXPECT_NEAR(add.log_mgf(lambda), expected, 1e-8 * std::max(1.0, std::fabs(expected)))
            << q << " " << sigma << " " << lambda;
      }
      for (const double alpha : {2.0, 3.0}) {
        const double log_a = compute_log_a(q, sigma, alpha);
        EXPECT_NEAR(add.log_mgf(-alpha), log_a, 1e-8 * std::max(1.0, log_a))
            << q << " " << sigma << " " << alpha;
        EXPECT_LE(add.log_mgf(alpha - 1.0), log_a + 1e-8 * std::max(1.0, log_a))
            << q << " " << sigma << " " << alpha;
      }
    }
  }
}

TEST(PrvNumerics, LogMgfMatchesDirectSum) {
  const pd::SubsampledGaussianPrv prv(0.1, 1.0);
  const pd::DiscretePrv d =
      pd::discretise(prv, 1e-3, prv.lower_quantile(1e-12), prv.upper_quantile(1e-12), 1 << 22);
  for (const double lambda : {-7.0, -1.0, -0.01, 0.0, 0.3, 2.0, 9.0}) {
    long double direct = 0.0L;
    for (std::size_t i = 0; i < d.mass.size(); ++i) {
      direct += d.mass[i] * std::exp(static_cast<long double>(lambda) * d.value(i));
    }
    EXPECT_NEAR(d.log_mgf(lambda), static_cast<double>(std::log(direct)), 1e-12) << lambda;
  }
}

TEST(PrvNumerics, ChernoffWindowHoldsTheComposedMass) {
  // Compose on a window 3x wider than needed and measure the mass outside [a, b].
  const pd::SubsampledGaussianPrv prv(0.05, 1.2);
  const double h = 2e-4;
  std::vector<pd::DiscretePrv> phases = {
      pd::discretise(prv, h, prv.lower_quantile(1e-13), prv.upper_quantile(1e-13), 1 << 22)};
  const std::vector<int64_t> steps = {400};
  const double tail = 1e-9;
  const auto [a, b] = pd::chernoff_window(phases, steps, std::log(tail));
  ASSERT_LT(a, b);
  const double offset = 400.0 * phases[0].shift;
  const double width = (b - a) / h;
  const int64_t size = pd::fast_fft_size(static_cast<int64_t>(3.0 * width));
  const int64_t first = static_cast<int64_t>(std::floor((a - offset) / h - width));
  const pd::Composition c = pd::compose(phases, steps, first, size);
  double below = 0.0;
  double above = 0.0;
  for (std::size_t j = 0; j < c.prv.size(); ++j) {
    if (c.prv.value(j) < a) below += c.prv.pmf()[j];
    if (c.prv.value(j) > b) above += c.prv.pmf()[j];
  }
  EXPECT_LE(below, tail);
  EXPECT_LE(above, tail);
  // ... and is not absurdly loose.
  EXPECT_GT(above, 1e-3 * tail);
}

TEST(PrvNumerics, RoundoffEstimateCoversPureNoiseRegion) {
  // Compose on a window twice as long as the support (Chernoff at 1e-200): the second half holds
  // only FFT round-off. Its measured 1-norm per point, times the size of the window the
  // accountant would use (Chernoff at delta_error / 24), must stay below the round-off estimate
  // of that composition.
  struct Case {
    double q;
    double sigma;
    int64_t steps;
  };
  const double delta_error = 1e-8;
  for (const Case& k : {Case{1e-3, 2.0, 20000}, Case{1.0, 0.7, 100}, Case{0.04, 1.5, 2249},
                        Case{1e-4, 1.0, 100000}, Case{1.0, 20.0, 1000}}) {
    const double h = 0.01 / std::sqrt(k.steps * std::log(12.0 / delta_error) / 2.0);
    const pd::SubsampledGaussianPrv prv(k.q, k.sigma);
    const double tail = delta_error / (48.0 * k.steps);
    std::vector<pd::DiscretePrv> phases = {
        pd::discretise(prv, h, prv.lower_quantile(tail), prv.upper_quantile(tail), 1 << 22)};
    const std::vector<int64_t> steps = {k.steps};
    const double offset = k.steps * phases[0].shift;
    auto window = [&](double log_tail) {
      const auto [a, b] = pd::chernoff_window(phases, steps, log_tail);
      const int64_t first = static_cast<int64_t>(std::floor((a - offset) / h));
      const int64_t needed = static_cast<int64_t>(std::ceil((b - offset) / h)) - first + 1;
      return std::make_pair(first, needed);
    };
    const auto [first, needed] = window(std::log(delta_error / 24.0));
    const int64_t size = pd::fast_fft_size(needed);
    const pd::Composition real = pd::compose(phases, steps, first, size);

    const auto [wide_first, wide_needed] = window(std::log(1e-200));
    const int64_t wide_size = pd::fast_fft_size(2 * wide_needed);
    const pd::Composition wide = pd::compose(phases, steps, wide_first, wide_size);
    double noise = 0.0;
    for (std::size_t j = static_cast<std::size_t>(wide_needed); j < wide.prv.size(); ++j) {
      noise += wide.prv.pmf()[j];
    }
    // Clamping hides the negative half of the noise: double it.
    const double per_point = 2.0 * noise / static_cast<double>(wide_size - wide_needed);
    EXPECT_LT(per_point * static_cast<double>(size), real.roundoff_absolute)
        << k.q << " " << k.sigma << " " << k.steps;
    // The estimate leaves most of delta_error to spare at delta = 1e-5.
    EXPECT_LT(real.roundoff_absolute, delta_error / 4.0) << k.q << " " << k.sigma << " " << k.steps;
    EXPECT_LT(real.roundoff_relative, 1e-9);
  }
}

TEST(PrvNumerics, FastFftSizes) {
  for (const int64_t n : {1, 5, 97, 1000, 262145, 279937, 1000003}) {
    const int64_t m = pd::fast_fft_size(n);
    EXPECT_GE(m, n);
    EXPECT_EQ(m % 4, 0);
    int64_t r = m;
    for (const int64_t p : {2, 3, 5}) {
      while (r % p == 0) r /= p;
    }
    EXPECT_EQ(r, 1) << m;
    EXPECT_LE(m, 2 * n + 8);
  }
}

TEST(PrvNumerics, ComposedDeltaAndEpsilonInvertEachOther) {
  // A hand-made distribution: values -1, 0, 1, 2 (mesh 1) with masses 0.1, 0.4, 0.3, 0.2.
  const pd::ComposedPrv c(1.0, -1, 0.0, {0.1, 0.4, 0.3, 0.2});
  // delta(eps) = sum p (1 - e^{eps - v})_+, directly.
  auto direct = [](double eps) {
    const double v[] = {-1.0, 0.0, 1.0, 2.0};
    const double p[] = {0.1, 0.4, 0.3, 0.2};
    double d = 0.0;
    for (int i = 0; i < 4; ++i) d += p[i] * std::max(0.0, 1.0 - std::exp(eps - v[i]));
    return d;
  };
  for (const double eps : {-3.0, -1.0, -0.5, 0.0, 0.3, 1.0, 1.7, 2.0, 5.0}) {
    EXPECT_NEAR(c.delta(eps), direct(eps), 1e-15) << eps;
    if (direct(eps) > 0.0) {
      EXPECT_NEAR(c.epsilon(direct(eps)), eps, 1e-12) << eps;
    }
  }
  EXPECT_EQ(c.epsilon(1.0), -std::numeric_limits<double>::infinity());
}

}  // namespace
}  // namespace dpzero::accounting
