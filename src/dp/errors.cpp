// src/dp/errors.cpp — see errors.h.
#include "src/dp/errors.h"

namespace dpzero::dp {

namespace {

std::string first_line(const std::string& cause) {
  std::string first = cause.substr(0, cause.find('\n'));
  if (first.size() > 300) first.resize(300);
  return first;
}

}  // namespace

std::string update_error_text(int64_t rank, int64_t world_size, int64_t step, int64_t charge,
                              const std::string& cause) {
  return "rank " + std::to_string(rank) + " of " + std::to_string(world_size) + ", step " +
         std::to_string(step) + " (charge " + std::to_string(charge) +
         "): the step was charged to the privacy ledger, then failed on this rank before its "
         "update was applied; its privacy cost counts (" +
         first_line(cause) + ")";
}

std::string collective_error_text(int64_t rank, int64_t world_size, int64_t step,
                                  const std::string& what, ChargeState charge_state,
                                  const std::string& cause) {
  const std::string first = first_line(cause);
  const char* state = "nothing was charged or applied on this rank";
  if (charge_state == ChargeState::kCharged) {
    state = "the step was charged to the privacy ledger and was not applied on this rank";
  } else if (charge_state == ChargeState::kUnknown) {
    state =
        "rank 0's privacy ledger may hold the step (its record was being confirmed); it was "
        "not applied on this rank";
  }
  return "rank " + std::to_string(rank) + " of " + std::to_string(world_size) + ", step " +
         std::to_string(step) + ": " + what +
         " failed: a peer rank died, hung past the process group's timeout, or lost its "
         "connection; " +
         state + " (" + first + ")";
}

}  // namespace dpzero::dp
