// tests/cpp/torch/checkpoint_test.cpp — the pure parts of src/checkpoint/: CRC-32 against its
// published check values, the manifest's JSON round trip and errors, and the resharding plan
// against a brute-force oracle over many layouts. Saving and loading over real ranks, crashes
// included, are tested in tests/python/test_checkpoint.py.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "src/checkpoint/crc32.h"
#include "src/checkpoint/manifest.h"
#include "src/checkpoint/reshard.h"
#include "src/zero/shard_plan.h"
#include "tests/cpp/common/error_message.h"

namespace dpzero::checkpoint {
namespace {

using dpzero::testing::error_message;

uint32_t crc_of(const std::string& s) { return crc32(s.data(), s.size()); }

TEST(Crc32, PublishedCheckValues) {
  // CRC-32/ISO-HDLC "check" value (the CRC of the ASCII digits 1-9), the empty string, and two
  // values that zlib.crc32 gives.
  EXPECT_EQ(crc_of("123456789"), 0xCBF43926u);
  EXPECT_EQ(crc_of(""), 0u);
  EXPECT_EQ(crc_of("a"), 0xE8B7BE43u);
  EXPECT_EQ(crc_of("The quick brown fox jumps over the lazy dog"), 0x414FA339u);
  EXPECT_EQ(crc32_hex(0xCBF43926u), "cbf43926");
  EXPECT_EQ(crc32_hex(0x1u), "00000001");
}

TEST(Crc32, IncrementalEqualsOneShot) {
  std::string data;
  for (int i = 0; i < 1000; ++i) data.push_back(static_cast<char>(i * 37 + 11));
  for (std::size_t cut : {0u, 1u, 499u, 1000u}) {
    const uint32_t first = crc32_update(0, data.data(), cut);
    EXPECT_EQ(crc32_update(first, data.data() + cut, data.size() - cut), crc_of(data)) << cut;
  }
}

Manifest sample_manifest() {
  Manifest m;
  m.step = 20;
  m.engine_steps = 20;
  m.world_size = 2;
  m.stage = 3;
  m.alignment = 4;
  m.total_coordinates = 15;
  m.optimizer_kind = "adamw";
  m.optimizer = {{"lr", 0.01}, {"betas", {0.9, 0.999}}};
  ManifestUnit u;
  u.name = "blocks.0";
  u.padded_numel = 20;
  u.shard_numel = 10;
  u.optimizer_steps = 20;
  u.entries = {"param", "exp_avg", "exp_avg_sq"};
  u.params = {{"a", 5, 0, 0}, {"b", 7, 5, 8}, {"c", 3, 12, 16}};
  m.units = {u};
  m.rank_files = {{"rank-00000.pt", 1234, 0xCBF43926u}, {"rank-00001.pt", 99, 7}};
  m.shared_file = {"shared.pt", 10, 0xFFFFFFFFu};
  m.metadata = {{"epoch", 3}};
  return m;
}

TEST(Manifest, JsonRoundTrip) {
  const Manifest m = sample_manifest();
  const Manifest back = parse_manifest(manifest_to_json(m), "m.json");
  EXPECT_EQ(back.step, 20);
  EXPECT_EQ(back.world_size, 2);
  EXPECT_EQ(back.stage, 3);
  EXPECT_EQ(back.optimizer_kind, "adamw");
  EXPECT_EQ(back.optimizer, m.optimizer);
  ASSERT_EQ(back.units.size(), 1u);
  EXPECT_EQ(back.units[0].entries, m.units[0].entries);
  ASSERT_EQ(back.units[0].params.size(), 3u);
  EXPECT_EQ(back.units[0].params[1].name, "b");
  EXPECT_EQ(back.units[0].params[1].flat_offset, 8);
  EXPECT_EQ(back.rank_files[0].crc32, 0xCBF43926u);
  EXPECT_EQ(back.rank_files[1].crc32, 7u);
  EXPECT_EQ(back.shared_file.crc32, 0xFFFFFFFFu);
  EXPECT_EQ(back.metadata, m.metadata);
}

TEST(Manifest, ErrorsNameTheFileAndField) {
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(manifest_to_json(sample_manifest()));
  auto parse = [](const nlohmann::ordered_json& v) { parse_manifest(v.dump(), "ckpt/m.json"); };

  auto bad = j;
  bad["version"] = 2;
  EXPECT_NE(error_message<c10::Error>([&] { parse(bad); })
                .find("ckpt/m.json: version 2 is not supported"),
            std::string::npos);
  bad = j;
  bad["units"][0].erase("shard_numel");
  EXPECT_NE(error_message<c10::Error>([&] { parse(bad); })
                .find("units[0] has no 'shard_numel'"),
            std::string::npos);
  bad = j;
  bad["rank_files"][1]["crc32"] = "xyz";
  EXPECT_NE(error_message<c10::Error>([&] { parse(bad); })
                .find("rank_files[1].crc32 must be 8 hex digits, got 'xyz'"),
            std::string::npos);
  bad = j;
  bad["rank_files"][0]["name"] = "../etc/passwd";
  EXPECT_NE(error_message<c10::Error>([&] { parse(bad); }).find("must be a plain file name"),
            std::string::npos);
  bad = j;
  bad["units"][0]["padded_numel"] = 21;
  EXPECT_NE(error_message<c10::Error>([&] { parse(bad); })
                .find("'blocks.0' has padded_numel 21, expected world_size 2 x shard_numel 10"),
            std::string::npos);
  EXPECT_NE(error_message<c10::Error>([&] { parse_manifest("{\"format\": ", "ckpt/m.json"); })
                .find("ckpt/m.json is not valid JSON"),
            std::string::npos);
}

// ---- resharding against a brute-force oracle ------------------------------------------------

// Parameter i has numel numels[i]; global offsets follow in order.
std::vector<zero::ParamSpec> specs(const std::vector<int64_t>& numels) {
  std::vector<zero::ParamSpec> out;
  int64_t offset = 0;
  for (int64_t n : numels) {
    out.push_back({n, offset});
    offset += n;
  }
  return out;
}

// The old run: one unit per group of parameters, each rank file's "param" entry holding
// global coordinate + 1 at every parameter element and 0 in padding.
struct OldRun {
  Manifest manifest;
  std::vector<std::vector<std::vector<float>>> files;  // [rank][unit][shard_numel]
};

OldRun old_run(const std::vector<std::vector<int64_t>>& groups, int64_t world, int64_t alignment) {
  OldRun run;
  Manifest& m = run.manifest;
  m.world_size = world;
  m.alignment = alignment;
  run.files.assign(world, {});
  int64_t global = 0;
  int name = 0;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    std::vector<zero::ParamSpec> ps = specs(groups[g]);
    for (auto& p : ps) p.global_offset += global;
    const zero::UnitLayout layout(ps, world, alignment);
    ManifestUnit u;
    u.name = "u" + std::to_string(g);
    u.padded_numel = layout.padded_numel();
    u.shard_numel = layout.shard_numel();
    u.entries = {"param"};
    std::vector<float> flat(layout.padded_numel(), 0.0f);
    for (std::size_t i = 0; i < ps.size(); ++i) {
      u.params.push_back({"p" + std::to_string(name++), ps[i].numel, ps[i].global_offset,
                          layout.flat_offsets()[i]});
      for (int64_t e = 0; e < ps[i].numel; ++e) {
        flat[layout.flat_offsets()[i] + e] = static_cast<float>(ps[i].global_offset + e + 1);
      }
      global += ps[i].numel;
    }
    for (int64_t r = 0; r < world; ++r) {
      run.files[r].emplace_back(flat.begin() + r * u.shard_numel,
                                flat.begin() + (r + 1) * u.shard_numel);
    }
    m.units.push_back(u);
  }
  m.total_coordinates = global;
  return run;
}

// Loads the old run into a new partition / world size / alignment through plan_unit, for every
// new rank (stage 0: the whole unit), and compares with the values the new layout must hold.
void check_reshard(const OldRun& run, const std::vector<std::vector<int64_t>>& new_groups,
                   int64_t world, int64_t alignment, bool stage0) {
  int64_t global = 0;
  int name = 0;
  std::vector<TargetUnit> targets;
  std::vector<zero::UnitLayout> layouts;
  for (const auto& group : new_groups) {
    std::vector<zero::ParamSpec> ps = specs(group);
    for (auto& p : ps) p.global_offset += global;
    layouts.emplace_back(ps, world, alignment);
    TargetUnit t;
    t.name = "n" + std::to_string(targets.size());
    for (std::size_t i = 0; i < ps.size(); ++i) {
      t.params.push_back({"p" + std::to_string(name++), ps[i].numel, ps[i].global_offset,
                          layouts.back().flat_offsets()[i]});
      global += ps[i].numel;
    }
    targets.push_back(t);
  }
  check_model(run.manifest, targets, global, "m.json");
  for (int64_t rank = 0; rank < world; ++rank) {
    for (std::size_t u = 0; u < targets.size(); ++u) {
      const zero::UnitLayout& layout = layouts[u];
      TargetUnit t = targets[u];
      t.kept_begin = stage0 ? 0 : rank * layout.shard_numel();
      t.kept_end = stage0 ? layout.padded_numel() : (rank + 1) * layout.shard_numel();
      const UnitPlan plan = plan_unit(run.manifest, t, "m.json");
      std::vector<float> got(t.kept_end - t.kept_begin, 0.0f);
      std::vector<int> hits(got.size(), 0);
      for (const Piece& p : plan.pieces) {
        ASSERT_GE(p.old_offset, 0);
        ASSERT_LE(p.old_offset + p.length, run.manifest.units[p.old_unit].shard_numel);
        ASSERT_GE(p.new_offset, 0);
        ASSERT_LE(p.new_offset + p.length, static_cast<int64_t>(got.size()));
        for (int64_t e = 0; e < p.length; ++e) {
          got[p.new_offset + e] = run.files[p.old_rank][p.old_unit][p.old_offset + e];
          ++hits[p.new_offset + e];
        }
      }
      // Oracle: global coordinate + 1 at each parameter element of the kept range, else 0.
      std::vector<float> want(got.size(), 0.0f);
      for (const UnitParam& p : t.params) {
        for (int64_t e = 0; e < p.numel; ++e) {
          const int64_t flat = p.flat_offset + e;
          if (flat >= t.kept_begin && flat < t.kept_end) {
            want[flat - t.kept_begin] = static_cast<float>(p.global_offset + e + 1);
            EXPECT_EQ(hits[flat - t.kept_begin], 1) << "element covered once";
          }
        }
      }
      EXPECT_EQ(got, want) << "new W=" << world << " rank " << rank << " unit " << u;
    }
  }
}

TEST(Reshard, EveryWorldSizeAlignmentAndPartitionMatchesTheOracle) {
  // Nine parameters, in three old units; new partitions regroup them (one unit, per parameter,
  // straddling the old unit boundaries).
  const std::vector<std::vector<int64_t>> old_groups = {{5, 7, 3}, {1}, {17, 2, 9, 4, 6}};
  const std::vector<std::vector<std::vector<int64_t>>> new_partitions = {
      old_groups,
      {{5, 7, 3, 1, 17, 2, 9, 4, 6}},
      {{5}, {7}, {3}, {1}, {17}, {2}, {9}, {4}, {6}},
      {{5, 7}, {3, 1, 17, 2}, {9, 4, 6}},
  };
  for (int64_t old_world : {1, 2, 3, 4}) {
    for (int64_t old_alignment : {1, 4}) {
      const OldRun run = old_run(old_groups, old_world, old_alignment);
      for (const auto& partition : new_partitions) {
        for (int64_t world : {1, 2, 3, 4, 8}) {
          for (int64_t alignment : {1, 8}) {
            for (bool stage0 : {false, true}) {
              SCOPED_TRACE("old W=" + std::to_string(old_world) + " → new W=" +
                           std::to_string(world) + (stage0 ? " stage 0" : ""));
              check_reshard(run, partition, world, alignment, stage0);
            }
          }
        }
      }
    }
  }
}

TEST(Reshard, ModelMismatchesNameTheParameter) {
  const OldRun run = old_run({{5, 7, 3}}, 2, 4);
  auto target = [](std::vector<UnitParam> params) {
    TargetUnit t;
    t.name = "n0";
    t.params = std::move(params);
    return std::vector<TargetUnit>{t};
  };
  EXPECT_NE(error_message<c10::Error>([&] {
              check_model(run.manifest, target({{"p0", 5, 0, 0}, {"p1", 7, 5, 8}}), 12, "m.json");
            }).find("the checkpoint has parameter 'p2' (unit 'u0'), which is not a trainable"),
            std::string::npos);
  EXPECT_NE(error_message<c10::Error>([&] {
              check_model(run.manifest,
                          target({{"p0", 5, 0, 0}, {"p1", 7, 5, 8}, {"q", 3, 12, 16}}), 15,
                          "m.json");
            }).find("parameter 'q' (unit 'n0') is not in the checkpoint"),
            std::string::npos);
  EXPECT_NE(error_message<c10::Error>([&] {
              check_model(run.manifest,
                          target({{"p0", 5, 0, 0}, {"p1", 6, 5, 8}, {"p2", 3, 11, 16}}), 14,
                          "m.json");
            }).find("parameter 'p1' has 6 elements in the model and 7 in the checkpoint"),
            std::string::npos);
  EXPECT_NE(error_message<c10::Error>([&] {
              check_model(run.manifest,
                          target({{"p1", 7, 0, 0}, {"p0", 5, 7, 8}, {"p2", 3, 12, 16}}), 15,
                          "m.json");
            }).find("parameter 'p1' starts at global coordinate 0 in the model and 5"),
            std::string::npos);
}

}  // namespace
}  // namespace dpzero::checkpoint
