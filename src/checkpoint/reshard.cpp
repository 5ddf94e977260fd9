// src/checkpoint/reshard.cpp — mapping new flat coordinates to old rank files (reshard.h).
#include "src/checkpoint/reshard.h"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include <c10/util/Exception.h>

namespace dpzero::checkpoint {
namespace {

struct OldLocation {
  int64_t unit = 0;
  const ManifestParam* param = nullptr;
};

std::unordered_map<std::string, OldLocation> index_params(const Manifest& m,
                                                          const std::string& path) {
  std::unordered_map<std::string, OldLocation> index;
  for (std::size_t u = 0; u < m.units.size(); ++u) {
    for (const ManifestParam& p : m.units[u].params) {
      const bool inserted = index.emplace(p.name, OldLocation{static_cast<int64_t>(u), &p}).second;
      TORCH_CHECK(inserted, "checkpoint manifest ", path, " lists parameter '", p.name,
                  "' twice");
    }
  }
  return index;
}

}  // namespace

void check_model(const Manifest& m, const std::vector<TargetUnit>& units,
                 int64_t total_coordinates, const std::string& path) {
  const auto index = index_params(m, path);
  // Names first, both ways (a parameter missing on one side shifts every later global offset, so
  // the name says more than the first shifted offset would), then sizes and offsets.
  std::unordered_set<std::string> in_model;
  for (const TargetUnit& unit : units) {
    for (const UnitParam& p : unit.params) {
      TORCH_CHECK(index.count(p.name), "checkpoint ", path,
                  " does not match the model: parameter '", p.name, "' (unit '", unit.name,
                  "') is not in the checkpoint");
      in_model.insert(p.name);
    }
  }
  for (const ManifestUnit& u : m.units) {
    for (const ManifestParam& p : u.params) {
      TORCH_CHECK(in_model.count(p.name), "checkpoint ", path, " does not match the model: the "
                  "checkpoint has parameter '", p.name, "' (unit '", u.name,
                  "'), which is not a trainable parameter of the model");
    }
  }
  for (const TargetUnit& unit : units) {
    for (const UnitParam& p : unit.params) {
      const ManifestParam& old = *index.at(p.name).param;
      TORCH_CHECK(old.numel == p.numel, "checkpoint ", path,
                  " does not match the model: parameter '", p.name, "' has ", p.numel,
                  " elements in the model and ", old.numel, " in the checkpoint");
      TORCH_CHECK(old.global_offset == p.global_offset, "checkpoint ", path,
                  " does not match the model: parameter '", p.name, "' starts at global "
                  "coordinate ", p.global_offset, " in the model and ", old.global_offset,
                  " in the checkpoint (parameter order or trainable set differ)");
    }
  }
  TORCH_CHECK(m.total_coordinates == total_coordinates, "checkpoint ", path,
              " does not match the model: it has ", m.total_coordinates,
              " trainable coordinates, the model ", total_coordinates);
}

UnitPlan plan_unit(const Manifest& m, const TargetUnit& unit, const std::string& path) {
  const auto index = index_params(m, path);
  UnitPlan plan;
  int64_t source_unit = -1;  // the old unit plan.entries and plan.optimizer_steps came from
  for (const UnitParam& p : unit.params) {
    auto it = index.find(p.name);
    TORCH_CHECK(it != index.end(), "checkpoint ", path, ": parameter '", p.name,
                "' is not in the checkpoint");
    const int64_t u = it->second.unit;
    const ManifestUnit& old_unit = m.units[u];
    if (source_unit < 0) {
      source_unit = u;
      plan.entries = old_unit.entries;
      plan.optimizer_steps = old_unit.optimizer_steps;
    } else if (u != source_unit) {
      const ManifestUnit& first = m.units[source_unit];
      TORCH_CHECK(old_unit.entries == first.entries &&
                      old_unit.optimizer_steps == first.optimizer_steps,
                  "checkpoint ", path, ": unit '", unit.name, "' takes parameters from old units '",
                  first.name, "' and '", old_unit.name,
                  "', whose optimizer state entries or step counts differ");
    }
    // The part of this parameter inside the kept range, as element indices [lo, hi) of it.
    const int64_t lo = std::max<int64_t>(unit.kept_begin, p.flat_offset) - p.flat_offset;
    const int64_t hi = std::min<int64_t>(unit.kept_end, p.flat_offset + p.numel) - p.flat_offset;
    const int64_t m_old = old_unit.shard_numel;
    const int64_t old_flat = it->second.param->flat_offset;
    for (int64_t e = lo; e < hi;) {
      const int64_t pos = old_flat + e;  // old flat coordinate of element e
      const int64_t rank = pos / m_old;
      const int64_t length = std::min(hi - e, (rank + 1) * m_old - pos);
      plan.pieces.push_back(
          Piece{rank, u, pos - rank * m_old, p.flat_offset + e - unit.kept_begin, length});
      e += length;
    }
  }
  TORCH_CHECK(source_unit >= 0, "checkpoint ", path, ": unit '", unit.name,
              "' has no parameters");
  return plan;
}

}  // namespace dpzero::checkpoint
