// tests/cpp/torch/devices.h — the devices the GoogleTests run their kernels on: the CPU always,
// and CUDA when dpzero was built with its CUDA kernels and a GPU is present (the CUDA cases skip
// otherwise, with the reason).
#pragma once

#include <vector>

#include <ATen/ATen.h>

namespace dpzero::testing {

inline bool cuda_available() {
#ifdef DPZERO_WITH_CUDA
  return at::hasCUDA();
#else
  return false;
#endif
}

inline constexpr const char* kNoCuda = "no CUDA device, or dpzero built without CUDA kernels";

// The CPU, then CUDA where cuda_available().
inline std::vector<at::Device> devices() {
  std::vector<at::Device> out{at::kCPU};
  if (cuda_available()) out.emplace_back(at::kCUDA);
  return out;
}

}  // namespace dpzero::testing
