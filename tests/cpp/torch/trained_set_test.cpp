// Note [trained set] (src/dp/run.h): the step refuses exactly when the model's trainable tensors
// are no longer the ones trained since the start, and the refusal names what moved.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "src/dp/run.h"

namespace dpzero {
namespace {

using Named = std::vector<std::pair<std::string, at::Tensor>>;

at::Tensor param(bool trainable) { return at::zeros({2}).requires_grad_(trainable); }

TEST(TrainedSet, TheSameTensorsTrainableIsNoRefusal) {
  const at::Tensor w = param(true), b = param(true), frozen = param(false);
  // A tied parameter listed twice, and a frozen one that stays frozen, change nothing.
  EXPECT_EQ(dp::trained_set_refusal({w, b}, Named{{"w", w}, {"b", b}, {"tied", w}, {"f", frozen}}),
            std::nullopt);
}

TEST(TrainedSet, FrozenUnfrozenAndRemovedParametersAreNamed) {
  const at::Tensor w = param(true), b = param(true), f = param(false);
  b.requires_grad_(false);  // frozen since
  f.requires_grad_(true);   // unfrozen since
  const std::optional<std::string> why =
      dp::trained_set_refusal({w, b}, Named{{"w", w}, {"b", b}, {"f", f}});
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("trainable parameters changed"), std::string::npos) << *why;
  EXPECT_NE(why->find("trainable or frozen since: ['b', 'f']"), std::string::npos) << *why;
  EXPECT_EQ(why->find("no longer in the model"), std::string::npos) << *why;

  const at::Tensor w2 = param(true), gone = param(true);
  const std::optional<std::string> removed = dp::trained_set_refusal({w2, gone}, Named{{"w", w2}});
  ASSERT_TRUE(removed.has_value());
  EXPECT_NE(removed->find("(1 trained parameter(s) no longer in the model)"), std::string::npos)
      << *removed;

  // A trained tensor replaced by another one of the same name: the new one is named.
  const at::Tensor old_w = param(true), new_w = param(true);
  const std::optional<std::string> replaced = dp::trained_set_refusal({old_w}, Named{{"w", new_w}});
  ASSERT_TRUE(replaced.has_value());
  EXPECT_NE(replaced->find("['w']; 1 trained parameter(s) no longer in the model"),
            std::string::npos)
      << *replaced;
}

TEST(TrainedSet, ManyMovedParametersAreCutAfterFive) {
  std::vector<at::Tensor> trained;
  Named now;
  for (int i = 0; i < 7; ++i) {
    trained.push_back(param(true));
    now.emplace_back("p" + std::to_string(i), trained.back());
    trained.back().requires_grad_(false);
  }
  const std::optional<std::string> why = dp::trained_set_refusal(trained, now);
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("['p0', 'p1', 'p2', 'p3', 'p4']..."), std::string::npos) << *why;
  EXPECT_EQ(why->find("'p5'"), std::string::npos) << *why;
}

}  // namespace
}  // namespace dpzero
