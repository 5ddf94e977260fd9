// python/csrc/dp_bindings.cpp — dpzero._C.dp: the private step's C++ core (src/dp): the clipping
// book, the DP layers' autograd functions, the step transaction and their typed errors.
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

#include "python/csrc/bindings.h"
#include "src/dp/book.h"
#include "src/dp/clip_group.h"
#include "src/dp/dp_layers.h"
#include "src/dp/errors.h"
#include "src/dp/failpoints.h"
#include "src/dp/generators.h"
#include "src/dp/layer_ops.h"
#include "src/dp/private_step.h"
#include "src/dp/run.h"
#include "src/dp/norm_schedule.h"
#include "src/dp/state_guard.h"
#include "src/comm/collectives.h"
#include "src/zero/state.h"

namespace py = pybind11;

namespace dpzero::python {
namespace {

PyObject* privacy_error_type = nullptr;     // dpzero._C.dp.PrivacyError (lives with the module)
PyObject* collective_error_type = nullptr;  // dpzero._C.dp.CollectiveError

// A CollectiveError as the Python exception with its `charged` attribute: True, False, or None
// (rank 0's ledger may hold the step).
void raise_collective_error(const dp::CollectiveError& error) {
  py::object charged = py::none();
  if (error.charge_state() != dp::ChargeState::kUnknown) {
    charged = py::bool_(error.charge_state() == dp::ChargeState::kCharged);
  }
  py::object instance = py::reinterpret_borrow<py::object>(collective_error_type)(error.what());
  instance.attr("charged") = charged;
  PyErr_SetObject(collective_error_type, instance.ptr());
}

// Note [errors out of the autograd engine] in src/dp/book.h: raised as the Python exception, so
// that it reaches the caller of backward() as dpzero.PrivacyViolation.
[[noreturn]] void raise_privacy_error(const dp::PrivacyError& error) {
  py::gil_scoped_acquire gil;
  PyErr_SetString(privacy_error_type, error.what());
  python_error raised;  // torch's (global namespace): the engine restores it in Python
  raised.persist();
  throw raised;
}

dp::Report report_of(const std::shared_ptr<dp::Book>& book, int64_t generation, int64_t part,
                     std::optional<std::string> refusal) {
  return dp::Report{book, generation, part, std::move(refusal)};
}

}  // namespace

void bind_dp(py::module_ m) {

  // ---- the clipping book (src/dp/book.h) ---------------------------------------------------
  privacy_error_type =
      py::register_exception<dp::PrivacyError>(m, "PrivacyError", PyExc_RuntimeError).ptr();
  dp::set_privacy_error_hook(&raise_privacy_error);
  py::class_<dp::LayerOps, std::shared_ptr<dp::LayerOps>>(
      m, "LayerOps", "What the book does with one DP layer call's A and G (src/dp/layer_ops.h)");
  m.def("linear_ops", &dp::linear_ops, py::arg("train"), py::arg("transposed"),
        "nn.Linear (transposed=False) or HF Conv1D; train: (weight, bias) trained");
  m.def("embedding_ops", &dp::embedding_ops, py::arg("train"), py::arg("num_embeddings"),
        py::arg("padding_idx"), "nn.Embedding; train: (weight,)");
  m.def("norm_ops", &dp::norm_ops, py::arg("train"), py::arg("rms"), py::arg("eps"),
        py::arg("normalized_ndim"),
        "LayerNorm (rms=False; train: (weight, bias)) or RMSNorm (train: (weight,)); eps None: "
        "the input dtype's machine epsilon");
  m.def("conv_ops", &dp::conv_ops, py::arg("train"), py::arg("kernel_size"), py::arg("stride"),
        py::arg("padding"), py::arg("dilation"), py::arg("groups"),
        "nn.Conv1d / nn.Conv2d; train: (weight, bias)");

  py::class_<dp::StepStats>(m, "StepStats", "What one logical step's micro-batches produced")
      .def_readonly("samples", &dp::StepStats::samples)
      .def_readonly("dropped", &dp::StepStats::dropped)
      .def_readonly("micro_batches", &dp::StepStats::micro_batches);

  using Slot = std::optional<std::tuple<int64_t, int64_t, int64_t, std::vector<int64_t>>>;
  using Layer = std::tuple<std::string, std::shared_ptr<dp::LayerOps>, std::vector<Slot>,
                           int64_t, int64_t>;
  py::class_<dp::Book, std::shared_ptr<dp::Book>>(
      m, "Book", "The clipping book of one private model (src/dp/book.h)")
      .def(py::init([](const std::vector<Layer>& layers, std::vector<double> thresholds,
                       std::vector<int64_t> group_components, std::string mode, double gamma,
                       bool mean_loss, std::vector<int64_t> unit_numel,
                       std::vector<at::Device> unit_device, zero::ZeroState& zero) {
             std::vector<dp::BookLayer> book_layers;
             for (const auto& [name, ops, slots, component, group] : layers) {
               dp::BookLayer layer{name, ops, {}, component, group};
               for (const Slot& slot : slots) {
                 if (!slot) {
                   layer.slots.emplace_back();
                   continue;
                 }
                 const auto& [unit, offset, numel, shape] = *slot;
                 layer.slots.push_back(dp::Slot{unit, offset, numel, shape});
               }
               book_layers.push_back(std::move(layer));
             }
             dp::BookOptions options{std::move(thresholds), std::move(group_components),
                                     std::move(mode), gamma, mean_loss, std::move(unit_numel),
                                     std::move(unit_device)};
             return std::make_shared<dp::Book>(std::move(book_layers), std::move(options),
                                               zero);
           }),
           py::arg("layers"), py::arg("thresholds"), py::arg("group_components"),
           py::arg("mode"), py::arg("gamma"), py::arg("mean_loss"), py::arg("unit_numel"),
           py::arg("unit_device"), py::arg("zero"),
           py::keep_alive<1, 10>(),  // the book hands units to the ZeRO state
           "layers: per DP layer (name, LayerOps or None for the generic path, per parameter "
           "(unit, offset, numel, shape) or None where frozen, component, group)")
      .def("set_expected_rows", &dp::Book::set_expected_rows, py::arg("rows"))
      .def("set_padding", &dp::Book::set_padding, py::arg("padding"))
      .def_property_readonly("padding", &dp::Book::padding)
      .def("on_forward", &dp::Book::on_forward, py::arg("layer"))
      .def("set_verdict", &dp::Book::set_verdict, py::arg("part"))
      .def_property_readonly("generation", &dp::Book::generation)
      .def_property_readonly("num_parts", &dp::Book::num_parts)
      .def_property_readonly("open", &dp::Book::open)
      .def("on_backward", &dp::Book::on_backward, py::arg("generation"), py::arg("part"),
           py::arg("a"), py::arg("g"), py::call_guard<py::gil_scoped_release>())
      .def("begin_backward", &dp::Book::begin_backward, py::arg("generation"), py::arg("part"))
      .def("take_rows", &dp::Book::take_rows, py::arg("part"), py::arg("rows"))
      .def(
          "report_per_sample",
          [](dp::Book& book, int64_t part, const std::vector<std::optional<at::Tensor>>& grads) {
            std::vector<at::Tensor> rows;  // None (a frozen parameter) -> undefined
            for (const auto& t : grads) rows.push_back(t.value_or(at::Tensor()));
            book.report_per_sample(part, std::move(rows));
          },
          py::arg("part"), py::arg("grads"), py::call_guard<py::gil_scoped_release>())
      .def(
          "report_per_sample_rows",
          [](dp::Book& book, int64_t part, int64_t begin,
             const std::vector<std::optional<at::Tensor>>& grads) {
            std::vector<at::Tensor> rows;  // None (a frozen parameter) -> undefined
            for (const auto& t : grads) rows.push_back(t.value_or(at::Tensor()));
            book.report_per_sample_rows(part, begin, std::move(rows));
          },
          py::arg("part"), py::arg("begin"), py::arg("grads"),
          py::call_guard<py::gil_scoped_release>())
      .def("discard", &dp::Book::discard)
      .def("read_checks", &dp::Book::read_checks, py::arg("checks"),
           "Reads the flag tensors `checks` and the dropped count in one transfer per device: "
           "per tensor, its flags as bools")
      .def("take_stats", &dp::Book::take_stats)
      .def_property_readonly("micro_batches", &dp::Book::micro_batches)
      .def_property("error", &dp::Book::error, &dp::Book::set_error,
                    "the privacy violation that makes the step refuse, or None")
      .def_property("stale", &dp::Book::stale, &dp::Book::set_stale,
                    "a logical batch accumulated but never stepped when the next one began")
      .def("set_queue_finish", &dp::Book::set_queue_finish, py::arg("on"))
      .def("refuse_backward", &dp::Book::refuse_backward, py::arg("why"),
           "Refuses a backward that may not be clipped, recording `why` as the error");

  // ---- the step transaction (src/dp/private_step.h) ------------------------------------------
  py::register_exception<dp::BudgetExhausted>(m, "BudgetExhausted", PyExc_RuntimeError);
  py::register_exception<dp::UpdateError>(m, "UpdateError", PyExc_RuntimeError);
  // CollectiveError carries its charge state: a translator of its own (registered later, so
  // tried first) raises it with the `charged` attribute.
  collective_error_type =
      py::register_exception<dp::CollectiveError>(m, "CollectiveError", PyExc_RuntimeError).ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const dp::CollectiveError& e) {
      raise_collective_error(e);
    }
  });
  m.def(
      "collective_error_text",
      [](int64_t rank, int64_t world_size, int64_t step, const std::string& what, bool charged,
         const std::string& cause) {
        return dp::collective_error_text(
            rank, world_size, step, what,
            charged ? dp::ChargeState::kCharged : dp::ChargeState::kNotCharged, cause);
      },
      py::arg("rank"), py::arg("world_size"), py::arg("step"), py::arg("what"),
      py::arg("charged"), py::arg("cause"), "The message of a CollectiveError (src/dp/errors.h)");

  py::class_<dp::StepOutcome>(m, "StepOutcome", "What a private step released, and its private "
                                                "diagnostics (samples, dropped)")
      .def_readonly("noise_index", &dp::StepOutcome::noise_index)
      .def_readonly("caller_sampled", &dp::StepOutcome::caller_sampled)
      .def_readonly("samples", &dp::StepOutcome::samples)
      .def_readonly("dropped", &dp::StepOutcome::dropped);
  // ---- the run's rules (src/dp/run.h, Note [one set of rules]) ------------------------------
  py::class_<dp::RunSettings>(m, "RunSettings",
                              "The settings every front door has, as the run's rules read them")
      .def(py::init<>())
      .def_readwrite("noise_multiplier", &dp::RunSettings::noise_multiplier)
      .def_readwrite("allow_no_noise", &dp::RunSettings::allow_no_noise)
      .def_readwrite("max_grad_norm", &dp::RunSettings::max_grad_norm)
      .def_readwrite("sample_rate", &dp::RunSettings::sample_rate)
      .def_readwrite("dataset_size", &dp::RunSettings::dataset_size)
      .def_readwrite("max_physical_batch_size", &dp::RunSettings::max_physical_batch_size)
      .def_readwrite("loss_reduction", &dp::RunSettings::loss_reduction)
      .def_readwrite("clipping", &dp::RunSettings::clipping)
      .def_readwrite("automatic_gamma", &dp::RunSettings::automatic_gamma)
      .def_readwrite("accountant", &dp::RunSettings::accountant)
      .def_readwrite("zero_stage", &dp::RunSettings::zero_stage)
      .def_readwrite("bands", &dp::RunSettings::bands)
      .def_readwrite("strategy", &dp::RunSettings::strategy)
      .def_readwrite("strategy_rows", &dp::RunSettings::strategy_rows)
      .def_readwrite("epsilon_budget", &dp::RunSettings::epsilon_budget)
      .def_readwrite("budget_delta", &dp::RunSettings::budget_delta)
      .def_readwrite("seed", &dp::RunSettings::seed)
      .def_readwrite("secure_mode", &dp::RunSettings::secure_mode)
      .def_readwrite("ledger_path", &dp::RunSettings::ledger_path)
      .def_readwrite("run_id", &dp::RunSettings::run_id);
  m.def("_set_early_norms", &dp::set_early_norms, py::arg("on"),
        "Note [norms when their input is done] (src/dp/book.cpp): whether a Linear's weight norms "
        "are computed when every call on its input has reported, not when its group completes; "
        "returns the previous setting. For tests and benchmarks (src/dp/norm_schedule.h).");
  m.def("_set_norm_stream", &dp::set_norm_stream, py::arg("on"),
        "Note [norms on a side stream] (src/dp/norm_schedule.h): whether early norms are queued "
        "on a second stream of their device (no effect on the CPU); returns the previous setting. "
        "For tests and benchmarks.");
  m.def("check_run_settings", &dp::check_run_settings, py::arg("settings"),
        "ValueError naming the first bad setting and its value");
  m.def("state_fingerprint", &dp::state_fingerprint, py::arg("t"), py::arg("key"),
        "Note [state written from data]: a 0-dim int64 on t's device that any change of a word "
        "of t moves (src/dp/state_guard.h)");
  m.def("state_fingerprints", &dp::state_fingerprints, py::arg("ts"), py::arg("key"),
        "state_fingerprint of each of ts (one device) as one [len(ts)] int64 tensor, in one op "
        "call (src/dp/state_guard.h)");
  m.def(
      "generator_key",
      [](bool secure, int64_t seed, const std::vector<int64_t>& key) {
        const std::array<uint32_t, 8> k = dp::generator_key(dp::NoiseKey{secure, seed, key});
        return std::vector<int64_t>(k.begin(), k.end());
      },
      py::arg("secure"), py::arg("seed"), py::arg("key"),
      "Note [the model's own randomness] (src/dp/generators.h): the run's generator key (eight "
      "words) from its noise key (a secure key's eight words, or a seed)");
  m.def(
      "reseed_generators",
      [](const std::vector<int64_t>& key, const std::string& purpose, int64_t rank, int64_t step,
         int64_t index) {
        static const std::map<std::string, dp::DrawPurpose> purposes{
            {"iter", dp::DrawPurpose::kIter}, {"fetch", dp::DrawPurpose::kFetch},
            {"forward", dp::DrawPurpose::kForward}, {"between", dp::DrawPurpose::kBetween},
            {"worker", dp::DrawPurpose::kWorker}, {"saved", dp::DrawPurpose::kSaved}};
        const auto found = purposes.find(purpose);
        if (found == purposes.end())
          throw std::invalid_argument("reseed_generators: purpose must be iter, fetch, forward, "
                                      "between, worker or saved, got '" + purpose + "'");
        if (key.size() != 8)
          throw std::invalid_argument("reseed_generators: the generator key has 8 words, got " +
                                      std::to_string(key.size()));
        std::array<uint32_t, 8> k{};
        for (size_t i = 0; i < 8; ++i) k[i] = static_cast<uint32_t>(key[i]);
        const std::array<uint32_t, 3> n = dp::draw_nonce(found->second, rank, step, index);
        const dp::GeneratorWords words = dp::generator_words(k, n[0], n[1], n[2]);
        dp::reseed_torch(words, /*cuda=*/false);
        return std::make_pair(static_cast<int64_t>(words.seed),
                              std::vector<int64_t>(words.extra.begin(), words.extra.end()));
      },
      py::arg("key"), py::arg("purpose"), py::arg("rank"), py::arg("step"), py::arg("index"),
      "Note [the model's own randomness]: torch's CPU generator set from the run's generator "
      "key at (purpose, rank, step, index); returns (the CUDA seed, eight words for Python's "
      "random and numpy)");
  m.def(
      "watch_gathered",
      [](zero::ZeroState& state, std::optional<int64_t> key) {
        if (!key) return state.watch_gathered({});
        const int64_t k = *key;
        state.watch_gathered([k](const at::Tensor& t) { return dp::state_fingerprint(t, k); });
      },
      py::arg("state"), py::arg("key"),
      "Note [writes to a gathered unit] (src/zero/flat_param.h): the ZeRO state's stage-3 "
      "gathered copies fingerprinted with state_fingerprint(key) at each gather and release "
      "(None: the watch stops); ZeroState.take_gathered_written() reads the flags");
  m.def("trained_set_refusal", &dp::trained_set_refusal, py::arg("trained"), py::arg("now"),
        "Note [trained set]: the refusal when the trainable tensors among `now` ([(name, "
        "tensor)]) are no longer exactly `trained`, else None");
  py::class_<dp::RunStart>(m, "RunStart", "What start_run decided (src/dp/run.h)")
      .def_readonly("secure", &dp::RunStart::secure)
      .def_readonly("seed", &dp::RunStart::seed)
      .def_property_readonly(
          "key", [](const dp::RunStart& r) { return std::vector<int64_t>(r.key.w, r.key.w + 8); })
      .def_readonly("ledger", &dp::RunStart::ledger)
      .def_readonly("charges", &dp::RunStart::charges)
      .def_readonly("rows", &dp::RunStart::rows)
      .def_property_readonly("first_step", &dp::RunStart::first_step)
      .def_readonly("max_steps", &dp::RunStart::max_steps)
      .def_readonly("budget", &dp::RunStart::budget)
      .def_readonly("strategy", &dp::RunStart::strategy);
  m.def(
      "start_run",
      [](const dp::RunSettings& settings,
         const std::vector<std::tuple<std::string, int64_t, std::string>>& own,
         accounting::Accountant& accountant,
         std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> process_group) {
        std::vector<dp::AgreedSetting> agreed;
        for (const auto& [name, bits, shown] : own) agreed.push_back({name, bits, shown});
        py::gil_scoped_release no_gil;
        return dp::start_run(settings, agreed, comm::Collectives(process_group.value_or(nullptr)),
                             accountant);
      },
      py::arg("settings"), py::arg("own"), py::arg("accountant"), py::arg("process_group"),
      "Note [one set of rules]'s steps on every rank of process_group (None: one process). own: "
      "the front door's own settings as (name, 64 bits, shown). ValueError for a bad or differing "
      "setting or another run's ledger, LedgerError, RuntimeError for a failed collective");
  m.def(
      "agree_settings",
      [](const std::vector<std::tuple<std::string, int64_t, std::string>>& settings,
         std::optional<std::string> refusal,
         std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> process_group) {
        std::vector<dp::AgreedSetting> agreed;
        for (const auto& [name, bits, shown] : settings) agreed.push_back({name, bits, shown});
        py::gil_scoped_release no_gil;
        dp::agree_settings(agreed, refusal, comm::Collectives(process_group.value_or(nullptr)));
      },
      py::arg("settings"), py::arg("refusal"), py::arg("process_group"),
      "ValueError on every rank unless every rank has rank 0's settings ((name, 64 bits, shown)) "
      "and none has a refusal");
  m.def("layer_components", &dp::layer_components, py::arg("params"),
        "Each DP layer's clipping component: layers sharing a trained parameter (params: per "
        "layer, its trained parameters' identities) are one");

  py::class_<dp::PrivateStep, std::shared_ptr<dp::PrivateStep>>(
      m, "PrivateStep", "One private step's transaction on every rank (src/dp/private_step.h)")
      .def(py::init([](std::shared_ptr<dp::Book> book, zero::ZeroState& zero,
                       const dp::RunSettings& settings, const dp::RunStart& run,
                       std::shared_ptr<accounting::Accountant> accountant) {
             return std::make_shared<dp::PrivateStep>(std::move(book), zero, run.ledger,
                                                      run.step_settings(settings),
                                                      std::move(accountant), run.charges,
                                                      run.rows);
           }),
           py::arg("book"), py::arg("zero"), py::arg("settings"), py::arg("run"),
           py::arg("accountant"),
           py::keep_alive<1, 3>(),  // the step updates the ZeRO state
           "run: start_run's outcome (its ledger, charges, budget and key); accountant: a "
           "dpzero._C.accounting accountant, which each charge composes (in C++)")
      .def(
          "take",
          [](dp::PrivateStep& step, int64_t t, int64_t logical_size, bool caller_sampled,
             std::optional<std::string> refusal, std::optional<std::string> bad_settings) {
            return step.take(dp::StepRequest{t, logical_size, caller_sampled, std::move(refusal),
                                             std::move(bad_settings)});
          },
          py::arg("step"), py::arg("logical_size"), py::arg("caller_sampled"), py::arg("refusal"),
          py::arg("bad_settings"), py::call_guard<py::gil_scoped_release>(),
          "The step's transaction (a collective); raises PrivacyError, ValueError or "
          "BudgetExhausted with the batch dropped and nothing charged, LedgerError, or "
          "CollectiveError")
      .def("drop_batch", &dp::PrivateStep::drop_batch, py::call_guard<py::gil_scoped_release>(),
           "Drops the logical batch: the book's micro-batches and the ZeRO state's gradients")
      .def_property_readonly("charges", &dp::PrivateStep::charges)
      .def_property_readonly("rows", &dp::PrivateStep::rows)
      .def_property_readonly("equivalent_steps", &dp::PrivateStep::equivalent_steps)
      .def_property_readonly("accountant", &dp::PrivateStep::accountant)
      .def("restore", &dp::PrivateStep::restore, py::arg("charges"), py::arg("accountant"),
           py::arg("rows") = 0,
           "A checkpoint's charge count, the accountant that holds them, and its rows (one more "
           "than the last step charged)")
      .def(
          "set_noise_key",
          [](dp::PrivateStep& step, const py::object& key) { step.set_noise_key(noise_key(key)); },
          py::arg("noise_key"));

  // ---- DP layers as autograd functions (src/dp/dp_layers.h) ---------------------------------
  m.def(
      "linear",
      [](const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
         bool transposed, const std::shared_ptr<dp::Book>& book, int64_t generation,
         int64_t part, std::optional<std::string> refusal) {
        return dp::dp_linear(x, weight, bias.value_or(at::Tensor()), transposed,
                             report_of(book, generation, part, std::move(refusal)));
      },
      py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("transposed"), py::arg("book"),
      py::arg("generation"), py::arg("part"), py::arg("refusal"),
      "A Linear (HF Conv1D: transposed) call whose backward reports (A, G) to the book's part, "
      "or refuses with `refusal`");
  m.def(
      "embedding",
      [](const at::Tensor& ids, const at::Tensor& weight, std::optional<int64_t> padding_idx,
         const std::shared_ptr<dp::Book>& book, int64_t generation, int64_t part,
         std::optional<std::string> refusal) {
        return dp::dp_embedding(ids, weight, padding_idx,
                                report_of(book, generation, part, std::move(refusal)));
      },
      py::arg("ids"), py::arg("weight"), py::arg("padding_idx"), py::arg("book"),
      py::arg("generation"), py::arg("part"), py::arg("refusal"),
      "An Embedding call whose backward reports (ids, G) to the book's part, or refuses");
  m.def(
      "layer_norm",
      [](const at::Tensor& x, std::vector<int64_t> normalized_shape, const at::Tensor& weight,
         const std::optional<at::Tensor>& bias, double eps, const std::shared_ptr<dp::Book>& book,
         int64_t generation, int64_t part, std::optional<std::string> refusal) {
        return dp::dp_layer_norm(x, std::move(normalized_shape), weight,
                                 bias.value_or(at::Tensor()), eps,
                                 report_of(book, generation, part, std::move(refusal)));
      },
      py::arg("x"), py::arg("normalized_shape"), py::arg("weight"), py::arg("bias"),
      py::arg("eps"), py::arg("book"), py::arg("generation"), py::arg("part"),
      py::arg("refusal"),
      "An nn.LayerNorm call whose backward reports (x, G) to the book's part, or refuses");
}

}  // namespace dpzero::python
