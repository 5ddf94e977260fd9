// kernels/ghost_gemm.h — the ghost value from float64 GEMM Gram strips, written once in ATen for
// any device: the long-sequence path of the CUDA ghost kernels (Note [ghost roofline] in
// kernels/cuda/ghost_norm.cu says when), the same strips and row sums as the CPU kernel's (Note
// [gram strips] in kernels/cpu/ghost_norm.cpp), with the reductions done by ATen ops.
#pragma once

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dpzero::kernels {

// The row blocks [r0, r1) of the strips for a length-T sequence: ceil(T / 128) blocks, at most 8,
// of near-equal size (a GEMM of fewer than ~128 rows wastes a GPU's GEMM tiles; 8 blocks already
// do (8 + 1) / 16 of the full Grams' work).
std::vector<std::pair<int64_t, int64_t>> gemm_row_blocks(int64_t T);

// A [B, T, d_in], G [B, T, d_out] -> (value [B] = <A_i A_i^T, G_i G_i^T>, S [B] = sum_t ||a_t||
// ||g_t||), float64, raw (not yet certified), as dpzero::_ghost_sq_norms returns them. With A
// undefined and ids [B, T] int64 (an embedding): value = sum_{s,t} [id_s = id_t != pad] g_s . g_t,
// S = sum_{t: id_t != pad} ||g_t|| (pad = -1: none), as dpzero::_token_ghost_sq_norms. Inputs
// float32 / bfloat16 / float16 on any one device (A and G may differ in dtype); the outputs are
// on that device. Summation depth <= 2T (Note [ghost summation depth]).
std::tuple<at::Tensor, at::Tensor> ghost_values_gemm(const at::Tensor& a, const at::Tensor& ids,
                                                     const at::Tensor& g, int64_t pad);

// Note [shared inputs] (kernels/per_sample/linear.h): A [B, T, d_in] against each G[l] [B, T,
// d_out_l] -> (value [L, B], S [L, B]) float64, row l equal to ghost_values_gemm(A, {}, G[l], -1)
// up to the order of additions; A's Gram strips are made once per chunk for all L, then each G's
// in turn. Inputs float32 / bfloat16 / float16 on one device, dtypes may differ.
std::tuple<at::Tensor, at::Tensor> ghost_values_gemm_multi(const at::Tensor& a,
                                                           at::TensorList gs);

}  // namespace dpzero::kernels
