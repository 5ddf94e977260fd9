// python/csrc/checkpoint_bindings.cpp — sharded checkpoints (src/checkpoint/checkpoint.h) for
// python/dpzero/checkpoint.py. save and load are collectives: they run without the GIL.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "python/csrc/bindings.h"
#include "src/checkpoint/checkpoint.h"
#include "src/checkpoint/crc32.h"

namespace py = pybind11;

namespace dpzero::python {
namespace {

checkpoint::TensorList tensor_list(const py::dict& tensors, const char* what) {
  checkpoint::TensorList out;
  for (const auto& [key, value] : tensors) {
    if (!py::isinstance<py::str>(key)) {
      throw py::type_error(std::string(what) + ": keys must be str, got " +
                           py::str(py::type::of(key)).cast<std::string>());
    }
    if (!THPVariable_Check(value.ptr())) {
      throw py::type_error(std::string(what) + " '" + key.cast<std::string>() +
                           "' must be a torch.Tensor, got " +
                           py::str(py::type::of(value)).cast<std::string>());
    }
    out.emplace_back(key.cast<std::string>(), value.cast<at::Tensor>());
  }
  return out;
}

}  // namespace

void bind_checkpoint(py::module_ m) {
  m.def(
      "save",
      [](zero::ZeroState& state, const std::string& root, int64_t step, const py::dict& extra,
         const py::dict& shared, const std::string& metadata_json, int64_t keep_last) {
        checkpoint::SaveOptions options;
        options.step = step;
        options.keep_last = keep_last;
        options.metadata_json = metadata_json;
        const checkpoint::TensorList extra_list = tensor_list(extra, "extra");
        const checkpoint::TensorList shared_list = tensor_list(shared, "shared");
        py::gil_scoped_release no_gil;
        return checkpoint::save(state, root, extra_list, shared_list, options);
      },
      py::arg("state"), py::arg("root"), py::arg("step"), py::arg("extra"), py::arg("shared"),
      py::arg("metadata_json"), py::arg("keep_last"),
      "Collective: write a sharded checkpoint of `state` under `root` (Note [checkpoint commit]); "
      "returns the step directory. step < 0: the engine's step counter; keep_last 0: keep all.");
  m.def(
      "load",
      [](zero::ZeroState& state, const std::string& path, const py::dict& shared) {
        const checkpoint::TensorList shared_list = tensor_list(shared, "shared");
        checkpoint::LoadResult r;
        {
          py::gil_scoped_release no_gil;
          r = checkpoint::load(state, path, shared_list);
        }
        py::dict extra;
        for (const auto& [name, tensor] : r.extra) extra[py::str(name)] = tensor;
        py::dict out;
        out["path"] = r.directory;
        out["step"] = r.step;
        out["engine_steps"] = r.engine_steps;
        out["world_size"] = r.world_size;
        out["stage"] = r.stage;
        out["optimizer_json"] = r.optimizer_json;
        out["metadata_json"] = r.metadata_json;
        out["extra"] = extra;
        out["extra_rank"] = r.extra_rank < 0 ? py::object(py::none()) : py::int_(r.extra_rank);
        return out;
      },
      py::arg("state"), py::arg("path"), py::arg("shared"),
      "Collective: load `path` (a root or a step directory) into `state`, resharding as needed, "
      "and copy the saved shared tensors into `shared` (Note [checkpoint resharding]).");
  m.def("resolve", &checkpoint::resolve, py::arg("path"),
        "The step directory `path` denotes (itself, or what its `latest` names).");
  m.def(
      "crc32",
      [](const py::bytes& data) {
        const std::string_view view = data;
        return checkpoint::crc32(view.data(), view.size());
      },
      py::arg("data"), "CRC-32/ISO-HDLC of `data` (the manifest's checksum; equals zlib.crc32).");
  m.attr("FAULT_EXIT_CODE") = checkpoint::kFaultExitCode;
}

}  // namespace dpzero::python
