// kernels/cuda/fingerprint.cu — CUDA implementation of dpzero::_state_fingerprint (schema in
// kernels/ops.cpp; the sum is kernels/fingerprint_words.h; the CPU's is kernels/cpu/fingerprint.cpp).
//
// One launch per kTensors tensors, after the output's zeroing, whatever their sizes: blockIdx.y
// picks a tensor of the chunk (its pointer, length and word size travel in the launch's
// arguments), and a row of blocks walks its words with a grid stride. Each thread sums its words'
// terms in a 64-bit register, each warp and then each block adds its threads' sums, and each block
// adds its sum into the tensor's output with one 64-bit atomicAdd. Every addition is modulo 2^64,
// which is associative and commutative, so the atomics' order cannot change the result: the CPU's
// bits. The words are read once, and each costs two 64-bit multiplies (a few 32-bit multiply-adds
// each).
#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/fingerprint_checks.h"
#include "kernels/fingerprint_words.h"

namespace dpzero::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;
constexpr int kTensors = 96;  // per launch: the table below stays well inside 4 KiB of arguments

// One launch's tensors: their words, lengths and word sizes (1, 2, 4 or 8 bytes), and where the
// first one's fingerprint goes in the output.
struct Chunk {
  const void* words[kTensors];
  int64_t n[kTensors];
  int8_t size[kTensors];
  int64_t first;
};

// This thread's share of the fingerprint of words [n] (Word: the words' integer type, converted to
// int64 as their extension): positions start, start + stride, ...
template <typename Word>
__device__ uint64_t thread_sum(const Word* __restrict__ words, int64_t n, int64_t start,
                               int64_t stride, uint64_t key) {
  uint64_t acc = 0;
  for (int64_t j = start; j < n; j += stride) {
    acc += fingerprint::term(static_cast<uint64_t>(static_cast<int64_t>(words[j])),
                             static_cast<uint64_t>(j), key);
  }
  return acc;
}

// out[chunk.first + blockIdx.y] += the terms of tensor blockIdx.y's words this row of blocks
// reads, modulo 2^64. out must hold 0 before the first block adds.
__global__ void __launch_bounds__(kThreads)
fingerprint_kernel(Chunk chunk, uint64_t key, unsigned long long* __restrict__ out) {
  const int t = blockIdx.y;
  const int64_t n = chunk.n[t];
  const int64_t start = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (static_cast<int64_t>(blockIdx.x) * kThreads >= n) return;  // the whole block: no words
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  uint64_t acc = 0;
  switch (chunk.size[t]) {
    case 2: acc = thread_sum(static_cast<const int16_t*>(chunk.words[t]), n, start, stride, key);
            break;
    case 4: acc = thread_sum(static_cast<const int32_t*>(chunk.words[t]), n, start, stride, key);
            break;
    case 8: acc = thread_sum(static_cast<const int64_t*>(chunk.words[t]), n, start, stride, key);
            break;
    default: acc = thread_sum(static_cast<const uint8_t*>(chunk.words[t]), n, start, stride, key);
  }
  for (int offset = 16; offset > 0; offset >>= 1)
    acc += __shfl_down_sync(0xffffffffu, acc, offset);
  __shared__ uint64_t warps[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warps[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < kThreads / 32 ? warps[lane] : 0;
    for (int offset = 16; offset > 0; offset >>= 1)
      acc += __shfl_down_sync(0xffffffffu, acc, offset);
    if (lane == 0) atomicAdd(out + chunk.first + t, static_cast<unsigned long long>(acc));
  }
}

at::Tensor state_fingerprint_cuda(at::TensorList words, int64_t key) {
  check_fingerprint_words(words);
  const c10::cuda::CUDAGuard guard(words[0].device());
  const auto count = static_cast<int64_t>(words.size());
  at::Tensor out = at::zeros({count}, words[0].options().dtype(at::kLong));
  auto* o = reinterpret_cast<unsigned long long*>(out.mutable_data_ptr<int64_t>());
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (int64_t first = 0; first < count; first += kTensors) {
    Chunk chunk{};
    chunk.first = first;
    const int64_t in_chunk = std::min<int64_t>(kTensors, count - first);
    int64_t longest = 0;
    for (int64_t t = 0; t < in_chunk; ++t) {
      const at::Tensor& w = words[first + t];
      chunk.words[t] = w.const_data_ptr();
      chunk.n[t] = w.numel();
      chunk.size[t] = static_cast<int8_t>(w.element_size());
      longest = std::max(longest, w.numel());
    }
    if (longest == 0) continue;  // all empty: their fingerprints are the zeros above
    const int64_t row = std::min<int64_t>((longest + kThreads - 1) / kThreads, sms * kBlocksPerSm);
    fingerprint_kernel<<<dim3(static_cast<unsigned>(row), static_cast<unsigned>(in_chunk)),
                         kThreads, 0, stream>>>(chunk, static_cast<uint64_t>(key), o);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CUDA, m) { m.impl("_state_fingerprint", &state_fingerprint_cuda); }

}  // namespace dpzero::kernels
