// privacy/entropy.cpp — entropy_key() through Boost.Random's random_device, a well-kept wrapper of
// the OS entropy source (see docs/architecture.md, "Dependencies").
#include "privacy/entropy.h"

#include <stdexcept>
#include <string>

#include <boost/random/random_device.hpp>

namespace dpzero::privacy {

bool secure_noise(std::optional<bool> secure_mode, const std::optional<std::string>& seed) {
  if (secure_mode.value_or(false) && seed) {
    throw std::invalid_argument(
        "seed=" + *seed +
        " with secure_mode=True: secure mode draws its key from the OS and has no seed; give "
        "the seed (a reproducible run) or secure_mode=True, not both");
  }
  return secure_mode.value_or(!seed);
}

ChaCha20Key entropy_key() {
  try {
    boost::random::random_device device;
    ChaCha20Key key;
    for (uint32_t& w : key.w) w = device();
    return key;
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("secure mode: cannot read OS entropy: ") + e.what());
  }
}

}  // namespace dpzero::privacy
