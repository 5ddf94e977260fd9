// kernels/cpu/rank_one.h — the T = 1 path of the CPU ghost kernels (Note [rank-one ghost] in
// kernels/per_sample_checks.h), called by kernels/cpu/ghost_norm.cpp.
#pragma once

#include <cstdint>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace dpzero::kernels {

// a [B, 1, d_in] and each gs[l] [B, 1, d_out_l] (float32 / bfloat16 / float16, any strides) ->
// ([L, B] value = ||a_i||^2 ||g_{l,i}||^2, [L, B] S = sqrt(value)), float64. With ids [B, 1]
// int64 instead of a (an embedding; `a` undefined): value = ||g_{l,i}||^2 and S = ||g_{l,i}||
// for a token other than `pad`, 0 and 0 for a padding token (pad = -1: none).
std::tuple<at::Tensor, at::Tensor> rank_one_values(const at::Tensor& a, const at::Tensor& ids,
                                                   int64_t pad, at::TensorList gs);

}  // namespace dpzero::kernels
