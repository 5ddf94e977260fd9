// kernels/per_sample_ops.h — the per-sample gradient ops of every layer kind (schemas in
// kernels/ops.cpp): squared norms, clipped sums and the fused clip, written once as ATen
// compositions that run on any device, one file per layer kind under kernels/per_sample/. The
// only backend-specific piece, the ghost-norm Gram reduction, is reached through the dispatcher (dpzero::_ghost_sq_norms and
// dpzero::_token_ghost_sq_norms: kernels/cpu/ghost_norm.cpp, kernels/cuda/ghost_norm.cu), so
// kernels/per_sample.cpp registers these functions once, for every backend.
//
// Note [per-sample ops]
// A DP layer sees its input A and output gradient G for a micro-batch of B samples; any leading
// dims after the batch dim are flattened into a sequence length T, so A is [B, T, d_in] and G is
// [B, T, d_out]. Sample i's weight gradient is G_i^T A_i ([d_out, d_in]).
//  * *_sq_norms return ||g_i||^2 per sample ([B] float32) as a CERTIFIED UPPER BOUND: never below
//    the exact squared norm of the exact per-sample gradient of the inputs as given, nor below the
//    squared norm of what the layer's clipped sum adds for the sample (per unit factor), and
//    above them only by rounding margins (Note [certified norms], Note [clipped-sum rounding]). The ghost or direct path is chosen by
//    Note [ghost or direct] (kernels/per_sample_checks.h); loops run a chunk of samples at a time
//    (at most a chunk of per-sample gradients or Grams exists at once, none outlives the op).
//  * *_clipped_sum return sum_i c_i g_i (float32, the parameter's shape) for per-sample factors
//    c [B] float32: for a Linear layer G^T diag(c) A, the GEMMs that replace autograd's
//    weight-gradient GEMM (book-keeping, "BK", Bu et al. 2023, "Differentially private
//    optimization on large model at small cost": keep (A, G) from the one backward pass, then
//    weighted products, each sample's formed alone as Note [clipped-sum rounding] needs). A
//    sample whose factor is 0 or non-finite contributes exactly nothing, even when its A or G
//    holds NaN/Inf (its rows are zeroed, not multiplied by 0).
//  * *_clip (group / layer-wise clipping) compute the norms, the factors for threshold C
//    (privacy::clip_factor through dpzero::clip_factors: flat min(1, C/(||g||+1e-6)) or automatic
//    C/(||g||+gamma), factor 0 for a NaN/Inf norm, counted) and the clipped sum in one call.
// Precision: inputs float32 / bfloat16 / float16, outputs float32. Norms are computed in float64
// from exact float64 copies of the inputs and rounded up (Note [certified norms]). Clipped sums
// are full-IEEE float32 GEMMs and sums (never TF32 or oneDNN bf16: Note [fp32 matmul precision]),
// on float32 operands: low-precision inputs are upcast exactly, chunk by chunk. We do not run the
// clipped-sum GEMM on bf16/fp16 operands: that would round c_i * G_i to the input precision and
// could leave a clipped contribution up to 2^-8 (bf16) above its threshold, breaking the
// sensitivity bound. Bias clipped sums and the fused direct Linear path sum in float64.
// B = 0 (an empty micro-batch) gives empty norms and a zero clipped sum.
// Caller contracts (the ops cannot check them; the engine must):
//  * Batch first: dim 0 of every input is the sample dim. A layer fed [T, B, d] (a
//    batch_first=False attention or RNN input) must be transposed by the caller; otherwise the
//    "samples" are time steps and the clipping protects nothing.
//  * LayerNorm / RMSNorm normalise over the last `normalized_ndim` dims of the input
//    (= len(normalized_shape) of the module; default 1) and use the eps the caller passes.
//    torch.nn.RMSNorm(eps=None) means torch.finfo(input.dtype).eps: the caller passes that value.
//  * Embedding: the ops compute the gradient of a plain lookup. nn.Embedding(scale_grad_by_freq=
//    True) divides each row's gradient by the id's frequency in the whole micro-batch, so a
//    sample's gradient depends on the other samples; the engine must reject such modules.
//  * Conv: zero padding given as ints; other padding modes and 'same'/'valid' strings: pad the
//    input first and pass 0.
#pragma once

#include "kernels/per_sample/common.h"
#include "kernels/per_sample/conv.h"
#include "kernels/per_sample/embedding.h"
#include "kernels/per_sample/linear.h"
#include "kernels/per_sample/norm.h"
