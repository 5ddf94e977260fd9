// src/checkpoint/manifest.h — manifest.json, the one file that says what a checkpoint holds and
// how it was sharded (Note [checkpoint format] in checkpoint.h).
//
// A manifest names the run's layout (world size, stage, alignment, and for every unit its
// parameters with their global and flat offsets, padded and shard sizes, the optimizer's state
// entries and step count), the optimizer with its hyperparameters, the engine's step counter, and
// every file of the checkpoint with its size and CRC-32. Loading reads it first, checks the model
// against it and reshards from it (reshard.h); nothing else in the checkpoint is trusted before
// its size and checksum match the manifest.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dpzero::checkpoint {

inline constexpr const char* kManifestFormat = "dpzero-checkpoint";
inline constexpr int64_t kManifestVersion = 1;

struct ManifestParam {
  std::string name;           // canonical name (named_parameters())
  int64_t numel = 0;
  int64_t global_offset = 0;  // global coordinate of its first element
  int64_t flat_offset = 0;    // offset in its unit's flat buffer
};

struct ManifestUnit {
  std::string name;
  int64_t padded_numel = 0;           // multiple of the world size
  int64_t shard_numel = 0;            // padded_numel / world size: each rank file holds this many
  int64_t optimizer_steps = 0;        // the unit optimizer's step count
  std::vector<std::string> entries;   // "param" first, then the optimizer's state entries
  std::vector<ManifestParam> params;  // in flat order
};

struct ManifestFile {
  std::string name;    // relative to the step directory ("rank-00003.pt")
  int64_t bytes = 0;
  uint32_t crc32 = 0;  // crc32.h
};

struct Manifest {
  int64_t version = kManifestVersion;
  int64_t step = 0;               // the checkpoint's step (its directory name)
  int64_t engine_steps = 0;       // ZeroState::steps() when it was written
  int64_t world_size = 1;
  int64_t stage = 0;
  int64_t alignment = 1;
  int64_t total_coordinates = 0;  // D: trainable coordinates of the model
  std::string optimizer_kind;     // "sgd", "adam" or "adamw"
  nlohmann::ordered_json optimizer = nlohmann::ordered_json::object();  // hyperparameters
  std::vector<ManifestUnit> units;
  std::vector<ManifestFile> rank_files;  // [world_size], index = rank
  ManifestFile shared_file;              // rank-independent tensors (rank 0 writes it)
  nlohmann::ordered_json metadata = nlohmann::ordered_json::object();  // the caller's, free JSON
};

std::string manifest_to_json(const Manifest& manifest);

// Parses and validates (format, version, field types, consistent sizes). `path` is only for
// messages: every error names it and the offending field.
Manifest parse_manifest(const std::string& text, const std::string& path);

}  // namespace dpzero::checkpoint
