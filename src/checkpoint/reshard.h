// src/checkpoint/reshard.h — which bytes of which old rank file each coordinate a new rank keeps
// comes from, for any change of world size, stage, alignment or unit partition (Note
// [checkpoint resharding] in checkpoint.h). Pure functions of the manifest and the new layout: no
// files, no collectives.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "src/checkpoint/manifest.h"

namespace dpzero::checkpoint {

// One parameter of a unit of the engine that loads.
struct UnitParam {
  std::string name;
  int64_t numel = 0;
  int64_t global_offset = 0;
  int64_t flat_offset = 0;  // in the new unit's flat layout
};

// The engine that loads, as the checks and the plan need it.
struct TargetUnit {
  std::string name;
  std::vector<UnitParam> params;
  int64_t kept_begin = 0;  // the flat coordinates [kept_begin, kept_end) this rank keeps
  int64_t kept_end = 0;    // (Unit::kept_range())
};

// Throws naming the first parameter that is in the model but not in the checkpoint (or the
// reverse), or whose numel or global offset differs, and a total coordinate count that differs.
// `path` (the manifest) is for messages.
void check_model(const Manifest& manifest, const std::vector<TargetUnit>& units,
                 int64_t total_coordinates, const std::string& path);

// A run of consecutive coordinates that are consecutive in an old rank file too.
struct Piece {
  int64_t old_rank = 0;    // the rank file to read
  int64_t old_unit = 0;    // index into manifest.units (and the rank file's units)
  int64_t old_offset = 0;  // offset in that unit's entries in that file, each [shard_numel]
  int64_t new_offset = 0;  // offset in the kept values, each [kept_end - kept_begin]
  int64_t length = 0;
};

struct UnitPlan {
  std::vector<std::string> entries;  // "param", then the optimizer's state entries
  int64_t optimizer_steps = 0;
  std::vector<Piece> pieces;  // cover every parameter coordinate in the kept range once;
                              // padding is in none (it is zero)
};

// The plan for one target unit, after check_model. Its entries and step count come from the old
// units that held its parameters, which must agree (they do for checkpoints dpzero writes: every
// unit steps together and has the same optimizer); an error names the two units otherwise.
UnitPlan plan_unit(const Manifest& manifest, const TargetUnit& unit, const std::string& path);

}  // namespace dpzero::checkpoint
