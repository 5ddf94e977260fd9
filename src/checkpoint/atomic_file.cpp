// src/checkpoint/atomic_file.cpp — temp file + fsync + rename + directory fsync (atomic_file.h).
#include "src/checkpoint/atomic_file.h"

#include <fcntl.h>
#include <stdio.h>  // renameat2, RENAME_NOREPLACE (glibc >= 2.28)
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace dpzero::checkpoint {
namespace {

std::string errno_text(int error) { return std::strerror(error); }

[[noreturn]] void fail(const std::string& what, const std::string& path, int error) {
  throw std::runtime_error("checkpoint: cannot " + what + " " + path + ": " + errno_text(error));
}

std::string base_name(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// Writes all `size` bytes (write(2) may write fewer or be interrupted); false with errno set.
bool write_all(int fd, const char* data, std::size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data += n;
    size -= static_cast<std::size_t>(n);
  }
  return true;
}

}  // namespace

std::string parent_directory(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

void fsync_directory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail("open directory", path, errno);
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (rc != 0) fail("fsync directory", path, error);
}

void write_file_atomically(const std::string& path, const char* data, std::size_t size,
                           const std::function<void()>& halfway) {
  const std::string dir = parent_directory(path);
  const std::string temp = dir + "/." + base_name(path) + ".tmp-" + std::to_string(::getpid());
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("create", temp, errno);
  const std::size_t first = size / 2;
  bool ok = write_all(fd, data, first);
  if (ok && halfway) halfway();
  ok = ok && write_all(fd, data + first, size - first);
  int error = errno;
  if (ok && ::fsync(fd) != 0) {
    ok = false;
    error = errno;
  }
  if (::close(fd) != 0 && ok) {
    ok = false;
    error = errno;
  }
  if (!ok) {
    ::unlink(temp.c_str());
    fail("write", temp, error);
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    error = errno;
    ::unlink(temp.c_str());
    fail("rename " + temp + " to", path, error);
  }
  fsync_directory(dir);
}

std::vector<char> read_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("open", path, errno);
  std::vector<char> content;
  struct stat st {};
  if (::fstat(fd, &st) == 0 && st.st_size > 0) {
    content.reserve(static_cast<std::size_t>(st.st_size));
  }
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      ::close(fd);
      fail("read", path, error);
    }
    if (n == 0) break;
    content.insert(content.end(), buffer, buffer + n);
  }
  ::close(fd);
  return content;
}

void rename_no_replace(const std::string& from, const std::string& to) {
#ifdef RENAME_NOREPLACE
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return;
  if (errno == EEXIST) fail("rename " + from + " to", to + " (it already exists)", EEXIST);
  if (errno != EINVAL && errno != ENOSYS) fail("rename " + from + " to", to, errno);
  // The file system does not support RENAME_NOREPLACE: fall through to check + rename.
#endif
  struct stat st {};
  if (::lstat(to.c_str(), &st) == 0) {
    fail("rename " + from + " to", to + " (it already exists)", EEXIST);
  }
  if (::rename(from.c_str(), to.c_str()) != 0) fail("rename " + from + " to", to, errno);
}

}  // namespace dpzero::checkpoint
