// python/csrc/module.cpp — PYBIND11_MODULE(dpzero._C): one entry that wires each layer's bindings.
// The torch ops (torch.ops.dpzero.*) register themselves when this module is loaded.
#include <torch/extension.h>

#include "python/csrc/bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "dpzero C++ core: accounting, privacy ops and the ZeRO state";
#ifdef DPZERO_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  dpzero::python::bind_accounting(m.def_submodule("accounting", "Privacy accountants and ledger"));
  dpzero::python::bind_privacy(m.def_submodule("privacy", "Poisson sampling, clipping, entropy"));
  dpzero::python::bind_shard(m.def_submodule("shard", "Shard plans and sharded noise"));
  dpzero::python::bind_zero(m.def_submodule("zero", "The ZeRO state and shard optimizers"));
  dpzero::python::bind_memory(
      m.def_submodule("memory", "Live and peak CPU tensor bytes, counted in the allocator"));
  dpzero::python::bind_checkpoint(
      m.def_submodule("checkpoint", "Sharded checkpoints of the ZeRO state"));
  dpzero::python::bind_comm(m.def_submodule("comm", "Agreements across ranks (int64 collectives)"));
  dpzero::python::bind_dp(m.def_submodule("dp", "The private step's C++ core (src/dp)"));
  dpzero::python::bind_module_tree(
      m.def_submodule("tree", "A model's module tree and tensors read in one pass (the step's checks)"));
}
