// kernels/cuda/per_sample.cpp — registers the per-sample gradient ops of every layer kind
// (kernels/per_sample_ops.h; schemas in kernels/ops.cpp) for CUDA tensors. It holds no device code
// (so it is a .cpp, compiled only in CUDA builds): the ops are ATen compositions whose GEMMs run
// through cuBLAS on the current stream, and whose ghost paths reach the fused Gram-tile kernel of
// kernels/cuda/ghost_norm.cu through the dispatcher.
#include <torch/library.h>

#include "kernels/per_sample_ops.h"

namespace dpzero::kernels {

TORCH_LIBRARY_IMPL(dpzero, CUDA, m) {
  m.impl("linear_sq_norms", &per_sample::linear_sq_norms);
  m.impl("linear_clipped_sum", &per_sample::linear_clipped_sum);
  m.impl("linear_clip", &per_sample::linear_clip);
  m.impl("bias_sq_norms", &per_sample::bias_sq_norms);
  m.impl("bias_clipped_sum", &per_sample::bias_clipped_sum);
  m.impl("embedding_sq_norms", &per_sample::embedding_sq_norms);
  m.impl("embedding_clipped_sum", &per_sample::embedding_clipped_sum);
  m.impl("embedding_clip", &per_sample::embedding_clip);
  m.impl("layer_norm_sq_norms", &per_sample::layer_norm_sq_norms);
  m.impl("layer_norm_clipped_sum", &per_sample::layer_norm_clipped_sum);
  m.impl("layer_norm_clip", &per_sample::layer_norm_clip);
  m.impl("conv_sq_norms", &per_sample::conv_sq_norms);
  m.impl("conv_clipped_sum", &per_sample::conv_clipped_sum);
  m.impl("conv_clip", &per_sample::conv_clip);
}

}  // namespace dpzero::kernels
