// python/csrc/comm_bindings.cpp — the small agreements Python code makes across ranks (a refusal
// on any rank, equal logical batch sizes, rank 0's seed), through src/comm/collectives.h.
//
// Why not torch.distributed from Python: a tensor made in Python has a Python object, and Gloo's
// worker thread may drop the last reference to it after wait() returned — at interpreter exit that
// decref takes the GIL from a finalizing interpreter and std::terminate aborts the process (Note
// [work references]; seen as "terminate called without an active exception" at exit after a
// refused step, whose last collective was such an agreement). The values here live in tensors
// made in C++ that no Python object ever wraps, and the waits run without the GIL.
#include <vector>

#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/extension.h>

#include "python/csrc/bindings.h"
#include "src/comm/collectives.h"

namespace py = pybind11;

namespace dpzero::python {
namespace {

template <typename T>
std::vector<T> all_reduce_sum(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                              const std::vector<T>& values) {
  TORCH_CHECK(pg, "all_reduce_sum: process_group must not be None");
  py::gil_scoped_release no_gil;
  return comm::Collectives(pg).all_reduce_sum(values);
}

}  // namespace

void bind_comm(py::module_ m) {
  m.def("all_reduce_sum", &all_reduce_sum<int64_t>, py::arg("process_group"), py::arg("values"),
        "The elementwise sum over the group's ranks of int64 `values` (the same length on every "
        "rank); a failed peer raises RuntimeError naming the collective and rank.");
  m.def("all_reduce_sum_float64", &all_reduce_sum<double>, py::arg("process_group"),
        py::arg("values"), "all_reduce_sum of float64 `values`.");
  m.def(
      "broadcast",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const std::vector<int64_t>& values,
         int64_t root) {
        TORCH_CHECK(pg, "broadcast: process_group must not be None");
        py::gil_scoped_release no_gil;
        return comm::Collectives(pg).broadcast(values, root);
      },
      py::arg("process_group"), py::arg("values"), py::arg("root") = 0,
      "Group rank `root`'s int64 `values` on every rank (the same length on every rank).");
}

}  // namespace dpzero::python
