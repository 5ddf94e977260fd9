// src/zero/default_units.cpp — see default_units.h (Note [default units]).
#include "src/zero/default_units.h"

#include <stdexcept>

namespace dpzero::zero {

std::vector<std::string> default_units(const std::vector<ModuleNode>& walk) {
  std::vector<std::string> units;
  // Depths at which nodes are candidates: the root's children, and the children of a trainable
  // look-through node that is itself a candidate.
  int64_t open = 1;  // nodes deeper than this are below a unit or a skipped module
  int64_t previous = 0;
  for (const ModuleNode& node : walk) {
    if (node.depth < 1 || node.depth > previous + 1)
      throw std::invalid_argument("default_units: module '" + node.name + "' at depth " +
                                  std::to_string(node.depth) + " follows one at depth " +
                                  std::to_string(previous) + "; a walk's depths must nest");
    previous = node.depth;
    if (node.depth > open) continue;
    open = node.depth;  // back up to this node's level
    if (!node.trains) continue;
    if (node.look_through) {
      open = node.depth + 1;
    } else {
      units.push_back(node.name);
    }
  }
  return units;
}

std::string owner_unit(const std::string& param, const std::vector<std::string>& units) {
  std::string best = kRootUnit;
  bool found = false;
  for (const std::string& unit : units) {
    if (param.rfind(unit + ".", 0) == 0 && (!found || unit.size() > best.size())) {
      best = unit;
      found = true;
    }
  }
  return best;
}

}  // namespace dpzero::zero
