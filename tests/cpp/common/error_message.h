// tests/cpp/common/error_message.h — the message of the exception a call throws, for tests that
// check an error names the bad value, and whether a message holds a part.
#pragma once

#include <string>

namespace dpzero::testing {

// The what() of the E thrown by f(), or "<no E>" if f() returned normally (other exception types
// propagate and fail the test).
template <typename E, typename F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "<no exception of the expected type>";
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace dpzero::testing
