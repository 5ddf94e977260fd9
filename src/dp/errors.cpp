// src/dp/errors.cpp — see errors.h.
#include "src/dp/errors.h"

namespace dpzero::dp {

std::string collective_error_text(int64_t rank, int64_t world_size, int64_t step,
                                  const std::string& what, ChargeState charge_state,
                                  const std::string& cause) {
  std::string first = cause.substr(0, cause.find('\n'));
  if (first.size() > 300) first.resize(300);
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
