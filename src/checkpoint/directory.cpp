// src/checkpoint/directory.cpp — POSIX directory operations (directory.h).
#include "src/checkpoint/directory.h"

#include <dirent.h>
#include <ftw.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace dpzero::checkpoint {
namespace {

[[noreturn]] void fail(const std::string& what, const std::string& path, int error) {
  throw std::runtime_error("checkpoint: cannot " + what + " " + path + ": " +
                           std::strerror(error));
}

int remove_entry(const char* path, const struct stat*, int, struct FTW*) {
  return std::remove(path) == 0 || errno == ENOENT ? 0 : errno;
}

}  // namespace

std::string join_path(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void make_directory(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) != 0) fail("create directory", path, errno);
}

void make_directories(const std::string& path) {
  if (path.empty() || is_directory(path)) return;
  std::size_t slash = path.find_last_of('/');
  while (slash != std::string::npos && slash > 0 && path[slash - 1] == '/') --slash;
  if (slash != std::string::npos && slash > 0) make_directories(path.substr(0, slash));
  if (::mkdir(path.c_str(), 0755) != 0 && !(errno == EEXIST && is_directory(path))) {
    fail("create directory", path, errno);
  }
}

std::vector<std::string> list_directory(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) fail("list directory", dir, errno);
  std::vector<std::string> names;
  errno = 0;
  while (const struct dirent* entry = ::readdir(d)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  const int error = errno;
  ::closedir(d);
  if (error != 0) fail("list directory", dir, error);
  return names;
}

void remove_tree(const std::string& path) {
  if (!path_exists(path)) return;
  const int rc = ::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  if (rc != 0) fail("remove", path, rc > 0 ? rc : errno);
}

}  // namespace dpzero::checkpoint
