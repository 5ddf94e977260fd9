// src/dp/privacy_engine.cpp — see privacy_engine.h.
#include "src/dp/privacy_engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <utility>

#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/instancenorm.h>
#include <torch/autograd.h>
#include <torch/nn/modules/container/modulelist.h>

#include "accounting/calibrate.h"
#include "privacy/clipping.h"
#include "privacy/entropy.h"
#include "src/dp/modules.h"

namespace dpzero::dp {
namespace {

const char* const kRootUnit = "<root>";

std::string bad(const std::string& what) { return "dpzero::dp::PrivacyEngine: " + what; }

void check_options(const PrivacyOptions& o) {
  auto fail = [](const std::string& what) { throw std::invalid_argument(bad(what)); };
  if (!(o.noise_multiplier >= 0.0) || !std::isfinite(o.noise_multiplier))
    fail("noise_multiplier must be finite and >= 0, got " + std::to_string(o.noise_multiplier));
  if (o.noise_multiplier == 0.0 && !o.allow_no_noise)
    fail(
        "noise_multiplier is 0: the run would not be private (epsilon is infinite); set "
        "allow_no_noise to train without noise");
  if (!(o.max_grad_norm > 0.0) || !std::isfinite(o.max_grad_norm))
    fail("max_grad_norm must be finite and > 0, got " + std::to_string(o.max_grad_norm));
  if (!(o.sample_rate > 0.0 && o.sample_rate <= 1.0))
    fail("sample_rate must be in (0, 1], got " + std::to_string(o.sample_rate));
  if (o.dataset_size <= 0) fail("dataset_size must be > 0, got " + std::to_string(o.dataset_size));
  if (o.max_physical_batch_size < 0)
    fail("max_physical_batch_size must be >= 0 (0: no cap), got " +
         std::to_string(o.max_physical_batch_size));
  if (o.loss_reduction != "mean" && o.loss_reduction != "sum")
    fail("loss_reduction must be \"mean\" or \"sum\", got \"" + o.loss_reduction + "\"");
  if (o.stage == zero::Stage::k3)
    fail(
        "stage 3 gathers each unit in module hooks, which torch::nn modules in C++ lack; use "
        "stages 0-2, or the Python front door (dpzero.make_private) for stage 3");
  if (o.epsilon_budget && !(*o.epsilon_budget > 0.0))
    fail("epsilon_budget must be > 0, got " + std::to_string(*o.epsilon_budget));
  if (o.epsilon_budget && o.noise_multiplier == 0.0)
    fail("epsilon_budget needs noise: noise_multiplier is 0, so epsilon is infinite");
  if (!(o.delta > 0.0 && o.delta < 1.0))
    fail("delta must be in (0, 1), got " + std::to_string(o.delta));
}

// python/dpzero/zero.py's default units: the direct children holding trainable parameters,
// ModuleList / ModuleDict looked through.
void default_units(const std::string& prefix, const torch::nn::Module& module,
                   std::vector<std::string>& out) {
  for (const auto& item : module.named_children()) {
    const std::string name = prefix + item.key();
    const torch::nn::Module& child = *item.value();
    bool trains = false;
    for (const at::Tensor& p : child.parameters()) trains = trains || p.requires_grad();
    if (!trains) continue;
    if (dynamic_cast<const torch::nn::ModuleListImpl*>(&child) ||
        dynamic_cast<const torch::nn::ModuleDictImpl*>(&child)) {
      default_units(name + ".", child, out);
    } else {
      out.push_back(name);
    }
  }
}

// The innermost unit holding parameter `name` (python/dpzero/zero.py's _owner).
std::string owner(const std::string& name, const std::vector<std::string>& units) {
  std::string best = kRootUnit;
  for (const std::string& unit : units) {
    if (name.rfind(unit + ".", 0) == 0 && (best == kRootUnit || unit.size() > best.size()))
      best = unit;
  }
  return best;
}

// Modules that mix the examples of a batch or write what they saw into the model, trainable or
// not (python/dpzero/private/attach.py refuses the same).
void refuse_batch_mixing(const std::string& name, const torch::nn::Module& module) {
  const std::string type = module.name();
  std::string why;
  namespace tnn = torch::nn;
  const bool batch_norm = dynamic_cast<const tnn::BatchNorm1dImpl*>(&module) ||
                          dynamic_cast<const tnn::BatchNorm2dImpl*>(&module) ||
                          dynamic_cast<const tnn::BatchNorm3dImpl*>(&module);
  const bool instance_norm = dynamic_cast<const tnn::InstanceNorm1dImpl*>(&module) ||
                             dynamic_cast<const tnn::InstanceNorm2dImpl*>(&module) ||
                             dynamic_cast<const tnn::InstanceNorm3dImpl*>(&module);
  if (batch_norm || (instance_norm && !module.buffers(false).empty()))
    why =
        "normalises with statistics of the whole batch, or keeps running statistics of the "
        "data that would be released without noise; use LayerNorm (dpzero::dp::nn::LayerNorm)";
  if (const auto* e = dynamic_cast<const torch::nn::EmbeddingImpl*>(&module);
      e && e->options.max_norm())
    why =
        "has max_norm, so its forward renormalises the table in place from the data; drop "
        "max_norm";
  if (!why.empty()) throw std::invalid_argument(bad("module '" + name + "' (" + type + ") " + why));
}

// A 63-bit seed from the OS (python/dpzero/noise.py draws secrets.randbits(63)).
uint64_t random_seed() {
  std::random_device device;
  const uint64_t hi = device(), lo = device();
  return ((hi << 32) | lo) & ((uint64_t{1} << 63) - 1);
}

int64_t bits_of(double x) {
  int64_t b = 0;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

}  // namespace

at::Tensor MicroBatch::indices() const {
  return at::tensor(rows, at::TensorOptions().dtype(at::kLong));
}

PrivacyEngine::PrivacyEngine(std::shared_ptr<torch::nn::Module> model, PrivacyOptions options,
                             c10::intrusive_ptr<c10d::ProcessGroup> process_group)
    : model_(std::move(model)), options_(std::move(options)) {
  TORCH_CHECK(model_, bad("model is null"));
  check_options(options_);
  if (process_group) {
    rank_ = process_group->getRank();
    world_size_ = process_group->getSize();
  }

  // The trained parameters in named_parameters() order, tied ones once: global coordinates.
  std::map<const void*, size_t> index_of;  // TensorImpl -> params_ index
  std::vector<std::string> units;
  default_units("", *model_, units);
  int64_t total = 0;
  for (const auto& item : model_->named_parameters()) {
    const at::Tensor& p = item.value();
    if (!p.requires_grad() || index_of.count(p.unsafeGetTensorImpl())) continue;
    if (p.scalar_type() != at::kFloat)
      throw std::invalid_argument(bad("trainable parameter '" + item.key() + "' is " +
                                      std::string(c10::toString(p.scalar_type())) +
                                      "; trainable parameters must be float32"));
    index_of[p.unsafeGetTensorImpl()] = params_.size();
    params_.push_back(Param{item.key(), p, total});
    total += p.numel();
  }
  if (params_.empty()) throw std::invalid_argument(bad("the model has no trainable parameters"));
  for (const Param& p : params_) trained_.insert(p.tensor.unsafeGetTensorImpl());

  // The DP modules, and every trainable parameter inside one of them.
  struct Found {
    std::string name;
    DPModule* module;
    Trainable train;
  };
  std::vector<Found> found;
  std::set<const void*> covered;
  for (const auto& item : model_->named_modules("", /*include_self=*/true)) {
    torch::nn::Module& module = *item.value();
    const std::string name = item.key().empty() ? "<model>" : item.key();
    auto* dp = dynamic_cast<DPModule*>(&module);
    refuse_batch_mixing(name, module);
    bool own_trainable = false;
    for (const at::Tensor& p : module.parameters(/*recurse=*/false))
      own_trainable = own_trainable || p.requires_grad();
    if (!own_trainable) continue;
    if (!dp)
      throw std::invalid_argument(
          bad("module '" + name + "' (" + module.name() +
              ") holds trainable parameters but is not a DP module, so its gradient could not be "
              "clipped; build it from dpzero::dp::nn (Linear, Embedding, LayerNorm) or freeze its "
              "parameters (requires_grad_(false))"));
    if (dp->taken())
      throw std::invalid_argument(
          bad("DP module '" + name + "' is held by another PrivacyEngine; one engine per model"));
    Trainable train;
    for (const at::Tensor& p : dp->dp_parameters()) {
      train.push_back(p.defined() && p.requires_grad());
      if (train.back()) covered.insert(p.unsafeGetTensorImpl());
    }
    found.push_back(Found{name, dp, std::move(train)});
  }
  for (const Param& p : params_)
    if (!covered.count(p.tensor.unsafeGetTensorImpl()))
      throw std::invalid_argument(bad("trainable parameter '" + p.name +
                                      "' is registered in a DP module but is not one of the "
                                      "parameters it clips (dp_parameters()); freeze it or move "
                                      "it into a DP module of its own"));

  // The ZeRO state: units in plan order (by first global coordinate), private gradients only.
  std::map<std::string, std::vector<size_t>> members;
  std::vector<std::string> order;
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string unit = owner(params_[i].name, units);
    if (!members.count(unit)) order.push_back(unit);
    members[unit].push_back(i);
  }
  std::vector<zero::UnitSpec> specs;
  for (size_t u = 0; u < order.size(); ++u) {
    zero::UnitSpec spec{order[u], {}, {}, {}};
    for (size_t i : members[order[u]]) {
      params_[i].unit = static_cast<int64_t>(u);
      spec.params.push_back(params_[i].tensor);
      spec.param_names.push_back(params_[i].name);
      spec.global_offsets.push_back(params_[i].global);
    }
    specs.push_back(std::move(spec));
  }
  zero::ZeroConfig config;
  config.stage = options_.stage;
  config.optimizer = options_.optimizer;
  config.grad_scale = 1.0;  // the step scales by 1 / (q·N)
  zero_ = std::make_unique<zero::ZeroState>(std::move(specs), total, config, process_group);
  zero_->set_private(true);  // Note [private gradients] in src/zero/unit.h

  // Where each parameter's gradient goes: its slot in its unit's flat buffer.
  std::vector<int64_t> unit_numel;
  std::vector<at::Device> unit_device;
  for (int64_t u = 0; u < zero_->num_units(); ++u) {
    const zero::UnitLayout& layout = zero_->unit_at(u).flat().layout();
    unit_numel.push_back(layout.padded_numel());
    unit_device.push_back(params_[members[order[u]].front()].tensor.device());
    const std::vector<size_t>& in_unit = members[order[u]];
    for (size_t k = 0; k < in_unit.size(); ++k)
      params_[in_unit[k]].offset = layout.flat_offsets()[k];
  }
  auto slot_of = [&](const at::Tensor& p) -> std::optional<Slot> {
    if (!p.defined() || !p.requires_grad()) return std::nullopt;
    const Param& q = params_[index_of.at(p.unsafeGetTensorImpl())];
    return Slot{q.unit, q.offset, q.tensor.numel(), q.tensor.sizes().vec()};
  };

  // The book: flat clipping, one group; layers sharing a parameter form one component.
  std::vector<BookLayer> layers;
  std::map<const void*, int64_t> component_of;  // parameter -> component
  int64_t components = 0;
  for (const Found& f : found) {
    BookLayer layer{f.name, f.module->book_ops(f.train), {}, -1, 0};
    for (const at::Tensor& p : f.module->dp_parameters()) {
      layer.slots.push_back(slot_of(p));
      if (layer.slots.back() && component_of.count(p.unsafeGetTensorImpl()))
        layer.component = component_of[p.unsafeGetTensorImpl()];
    }
    if (layer.component < 0) layer.component = components++;
    for (const at::Tensor& p : f.module->dp_parameters()) {
      if (!p.defined() || !p.requires_grad()) continue;
      auto [it, fresh] = component_of.emplace(p.unsafeGetTensorImpl(), layer.component);
      // Note: a layer whose parameters belong to two components already formed would need a
      // union of them; the modules here hold one shared parameter at most (a tied weight).
      if (!fresh && it->second != layer.component)
        throw std::invalid_argument(bad("DP module '" + f.name +
                                        "' shares parameters with two other modules that share "
                                        "none with each other; this is not supported"));
    }
    layers.push_back(std::move(layer));
  }
  BookOptions book_options;
  book_options.thresholds = {privacy::threshold_f32(options_.max_grad_norm)};
  book_options.group_components = {components};
  book_options.mean_loss = options_.loss_reduction == "mean";
  book_options.unit_numel = unit_numel;
  book_options.unit_device = unit_device;
  session_ = std::make_shared<EngineSession>();
  session_->book = std::make_shared<Book>(std::move(layers), book_options, *zero_);
  session_->book->set_queue_finish(true);
  // The ledger (rank 0), the charges it already holds, and the budget.
  agree_on_settings();
  zero::NoiseKey key;
  if (secure_) {
    key.secure = true;
    key.key.assign(key_.w, key_.w + 8);
    sampler_.secure = true;
    sampler_.key = key_;
  } else {
    key.seed = static_cast<int64_t>(seed_);
    sampler_.seed = seed_;
  }
  int64_t charges = 0;
  std::string failure;
  if (rank_ == 0 && !options_.ledger_path.empty()) {
    try {
      const std::string& path = options_.ledger_path;
      if (std::filesystem::exists(path)) {
        // A given run id must be the ledger's, as Python's front door checks it.
        ledger_ = std::make_shared<accounting::Ledger>(
            accounting::Ledger::open(path, accounting::TornTailPolicy::kError, options_.run_id));
        if (ledger_->header().dataset_size != options_.dataset_size)
          throw std::invalid_argument(bad("ledger " + path + " is for a dataset of " +
                                          std::to_string(ledger_->header().dataset_size) +
                                          " examples, this run has " +
                                          std::to_string(options_.dataset_size) +
                                          ": it holds another run's charges. Give this run its "
                                          "own ledger path, or continue that run with its "
                                          "dataset"));
        for (const accounting::Phase& ph : ledger_->phases())
          if (ph.q != options_.sample_rate || ph.sigma != options_.noise_multiplier)
            throw std::invalid_argument(
                bad("ledger " + path + " holds steps at other sigma or q than this run's; "
                    "give this run its own ledger path"));
        charges = ledger_->total_steps();
      } else {
        accounting::LedgerHeader header;
        header.run_id = options_.run_id.empty() ? std::filesystem::path(path).filename().string()
                                                : options_.run_id;
        header.dataset_size = options_.dataset_size;
        header.settings = {{"accountant", "rdp"},
                           {"clipping", "flat"},
                           {"secure_mode", secure_},
                           {"world_size", world_size_},
                           {"front_door", "c++"}};
        ledger_ = std::make_shared<accounting::Ledger>(accounting::Ledger::create(path, header));
      }
    } catch (const std::exception& e) {
      failure = e.what();
      ledger_.reset();
    }
  }
  const std::vector<int64_t> agreed =
      zero_->comm().all_reduce_sum(std::vector<int64_t>{failure.empty() ? 0 : 1, charges});
  if (agreed[0] != 0) {
    if (!failure.empty()) throw accounting::LedgerError(failure);
    throw accounting::LedgerError("rank 0 could not open the privacy ledger " +
                                  options_.ledger_path + "; see its error");
  }
  charges = agreed[1];                                 // rank 0's
  if (charges > 0 && options_.noise_multiplier > 0.0)  // σ = 0: ε is infinite anyway
    accountant_->step(options_.sample_rate, options_.noise_multiplier, charges);

  StepSettings settings;
  settings.noise_multiplier = options_.noise_multiplier;
  settings.max_grad_norm = options_.max_grad_norm;
  settings.sample_rate = options_.sample_rate;
  settings.dataset_size = options_.dataset_size;
  if (options_.epsilon_budget) {
    settings.max_steps = accounting::steps_for_epsilon(
        *options_.epsilon_budget, options_.delta, options_.sample_rate, options_.noise_multiplier);
    settings.budget = "epsilon=" + std::to_string(*options_.epsilon_budget) +
                      " at delta=" + std::to_string(options_.delta) + " (rdp)";
  }
  settings.noise_key = key;
  step_ = std::make_unique<PrivateStep>(
      session_->book, *zero_, ledger_, settings, accountant_, charges);
  next_step_ = charges;  // Note [noise index]: never a step already charged

  // Last, once nothing can fail: the DP modules register with this engine's book, and every
  // trained parameter gets its escape hook.
  for (size_t l = 0; l < found.size(); ++l)
    found[l].module->bind(session_, static_cast<int64_t>(l), found[l].name);

  // A gradient autograd gives a trained parameter escaped its DP module (the parameter was used
  // outside it): it would be unclipped. The hook records the violation and stops the backward.
  for (const Param& p : params_) {
    std::weak_ptr<EngineSession> weak = session_;
    at::Tensor t = p.tensor;
    const unsigned handle = t.register_hook([weak, name = p.name](const at::Tensor& grad) {
      if (!grad.defined()) return grad;
      const std::string why = "parameter '" + name +
                              "' received a gradient from autograd: it is used outside its DP "
                              "module, so that gradient would escape clipping";
      if (auto session = weak.lock())
        if (!session->book->error()) session->book->set_error(why);  // the first one stands
      try {
        throw PrivacyError(why);
      } catch (const PrivacyError& e) {
        rethrow_from_engine(e);  // Note [errors out of the autograd engine] in book.h
      }
    });
    hooks_.emplace_back(t, handle);
  }
}

// Every rank must draw the same noise and the same batches (rank 0's seed; a seed given on
// several ranks must be one value, as in python/dpzero/private/engine.py), and clip, sample,
// scale and budget alike: rank 0's settings are broadcast and any rank's difference refuses the
// engine on every rank.
void PrivacyEngine::agree_on_settings() {
  const PrivacyOptions& o = options_;
  std::string own_error;  // raised on every rank, after the agreement
  bool secure = false;
  try {
    secure = privacy::secure_noise(
        o.secure_mode, o.seed ? std::optional<std::string>(std::to_string(*o.seed)) : std::nullopt);
  } catch (const std::invalid_argument& e) {
    own_error = e.what();
  }
  const uint64_t seed = o.seed ? *o.seed : random_seed();
  const std::vector<int64_t> mine{static_cast<int64_t>(seed),
                                  bits_of(o.noise_multiplier),
                                  bits_of(o.max_grad_norm),
                                  bits_of(o.sample_rate),
                                  o.dataset_size,
                                  o.max_physical_batch_size,
                                  o.loss_reduction == "mean",
                                  static_cast<int64_t>(o.stage),
                                  o.epsilon_budget.has_value(),
                                  bits_of(o.epsilon_budget.value_or(0.0)),
                                  bits_of(o.delta),
                                  bits_of(o.optimizer.lr),
                                  o.trust_batch_first,
                                  secure};
  const comm::Collectives& comm = zero_->comm();
  const std::vector<int64_t> first = comm.broadcast(mine, 0);
  std::string differs;
  if (o.seed && first[0] != mine[0]) differs = "seed (this rank " + std::to_string(*o.seed) + ")";
  static const char* const kNames[] = {"seed",
                                       "noise_multiplier",
                                       "max_grad_norm",
                                       "sample_rate",
                                       "dataset_size",
                                       "max_physical_batch_size",
                                       "loss_reduction",
                                       "stage",
                                       "epsilon_budget",
                                       "epsilon_budget",
                                       "delta",
                                       "optimizer.lr",
                                       "trust_batch_first",
                                       "secure_mode"};
  for (size_t i = 1; i < mine.size() && differs.empty(); ++i)
    if (first[i] != mine[i]) differs = kNames[i];
  if (comm.all_reduce_sum(
          std::vector<int64_t>{differs.empty() && own_error.empty() ? 0 : 1})[0] != 0) {
    if (!own_error.empty()) throw std::invalid_argument(bad(own_error));
    throw std::invalid_argument(
        bad(differs.empty() ? "another rank's options differ from rank 0's; every rank must pass "
                              "the same PrivacyOptions"
                            : "this rank's " + differs +
                                  " differs from rank 0's; every rank must "
                                  "pass the same PrivacyOptions"));
  }
  seed_ = static_cast<uint64_t>(first[0]);
  secure_ = secure;
  if (secure_) {  // rank 0's key, on every rank (Note [secure by default])
    std::vector<int64_t> words(8, 0);
    if (rank_ == 0) {
      const privacy::ChaCha20Key drawn = privacy::entropy_key();
      words.assign(drawn.w, drawn.w + 8);
    }
    words = comm.broadcast(words, 0);
    for (int i = 0; i < 8; ++i) key_.w[i] = static_cast<uint32_t>(words[i]);
  }
}

PrivacyEngine::~PrivacyEngine() {
  // The model trains as a plain one again: the DP modules' session expires with session_, and
  // the parameters lose their escape hooks.
  for (auto& [tensor, handle] : hooks_) tensor.remove_hook(handle);
  session_.reset();
}

void PrivacyEngine::check_batch_first(
    const std::function<at::Tensor(const at::Tensor& rows)>& loss_of) {
  if (current_ || session_->book->open() || session_->book->micro_batches() > 0)
    throw std::logic_error(
        bad("check_batch_first: a logical batch is accumulated; call it "
            "between steps"));
  // P = 3 examples (fewer in a smaller dataset); rows 1.. are where a mix would show. The
  // second run replaces example 0 by example P.
  const int64_t p = std::min<int64_t>(3, options_.dataset_size);
  const auto fail = [](const std::string& why) {
    throw PrivacyError("check_batch_first: " + why +
                       "; write the model batch-first, without ops across examples (Note [C++ "
                       "batch dimension] in src/dp/modules.h)");
  };
  const auto run = [&](const at::Tensor& rows) {
    session_->probing = true;
    session_->probe_calls.clear();
    at::Tensor losses;
    try {
      losses = loss_of(rows);
    } catch (...) {
      session_->probing = false;
      session_->probe_calls.clear();
      throw;
    }
    session_->probing = false;
    std::vector<EngineSession::ProbeCall> calls = std::move(session_->probe_calls);
    session_->probe_calls.clear();
    if (!losses.defined() || losses.dim() != 1 || losses.size(0) != p)
      throw std::invalid_argument(
          bad("check_batch_first: loss_of(rows) must return one loss per example, [" +
              std::to_string(p) + "] (reduction none), got " +
              (losses.defined() ? c10::str(losses.sizes()) : std::string("an undefined tensor"))));
    for (const auto& call : calls)
      if (call.output.dim() == 0 || call.output.size(0) != p || call.input.dim() == 0 ||
          call.input.size(0) != p)
        fail("DP layer '" + call.layer + "' was called with an input of shape " +
             c10::str(call.input.sizes()) + " for " + std::to_string(p) +
             " examples: its dim 0 does not hold the examples");
    return std::make_pair(losses, std::move(calls));
  };
  // Both runs draw the same random numbers (dropout masks equal row for row), and training
  // draws afterwards as if the check had not run: each device's generator is restored.
  std::vector<std::pair<at::Generator, at::Tensor>> generators;
  std::vector<at::Device> devices{at::Device(at::kCPU)};
  for (const Param& q : params_)
    if (std::find(devices.begin(), devices.end(), q.tensor.device()) == devices.end())
      devices.push_back(q.tensor.device());
  for (const at::Device& d : devices) {
    at::Generator g = at::globalContext().defaultGenerator(d);
    generators.emplace_back(g, g.get_state());
  }
  const auto rewind = [&] {
    for (auto& [g, state] : generators) g.set_state(state);
  };
  const at::Tensor rows = at::arange(p, at::TensorOptions().dtype(at::kLong));
  auto [losses, calls] = run(rows);
  rewind();

  // Rows of t other than row j.
  const auto others = [&](const at::Tensor& t, int64_t j) {
    std::vector<int64_t> keep;
    for (int64_t r = 0; r < p; ++r)
      if (r != j) keep.push_back(r);
    return t.detach().index_select(0, at::tensor(keep, at::TensorOptions().dtype(at::kLong)));
  };
  const auto row = [](const at::Tensor& t, int64_t j) { return t.detach().select(0, j); };

  // 1. Each example j replaced in turn by another example k: every call's rows other than j
  // are unchanged. A k equal to example j (duplicate data) changes nothing and tests nothing:
  // the next k is tried.
  const int64_t n = options_.dataset_size;
  if (n <= p)
    fail("the dataset has " + std::to_string(n) + " examples; the check needs at least " +
         std::to_string(p + 1) + " (or set PrivacyOptions::trust_batch_first)");
  for (int64_t j = 0; j < p; ++j) {
    bool tested = false;
    for (int64_t k = p; k < std::min<int64_t>(n, p + 8) && !tested; ++k) {
      at::Tensor other = rows.clone();
      other[j] = k;
      const auto [unused, again] = run(other);
      rewind();
      if (again.size() != calls.size())
        fail("the model made " + std::to_string(calls.size()) + " and then " +
             std::to_string(again.size()) + " DP layer calls for two batches of " +
             std::to_string(p) + " examples");
      for (size_t c = 0; c < calls.size(); ++c)
        if (again[c].layer != calls[c].layer || again[c].output.sizes() != calls[c].output.sizes())
          fail("the model's DP layer calls differ between two batches of " + std::to_string(p) +
               " examples (call " + std::to_string(c) + ": '" + calls[c].layer + "' " +
               c10::str(calls[c].output.sizes()) + ", then '" + again[c].layer + "' " +
               c10::str(again[c].output.sizes()) + ")");
      for (size_t c = 0; c < calls.size() && !tested; ++c)
        tested = !torch::equal(row(calls[c].input, j), row(again[c].input, j)) ||
                 !torch::equal(row(calls[c].output, j), row(again[c].output, j));
      if (!tested) continue;
      for (size_t c = 0; c < calls.size(); ++c)
        if (!torch::equal(others(calls[c].input, j), others(again[c].input, j)) ||
            !torch::equal(others(calls[c].output, j), others(again[c].output, j)))
          fail("DP layer '" + calls[c].layer + "': changing example " + std::to_string(j) +
               " changed other rows of its input or output " + c10::str(calls[c].output.sizes()) +
               ", so its rows mix examples and would be clipped instead of examples");
    }
    if (!tested)
      fail("could not test example " + std::to_string(j) + ": replacing it by each of examples " +
           std::to_string(p) + ".." + std::to_string(std::min<int64_t>(n, p + 8) - 1) +
           " changed no DP layer's row " + std::to_string(j));
  }

  // 2. Each example's loss alone reaches its own row of every DP output, and no other row.
  std::vector<at::Tensor> outputs;
  std::vector<std::string> names;
  for (const auto& call : calls) {
    if (!call.output.requires_grad()) continue;
    outputs.push_back(call.output);
    names.push_back(call.layer);
  }
  if (outputs.empty() || !losses.requires_grad())
    fail(
        "no gradient reaches a DP layer: loss_of(rows) must run this engine's model with "
        "gradients on");
  bool reached = false;
  for (int64_t i = 0; i < p; ++i) {
    const std::vector<at::Tensor> grads =
        torch::autograd::grad({losses[i]}, outputs, {}, /*retain_graph=*/i + 1 < p,
                              /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t k = 0; k < grads.size(); ++k) {
      const at::Tensor& g = grads[k];
      if (!g.defined()) continue;
      reached = reached || row(g, i).ne(0).any().item<bool>();
      if (others(g, i).ne(0).any().item<bool>())
        fail("the loss of example " + std::to_string(i) + " reaches other rows of DP layer '" +
             names[k] + "''s output " + c10::str(g.sizes()) +
             ": its dim 0 does not hold one example per row (a sequence-first layout, or an op "
             "across the examples after it), so its rows would be clipped instead of examples");
    }
  }
  if (!reached)
    fail(
        "the examples' losses reached no DP layer's output; loss_of(rows) must run this "
        "engine's model on those rows");
  batch_first_checked_ = true;
}

std::vector<MicroBatch> PrivacyEngine::sample() {
  if (current_ || session_->book->micro_batches() > 0 || session_->book->open())
    throw std::logic_error(
        bad("sample(): the logical batch handed out last is accumulated but "
            "not stepped; call step() (or zero_grad() to drop it) first"));
  const int64_t t = next_step_;
  const int64_t cap = options_.max_physical_batch_size > 0 ? options_.max_physical_batch_size
                                                           : options_.dataset_size;
  const privacy::MicroBatchSchedule schedule =
      privacy::poisson_micro_batches(sampler_, static_cast<uint32_t>(t), options_.dataset_size,
                                     options_.sample_rate, rank_, world_size_, cap);
  std::vector<MicroBatch> out;
  const int64_t count = static_cast<int64_t>(schedule.micro_batches.size());
  for (int64_t i = 0; i < count; ++i) {
    MicroBatch mb{t, i, count, schedule.logical_batch_size, schedule.micro_batches[i], false};
    if (mb.rows.empty()) {  // Note [padding batches]: one real row whose gradient is zeroed
      mb.rows = {0};
      mb.padding = true;
    }
    out.push_back(std::move(mb));
  }
  schedule_ = out;
  return out;
}

void PrivacyEngine::hand_out(const MicroBatch& micro) {
  if (current_ && caller_sampled_)
    throw std::logic_error(
        bad("hand_out: a logical batch from own_batch is accumulated; call "
            "step() or zero_grad() first"));
  const bool first = !current_;
  if (!first && (micro.step != current_->step || micro.index != handed_))
    throw std::logic_error(bad("hand_out: micro-batch " + std::to_string(micro.index) +
                               " of step " + std::to_string(micro.step) +
                               " is out of order; "
                               "expected micro-batch " +
                               std::to_string(handed_) + " of step " +
                               std::to_string(current_->step)));
  if (first && (micro.step != next_step_ || micro.index != 0))
    throw std::logic_error(bad("hand_out: micro-batch " + std::to_string(micro.index) +
                               " of step " + std::to_string(micro.step) +
                               " is not the first of the next step " + std::to_string(next_step_) +
                               "; hand out what sample() returned, in order"));
  // What is handed out is what the sampler drew, field for field (a changed copy would release
  // rows the step was not sampled with, or skip micro-batches).
  const size_t i = static_cast<size_t>(micro.index);
  const bool drawn = i < schedule_.size() && schedule_[i].step == micro.step &&
                     schedule_[i].count == micro.count && schedule_[i].rows == micro.rows &&
                     schedule_[i].padding == micro.padding &&
                     schedule_[i].logical_size == micro.logical_size;
  if (!drawn)
    throw std::invalid_argument(bad("hand_out: micro-batch " + std::to_string(micro.index) +
                                    " of step " + std::to_string(micro.step) +
                                    " is not what sample() returned; hand out its micro-batches "
                                    "unchanged"));
  current_ = micro;
  ++handed_;
  caller_sampled_ = false;
  Book& book = *session_->book;
  book.set_padding(micro.padding);
  book.set_expected_rows(static_cast<int64_t>(micro.rows.size()));
  session_->handed_out = true;
}

void PrivacyEngine::own_batch(int64_t rows, int64_t logical_size) {
  if (rows < 1 || logical_size < 0 || logical_size > options_.dataset_size)
    throw std::invalid_argument(bad("own_batch: rows must be >= 1 and logical_size in [0, " +
                                    std::to_string(options_.dataset_size) +
                                    "], got rows=" + std::to_string(rows) +
                                    ", logical_size=" + std::to_string(logical_size)));
  if (current_ && !caller_sampled_)
    throw std::logic_error(
        bad("own_batch: a logical batch from sample() is accumulated; call "
            "step() or zero_grad() first"));
  if (current_ && current_->logical_size != logical_size)
    throw std::invalid_argument(bad("own_batch: logical_size " + std::to_string(logical_size) +
                                    " differs from this logical batch's " +
                                    std::to_string(current_->logical_size)));
  MicroBatch mb{next_step_, handed_, 0, logical_size, {}, false};
  current_ = mb;
  ++handed_;
  caller_sampled_ = true;
  session_->book->set_padding(false);
  session_->book->set_expected_rows(rows);
  session_->handed_out = true;
}

StepOutcome PrivacyEngine::step() {
  if (!current_)
    throw std::logic_error(
        bad("step() without a micro-batch since the last step: hand out the "
            "micro-batches of sample() (or own_batch) first"));
  StepRequest request;
  request.step = current_->step;
  request.logical_size = current_->logical_size;
  request.caller_sampled = caller_sampled_;
  if (!caller_sampled_ && handed_ < current_->count)
    request.refusal = "step(): " + std::to_string(handed_) + " of the " +
                      std::to_string(current_->count) + " micro-batches of logical step " +
                      std::to_string(current_->step) + " were handed out; a step takes them all";
  if (session_->book->micro_batches() < handed_ && !request.refusal)
    request.refusal = "step(): " + std::to_string(handed_) + " micro-batches were handed out but " +
                      std::to_string(session_->book->micro_batches()) +
                      " back-propagated; every micro-batch's backward must run before the step";
  if (!batch_first_checked_ && !options_.trust_batch_first && !request.refusal)
    request.refusal =
        "step(): the model's batch-first layout was not checked; call check_batch_first() once "
        "before training (Note [C++ batch dimension] in src/dp/modules.h), or set "
        "PrivacyOptions::trust_batch_first";
  // The trained set may not change: a parameter made trainable since would never be clipped.
  std::set<const void*> now;  // trained_ is the set when the engine took the model
  for (const at::Tensor& p : model_->parameters())
    if (p.requires_grad()) now.insert(p.unsafeGetTensorImpl());
  if (now != trained_ && !request.refusal)
    request.refusal =
        "step(): the model's trainable parameters changed since the PrivacyEngine "
        "took it; its clipping covers the parameters trainable then. Build a new "
        "engine for the new set";
  const int64_t t = current_->step;
  StepOutcome out;
  try {
    out = step_->take(request);
  } catch (...) {
    close_logical_batch();
    next_step_ = std::max(next_step_, step_->charges());  // a charged step's draw is used
    throw;
  }
  close_logical_batch();
  next_step_ = std::max(t + 1, step_->charges());
  return out;
}

void PrivacyEngine::zero_grad() {
  close_logical_batch();
  step_->drop_batch();
  session_->book->set_error(std::nullopt);
  session_->book->set_stale(false);
}

void PrivacyEngine::close_logical_batch() {
  current_.reset();
  handed_ = 0;
  caller_sampled_ = false;
  session_->handed_out = false;
  session_->book->set_padding(false);
  session_->book->set_expected_rows(std::nullopt);
}

double PrivacyEngine::epsilon(double delta) const {
  if (charges() == 0) return 0.0;
  if (options_.noise_multiplier == 0.0) return INFINITY;
  return accountant_->epsilon(delta).epsilon;
}

at::Tensor PrivacyEngine::parameter(const std::string& name) {
  for (const Param& p : params_) {
    if (p.name != name) continue;
    return zero_->full_parameters(p.unit)
        .narrow(0, p.offset, p.tensor.numel())
        .view(p.tensor.sizes());
  }
  throw std::invalid_argument(bad("parameter(): no trained parameter named '" + name + "'"));
}

}  // namespace dpzero::dp
