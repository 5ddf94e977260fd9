// python/csrc/zero_bindings.cpp — the ZeRO state (src/zero/state.h) and the shard optimizers
// for python/dpzero/zero.py. The process group arrives as torch's own Python ProcessGroup object
// and is converted by torch's pybind11 caster for c10::intrusive_ptr<c10d::ProcessGroup>.
#include <optional>

#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/extension.h>

#include "python/csrc/bindings.h"
#include "src/comm/process_group.h"
#include "src/zero/default_units.h"
#include "src/zero/memory.h"
#include "src/zero/optim.h"
#include "src/zero/state.h"
#include "src/dp/step_noise.h"

namespace py = pybind11;

namespace dpzero::python {
namespace {

zero::OptimizerOptions optimizer_options(const std::string& kind, double lr, double weight_decay,
                                         bool maximize, double momentum, double dampening,
                                         bool nesterov, double beta1, double beta2, double eps,
                                         bool amsgrad) {
  zero::OptimizerOptions o;
  o.kind = zero::parse_optimizer_kind(kind);
  o.lr = lr;
  o.weight_decay = weight_decay;
  o.maximize = maximize;
  o.momentum = momentum;
  o.dampening = dampening;
  o.nesterov = nesterov;
  o.beta1 = beta1;
  o.beta2 = beta2;
  o.eps = eps;
  o.amsgrad = amsgrad;
  return o;
}

c10::intrusive_ptr<c10d::ProcessGroup> process_group_or_null(const py::object& pg) {
  if (pg.is_none()) return {};
  return pg.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
}

// Destroys the engine without the GIL. The engine may hold the last reference to a c10d process
// group, whose destructor joins backend threads; a thread that needs the GIL to finish (Note
// [work references]) would otherwise wait forever on the one joining it.
struct DeleteWithoutGil {
  void operator()(zero::ZeroState* state) const {
    py::gil_scoped_release no_gil;
    delete state;
  }
};

}  // namespace

void bind_zero(py::module_ m) {
  using zero::ZeroState;

  // Note [default units] (src/zero/default_units.h).
  m.attr("ROOT_UNIT") = zero::kRootUnit;
  m.def(
      "default_units",
      [](const std::vector<std::tuple<std::string, int64_t, bool, bool>>& walk) {
        std::vector<zero::ModuleNode> nodes;
        for (const auto& [name, depth, trains, look_through] : walk)
          nodes.push_back(zero::ModuleNode{name, depth, trains, look_through});
        return zero::default_units(nodes);
      },
      py::arg("walk"),
      "The default units of a model from a pre-order walk of its modules below the root: "
      "(qualified name, depth (1: the root's child), trains, look_through) each");
  m.def("owner_unit", &zero::owner_unit, py::arg("param"), py::arg("units"),
        "The innermost of units holding parameter param, else ROOT_UNIT");

  py::class_<zero::ShardOptimizer>(
      m, "ShardOptimizer",
      "An optimizer over one flat fp32 shard, op for op torch.optim's single-tensor path.")
      .def(py::init([](const std::string& kind, double lr, double weight_decay, bool maximize,
                       double momentum, double dampening, bool nesterov,
                       std::pair<double, double> betas, double eps, bool amsgrad) {
             return zero::make_shard_optimizer(optimizer_options(kind, lr, weight_decay, maximize,
                                                                 momentum, dampening, nesterov,
                                                                 betas.first, betas.second, eps,
                                                                 amsgrad));
           }),
           py::arg("kind"), py::arg("lr"), py::arg("weight_decay") = 0.0,
           py::arg("maximize") = false, py::arg("momentum") = 0.0, py::arg("dampening") = 0.0,
           py::arg("nesterov") = false, py::arg("betas") = std::make_pair(0.9, 0.999),
           py::arg("eps") = 1e-8, py::arg("amsgrad") = false)
      .def(
          "step",
          [](zero::ShardOptimizer& self, at::Tensor param, const at::Tensor& grad) {
            at::NoGradGuard no_grad;
            self.step(param, grad);
          },
          py::arg("param"), py::arg("grad"),
          "Update `param` ([n] fp32) in place from `grad` ([n] fp32).")
      .def_property_readonly("steps", &zero::ShardOptimizer::steps)
      .def("state", [](const zero::ShardOptimizer& self) {
        py::dict out;
        for (const auto& [name, tensor] : self.state()) out[py::str(name)] = tensor;
        return out;
      });

  m.def(
      "new_process_group",
      [](const std::string& backend, const std::string& init_method, int64_t rank,
         int64_t world_size, double timeout_s) {
        TORCH_CHECK(timeout_s > 0, "timeout_s must be > 0, got ", timeout_s);
        comm::check_backend(backend);
        const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
        py::gil_scoped_release no_gil;  // blocks until every rank joined
        auto store = comm::make_store(init_method, rank, world_size, timeout);
        return comm::make_process_group(backend, store, rank, world_size, timeout);
      },
      py::arg("backend"), py::arg("init_method"), py::arg("rank"), py::arg("world_size"),
      py::arg("timeout_s") = 1800.0,
      "A c10d ProcessGroup created in C++ (src/comm/process_group.h) without "
      "torch.distributed.init_process_group: backend 'gloo' or 'nccl', init_method "
      "'tcp://HOST:PORT' or 'file:///PATH'. Usable as dpzero.shard(process_group=...).");
  m.def(
      "predict_model_state_bytes",
      [](int64_t stage, double psi, int64_t world_size, double param_bytes, double grad_bytes,
         double optimizer_bytes) {
        const zero::ModelStateBytes b = zero::predict_model_state_bytes(
            zero::parse_stage(stage), psi, world_size, param_bytes, grad_bytes, optimizer_bytes);
        py::dict out;
        out["params"] = b.params;
        out["grads"] = b.grads;
        out["optimizer"] = b.optimizer;
        out["total"] = b.total();
        return out;
      },
      py::arg("stage"), py::arg("psi"), py::arg("world_size"), py::arg("param_bytes"),
      py::arg("grad_bytes"), py::arg("optimizer_bytes"),
      "ZeRO's per-rank model-state bytes (src/zero/memory.h): params, grads, optimizer, total.");
  m.def(
      "optimizer_bytes_per_param",
      [](const std::string& kind, double momentum, bool amsgrad, bool mixed) {
        zero::OptimizerOptions o;
        o.kind = zero::parse_optimizer_kind(kind);
        o.momentum = momentum;
        o.amsgrad = amsgrad;
        return zero::optimizer_bytes_per_param(o, mixed);
      },
      py::arg("kind"), py::arg("momentum") = 0.0, py::arg("amsgrad") = false,
      py::arg("mixed") = false, "K: optimizer state bytes per parameter (fp32 master if mixed).");

  py::class_<ZeroState, std::unique_ptr<ZeroState, DeleteWithoutGil>>(m, "ZeroState",
                        "The ZeRO state of one model (src/zero/state.h). Built by "
                        "dpzero.shard(); every hook body is one call into it.")
      .def(py::init([](const std::vector<std::tuple<std::string, std::vector<at::Tensor>,
                                                    std::vector<std::string>,
                                                    std::vector<int64_t>>>& units,
                       int64_t total_coordinates, int64_t stage, const std::string& optimizer,
                       double lr, double weight_decay, bool maximize, double momentum,
                       double dampening, bool nesterov, std::pair<double, double> betas,
                       double eps, bool amsgrad, const py::object& process_group,
                       int64_t alignment, double grad_scale, bool sync_module_states,
                       at::ScalarType param_dtype, at::ScalarType reduce_dtype,
                       const std::string& shard_boundaries, bool offload_optimizer,
                       bool prefetch, bool offload_params) {
             std::vector<zero::UnitSpec> specs;
             for (const auto& [name, params, names, offsets] : units) {
               specs.push_back({name, params, names, offsets});
             }
             zero::ZeroConfig config;
             config.stage = zero::parse_stage(stage);
             config.optimizer =
                 optimizer_options(optimizer, lr, weight_decay, maximize, momentum, dampening,
                                   nesterov, betas.first, betas.second, eps, amsgrad);
             config.alignment = alignment;
             config.grad_scale = grad_scale;
             config.sync_module_states = sync_module_states;
             config.param_dtype = param_dtype;
             config.reduce_dtype = reduce_dtype;
             config.boundaries = zero::parse_shard_boundaries(shard_boundaries);
             config.offload_optimizer = offload_optimizer;
             config.prefetch = prefetch;
             config.offload_params = offload_params;
             auto pg = process_group_or_null(process_group);
             py::gil_scoped_release no_gil;  // construction broadcasts
             return std::unique_ptr<ZeroState, DeleteWithoutGil>(new ZeroState(
                 std::move(specs), total_coordinates, config, std::move(pg)));
           }),
           py::arg("units"), py::arg("total_coordinates"), py::arg("stage"),
           py::arg("optimizer"), py::arg("lr"), py::arg("weight_decay"), py::arg("maximize"),
           py::arg("momentum"), py::arg("dampening"), py::arg("nesterov"), py::arg("betas"),
           py::arg("eps"), py::arg("amsgrad"), py::arg("process_group"), py::arg("alignment"),
           py::arg("grad_scale"), py::arg("sync_module_states"),
           py::arg("param_dtype") = at::kFloat, py::arg("reduce_dtype") = at::kFloat,
           py::arg("shard_boundaries") = "even", py::arg("offload_optimizer") = false,
           py::arg("prefetch") = true, py::arg("offload_params") = false,
           "units: list of (name, params, param_names, global_offsets) in plan order.")
      .def("pre_forward", &ZeroState::pre_forward, py::arg("unit"),
           py::call_guard<py::gil_scoped_release>())
      .def("post_forward", &ZeroState::post_forward, py::arg("unit"),
           py::call_guard<py::gil_scoped_release>())
      .def("pre_backward", &ZeroState::pre_backward, py::arg("unit"),
           py::call_guard<py::gil_scoped_release>())
      .def("grad_ready", &ZeroState::grad_ready, py::arg("unit"), py::arg("param_index"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "grad_accumulator",
          [](ZeroState& self, int64_t unit) -> std::optional<at::Tensor> {
            at::Tensor acc = self.grad_accumulator(unit);
            if (!acc.defined()) return std::nullopt;
            return acc;
          },
          py::arg("unit"),
          "Note [private accumulator]: unit `unit`'s float32 gradient buffer [padded_numel] in "
          "stages 0-1, into which the private path adds clipped sums in place (and then never "
          "calls add_unit_grad for the unit); None where add_unit_grad must be used.")
      .def("set_private", &ZeroState::set_private, py::arg("on"),
           py::call_guard<py::gil_scoped_release>(),
           "Note [private gradients]: on, gradients reach the step only through add_unit_grad / "
           "grad_accumulator and no parameter .grad views are attached (a .grad written by the "
           "caller is ignored); off restores the views.")
      .def("step", &ZeroState::step, py::call_guard<py::gil_scoped_release>())
      .def(
          "noisy_step",
          [](ZeroState& s, double stddev, int64_t step, double grad_scale, py::object seed,
             py::object key) {
            TORCH_CHECK(seed.is_none() != key.is_none(),
                        "noisy_step: give exactly one of seed (Philox) and key (secure mode)");
            dp::NoiseKey noise_key;
            if (!seed.is_none()) {
              noise_key.seed = seed.cast<int64_t>();
            } else {
              noise_key.secure = true;
              noise_key.key = key.cast<std::vector<int64_t>>();
            }
            dp::StepNoise noise(stddev, std::move(noise_key), step);
            py::gil_scoped_release no_gil;
            s.noisy_step(&noise, grad_scale);
          },
          py::arg("stddev"), py::arg("step"), py::arg("grad_scale"), py::arg("seed") = py::none(),
          py::arg("key") = py::none(),
          "design.md §2 steps 5-7 on the engine: noise N(0, stddev^2) from (seed or key, step) "
          "on exactly the global coordinates this rank updates, scale by grad_scale, update.")
      .def("zero_grad", &ZeroState::zero_grad, py::call_guard<py::gil_scoped_release>())
      .def("take_gathered_written", &ZeroState::take_gathered_written,
           "Note [writes to a gathered unit] in src/zero/flat_param.h: one 0-dim bool per unit "
           "on its device, whether a stage-3 gathered copy changed between its gather and its "
           "release since the last take; resets them")
      .def("full_parameters", &ZeroState::full_parameters, py::arg("unit"),
           py::call_guard<py::gil_scoped_release>(),
           "Unit `unit`'s flat parameters [padded_numel], a copy (all-gathers in stage 3: call "
           "on every rank).")
      .def("set_lr", &ZeroState::set_lr, py::arg("lr"))
      .def(
          "set_optimizer_options",
          [](ZeroState& s, const std::string& kind, double lr, double weight_decay, bool maximize,
             double momentum, double dampening, bool nesterov, std::pair<double, double> betas,
             double eps, bool amsgrad) {
            s.set_optimizer_options(optimizer_options(kind, lr, weight_decay, maximize, momentum,
                                                      dampening, nesterov, betas.first,
                                                      betas.second, eps, amsgrad));
          },
          py::arg("kind"), py::arg("lr"), py::arg("weight_decay"), py::arg("maximize"),
          py::arg("momentum"), py::arg("dampening"), py::arg("nesterov"), py::arg("betas"),
          py::arg("eps"), py::arg("amsgrad"),
          "New hyperparameters for the next steps (src/zero/optim.h set_options); the kind and "
          "amsgrad cannot change.")
      .def("set_decay_exempt", &ZeroState::set_decay_exempt, py::arg("unit"), py::arg("exempt"),
           "Note [weight decay runs] (src/zero/optim.h): unit `unit`'s parameter i gets no "
           "weight decay when exempt[i].")
      .def(
          "gathered_state",
          [](ZeroState& s, int64_t u) {
            std::vector<std::pair<std::string, at::Tensor>> entries;
            {
              py::gil_scoped_release no_gil;  // all-gathers when W > 1
              entries = s.gathered_state(u);
            }
            py::dict out;
            for (const auto& [name, tensor] : entries) out[py::str(name)] = tensor;
            return out;
          },
          py::arg("unit"),
          "Unit `unit`'s 'param' and optimizer state, each [padded_numel] over all ranks (a copy; "
          "a collective when W > 1).")
      .def_property_readonly(
          "optimizer_options",
          [](const ZeroState& s) {
            const zero::OptimizerOptions& o = s.config().optimizer;
            py::dict out;
            out["lr"] = o.lr;
            out["weight_decay"] = o.weight_decay;
            out["maximize"] = o.maximize;
            out["momentum"] = o.momentum;
            out["dampening"] = o.dampening;
            out["nesterov"] = o.nesterov;
            out["betas"] = py::make_tuple(o.beta1, o.beta2);
            out["eps"] = o.eps;
            out["amsgrad"] = o.amsgrad;
            return out;
          },
          "The hyperparameters the next step uses.")
      .def_property_readonly("lr", [](const ZeroState& s) { return s.config().optimizer.lr; })
      .def_property_readonly("steps", &ZeroState::steps)
      .def_property_readonly(
          "stage", [](const ZeroState& s) { return static_cast<int64_t>(s.config().stage); })
      .def_property_readonly("rank", [](const ZeroState& s) { return s.comm().rank(); })
      .def_property_readonly("world_size", [](const ZeroState& s) { return s.comm().world_size(); })
      .def_property_readonly("grad_scale", [](const ZeroState& s) { return s.config().grad_scale; })
      .def_property_readonly("num_units", &ZeroState::num_units)
      .def_property_readonly("needs_grad_hooks", &ZeroState::needs_grad_hooks,
                             "Whether every parameter's post-accumulate-grad hook must call "
                             "grad_ready (stages 2-3, or a reduce dtype unlike the parameters').")
      .def_property_readonly("param_dtype",
                             [](const ZeroState& s) { return s.config().param_dtype; })
      .def_property_readonly("offload_optimizer",
                             [](const ZeroState& s) {
                               return s.config().offload_optimizer || s.config().offload_params;
                             })
      .def_property_readonly("offload_params",
                             [](const ZeroState& s) { return s.config().offload_params; })
      .def_property_readonly("reduce_dtype",
                             [](const ZeroState& s) { return s.config().reduce_dtype; })
      .def_property_readonly("plan", &ZeroState::plan, py::return_value_policy::copy)
      .def(
          "grad_shard",
          [](ZeroState& s, int64_t u) {
            at::Tensor out;
            {
              py::gil_scoped_release no_gil;  // may wait for a reduction in flight
              out = s.unit_at(u).grad_shard();
            }
            return out;
          },
          py::arg("unit"),
          "Stages 2-3: unit `unit`'s reduced gradient of the owned shard so far [shard_numel].")
      .def(
          "unsharded", [](ZeroState& s, int64_t u) { return s.unit_at(u).flat().unsharded(); },
          py::arg("unit"))
      .def(
          "reducing", [](ZeroState& s, int64_t u) { return s.unit_at(u).reducing(); },
          py::arg("unit"), "Note [reduce-scatter overlap]: a reduction of the unit is in flight.")
      .def(
          "optimizer_state",
          [](ZeroState& s, int64_t u) {
            py::dict out;
            for (const auto& [name, tensor] : s.unit_at(u).optimizer().state()) {
              out[py::str(name)] = tensor;
            }
            return out;
          },
          py::arg("unit"))
      .def(
          "kept_range", [](ZeroState& s, int64_t u) { return s.unit_at(u).kept_range(); },
          py::arg("unit"), "The flat coordinates [begin, end) this rank keeps state for.")
      .def(
          "optimizer_steps", [](ZeroState& s, int64_t u) { return s.unit_at(u).optimizer().steps(); },
          py::arg("unit"))
      .def(
          "load_state",
          [](ZeroState& s, int64_t u, const std::map<std::string, at::Tensor>& values,
             int64_t steps) {
            std::vector<std::pair<std::string, at::Tensor>> entries(values.begin(), values.end());
            py::gil_scoped_release no_gil;  // stages 1-2 all-gather
            s.unit_at(u).load_state(entries, steps, s.comm());
          },
          py::arg("unit"), py::arg("values"), py::arg("steps"),
          "Note [checkpoint slices]: restore unit `unit` over kept_range(unit) (collective in "
          "stages 1-2).")
      .def("memory", [](const ZeroState& s) {
        const zero::MemoryStats m = s.memory();
        py::dict out;
        out["params"] = m.param_bytes;
        out["master_params"] = m.master_bytes;
        out["grads"] = m.grad_bytes;
        out["peak_grads"] = m.peak_grad_bytes;
        out["optimizer_state"] = m.optimizer_bytes;
        out["peak_params"] = m.peak_param_bytes;
        out["peak_comm_buffers"] = m.peak_comm_bytes;
        out["host"] = m.host_bytes;
        return out;
      }, "Bytes this rank holds now: params, master_params, grads, optimizer_state; and the "
         "peaks peak_params, peak_comm_buffers; host: the part of master and optimizer state "
         "offloaded to host memory.");
}

}  // namespace dpzero::python
