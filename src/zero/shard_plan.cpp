// src/zero/shard_plan.cpp — UnitLayout: flat offsets, padding and per-rank coordinate runs.
#include "src/zero/shard_plan.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

namespace dpzero::zero {
namespace {

int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

}  // namespace

UnitLayout::UnitLayout(std::vector<ParamSpec> params, int64_t world_size, int64_t alignment)
    : params_(std::move(params)), world_size_(world_size) {
  if (world_size < 1) {
    throw std::invalid_argument("world_size must be >= 1, got " + std::to_string(world_size));
  }
  if (alignment < 1) {
    throw std::invalid_argument("alignment must be >= 1, got " + std::to_string(alignment));
  }
  int64_t cursor = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamSpec& p = params_[i];
    if (p.numel < 0 || p.global_offset < 0) {
      throw std::invalid_argument("parameter " + std::to_string(i) + " has numel " +
                                  std::to_string(p.numel) + " and global offset " +
                                  std::to_string(p.global_offset) + "; both must be >= 0");
    }
    cursor = round_up(cursor, alignment);
    flat_offsets_.push_back(cursor);
    cursor += p.numel;
  }
  // Overlapping global ranges would give one coordinate two owners (two noise draws).
  std::vector<size_t> order(params_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return params_[a].global_offset < params_[b].global_offset;
  });
  for (size_t k = 1; k < order.size(); ++k) {
    const ParamSpec& prev = params_[order[k - 1]];
    const ParamSpec& next = params_[order[k]];
    if (prev.global_offset + prev.numel > next.global_offset && next.numel > 0 && prev.numel > 0) {
      throw std::invalid_argument(
          "parameters " + std::to_string(order[k - 1]) + " and " + std::to_string(order[k]) +
          " overlap in global coordinates at " + std::to_string(next.global_offset));
    }
  }
  padded_numel_ = round_up(std::max<int64_t>(cursor, 1), world_size_);
}

int64_t UnitLayout::param_numel() const {
  int64_t total = 0;
  for (const ParamSpec& p : params_) total += p.numel;
  return total;
}

std::vector<CoordinateRun> UnitLayout::runs() const {
  std::vector<CoordinateRun> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].numel == 0) continue;
    out.push_back(CoordinateRun{flat_offsets_[i], params_[i].global_offset, params_[i].numel});
  }
  return out;
}

std::vector<CoordinateRun> UnitLayout::runs_for_rank(int64_t rank) const {
  if (rank < 0 || rank >= world_size_) {
    throw std::invalid_argument("rank must be in [0, " + std::to_string(world_size_) + "), got " +
                                std::to_string(rank));
  }
  const int64_t begin = rank * shard_numel();
  const int64_t end = begin + shard_numel();
  std::vector<CoordinateRun> out;
  for (const CoordinateRun& run : runs()) {
    const int64_t lo = std::max(begin, run.local_offset);
    const int64_t hi = std::min(end, run.local_offset + run.length);
    if (lo >= hi) continue;
    out.push_back(CoordinateRun{lo - begin, run.global_offset + (lo - run.local_offset), hi - lo});
  }
  return out;
}

}  // namespace dpzero::zero
