// src/checkpoint/atomic_file.h — durable whole-file writes and renames on a POSIX file system:
// the primitives of the checkpoint commit protocol (Note [checkpoint commit] in checkpoint.h).
//
// A file written by write_file_atomically is either absent under its final name or complete and on
// stable storage: the bytes go to a temporary name in the same directory, are fsynced, the file
// is renamed over the final name (rename(2) is atomic within one file system) and the directory is
// fsynced so the new entry itself survives a power loss. A crash at any point leaves at most a
// stray temporary file (".<name>.tmp-<pid>"), never a torn file under the final name.
//
// Errors throw std::runtime_error naming the path and the system's reason (strerror).
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace dpzero::checkpoint {

// Writes data[0, size) to `path` as described above, replacing an existing file atomically.
// `halfway` (tests only; Note [checkpoint faults]) runs after the first half of the bytes is
// written to the temporary file and before the rest, so a test can crash the process mid-write.
void write_file_atomically(const std::string& path, const char* data, std::size_t size,
                           const std::function<void()>& halfway = {});

// The whole content of `path`.
std::vector<char> read_file(const std::string& path);

// fsync(2) on a directory, making the creation, removal or renaming of its entries durable.
void fsync_directory(const std::string& path);

// Renames directory `from` to `to`, failing (naming `to`) if `to` exists: renameat2 with
// RENAME_NOREPLACE where the file system supports it, else a check followed by rename(2), which is
// enough with one writer per checkpoint root.
void rename_no_replace(const std::string& from, const std::string& to);

// The parent directory of `path` ("." when it has none).
std::string parent_directory(const std::string& path);

}  // namespace dpzero::checkpoint
