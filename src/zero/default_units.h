// src/zero/default_units.h — which modules of a model become ZeRO units when the caller names
// none, and which unit holds each parameter: the rule both front doors (Python's dpzero.shard and
// make_private, the C++ dp::PrivacyEngine) call, each walking its own module tree.
//
// Note [default units]
// ~~~~~~~~~~~~~~~~~~~~
// Every direct child of the model that holds a trainable parameter is a unit, except a child
// that is only a container (ModuleList, ModuleDict, and in Python PEFT's tuner wrappers, whose
// forward PeftModel bypasses): its own children take its place, recursively. Each parameter
// belongs to the innermost unit whose name is a prefix of its name ("blocks.0" holds
// "blocks.0.attn.weight"); parameters in no unit are the root unit's. A unit is all-gathered,
// reduce-scattered and sharded as one flat buffer, so this choice decides the memory and the
// overlap of a sharded run, never its result.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dpzero::zero {

// The name of the unit of parameters that no named unit holds.
inline constexpr const char* kRootUnit = "<root>";

// One module below the model's root, as a front door's pre-order walk of its children lists it.
struct ModuleNode {
  std::string name;           // qualified ("blocks.0")
  int64_t depth = 1;          // 1: a child of the root; a node's children follow it at depth + 1
  bool trains = false;        // it or a module below it holds a trainable parameter
  bool look_through = false;  // a container whose children are units in its place
};

// Note [default units]: the unit names, in walk order. Throws std::invalid_argument for a walk
// whose depths do not nest (a node deeper than its predecessor's depth + 1).
std::vector<std::string> default_units(const std::vector<ModuleNode>& walk);

// Note [default units]: the innermost of `units` holding parameter `param`, else kRootUnit.
std::string owner_unit(const std::string& param, const std::vector<std::string>& units);

}  // namespace dpzero::zero
