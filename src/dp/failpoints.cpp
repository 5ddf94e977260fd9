// src/dp/failpoints.cpp — see failpoints.h.
#include "src/dp/failpoints.h"

#include <signal.h>
#include <unistd.h>

#include <array>
#include <cstdlib>
#include <stdexcept>
#include <string_view>
#include <vector>

namespace dpzero::dp {
namespace {

constexpr std::array<std::string_view, 4> kPoints = {"before_ledger", "after_ledger",
                                                     "after_charge", "after_update"};
constexpr std::string_view kRaise = ":raise";

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  size_t begin = 0;
  for (size_t end; (end = text.find(sep, begin)) != std::string::npos; begin = end + 1) {
    parts.push_back(text.substr(begin, end - begin));
  }
  parts.push_back(text.substr(begin));
  return parts;
}

constexpr const char* kSpace = " \t\n\r\f\v";

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(kSpace), e = s.find_last_not_of(kSpace);
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

int64_t parse_integer(const std::string& text, const std::string& item) {
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (text.empty() || used != text.size()) {
    throw std::invalid_argument(std::string(kFailpointEnv) + ": '" + item +
                                "': CHARGE and RANK must be integers");
  }
  return value;
}

}  // namespace

Failpoints Failpoints::from_env() {
  const char* raw = std::getenv(kFailpointEnv);
  return raw == nullptr ? Failpoints() : parse(raw);
}

Failpoints Failpoints::parse(const std::string& value) {
  Failpoints out;
  for (const std::string& part : split(value, ',')) {
    const std::string item = trim(part);
    if (item.empty()) continue;
    const bool raise = item.size() > kRaise.size() &&
                       item.compare(item.size() - kRaise.size(), kRaise.size(), kRaise) == 0;
    const std::vector<std::string> fields =
        split(raise ? item.substr(0, item.size() - kRaise.size()) : item, '@');
    bool known = false;
    for (std::string_view p : kPoints) known = known || fields[0] == p;
    if ((fields.size() != 2 && fields.size() != 3) || !known) {
      throw std::invalid_argument(std::string(kFailpointEnv) + ": '" + item +
                                  "' is not POINT@CHARGE[@RANK][:raise] with POINT one of "
                                  "['before_ledger', 'after_ledger', 'after_charge', "
                                  "'after_update']");
    }
    if (raise && fields[0] == "after_ledger") {
      throw std::invalid_argument(std::string(kFailpointEnv) + ": '" + item +
                                  "': after_ledger takes no :raise (the step is recorded but not "
                                  "yet counted there); use after_charge");
    }
    Point point{fields[0], parse_integer(trim(fields[1]), item), std::nullopt, raise, item};
    if (fields.size() == 3) point.rank = parse_integer(trim(fields[2]), item);
    out.points_.push_back(point);
  }
  return out;
}

void Failpoints::hit(const std::string& point, int64_t charge, int64_t rank) const {
  for (const Point& p : points_) {
    if (p.point == point && p.charge == charge && (!p.rank || *p.rank == rank)) {
      if (p.raise) throw std::runtime_error(std::string(kFailpointEnv) + " " + p.item);
      kill(getpid(), SIGKILL);
    }
  }
}

}  // namespace dpzero::dp
