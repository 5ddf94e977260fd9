// kernels/per_sample.cpp — registers the per-sample gradient ops of every layer kind
// (kernels/per_sample_ops.h; schemas in kernels/ops.cpp) once for every backend. They are ATen
// compositions (GEMMs through the backend's BLAS — cuBLAS on the current stream on CUDA), so one
// CompositeExplicitAutograd registration serves CPU and CUDA alike; the only backend-specific part,
// the ghost-norm Gram reduction, is its own op with one implementation per backend
// (kernels/cpu/ghost_norm.cpp, kernels/cuda/ghost_norm.cu), reached through the dispatcher.
#include <cstdint>

#include <torch/library.h>

#include "kernels/per_sample_checks.h"
#include "kernels/per_sample_ops.h"

namespace dpzero::kernels {
namespace {

// Note [ghost or direct] in kernels/per_sample_checks.h.
bool ghost_is_cheaper_op(int64_t T, int64_t d_in, int64_t d_out) {
  return ghost_is_cheaper(T, d_in, d_out);
}

// Tests only: the chunk byte budget (kernels/per_sample_checks.h); returns the previous one.
int64_t set_chunk_bytes_op(int64_t bytes) { return set_chunk_bytes(bytes); }

// Tests and benchmarks only: where the CUDA ghost kernels switch to GEMM strips; returns the
// previous one.
int64_t set_ghost_gemm_min_rows_op(int64_t rows) { return set_ghost_gemm_min_rows(rows); }

// Tests and benchmarks only: where the CUDA ghost kernels take the split tiles; returns the
// previous one.
int64_t set_ghost_split_min_rows_op(int64_t rows) { return set_ghost_split_min_rows(rows); }

// Tests only: Note [device path]; returns the previous setting.
bool set_device_path_op(bool forced) { return device_path_forced().exchange(forced); }

}  // namespace

// No tensor arguments, so no backend key: CompositeImplicitAutograd serves every call.
TORCH_LIBRARY_IMPL(dpzero, CompositeImplicitAutograd, m) {
  m.impl("ghost_is_cheaper", &ghost_is_cheaper_op);
  m.impl("_set_chunk_bytes", &set_chunk_bytes_op);
  m.impl("_set_ghost_gemm_min_rows", &set_ghost_gemm_min_rows_op);
  m.impl("_set_ghost_split_min_rows", &set_ghost_split_min_rows_op);
  m.impl("_set_device_path", &set_device_path_op);
}

// Backend-generic kernels without an autograd formula (they compute gradients; nothing
// differentiates through them).
TORCH_LIBRARY_IMPL(dpzero, CompositeExplicitAutograd, m) {
  m.impl("linear_sq_norms", &per_sample::linear_sq_norms);
  m.impl("linear_sq_norms_multi", &per_sample::linear_sq_norms_multi);
  // Note [shared inputs]: the CPU and CUDA kernels (kernels/cpu/ghost_norm.cpp,
  // kernels/cuda/ghost_norm.cu) build A's Gram once; other devices run one _ghost_sq_norms per
  // layer.
  m.impl("_ghost_sq_norms_multi", &per_sample::ghost_sq_norms_multi_generic);
  m.impl("linear_clipped_sum", &per_sample::linear_clipped_sum);
  m.impl("add_linear_clipped_sum_", &per_sample::add_linear_clipped_sum_);
  m.impl("linear_clip", &per_sample::linear_clip);
  m.impl("bias_sq_norms", &per_sample::bias_sq_norms);
  m.impl("bias_clipped_sum", &per_sample::bias_clipped_sum);
  m.impl("bias_per_sample", &per_sample::bias_per_sample);
  m.impl("per_sample_clipped_sum", &per_sample::per_sample_clipped_sum);
  m.impl("embedding_sq_norms", &per_sample::embedding_sq_norms);
  m.impl("embedding_clipped_sum", &per_sample::embedding_clipped_sum);
  m.impl("add_embedding_clipped_sum_", &per_sample::add_embedding_clipped_sum_);
  m.impl("embedding_clip", &per_sample::embedding_clip);
  m.impl("layer_norm_sq_norms", &per_sample::layer_norm_sq_norms);
  m.impl("layer_norm_clipped_sum", &per_sample::layer_norm_clipped_sum);
  m.impl("layer_norm_clip", &per_sample::layer_norm_clip);
  m.impl("layer_norm_per_sample", &per_sample::layer_norm_per_sample);
  m.impl("conv_sq_norms", &per_sample::conv_sq_norms);
  m.impl("conv_clipped_sum", &per_sample::conv_clipped_sum);
  m.impl("conv_clip", &per_sample::conv_clip);
  // Note [row sums]: any device; kernels/cpu/row_sums.cpp and kernels/cuda/row_sums.cu override
  // them on the CPU and on CUDA.
  m.impl("_row_sums", &per_sample::row_sums_generic);
  m.impl("_norm_row_sums", &per_sample::norm_row_sums_generic);
  m.impl("_embedding_rows", &per_sample::embedding_rows_generic);
}

}  // namespace dpzero::kernels
