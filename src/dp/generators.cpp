// src/dp/generators.cpp — Note [the model's own randomness] (generators.h): the words of a reseed
// (ChaCha20 under the run's generator key) and torch's generators set from them.
#include "src/dp/generators.h"

#include <mutex>
#include <stdexcept>
#include <string>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/MT19937RNGEngine.h>

#include "privacy/chacha20.h"

namespace dpzero::dp {
namespace {

privacy::ChaCha20Key chacha_key(const std::array<uint32_t, 8>& words) {
  privacy::ChaCha20Key key;
  for (int i = 0; i < 8; ++i) key.w[i] = words[static_cast<size_t>(i)];
  return key;
}

}  // namespace

std::array<uint32_t, 8> generator_key(const NoiseKey& key) {
  std::array<uint32_t, 8> base{};
  if (key.secure) {
    if (key.key.size() != 8)
      throw std::invalid_argument("dpzero::dp::generator_key: a secure key has 8 words, got " +
                                  std::to_string(key.key.size()));
    for (size_t i = 0; i < 8; ++i) base[i] = static_cast<uint32_t>(key.key[i]);
  } else {
    const uint64_t seed = static_cast<uint64_t>(key.seed);
    base[0] = static_cast<uint32_t>(seed);
    base[1] = static_cast<uint32_t>(seed >> 32);
  }
  const privacy::ChaCha20Block b = privacy::chacha20_block(chacha_key(base), 0u, 0u, 0u,
                                                           kGeneratorStream);
  std::array<uint32_t, 8> out{};
  for (size_t i = 0; i < 8; ++i) out[i] = b.w[i];
  return out;
}

GeneratorWords generator_words(const std::array<uint32_t, 8>& key, uint32_t nonce0,
                               uint32_t nonce1, uint32_t nonce2) {
  // 624 + 2 + 8 = 634 words: blocks 0..39 of the keystream, in order.
  std::array<uint32_t, 640> stream{};
  const privacy::ChaCha20Key k = chacha_key(key);
  for (uint32_t block = 0; block < 40; ++block) {
    const privacy::ChaCha20Block b = privacy::chacha20_block(k, block, nonce0, nonce1, nonce2);
    for (int i = 0; i < 16; ++i) stream[16 * block + static_cast<uint32_t>(i)] = b.w[i];
  }
  GeneratorWords out;
  for (size_t i = 0; i < 624; ++i) out.twister[i] = stream[i];
  out.seed = ((static_cast<uint64_t>(stream[625]) << 32) | stream[624]) >> 1;  // 63 bits
  for (size_t i = 0; i < 8; ++i) out.extra[i] = stream[626 + i];
  return out;
}

std::array<uint32_t, 3> draw_nonce(DrawPurpose purpose, int64_t rank, int64_t step,
                                   int64_t index) {
  if (rank < 0 || rank >= (int64_t{1} << 24) || step < 0 || step > 0xFFFFFFFFll || index < 0 ||
      index > 0xFFFFFFFFll)
    throw std::invalid_argument("dpzero::dp::draw_nonce: rank must be in [0, 2^24), step and "
                                "index in [0, 2^32), got rank=" + std::to_string(rank) +
                                ", step=" + std::to_string(step) +
                                ", index=" + std::to_string(index));
  return {(static_cast<uint32_t>(purpose) << 24) | static_cast<uint32_t>(rank),
          static_cast<uint32_t>(step), static_cast<uint32_t>(index)};
}

void reseed_torch(const GeneratorWords& words, bool cuda) {
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    auto* cpu = gen.get<at::CPUGeneratorImpl>();
    cpu->set_current_seed(words.seed);  // clears the cached normal samples
    at::mt19937_data_pod pod = at::mt19937(words.seed).data();
    pod.left_ = 1;  // twist before the first draw
    pod.next_ = 0;
    for (size_t i = 0; i < pod.state_.size(); ++i) pod.state_[i] = words.twister[i];
    at::mt19937 engine;
    engine.set_data(pod);
    cpu->set_engine(engine);
  }
  if (cuda && at::hasCUDA()) {
    const int devices = at::detail::getCUDAHooks().deviceCount();
    for (int d = 0; d < devices; ++d) {
      at::Generator gen = at::globalContext().defaultGenerator(
          c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(d)));
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_current_seed(words.seed);
    }
  }
}

void reseed(const std::array<uint32_t, 8>& key, DrawPurpose purpose, int64_t rank, int64_t step,
            int64_t index) {
  const std::array<uint32_t, 3> n = draw_nonce(purpose, rank, step, index);
  reseed_torch(generator_words(key, n[0], n[1], n[2]), /*cuda=*/true);
}

}  // namespace dpzero::dp
