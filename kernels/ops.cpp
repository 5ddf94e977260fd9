// kernels/ops.cpp — the one schema of dpzero's torch ops (TORCH_LIBRARY(dpzero, ...)).
// Each op (or op family) has one implementation file per backend, side by side: kernels/cpu/<x>.cpp
// and kernels/cuda/<x>.cu. The per-sample layer ops are one family written once in ATen
// (per_sample_ops.h) and registered once for every backend (per_sample.cpp); their only
// backend-specific kernel is the ghost-norm Gram reduction (cpu/ghost_norm.cpp and
// cuda/ghost_norm.cu).
#include <torch/library.h>

TORCH_LIBRARY(dpzero, m) {
  // In place: self[i] += std * z(seed, step, offset + i) for every i (Note [noise ownership] in
  // privacy/noise.h). self: [n] any shape, contiguous, float32 / bfloat16 / float16 (fp32 math).
  // seed is a 64-bit key given as int64 (its bits are used as uint64); 0 <= step < 2^32;
  // offset >= 0 is the global coordinate index of self's first element.
  m.def("add_noise_(Tensor(a!) self, float std, int seed, int step, int offset) -> Tensor(a!)");
  // Secure mode (Note [secure noise] in privacy/secure_noise.h): the same contract with the draw
  // from ChaCha20 under a 256-bit key given as eight 32-bit words (0 <= w < 2^32), fp64 math and
  // the sum-of-normals mitigation. self: contiguous float32 / float64 / bfloat16 / float16.
  m.def("add_secure_noise_(Tensor(a!) self, float std, int[] key, int step, int offset) -> Tensor(a!)");
  // Both draws over a table of coordinate runs (Note [noise launches] in
  // kernels/cuda/noise_runs.cuh): runs is [3 R] int64, R triples (local, length, global); for each
  // run, self[local + k] += std * z(.., step, global + k) for 0 <= k < length, exactly as
  // add_noise_ / add_secure_noise_ on self[local : local + length] with offset = global. The runs
  // must lie inside self and be disjoint in ascending order of `local`; elements outside them are
  // untouched. One call (one CUDA launch per 128 runs) instead of one per run.
  m.def("add_noise_runs_(Tensor(a!) self, float std, int seed, int step, int[] runs) "
        "-> Tensor(a!)");
  m.def("add_secure_noise_runs_(Tensor(a!) self, float std, int[] key, int step, int[] runs) "
        "-> Tensor(a!)");
  // Per-sample clip factors from per-sample norms (privacy/clipping.h): norms [B] float32;
  // mode "flat" (min(1, C/(n+1e-6))) or "automatic" (C/(n+gamma)). Returns factors [B] float32
  // (0 for NaN/Inf/negative norms) and the count of such invalid norms as a 0-dim int64 tensor;
  // norm * factor <= max_norm holds exactly (privacy/clipping.h).
  m.def("clip_factors(Tensor norms, float max_norm, str mode, float gamma=0.01) -> (Tensor, Tensor)");

  // ---- Per-sample gradient norms, clipped sums and fused clipping ------------------------------
  // Note [per-sample ops] in kernels/per_sample_ops.h. Shapes: A [B, ..., d_in] / G [B, ..., d_out]
  // with the leading dims after B flattened into T; inputs float32 / bfloat16 / float16; every
  // output float32. sq_norms are per-sample SQUARED gradient norms [B] (they add across layers),
  // certified upper bounds computed in float64 (Note [certified norms]: never below the exact
  // value); scale is [B] float32 (a sample with scale 0 or non-finite contributes nothing). method:
  // 0 = auto (ghost iff ghost_is_cheaper; embeddings on the CPU: always direct, Note [embedding
  // rows]), 1 = ghost norm, 2 = direct. The *_clip ops return
  // factors [B] from dpzero::clip_factors (flat / automatic, gamma) and the non-finite count.
  // True iff the ghost norm is the cheaper path: 2 T^2 <= d_in d_out (Note [ghost or direct]).
  m.def("ghost_is_cheaper(int T, int d_in, int d_out) -> bool");
  // Linear weight ([d_out, d_in]) and HF Conv1D weight ([d_in, d_out], transposed=True): A is the
  // layer input, G the output gradient. bias=True adds the bias's share (||sum_t G_i||^2).
  m.def("linear_sq_norms(Tensor A, Tensor G, bool bias=False, int method=0) -> Tensor");
  // Note [shared inputs]: layers reading one input A (attention's query/key/value, a gated MLP's
  // gate/up), each with its output gradient G[l] [B, ..., d_out_l] -> [L, B] float32, row l
  // equal to linear_sq_norms(A, G[l], False, method).
  m.def("linear_sq_norms_multi(Tensor A, Tensor[] G, int method=0) -> Tensor");
  m.def("linear_clipped_sum(Tensor A, Tensor G, Tensor scale, bool transposed=False) -> Tensor");
  // Note [accumulating clipped sums]: the same sum added into self (float32, the weight's shape),
  // e.g. the parameter's slot of the engine's flat gradient buffer.
  m.def("add_linear_clipped_sum_(Tensor(a!) self, Tensor A, Tensor G, Tensor scale, "
        "bool transposed=False) -> Tensor(a!)");
  // -> (grad_weight, grad_bias [d_out] or [0] without bias, sq_norms, factors, nonfinite)
  m.def("linear_clip(Tensor A, Tensor G, float max_norm, str mode, float gamma=0.01, "
        "bool bias=False, bool transposed=False, int method=0) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Any bias: G [B, ..., d] with the bias dim last -> [B] / [d].
  m.def("bias_sq_norms(Tensor G) -> Tensor");
  m.def("bias_clipped_sum(Tensor G, Tensor scale) -> Tensor");
  // Note [kept per-sample gradients]: -> (per-sample bias gradients [B, d] float64, sq_norms [B]).
  m.def("bias_per_sample(Tensor G) -> (Tensor, Tensor)");
  // Kept per-sample gradients grads [B, ...] (float64 / float32), scale [B] -> [...] float32.
  m.def("per_sample_clipped_sum(Tensor grads, Tensor scale) -> Tensor");
  // The same sum added into self, float32 with the elements of one sample's grads (a parameter's
  // slot): self += float32(sum_i scale_i grads_i), the sum in float64 in the order of Note [kept
  // sums in chunks] (kernels/per_sample_sum.h), a sample whose factor is 0 or non-finite skipped
  // (its row never read). The same bits on every backend; one launch on a GPU up to 32 samples,
  // two above.
  m.def("add_per_sample_clipped_sum_(Tensor(a!) self, Tensor grads, Tensor scale) -> Tensor(a!)");
  // The same for a list of pairs under one scale: self[k] += float32(sum_i scale_i grads[k]_i),
  // each pair's bits add_per_sample_clipped_sum_'s; no self shares memory with another self or
  // with another pair's grads. One launch on a GPU for up to 32 samples, two above, whatever the
  // number of pairs (a layer's kept biases and norm parameters, or a whole group's).
  m.def("_add_per_sample_clipped_sums_(Tensor(a!)[] self, Tensor[] grads, Tensor scale) -> ()");
  // Embedding [V, d]: ids [B, ...] int64/int32, G ids.shape + [d]; padding_idx as in nn.Embedding
  // (padding tokens get no gradient). clipped sum -> [V, d].
  m.def("embedding_sq_norms(Tensor ids, Tensor G, int num_embeddings, int? padding_idx=None, "
        "int method=0) -> Tensor");
  m.def("embedding_clipped_sum(Tensor ids, Tensor G, Tensor scale, int num_embeddings, "
        "int? padding_idx=None) -> Tensor");
  m.def("add_embedding_clipped_sum_(Tensor(a!) self, Tensor ids, Tensor G, Tensor scale, "
        "int num_embeddings, int? padding_idx=None) -> Tensor(a!)");
  // -> (grad_weight [V, d], sq_norms, factors, nonfinite)
  m.def("embedding_clip(Tensor ids, Tensor G, int num_embeddings, float max_norm, str mode, "
        "float gamma=0.01, int? padding_idx=None, int method=0) -> (Tensor, Tensor, Tensor, Tensor)");
  // LayerNorm (rms=False) / RMSNorm (rms=True) over the last normalized_ndim dims (=
  // len(normalized_shape)): input is the RAW layer input [B, ..., *normalized_shape]; the op
  // computes x̂ from it and eps in float64 (RMSNorm's eps=None: pass torch.finfo(dtype).eps).
  // Weight grad sum_t G ⊙ x̂ -> normalized_shape.
  m.def("layer_norm_sq_norms(Tensor input, Tensor G, float eps, bool rms=False, bool bias=False, "
        "int normalized_ndim=1) -> Tensor");
  m.def("layer_norm_clipped_sum(Tensor input, Tensor G, Tensor scale, float eps, bool rms=False, "
        "int normalized_ndim=1) -> Tensor");
  // -> (grad_weight, grad_bias or [0], sq_norms, factors, nonfinite); grads of normalized_shape
  m.def("layer_norm_clip(Tensor input, Tensor G, float eps, float max_norm, str mode, "
        "float gamma=0.01, bool rms=False, bool bias=False, int normalized_ndim=1) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Note [kept per-sample gradients]: -> (per-sample weight gradients [B, *normalized_shape]
  // float64, sq_norms [B]); the bias's: bias_per_sample.
  m.def("layer_norm_per_sample(Tensor input, Tensor G, float eps, bool rms=False, "
        "int normalized_ndim=1) -> (Tensor, Tensor)");
  // Conv1d (kernel_size [k]) / Conv2d ([kh, kw]): input [B, C_in, *spatial], G [B, C_out,
  // *out_spatial]; zero padding given as ints. clipped sum -> [C_out, C_in/groups, *kernel_size].
  m.def("conv_sq_norms(Tensor input, Tensor G, int[] kernel_size, int[] stride, int[] padding, "
        "int[] dilation, int groups=1, bool bias=False, int method=0) -> Tensor");
  m.def("conv_clipped_sum(Tensor input, Tensor G, Tensor scale, int[] kernel_size, int[] stride, "
        "int[] padding, int[] dilation, int groups=1) -> Tensor");
  // -> (grad_weight, grad_bias [C_out] or [0], sq_norms, factors, nonfinite)
  m.def("conv_clip(Tensor input, Tensor G, int[] kernel_size, int[] stride, int[] padding, "
        "int[] dilation, int groups, float max_norm, str mode, float gamma=0.01, bool bias=False, "
        "int method=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Backend kernels of the ghost paths (kernels/cpu/ghost_norm.cpp, kernels/cuda/ghost_norm.cu);
  // call the layer ops instead. A [B, T, d_in], G [B, T, d_out] -> <A_i A_i^T, G_i G_i^T> [B];
  // ids [B, T] int64, padding_idx >= 0 or -1 (none) -> sum_{s,t} [id_s = id_t != pad] g_s . g_t.
  // Both return the RAW float64 value (not yet a certified bound: Note [certified norms]) and S
  // [B] float64, sum_t ||a_t|| ||g_t|| (tokens: sum over non-padding t of ||g_t||).
  m.def("_ghost_sq_norms(Tensor A, Tensor G) -> (Tensor, Tensor)");
  m.def("_token_ghost_sq_norms(Tensor ids, Tensor G, int padding_idx) -> (Tensor, Tensor)");
  // _ghost_sq_norms of A against each G[l]: ([L, B] values, [L, B] S), float64.
  m.def("_ghost_sq_norms_multi(Tensor A, Tensor[] G) -> (Tensor, Tensor)");
  // Note [row sums] in kernels/per_sample/common.h: G [B, T, d] -> (sum_t G_t [B, d], sum_t ||G_t||
  // [B]); x, G [B, T, d] -> (sum_t G_t ⊙ x̂_t [B, d], sum_t ||G_t ⊙ x̂_t|| [B]), x̂ the LayerNorm
  // (rms=False) or RMSNorm (rms=True) normalisation of x over d with eps; all float64.
  m.def("_row_sums(Tensor G) -> (Tensor, Tensor)");
  // Note [embedding rows]: ids [B, T] int64, G [B, T, d], padding_idx >= 0 or -1 (none) ->
  // (sum over distinct ids v != pad of ||sum_{t: id_t = v} G_t||^2 [B], sum_{t: id_t != pad}
  // ||G_t|| [B]), float64 (raw: the layer ops certify them).
  m.def("_embedding_rows(Tensor ids, Tensor G, int num_embeddings, int padding_idx) "
        "-> (Tensor, Tensor)");
  m.def("_norm_row_sums(Tensor x, Tensor G, float eps, bool rms) -> (Tensor, Tensor)");
  // The directed-rounding steps of certified norms on per-sample vectors, one pass (one launch):
  // kernels/certify.h's Step table says what each step computes from value (float64 or float32;
  // [B] for most steps, [B, n] for kRows, [P, B] for kSumUp), S (float64, value's shape or [B];
  // the certifying steps only), coef and, for the certifying steps, margin (Note [clipped-sum
  // rounding] in kernels/per_sample/common.h). Returns float64 where the step gives float64 and not
  // f32, else float32 rounded up (down for the kRoundDown and kScaleDown steps). `rest` ([B]
  // float32, kGhost, kDirect or kRows with f32, or kRoundUp): another certified squared norm of the
  // same samples (a Linear's or a norm layer's bias), added to the result as kSumUp adds two parts
  // (certify::plus_rest). Or, in its place, `rest_rows` [B, n] float64 and `rest_s` [B] float64: a
  // bias's kept rows and their S, certified in the same pass as kRows with f32 and coef
  // `rest_coef` would (certify::rows_bound), then added the same way.
  m.def("_certify(Tensor value, Tensor? S, float coef, int step, bool f32=False, "
        "float margin=0.0, Tensor? rest=None, Tensor? rest_rows=None, Tensor? rest_s=None, "
        "float rest_coef=0.0) -> Tensor");
  // One clipping group's factors in one pass (Note [certified group norms] in src/dp/clip_group.h,
  // Note [mean loss] in src/dp/book.h): sq [P, B] float32, the parts' certified squared norms as
  // delivered, grouped by component in order (sizes[c] parts each); mean >= 1 the mean-loss
  // scale. -> (factors [B] float32 for the delivered gradients, certified group norms [B]
  // float32 of the mean-scaled ones); a factor is 0 exactly where the norm is not finite.
  m.def("_group_clip(Tensor sq, int[] sizes, int mean, float max_norm, str mode, "
        "float gamma=0.01) -> (Tensor, Tensor)");
  // x [B, ...] float32 / float64, scale [B] float32 -> x's shape and dtype: row i times scale[i]
  // (multiply) or as it is, and zeros for a row whose factor is 0 or non-finite (a dropped
  // sample: its NaN/Inf never reaches a sum). One pass over x.
  m.def("_scale_rows(Tensor x, Tensor scale, bool multiply) -> Tensor");
  // self [rows, cols] float32 += sum_i scale_i left_i^T right_i, left [c, T, rows] and right
  // [c, T, cols] float32 / bfloat16 / float16, scale [c] float32: each sample's contribution
  // formed alone in float32 from zero (its left rows times its factor, each rounded once), then
  // added (Note [clipped-sum rounding]); a
  // sample whose factor is 0 or non-finite is skipped, its rows never read into a sum. The device
  // path of the clipped sums (Note [device path]). `splits` (CUDA only; 0: chosen from the
  // device's size) divides the samples among that many blocks per output tile, whose sums are
  // added after in a fixed order.
  m.def("_add_sample_products_(Tensor(a!) self, Tensor left, Tensor right, Tensor scale, "
        "int splits=0) -> Tensor(a!)");
  // self [V, d] float32 += each kept sample's embedding rows summed per id, ids [B, T] int64 in
  // [0, V), G [B, T, d] float32 / bfloat16 / float16, scale [B] float32 (its factors); a padding
  // token (id pad; -1: none) and a sample whose factor is 0 or non-finite are skipped, their rows
  // never read. Each sample's per-id sum formed alone in float32 (c_i G_t rounded once, then added
  // in position order), then added into its row in ascending sample order: Note [embedding sums]
  // (kernels/embedding_sums.h), the same bits on every backend. The device path of the embedding's
  // clipped sums (Note [device path]).
  m.def("_add_embedding_sums_(Tensor(a!) self, Tensor ids, Tensor G, Tensor scale, int pad) -> "
        "Tensor(a!)");
  // Note [state written from data] (src/dp/state_guard.h): words, L >= 1 tensors [n_l] contiguous
  // uint8 / int16 / int32 / int64 (tensors' bits viewed as integers) on one device -> [L] int64 on
  // that device, entry l the sum modulo 2^64 of kernels/fingerprint_words.h over words[l] under
  // `key`. Every backend gives the same bits; a GPU takes one launch per 96 tensors.
  m.def("_state_fingerprint(Tensor[] words, int key) -> Tensor");
  // Tests only: sets the byte budget of every chunked per-sample loop (bytes >= 1; default 64 MiB,
  // kernels/per_sample_checks.h) and returns the previous one. A tiny budget makes the loops run
  // many chunks, the last one short.
  m.def("_set_chunk_bytes(int bytes) -> int");
  // Tests and benchmarks only: the sequence length from which the CUDA ghost kernels take the
  // float64 GEMM strips (rows >= 2; default 256, kernels/per_sample_checks.h); returns the
  // previous one.
  m.def("_set_ghost_gemm_min_rows(int rows) -> int");
  // Tests and benchmarks only: the sequence length from which the CUDA ghost kernels below the
  // strips' length take the split tiles (rows >= 2; default: none, kernels/per_sample_checks.h);
  // returns the previous one.
  m.def("_set_ghost_split_min_rows(int rows) -> int");
  // Tests only: CPU tensors take the branches a GPU takes where the per-sample ops choose by
  // device for speed (Note [device path] in kernels/per_sample_checks.h); returns the previous
  // setting.
  m.def("_set_device_path(bool forced) -> bool");
  // Tests only: the CPU noise ops draw in AVX2 lanes (Note [cpu noise lanes] in
  // kernels/cpu/noise_simd.h) when `enabled` and the CPU has them, with the scalar header draw
  // otherwise; returns the previous setting.
  m.def("_set_noise_lanes(bool enabled) -> bool");
}
