// kernels/embedding_sums.h — what the CPU and CUDA implementations of dpzero::_add_embedding_sums_
// (schema in kernels/ops.cpp) share: the order of the sums, which both follow so that they give
// the same bits, and the argument checks (both refuse the same calls with the same messages).
//
// Note [embedding sums]
// ~~~~~~~~~~~~~~~~~~~~~
// An embedding's clipped sum adds, for every kept sample i (factor c_i, sample_products::adds) and
// every id v != pad that the sample holds, the sample's row sum into row v of the [V, d] float32
// accumulator:
//   r_j = sum over the sample's tokens t with id v, in position order, of c_i G_itj  (from 0.0f),
//   self_vj = self_vj + r_j,       for the samples holding v in ascending order of i,
// every product and addition a float32 operation rounded once (G read as float32, exactly for
// bfloat16 and float16). So each sample's contribution is formed alone before it meets another's
// (Note [clipped-sum rounding] in kernels/per_sample/common.h: rows rounded once after the
// factor, then a length-T sum per entry), and a dropped sample's rows and a padding token's row
// are never read. Distinct ids touch distinct rows, so the order of a sample's ids does not
// matter; only the order of samples within a row does, and that one is fixed.
//
// The host walks the samples in order. A device cannot let every sample add into a row at once
// without atomics, whose order would change the bits from run to run, so it goes in two passes:
//  1. a block per (column tile, sample) sorts the sample's tokens by (id, position), forms r for
//     each run of one id, writes it to a [B T, d] workspace at the run's last sorted position k,
//     and writes the run's key v B + i there too (kNoRun at every other position; keys are unique,
//     as a sample holds one run per id);
//  2. the keys sorted, a block per run of one v (per column tile) adds that row's sums in key
//     order, which is ascending i, into row v.
// An id outside [0, V) is refused on the host. On a device it is skipped (a check there would
// wait on the device), as the forward's embedding lookup has already refused it.
#pragma once

#include <cstdint>
#include <limits>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "kernels/per_sample_checks.h"
#include "kernels/sample_products_checks.h"

namespace dpzero::kernels::embedding_sums {

// A workspace position that ends no run: sorts after every key v B + i.
constexpr int64_t kNoRun = std::numeric_limits<int64_t>::max();

// self [V, d] float32, ids [B, T] int64, G [B, T, d] float32 / bfloat16 / float16, scale [B]
// float32, all on one device; pad -1 (none) or in [0, V); self shares memory with no operand.
inline void check_args(const at::Tensor& self, const at::Tensor& ids, const at::Tensor& g,
                       const at::Tensor& scale, int64_t pad) {
  constexpr const char* op = "_add_embedding_sums_";
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2, "dpzero::", op,
              ": ids must be [B, T] int64, got ", ids.scalar_type(), " of shape ", ids.sizes());
  check_floating(op, "G", g);
  TORCH_CHECK(g.dim() == 3 && g.size(0) == ids.size(0) && g.size(1) == ids.size(1), "dpzero::", op,
              ": G must be [B, T, d] with ids' [B, T] = ", ids.sizes(), ", got ", g.sizes());
  check_same_device(op, "ids", ids, g, "G");
  check_scale(op, scale, g.size(0), g);
  TORCH_CHECK(self.scalar_type() == at::kFloat && self.dim() == 2 && self.size(0) >= 1 &&
                  self.size(1) == g.size(2),
              "dpzero::", op, ": self (the accumulator) must be [V, d] = [V, ", g.size(2),
              "] float32 with V >= 1, got ", self.scalar_type(), " of shape ", self.sizes());
  check_same_device(op, "self", self, g, "G");
  TORCH_CHECK(pad >= -1 && pad < self.size(0), "dpzero::", op, ": pad must be -1 (none) or in [0, ",
              self.size(0), "), got ", pad);
  TORCH_CHECK(sample_products::disjoint(self, g) && sample_products::disjoint(self, scale) &&
                  sample_products::disjoint(self, ids),
              "dpzero::", op, ": self shares memory with ids, G or scale; add into another tensor");
  const int64_t b = g.size(0);
  TORCH_CHECK(b == 0 || self.size(0) <= (kNoRun - 1) / b, "dpzero::", op, ": V = ", self.size(0),
              " rows times B = ", b, " samples overflow the run keys");
}

}  // namespace dpzero::kernels::embedding_sums
