// kernels/sample_products_checks.h — what the CPU and CUDA implementations of
// dpzero::_add_sample_products_ (schema in kernels/ops.cpp) share besides their arithmetic: the
// argument checks (both backends refuse the same calls with the same messages) and the rule that
// skips a dropped sample.
#pragma once

#include <cstdint>
#include <utility>

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

namespace dpzero::kernels::sample_products {

// Whether sample i's factor adds its product: a factor of 0 or a non-finite one is a dropped
// sample, whose rows (maybe NaN or Inf) are never read into a sum (as _scale_rows zeroes them).
// The one statement of the rule, for host and device code.
C10_HOST_DEVICE inline bool adds(float factor) {
  return factor - factor == 0.0f && factor != 0.0f;  // finite: x - x is NaN for Inf and NaN
}

inline bool floating(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
         x.scalar_type() == at::kHalf;
}

// Whether `self` [rows, cols] can take the op's in-place write: unit column stride (or one
// column) and rows that do not overlap (a row stride of at least cols, or one row), so no two
// entries share memory (a caller with another destination forms the products itself).
inline bool accepts(const at::Tensor& self) {
  return (self.stride(1) == 1 || self.size(1) <= 1) &&
         (self.stride(0) >= self.size(1) || self.size(0) <= 1);
}

// Whether a and b touch disjoint memory: other storages, or byte ranges [first, last element]
// that do not meet in one storage (torch's strides are never negative).
inline bool disjoint(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return true;
  if (!a.has_storage() || !b.has_storage()) return false;
  if (!a.storage().is_alias_of(b.storage())) return true;
  const auto range = [](const at::Tensor& x) {
    int64_t last = x.storage_offset();
    for (int64_t d = 0; d < x.dim(); ++d) last += (x.size(d) - 1) * x.stride(d);
    const int64_t item = static_cast<int64_t>(x.element_size());
    return std::pair<int64_t, int64_t>{x.storage_offset() * item, (last + 1) * item};
  };
  const auto [a0, a1] = range(a);
  const auto [b0, b1] = range(b);
  return a1 <= b0 || b1 <= a0;
}

// Whether the op takes this call as it is: `accepts(self)`, operands of the op's dtypes, and no
// operand sharing self's memory (a caller's other path handles the rest).
inline bool fits(const at::Tensor& self, const at::Tensor& left, const at::Tensor& right,
                 const at::Tensor& scale) {
  return self.scalar_type() == at::kFloat && floating(left) && floating(right) && accepts(self) &&
         disjoint(self, left) && disjoint(self, right) && disjoint(self, scale);
}

// Checks self [rows, cols] float32 (unit column stride unless cols <= 1), left [c, T, rows] and
// right [c, T, cols] float32 / bfloat16 / float16, scale [c] float32, all on self's device,
// splits >= 0; self shares memory with no operand (scale included) nor with itself.
inline void check(const at::Tensor& self, const at::Tensor& left, const at::Tensor& right,
                  const at::Tensor& scale, int64_t splits) {
  constexpr const char* op = "dpzero::_add_sample_products_";
  TORCH_CHECK(self.dim() == 2 && self.scalar_type() == at::kFloat, op,
              ": self must be a [rows, cols] float32 matrix, got ", self.scalar_type(),
              " of shape ", self.sizes());
  TORCH_CHECK(left.dim() == 3 && right.dim() == 3 && floating(left) && floating(right), op,
              ": left and right must be [c, T, rows] and [c, T, cols] float32, bfloat16 or "
              "float16, got ", left.scalar_type(), " of shape ", left.sizes(), " and ",
              right.scalar_type(), " of shape ", right.sizes());
  TORCH_CHECK(left.size(0) == right.size(0) && left.size(1) == right.size(1) &&
                  left.size(2) == self.size(0) && right.size(2) == self.size(1),
              op, ": left ", left.sizes(), " and right ", right.sizes(),
              " do not make the [rows, cols] = ", self.sizes(), " sum of per-sample products");
  TORCH_CHECK(scale.dim() == 1 && scale.scalar_type() == at::kFloat &&
                  scale.size(0) == left.size(0),
              op, ": scale must be [", left.size(0), "] float32 (one factor per sample), got ",
              scale.scalar_type(), " of shape ", scale.sizes());
  for (const at::Tensor* x : {&left, &right, &scale}) {
    TORCH_CHECK(x->device() == self.device(), op, ": an operand is on ", x->device(),
                ", self on ", self.device());
  }
  TORCH_CHECK(splits >= 0, op, ": splits must be >= 0 (0: chosen by the device), got ", splits);
  TORCH_CHECK(accepts(self), op,
              ": self must have unit column stride and rows that do not overlap, got strides ",
              self.strides(), " for shape ", self.sizes());
  TORCH_CHECK(disjoint(self, left) && disjoint(self, right) && disjoint(self, scale), op,
              ": self shares memory with an operand");
}

}  // namespace dpzero::kernels::sample_products
