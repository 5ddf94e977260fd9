// python/csrc/privacy_bindings.cpp — Poisson sampling, clipping thresholds and OS-entropy keys
// (privacy/). The noise and clip-factor ops are torch ops (torch.ops.dpzero.*), not bound here.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "privacy/banded.h"
#include "privacy/clipping.h"
#include "privacy/entropy.h"
#include "privacy/poisson.h"
#include "python/csrc/bindings.h"

namespace py = pybind11;

namespace dpzero::python {
namespace {

uint32_t checked_step(int64_t step) {
  if (step < 0 || step > static_cast<int64_t>(UINT32_MAX)) {
    throw std::invalid_argument("step must be in [0, 2^32), got " + std::to_string(step));
  }
  return static_cast<uint32_t>(step);
}

// The sampler's source from Python: an int is a Philox seed; a list of eight 32-bit words is a
// secure-mode ChaCha20 key (from entropy_key()).
privacy::SamplerSource sampler_source(const py::object& seed_or_key) {
  privacy::SamplerSource source;
  if (py::isinstance<py::int_>(seed_or_key)) {
    source.seed = seed_or_key.cast<uint64_t>();
    return source;
  }
  const auto words = seed_or_key.cast<std::vector<int64_t>>();
  if (words.size() != 8) {
    throw std::invalid_argument("a secure sampler key must have 8 words, got " +
                                std::to_string(words.size()));
  }
  source.secure = true;
  for (size_t i = 0; i < 8; ++i) {
    if (words[i] < 0 || words[i] > static_cast<int64_t>(UINT32_MAX)) {
      throw std::invalid_argument("sampler key word " + std::to_string(i) +
                                  " must be in [0, 2^32), got " + std::to_string(words[i]));
    }
    source.key.w[i] = static_cast<uint32_t>(words[i]);
  }
  return source;
}

}  // namespace

void bind_privacy(py::module_ m) {
  using namespace dpzero::privacy;
  m.def(
      "sampler_uniform",
      [](const py::object& seed, int64_t step, uint64_t k) {
        return inclusion_uniform(sampler_source(seed), checked_step(step), k);
      },
      py::arg("seed"), py::arg("step"), py::arg("k"),
      "u(seed, step, k) in [0, 1): example k is in step's batch iff u < q (Note [poisson "
      "schedule]); seed is an int (Philox) or an 8-word key (secure mode).");
  m.def(
      "poisson_logical_batch",
      [](const py::object& seed, int64_t step, int64_t n, double q, int64_t partitions) {
        return poisson_logical_batch(sampler_source(seed), checked_step(step), n, q, partitions);
      },
      py::arg("seed"), py::arg("step"), py::arg("n"), py::arg("q"), py::arg("partitions") = 1,
      "Included example indices of step's logical batch; seed is an int (Philox) or an "
      "8-word key (secure mode, ChaCha20); partitions > 1: Note [cyclic poisson].");
  // Note [banded strategies] (privacy/banded.h).
  py::class_<BandedToeplitz>(m, "BandedToeplitz",
                             "A b-banded lower-triangular Toeplitz strategy C for correlated noise")
      .def(py::init<std::vector<double>>(), py::arg("coefficients"))
      .def_static("identity", &BandedToeplitz::identity)
      .def_static("sqrt_prefix_sum", &BandedToeplitz::sqrt_prefix_sum, py::arg("bands"))
      .def_static("optimized", &BandedToeplitz::optimized, py::arg("bands"), py::arg("n"))
      .def_property_readonly("bands", &BandedToeplitz::bands)
      .def_property_readonly("coefficients", &BandedToeplitz::coefficients)
      .def("next", &BandedToeplitz::next, py::arg("z"), py::arg("previous"),
           "w_t from z_t and the previous w's, newest first")
      .def("column_norm", &BandedToeplitz::column_norm, py::arg("n"), py::arg("i"))
      .def("sensitivity_squared", &BandedToeplitz::sensitivity_squared, py::arg("n"),
           py::arg("separation"), py::arg("max_participations"))
      .def("mean_squared_error", &BandedToeplitz::mean_squared_error, py::arg("n"));
  py::class_<MicroBatchSchedule>(m, "MicroBatchSchedule")
      .def_readonly("logical_batch_size", &MicroBatchSchedule::logical_batch_size)
      .def_readonly("micro_batches", &MicroBatchSchedule::micro_batches);
  m.def(
      "poisson_micro_batches",
      [](const py::object& seed, int64_t step, int64_t n, double q, int64_t rank,
         int64_t world_size, int64_t max_micro_batch, int64_t partitions) {
        return poisson_micro_batches(sampler_source(seed), checked_step(step), n, q, rank,
                                     world_size, max_micro_batch, partitions);
      },
      py::arg("seed"), py::arg("step"), py::arg("n"), py::arg("q"), py::arg("rank"),
      py::arg("world_size"), py::arg("max_micro_batch"), py::arg("partitions") = 1);
  m.def("group_thresholds", &group_thresholds, py::arg("max_norm"), py::arg("num_groups"),
        py::arg("weights") = std::vector<double>{},
        "Per-group thresholds C_l = C sqrt(w_l / sum w) rounded down to float32, with sum C_l^2 "
        "<= C^2 exactly (equal split unless weights are given).");
  m.def(
      "threshold_f32", [](double c) { return static_cast<double>(threshold_f32(c)); },
      py::arg("max_norm"),
      "The float32 threshold the clip factors use for a clip norm C: C rounded toward zero.");
  m.def(
      "entropy_key",
      [] {
        const ChaCha20Key key = entropy_key();
        return std::vector<int64_t>(key.w, key.w + 8);
      },
      "256 bits of OS entropy as eight 32-bit words: the key of add_secure_noise_.");
  m.def("secure_noise", &secure_noise, py::arg("secure_mode"), py::arg("seed"),
        "Note [secure by default] (privacy/entropy.h): whether a run draws in secure mode; "
        "ValueError for secure_mode=True with a seed.");
}

}  // namespace dpzero::python
