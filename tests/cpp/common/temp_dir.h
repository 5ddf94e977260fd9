// tests/cpp/common/temp_dir.h — a new, empty directory for one test, by mkdtemp: never one an
// earlier process left behind. A name made from the test and the pid was reused once the pid
// was, and clearing the old directory with std::filesystem::remove_all crashed the test process:
// libtorch.so exports its own std::filesystem functions and the dynamic linker binds ours to them
// (src/checkpoint/directory.h says the same of dpzero._C).
#pragma once

#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace dpzero::testing {

// $TMPDIR (or /tmp) / "<prefix>_XXXXXX", created.
inline std::string fresh_temp_dir(const std::string& prefix) {
  std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "_XXXXXX")).string();
  if (mkdtemp(pattern.data()) == nullptr) {
    throw std::runtime_error("mkdtemp(" + pattern + ") failed: " + std::strerror(errno));
  }
  return pattern;
}

}  // namespace dpzero::testing
