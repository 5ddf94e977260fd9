// Note [default units] (src/zero/default_units.h) against units written out by hand for a model
// shaped like a transformer: embeddings, a ModuleList of blocks (looked through), a frozen
// module, a container of nothing trainable, and a head; and each parameter's owner.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "src/zero/default_units.h"

namespace dpzero::zero {
namespace {

TEST(DefaultUnits, ChildrenWithTrainableParametersContainersLookedThrough) {
  // model
  //   emb            trains
  //   blocks         ModuleList, trains
  //     0            trains
  //       attn       trains
  //     1            trains
  //       inner      ModuleDict, trains (below a unit: not a candidate)
  //         a        trains
  //   frozen         holds only frozen parameters
  //     lin
  //   heads          ModuleList of nothing trainable
  //     0
  //   head           trains
  const std::vector<ModuleNode> walk = {
      {"emb", 1, true, false},          {"blocks", 1, true, true},
      {"blocks.0", 2, true, false},     {"blocks.0.attn", 3, true, false},
      {"blocks.1", 2, true, false},     {"blocks.1.inner", 3, true, true},
      {"blocks.1.inner.a", 4, true, false}, {"frozen", 1, false, false},
      {"frozen.lin", 2, false, false},  {"heads", 1, false, true},
      {"heads.0", 2, false, false},     {"head", 1, true, false},
  };
  const std::vector<std::string> units = default_units(walk);
  EXPECT_EQ(units, (std::vector<std::string>{"emb", "blocks.0", "blocks.1", "head"}));
  EXPECT_EQ(owner_unit("blocks.0.attn.weight", units), "blocks.0");
  EXPECT_EQ(owner_unit("blocks.1.inner.a.bias", units), "blocks.1");
  EXPECT_EQ(owner_unit("blocks.10.weight", units), kRootUnit);  // "blocks.1" is no prefix of it
  EXPECT_EQ(owner_unit("scale", units), kRootUnit);
  // The innermost unit wins when units nest (units the caller names may).
  EXPECT_EQ(owner_unit("a.b.c", {"a", "a.b"}), "a.b");
  EXPECT_EQ(owner_unit("a.b.c", {"a.b", "a"}), "a.b");
}

TEST(DefaultUnits, NestedContainersAndAWalkThatDoesNotNest) {
  const std::vector<ModuleNode> nested = {
      {"outer", 1, true, true}, {"outer.inner", 2, true, true}, {"outer.inner.x", 3, true, false},
      {"outer.y", 2, true, false}, {"z", 1, true, false}};
  EXPECT_EQ(default_units(nested), (std::vector<std::string>{"outer.inner.x", "outer.y", "z"}));
  EXPECT_THROW(default_units({{"a", 1, true, false}, {"a.b.c", 3, true, false}}),
               std::invalid_argument);
  EXPECT_TRUE(default_units({}).empty());
}

}  // namespace
}  // namespace dpzero::zero
