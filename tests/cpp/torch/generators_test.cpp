// tests/cpp/torch/generators_test.cpp — Note [the model's own randomness] (src/dp/generators.h)
// at the C++ front door: the twister's state against an independent MT19937, and the engine's
// reseeds at each hand-out.
//
// The invariants, each with the mutation that made its test fail:
//   - a reseed sets the CPU generator's whole state: torch's draws equal std::mt19937 loaded with
//     the 624 words (reseed_torch setting only the seed);
//   - two secure engines after torch::manual_seed(0) draw differently at their hand-outs, two
//     seeded ones with one seed alike whatever torch's seed (the reseed at hand_out removed);
//   - a state set between steps, as a load would set it, reaches no later micro-batch (the
//     reseed at hand_out removed).

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <memory>
#include <random>
#include <sstream>
#include <vector>

#include <torch/torch.h>

#include "src/dp/generators.h"
#include "src/dp/modules.h"
#include "src/dp/privacy_engine.h"

namespace dpzero::dp {
namespace {

constexpr int64_t kIn = 4, kClasses = 3, kN = 32;

TEST(Generators, AReseedSetsTheWholeTwisterState) {
  const std::array<uint32_t, 8> key = generator_key(NoiseKey{false, 12345, {}});
  const std::array<uint32_t, 3> nonce = draw_nonce(DrawPurpose::kForward, 1, 2, 3);
  const GeneratorWords words = generator_words(key, nonce[0], nonce[1], nonce[2]);
  reseed_torch(words, /*cuda=*/false);
  const at::Tensor got = torch::rand({64}, torch::kFloat32);
  std::stringstream state;  // libstdc++'s text form: the 624 words, then the position
  for (uint32_t w : words.twister) state << w << ' ';
  state << 624;
  std::mt19937 reference;
  state >> reference;
  for (int64_t i = 0; i < 64; ++i) {
    const float want = static_cast<float>(reference() & 0xFFFFFFu) * (1.0f / 16777216.0f);
    ASSERT_EQ(got[i].item<float>(), want) << "draw " << i;
  }
  // What a 32-bit seed would have drawn is something else.
  torch::manual_seed(words.seed & 0xFFFFFFFFu);
  EXPECT_FALSE(torch::equal(torch::rand({64}, torch::kFloat32), got));
  EXPECT_THROW(draw_nonce(DrawPurpose::kForward, int64_t{1} << 24, 0, 0), std::invalid_argument);
  EXPECT_THROW(generator_key(NoiseKey{true, 0, {1, 2, 3}}), std::invalid_argument);
}

struct Net : torch::nn::Module {
  Net() { fc = register_module("fc", nn::Linear(kIn, kClasses)); }
  at::Tensor forward(const at::Tensor& x) { return fc(x); }
  nn::Linear fc{nullptr};
};

PrivacyOptions options(std::optional<uint64_t> seed) {
  PrivacyOptions o;
  o.noise_multiplier = 0.7;
  o.max_grad_norm = 0.5;
  o.sample_rate = 0.25;
  o.dataset_size = kN;
  o.max_physical_batch_size = 4;
  o.optimizer.lr = 0.1;
  o.seed = seed;
  o.trust_batch_first = true;
  return o;
}

// The first draws after each hand-out of two logical steps (what dropout would draw), with
// torch seeded from `torch_seed` first and, if `between`, torch's generator set to a known state
// after the first step (as a checkpoint's load would set it).
std::vector<float> draws(std::optional<uint64_t> seed, uint64_t torch_seed, bool between = false) {
  torch::manual_seed(torch_seed);
  auto net = std::make_shared<Net>();
  PrivacyEngine engine(net, options(seed));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor x = at::randn({kN, kIn}, gen), y = at::randint(kClasses, {kN}, gen);
  std::vector<float> out;
  for (int s = 0; s < 2; ++s) {
    for (const MicroBatch& mb : engine.sample()) {
      engine.hand_out(mb);
      out.push_back(torch::rand({}).item<float>());
      torch::cross_entropy_loss(net->forward(x.index_select(0, mb.indices())),
                                y.index_select(0, mb.indices()))
          .backward();
    }
    engine.step();
    if (between) torch::manual_seed(123);
  }
  return out;
}

TEST(Generators, TheEnginesDrawsFollowTheRunsSecretNotTorchsSeed) {
  const std::vector<float> secure_a = draws(std::nullopt, 0), secure_b = draws(std::nullopt, 0);
  ASSERT_GE(secure_a.size(), 2u);
  for (size_t i = 0; i < std::min(secure_a.size(), secure_b.size()); ++i)
    EXPECT_NE(secure_a[i], secure_b[i]) << "micro-batch " << i;
  const std::vector<float> seeded = draws(5, 0);
  EXPECT_EQ(draws(5, 1), seeded);         // torch's seed decides nothing
  EXPECT_EQ(draws(5, 0, true), seeded);   // nor a state set between steps
  EXPECT_NE(draws(6, 0), seeded);
}

}  // namespace
}  // namespace dpzero::dp
