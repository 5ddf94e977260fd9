// src/checkpoint/directory.h — the directory operations of the checkpoint commit protocol, on
// POSIX calls (Note [checkpoint commit] in checkpoint.h).
//
// Why not std::filesystem: libtorch.so exports its own copies of std::filesystem functions
// (built against another libstdc++), and the dynamic linker binds our calls to them; its
// std::filesystem::remove_all crashed (a call through a null pointer) when called from dpzero._C.
// POSIX calls have one definition, in libc.
//
// Errors throw std::runtime_error naming the path and the system's reason (strerror).
#pragma once

#include <string>
#include <vector>

namespace dpzero::checkpoint {

// `dir` + "/" + `name` (no separator doubled).
std::string join_path(const std::string& dir, const std::string& name);

bool path_exists(const std::string& path);  // lstat succeeds
bool is_directory(const std::string& path);

// mkdir -p with mode 0755.
void make_directories(const std::string& path);
// mkdir: fails naming the path if it exists.
void make_directory(const std::string& path);

// The names in `dir`, without "." and "..", in no particular order.
std::vector<std::string> list_directory(const std::string& dir);

// rm -r: removes `path` and everything below it, not following symbolic links; a missing path is
// not an error.
void remove_tree(const std::string& path);

}  // namespace dpzero::checkpoint
