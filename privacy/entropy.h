// privacy/entropy.h — keys from the operating system's entropy source (secure mode), and the
// rule that chooses secure mode.
//
// Note [secure by default]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Whoever can regenerate a run's noise can subtract it from the updates, so the noise's source
// is the run's secret. Every front door (dpzero.make_private, PrivacyEngine, PrivateTrainer, the
// C++ PrivacyEngine) therefore draws noise and batches in secure mode, ChaCha20 keyed from the
// OS (privacy/secure_noise.h), unless the caller gives a seed: a seed makes the run reproducible
// (Philox, the faster generator), and keeping it secret is then the caller's business. A secure
// run's key lives only in its processes: no state dict, checkpoint or ledger holds it (Python's
// state_dict hands it out only when asked by name, include_secrets=True). secure_mode=False
// without a seed asks for a seeded run without giving the seed: rank 0 draws one, and the state
// dict keeps it so that the run can be resumed exactly.
#pragma once

#include <optional>
#include <string>

#include "privacy/chacha20.h"

namespace dpzero::privacy {

// Note [secure by default]: whether a run draws in secure mode, from the caller's secure_mode
// (nullopt: not given) and its seed as the caller wrote it (nullopt: none). secure_mode=true with
// a seed is a std::invalid_argument naming the seed (secure mode has none).
bool secure_noise(std::optional<bool> secure_mode, const std::optional<std::string>& seed);

// 256 bits from boost::random::random_device (getrandom(2) / /dev/urandom on Linux). Throws
// std::runtime_error naming the failure if the OS source cannot be read.
ChaCha20Key entropy_key();

}  // namespace dpzero::privacy
