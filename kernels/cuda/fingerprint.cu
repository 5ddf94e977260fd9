// kernels/cuda/fingerprint.cu — CUDA implementation of dpzero::_state_fingerprint (schema in
// kernels/ops.cpp; the sum is kernels/fingerprint_words.h; the CPU's is kernels/cpu/fingerprint.cpp).
//
// One launch after the output's zeroing, whatever the size: a grid of a few blocks per SM walks
// the words with a grid stride, each thread sums its words' terms in a 64-bit register, each warp
// and then each block adds its threads' sums, and each block adds its sum into the output with one
// 64-bit atomicAdd. Every addition is modulo 2^64, which is associative and commutative, so the
// atomics' order cannot change the result: the CPU's bits. The words are read once (the bytes of
// the tensor), and each costs two 64-bit multiplies (a few 32-bit multiply-adds each), so the
// kernel runs near the copy rate; an earlier ATen composition took about fifteen int64 passes and
// launches per 2^20 words.
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

// words [n] (Word: its integer type; converted to int64, the words' extension) -> *out += the
// fingerprint's terms of every word, modulo 2^64. out must hold 0 before the first block adds.
template <typename Word>
__global__ void __launch_bounds__(kThreads)
fingerprint_kernel(const Word* __restrict__ words, int64_t n, uint64_t key,
                   unsigned long long* __restrict__ out) {
  uint64_t acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; j < n; j += stride) {
    uint64_t z = static_cast<uint64_t>(static_cast<int64_t>(words[j])) ^
                 ((static_cast<uint64_t>(j) + key) * fingerprint::kGolden);
    z = (z ^ (z >> 30)) * fingerprint::kMix1;
    z = (z ^ (z >> 27)) * fingerprint::kMix2;
    acc += z ^ (z >> 31);
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
    if (lane == 0) atomicAdd(out, static_cast<unsigned long long>(acc));
  }
}

template <typename Word>
void launch(const at::Tensor& words, uint64_t key, at::Tensor& out) {
  const int64_t n = words.numel();
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int grid = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads,
                                                      sms * kBlocksPerSm));
  fingerprint_kernel<Word><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      words.const_data_ptr<Word>(), n, key,
      reinterpret_cast<unsigned long long*>(out.mutable_data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor state_fingerprint_cuda(const at::Tensor& words, int64_t key) {
  check_fingerprint_words(words);
  const c10::cuda::CUDAGuard guard(words.device());
  at::Tensor out = at::zeros({}, words.options().dtype(at::kLong));
  if (words.numel() == 0) return out;
  const auto k = static_cast<uint64_t>(key);
  switch (words.scalar_type()) {
    case at::kShort: launch<int16_t>(words, k, out); break;
    case at::kInt: launch<int32_t>(words, k, out); break;
    case at::kLong: launch<int64_t>(words, k, out); break;
    default: launch<uint8_t>(words, k, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CUDA, m) { m.impl("_state_fingerprint", &state_fingerprint_cuda); }

}  // namespace dpzero::kernels
