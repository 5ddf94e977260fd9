// src/dp/failpoints.h — named places in the private step where a test can kill this process, or
// make the step fail.
//
// Note [failpoints]
// ~~~~~~~~~~~~~~~~~
// Crash safety is a claim about what survives a `kill -9` at the worst moment: after the ledger
// record of a step and before its update, say. Killing a process from outside at a chosen moment
// is a race, so the step names its moments and, when the environment variable DPZERO_FAILPOINT
// names one, sends itself SIGKILL there (no cleanup, no flush: the real thing). The value is a
// comma-separated list of POINT@CHARGE or POINT@CHARGE@RANK: CHARGE is the 0-based index of the
// step's ledger charge (Note [noise index] in src/dp/private_step.h), RANK the process
// group rank (any rank when omitted). Points, in the order a step passes them
// (PrivateStep::take, private_step.h):
//
//   before_ledger   the step was agreed on; nothing is recorded or applied yet
//   after_ledger    the ledger holds the step (durably) and every rank knows; no update yet
//   after_charge    the step is charged (the count and the accountant); no update yet
//   after_update    the noisy update is applied on this rank
//
// An item ending in ":raise" throws std::runtime_error there instead, naming the item: the
// in-process way to fail a step at that moment (after_charge: an UpdateError that says the step
// was charged). Not at after_ledger, where a step is recorded but not yet counted: only a kill
// may stop it there, since the process's count then dies with it.
//
// The value is read and checked once, when a private step is made (PrivateStep's constructor):
// a misspelt one is an error there, not a silent no-op. Unset (the normal case) a failpoint costs
// nothing.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dpzero::dp {

inline constexpr const char* kFailpointEnv = "DPZERO_FAILPOINT";

class Failpoints {
 public:
  // The failpoints DPZERO_FAILPOINT names (none when unset). A value that is not a list of
  // POINT@CHARGE[@RANK] is a std::invalid_argument naming the bad item.
  static Failpoints from_env();
  static Failpoints parse(const std::string& value);

  // SIGKILLs this process, or throws, if (point, charge) is named for `rank`.
  void hit(const std::string& point, int64_t charge, int64_t rank) const;

 private:
  struct Point {
    std::string point;
    int64_t charge = 0;
    std::optional<int64_t> rank;  // nullopt: any rank
    bool raise = false;           // throw instead of SIGKILL
    std::string item;             // as DPZERO_FAILPOINT names it
  };
  std::vector<Point> points_;
};

}  // namespace dpzero::dp
