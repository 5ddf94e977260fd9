// src/dp/privacy_engine.cpp — see privacy_engine.h.
#include "src/dp/privacy_engine.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <stdexcept>
#include <utility>

#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/instancenorm.h>
#include <torch/autograd.h>
#include <torch/nn/modules/container/modulelist.h>

#include "privacy/clipping.h"
#include "src/comm/collectives.h"
#include "src/dp/modules.h"
#include "src/dp/run.h"
#include "src/zero/default_units.h"

namespace dpzero::dp {
namespace {

std::string bad(const std::string& what) { return "dpzero::dp::PrivacyEngine: " + what; }


// What only this front door refuses (run.h checks the rest, for both).
void check_options(const PrivacyOptions& o) {
  if (o.zero_stage == 3)
    throw std::invalid_argument(bad(
        "zero_stage 3 gathers each unit in module hooks, which torch::nn modules in C++ lack; "
        "use stages 0-2, or the Python front door (dpzero.make_private) for stage 3"));
  if (o.clipping != "flat")
    throw std::invalid_argument(bad("clipping '" + o.clipping +
                                    "': the C++ front door clips flat; use clipping \"flat\", "
                                    "or the Python front door for per-layer, group or automatic "
                                    "clipping"));
}

// This door's walk of the module tree for Note [default units] (src/zero/default_units.h):
// every module below `module` in pre-order; ModuleList and ModuleDict are containers.
void walk_modules(const torch::nn::Module& module, int64_t depth, const std::string& prefix,
                  std::vector<zero::ModuleNode>& out) {
  for (const auto& item : module.named_children()) {
    const torch::nn::Module& child = *item.value();
    bool trains = false;
    for (const at::Tensor& p : child.parameters()) trains = trains || p.requires_grad();
    const bool container = dynamic_cast<const torch::nn::ModuleListImpl*>(&child) ||
                           dynamic_cast<const torch::nn::ModuleDictImpl*>(&child);
    out.push_back(zero::ModuleNode{prefix + item.key(), depth, trains, container});
    walk_modules(child, depth + 1, prefix + item.key() + ".", out);
  }
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

}  // namespace

at::Tensor MicroBatch::indices() const {
  return at::tensor(rows, at::TensorOptions().dtype(at::kLong));
}

PrivacyEngine::PrivacyEngine(std::shared_ptr<torch::nn::Module> model, PrivacyOptions options,
                             c10::intrusive_ptr<c10d::ProcessGroup> process_group)
    : model_(std::move(model)), options_(std::move(options)) {
  TORCH_CHECK(model_, bad("model is null"));
  check_options(options_);
  const RunSettings& settings = options_;  // the shared part
  check_run_settings(settings);  // start_run checks again, agreed; this refuses before any change
  if (process_group) {
    rank_ = process_group->getRank();
    world_size_ = process_group->getSize();
  }

  // The trained parameters in named_parameters() order, tied ones once: global coordinates.
  std::map<const void*, size_t> index_of;  // TensorImpl -> params_ index
  std::vector<zero::ModuleNode> walk;
  walk_modules(*model_, 1, "", walk);
  const std::vector<std::string> units = zero::default_units(walk);
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

  // The run's rules, on every rank (Note [one set of rules] in run.h): the agreement, the
  // randomness, the ledger with the charges it holds, the budget.
  accountant_ = accounting::make_accountant(accounting::parse_accountant_kind(settings.accountant));
  const RunStart run = start_run(settings,
                                 {agreed("optimizer.lr", options_.optimizer.lr),
                                  agreed("trust_batch_first", options_.trust_batch_first)},
                                 comm::Collectives(process_group), *accountant_);
  ledger_ = run.ledger;
  secure_ = run.secure;
  seed_ = run.seed;
  sampler_.secure = run.secure;
  if (run.secure) sampler_.key = run.key;
  else sampler_.seed = run.seed;

  // The ZeRO state: units in plan order (by first global coordinate), private gradients only.
  std::map<std::string, std::vector<size_t>> members;
  std::vector<std::string> order;
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string unit = zero::owner_unit(params_[i].name, units);
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
  config.stage = static_cast<zero::Stage>(options_.zero_stage);
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

  // The book: flat clipping, one group; layers sharing a parameter form one component (run.h).
  std::vector<std::vector<int64_t>> shared(found.size());
  for (size_t l = 0; l < found.size(); ++l)
    for (const at::Tensor& p : found[l].module->dp_parameters())
      if (p.defined() && p.requires_grad())
        shared[l].push_back(reinterpret_cast<int64_t>(p.unsafeGetTensorImpl()));
  const std::vector<int64_t> component = layer_components(shared);
  const int64_t components =
      component.empty() ? 0 : *std::max_element(component.begin(), component.end()) + 1;
  std::vector<BookLayer> layers;
  for (size_t l = 0; l < found.size(); ++l) {
    BookLayer layer{found[l].name, found[l].module->book_ops(found[l].train), {}, component[l],
                    0};
    for (const at::Tensor& p : found[l].module->dp_parameters()) layer.slots.push_back(slot_of(p));
    layers.push_back(std::move(layer));
  }
  BookOptions book_options;
  book_options.thresholds = {std::isfinite(options_.max_grad_norm)
                                 ? privacy::threshold_f32(options_.max_grad_norm)
                                 : options_.max_grad_norm};
  book_options.group_components = {components};
  book_options.mean_loss = options_.loss_reduction == "mean";
  book_options.unit_numel = unit_numel;
  book_options.unit_device = unit_device;
  session_ = std::make_shared<EngineSession>();
  session_->book = std::make_shared<Book>(std::move(layers), book_options, *zero_);
  session_->book->set_queue_finish(true);
  step_ = std::make_unique<PrivateStep>(session_->book, *zero_, run.ledger,
                                        run.step_settings(settings), accountant_, run.charges,
                                        run.rows);
  next_step_ = run.first_step();  // Note [noise index]: never a step already charged

  // The model's state as it is now, after the broadcast (Note [state written from data]).
  std::vector<std::pair<std::string, at::Tensor>> trained;
  for (const Param& p : params_) trained.emplace_back(p.name, p.tensor);
  state_ = std::make_unique<StateGuard>(model_, std::move(trained));

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
  // ... and the model's buffers are put back after each run: the check's forwards on the
  // dataset's examples leave no trace in its state.
  const auto rewind = [&] {
    for (auto& [g, state] : generators) g.set_state(state);
    state_->restore_buffers();
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
  const int64_t cap = options_.max_physical_batch_size.value_or(options_.dataset_size);
  const privacy::MicroBatchSchedule schedule =
      privacy::poisson_micro_batches(sampler_, static_cast<uint32_t>(t), options_.dataset_size,
                                     options_.sample_rate, rank_, world_size_, cap,
                                     options_.bands);
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
  // What earlier forwards wrote, put back and noted for the step: the earlier micro-batches', and
  // before the first one whatever ran between the logical batches (an evaluation forward on
  // training rows, which this batch's forward could read and clear).
  state_->check_micro_batch();
  reseed_generators(DrawPurpose::kForward, micro.step, micro.index);
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
  state_->check_micro_batch();  // as hand_out does
  reseed_generators(DrawPurpose::kForward, next_step_, handed_);
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
  if (!request.refusal) {  // Note [trained set] (run.h)
    std::vector<std::pair<std::string, at::Tensor>> now;
    for (const auto& item : model_->named_parameters()) now.emplace_back(item.key(), item.value());
    std::vector<at::Tensor> trained;  // params_: the tensors trainable when the engine took it
    for (const Param& p : params_) trained.push_back(p.tensor);
    request.refusal = trained_set_refusal(trained, now);
  }
  {  // Note [state written from data]: always, as it puts the buffers back; the step's one read
    std::vector<bool> flags;
    for (const std::vector<bool>& f : session_->book->read_checks(state_->step_flags()))
      flags.insert(flags.end(), f.begin(), f.end());
    std::optional<std::string> changed = state_->verdict(flags);
    if (!request.refusal) request.refusal = std::move(changed);
  }
  const int64_t t = current_->step;
  const int64_t charged = step_->charges();
  StepOutcome out;
  try {
    out = step_->take(request);
  } catch (...) {
    close_logical_batch();
    // a charged step's draw is used, and a banded run's rows are never reused
    next_step_ = std::max({next_step_, step_->charges(), step_->rows()});
    if (step_->charges() > charged) state_->record_trained();  // the update may have written
    throw;
  }
  state_->record_trained();  // the update's own writes
  close_logical_batch();
  next_step_ = std::max({t + 1, step_->charges(), step_->rows()});
  return out;
}

void PrivacyEngine::zero_grad() {
  close_logical_batch();
  state_->clear_pending();
  step_->drop_batch();
  session_->book->set_error(std::nullopt);
  session_->book->set_stale(false);
}

void PrivacyEngine::reseed_generators(DrawPurpose purpose, int64_t step, int64_t index) const {
  reseed(generator_key(step_->settings().noise_key), purpose, rank_, step, index);
}

void PrivacyEngine::close_logical_batch() {
  // Its draws end here (a save between steps holds no state a step draws from).
  reseed_generators(DrawPurpose::kBetween, current_ ? current_->step : next_step_, 0);
  current_.reset();
  handed_ = 0;
  caller_sampled_ = false;
  session_->handed_out = false;
  session_->book->set_padding(false);
  session_->book->set_expected_rows(std::nullopt);
}

void PrivacyEngine::verify_state() const {
  const std::optional<std::string> why = state_->release_refusal();
  const comm::Collectives& comm = zero_->comm();
  std::vector<int64_t> found(static_cast<size_t>(comm.world_size()), 0);
  if (comm.world_size() > 1) {  // a failure names the collective and the rank (comm::wait)
    found[static_cast<size_t>(comm.rank())] = why ? 1 : 0;
    found = comm.all_reduce_sum(found);
  }
  if (why) throw PrivacyError(bad("verify_state: " + *why));
  std::string ranks;
  for (size_t r = 0; r < found.size(); ++r) {
    if (found[r] != 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  }
  if (!ranks.empty()) {
    throw PrivacyError(bad("verify_state: the model's state changed on rank(s) " + ranks +
                           " (their verify_state names what), and a rank's write can reach what "
                           "this rank releases; nothing may be released until it is accepted "
                           "there (accept_state_change) or the run is restarted"));
  }
}

void PrivacyEngine::accept_state_change(const std::vector<std::string>& names) {
  state_->accept(names);
}

double PrivacyEngine::epsilon(double delta) const {
  if (charges() == 0) return 0.0;
  if (options_.noise_multiplier == 0.0) return INFINITY;
  return accountant_->get_epsilon(delta);
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
