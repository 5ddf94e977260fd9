// python/csrc/bindings.h — one bind_* function per layer, each in its own file.
#pragma once

#include <pybind11/pybind11.h>

#include "src/dp/step_noise.h"

namespace dpzero::python {

void bind_accounting(pybind11::module_ m);  // accounting_bindings.cpp
void bind_checkpoint(pybind11::module_ m);  // checkpoint_bindings.cpp
void bind_comm(pybind11::module_ m);        // comm_bindings.cpp
void bind_dp(pybind11::module_ m);          // dp_bindings.cpp
void bind_shard(pybind11::module_ m);       // shard_bindings.cpp
void bind_memory(pybind11::module_ m);      // memory_bindings.cpp
void bind_module_tree(pybind11::module_ m); // module_tree_bindings.cpp
void bind_privacy(pybind11::module_ m);     // privacy_bindings.cpp
void bind_zero(pybind11::module_ m);        // zero_bindings.cpp

// A noise key from Python: an int64 Philox seed, or secure mode's 8-word ChaCha20 key
// (shard_bindings.cpp).
dp::NoiseKey noise_key(const pybind11::object& seed_or_key);

}  // namespace dpzero::python
