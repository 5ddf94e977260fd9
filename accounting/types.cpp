// accounting/types.cpp — validation of phases, delta and epsilon; AccountantKind <-> string;
// exact formatting of doubles for error messages.
#include "accounting/types.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <stdexcept>

namespace dpzero::accounting {

std::string format_double(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  // Shortest round-trip representation (C++17 <charconv>): the reader sees the value exactly.
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

void validate_phase(const Phase& phase) {
  // Written as !(inside) so that NaN is rejected too.
  if (!(phase.q >= 0.0 && phase.q <= 1.0)) {
    throw std::invalid_argument("sample rate q must be in [0, 1], got " + format_double(phase.q));
  }
  if (!(phase.sigma > 0.0 && std::isfinite(phase.sigma))) {
    throw std::invalid_argument("noise multiplier sigma must be > 0 and finite, got " +
                                format_double(phase.sigma));
  }
  if (phase.steps < 0) {
    throw std::invalid_argument("steps must be >= 0, got " + std::to_string(phase.steps));
  }
}

void validate_delta(double delta) {
  if (!(delta > 0.0 && delta < 1.0)) {
    throw std::invalid_argument("delta must be in (0, 1), got " + format_double(delta));
  }
}

void validate_epsilon(double epsilon) {
  if (!(epsilon >= 0.0 && std::isfinite(epsilon))) {
    throw std::invalid_argument("epsilon must be >= 0 and finite, got " + format_double(epsilon));
  }
}

AccountantKind parse_accountant_kind(const std::string& name) {
  std::string lower;
  lower.reserve(name.size());
  for (const char c : name) lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  if (lower == "rdp") return AccountantKind::kRdp;
  if (lower == "prv") return AccountantKind::kPrv;
  throw std::invalid_argument("unknown accountant \"" + name + "\"; expected \"rdp\" or \"prv\"");
}

std::string to_string(AccountantKind kind) {
  switch (kind) {
    case AccountantKind::kRdp:
      return "rdp";
    case AccountantKind::kPrv:
      return "prv";
  }
  throw std::invalid_argument("unknown AccountantKind value " +
                              std::to_string(static_cast<int>(kind)));
}

}  // namespace dpzero::accounting
