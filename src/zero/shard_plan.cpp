// src/zero/shard_plan.cpp — UnitLayout: flat offsets, padding and per-rank coordinate runs.
#include "src/zero/shard_plan.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

namespace dpzero::zero {
namespace {

int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// Note [ragged plans]: whether `sizes`, in order, fit into `bins` contiguous groups of at most
// `capacity` each (greedy packing; a group closes only when the next item does not fit).
bool fits(const std::vector<int64_t>& sizes, int64_t bins, int64_t capacity) {
  int64_t used = 0, groups = 1;
  for (int64_t size : sizes) {
    if (size > capacity) return false;
    if (used + size > capacity) {
      if (++groups > bins) return false;
      used = 0;
    }
    used += size;
  }
  return true;
}

}  // namespace

ShardBoundaries parse_shard_boundaries(const std::string& name) {
  if (name == "even") return ShardBoundaries::kEven;
  if (name == "parameters") return ShardBoundaries::kParameters;
  throw std::invalid_argument("shard boundaries must be 'even' or 'parameters', got '" + name +
                              "'");
}

UnitLayout::UnitLayout(std::vector<ParamSpec> params, int64_t world_size, int64_t alignment,
                       ShardBoundaries boundaries)
    : params_(std::move(params)), world_size_(world_size), boundaries_(boundaries) {
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
  // Overlapping global ranges would give one coordinate two owners (two equal noise draws).
  // Zero-size parameters own nothing and are left out; each range is compared with the furthest
  // end seen so far, so no ordering of the parameters can hide an overlap.
  std::vector<size_t> order;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].numel > std::numeric_limits<int64_t>::max() - params_[i].global_offset) {
      throw std::invalid_argument("parameter " + std::to_string(i) + ": global offset " +
                                  std::to_string(params_[i].global_offset) + " + numel " +
                                  std::to_string(params_[i].numel) + " overflows int64");
    }
    if (params_[i].numel > 0) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return params_[a].global_offset < params_[b].global_offset;
  });
  int64_t furthest_end = std::numeric_limits<int64_t>::min();
  size_t furthest = 0;
  for (size_t i : order) {
    if (params_[i].global_offset < furthest_end) {
      throw std::invalid_argument(
          "parameters " + std::to_string(furthest) + " and " + std::to_string(i) +
          " overlap in global coordinates at " + std::to_string(params_[i].global_offset));
    }
    furthest_end = params_[i].global_offset + params_[i].numel;
    furthest = i;
  }
  padded_numel_ = round_up(std::max<int64_t>(cursor, 1), world_size_);
  if (boundaries_ == ShardBoundaries::kParameters && world_size_ > 1) {
    // Note [ragged plans]: each parameter's aligned footprint is an item; find the smallest
    // capacity m (a multiple of `alignment`, so every group starts aligned) that packs them into
    // W groups, then lay group r out from r·m.
    std::vector<int64_t> sizes;
    for (const ParamSpec& p : params_) sizes.push_back(round_up(p.numel, alignment));
    int64_t lo = alignment;
    int64_t hi = round_up(std::max<int64_t>(cursor, 1), alignment);
    for (int64_t size : sizes) lo = std::max(lo, size);
    while (lo < hi) {  // invariant: hi fits; no capacity below lo does; both multiples of alignment
      const int64_t mid = lo + (hi - lo) / alignment / 2 * alignment;  // in [lo, hi)
      if (fits(sizes, world_size_, mid)) {
        hi = mid;
      } else {
        lo = mid + alignment;
      }
    }
    const int64_t m = hi;
    int64_t group = 0, used = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (used + sizes[i] > m) {
        ++group;
        used = 0;
      }
      flat_offsets_[i] = group * m + used;
      used += sizes[i];
    }
    padded_numel_ = m * world_size_;
  }
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


ShardPlan::ShardPlan(std::vector<UnitLayout> units, int64_t total_coordinates)
    : units_(std::move(units)), total_coordinates_(total_coordinates) {
  if (units_.empty()) throw std::invalid_argument("a shard plan needs at least one unit, got 0");
  if (total_coordinates < 0) {
    throw std::invalid_argument("total coordinates must be >= 0, got " +
                                std::to_string(total_coordinates));
  }
  // Every global coordinate in [0, D) must belong to exactly one parameter of one unit, or some
  // coordinate would be noised twice (equal draws) or never (design.md §3 "Noise").
  std::vector<std::pair<int64_t, int64_t>> ranges;  // (begin, end) of every run of every unit
  for (size_t u = 0; u < units_.size(); ++u) {
    if (units_[u].world_size() != units_[0].world_size()) {
      throw std::invalid_argument("unit " + std::to_string(u) + " has world size " +
                                  std::to_string(units_[u].world_size()) + ", unit 0 has " +
                                  std::to_string(units_[0].world_size()));
    }
    for (const CoordinateRun& run : units_[u].runs()) {
      ranges.emplace_back(run.global_offset, run.global_offset + run.length);
    }
  }
  std::sort(ranges.begin(), ranges.end());
  int64_t next = 0;
  for (const auto& [begin, end] : ranges) {
    if (begin < next) {
      throw std::invalid_argument("global coordinate " + std::to_string(begin) +
                                  " is owned by two parameters of the plan");
    }
    if (begin > next) {
      throw std::invalid_argument("global coordinates [" + std::to_string(next) + ", " +
                                  std::to_string(begin) + ") belong to no unit of the plan");
    }
    next = end;
  }
  if (next != total_coordinates) {
    throw std::invalid_argument("the plan's units cover [0, " + std::to_string(next) +
                                ") but the model has " + std::to_string(total_coordinates) +
                                " trainable coordinates");
  }
}

}  // namespace dpzero::zero
