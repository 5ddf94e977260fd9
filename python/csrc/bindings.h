// python/csrc/bindings.h — one bind_* function per layer, each in its own file.
#pragma once

#include <pybind11/pybind11.h>

namespace dpzero::python {

void bind_accounting(pybind11::module_ m);  // accounting_bindings.cpp
void bind_checkpoint(pybind11::module_ m);  // checkpoint_bindings.cpp
void bind_comm(pybind11::module_ m);        // comm_bindings.cpp
void bind_dp(pybind11::module_ m);          // dp_bindings.cpp
void bind_shard(pybind11::module_ m);       // shard_bindings.cpp
void bind_memory(pybind11::module_ m);      // memory_bindings.cpp
void bind_privacy(pybind11::module_ m);     // privacy_bindings.cpp
void bind_zero(pybind11::module_ m);        // zero_bindings.cpp

}  // namespace dpzero::python
