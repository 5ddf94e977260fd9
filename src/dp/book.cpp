// src/dp/book.cpp — see book.h.
#include "src/dp/book.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <tuple>
#include <utility>

#include <c10/util/accumulate.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include "kernels/per_sample_ops.h"
#include "src/dp/clip_group.h"
#include "src/zero/state.h"

namespace dpzero::dp {
namespace {

namespace ps = kernels::per_sample;

// Note [one sample per row]: the advice every row-count refusal ends with.
constexpr const char* kBatchOnDim0 =
    ": DP layers need the batch on dim 0 (Note [one sample per row]): transpose "
    "batch_first=False inputs, and expand inputs shared by the batch ([1, ...] broadcast) to the "
    "batch";

PrivacyErrorHook privacy_error_hook = nullptr;

using Lock = std::lock_guard<std::recursive_mutex>;

}  // namespace

Book::InputKey Book::input_key(const at::Tensor& a) {
  return {a.data_ptr(),    a.sizes().vec(),  a.strides().vec(),
          a.scalar_type(), a.device().str(), a._version()};
}

void set_privacy_error_hook(PrivacyErrorHook hook) { privacy_error_hook = hook; }

void rethrow_from_engine(const PrivacyError& error) {
  if (privacy_error_hook != nullptr) privacy_error_hook(error);  // throws
  throw;
}

Book::Book(std::vector<BookLayer> layers, BookOptions options, zero::ZeroState& engine)
    : layers_(std::move(layers)), options_(std::move(options)), engine_(engine) {
  const size_t groups = options_.thresholds.size();
  TORCH_CHECK(options_.group_components.size() == groups, "dpzero::dp::Book: ", groups,
              " thresholds but ", options_.group_components.size(), " group sizes");
  TORCH_CHECK(options_.unit_device.size() == options_.unit_numel.size(),
              "dpzero::dp::Book: ", options_.unit_numel.size(), " unit sizes but ",
              options_.unit_device.size(), " unit devices");
  TORCH_CHECK(static_cast<int64_t>(options_.unit_numel.size()) == engine_.num_units(),
              "dpzero::dp::Book: ", options_.unit_numel.size(), " units, the engine has ",
              engine_.num_units());
  for (const BookLayer& layer : layers_) {
    TORCH_CHECK(layer.group >= 0 && static_cast<size_t>(layer.group) < groups,
                "dpzero::dp::Book: layer '", layer.name, "' is in group ", layer.group, " of ",
                groups);
    if (layer.ops) {
      TORCH_CHECK(static_cast<int64_t>(layer.slots.size()) == layer.ops->num_params(),
                  "dpzero::dp::Book: layer '", layer.name, "' has ", layer.slots.size(),
                  " slots for ", layer.ops->num_params(), " parameters");
    }
    for (const auto& slot : layer.slots) {
      if (!slot) continue;
      TORCH_CHECK(slot->unit >= 0 && slot->unit < engine_.num_units() && slot->offset >= 0 &&
                      slot->offset + slot->numel <= options_.unit_numel[slot->unit],
                  "dpzero::dp::Book: layer '", layer.name, "' has a slot [", slot->offset, ", ",
                  slot->offset + slot->numel, ") outside unit ", slot->unit);
      // dests() views the slot as its shape: the shape must hold exactly its numel elements.
      TORCH_CHECK(c10::multiply_integers(slot->shape) == slot->numel, "dpzero::dp::Book: layer '",
                  layer.name, "' has a slot of ", slot->numel, " elements with shape ",
                  c10::IntArrayRef(slot->shape));
      if (!layer.ops) keep_gathered_.insert(slot->unit);  // Note [early release]
    }
  }
  reset_micro_batch();
}

void Book::refuse(const std::string& why) const {
  if (!error_) error_ = why;  // the first violation is the one the step names
  throw PrivacyError(why);
}

void Book::refuse_backward(const std::string& why) {
  Lock lock(mutex_);
  refuse(why);
}

void Book::note_failure(const std::exception& e, const char* where) {
  if (dynamic_cast<const PrivacyError*>(&e) != nullptr) {
    if (!error_) error_ = e.what();
  } else if (!error_) {
    error_ = std::string(where) + " failed (" + e.what() + ")";
  }
}

void Book::set_expected_rows(std::optional<int64_t> rows) {
  Lock lock(mutex_);
  expected_rows_ = rows;
  finished_ = 0;
  if (rows) ++hand_out_;
}
std::optional<std::string> Book::error() const {
  Lock lock(mutex_);
  return error_;
}
void Book::set_error(std::optional<std::string> error) {
  Lock lock(mutex_);
  error_ = std::move(error);
}
bool Book::stale() const {
  Lock lock(mutex_);
  return stale_;
}
void Book::set_stale(bool stale) {
  Lock lock(mutex_);
  stale_ = stale;
}
void Book::set_queue_finish(bool on) {
  Lock lock(mutex_);
  TORCH_CHECK(!on || !weak_from_this().expired(),
              "dpzero::dp::Book::set_queue_finish: the "
              "book must be owned by a std::shared_ptr to queue its own callback");
  queue_finish_ = on;
}
void Book::set_padding(bool padding) {
  Lock lock(mutex_);
  padding_ = padding;
}
bool Book::padding() const {
  Lock lock(mutex_);
  return padding_;
}
int64_t Book::generation() const {
  Lock lock(mutex_);
  return generation_;
}
int64_t Book::num_parts() const {
  Lock lock(mutex_);
  return static_cast<int64_t>(parts_.size());
}
bool Book::open() const {
  Lock lock(mutex_);
  return !parts_.empty();
}
bool Book::started() const {
  Lock lock(mutex_);
  return started_;
}
int64_t Book::micro_batches() const {
  Lock lock(mutex_);
  return stats_.micro_batches;
}
void Book::discard() {
  Lock lock(mutex_);
  reset_micro_batch();
}

void Book::reset_micro_batch() {
  // A backward that reaches a part of an earlier micro-batch (a second backward through one
  // graph) carries an old generation and is refused.
  ++generation_;
  started_ = false;
  finish_queued_ = false;
  parts_.clear();
  group_state_.clear();
  unit_expected_.clear();
  unit_uses_.clear();
  unit_buf_.clear();
  direct_.clear();
  handed_.clear();
  batch_.reset();
  dropped_mask_ = at::Tensor();
  inputs_.clear();  // what early norms read and wrote is recorded on their streams
}

// ---- forward
// -------------------------------------------------------------------------------------

int64_t Book::on_forward(int64_t layer) {
  Lock lock(mutex_);
  if (started_) {
    refuse(
        "a backward pass stopped partway after part of it was clipped; its clipped sums are "
        "still accumulated, so a new forward would count those examples twice: call "
        "zero_grad() to drop the micro-batch");
  }
  TORCH_CHECK(layer >= 0 && static_cast<size_t>(layer) < layers_.size(),
              "dpzero::dp::Book::on_forward: no layer ", layer, " (", layers_.size(), " layers)");
  const BookLayer& l = layers_[layer];
  const int64_t index = num_parts();
  Part part;
  part.layer = layer;
  part.hand_out = hand_out_;
  parts_.push_back(std::move(part));
  group_state_[l.group].parts.push_back(index);
  for (const auto& slot : l.slots) {
    if (!slot) continue;
    ++unit_expected_[slot->unit];
    ++unit_uses_[slot->unit];
  }
  return index;
}

void Book::set_verdict(int64_t part) {
  Lock lock(mutex_);
  TORCH_CHECK(part >= 0 && part < num_parts(), "dpzero::dp::Book::set_verdict: no part ", part,
              " (", num_parts(), " parts)");
  parts_[part].verdict = true;
}

void Book::note_input(int64_t generation, int64_t part, const at::Tensor& a) {
  Lock lock(mutex_);
  if (generation != generation_ || part < 0 || part >= num_parts() || parts_[part].input ||
      !a.defined()) {
    return;  // not this micro-batch's part (its backward will be refused), or noted already
  }
  const InputKey key = input_key(a);
  parts_[part].input = key;
  inputs_[key].push_back(part);
}

// ---- backward
// ------------------------------------------------------------------------------------

void Book::begin_backward(int64_t generation, int64_t index) {
  Lock lock(mutex_);
  if (stale_) {
    refuse(
        "a new logical batch began while the previous one's gradients were still "
        "accumulated (step() was not called for it); they would be released together; call "
        "zero_grad() first");
  }
  if (generation != generation_ || index < 0 || index >= num_parts() || parts_[index].claimed) {
    refuse(
        "a backward reached a DP layer call whose gradient was already taken (a second "
        "backward through the same forward, or a graph kept across zero_grad()); each forward "
        "may be back-propagated once");
  }
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info != nullptr && !exec_info->empty()) {
    // Note [no parameter edges] in dp_layers.h: such a backward runs only the DP layers on a path
    // to the given tensors, and the others' clipped gradients would be missing from the step.
    refuse("a backward restricted to some tensors (torch.autograd.grad, or backward(inputs=...)) "
           "reached DP layer '" + layers_[parts_[index].layer].name +
           "': it skips the DP layers that do not lead to those tensors, so the step would miss "
           "their clipped gradients; back-propagate the loss itself (loss.backward())");
  }
  Part& part = parts_[index];
  if (expected_rows_ && part.hand_out != hand_out_) {
    // Its forward ran on an earlier micro-batch of the loader, still open when this one was
    // handed out: row i of both would be clipped as one example.
    refuse("a backward reached DP layer '" + layers_[part.layer].name +
           "' of an earlier micro-batch of the loader (its forward ran before the current one "
           "was handed out): examples of two micro-batches would be clipped as one; "
           "back-propagate each micro-batch before taking the next");
  }
  if (!part.verdict) {
    refuse("layer '" + layers_[part.layer].name +
           "' has no verdict on which of its rows are "
           "examples (Note [batch provenance]); it is not clipped");
  }
  part.claimed = true;
  started_ = true;
}

int64_t Book::take_rows(int64_t index, int64_t b) {
  Lock lock(mutex_);
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(parts_.size()) && parts_[index].claimed &&
                  parts_[index].rows < 0,
              "dpzero::dp::Book::take_rows: part ", index, " was not claimed by begin_backward");
  Part& part = parts_[index];
  const BookLayer& layer = layers_[part.layer];
  if (expected_rows_ && b != *expected_rows_) {
    refuse("layer '" + layer.name + "' saw a batch of " + std::to_string(b) +
           " rows in a micro-batch of " + std::to_string(*expected_rows_) + " examples" +
           kBatchOnDim0);
  }
  if (batch_ && b != *batch_) {
    refuse("layer '" + layer.name + "' saw a batch of " + std::to_string(b) +
           " rows where other layers of the same micro-batch saw " + std::to_string(*batch_) +
           kBatchOnDim0);
  }
  part.rows = b;
  if (padding_) return 0;  // exact zeros: the padding row contributes nothing
  if (fused(part) && options_.mean_loss && b > 0) return b;  // Note [mean loss]
  return 1;
}

bool Book::fused(const Part& part) const {
  const BookLayer& layer = layers_[part.layer];
  return group_state_.at(layer.group).parts.size() == 1 &&
         options_.group_components[layer.group] == 1 &&
         std::isfinite(options_.thresholds[layer.group]);
}

void Book::on_backward(int64_t generation, int64_t index, const at::Tensor& a, at::Tensor g) {
  Lock lock(mutex_);
  try {
    report_kernel(generation, index, a, std::move(g));
    queue_finish();
  } catch (const std::exception& e) {
    // Whatever failed, part of this micro-batch may already be in the engine: the step must not
    // run on it (a retried micro-batch would count its examples twice).
    note_failure(e, "the backward in the clipping");
    throw;
  }
}

void Book::report_kernel(int64_t generation, int64_t index, const at::Tensor& a, at::Tensor g) {
  begin_backward(generation, index);
  TORCH_CHECK(layers_[parts_[index].layer].ops, "dpzero::dp::Book::on_backward: layer '",
              layers_[parts_[index].layer].name, "' takes the generic path (report_per_sample)");
  const int64_t multiplier = take_rows(index, g.dim() > 0 ? g.size(0) : 0);
  if (multiplier == 0) {
    g = at::zeros_like(g);
  } else if (multiplier != 1) {
    g = g * multiplier;
  }
  Kept inputs;
  inputs.a = a;
  inputs.g = g;
  report(index, std::move(inputs), /*per_sample=*/false);
}

void Book::report_per_sample(int64_t index, std::vector<at::Tensor> grads) {
  Lock lock(mutex_);
  TORCH_CHECK(index >= 0 && index < num_parts() && parts_[index].rows >= 0 && !parts_[index].kept &&
                  !parts_[index].done,
              "dpzero::dp::Book::report_per_sample: part ", index,
              " has not passed begin_backward and take_rows");
  const BookLayer& layer = layers_[parts_[index].layer];
  TORCH_CHECK(!layer.ops && grads.size() == layer.slots.size(),
              "dpzero::dp::Book::report_per_sample: layer '", layer.name, "' takes ",
              layer.ops ? "its kernel path (on_backward)"
                        : std::to_string(layer.slots.size()) + " per-sample gradients, got " +
                              std::to_string(grads.size()));
  Kept kept;
  kept.grads = std::move(grads);
  try {
    report(index, std::move(kept), /*per_sample=*/true);
    queue_finish();
  } catch (const std::exception& e) {
    note_failure(e, "the backward in the clipping");
    throw;
  }
}

void Book::report_per_sample_rows(int64_t index, int64_t begin, std::vector<at::Tensor> grads) {
  Lock lock(mutex_);
  TORCH_CHECK(index >= 0 && index < num_parts() && parts_[index].rows >= 0 && !parts_[index].kept &&
                  !parts_[index].done,
              "dpzero::dp::Book::report_per_sample_rows: part ", index,
              " has not passed begin_backward and take_rows, or is done");
  Part& part = parts_[index];
  const BookLayer& layer = layers_[part.layer];
  const GroupState& gs = group_state_.at(layer.group);
  TORCH_CHECK(!layer.ops && grads.size() == layer.slots.size(),
              "dpzero::dp::Book::report_per_sample_rows: layer '", layer.name, "' takes ",
              layer.ops ? "its kernel path (on_backward)"
                        : std::to_string(layer.slots.size()) + " per-sample gradients, got " +
                              std::to_string(grads.size()));
  TORCH_CHECK(gs.parts.size() == 1 && options_.group_components[layer.group] == 1,
              "dpzero::dp::Book::report_per_sample_rows: layer '", layer.name,
              "' shares its clipping group with other parts; report all rows at once");
  TORCH_CHECK(begin == part.reported, "dpzero::dp::Book::report_per_sample_rows: rows of part ",
              index, " must come in order: expected row ", part.reported, ", got ", begin);
  try {
    int64_t n = -1;
    for (const at::Tensor& t : grads) {
      if (!t.defined()) continue;
      if (t.dim() == 0 || (n >= 0 && t.size(0) != n) || begin + t.size(0) > part.rows) {
        refuse("layer '" + layer.name + "' reported rows " + std::to_string(begin) + "+" +
               (t.dim() ? std::to_string(t.size(0)) : std::string("?")) + " for a part of " +
               std::to_string(part.rows) + " rows");
      }
      n = t.size(0);
    }
    TORCH_CHECK(n > 0, "dpzero::dp::Book: layer '", layer.name, "' reported no gradient");
    if (!batch_) {
      batch_ = part.rows;
      dropped_mask_ = at::zeros({*batch_}, grads[0].defined()
                                               ? grads[0].options().dtype(at::kBool)
                                               : at::TensorOptions().dtype(at::kBool));
    }
    const double threshold = options_.thresholds[layer.group];
    at::Tensor factors;
    if (std::isfinite(threshold)) {  // fused: G was scaled for a mean loss (take_rows)
      factors = std::get<0>(ps::clip_from_sq_norms(per_sample_sq_norms(grads).to(at::kDouble),
                                                   threshold, options_.mode, options_.gamma));
      dropped_mask_.narrow(0, begin, n).logical_or_(factors == 0);
    } else {  // C = inf: no clipping; the mean loss scales the factors (Note [mean loss])
      const at::Tensor& first = *std::find_if(grads.begin(), grads.end(),
                                              [](const at::Tensor& t) { return t.defined(); });
      factors = mean_scaled_factors(at::ones({n}, first.options().dtype(at::kFloat)),
                                    mean_scale());
    }
    add_per_sample_clipped_sums(grads, factors, dests(layer));
    part.reported += n;
    if (part.reported == part.rows) {
      ++group_state_.at(layer.group).received;
      group_state_.at(layer.group).complete = true;
      part.done = true;
      delivered(layer);
      release_if_done(layer);
    }
    queue_finish();
  } catch (const std::exception& e) {
    note_failure(e, "the backward in the clipping");
    throw;
  }
}

void Book::queue_finish() {
  if (!queue_finish_ || finish_queued_) return;
  torch::autograd::Engine::get_default_engine().queue_callback([weak = weak_from_this()] {
    const std::shared_ptr<Book> book = weak.lock();
    if (!book) return;  // the book is gone, and with it what this backward clipped
    try {
      book->finish_backward();
    } catch (const PrivacyError& e) {
      rethrow_from_engine(e);  // Note [errors out of the autograd engine]
    }
  });
  finish_queued_ = true;
}

// One part's backward, after the checks: `in` holds (a, g) for a kernel layer, the per-sample
// gradients for the generic path.
void Book::report(int64_t index, Kept in, bool per_sample) {
  Part& part = parts_[index];
  const BookLayer& layer = layers_[part.layer];
  // Note [one sample per row]: every reported tensor has the rows take_rows checked.
  bool any = false;
  at::Tensor first;
  for (const at::Tensor& t : per_sample ? in.grads : std::vector<at::Tensor>{in.g}) {
    if (!t.defined()) continue;
    if (t.dim() == 0 || t.size(0) != part.rows) {
      refuse("layer '" + layer.name + "' reported a gradient of shape " + c10::str(t.sizes()) +
             " for a part of " + std::to_string(part.rows) + " rows");
    }
    if (!any) first = t;
    any = true;
  }
  TORCH_CHECK(any, "dpzero::dp::Book: layer '", layer.name, "' reported no gradient");
  if (!batch_) {
    batch_ = part.rows;
    dropped_mask_ = at::zeros({*batch_}, first.options().dtype(at::kBool));
  }
  GroupState& gs = group_state_.at(layer.group);
  const double threshold = options_.thresholds[layer.group];
  const bool clip = std::isfinite(threshold);
  ++gs.received;
  if (fused(part)) {
    // A singleton group: norm, factors and clipped sum in one fused op, in this backward.
    at::Tensor factors;
    if (per_sample) {
      factors = std::get<0>(ps::clip_from_sq_norms(per_sample_sq_norms(in.grads).to(at::kDouble),
                                                   threshold, options_.mode, options_.gamma));
      add_per_sample_clipped_sums(in.grads, factors, dests(layer));
    } else {
      factors =
          layer.ops->clip_into(in.a, in.g, threshold, options_.mode, options_.gamma, dests(layer));
    }
    note_factors(factors);
    part.done = true;
    gs.complete = true;
    delivered(layer);
  } else {
    if (per_sample) {
      if (clip) in.sq = per_sample_sq_norms(in.grads);  // as delivered (Note [mean loss])
      part.kept = std::move(in);
    } else if (clip && layer.ops->shares_input()) {
      part.kept = layer.ops->keep_pending(in.a, in.g);  // Note [shared inputs]
      if (part.input && norm_stream_for(in.a.device())) part.marked = mark(in.a.device());
      norms_if_input_done(index);
    } else {
      part.kept = layer.ops->keep(in.a, in.g, clip);
    }
    if (part.kept->a.defined()) part.a_version = part.kept->a._version();
    if (part.kept->g.defined()) part.g_version = part.kept->g._version();
    if (gs.received == static_cast<int64_t>(gs.parts.size())) complete(layer.group);
  }
  release_if_done(layer);
}

// Note [kept inputs stay unwritten]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A part that is not clipped in its own backward keeps what its clipped sum needs until its group
// completes. The clip bounds its contribution only if the sum reads the values the norm read,
// and between the part's report and the completion other code runs: the earlier layers' backward
// nodes, a custom Function's backward, tensor hooks. One of them writing in place into a tensor a
// DP layer read (its A, or its G) would scale the contribution past C unseen, had the norm been
// computed before the write. So, by construction:
//  * a kind that keeps per-sample rows (a bias, a norm layer) computes its norm from the rows at
//    its report, and its clipped sum from the same rows;
//  * a kind that keeps A and G has its norm computed when the group completes (Kept::deferred,
//    Kept::pending), right before its clipped sum reads the same A and G: whatever wrote them
//    before, the norm and the sum see the same values.
// Early norms (Note [norms when their input is done], asked for) give up the second: a Linear's
// norm is computed at its set's last report. For them, and for any write at all, the book takes
// A's and G's version counters when it keeps them and refuses to complete a group if either
// moved: a tracked write in place (any ATen op) refuses the step, naming the layer. A write that
// bypasses the counter (through .data, or another library's view of the memory) is outside what
// the counters see; with the default schedule it is harmless to the bound, with early norms it is
// the premise they add (tests/python/test_norm_schedule.py shows both).
void Book::check_unwritten(int64_t index) const {
  const Part& part = parts_[index];
  const Kept& kept = *part.kept;
  const std::string& name = layers_[part.layer].name;
  if (kept.a.defined() && kept.a._version() != part.a_version) {
    refuse("the input of DP layer '" + name +
           "' was written in place during the backward, after the layer reported it: its "
           "clipped gradient would be summed from other values than its norm was computed from; "
           "clone the tensor before writing into it in a backward (a custom autograd Function or "
           "a hook)");
  }
  if (kept.g.defined() && kept.g._version() != part.g_version) {
    refuse("the output gradient of DP layer '" + name +
           "' was written in place during the backward, after the layer reported it: its "
           "clipped gradient would be summed from other values than its norm was computed from; "
           "clone the gradient before writing into it (a tensor hook)");
  }
}

// ---- completion
// ----------------------------------------------------------------------------------

void Book::shared_norms(const std::vector<int64_t>& parts) {
  std::vector<std::pair<InputKey, std::vector<int64_t>>> by_input;
  for (const int64_t index : parts) {
    const Kept& kept = *parts_[index].kept;
    if (!kept.pending) continue;
    const InputKey key = input_key(kept.a);
    auto it = std::find_if(by_input.begin(), by_input.end(),
                           [&](const auto& entry) { return entry.first == key; });
    if (it == by_input.end()) {
      by_input.emplace_back(key, std::vector<int64_t>{index});
    } else {
      it->second.push_back(index);
    }
  }
  for (const auto& entry : by_input) input_norms(entry.second, /*early=*/false);
}

bool Book::pending_kind(int64_t index) const {
  const Part& part = parts_[index];
  const BookLayer& layer = layers_[part.layer];
  return layer.ops && layer.ops->shares_input() &&
         std::isfinite(options_.thresholds[layer.group]) && !fused(part);
}

// Note [norms when their input is done]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Note [shared inputs] computes the weight norms of the Linear calls that read one input in one
// op, which builds that input's Gram once. By default a group's norms are computed when the
// group completes: for flat clipping at the end of the backward, every layer's at once, after the
// last GEMM of the backward, on a GPU with nothing beside them. A set of calls is known at the
// end of the forward, though, and with early norms on (early_norms(), norm_schedule.h; off by
// default) each call notes the tensor it read (note_input), and a set's norms are computed as
// soon as the last of its calls has reported, while autograd goes on to the earlier layers (on
// a GPU, on a side stream: Note [norms on a side stream]). The set is the calls whose noted
// input is this one and that keep their inputs pending (pending_kind: a Linear with a trained
// weight in a group of several parts with a finite threshold); a call whose reported A is not
// the tensor it noted (it was cast again, or written since) leaves the set and waits for its
// group as before, as does every call of a set one of whose calls never reports (its output did
// not reach the loss). The grouping only decides which calls share one op: each call's norm is
// certified whatever set computes it (Note [certified norms]), and where the kernels give a row
// the single op's bits (the CPU kernel, the CUDA tiles: Note [shared inputs]) the sets change
// no value at all (the GoogleTest Book.NormsOfAFinishedInputAreTheGroupsOwn compares them with
// the completion's, bit for bit). Early norms read A and G before the clipped sums do, which
// adds the premise of Note [kept inputs stay unwritten]: that is why they are asked for.
void Book::norms_if_input_done(int64_t index) {
  Part& part = parts_[index];
  if (!part.input) return;
  auto it = inputs_.find(*part.input);
  if (it == inputs_.end()) return;
  std::vector<int64_t>& noted = it->second;
  if (input_key(part.kept->a) != *part.input) {
    noted.erase(std::remove(noted.begin(), noted.end(), index), noted.end());
    part.input.reset();
  }
  std::vector<int64_t> same;
  for (const int64_t p : noted) {
    const Part& other = parts_[p];
    if (!pending_kind(p) || other.done) continue;  // never pending, or its group completed
    if (!other.kept) return;                       // a call still to report
    if (other.kept->pending) same.push_back(p);
  }
  if (!same.empty()) input_norms(same, /*early=*/true);
}

void Book::input_norms(const std::vector<int64_t>& same, bool early) {
  const Kept& first = *parts_[same[0]].kept;
  // rests: each layer's bias rows (or none), certified and added to its weight's norm in the
  // certification's own pass (on the host with certified_sum's bits).
  std::vector<at::Tensor> gs, reads{first.a};
  std::vector<ps::KeptRest> rests;
  for (const int64_t index : same) {
    const Kept& kept = *parts_[index].kept;
    gs.push_back(kept.g);
    rests.push_back({kept.rest_rows, kept.rest_s, kept.rest_coef});
    reads.push_back(kept.g);
    if (kept.rest_rows.defined()) {
      reads.push_back(kept.rest_rows);
      reads.push_back(kept.rest_s);
    }
  }
  const auto norms = [&] {
    return ps::linear_sq_norms_each(first.a, gs, /*method=*/0, rests);  // L x [B]
  };
  const at::Device device = first.a.device();
  std::vector<at::Tensor> totals;
  std::shared_ptr<const Aside> aside;
  if (early && norm_stream_for(device)) {  // at completion nothing is left to overlap
    std::vector<std::shared_ptr<const c10::Event>> after;
    for (const int64_t index : same) {
      if (parts_[index].marked) after.push_back(parts_[index].marked);
    }
    std::tie(totals, aside) = run_aside(device, after, reads, norms);
  } else {
    totals = norms();
  }
  for (size_t l = 0; l < same.size(); ++l) {
    Part& part = parts_[same[l]];
    part.kept->sq = std::move(totals[l]);
    part.kept->rest_rows = at::Tensor();  // grads[1] keeps the bias rows for its clipped sum
    part.kept->rest_s = at::Tensor();
    part.kept->pending = false;
    part.aside = aside;
    part.marked.reset();
  }
}

// Note [a group's kept rows in one add]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// When a group completes, each of its parts adds its clipped sums into its parameters' slots: the
// sums formed from A and G (weights) at once, and the kept per-sample rows (biases, norm
// parameters: a few, each small) through dpzero::_add_per_sample_clipped_sums_, which adds any
// number of pairs in one op (one launch on a GPU) where one op per parameter took a launch each.
// So the kept rows of consecutive parts wait and are added together. This changes no bit: each
// pair's op gives add_per_sample_clipped_sum_'s bits, and float32 additions into one memory
// location happen in the order they did, because the waiting rows are added first whenever a
// part writes into a slot one of them waits for (a layer called twice in the step, a parameter
// tied between layers) and whenever a layer's own kept rows meet in one slot (a parameter it
// holds twice: KeptSums::gather), so the waiting pairs' slots are distinct (the op refuses memory
// shared between its pairs, so a premise broken later fails loudly). Adds into different slots
// commute.
// A unit's buffer is complete before it is handed over to the engine: the waiting rows are added
// before any delivered() that hands a unit over, which keeps each unit's reduction starting as
// early as before.
void Book::complete(int64_t group) {
  GroupState& gs = group_state_.at(group);
  if (gs.complete) return;
  gs.complete = true;
  std::vector<int64_t> parts;
  for (const int64_t index : gs.parts) {
    if (parts_[index].kept) parts.push_back(index);
  }
  if (parts.empty()) return;
  for (const int64_t index : parts) check_unwritten(index);
  const double threshold = options_.thresholds[group];
  at::Tensor factors;
  if (std::isfinite(threshold)) {
    for (const int64_t index : parts) {  // Note [kept inputs stay unwritten]
      Kept& kept = *parts_[index].kept;
      if (!kept.deferred) continue;
      kept.sq = layers_[parts_[index].layer].ops->sq_norms(kept.a, kept.g);
      kept.deferred = false;
    }
    shared_norms(parts);
    for (const int64_t index : parts) {  // Note [norms on a side stream], step 3
      Part& part = parts_[index];
      if (!part.aside) continue;
      wait_and_use(*part.aside, {part.kept->sq});
      part.aside.reset();
    }
    // Per component, its parts' squared norms (Note [certified group norms]).
    std::vector<int64_t> order;
    std::map<int64_t, std::vector<at::Tensor>> by_component;
    for (const int64_t index : parts) {
      const int64_t c = layers_[parts_[index].layer].component;
      if (!by_component.count(c)) order.push_back(c);
      by_component[c].push_back(parts_[index].kept->sq);
    }
    std::vector<std::vector<at::Tensor>> components;
    for (const int64_t c : order) components.push_back(std::move(by_component[c]));
    // Norms, factors and their mean-loss scaling in one pass (Note [mean loss]).
    factors = std::get<0>(group_clip(components, mean_scale(), threshold, options_.mode,
                                     options_.gamma));
    note_factors(factors);
  } else {  // C = inf: no clipping (non-private training through the same path)
    factors = mean_scaled_factors(at::ones({*batch_}, dropped_mask_.options().dtype(at::kFloat)),
                                  mean_scale());  // Note [mean loss]
  }
  // Note [a group's kept rows in one add]: the kept per-sample rows wait in `kept_sums`.
  KeptSums kept_sums(factors);
  std::set<std::pair<int64_t, int64_t>> waiting;  // the (unit, offset) slots kept_sums adds into
  for (const int64_t index : parts) {
    Part& part = parts_[index];
    const BookLayer& layer = layers_[part.layer];
    const bool meets = std::any_of(layer.slots.begin(), layer.slots.end(), [&](const auto& slot) {
      return slot && waiting.count({slot->unit, slot->offset});
    });
    if (meets) {
      kept_sums.add();
      waiting.clear();
    }
    add_kept_clipped_sums(part, factors, kept_sums);
    for (size_t p = 0; p < layer.slots.size(); ++p) {
      const bool kept = p < part.kept->grads.size() && part.kept->grads[p].defined();
      if (kept && layer.slots[p]) waiting.insert({layer.slots[p]->unit, layer.slots[p]->offset});
    }
    part.kept.reset();  // book-keeping ends here for this part (kept_sums holds its rows)
    part.done = true;
    if (hands_over(layer)) {
      kept_sums.add();
      waiting.clear();
    }
    delivered(layer);
  }
  kept_sums.add();
}

void Book::add_kept_clipped_sums(const Part& part, const at::Tensor& factors,
                                 KeptSums& kept_sums) {
  const BookLayer& layer = layers_[part.layer];
  const Kept& kept = *part.kept;
  const std::vector<at::Tensor> out = dests(layer);
  if (layer.ops) {
    // The trained parameters without kept rows are summed from a and g.
    Trainable rest(layer.ops->train().size(), false);
    bool any = false;
    for (size_t p = 0; p < rest.size(); ++p) {
      rest[p] = layer.ops->train()[p] && !(p < kept.grads.size() && kept.grads[p].defined());
      any = any || rest[p];
    }
    if (any) layer.ops->add_clipped_sums(kept.a, kept.g, factors, rest, out);
  }
  kept_sums.gather(kept.grads, out);
}

int64_t Book::mean_scale() const {
  return options_.mean_loss && !padding_ && batch_ && *batch_ > 0 ? *batch_ : 1;
}

void Book::note_factors(const at::Tensor& factors) {
  if (factors.numel() == 0) return;
  dropped_mask_.logical_or_(factors == 0);
}

// ---- units
// ---------------------------------------------------------------------------------------

at::Tensor& Book::unit_buffer(int64_t unit) {
  auto it = unit_buf_.find(unit);
  if (it != unit_buf_.end()) return it->second;
  at::Tensor buf = engine_.grad_accumulator(unit);  // Note [private accumulator]
  if (buf.defined()) {
    direct_.insert(unit);
  } else {
    buf = at::zeros({options_.unit_numel[unit]},
                    at::TensorOptions().dtype(at::kFloat).device(options_.unit_device[unit]));
  }
  return unit_buf_.emplace(unit, std::move(buf)).first->second;
}

std::vector<at::Tensor> Book::dests(const BookLayer& layer) {
  std::vector<at::Tensor> out;
  for (const auto& slot : layer.slots) {
    if (!slot) {
      out.emplace_back();
      continue;
    }
    // The unit's buffer is a flat [numel]: one as_strided per slot, where a narrow and a view
    // were three dispatched ops, for every parameter of every DP layer call in every backward.
    const at::Tensor& buf = unit_buffer(slot->unit);
    TORCH_CHECK(slot->offset >= 0 && slot->offset + slot->numel <= buf.numel(), "dpzero: ",
                layer.name, ": a parameter's slot [", slot->offset, ", ",
                slot->offset + slot->numel, ") lies outside its unit's gradient buffer of ",
                buf.numel(), " elements");
    if (buf.dim() == 1 && buf.stride(0) == 1) {
      out.push_back(buf.as_strided(slot->shape, c10::contiguous_strides(slot->shape),
                                   buf.storage_offset() + slot->offset));
    } else {
      out.push_back(buf.narrow(0, slot->offset, slot->numel).view(slot->shape));
    }
  }
  return out;
}

void Book::delivered(const BookLayer& layer) {
  for (const auto& slot : layer.slots) {
    if (slot && --unit_expected_[slot->unit] == 0) hand_over(slot->unit);
  }
}

bool Book::hands_over(const BookLayer& layer) const {
  std::map<int64_t, int64_t> slots;  // per unit, the contributions delivered() takes from it
  for (const auto& slot : layer.slots) {
    if (slot) ++slots[slot->unit];
  }
  return std::any_of(slots.begin(), slots.end(), [&](const auto& unit_slots) {
    const auto expected = unit_expected_.find(unit_slots.first);
    return expected != unit_expected_.end() && expected->second == unit_slots.second;
  });
}

void Book::hand_over(int64_t unit) {
  at::Tensor buf = std::move(unit_buffer(unit));
  unit_buf_.erase(unit);
  unit_expected_.erase(unit);
  handed_.insert(unit);
  if (direct_.count(unit)) return;  // already in the engine's buffer
  engine_.add_unit_grad(unit, buf, /*release_params=*/!keep_gathered_.count(unit),
                        /*donated=*/true);  // erased above: nothing else holds buf
}

void Book::release_if_done(const BookLayer& layer) {
  for (const auto& slot : layer.slots) {
    if (!slot) continue;
    if (--unit_uses_[slot->unit] == 0 && !keep_gathered_.count(slot->unit)) {
      engine_.release_params(slot->unit);
    }
  }
}

// ---- end of backward
// -----------------------------------------------------------------------------

void Book::finish_backward() {
  Lock lock(mutex_);
  try {
    if (expected_rows_ && ++finished_ > 1) {
      refuse(
          "a second backward pass reached the clipping within one micro-batch of the loader "
          "(two forwards on one batch, or an input-gradient pass): its examples would be "
          "counted twice");
    }
    for (auto& entry : group_state_) complete(entry.first);
    for (int64_t unit = 0; unit < engine_.num_units(); ++unit) {
      if (!handed_.count(unit)) hand_over(unit);  // zeros where no part of it ran
    }
    if (batch_ && !padding_) {  // padding rows count nowhere
      stats_.samples += *batch_;
      const at::Tensor dropped = dropped_mask_.sum();  // stays on the device until take_stats
      dropped_ = dropped_.defined() ? dropped_ + dropped.to(dropped_.device()) : dropped;
    }
    ++stats_.micro_batches;
  } catch (const std::exception& e) {
    note_failure(e, "the end of the backward");
    reset_micro_batch();
    throw;
  }
  reset_micro_batch();
}

std::vector<std::vector<bool>> Book::read_checks(const std::vector<at::Tensor>& checks) {
  Lock lock(mutex_);
  // Per device, its tensors flattened into one int64 vector, copied to the host at once.
  std::vector<at::Tensor> pieces;
  for (const at::Tensor& c : checks) {
    TORCH_CHECK(c.defined(), "dpzero::dp::Book::read_checks: check ", pieces.size(),
                " is an undefined tensor");
    // Nonzero (NaN included) is a failure, whatever the dtype: 0.5 must not read as 0. Bool
    // flags go as they are: the cat below promotes them with the int64 count in one launch.
    const at::Tensor flat = c.reshape({-1});
    pieces.push_back(flat.scalar_type() == at::kBool ? flat : flat.ne(0));
  }
  if (dropped_.defined()) pieces.push_back(dropped_.reshape({1}));
  std::vector<std::vector<int64_t>> values(pieces.size());
  std::vector<bool> read(pieces.size(), false);
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (read[i]) continue;
    std::vector<size_t> same;
    for (size_t j = i; j < pieces.size(); ++j) {
      if (!read[j] && pieces[j].device() == pieces[i].device()) same.push_back(j);
    }
    std::vector<at::Tensor> parts;
    for (const size_t j : same) parts.push_back(pieces[j]);
    // The transfer, which waits for the device (a copy even on the CPU, so that a test that
    // counts operators sees the read: tests/python/test_device_path.py).
    const at::Tensor host =
        at::cat(parts).to(at::kCPU, at::kLong, /*non_blocking=*/false, /*copy=*/true);
    const int64_t* p = host.data_ptr<int64_t>();
    for (const size_t j : same) {
      values[j].assign(p, p + pieces[j].numel());
      p += pieces[j].numel();
      read[j] = true;
    }
  }
  if (dropped_.defined()) {
    stats_.dropped += values.back()[0];
    dropped_ = at::Tensor();
  }
  std::vector<std::vector<bool>> out;
  for (size_t i = 0; i < checks.size(); ++i) {
    out.emplace_back();
    for (const int64_t v : values[i]) out.back().push_back(v != 0);
  }
  return out;
}

StepStats Book::take_stats() {
  Lock lock(mutex_);
  StepStats stats = stats_;
  if (dropped_.defined()) stats.dropped += dropped_.item<int64_t>();
  stats_ = StepStats();
  dropped_ = at::Tensor();
  return stats;
}

}  // namespace dpzero::dp
