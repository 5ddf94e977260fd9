// src/zero/shard_plan.h — flat layout of a unit's parameters and which global coordinates each rank
// owns (design.md §2.5; Note [noise ownership] in privacy/noise.h).
//
// A unit's trainable parameters are laid out in one flat buffer in canonical order, each starting
// at a multiple of `alignment` elements, and the buffer is padded at the end so it splits into
// `world_size` equal shards. Rank r owns flat elements [r * shard_numel, (r + 1) * shard_numel).
// Padding has no global coordinate: it gets no noise and is never read.
//
// Note [ragged plans]
// ~~~~~~~~~~~~~~~~~~~
// The even plan packs parameters back to back, so a shard boundary may cut a parameter. An
// optimizer or quantiser that works on whole tensors (Shampoo, 8-bit block-wise Adam, LAMB's
// per-tensor trust ratio) needs boundaries that follow parameters. The ragged plan
// (ShardBoundaries::kParameters) partitions the unit's parameters, in canonical order, into W
// contiguous groups with the smallest possible largest group (binary search on the capacity m,
// each candidate checked by greedy packing, which is exact for contiguous partitions), places
// group r at flat offset r·m and pads each group to m. Every rank still holds an m-element
// shard, so the equal-size collectives, the optimizer and the noise runs are unchanged; the
// price is padding wherever the groups are uneven (reported by padded_numel()).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dpzero::zero {

// One parameter of a unit: its element count and the global coordinate index of its first
// element (all trainable parameters of the model in named_parameters() order, tied ones once).
struct ParamSpec {
  int64_t numel = 0;
  int64_t global_offset = 0;
};

// A run of consecutive elements that are consecutive global coordinates as well.
struct CoordinateRun {
  int64_t local_offset = 0;   // offset inside the rank's shard (or inside the full flat buffer)
  int64_t global_offset = 0;  // global coordinate of the first element
  int64_t length = 0;
};

// Where shard boundaries may fall (Note [ragged plans]).
enum class ShardBoundaries { kEven, kParameters };

// Parses "even" or "parameters"; std::invalid_argument naming any other value.
ShardBoundaries parse_shard_boundaries(const std::string& name);

class UnitLayout {
 public:
  // Throws std::invalid_argument naming the value for world_size < 1, alignment < 1, a negative
  // numel or global offset, or parameters whose global ranges overlap.
  UnitLayout(std::vector<ParamSpec> params, int64_t world_size, int64_t alignment = 1,
             ShardBoundaries boundaries = ShardBoundaries::kEven);

  int64_t world_size() const { return world_size_; }
  ShardBoundaries boundaries() const { return boundaries_; }
  int64_t padded_numel() const { return padded_numel_; }  // multiple of world_size
  int64_t shard_numel() const { return padded_numel_ / world_size_; }
  int64_t param_numel() const;                              // sum of parameter numels
  const std::vector<ParamSpec>& params() const { return params_; }
  const std::vector<int64_t>& flat_offsets() const { return flat_offsets_; }  // one per parameter

  // The global coordinates rank `rank` owns, as runs with offsets relative to its shard.
  std::vector<CoordinateRun> runs_for_rank(int64_t rank) const;
  // The runs of the full flat buffer (offsets relative to the buffer start).
  std::vector<CoordinateRun> runs() const;

 private:
  std::vector<ParamSpec> params_;
  std::vector<int64_t> flat_offsets_;
  int64_t world_size_;
  ShardBoundaries boundaries_;
  int64_t padded_numel_ = 0;
};

// All units of a model: checked at construction to cover the global coordinates [0, D) exactly
// once (no coordinate in two parameters, none in none), the precondition of Note [noise
// ownership] across units.
class ShardPlan {
 public:
  // Throws std::invalid_argument naming the first coordinate owned twice or by no one, a world
  // size that differs between units, or a coverage that does not end at total_coordinates.
  ShardPlan(std::vector<UnitLayout> units, int64_t total_coordinates);

  const std::vector<UnitLayout>& units() const { return units_; }
  int64_t world_size() const { return units_.front().world_size(); }
  int64_t total_coordinates() const { return total_coordinates_; }

 private:
  std::vector<UnitLayout> units_;
  int64_t total_coordinates_;
};

}  // namespace dpzero::zero
