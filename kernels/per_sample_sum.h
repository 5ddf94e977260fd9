// kernels/per_sample_sum.h — what the CPU and CUDA implementations of
// dpzero::add_per_sample_clipped_sum_ (schema in kernels/ops.cpp) share besides the argument
// checks (per_sample_checks.h): the order of the sum, which both follow so that they give the same
// bits.
//
// Note [kept sums in chunks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Entry j of the sum of kept per-sample gradients is formed in float64 as
//   part_k = sum over the kept samples i of chunk k, in order, of c_i g_ij  (part_k from 0.0),
//   total  = sum over the chunks k = 0, 1, ..., in order, of part_k           (total from 0.0),
// chunk k holding samples [k kSamplesPerChunk, (k + 1) kSamplesPerChunk), each product and each
// addition rounded once; then self_j = self_j + float32(total), one float32 addition. A sample
// whose factor is 0 or non-finite is skipped, its row never read (sample_products::adds). The
// chunks give a GPU one thread per entry and chunk, where a thread per entry alone would leave
// most of the device idle at large B and read the rows with little in flight; the association is
// fixed (it depends on B alone, not on the device or its size), so the host and the device agree
// bit for bit. The rounding bound is Note [clipped-sum rounding]'s for a sum of bounded terms in
// float64 (any association), far below the float32 rounding that follows.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace dpzero::kernels::per_sample_sum {

constexpr int64_t kSamplesPerChunk = 32;

inline int64_t chunks(int64_t b) { return (b + kSamplesPerChunk - 1) / kSamplesPerChunk; }

// Where a backend adds the sums: self itself, or for a strided self (a slot of another layout) a
// contiguous copy of its values, written back by written_back (the same float32 additions).
inline at::Tensor accumulator(const at::Tensor& self) {
  return self.is_contiguous() ? self : self.contiguous();
}

// The op's end on either backend: an in-place write moves self's version counter, as autograd
// must see it; a copy is written back into self (copy_ moves the counter itself).
inline at::Tensor& written_back(at::Tensor& self, const at::Tensor& out) {
  if (out.is_same(self)) {
    self.unsafeGetTensorImpl()->bump_version();
  } else {
    self.copy_(out);
  }
  return self;
}

}  // namespace dpzero::kernels::per_sample_sum
