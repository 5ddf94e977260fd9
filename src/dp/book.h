// src/dp/book.h — the clipping book: per micro-batch, from each DP layer call's (A, G) to clipped
// sums in the ZeRO state's gradient buffers (design.md §2 step 3).
//
// Terms. A *part* is one forward call of a DP layer in the current micro-batch. A *component* is
// a set of layers that share a parameter (a tied embedding and output head; a layer called twice
// is a component of several parts): its per-sample norm is bounded by the sum of its parts' norms
// (the triangle inequality, Note [certified group norms] in clip_group.h). A *clipping group* is a
// set of components clipped together with threshold C_g, the thresholds satisfying
// Σ_g C_g² = C² (privacy/clipping.h): flat and automatic clipping have one group, layer clipping
// one per component, group clipping the caller's. A sample's whole clipped gradient then has norm
// at most C: the sensitivity contract (design.md §3).
//
// One micro-batch, top to bottom:
//   forward   on_forward(layer) registers a part and counts, per group and per unit, the
//             contributions the backward will bring; set_verdict(part) records that dim 0 of the
//             part's rows holds the examples (Note [one sample per row]).
//   backward  each part reports (on_backward for a kernel layer; begin_backward, take_rows and
//             report_per_sample for the generic path). A singleton group is clipped at once, in
//             one fused op; otherwise the part's norms (or what they need) are kept until every
//             part of its group has reported, when the group is *complete*: factors c_i from its
//             norms, and each part's Σ_i c_i g_i added into its unit's flat float32 buffer. A
//             unit with every contribution of the micro-batch is handed to the engine
//             (ZeroState::add_unit_grad), whose reduce-scatter starts while the backward goes on.
//   end       finish_backward() completes what the backward did not reach (a layer whose output
//             did not influence the loss contributes zeros: every rank issues the same
//             reductions, Note [collective order] in src/zero/state.h), counts the samples and
//             the dropped ones, and closes the micro-batch.
//
// In stages 0–1 the unit's buffer is the engine's own gradient buffer (Note [private
// accumulator] in src/zero/unit.h): nothing is handed over.
//
// Note [padding batches]
// ~~~~~~~~~~~~~~~~~~~~~~
// A rank whose share of a logical batch runs short still runs every micro-batch (all ranks issue
// the same collectives), but many models cannot run on zero rows (Hugging Face attention reshapes
// fail). Such a micro-batch is one real row (example 0; each front door's loader makes it) whose
// output gradients the book replaces by exact zeros: it contributes nothing, counts no samples
// and drops none, and the front door says so (Python's PrivacyEngine.is_padding_batch,
// MicroBatch::padding in C++).
//
// Note [mean loss]: under loss_reduction="mean" over a micro-batch of b rows, autograd delivers
// G / b. A singleton group multiplies G by b before its fused clip; a larger group clips the
// per-sample gradients b·g_i without copying G: the parts' squared norms are kept as delivered,
// and group_clip (clip_group.h) scales them and the factors when the group completes.
//
// Note [early release]
// ~~~~~~~~~~~~~~~~~~~~
// At stage 3 a unit is gathered for its backward and must be freed once no autograd node still
// reads its parameters. The engine frees it when its gradient is handed over, but with flat (or
// group) clipping that is the end of the backward, when the clipping factors of the whole group
// are known: every unit would stay gathered through the backward, the whole model at once, which
// stage 3 exists to avoid. What the clipped sums need later is the kept A and G, never the
// parameters. So the book counts, per unit, the DP layer calls of this micro-batch that use its
// parameters and have not run their backward; a call reports once its input gradient is
// computed, and when the count reaches zero the unit is freed (ZeroState::release_params). A
// generic-path layer hands over its gradient from a tap on its OUTPUT, before its own backward
// nodes (which may read its parameters) have run: its units stay gathered until the end of the
// backward.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

#include "src/dp/errors.h"
#include "src/dp/layer_ops.h"
#include "src/dp/norm_schedule.h"

namespace dpzero::zero {
class ZeroState;
}

namespace dpzero::dp {

// Note [errors out of the autograd engine]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A PrivacyError thrown where the autograd engine runs our code (a DP layer's backward node, the
// book's end-of-backward callback) reaches the caller of backward() through the engine, which
// turns any C++ exception but its own Python one into a plain RuntimeError. The Python bindings
// install a hook that raises the error as dpzero.PrivacyViolation instead; without one (a C++
// program) the PrivacyError is rethrown as is. `rethrow_from_engine` is called inside a catch
// block.
using PrivacyErrorHook = void (*)(const PrivacyError&);
void set_privacy_error_hook(PrivacyErrorHook hook);
[[noreturn]] void rethrow_from_engine(const PrivacyError& error);

// Where one trained parameter's gradient goes: unit `unit`, at `offset` in its flat buffer.
struct Slot {
  int64_t unit = 0;
  int64_t offset = 0;
  int64_t numel = 0;
  std::vector<int64_t> shape;
};

struct BookLayer {
  std::string name;                        // the module's name, for errors
  std::shared_ptr<const LayerOps> ops;     // null: the generic path reports per-sample gradients
  std::vector<std::optional<Slot>> slots;  // per parameter (the kind's order); nullopt: frozen
  int64_t component = 0;
  int64_t group = 0;
};

struct BookOptions {
  std::vector<double> thresholds;         // per group: C_g (inf: no clipping)
  std::vector<int64_t> group_components;  // per group: how many components it holds
  std::string mode = "flat";              // "flat" | "automatic" (privacy/clipping.h)
  double gamma = 0.01;                    // automatic clipping's stabiliser
  bool mean_loss = false;                 // Note [mean loss]
  std::vector<int64_t> unit_numel;        // per unit: its flat buffer's length
  std::vector<at::Device> unit_device;    // per unit: its buffer's device
};

// What the micro-batches of one logical step produced on this rank.
struct StepStats {
  int64_t samples = 0;        // rows seen by the DP layers (padding excluded)
  int64_t dropped = 0;        // samples with a non-finite norm (factor 0)
  int64_t micro_batches = 0;  // backward passes that reached the clipping
};

class Book : public std::enable_shared_from_this<Book> {
 public:
  Book(std::vector<BookLayer> layers, BookOptions options, zero::ZeroState& engine);

  // ---- the micro-batch the caller's loader handed out ---------------------------------------
  // A new micro-batch's rows (nullopt: unknown, e.g. a batch not from the loader): every part
  // must have as many, and one backward pass may reach the clipping.
  void set_expected_rows(std::optional<int64_t> rows);
  void set_padding(bool padding);  // Note [padding batches]
  bool padding() const;

  // ---- forward ------------------------------------------------------------------------------
  // Registers one call of `layer`; returns its part index in this micro-batch. Refused once a
  // backward of this micro-batch has begun (it stopped partway when a forward comes: what it
  // clipped stays accumulated, and the examples would count twice) until discard().
  int64_t on_forward(int64_t layer);
  // Note [one sample per row]: dim 0 of part `part`'s rows holds the examples (decided from
  // where its inputs came from). A part without a verdict is never clipped.
  void set_verdict(int64_t part);
  // Note [norms when their input is done]: part `part` of micro-batch `generation` (a Linear call)
  // reads `a` ([B, ..., d_in], the tensor its backward will report as A). Optional (the DP layers
  // note only with early_norms() on): a part never noted has its norms computed when its group
  // completes.
  void note_input(int64_t generation, int64_t part, const at::Tensor& a);
  int64_t generation() const;  // changes with every micro-batch
  int64_t num_parts() const;
  bool open() const;     // parts registered, backward not finished
  bool started() const;  // a backward of this micro-batch has begun

  // ---- backward -----------------------------------------------------------------------------
  // A kernel layer's call reports its input A and output gradient G ([B, ...]).
  void on_backward(int64_t generation, int64_t part, const at::Tensor& a, at::Tensor g);
  // The generic path in three steps: claim the part; check its rows and learn what G must be
  // multiplied by before its per-sample gradients are computed (0: replaced by zeros, a padding
  // batch; b: a singleton group under a mean loss; else 1); report them (per parameter
  // [B, *shape], undefined where frozen).
  void begin_backward(int64_t generation, int64_t part);
  int64_t take_rows(int64_t part, int64_t rows);
  void report_per_sample(int64_t part, std::vector<at::Tensor> grads);
  // The same in pieces of rows, for a part alone in its group (strict isolation, Note [strict
  // isolation] in python/dpzero/private/strict.py, whose one part is the whole model): rows
  // [begin, begin + n) of the part's per-sample gradients ([n, *shape] each), in order; each
  // piece is clipped and summed at once, so only n examples' gradients exist at a time. The
  // part is done with its last row.
  void report_per_sample_rows(int64_t part, int64_t begin, std::vector<at::Tensor> grads);
  // The backward's final callback: completes every group, hands every unit over, counts.
  void finish_backward();
  // Drops a micro-batch whose backward never ran.
  void discard();
  // The step's one device-to-host read (Note [host reads of a step] in private_step.h): reads
  // `checks` (flag tensors of any shape, on any devices: nonzero where a check failed) together
  // with the dropped-sample count, one transfer per device, and keeps the count for take_stats.
  // Returns, per tensor of `checks`, its flags as host values, flattened.
  std::vector<std::vector<bool>> read_checks(const std::vector<at::Tensor>& checks);
  // This step's figures; reads the dropped count here unless read_checks already did.
  StepStats take_stats();
  int64_t micro_batches() const;

  // ---- what makes the step refuse -------------------------------------------------------------
  // The first privacy violation seen (a refusal here, or one the caller records); the step
  // refuses until the caller clears it (zero_grad()).
  std::optional<std::string> error() const;
  void set_error(std::optional<std::string> error);
  // A logical batch accumulated but never stepped when the next one began: every backward is
  // refused until the caller drops it.
  bool stale() const;
  void set_stale(bool stale);
  // Whether a backward queues finish_backward as the autograd engine's final callback (on: a
  // model's backward; off: a caller that calls finish_backward itself, as the tests do).
  void set_queue_finish(bool on);
  // Refuses the backward of a DP layer call that may not be clipped (`why`), recording it.
  [[noreturn]] void refuse_backward(const std::string& why);

 private:
  // Note [shared inputs]: what identifies one input tensor, unchanged since: its data pointer,
  // sizes, strides, dtype, device and version counter.
  using InputKey = std::tuple<const void*, std::vector<int64_t>, std::vector<int64_t>,
                              at::ScalarType, std::string, uint32_t>;
  static InputKey input_key(const at::Tensor& a);

  struct Part {
    int64_t layer = 0;
    int64_t hand_out = 0;  // the micro-batch handed out when it registered
    bool verdict = false;  // Note [one sample per row]
    bool claimed = false;  // its backward began
    int64_t rows = -1;     // its rows, as take_rows checked them
    int64_t reported = 0;  // rows reported so far by report_per_sample_rows
    bool done = false;     // its clipped sums are added
    std::optional<Kept> kept;
    std::optional<InputKey> input;  // Note [norms when their input is done]
    // Note [norms on a side stream]: its report's mark (step 1), and kept->sq's event (step 3).
    std::shared_ptr<const c10::Event> marked;
    std::shared_ptr<const Aside> aside;
    // Note [kept inputs stay unwritten]: kept->a's and kept->g's versions when kept.
    uint32_t a_version = 0, g_version = 0;
  };
  struct GroupState {
    std::vector<int64_t> parts;
    int64_t received = 0;
    bool complete = false;
  };

  void reset_micro_batch();
  // Whether `part` is clipped alone, in one fused op, in its backward.
  bool fused(const Part& part) const;
  void report_kernel(int64_t generation, int64_t part, const at::Tensor& a, at::Tensor g);
  void report(int64_t part, Kept kept_or_inputs, bool per_sample);
  void complete(int64_t group);
  void shared_norms(const std::vector<int64_t>& parts);
  // Whether part `index` keeps its inputs pending for shared norms (Note [shared inputs]).
  bool pending_kind(int64_t index) const;
  // Note [norms when their input is done]: after part `index` kept its inputs pending.
  void norms_if_input_done(int64_t index);
  // The weight norms of pending parts that read one input, in one multi-layer op (`early`: a set
  // of Note [norms when their input is done], on a side stream where one is asked for).
  void input_norms(const std::vector<int64_t>& same, bool early);
  // Note [kept inputs stay unwritten]: refuses if part `index`'s kept A or G was written since.
  void check_unwritten(int64_t index) const;
  // The part's rows summed from A and G added now; its kept per-sample rows gathered in
  // kept_sums (Note [a group's kept rows in one add]).
  void add_kept_clipped_sums(const Part& part, const at::Tensor& factors, KeptSums& kept_sums);
  int64_t mean_scale() const;
  void note_factors(const at::Tensor& factors);
  at::Tensor& unit_buffer(int64_t unit);
  std::vector<at::Tensor> dests(const BookLayer& layer);
  void delivered(const BookLayer& layer);
  // Whether delivered(layer) now would hand a unit over.
  bool hands_over(const BookLayer& layer) const;
  void hand_over(int64_t unit);
  void release_if_done(const BookLayer& layer);
  void queue_finish();
  // Records `e` as the error unless one is recorded (a non-privacy failure: what failed where).
  void note_failure(const std::exception& e, const char* where);
  [[noreturn]] void refuse(const std::string& why) const;

  // The autograd engine may run backward nodes of different devices on different threads, and
  // the bindings release the GIL: every public method holds this (recursive: on_backward calls
  // begin_backward and take_rows).
  mutable std::recursive_mutex mutex_;
  const std::vector<BookLayer> layers_;
  const BookOptions options_;
  zero::ZeroState& engine_;
  std::set<int64_t> keep_gathered_;  // Note [early release]: units of generic-path layers

  std::optional<int64_t> expected_rows_;
  int64_t finished_ = 0;  // backward passes that reached the clipping since set_expected_rows
  int64_t hand_out_ = 0;  // micro-batches handed out (set_expected_rows with rows)
  bool padding_ = false;
  mutable std::optional<std::string> error_;  // refuse() records, even from const checks
  bool stale_ = false;
  bool queue_finish_ = false;
  StepStats stats_;
  at::Tensor dropped_;  // 0-dim int64: this step's dropped samples, unread (read_checks, take_stats)

  // This micro-batch.
  int64_t generation_ = 0;
  bool started_ = false;        // a backward of this micro-batch has begun
  bool finish_queued_ = false;  // finish_backward is the running backward's final callback
  std::vector<Part> parts_;
  std::map<int64_t, GroupState> group_state_;
  std::map<int64_t, int64_t> unit_expected_;  // contributions still to come, per unit
  std::map<int64_t, int64_t> unit_uses_;      // Note [early release]
  std::map<int64_t, at::Tensor> unit_buf_;
  std::set<int64_t> direct_;  // units whose buffer is the engine's (Note [private accumulator])
  std::set<int64_t> handed_;
  std::optional<int64_t> batch_;
  at::Tensor dropped_mask_;  // [B] bool
  std::map<InputKey, std::vector<int64_t>> inputs_;  // parts by their noted input
};

}  // namespace dpzero::dp
