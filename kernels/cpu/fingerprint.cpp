// kernels/cpu/fingerprint.cpp — CPU implementation of dpzero::_state_fingerprint (schema in
// kernels/ops.cpp; the sum is kernels/fingerprint_words.h): one multi-threaded pass per tensor, eight
// words a step where the CPU has AVX-512 (fingerprint_simd.h), else the scalar loop below.
#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels/cpu/cpu_lanes.h"
#include "kernels/cpu/fingerprint_simd.h"
#include "kernels/fingerprint_checks.h"
#include "kernels/fingerprint_words.h"

namespace dpzero::kernels {
namespace {

// The sum over words[0, n) in uint64 arithmetic, which wraps modulo 2^64; Word's conversion to
// int64 is the words' extension (uint8 zero-, wider types sign-extended).
template <typename Word>
uint64_t host_fingerprint(const Word* words, int64_t n, uint64_t key) {
  constexpr bool kLanes = sizeof(Word) >= 2;  // bytes take the scalar loop
  const bool lanes = kLanes && cpu_lanes::avx512f_dq();
  return at::parallel_reduce(
      int64_t{0}, n, int64_t{1} << 16, uint64_t{0},
      [&](int64_t begin, int64_t end, uint64_t acc) {
        if constexpr (kLanes) {
          if (lanes) return acc + fingerprint::sum_avx512(words, begin, end, key);
        }
        for (int64_t j = begin; j < end; ++j) {
          acc += fingerprint::term(static_cast<uint64_t>(static_cast<int64_t>(words[j])),
                                   static_cast<uint64_t>(j), key);
        }
        return acc;
      },
      [](uint64_t a, uint64_t b) { return a + b; });
}

// words[l] -> its fingerprint under key.
uint64_t fingerprint_of(const at::Tensor& words, uint64_t key) {
  const int64_t n = words.numel();
  if (n == 0) return 0;
  switch (words.scalar_type()) {
    case at::kShort: return host_fingerprint(words.const_data_ptr<int16_t>(), n, key);
    case at::kInt: return host_fingerprint(words.const_data_ptr<int32_t>(), n, key);
    case at::kLong: return host_fingerprint(words.const_data_ptr<int64_t>(), n, key);
    default: return host_fingerprint(words.const_data_ptr<uint8_t>(), n, key);
  }
}

at::Tensor state_fingerprint_cpu(at::TensorList words, int64_t key) {
  check_fingerprint_words(words);
  at::Tensor out = at::empty({static_cast<int64_t>(words.size())},
                             words[0].options().dtype(at::kLong));
  int64_t* o = out.mutable_data_ptr<int64_t>();
  for (size_t l = 0; l < words.size(); ++l)
    o[l] = static_cast<int64_t>(fingerprint_of(words[l], static_cast<uint64_t>(key)));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpzero, CPU, m) { m.impl("_state_fingerprint", &state_fingerprint_cpu); }

}  // namespace dpzero::kernels
