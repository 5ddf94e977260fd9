// python/csrc/module_tree_bindings.cpp — dpzero._C.tree: a model's module tree and its tensors
// read in one C++ pass, for the checks the private step makes on every step and micro-batch
// (python/dpzero/private/trainable.py, state_guard.py). Each answers what a Python walk over the
// same objects would, at a small fraction of its cost; where an answer is "something changed", the
// Python walk runs and names it.
#include <array>
#include <optional>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>

#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include "python/csrc/bindings.h"
#include "src/dp/state_guard.h"

namespace py = pybind11;

namespace dpzero::python {
namespace {

// The three dicts of an nn.Module that hold its tree and its tensors; only the parameters'
// requires_grad is part of the snapshot (asking a module whether it is a tensor goes through
// isinstance's slow path).
constexpr std::array<const char*, 3> kDicts{"_modules", "_buffers", "_parameters"};
constexpr size_t kModules = 0, kBuffers = 1, kParameters = 2;

// Their names as interned str objects, made once: an attribute lookup by a new str each time
// misses the type's attribute cache (keyed by the name's object) and walks the class's MRO, which
// made a snapshot's comparison slower than the Python walk it stands for.
const std::array<PyObject*, 3>& dict_names() {
  static const std::array<PyObject*, 3> names{PyUnicode_InternFromString(kDicts[0]),
                                              PyUnicode_InternFromString(kDicts[1]),
                                              PyUnicode_InternFromString(kDicts[2])};
  return names;
}

// Note [module tree snapshots]
// A snapshot holds, for each module of a listing, the module and its _modules, _buffers and
// _parameters dicts with every key and value in order, as strong references, and each parameter's
// requires_grad. `same` is true exactly when the listing is the same module objects in the
// same order and each still holds the same dict objects with the same keys and values (by
// identity) in the same order and the same requires_grad flags. Strong references make identity
// exact: an object the snapshot holds cannot be freed, so no later object can take its address.
// Whatever a Python walk of these dicts computes (the modules' children, their buffers and
// parameters by name, which are trainable) is then what it computed when the snapshot was taken;
// a module rebinding one of the three attributes, or any insertion, removal or replacement in
// them, makes `same` false. (A change that `same` misses would need a dict mutated and restored
// to the very same objects, which leaves every such walk's answer unchanged too.) A module whose
// attribute is another kind of mapping makes the snapshot incomplete: the Python walks read it.
//
// A check that uses a snapshot decides from what the snapshot holds (`trainable`, `items`), never
// from a walk of the live dicts made before or after it: Python code can run between two reads
// (a __torch_function__ or dispatch mode, a finalizer, a thread), and a verdict taken from one
// state must not be recorded against another. A snapshot is `complete` when every child its
// modules hold is in its listing and every listed module but the root is held as a child; one
// taken after the tree grew past the listing, or shrank below it, is not, and is never `same`,
// so the changed tree is listed again at the next check.
//
// The snapshot shows the garbage collector what it holds (tp_traverse, tp_clear): the modules
// often reach the engine that holds the snapshot (a patched forward), and a cycle through
// references the collector cannot see would never be freed, nor the engine's ledger lock
// released.
class Snapshot {
 public:
  explicit Snapshot(const py::list& modules) {
    bool plain_dicts = true;
    modules_.reserve(modules.size());
    for (const py::handle m : modules) {
      Module copy{py::reinterpret_borrow<py::object>(m), {}};
      for (size_t d = 0; d < kDicts.size(); ++d) {
        py::object dict =
            py::reinterpret_steal<py::object>(PyObject_GetAttr(m.ptr(), dict_names()[d]));
        if (!dict) throw py::error_already_set();
        Dict& out = copy.dicts[d];
        if (!PyDict_Check(dict.ptr())) {  // another mapping: left to the Python walks
          plain_dicts = false;
          out.dict = std::move(dict);
          continue;
        }
        PyObject *key = nullptr, *value = nullptr;
        Py_ssize_t pos = 0;
        while (PyDict_Next(dict.ptr(), &pos, &key, &value)) {
          out.items.emplace_back(py::reinterpret_borrow<py::object>(key),
                                 py::reinterpret_borrow<py::object>(value));
          out.grad.push_back(d == kParameters ? requires_grad(value) : -1);
        }
        out.dict = std::move(dict);
      }
      modules_.push_back(std::move(copy));
    }
    // Complete: every child a listed module holds is listed too (else the tree grew between the
    // listing and this snapshot, and `same` would keep the listing stale).
    std::unordered_set<PyObject*> listed, held;
    for (const Module& m : modules_) listed.insert(m.module.ptr());
    complete_ = plain_dicts;
    for (const Module& m : modules_) {
      for (const auto& [key, child] : m.dicts[kModules].items) {
        if (child.ptr() == Py_None) continue;
        held.insert(child.ptr());
        if (!listed.count(child.ptr())) complete_ = false;
      }
    }
    // And every listed module but the first (the root) is some listed module's child (else a
    // module left the tree after the listing, and `same` would keep listing it).
    for (size_t i = 1; i < modules_.size(); ++i)
      if (!held.count(modules_[i].module.ptr())) complete_ = false;
  }

  bool complete() const { return complete_; }

  // The ids of the parameters it holds that require grad (a trainable set read off the snapshot
  // itself, so that what is checked is what is held).
  std::vector<intptr_t> trainable() const {
    std::vector<intptr_t> out;
    for (const Module& m : modules_) {
      const Dict& params = m.dicts[kParameters];
      for (size_t j = 0; j < params.items.size(); ++j)
        if (params.grad[j] == 1)
          out.push_back(reinterpret_cast<intptr_t>(params.items[j].second.ptr()));
    }
    return out;
  }

  // (module, [(name, buffer)], [(name, parameter)]) of each listed module, as held.
  py::list items() const {
    py::list out;
    for (const Module& m : modules_) {
      py::list buffers, params;
      for (const auto& [key, value] : m.dicts[kBuffers].items)
        buffers.append(py::make_tuple(key, value));
      for (const auto& [key, value] : m.dicts[kParameters].items)
        params.append(py::make_tuple(key, value));
      out.append(py::make_tuple(m.module, buffers, params));
    }
    return out;
  }

  bool same(const py::list& modules) const {
    if (!complete_ || modules.size() != modules_.size()) return false;
    for (size_t i = 0; i < modules_.size(); ++i) {
      PyObject* m = PyList_GET_ITEM(modules.ptr(), static_cast<Py_ssize_t>(i));
      const Module& copy = modules_[i];
      if (m != copy.module.ptr()) return false;
      for (size_t d = 0; d < kDicts.size(); ++d) {
        PyObject* dict = PyObject_GetAttr(m, dict_names()[d]);
        if (dict == nullptr) {  // the Python walk will raise its own error
          PyErr_Clear();
          return false;
        }
        Py_DECREF(dict);  // still referenced by the snapshot when it is the same object
        const Dict& was = copy.dicts[d];
        if (dict != was.dict.ptr()) return false;
        if (PyDict_Size(dict) != static_cast<Py_ssize_t>(was.items.size())) return false;
        PyObject *key = nullptr, *value = nullptr;
        Py_ssize_t pos = 0;
        size_t j = 0;
        while (PyDict_Next(dict, &pos, &key, &value)) {
          if (key != was.items[j].first.ptr() || value != was.items[j].second.ptr() ||
              (d == kParameters && requires_grad(value) != was.grad[j]))
            return false;
          ++j;
        }
      }
    }
    return true;
  }

  // The garbage collector's view of what a snapshot holds (Note [module tree snapshots]).
  int traverse(visitproc visit, void* arg) const {
    for (const Module& m : modules_) {
      Py_VISIT(m.module.ptr());
      for (const Dict& d : m.dicts) {
        Py_VISIT(d.dict.ptr());
        for (const auto& [key, value] : d.items) {
          Py_VISIT(key.ptr());
          Py_VISIT(value.ptr());
        }
      }
    }
    return 0;
  }
  void clear() { modules_.clear(); }

 private:
  // -1: not a tensor; else the tensor's requires_grad.
  static int8_t requires_grad(PyObject* value) {
    if (!THPVariable_Check(value)) return -1;
    return THPVariable_Unpack(value).requires_grad() ? 1 : 0;
  }

  struct Dict {
    py::object dict;
    std::vector<std::pair<py::object, py::object>> items;
    std::vector<int8_t> grad;
  };
  struct Module {
    py::object module;
    std::array<Dict, kDicts.size()> dicts;
  };
  std::vector<Module> modules_;
  bool complete_ = false;
};

// The tensor a Python object holds, or a TypeError naming the position.
const at::Tensor& tensor_at(const py::list& tensors, size_t i, const char* what) {
  PyObject* t = PyList_GET_ITEM(tensors.ptr(), static_cast<Py_ssize_t>(i));
  if (!THPVariable_Check(t))
    throw py::type_error(std::string("tree.") + what + ": tensors[" + std::to_string(i) +
                         "] is a " + Py_TYPE(t)->tp_name + ", not a tensor");
  return THPVariable_Unpack(t);
}

// The places (dp::TensorPlace, src/dp/state_guard.h) of a list of tensors, recorded; `moved`
// compares a list with them in one call.
class Places {
 public:
  explicit Places(const py::list& tensors) {
    places_.reserve(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i)
      places_.emplace_back(tensor_at(tensors, i, "Places"));
  }
  // The positions whose tensor is not where it was recorded (all of them if the count differs).
  std::vector<int64_t> moved(const py::list& tensors) const {
    std::vector<int64_t> out;
    const bool same_count = tensors.size() == places_.size();
    for (size_t i = 0; i < tensors.size(); ++i)
      if (!same_count || dp::TensorPlace(tensor_at(tensors, i, "Places.moved")) != places_[i])
        out.push_back(static_cast<int64_t>(i));
    return out;
  }

 private:
  std::vector<dp::TensorPlace> places_;
};

}  // namespace

void bind_module_tree(py::module_ m) {
  py::class_<Snapshot>(
      m, "Snapshot",
      "Note [module tree snapshots] (python/csrc/module_tree_bindings.cpp): a listing of modules "
      "with their _modules, _buffers and _parameters, held",
      py::custom_type_setup([](PyHeapTypeObject* heap_type) {
        PyTypeObject* type = &heap_type->ht_type;
        type->tp_flags |= Py_TPFLAGS_HAVE_GC;
        type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) {
          Py_VISIT(Py_TYPE(self));
          if (!py::detail::is_holder_constructed(self)) return 0;
          return py::cast<const Snapshot&>(py::handle(self)).traverse(visit, arg);
        };
        type->tp_clear = [](PyObject* self) {
          if (py::detail::is_holder_constructed(self))
            py::cast<Snapshot&>(py::handle(self)).clear();
          return 0;
        };
      }))
      .def(py::init<const py::list&>(), py::arg("modules"))
      .def("same", &Snapshot::same, py::arg("modules"),
           "Whether `modules` is the snapshot's listing with every dict, key, value and "
           "requires_grad as they were (never for an incomplete snapshot)")
      .def_property_readonly("complete", &Snapshot::complete,
                             "Whether every child a listed module held was listed")
      .def("trainable", &Snapshot::trainable,
           "The ids of the held parameters that required grad")
      .def("items", &Snapshot::items,
           "(module, [(name, buffer)], [(name, parameter)]) of each listed module, as held");
  m.def(
      "versions",
      [](const py::list& tensors) {
        std::vector<int64_t> out;
        out.reserve(tensors.size());
        for (size_t i = 0; i < tensors.size(); ++i)
          out.push_back(static_cast<int64_t>(tensor_at(tensors, i, "versions")._version()));
        return out;
      },
      py::arg("tensors"), "Each tensor's version counter (t._version), in one call");
  py::class_<Places>(m, "Places",
                     "Where each of a list of tensors' elements are and how they are read "
                     "(storage, offset, sizes, strides, dtype, negation and conjugation bits), "
                     "recorded")
      .def(py::init<const py::list&>(), py::arg("tensors"))
      .def("moved", &Places::moved, py::arg("tensors"),
           "The positions whose tensor is not where it was recorded (an unreadable place, a "
           "resharded ZeRO stage-3 parameter's, counts as moved)");
  m.def(
      "storage_pointers",
      [](const py::list& tensors) {
        std::vector<std::optional<int64_t>> out;
        out.reserve(tensors.size());
        for (size_t i = 0; i < tensors.size(); ++i) {
          const dp::TensorPlace place(tensor_at(tensors, i, "storage_pointers"));
          out.push_back(place.readable ? std::optional<int64_t>(place.data) : std::nullopt);
        }
        return out;
      },
      py::arg("tensors"),
      "Each tensor's storage's data pointer, in one call; None where it has no storage or it "
      "refuses access (a resharded ZeRO stage-3 parameter)");
}

}  // namespace dpzero::python
