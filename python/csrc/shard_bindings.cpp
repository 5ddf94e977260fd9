// python/csrc/shard_bindings.cpp — dpzero._C.shard: shard plans and sharded noise (src/zero/).
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "python/csrc/bindings.h"
#include "src/dp/step_noise.h"
#include "src/zero/shard_plan.h"

namespace py = pybind11;

namespace dpzero::python {

dp::NoiseKey noise_key(const py::object& seed_or_key) {
  dp::NoiseKey key;
  if (py::isinstance<py::int_>(seed_or_key)) {
    key.seed = seed_or_key.cast<int64_t>();
  } else {
    key.secure = true;
    key.key = seed_or_key.cast<std::vector<int64_t>>();
  }
  return key;
}

void bind_shard(py::module_ m) {
  using zero::CoordinateRun;
  using zero::UnitLayout;
  py::class_<CoordinateRun>(m, "CoordinateRun")
      .def_readonly("local_offset", &CoordinateRun::local_offset)
      .def_readonly("global_offset", &CoordinateRun::global_offset)
      .def_readonly("length", &CoordinateRun::length)
      .def("__repr__", [](const CoordinateRun& r) {
        return "CoordinateRun(local_offset=" + std::to_string(r.local_offset) +
               ", global_offset=" + std::to_string(r.global_offset) +
               ", length=" + std::to_string(r.length) + ")";
      });
  py::class_<UnitLayout>(m, "UnitLayout",
                         "Flat layout of one unit's parameters and the global coordinates each "
                         "rank owns. params: list of (numel, global_offset).")
      .def(py::init([](const std::vector<std::pair<int64_t, int64_t>>& params, int64_t world_size,
                       int64_t alignment, const std::string& boundaries) {
             std::vector<zero::ParamSpec> specs;
             for (const auto& [numel, offset] : params) specs.push_back({numel, offset});
             return UnitLayout(std::move(specs), world_size, alignment,
                               zero::parse_shard_boundaries(boundaries));
           }),
           py::arg("params"), py::arg("world_size"), py::arg("alignment") = 1,
           py::arg("boundaries") = "even",
           "boundaries: 'even' (equal shards, may cut a parameter) or 'parameters' (Note [ragged "
           "plans]: shard boundaries fall between parameters).")
      .def_property_readonly("padded_numel", &UnitLayout::padded_numel)
      .def_property_readonly("shard_numel", &UnitLayout::shard_numel)
      .def_property_readonly("flat_offsets", &UnitLayout::flat_offsets)
      .def("runs", &UnitLayout::runs)
      .def("runs_for_rank", &UnitLayout::runs_for_rank, py::arg("rank"));
  py::class_<zero::ShardPlan>(m, "ShardPlan",
                              "All units of a model, checked to cover [0, total) exactly once.")
      .def(py::init<std::vector<UnitLayout>, int64_t>(), py::arg("units"),
           py::arg("total_coordinates"))
      .def_property_readonly("units", &zero::ShardPlan::units)
      .def_property_readonly("total_coordinates", &zero::ShardPlan::total_coordinates);
  m.def(
      "add_shard_noise_",
      [](at::Tensor shard, const UnitLayout& layout, int64_t rank, double stddev,
         const py::object& seed, int64_t step) {
        return dp::add_shard_noise_(shard, layout, rank, stddev, noise_key(seed), step);
      },
      py::arg("shard"), py::arg("layout"), py::arg("rank"), py::arg("std"), py::arg("seed"),
      py::arg("step"),
      "Add std * z(seed, step, j) to every coordinate j that `rank` owns in `shard` "
      "(Note [noise ownership]); seed is an int64 Philox seed or secure mode's 8-word key. "
      "Returns how many coordinates were noised.");
}

}  // namespace dpzero::python
