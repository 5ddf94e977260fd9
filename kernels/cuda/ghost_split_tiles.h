// kernels/cuda/ghost_split_tiles.h — the split tiles (Note [split tiles] in
// kernels/cuda/ghost_split_tiles.cu): the CUDA ghost value with float64 tensor-core Grams and each
// operand's features split over blocks, called by kernels/cuda/ghost_norm.cu's launchers.
#pragma once

#include <cstdint>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace dpzero::kernels {

// Whether `device` (a CUDA device) has the float64 tensor cores the split tiles run on (sm_80 and
// later); elsewhere the fused tiles serve every length.
bool split_tiles_supported(const c10::Device& device);

// a [B, T, d_in] (undefined when tokens), ids [B, T] int64 (tokens only), gs[l] [B, T, d_l] (L >=
// 1); all contiguous, a and every G of one element type (float32, bfloat16 or float16), on one
// CUDA device; B >= 1, T >= 2. -> (value [L, B], S [L, B]) float64, raw as dpzero::_ghost_sq_norms
// (or _token_ghost_sq_norms with padding_idx, -1 for none) returns them for (A or ids, G[l]).
std::tuple<at::Tensor, at::Tensor> ghost_split_tiles(const at::Tensor& a, const at::Tensor& ids,
                                                     const std::vector<at::Tensor>& gs,
                                                     int64_t padding_idx, bool tokens);

}  // namespace dpzero::kernels
