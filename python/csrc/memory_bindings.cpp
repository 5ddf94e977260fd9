// python/csrc/memory_bindings.cpp — the tracking CPU allocator (src/memory/cpu_tracker.h) for
// dpzero.planner.measure.
#include <torch/extension.h>

#include "python/csrc/bindings.h"
#include "src/memory/cpu_tracker.h"

namespace py = pybind11;

namespace dpzero::python {

void bind_memory(py::module_ m) {
  m.def("watch_cpu", &memory::watch_cpu,
        "Starts a watcher of CPU tensor bytes (installing the tracking allocator on first use; "
        "Note [tracking CPU allocator]); returns its id.");
  m.def("unwatch_cpu", &memory::unwatch_cpu, py::arg("id"),
        "Drops a watcher; the last one uninstalls the tracking allocator.");
  m.def("cpu_live_bytes", &memory::cpu_live_bytes,
        "Bytes of CPU storages allocated while tracked and not yet freed, on any thread.");
  m.def("cpu_peak_bytes", &memory::cpu_peak_bytes, py::arg("id"),
        "Most live bytes since the watcher started or last reset its peak.");
  m.def("reset_cpu_peak", &memory::reset_cpu_peak, py::arg("id"),
        "Sets the watcher's peak to the live bytes now.");
}

}  // namespace dpzero::python
