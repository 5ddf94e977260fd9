// src/dp/state_guard.cpp — see state_guard.h.
#include "src/dp/state_guard.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <tuple>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include "privacy/entropy.h"

namespace dpzero::dp {
namespace {

// At most this many changed tensors are named in a refusal (the rest are counted).
constexpr size_t kNamed = 6;

// `t`'s values as a flat uint8 tensor (a copy where `t` is not contiguous).
at::Tensor bytes_of(const at::Tensor& t) {
  const at::Tensor flat = t.detach().contiguous().reshape({-1});
  if (flat.numel() == 0) return at::empty({0}, flat.options().dtype(at::kByte));
  return flat.view(at::kByte);
}

// What of state tensor `t` is checked: all of its storage, as a flat tensor of its dtype (of
// bytes where the storage is not a whole number of its elements), which a save writes and a
// forward can reach past the view; but `t` itself when a trained parameter's storage is the same
// (`trained`: their data pointers; the rest is the optimizer's to write) or it has none.
at::Tensor memory_of(const at::Tensor& t, const std::set<const void*>& trained) {
  if (!t.has_storage() || t.is_meta()) return t;
  const c10::Storage& storage = t.storage();
  if (storage.data() != nullptr && trained.count(storage.data())) return t;
  const int64_t nbytes = static_cast<int64_t>(storage.nbytes());
  const at::ScalarType dtype =
      nbytes % static_cast<int64_t>(t.element_size()) == 0 ? t.scalar_type() : at::kByte;
  const int64_t n = nbytes / static_cast<int64_t>(c10::elementSize(dtype));
  return at::empty({0}, at::TensorOptions().dtype(dtype).device(t.device()))
      .set_(storage, 0, {n}, {1});
}

// "buffer 'enc.ema' of module 'enc' (Encoder)".
std::string describe(bool buffer, const std::string& name, const torch::nn::Module& owner) {
  const size_t dot = name.rfind('.');
  const std::string module = dot == std::string::npos ? "<model>" : name.substr(0, dot);
  return std::string(buffer ? "buffer '" : "frozen parameter '") + name + "' of module '" +
         module + "' (" + owner.name() + ")";
}

// The tensor registered in `owner` as `local` now (a buffer or a parameter), or undefined.
at::Tensor current(const torch::nn::Module& owner, const std::string& local, bool buffer) {
  const auto named = buffer ? owner.named_buffers(/*recurse=*/false)
                            : owner.named_parameters(/*recurse=*/false);
  const at::Tensor* found = named.find(local);
  return found ? *found : at::Tensor();
}

using Key = std::tuple<const torch::nn::Module*, std::string, bool>;

// t's bits as a flat tensor of integer words (Note [fingerprint words] in state_guard.h): 8-byte
// words when its byte count is a multiple of 8, else words of its element size (a 16-byte
// element's bytes). One view of t where it is flat already (a memory of memory_of), as the guards'
// tensors are: the views cost more than the words of a small tensor.
at::Tensor words_of(const at::Tensor& t) {
  const at::Tensor flat = t.dim() == 1 && t.is_contiguous() ? t : t.contiguous().reshape({-1});
  const int64_t size = static_cast<int64_t>(flat.element_size());
  const int64_t nbytes = flat.numel() * size;
  if (nbytes > 0 && nbytes % 8 == 0) {
    const bool aligned = flat.storage_offset() * size % 8 == 0 &&
                         reinterpret_cast<std::uintptr_t>(flat.const_data_ptr()) % 8 == 0;
    return aligned ? flat.view(at::kLong) : bytes_of(flat).clone().view(at::kLong);
  }
  switch (size) {
    case 1: return flat.view(at::kByte);
    case 2: return flat.view(at::kShort);
    case 4: return flat.view(at::kInt);
    case 8: return flat.view(at::kLong);
    default: return bytes_of(flat);  // complex128: its bytes
  }
}
}  // namespace

at::Tensor state_fingerprints(const std::vector<at::Tensor>& ts, int64_t key) {
  TORCH_CHECK(!ts.empty(), "state_fingerprints: needs at least one tensor, got none");
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> words;
  words.reserve(ts.size());
  for (const at::Tensor& t : ts) words.push_back(words_of(t));
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_state_fingerprint", "")
                             .typed<at::Tensor(at::TensorList, int64_t)>();
  return op.call(words, key);
}

at::Tensor state_fingerprint(const at::Tensor& t, int64_t key) {
  return state_fingerprints({t}, key).select(0, 0);
}

TensorPlace::TensorPlace(const at::Tensor& t) {
  if (!t.has_storage()) return;
  try {  // a resharded stage-3 parameter's storage refuses every data access
    const c10::Storage& s = t.storage();
    data = reinterpret_cast<int64_t>(s.data());
    nbytes = static_cast<int64_t>(s.nbytes());
  } catch (const c10::Error&) {
    return;
  }
  readable = true;
  offset = t.storage_offset();
  sizes = t.sizes().vec();
  strides = t.strides().vec();
  dtype = t.scalar_type();
  neg = t.is_neg();
  conj = t.is_conj();
}

bool TensorPlace::operator==(const TensorPlace& o) const {
  return readable && o.readable && data == o.data && nbytes == o.nbytes && offset == o.offset &&
         sizes == o.sizes && strides == o.strides && dtype == o.dtype && neg == o.neg &&
         conj == o.conj;
}

StateGuard::StateGuard(std::shared_ptr<torch::nn::Module> model,
                       std::vector<std::pair<std::string, at::Tensor>> trained)
    : model_(std::move(model)), trained_(std::move(trained)) {
  const privacy::ChaCha20Key entropy = privacy::entropy_key();
  key_ = static_cast<int64_t>(((static_cast<uint64_t>(entropy.w[0]) << 32) | entropy.w[1]) >> 2);
  fix({});
  record_trained();
}

std::set<const void*> StateGuard::trained_storages() const {
  std::set<const void*> out;
  for (const auto& [name, p] : trained_)
    if (p.has_storage() && p.storage().data() != nullptr) out.insert(p.storage().data());
  return out;
}

std::vector<StateGuard::Entry> StateGuard::walk() const {
  std::set<const c10::TensorImpl*> trained;
  for (const auto& [name, p] : trained_) trained.insert(p.unsafeGetTensorImpl());
  std::vector<Entry> out;
  std::set<Key> seen;  // a module reached by two names: its first
  for (const auto& item : model_->named_modules("", /*include_self=*/true)) {
    const std::shared_ptr<torch::nn::Module>& m = item.value();
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    for (const auto& b : m->named_buffers(/*recurse=*/false))
      if (b.value().defined() && seen.insert(Key{m.get(), b.key(), true}).second)
        out.push_back(Entry{prefix + b.key(), m, b.key(), true, b.value(), {}, {}});
    for (const auto& p : m->named_parameters(/*recurse=*/false))
      if (p.value().defined() && !trained.count(p.value().unsafeGetTensorImpl()) &&
          seen.insert(Key{m.get(), p.key(), false}).second)
        out.push_back(Entry{prefix + p.key(), m, p.key(), false, p.value(), {}, {}});
  }
  return out;
}

void StateGuard::fix(const std::vector<std::string>& names) {
  at::NoGradGuard no_grad;
  const std::set<std::string> named(names.begin(), names.end());
  const auto fixes = [&](const std::string& name) { return names.empty() || named.count(name); };
  std::map<Key, const Entry*> old;
  for (const Entry& e : entries_) old[Key{e.owner.get(), e.local, e.buffer}] = &e;
  const std::set<const void*> trained = trained_storages();
  std::vector<Entry> entries;
  std::set<Key> walked;
  for (Entry& e : walk()) {
    const Key key{e.owner.get(), e.local, e.buffer};
    walked.insert(key);
    if (!fixes(e.name)) {  // keeps what was fixed before (a tensor new since stays a change)
      if (old.count(key)) entries.push_back(*old.at(key));
      continue;
    }
    const at::Tensor memory = memory_of(e.tensor, trained);
    if (e.buffer) e.copy = bytes_of(memory).clone();
    else e.fingerprint = state_fingerprint(memory, key_);
    entries.push_back(std::move(e));
  }
  for (const Entry& e : entries_)  // removed since, and not named: still a change
    if (!walked.count(Key{e.owner.get(), e.local, e.buffer}) && !fixes(e.name))
      entries.push_back(e);
  // The pending flags are per entry: what they hold stays a change of the open logical batch.
  bool pending = false;
  for (const at::Tensor& f : pending_) pending = pending || f.item<bool>();
  if (pending)
    pending_problems_.push_back("module state changed during an earlier micro-batch of this "
                                "logical batch");
  pending_.clear();
  entries_ = std::move(entries);
}

std::vector<std::string> StateGuard::structure() const {
  std::vector<std::string> problems;
  std::set<Key> fixed;
  for (const Entry& e : entries_) {
    fixed.insert(Key{e.owner.get(), e.local, e.buffer});
    const at::Tensor now = current(*e.owner, e.local, e.buffer);
    if (!now.defined())
      problems.push_back(describe(e.buffer, e.name, *e.owner) + " was removed");
    else if (now.unsafeGetTensorImpl() != e.tensor.unsafeGetTensorImpl())
      problems.push_back(describe(e.buffer, e.name, *e.owner) + " was replaced by another tensor");
  }
  for (const Entry& e : walk())
    if (!fixed.count(Key{e.owner.get(), e.local, e.buffer}))
      problems.push_back(describe(e.buffer, e.name, *e.owner) +
                         (e.buffer ? " was registered" : " was added") +
                         " after the engine took the model");
  return problems;
}

void StateGuard::record_trained() {
  versions_.clear();
  places_.clear();
  for (const auto& [name, p] : trained_) places_.emplace_back(p);
  trained_memories_.clear();
  for (const auto& [name, p] : trained_) {
    versions_.push_back(static_cast<int64_t>(p._version()));
    const void* data = p.storage().data();
    auto same = std::find_if(trained_memories_.begin(), trained_memories_.end(),
                             [&](const TrainedMemory& m) { return m.data == data; });
    if (same == trained_memories_.end()) {
      const at::Tensor memory = memory_of(p, {});  // all of its storage: a unit's flat buffer
      trained_memories_.push_back(TrainedMemory{{name}, memory, data, at::Tensor()});
    } else {
      same->names.push_back(name);
    }
  }
  const std::vector<at::Tensor> now = trained_fingerprints();
  for (size_t i = 0; i < now.size(); ++i) trained_memories_[i].fingerprint = now[i];
}

std::vector<at::Tensor> StateGuard::trained_fingerprints() const {
  std::vector<at::Tensor> memories;
  for (const TrainedMemory& m : trained_memories_) memories.push_back(m.memory);
  const bool one_device = std::all_of(memories.begin(), memories.end(), [&](const at::Tensor& t) {
    return t.device() == memories.front().device();
  });
  std::vector<at::Tensor> out;
  if (one_device && !memories.empty()) {
    const at::Tensor all = state_fingerprints(memories, key_);  // one op call for every unit
    for (int64_t i = 0; i < all.size(0); ++i) out.push_back(all.select(0, i));
  } else {
    for (const at::Tensor& m : memories) out.push_back(state_fingerprint(m, key_));
  }
  return out;
}

namespace {
std::string written_outside(const std::vector<std::string>& names) {
  const std::string how =
      " written outside the private step (in place or through .data() in the forward, or "
      "between steps)";
  if (names.size() == 1) return "trainable parameter '" + names[0] + "' was" + how;
  std::string list;
  for (size_t i = 0; i < std::min<size_t>(names.size(), 4); ++i)
    list += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > 4) list += " and " + std::to_string(names.size() - 4) + " more";
  return "one of the trainable parameters " + list + ", which share one buffer, was" + how;
}
}  // namespace

std::vector<std::string> StateGuard::written_trained() const {
  std::vector<std::string> problems;
  for (size_t i = 0; i < trained_.size(); ++i) {
    const auto& [name, p] = trained_[i];
    if (static_cast<int64_t>(p._version()) != versions_[i])
      problems.push_back(written_outside({name}));
    else if (TensorPlace(p) != places_[i])
      problems.push_back("trainable parameter '" + name +
                         "' was given other memory outside the private step (its data replaced)");
  }
  return problems;
}

std::vector<at::Tensor> StateGuard::flags() const {
  at::NoGradGuard no_grad;
  const std::set<const void*> trained = trained_storages();
  std::vector<at::Tensor> out;
  for (const Entry& e : entries_) {
    const at::Tensor now = current(*e.owner, e.local, e.buffer);
    const auto flag = at::TensorOptions().dtype(at::kBool).device(e.tensor.device());
    if (!now.defined() || now.unsafeGetTensorImpl() != e.tensor.unsafeGetTensorImpl()) {
      out.push_back(at::zeros({}, flag));  // structure() names it
    } else if (e.buffer) {
      const at::Tensor bytes = bytes_of(memory_of(e.tensor, trained));
      out.push_back(bytes.numel() != e.copy.numel()
                        ? at::ones({}, flag)
                        : bytes.ne(e.copy.to(bytes.device())).any().to(flag.device()));
    } else {
      out.push_back(state_fingerprint(memory_of(e.tensor, trained), key_)
                        .ne(e.fingerprint.to(e.tensor.device())));
    }
  }
  // By value: .data() moves no version counter. One fingerprint per memory (a unit's flat
  // buffer), so that the launches grow with units, not parameters.
  const std::vector<at::Tensor> now = trained_fingerprints();
  for (size_t i = 0; i < now.size(); ++i) out.push_back(now[i].ne(trained_memories_[i].fingerprint));
  return out;
}

void StateGuard::restore_buffers() {
  at::NoGradGuard no_grad;
  const std::set<const void*> trained = trained_storages();
  for (const Entry& e : entries_) {
    if (!e.buffer) continue;
    const at::Tensor now = current(*e.owner, e.local, e.buffer);
    if (!now.defined() || now.unsafeGetTensorImpl() != e.tensor.unsafeGetTensorImpl()) continue;
    at::Tensor memory = memory_of(e.tensor, trained);
    if (memory.numel() * static_cast<int64_t>(memory.element_size()) != e.copy.numel())
      continue;  // resized: flags() reports it, and there is nothing to copy back into
    memory.copy_(e.copy.to(memory.device()).view(memory.scalar_type()).view(memory.sizes()));
  }
}

void StateGuard::check_micro_batch() {
  for (std::string& p : structure()) pending_problems_.push_back(std::move(p));
  for (std::string& p : written_trained()) pending_problems_.push_back(std::move(p));
  std::vector<at::Tensor> now = flags();
  if (pending_.empty()) pending_ = std::move(now);
  else
    for (size_t i = 0; i < now.size(); ++i) pending_[i] = pending_[i].logical_or(now[i]);
  restore_buffers();
}

std::vector<at::Tensor> StateGuard::step_flags() {
  std::vector<at::Tensor> now = flags();
  if (!pending_.empty())
    for (size_t i = 0; i < now.size(); ++i) now[i] = now[i].logical_or(pending_[i]);
  return now;
}

void StateGuard::clear_pending() {
  pending_.clear();
  pending_problems_.clear();
}

namespace {

// The refusal naming `items` (deduplicated, in order), or nullopt when there are none.
std::optional<std::string> refusal_of(std::vector<std::string> items) {
  std::vector<std::string> unique;
  for (std::string& item : items)
    if (std::find(unique.begin(), unique.end(), item) == unique.end())
      unique.push_back(std::move(item));
  if (unique.empty()) return std::nullopt;
  std::string list;
  for (size_t i = 0; i < std::min(unique.size(), kNamed); ++i)
    list += (i ? "; " : "") + unique[i];
  if (unique.size() > kNamed) list += " (and " + std::to_string(unique.size() - kNamed) + " more)";
  return "the model's state changed since the engine took it: " + list +
         ". Buffers and frozen parameters are released with the model without noise and are "
         "read by later steps, so nothing computed from the training data, nor a count of "
         "forward calls (it follows the realised batch sizes), may be written into them, nor "
         "into a trainable parameter outside the step (Note [state written from data], "
         "src/dp/state_guard.h). Compute such a value without the training batch, or keep it "
         "out of the module's state (a local value in the forward); a write that holds nothing "
         "of the training data (a load, a value computed from the released model) is accepted "
         "by name with PrivacyEngine::accept_state_change(names)";
}

}  // namespace

std::optional<std::string> StateGuard::verdict(const std::vector<bool>& read) {
  TORCH_CHECK(read.size() == entries_.size() + trained_memories_.size(),
              "dpzero::dp::StateGuard::verdict: ", read.size(), " flags for ", entries_.size(),
              " state tensors and ", trained_memories_.size(), " trained memories");
  std::vector<std::string> items = std::move(pending_problems_);
  for (std::string& p : structure()) items.push_back(std::move(p));
  for (std::string& p : written_trained()) items.push_back(std::move(p));
  for (size_t i = 0; i < entries_.size(); ++i)
    if (read[i]) items.push_back(describe(entries_[i].buffer, entries_[i].name, *entries_[i].owner));
  for (size_t i = 0; i < trained_memories_.size(); ++i)
    if (read[entries_.size() + i]) items.push_back(written_outside(trained_memories_[i].names));
  restore_buffers();
  clear_pending();
  return refusal_of(std::move(items));
}

std::optional<std::string> StateGuard::release_refusal() const {
  std::vector<std::string> items = structure();
  for (std::string& p : written_trained()) items.push_back(std::move(p));
  const std::vector<at::Tensor> now = flags();
  for (size_t i = 0; i < entries_.size(); ++i)
    if (now[i].item<bool>())
      items.push_back(describe(entries_[i].buffer, entries_[i].name, *entries_[i].owner));
  for (size_t i = 0; i < trained_memories_.size(); ++i)
    if (now[entries_.size() + i].item<bool>())
      items.push_back(written_outside(trained_memories_[i].names));
  return refusal_of(std::move(items));
}

void StateGuard::accept(const std::vector<std::string>& names) {
  if (!names.empty()) {
    std::set<std::string> known;
    for (const Entry& e : walk()) known.insert(e.name);
    for (const Entry& e : entries_) known.insert(e.name);
    std::string unknown;
    for (const std::string& n : names)
      if (!known.count(n)) unknown += (unknown.empty() ? "'" : ", '") + n + "'";
    if (!unknown.empty()) {
      std::string some;
      for (const std::string& k : known) {
        if (some.size() > 60) break;
        some += (some.empty() ? "'" : ", '") + k + "'";
      }
      throw std::invalid_argument(
          "dpzero::dp::PrivacyEngine: accept_state_change: " + unknown +
          " names no buffer or frozen parameter of the model (it has " +
          std::to_string(known.size()) + (known.empty() ? ")" : ": " + some + ", ...)"));
    }
  }
  fix(names);
  if (names.empty()) record_trained();  // a named acceptance takes no trained parameter's write
}

}  // namespace dpzero::dp
