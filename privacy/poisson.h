// privacy/poisson.h — Poisson sampling as a pure function of (seed, step, example), and the
// per-rank micro-batch schedule of a logical batch (design.md §2 step 1).
//
// Note [poisson schedule]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Example k is in the logical batch of step t iff u(seed, t, k) < q, with u a 53-bit uniform in
// [0, 1) from Philox4x32-10 on the sampler stream (counter (k/2 lo, k/2 hi, t, "samp"); even k use
// words 0-1, odd k words 2-3). Inclusion is therefore independent across examples and steps — the
// sampling the RDP/PRV analyses of the subsampled Gaussian assume — and any rank can evaluate any
// example's inclusion. Rank r's partition is {k : k mod W = r}; it cuts its part of the batch, in
// ascending k, into micro-batches of at most m. All ranks compute every rank's count locally and
// agree on the micro-batch count max_r ceil(n_r / m) (at least 1, so an empty logical batch is
// still one step: its noise is still added); a rank that runs short is given empty micro-batches.
// Secure mode draws u from ChaCha20 under the run's 256-bit entropy key instead (Note [secure
// noise] in secure_noise.h): block k/8 (counter = low 32 bits, nonce = (high 32 bits, t, "samp")),
// words 2(k%8) and 2(k%8)+1 — so the batches are as unpredictable as the noise.
//
// Note [cyclic poisson]
// ~~~~~~~~~~~~~~~~~~~~~
// The banded mechanisms' amplification (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix
// Factorization", §4) needs each example to take part in steps at least b apart: the dataset is
// split into b fixed partitions, {k : k mod b = p}, and step t samples only partition t mod b,
// each of its examples with probability q by the same u(seed, t, k) < q as above. So an example's
// inclusions are independent across the steps of its partition, never in the b − 1 steps between,
// and partitions = 1 is the ordinary schedule, draw for draw. The partition is fixed by the
// index alone, before any data is read, as the theorem requires. Rank r's share is
// {k : floor(k / b) mod W = r}, which is k mod W at b = 1 and spreads a partition's examples over
// every rank whatever b and W have in common.
#pragma once

#include <cstdint>
#include <vector>

#include "privacy/chacha20.h"
#include "privacy/host_device.h"
#include "privacy/noise.h"
#include "privacy/philox.h"
#include "privacy/streams.h"

namespace dpzero::privacy {

// u(seed, t, k) in [0, 1): 53 random bits times 2^-53.
DPZERO_HOST_DEVICE double sampler_uniform(uint64_t seed, uint32_t step, uint64_t k) {
  const Philox4x32Counter counter{{static_cast<uint32_t>(k / 2), static_cast<uint32_t>((k / 2) >> 32),
                                   step, kSamplerStream}};
  const Philox4x32Counter bits = philox4x32_10(counter, philox_key(seed));
  const uint32_t hi = bits.v[(k % 2) * 2], lo = bits.v[(k % 2) * 2 + 1];
  const uint64_t m = ((static_cast<uint64_t>(hi) << 32) | lo) >> 11;
  return static_cast<double>(m) * 1.1102230246251565e-16;  // 2^-53
}

// Secure mode's u(key, t, k) in [0, 1): 53 bits of ChaCha20 output times 2^-53.
DPZERO_HOST_DEVICE double secure_sampler_uniform(const ChaCha20Key& key, uint32_t step, uint64_t k) {
  const uint64_t block = k / 8;
  const ChaCha20Block b = chacha20_block(key, static_cast<uint32_t>(block),
                                         static_cast<uint32_t>(block >> 32), step, kSamplerStream);
  const uint32_t hi = b.w[2 * (k % 8)], lo = b.w[2 * (k % 8) + 1];
  const uint64_t m = ((static_cast<uint64_t>(hi) << 32) | lo) >> 11;
  return static_cast<double>(m) * 1.1102230246251565e-16;  // 2^-53
}

// Where the sampler's randomness comes from: a Philox seed (default) or, in secure mode, a
// ChaCha20 key from OS entropy shared by all ranks.
struct SamplerSource {
  uint64_t seed = 0;
  bool secure = false;
  ChaCha20Key key{};
};

DPZERO_HOST_DEVICE double inclusion_uniform(const SamplerSource& source, uint32_t step, uint64_t k) {
  return source.secure ? secure_sampler_uniform(source.key, step, k)
                       : sampler_uniform(source.seed, step, k);
}

// The logical batch of step t over a dataset of n examples: included indices, ascending;
// with partitions b > 1, only partition t mod b is sampled (Note [cyclic poisson]). Throws
// std::invalid_argument naming the value for n < 0, q outside [0, 1] or partitions < 1.
std::vector<int64_t> poisson_logical_batch(const SamplerSource& source, uint32_t step, int64_t n,
                                           double q, int64_t partitions = 1);

struct MicroBatchSchedule {
  int64_t logical_batch_size = 0;             // examples in the step over all ranks
  std::vector<int64_t> rank_counts;           // examples per rank, size W
  std::vector<std::vector<int64_t>> micro_batches;  // this rank's, each of size <= m; count agreed
};

// Rank `rank`'s micro-batches of step t (Note [poisson schedule]). Throws std::invalid_argument for
// world_size < 1, rank outside [0, world_size), max_micro_batch < 1, or the cases above.
MicroBatchSchedule poisson_micro_batches(const SamplerSource& source, uint32_t step, int64_t n, double q,
                                         int64_t rank, int64_t world_size,
                                         int64_t max_micro_batch, int64_t partitions = 1);

}  // namespace dpzero::privacy
