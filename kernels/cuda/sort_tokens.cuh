// kernels/cuda/sort_tokens.cuh — each sample's tokens sorted by (id, position), for the CUDA
// embedding kernels (_embedding_rows in row_sums.cu, _add_embedding_sums_ in embedding_sums.cu):
// in one block's shared memory, a bitonic sort of P = the power of two >= T entries, for T <=
// kMaxSortTokens; past that, presort's ATen sort along the tokens, which gives the same order for
// valid ids.
#pragma once

#include <cstdint>
#include <limits>
#include <tuple>

#include <ATen/ATen.h>

namespace dpzero::kernels::sort_tokens {

constexpr int64_t kMaxSortTokens = 2048;  // tokens a block sorts in shared memory (24 KiB)

// The power of two >= t, and the dynamic shared memory sort() needs for it.
inline int padded_length(int64_t t) {
  int p = 1;
  while (p < t) p <<= 1;
  return p;
}
inline size_t shared_bytes(int p) {
  return static_cast<size_t>(p) * (sizeof(int64_t) + sizeof(int));
}

// id [T] (one sample's ids) -> key [P] and pos [P] in `smem` (shared_bytes(p) of dynamic shared
// memory): the sample's non-padding tokens sorted by (id, position) in entries [0, n), n returned
// (the same in every thread); a padding token and the fill up to P carry a position >= T and sort
// after every real token. Every thread of the block calls it (barriers inside); the block has
// `threads` threads.
__device__ __forceinline__ int sort(const int64_t* __restrict__ id, int64_t t_len, int p,
                                    int64_t pad, int threads, unsigned char* smem, int64_t*& key,
                                    int*& pos) {
  key = reinterpret_cast<int64_t*>(smem);
  pos = reinterpret_cast<int*>(key + p);
  __shared__ int real;
  if (threadIdx.x == 0) real = 0;
  __syncthreads();
  int mine = 0;
  for (int t = threadIdx.x; t < p; t += threads) {
    const bool is_real = t < t_len && id[t] != pad;
    key[t] = t < t_len ? id[t] : 0;
    pos[t] = is_real ? t : static_cast<int>(t_len) + t;
    mine += is_real ? 1 : 0;
  }
  atomicAdd(&real, mine);  // an integer count: the same whatever the order
  __syncthreads();
  // (real first, id, position) ascending: a skipped entry's position is >= T.
  auto before = [&](int a, int b) {
    const bool ra = pos[a] < t_len, rb = pos[b] < t_len;
    if (ra != rb) return ra;
    if (ra && key[a] != key[b]) return key[a] < key[b];
    return pos[a] < pos[b];
  };
  for (int k = 2; k <= p; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int t = threadIdx.x; t < p; t += threads) {
        const int u = t ^ j;
        if (u > t) {
          const bool ascending = (t & k) == 0;
          if (ascending == before(u, t)) {
            const int64_t kt = key[t];
            key[t] = key[u];
            key[u] = kt;
            const int pt = pos[t];
            pos[t] = pos[u];
            pos[u] = pt;
          }
        }
      }
      __syncthreads();
    }
  }
  return real;
}

// ids [B, T] int64 -> (order [B, T] int32 positions, sorted [B, T] their ids, count [B] int32),
// as sort() lays out its entries [0, n) per sample: the non-padding tokens by (id, position)
// first (a stable sort), then the padding ones; for ids in [0, V), sort()'s order. An id outside
// [0, V) sorts as V, so it never ties with the padding tokens: _add_embedding_sums_ adds it into
// no row, and _embedding_rows counts all of a sample's such tokens as one run (sort() keeps one
// run per id). The forward's lookup has refused them before either runs.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> presort(const at::Tensor& ids, int64_t pad,
                                                              int64_t num_embeddings) {
  const at::Tensor padding = ids == pad;
  const at::Tensor key =
      ids.masked_fill(ids.lt(0).logical_or_(ids.ge(num_embeddings)), num_embeddings)
          .masked_fill_(padding, std::numeric_limits<int64_t>::max());
  auto [sorted, order] = key.sort(/*stable=*/true, 1);
  return {order.to(at::kInt), sorted,
          (~padding).sum(at::IntArrayRef{1}, /*keepdim=*/false, at::kInt)};
}

}  // namespace dpzero::kernels::sort_tokens
