// privacy/entropy.h — keys from the operating system's entropy source (secure mode).
#pragma once

#include "privacy/chacha20.h"

namespace dpzero::privacy {

// 256 bits from boost::random::random_device (getrandom(2) / /dev/urandom on Linux). Throws
// std::runtime_error naming the failure if the OS source cannot be read.
ChaCha20Key entropy_key();

}  // namespace dpzero::privacy
