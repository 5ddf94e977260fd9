// tests/cpp/accounting/types_test.cpp — validation messages of accounting/types.h name the bad
// field and value; AccountantKind parsing; exact double formatting.
#include <gtest/gtest.h>

#include <utility>

#include "tests/cpp/common/error_message.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "accounting/types.h"

namespace dpzero::accounting {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

template <typename F>
std::string invalid_argument_message(F&& f) {
  return testing::error_message<std::invalid_argument>(std::forward<F>(f));
}

TEST(FormatDouble, ShortestRoundTripText) {
  EXPECT_EQ(format_double(1.5), "1.5");
  EXPECT_EQ(format_double(0.1), "0.1");
  EXPECT_EQ(format_double(1e-5), "1e-05");
  EXPECT_EQ(format_double(-2.0), "-2");
  EXPECT_EQ(format_double(kNaN), "nan");
  EXPECT_EQ(format_double(kInf), "inf");
  EXPECT_EQ(format_double(-kInf), "-inf");
  const double third = 1.0 / 3.0;
  EXPECT_EQ(std::stod(format_double(third)), third);
}

TEST(ValidatePhase, AcceptsTheClosedRangeOfQ) {
  EXPECT_NO_THROW(validate_phase(Phase{0.0, 1.0, 0}));
  EXPECT_NO_THROW(validate_phase(Phase{1.0, 0.5, 10}));
}

TEST(ValidatePhase, QOutsideUnitIntervalNamesFieldAndValue) {
  EXPECT_EQ(invalid_argument_message([] { validate_phase(Phase{1.5, 1.0, 1}); }),
            "sample rate q must be in [0, 1], got 1.5");
  EXPECT_NE(invalid_argument_message([] { validate_phase(Phase{-0.25, 1.0, 1}); })
                .find("got -0.25"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([] { validate_phase(Phase{kNaN, 1.0, 1}); }).find("got nan"),
            std::string::npos);
}

TEST(ValidatePhase, SigmaMustBePositiveAndFinite) {
  for (const double sigma : {0.0, -1.25, kInf, kNaN}) {
    const std::string message =
        invalid_argument_message([sigma] { validate_phase(Phase{0.1, sigma, 1}); });
    EXPECT_NE(message.find("sigma"), std::string::npos) << message;
    EXPECT_NE(message.find("got " + format_double(sigma)), std::string::npos) << message;
  }
}

TEST(ValidatePhase, NegativeStepsNamed) {
  EXPECT_EQ(invalid_argument_message([] { validate_phase(Phase{0.1, 1.0, -3}); }),
            "steps must be >= 0, got -3");
}

TEST(ValidateDelta, OpenUnitInterval) {
  EXPECT_NO_THROW(validate_delta(1e-5));
  for (const double delta : {0.0, 1.0, -1e-5, 2.0, kNaN}) {
    const std::string message = invalid_argument_message([delta] { validate_delta(delta); });
    EXPECT_NE(message.find("delta"), std::string::npos) << message;
    EXPECT_NE(message.find("got " + format_double(delta)), std::string::npos) << message;
  }
}

TEST(ValidateEpsilon, NonNegativeFinite) {
  EXPECT_NO_THROW(validate_epsilon(0.0));
  EXPECT_NO_THROW(validate_epsilon(8.0));
  for (const double eps : {-0.5, kInf, kNaN}) {
    const std::string message = invalid_argument_message([eps] { validate_epsilon(eps); });
    EXPECT_NE(message.find("epsilon"), std::string::npos) << message;
    EXPECT_NE(message.find("got " + format_double(eps)), std::string::npos) << message;
  }
}

TEST(AccountantKind, ParsesAndPrints) {
  EXPECT_EQ(parse_accountant_kind("rdp"), AccountantKind::kRdp);
  EXPECT_EQ(parse_accountant_kind("PRV"), AccountantKind::kPrv);
  EXPECT_EQ(to_string(AccountantKind::kRdp), "rdp");
  EXPECT_EQ(to_string(AccountantKind::kPrv), "prv");
  EXPECT_EQ(parse_accountant_kind(to_string(AccountantKind::kPrv)), AccountantKind::kPrv);
  const std::string message = invalid_argument_message([] { parse_accountant_kind("moments"); });
  EXPECT_NE(message.find("\"moments\""), std::string::npos) << message;
}

}  // namespace
}  // namespace dpzero::accounting
