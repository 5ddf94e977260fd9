// privacy/host_device.h — DPZERO_HOST_DEVICE: one spelling for functions that nvcc compiles for
// both the host and the device and that g++ compiles as plain inline host functions.
#pragma once

#if defined(__CUDACC__)
#define DPZERO_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DPZERO_HOST_DEVICE inline
#endif
