// accounting/accountant.cpp — see accountant.h.
#include "accounting/accountant.h"

#include <algorithm>

#include "accounting/prv.h"
#include "accounting/rdp.h"

namespace dpzero::accounting {

void Accountant::add(const Phase& phase) {
  validate_phase(phase);
  compose(phase);
  if (!phases_.empty() && phases_.back().q == phase.q && phases_.back().sigma == phase.sigma) {
    phases_.back().steps += phase.steps;
  } else {
    phases_.push_back(phase);
  }
  steps_ += phase.steps;
}

bool Accountant::releases_nothing() const {
  return std::none_of(phases_.begin(), phases_.end(), releases);
}

std::shared_ptr<Accountant> make_accountant(AccountantKind kind) {
  if (kind == AccountantKind::kPrv) return std::make_shared<PrvAccountant>();
  return std::make_shared<RdpAccountant>();
}

}  // namespace dpzero::accounting
