// src/checkpoint/checkpoint.cpp — save (Note [checkpoint commit]) and load (Note [checkpoint
// resharding]) of a ZeroState; file format in Note [checkpoint format].
#include "src/checkpoint/checkpoint.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <random>
#include <set>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include "src/checkpoint/atomic_file.h"
#include "src/checkpoint/crc32.h"
#include "src/checkpoint/directory.h"
#include "src/checkpoint/manifest.h"
#include "src/checkpoint/reshard.h"

namespace dpzero::checkpoint {
namespace {

using Json = nlohmann::ordered_json;
using c10::IValue;

constexpr const char* kRankFormat = "dpzero-checkpoint-rank";
constexpr const char* kSharedFormat = "dpzero-checkpoint-shared";
constexpr int64_t kFileVersion = 1;
constexpr const char* kManifestName = "manifest.json";
constexpr const char* kLatestName = "latest";
constexpr const char* kSharedName = "shared.pt";

// ---- names ------------------------------------------------------------------------------------

std::string step_dir_name(int64_t step) {
  char name[40];
  std::snprintf(name, sizeof(name), "step-%08" PRId64, step);
  return name;
}

std::string rank_file_name(int64_t rank) {
  char name[40];
  std::snprintf(name, sizeof(name), "rank-%05" PRId64 ".pt", rank);
  return name;
}

// The step of a committed step directory's name ("step-00000020" → 20), or -1.
int64_t parse_step_dir_name(const std::string& name) {
  if (name.size() < 6 || name.compare(0, 5, "step-") != 0) return -1;
  int64_t step = 0;
  for (std::size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || step > (INT64_MAX - 9) / 10) return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

std::string join(const std::string& dir, const std::string& name) { return join_path(dir, name); }

const char* optimizer_kind_name(zero::OptimizerKind kind) {
  switch (kind) {
    case zero::OptimizerKind::kSgd: return "sgd";
    case zero::OptimizerKind::kAdam: return "adam";
    case zero::OptimizerKind::kAdamW: return "adamw";
  }
  return "?";
}

Json optimizer_hyperparameters(const zero::OptimizerOptions& o) {
  Json j{{"lr", o.lr}, {"weight_decay", o.weight_decay}, {"maximize", o.maximize}};
  if (o.kind == zero::OptimizerKind::kSgd) {
    j["momentum"] = o.momentum;
    j["dampening"] = o.dampening;
    j["nesterov"] = o.nesterov;
  } else {
    j["betas"] = {o.beta1, o.beta2};
    j["eps"] = o.eps;
    j["amsgrad"] = o.amsgrad;
  }
  return j;
}

// ---- faults (Note [checkpoint faults]) ---------------------------------------------------------

constexpr const char* kFaultPhases[] = {"during_rank_file", "after_rank_file", "before_manifest",
                                        "before_commit_rename", "before_latest"};

// The phase and rank (-1: any) DPZERO_CHECKPOINT_FAULT asks for; an empty phase when unset.
std::pair<std::string, int64_t> fault_request() {
  const char* spec = std::getenv("DPZERO_CHECKPOINT_FAULT");
  if (spec == nullptr || *spec == '\0') return {"", -1};
  std::string phase = spec;
  int64_t rank = -1;
  const std::size_t colon = phase.find(':');
  if (colon != std::string::npos) {
    const std::string rank_text = phase.substr(colon + 1);
    char* end = nullptr;
    rank = std::strtoll(rank_text.c_str(), &end, 10);
    TORCH_CHECK(!rank_text.empty() && *end == '\0' && rank >= 0,
                "DPZERO_CHECKPOINT_FAULT: the rank after ':' must be an integer >= 0, got '", spec,
                "'");
    phase.resize(colon);
  }
  TORCH_CHECK(std::find(std::begin(kFaultPhases), std::end(kFaultPhases), phase) !=
                  std::end(kFaultPhases),
              "DPZERO_CHECKPOINT_FAULT: unknown phase '", phase, "' (phases: during_rank_file, "
              "after_rank_file, before_manifest, before_commit_rename, before_latest)");
  return {phase, rank};
}

void fault_point(const char* phase, int64_t rank) {
  const auto [wanted, wanted_rank] = fault_request();
  if (wanted != phase || (wanted_rank >= 0 && wanted_rank != rank)) return;
  std::fprintf(stderr, "dpzero checkpoint: DPZERO_CHECKPOINT_FAULT: crashing rank %" PRId64
               " at %s\n", rank, phase);
  std::fflush(stderr);
  std::_Exit(kFaultExitCode);
}

// ---- agreement between ranks -------------------------------------------------------------------

std::string error_text(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

// Runs f; returns "" or the message of what it threw.
std::string capture(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    std::string message = error_text(e);
    return message.empty() ? "unknown error" : message;
  }
  return "";
}

struct Record {
  bool ok = true;
  std::string text;  // the error when !ok, else the phase's payload
};

// Every rank's record, on every rank (two all_gathers: the lengths, then the padded bytes). A
// collective, so also the commit protocol's barrier.
std::vector<Record> exchange(const comm::Collectives& comm, const at::Device& device,
                             const Record& mine) {
  const int64_t world = comm.world_size();
  const auto i64 = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor length = at::full({1}, static_cast<int64_t>(mine.text.size()) + 1, i64);
  at::Tensor lengths = at::empty({world}, i64);
  comm.all_gather(lengths, length);
  const at::Tensor lengths_cpu = lengths.cpu();
  const int64_t width = lengths_cpu.max().item<int64_t>();
  at::Tensor bytes = at::zeros({width}, at::kByte);  // [status byte, text...]
  bytes.data_ptr<uint8_t>()[0] = mine.ok ? 1 : 0;
  std::memcpy(bytes.data_ptr<uint8_t>() + 1, mine.text.data(), mine.text.size());
  bytes = bytes.to(device);
  at::Tensor all = at::empty({world * width}, at::TensorOptions().dtype(at::kByte).device(device));
  comm.all_gather(all, bytes);
  const at::Tensor all_cpu = all.cpu();
  std::vector<Record> out(world);
  for (int64_t r = 0; r < world; ++r) {
    const auto* p = all_cpu.data_ptr<uint8_t>() + r * width;
    out[r].ok = p[0] == 1;
    out[r].text.assign(reinterpret_cast<const char*>(p + 1),
                       static_cast<std::size_t>(lengths_cpu[r].item<int64_t>() - 1));
  }
  return out;
}

// Exchanges `error` ("" = ok) with payload `text` and throws on every rank if any rank failed: a
// failed rank its own message, the others the first failed rank's. Returns the records.
std::vector<Record> agree(const comm::Collectives& comm, const at::Device& device,
                          const std::string& error, const std::string& text, const char* op) {
  std::vector<Record> records =
      exchange(comm, device, error.empty() ? Record{true, text} : Record{false, error});
  TORCH_CHECK(error.empty(), error);
  for (std::size_t r = 0; r < records.size(); ++r) {
    TORCH_CHECK(records[r].ok, "checkpoint ", op, ": rank ", r, " failed: ", records[r].text);
  }
  return records;
}

at::Device engine_device(zero::ZeroState& state) {
  return state.num_units() > 0 ? state.unit_at(0).flat().device() : at::Device(at::kCPU);
}

// ---- serialisation ------------------------------------------------------------------------------

// A compact CPU copy: never a view (pickling a view writes its whole storage).
at::Tensor saved_copy(const at::Tensor& t) {
  return t.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous();
}

c10::Dict<std::string, at::Tensor> tensor_dict(const TensorList& tensors, const char* what) {
  c10::Dict<std::string, at::Tensor> out;
  for (const auto& [name, tensor] : tensors) {
    TORCH_CHECK(tensor.defined(), "checkpoint save: ", what, " '", name, "' is not a tensor");
    TORCH_CHECK(!out.contains(name), "checkpoint save: ", what, " '", name, "' appears twice");
    out.insert(name, saved_copy(tensor));
  }
  return out;
}

// torch::jit::pickle_save's zip container, but with untagged dicts and lists: pickle_save tags
// each aggregate with its TorchScript type (torch.jit._pickle.restore_type_tag), a global that
// torch.load(weights_only=True) refuses, while untagged ones are plain Python dicts and lists.
std::vector<char> serialize(const IValue& value) {
  std::vector<char> pickle;
  torch::jit::Pickler pickler(
      [&](const char* data, std::size_t size) { pickle.insert(pickle.end(), data, data + size); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  std::vector<char> out;
  out.reserve(pickle.size());
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, std::size_t size) {
    const char* bytes = static_cast<const char*>(data);
    out.insert(out.end(), bytes, bytes + size);
    return size;
  });
  torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(),
                                     writer);
  writer.writeEndOfFile();
  return out;
}

c10::impl::GenericDict string_dict() {
  return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
}

std::vector<char> rank_file_bytes(zero::ZeroState& state, int64_t step, const TensorList& extra) {
  c10::impl::GenericList units(c10::AnyType::get());
  for (int64_t u = 0; u < state.num_units(); ++u) {
    zero::Unit& group = state.unit_at(u);
    c10::impl::GenericDict unit = string_dict();
    unit.insert("name", group.name());
    unit.insert("optimizer_steps", group.optimizer().steps());
    unit.insert("entries", tensor_dict(group.owned_state(), "entry"));
    units.push_back(unit);
  }
  c10::impl::GenericDict file = string_dict();
  file.insert("format", kRankFormat);
  file.insert("version", kFileVersion);
  file.insert("rank", state.comm().rank());
  file.insert("world_size", state.comm().world_size());
  file.insert("step", step);
  file.insert("units", units);
  file.insert("extra", tensor_dict(extra, "extra"));
  return serialize(file);
}

std::vector<char> shared_file_bytes(int64_t step, const TensorList& shared) {
  c10::impl::GenericDict file = string_dict();
  file.insert("format", kSharedFormat);
  file.insert("version", kFileVersion);
  file.insert("step", step);
  file.insert("tensors", tensor_dict(shared, "shared tensor"));
  return serialize(file);
}

// The manifest of this engine, without files (rank 0 adds them after the exchange).
Manifest describe(zero::ZeroState& state, int64_t step, const Json& metadata) {
  Manifest m;
  m.step = step;
  m.engine_steps = state.steps();
  m.world_size = state.comm().world_size();
  m.stage = static_cast<int64_t>(state.config().stage);
  m.alignment = state.config().alignment;
  m.total_coordinates = state.plan().total_coordinates();
  m.optimizer_kind = optimizer_kind_name(state.config().optimizer.kind);
  m.optimizer = optimizer_hyperparameters(state.config().optimizer);
  m.metadata = metadata;
  for (int64_t u = 0; u < state.num_units(); ++u) {
    zero::Unit& group = state.unit_at(u);
    const zero::UnitLayout& layout = group.flat().layout();
    ManifestUnit unit;
    unit.name = group.name();
    unit.padded_numel = layout.padded_numel();
    unit.shard_numel = layout.shard_numel();
    unit.optimizer_steps = group.optimizer().steps();
    for (const auto& [name, tensor] : group.owned_state()) unit.entries.push_back(name);
    for (std::size_t i = 0; i < layout.params().size(); ++i) {
      unit.params.push_back(ManifestParam{group.flat().names()[i], layout.params()[i].numel,
                                          layout.params()[i].global_offset,
                                          layout.flat_offsets()[i]});
    }
    m.units.push_back(std::move(unit));
  }
  return m;
}

// ---- reading ------------------------------------------------------------------------------------

// The IValue of a checkpoint file after its size and CRC-32 match the manifest.
IValue read_verified(const std::string& path, const ManifestFile& expected) {
  std::vector<char> bytes = read_file(path);
  TORCH_CHECK(static_cast<int64_t>(bytes.size()) == expected.bytes, "checkpoint file ", path,
              " has ", bytes.size(), " bytes, the manifest says ", expected.bytes,
              " (truncated or replaced)");
  const uint32_t crc = crc32(bytes.data(), bytes.size());
  TORCH_CHECK(crc == expected.crc32, "checkpoint file ", path, " is corrupt: its CRC-32 is ",
              crc32_hex(crc), ", the manifest says ", crc32_hex(expected.crc32));
  try {
    return torch::jit::pickle_load(bytes);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "checkpoint file ", path, " cannot be unpickled: ", error_text(e));
  }
}

// Field access on an unpickled dict, naming the file in every error.
class FileDict {
 public:
  FileDict(const IValue& value, std::string what, const std::string& path)
      : what_(std::move(what)), path_(path) {
    TORCH_CHECK(value.isGenericDict(), "checkpoint file ", path_, ": ", what_,
                " is not a dict");
    dict_ = value.toGenericDict();
  }
  const IValue& get(const char* key) const {
    auto it = dict_.find(key);
    TORCH_CHECK(it != dict_.end(), "checkpoint file ", path_, ": ", what_, " has no '", key, "'");
    return it->value();
  }
  int64_t integer(const char* key) const {
    const IValue& v = get(key);
    TORCH_CHECK(v.isInt(), "checkpoint file ", path_, ": ", what_, ".", key, " is not an int");
    return v.toInt();
  }
  std::string string(const char* key) const {
    const IValue& v = get(key);
    TORCH_CHECK(v.isString(), "checkpoint file ", path_, ": ", what_, ".", key,
                " is not a string");
    return v.toStringRef();
  }
  // {name: tensor}, in file order.
  TensorList tensors(const char* key) const {
    FileDict inner(get(key), what_ + "." + key, path_);
    TensorList out;
    for (const auto& item : inner.dict_) {
      TORCH_CHECK(item.key().isString() && item.value().isTensor(), "checkpoint file ", path_,
                  ": ", what_, ".", key, " must map names to tensors");
      out.emplace_back(item.key().toStringRef(), item.value().toTensor());
    }
    return out;
  }
  const std::string& path() const { return path_; }

 private:
  c10::impl::GenericDict dict_ = string_dict();
  std::string what_;
  const std::string& path_;
};

void check_header(const FileDict& file, const char* format, const Manifest& m) {
  TORCH_CHECK(file.string("format") == format && file.integer("version") == kFileVersion,
              "checkpoint file ", file.path(), " is not a version-", kFileVersion, " ", format,
              " file");
  TORCH_CHECK(file.integer("step") == m.step, "checkpoint file ", file.path(), " is of step ",
              file.integer("step"), ", the manifest's step is ", m.step);
}

struct RankFile {
  std::vector<std::vector<at::Tensor>> entries;  // [unit][manifest entry], each [shard_numel]
  TensorList extra;
};

RankFile read_rank_file(const std::string& dir, const Manifest& m, int64_t rank) {
  const std::string path = join(dir, m.rank_files[rank].name);
  const FileDict file(read_verified(path, m.rank_files[rank]), "the file", path);
  check_header(file, kRankFormat, m);
  TORCH_CHECK(file.integer("rank") == rank && file.integer("world_size") == m.world_size,
              "checkpoint file ", path, " is rank ", file.integer("rank"), " of ",
              file.integer("world_size"), ", the manifest lists it as rank ", rank, " of ",
              m.world_size);
  const IValue& units_value = file.get("units");
  TORCH_CHECK(units_value.isList() && units_value.toListRef().size() == m.units.size(),
              "checkpoint file ", path, ": 'units' must be a list of ", m.units.size(), " units");
  RankFile out;
  const auto units = units_value.toListRef();
  for (std::size_t u = 0; u < m.units.size(); ++u) {
    const ManifestUnit& mu = m.units[u];
    const FileDict unit(units[u], "units[" + std::to_string(u) + "]", path);
    TORCH_CHECK(unit.string("name") == mu.name, "checkpoint file ", path, ": unit ", u, " is '",
                unit.string("name"), "', the manifest says '", mu.name, "'");
    const TensorList entries = unit.tensors("entries");
    std::vector<at::Tensor> ordered;
    for (const std::string& name : mu.entries) {
      auto it = std::find_if(entries.begin(), entries.end(),
                             [&](const auto& e) { return e.first == name; });
      TORCH_CHECK(it != entries.end(), "checkpoint file ", path, ": unit '", mu.name,
                  "' has no entry '", name, "'");
      const at::Tensor& t = it->second;
      TORCH_CHECK(t.dim() == 1 && t.numel() == mu.shard_numel && t.scalar_type() == at::kFloat,
                  "checkpoint file ", path, ": unit '", mu.name, "' entry '", name,
                  "' must be fp32 [", mu.shard_numel, "], got ", t.scalar_type(), " ", t.sizes());
      ordered.push_back(t);
    }
    out.entries.push_back(std::move(ordered));
  }
  out.extra = file.tensors("extra");
  return out;
}

TensorList read_shared_file(const std::string& dir, const Manifest& m) {
  const std::string path = join(dir, m.shared_file.name);
  const FileDict file(read_verified(path, m.shared_file), "the file", path);
  check_header(file, kSharedFormat, m);
  return file.tensors("tensors");
}

// shared (from the file) onto targets: the same names, shapes and dtypes, or an error naming one.
void check_shared(const TensorList& saved, const TensorList& targets, const std::string& path) {
  for (const auto& [name, target] : targets) {
    auto it = std::find_if(saved.begin(), saved.end(),
                           [&](const auto& e) { return e.first == name; });
    TORCH_CHECK(it != saved.end(), "checkpoint ", path, " does not match the model: it has no '",
                name, "' (a buffer or frozen parameter of the model)");
    TORCH_CHECK(it->second.sizes() == target.sizes() &&
                    it->second.scalar_type() == target.scalar_type(),
                "checkpoint ", path, " does not match the model: '", name, "' is ",
                it->second.scalar_type(), " ", it->second.sizes(), " in the checkpoint and ",
                target.scalar_type(), " ", target.sizes(), " in the model");
  }
  for (const auto& [name, tensor] : saved) {
    TORCH_CHECK(std::any_of(targets.begin(), targets.end(),
                            [&](const auto& e) { return e.first == name; }),
                "checkpoint ", path, " does not match the model: it has '", name,
                "', which is not a buffer or frozen parameter of the model");
  }
}

// ---- commit helpers (rank 0) --------------------------------------------------------------------

std::string make_nonce() {
  std::random_device device;
  const uint64_t value = (static_cast<uint64_t>(device()) << 32) ^ device();
  char text[24];
  std::snprintf(text, sizeof(text), "%016" PRIx64, value);
  return text;
}

// Renames step directory `name` out of the way (so a half-deleted directory never looks
// committed), then deletes it.
void remove_step_directory(const std::string& root, const std::string& name,
                           const std::string& nonce) {
  const std::string doomed = join(root, "." + name + ".deleting-" + nonce);
  rename_no_replace(join(root, name), doomed);
  remove_tree(doomed);
}

// A leftover of a crashed save: ".step-N.tmp-*", ".step-N.deleting-*" or ".latest.tmp-*".
bool is_leftover(const std::string& name) {
  const bool ours = name.compare(0, 6, ".step-") == 0 || name.compare(0, 8, ".latest.") == 0;
  return ours && (name.find(".tmp-") != std::string::npos ||
                  name.find(".deleting-") != std::string::npos);
}

// After a commit: keep_last, and the leftovers of crashed saves. Failures here do not undo the
// commit: they are warnings.
void clean_up(const std::string& root, int64_t step, int64_t keep_last, const std::string& nonce) {
  std::vector<std::pair<int64_t, std::string>> older;  // committed steps below `step`
  std::vector<std::string> leftovers;
  for (const std::string& name : list_directory(root)) {
    const int64_t s = parse_step_dir_name(name);
    if (s >= 0 && s < step && path_exists(join(join(root, name), kManifestName))) {
      older.emplace_back(s, name);
    } else if (is_leftover(name)) {
      leftovers.push_back(name);
    }
  }
  if (keep_last > 0) {
    std::sort(older.begin(), older.end(),
              [](const auto& a, const auto& b) { return a.first > b.first; });
    for (std::size_t i = static_cast<std::size_t>(keep_last - 1); i < older.size(); ++i) {
      remove_step_directory(root, older[i].second, nonce);
    }
  }
  for (const std::string& name : leftovers) remove_tree(join(root, name));
  fsync_directory(root);
}

}  // namespace

// ---- save ---------------------------------------------------------------------------------------

std::string save(zero::ZeroState& state, const std::string& root, const TensorList& extra,
                 const TensorList& shared, const SaveOptions& options) {
  const comm::Collectives& comm = state.comm();
  const int64_t rank = comm.rank();
  const at::Device device = engine_device(state);
  const int64_t step = options.step < 0 ? state.steps() : options.step;
  const std::string step_dir = join(root, step_dir_name(step));

  // 1. Everything in memory: this rank's file, and on rank 0 shared.pt and the manifest draft.
  std::vector<char> rank_bytes, shared_bytes;
  Manifest manifest;
  std::string error = capture([&] {
    fault_request();  // an unknown phase is an error before anything is written
    TORCH_CHECK(!root.empty(), "checkpoint save: the checkpoint root is empty");
    TORCH_CHECK(options.keep_last >= 0, "checkpoint save: keep_last must be >= 0, got ",
                options.keep_last);
    Json metadata;
    try {
      metadata = Json::parse(options.metadata_json);
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, "checkpoint save: metadata is not valid JSON: ", e.what());
    }
    at::NoGradGuard no_grad;
    rank_bytes = rank_file_bytes(state, step, extra);
    if (rank == 0) {
      shared_bytes = shared_file_bytes(step, shared);
      manifest = describe(state, step, metadata);
    }
  });

  // 2. Rank 0 makes the temporary step directory; every rank learns its name.
  const std::string temp_dir_name = ".step-" + std::to_string(step) + ".tmp-";  // + nonce
  std::string nonce;
  if (rank == 0 && error.empty()) {
    error = capture([&] {
      make_directories(root);
      TORCH_CHECK(!path_exists(step_dir), "checkpoint save: ", step_dir,
                  " already exists; a committed checkpoint is never overwritten (save under "
                  "another step, or remove it)");
      nonce = make_nonce();
      make_directory(join(root, temp_dir_name + nonce));
      fsync_directory(root);
    });
  }
  const std::string created = nonce;  // rank 0: the directory it made, if any
  // Rank 0 removes its temporary directory when a later phase fails on some rank (a crash leaves
  // it to the next successful save instead, Note [checkpoint commit]).
  const auto discard = [&] {
    if (rank == 0 && !created.empty()) {
      capture([&] { remove_tree(join(root, temp_dir_name + created)); });
    }
  };
  try {
    nonce = agree(comm, device, error, nonce, "save")[0].text;
  } catch (...) {
    discard();
    throw;
  }
  const std::string temp_dir = join(root, temp_dir_name + nonce);

  // 3. Every rank writes its file durably; every rank learns every file's size and CRC-32.
  error = capture([&] {
    write_file_atomically(join(temp_dir, rank_file_name(rank)), rank_bytes.data(),
                          rank_bytes.size(), [&] { fault_point("during_rank_file", rank); });
    fault_point("after_rank_file", rank);
    if (rank == 0) {
      write_file_atomically(join(temp_dir, kSharedName), shared_bytes.data(), shared_bytes.size());
    }
  });
  const std::string info =
      Json{{"bytes", rank_bytes.size()}, {"crc32", crc32(rank_bytes.data(), rank_bytes.size())}}
          .dump();
  std::vector<Record> files;
  try {
    files = agree(comm, device, error, info, "save");
  } catch (...) {
    discard();
    throw;
  }

  // 4. Rank 0 commits: manifest, rename, latest, then keep_last and leftovers.
  error = "";
  if (rank == 0) {
    bool renamed = false;
    error = capture([&] {
      for (std::size_t r = 0; r < files.size(); ++r) {
        const Json j = Json::parse(files[r].text);
        manifest.rank_files.push_back(ManifestFile{rank_file_name(static_cast<int64_t>(r)),
                                                   j.at("bytes").get<int64_t>(),
                                                   j.at("crc32").get<uint32_t>()});
      }
      manifest.shared_file = ManifestFile{kSharedName, static_cast<int64_t>(shared_bytes.size()),
                                          crc32(shared_bytes.data(), shared_bytes.size())};
      fault_point("before_manifest", rank);
      const std::string text = manifest_to_json(manifest);
      write_file_atomically(join(temp_dir, kManifestName), text.data(), text.size());
      fault_point("before_commit_rename", rank);
      rename_no_replace(temp_dir, step_dir);
      renamed = true;
      fsync_directory(root);
      fault_point("before_latest", rank);
      const std::string latest = step_dir_name(step) + "\n";
      write_file_atomically(join(root, kLatestName), latest.data(), latest.size());
    });
    if (!error.empty() && !renamed) discard();
    if (error.empty()) {
      const std::string cleanup =
          capture([&] { clean_up(root, step, options.keep_last, make_nonce()); });
      if (!cleanup.empty()) {
        TORCH_WARN("checkpoint save: ", step_dir, " is committed, but cleaning up ", root,
                   " failed: ", cleanup);
      }
    }
  }
  agree(comm, device, error, "", "save");
  return step_dir;
}

// ---- load ---------------------------------------------------------------------------------------

std::string resolve(const std::string& path) {
  TORCH_CHECK(!path.empty(), "checkpoint load: the path is empty");
  if (path_exists(join(path, kManifestName))) return path;
  const std::string latest_path = join(path, kLatestName);
  TORCH_CHECK(path_exists(latest_path), "no checkpoint at ", path, ": it has neither ",
              kManifestName, " (a step directory) nor ", kLatestName, " (a checkpoint root)");
  const std::vector<char> bytes = read_file(latest_path);
  std::string name(bytes.begin(), bytes.end());
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  TORCH_CHECK(parse_step_dir_name(name) >= 0, "checkpoint root ", path, ": ", latest_path,
              " must name a step directory (step-NNNNNNNN), got '", name, "'");
  const std::string dir = join(path, name);
  TORCH_CHECK(path_exists(join(dir, kManifestName)), "checkpoint root ", path, ": ", latest_path,
              " names ", name, ", but ", join(dir, kManifestName), " does not exist");
  return dir;
}

LoadResult load(zero::ZeroState& state, const std::string& path, const TensorList& shared) {
  const comm::Collectives& comm = state.comm();
  const int64_t rank = comm.rank();
  const at::Device device = engine_device(state);

  // Rank 0 resolves ROOT/latest for everyone, so all ranks load the same step even if their
  // views of the file system differ for a moment.
  std::string resolved;
  const std::string resolve_error = rank == 0 ? capture([&] { resolved = resolve(path); }) : "";
  const std::string dir = agree(comm, device, resolve_error, resolved, "load")[0].text;

  LoadResult result;
  std::vector<UnitPlan> plans;
  std::vector<std::vector<at::Tensor>> values;  // [unit][entry], each [kept_end - kept_begin]
  TensorList shared_saved;
  const std::string error = capture([&] {
    at::NoGradGuard no_grad;
    const std::string manifest_path = join(dir, kManifestName);
    const std::vector<char> text = read_file(manifest_path);
    const Manifest m = parse_manifest(std::string(text.begin(), text.end()), manifest_path);

    const std::string kind = optimizer_kind_name(state.config().optimizer.kind);
    TORCH_CHECK(m.optimizer_kind == kind, "checkpoint ", dir, " was written with optimizer '",
                m.optimizer_kind, "', this engine uses '", kind, "'");
    std::vector<TargetUnit> targets;
    for (int64_t u = 0; u < state.num_units(); ++u) {
      zero::Unit& group = state.unit_at(u);
      const zero::UnitLayout& layout = group.flat().layout();
      TargetUnit t;
      t.name = group.name();
      for (std::size_t i = 0; i < layout.params().size(); ++i) {
        t.params.push_back(UnitParam{group.flat().names()[i], layout.params()[i].numel,
                                     layout.params()[i].global_offset, layout.flat_offsets()[i]});
      }
      std::tie(t.kept_begin, t.kept_end) = group.kept_range();
      targets.push_back(std::move(t));
    }
    check_model(m, targets, state.plan().total_coordinates(), manifest_path);

    // Plans, checked against each optimizer before any file is read: a scratch optimizer with the
    // engine's options takes the entry names on empty tensors (ShardOptimizer::load_state checks
    // names and shapes only), so a mismatch (momentum on/off, amsgrad) fails here, on every rank.
    std::set<int64_t> needed;
    for (std::size_t u = 0; u < targets.size(); ++u) {
      UnitPlan plan = plan_unit(m, targets[u], manifest_path);
      TensorList probe;
      for (std::size_t e = 1; e < plan.entries.size(); ++e) {
        probe.emplace_back(plan.entries[e], at::empty({0}, at::kFloat));
      }
      const std::string checked = capture([&] {
        zero::make_shard_optimizer(state.unit_at(static_cast<int64_t>(u)).optimizer().options())
            ->load_state(probe, plan.optimizer_steps, 0);
      });
      TORCH_CHECK(checked.empty(), "checkpoint ", dir, ": unit '", targets[u].name, "': ",
                  checked);
      const int64_t n = targets[u].kept_end - targets[u].kept_begin;
      std::vector<at::Tensor> unit_values;
      for (std::size_t e = 0; e < plan.entries.size(); ++e) {
        unit_values.push_back(at::zeros({n}, at::kFloat));  // padding stays zero
      }
      values.push_back(std::move(unit_values));
      for (const Piece& p : plan.pieces) needed.insert(p.old_rank);
      plans.push_back(std::move(plan));
    }
    if (rank < m.world_size) needed.insert(rank);  // its extra (Note [checkpoint extras])

    // Each needed old file once, one at a time.
    for (const int64_t old_rank : needed) {
      RankFile file = read_rank_file(dir, m, old_rank);
      for (std::size_t u = 0; u < plans.size(); ++u) {
        for (const Piece& p : plans[u].pieces) {
          if (p.old_rank != old_rank) continue;
          for (std::size_t e = 0; e < plans[u].entries.size(); ++e) {
            values[u][e].narrow(0, p.new_offset, p.length)
                .copy_(file.entries[p.old_unit][e].narrow(0, p.old_offset, p.length));
          }
        }
      }
      if (old_rank == rank) {
        result.extra = std::move(file.extra);
        result.extra_rank = rank;
      }
    }
    shared_saved = read_shared_file(dir, m);
    check_shared(shared_saved, shared, dir);

    result.directory = dir;
    result.step = m.step;
    result.engine_steps = m.engine_steps;
    result.world_size = m.world_size;
    result.stage = m.stage;
    result.optimizer_json =
        Json{{"kind", m.optimizer_kind}, {"hyperparameters", m.optimizer}}.dump();
    result.metadata_json = m.metadata.dump();
  });
  agree(comm, device, error, "", "load");

  // Every rank has everything and it all checked out: now change the engine (stages 1-2
  // all-gather inside load_state, in unit order on every rank).
  at::NoGradGuard no_grad;
  for (std::size_t u = 0; u < plans.size(); ++u) {
    TensorList entries;
    for (std::size_t e = 0; e < plans[u].entries.size(); ++e) {
      entries.emplace_back(plans[u].entries[e], values[u][e]);
    }
    state.unit_at(static_cast<int64_t>(u)).load_state(entries, plans[u].optimizer_steps, comm);
  }
  state.set_steps(result.engine_steps);
  for (const auto& [name, target] : shared) {
    auto it = std::find_if(shared_saved.begin(), shared_saved.end(),
                           [&](const auto& e) { return e.first == name; });
    at::Tensor(target).copy_(it->second);
  }
  return result;
}

}  // namespace dpzero::checkpoint
