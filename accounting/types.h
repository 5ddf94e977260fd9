// accounting/types.h — value types shared by the accountants, calibration and the ledger.
//
// A run is a sequence of phases; within a phase every step uses the same Poisson sample rate q and
// noise multiplier sigma (design.md §2). Heterogeneous runs are several phases.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dpzero::accounting {

// One homogeneous stretch of DP-SGD steps: `steps` compositions of the Poisson-subsampled
// Gaussian mechanism with sample rate q in [0, 1] and noise multiplier sigma > 0.
struct Phase {
  double q = 0.0;
  double sigma = 1.0;
  int64_t steps = 0;
};

// Throws std::invalid_argument naming the bad field and value (q outside [0,1], sigma <= 0 or not
// finite, steps < 0).
void validate_phase(const Phase& phase);
// Throws std::invalid_argument unless 0 < delta < 1.
void validate_delta(double delta);
// Throws std::invalid_argument unless epsilon >= 0 and finite.
void validate_epsilon(double epsilon);

enum class AccountantKind { kRdp, kPrv };

// "rdp" / "prv" <-> AccountantKind; parse throws std::invalid_argument naming the string.
AccountantKind parse_accountant_kind(const std::string& name);
std::string to_string(AccountantKind kind);

// Shortest decimal text that reads back as the same double ("1.5", "1e-05", "nan", "inf");
// error messages use it so the offending value is shown exactly.
std::string format_double(double value);

}  // namespace dpzero::accounting
