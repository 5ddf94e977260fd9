// src/checkpoint/manifest.cpp — manifest.json to and from Manifest (manifest.h).
#include "src/checkpoint/manifest.h"

#include <cstdlib>

#include <c10/util/Exception.h>

#include "src/checkpoint/crc32.h"

namespace dpzero::checkpoint {
namespace {

using Json = nlohmann::ordered_json;

Json file_to_json(const ManifestFile& f) {
  return Json{{"name", f.name}, {"bytes", f.bytes}, {"crc32", crc32_hex(f.crc32)}};
}

// Reads fields of one JSON object, naming the manifest and the field's path in every error.
class Reader {
 public:
  Reader(const Json& object, std::string where, const std::string& path)
      : object_(object), where_(std::move(where)), path_(path) {
    TORCH_CHECK(object_.is_object(), "checkpoint manifest ", path_, ": ", where_,
                " must be a JSON object, got ", object_.dump());
  }

  const Json& field(const char* name) const {
    auto it = object_.find(name);
    TORCH_CHECK(it != object_.end(), "checkpoint manifest ", path_, ": ", where_, " has no '",
                name, "'");
    return *it;
  }
  int64_t integer(const char* name, int64_t min = 0) const {
    const Json& v = field(name);
    TORCH_CHECK(v.is_number_integer() && v.get<int64_t>() >= min, "checkpoint manifest ", path_,
                ": ", where_, ".", name, " must be an integer >= ", min, ", got ", v.dump());
    return v.get<int64_t>();
  }
  std::string string(const char* name) const {
    const Json& v = field(name);
    TORCH_CHECK(v.is_string(), "checkpoint manifest ", path_, ": ", where_, ".", name,
                " must be a string, got ", v.dump());
    return v.get<std::string>();
  }
  const Json& array(const char* name) const {
    const Json& v = field(name);
    TORCH_CHECK(v.is_array(), "checkpoint manifest ", path_, ": ", where_, ".", name,
                " must be an array, got ", v.dump());
    return v;
  }
  std::string at(const char* name) const { return where_ + "." + name; }

 private:
  const Json& object_;
  std::string where_;
  const std::string& path_;
};

ManifestFile file_from_json(const Json& j, const std::string& where, const std::string& path) {
  Reader r(j, where, path);
  ManifestFile f;
  f.name = r.string("name");
  TORCH_CHECK(!f.name.empty() && f.name.find('/') == std::string::npos && f.name[0] != '.',
              "checkpoint manifest ", path, ": ", where, ".name must be a plain file name, got '",
              f.name, "'");
  f.bytes = r.integer("bytes");
  const std::string crc = r.string("crc32");
  char* end = nullptr;
  const unsigned long value = std::strtoul(crc.c_str(), &end, 16);
  TORCH_CHECK(crc.size() == 8 && end == crc.c_str() + 8, "checkpoint manifest ", path, ": ", where,
              ".crc32 must be 8 hex digits, got '", crc, "'");
  f.crc32 = static_cast<uint32_t>(value);
  return f;
}

}  // namespace

std::string manifest_to_json(const Manifest& m) {
  Json units = Json::array();
  for (const ManifestUnit& u : m.units) {
    Json params = Json::array();
    for (const ManifestParam& p : u.params) {
      params.push_back(Json{{"name", p.name},
                            {"numel", p.numel},
                            {"global_offset", p.global_offset},
                            {"flat_offset", p.flat_offset}});
    }
    units.push_back(Json{{"name", u.name},
                         {"padded_numel", u.padded_numel},
                         {"shard_numel", u.shard_numel},
                         {"optimizer_steps", u.optimizer_steps},
                         {"entries", u.entries},
                         {"params", std::move(params)}});
  }
  Json files = Json::array();
  for (const ManifestFile& f : m.rank_files) files.push_back(file_to_json(f));
  Json out{{"format", kManifestFormat},
           {"version", m.version},
           {"step", m.step},
           {"engine_steps", m.engine_steps},
           {"world_size", m.world_size},
           {"stage", m.stage},
           {"alignment", m.alignment},
           {"total_coordinates", m.total_coordinates},
           {"optimizer", Json{{"kind", m.optimizer_kind}, {"hyperparameters", m.optimizer}}},
           {"units", std::move(units)},
           {"rank_files", std::move(files)},
           {"shared_file", file_to_json(m.shared_file)},
           {"metadata", m.metadata}};
  return out.dump(1) + "\n";
}

Manifest parse_manifest(const std::string& text, const std::string& path) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "checkpoint manifest ", path, " is not valid JSON: ", e.what());
  }
  Reader top(j, "manifest", path);
  TORCH_CHECK(top.string("format") == kManifestFormat, "checkpoint manifest ", path,
              ": format must be '", kManifestFormat, "', got '", top.string("format"), "'");
  Manifest m;
  m.version = top.integer("version");
  TORCH_CHECK(m.version == kManifestVersion, "checkpoint manifest ", path, ": version ", m.version,
              " is not supported (this dpzero reads version ", kManifestVersion, ")");
  m.step = top.integer("step");
  m.engine_steps = top.integer("engine_steps");
  m.world_size = top.integer("world_size", 1);
  m.stage = top.integer("stage");
  TORCH_CHECK(m.stage <= 3, "checkpoint manifest ", path, ": stage must be 0-3, got ", m.stage);
  m.alignment = top.integer("alignment", 1);
  m.total_coordinates = top.integer("total_coordinates");
  Reader optimizer(top.field("optimizer"), "manifest.optimizer", path);
  m.optimizer_kind = optimizer.string("kind");
  m.optimizer = optimizer.field("hyperparameters");

  const Json& units = top.array("units");
  for (std::size_t u = 0; u < units.size(); ++u) {
    Reader ru(units[u], "units[" + std::to_string(u) + "]", path);
    ManifestUnit unit;
    unit.name = ru.string("name");
    unit.padded_numel = ru.integer("padded_numel");
    unit.shard_numel = ru.integer("shard_numel");
    TORCH_CHECK(unit.shard_numel * m.world_size == unit.padded_numel, "checkpoint manifest ", path,
                ": unit '", unit.name, "' has padded_numel ", unit.padded_numel,
                ", expected world_size ", m.world_size, " x shard_numel ", unit.shard_numel);
    unit.optimizer_steps = ru.integer("optimizer_steps");
    for (const Json& e : ru.array("entries")) {
      TORCH_CHECK(e.is_string(), "checkpoint manifest ", path, ": ", ru.at("entries"),
                  " must hold strings, got ", e.dump());
      unit.entries.push_back(e.get<std::string>());
    }
    TORCH_CHECK(!unit.entries.empty() && unit.entries.front() == "param", "checkpoint manifest ",
                path, ": ", ru.at("entries"), " must start with \"param\"");
    const Json& params = ru.array("params");
    for (std::size_t i = 0; i < params.size(); ++i) {
      Reader rp(params[i], ru.at("params") + "[" + std::to_string(i) + "]", path);
      ManifestParam p{rp.string("name"), rp.integer("numel"), rp.integer("global_offset"),
                      rp.integer("flat_offset")};
      TORCH_CHECK(p.flat_offset + p.numel <= unit.padded_numel, "checkpoint manifest ", path,
                  ": parameter '", p.name, "' ends at flat offset ", p.flat_offset + p.numel,
                  ", beyond its unit's padded_numel ", unit.padded_numel);
      unit.params.push_back(std::move(p));
    }
    m.units.push_back(std::move(unit));
  }
  const Json& files = top.array("rank_files");
  TORCH_CHECK(static_cast<int64_t>(files.size()) == m.world_size, "checkpoint manifest ", path,
              ": rank_files names ", files.size(), " files, expected world_size ", m.world_size);
  for (std::size_t r = 0; r < files.size(); ++r) {
    m.rank_files.push_back(file_from_json(files[r], "rank_files[" + std::to_string(r) + "]", path));
  }
  m.shared_file = file_from_json(top.field("shared_file"), "shared_file", path);
  m.metadata = top.field("metadata");
  return m;
}

}  // namespace dpzero::checkpoint
