// privacy/poisson.cpp — logical batches and per-rank micro-batch schedules (Note [poisson schedule]).
#include "privacy/poisson.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace dpzero::privacy {
namespace {

void check_sample(int64_t n, double q) {
  if (n < 0) throw std::invalid_argument("dataset size must be >= 0, got " + std::to_string(n));
  if (!(q >= 0.0 && q <= 1.0)) {
    throw std::invalid_argument("sample rate q must be in [0, 1], got " + std::to_string(q));
  }
}

}  // namespace

std::vector<int64_t> poisson_logical_batch(const SamplerSource& source, uint32_t step, int64_t n,
                                           double q, int64_t partitions) {
  check_sample(n, q);
  if (partitions < 1)
    throw std::invalid_argument("partitions must be >= 1, got " + std::to_string(partitions));
  std::vector<int64_t> batch;
  batch.reserve(static_cast<size_t>(std::ceil(q * static_cast<double>(n) * 1.1)) + 16);
  // Note [cyclic poisson]: partition step mod b only, its examples k = p, p + b, p + 2b, ...
  for (int64_t k = static_cast<int64_t>(step % static_cast<uint64_t>(partitions)); k < n;
       k += partitions) {
    if (inclusion_uniform(source, step, static_cast<uint64_t>(k)) < q) batch.push_back(k);
  }
  return batch;
}

MicroBatchSchedule poisson_micro_batches(const SamplerSource& source, uint32_t step, int64_t n,
                                         double q,
                                         int64_t rank, int64_t world_size,
                                         int64_t max_micro_batch, int64_t partitions) {
  if (world_size < 1) {
    throw std::invalid_argument("world_size must be >= 1, got " + std::to_string(world_size));
  }
  if (rank < 0 || rank >= world_size) {
    throw std::invalid_argument("rank must be in [0, " + std::to_string(world_size) + "), got " +
                                std::to_string(rank));
  }
  if (max_micro_batch < 1) {
    throw std::invalid_argument("max micro-batch size must be >= 1, got " +
                                std::to_string(max_micro_batch));
  }
  const std::vector<int64_t> batch = poisson_logical_batch(source, step, n, q, partitions);
  MicroBatchSchedule out;
  out.logical_batch_size = static_cast<int64_t>(batch.size());
  out.rank_counts.assign(static_cast<size_t>(world_size), 0);
  std::vector<int64_t> mine;
  for (int64_t k : batch) {
    const int64_t owner = (k / partitions) % world_size;  // Note [cyclic poisson]
    ++out.rank_counts[static_cast<size_t>(owner)];
    if (owner == rank) mine.push_back(k);
  }
  const int64_t most = *std::max_element(out.rank_counts.begin(), out.rank_counts.end());
  const int64_t count = std::max<int64_t>(1, (most + max_micro_batch - 1) / max_micro_batch);
  out.micro_batches.resize(static_cast<size_t>(count));
  for (size_t i = 0; i < mine.size(); ++i) {
    out.micro_batches[i / static_cast<size_t>(max_micro_batch)].push_back(mine[i]);
  }
  return out;
}

}  // namespace dpzero::privacy
