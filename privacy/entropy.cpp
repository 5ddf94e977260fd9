// privacy/entropy.cpp — entropy_key() through Boost.Random's random_device, a well-kept wrapper of
// the OS entropy source (see docs/architecture.md, "Dependencies").
#include "privacy/entropy.h"

#include <stdexcept>
#include <string>

#include <boost/random/random_device.hpp>

namespace dpzero::privacy {

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
