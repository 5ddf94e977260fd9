// tests/cpp/torch/state_guard_test.cpp — Note [state written from data] at the C++ front door
// (src/dp/state_guard.h): the fingerprint against a word-by-word reference, and the engine's
// refusals on a model whose forward writes its state.
//
// The invariants, each with the mutation of state_guard.cpp / privacy_engine.cpp that made its
// test fail:
//   - the fingerprint is the stated sum, in every element size, on the host's pass and on a GPU's
//     one launch, for one tensor and for a list in one call, and every change of one word moves
//     it (the position mixing removed, the lanes' position step or shift changed);
//   - a buffer written from the batch refuses the step, named, charges nothing and is put back
//     (the step's verdict ignored; restore_buffers emptied);
//   - a write in one micro-batch that is gone by the step still refuses it, and every later
//     forward reads the fixed value (check_micro_batch not called, or its flags dropped); so does
//     a write between two steps that the next step's first forward clears (the check before the
//     first micro-batch removed);
//   - an acceptance by name takes no trained parameter's write (record_trained on every accept);
//   - a frozen parameter written refuses every step until accepted by name, and a trained one
//     written in the forward, in place or through .data(), until accepted (fingerprint or
//     version checks removed);
//   - a buffer registered after the engine took the model is refused (structure() emptied);
//   - state only read trains at stages 0-2 on two ranks with each optimizer, the state unchanged
//     (the update writes the parameters' storage without moving their version counters; the
//     guard records the versions after each step all the same);
//   - check_batch_first's forwards leave no trace (its rewind's restore removed), and
//     verify_state names a write made outside the loop;
//   - verify_state on two ranks refuses on both when one rank's state changed (the agreement
//     removed: the other rank passed).

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "src/dp/errors.h"
#include "src/dp/modules.h"
#include "src/dp/privacy_engine.h"
#include "src/dp/state_guard.h"
#include "tests/cpp/common/error_message.h"
#include "tests/cpp/torch/devices.h"
#include "tests/cpp/torch/ranks.h"

namespace dpzero::dp {
namespace {

using testing::contains;
using testing::cuda_available;
using testing::kNoCuda;

constexpr int64_t kIn = 4, kClasses = 3, kN = 64;

// ---- the fingerprint ------------------------------------------------------------------------

// The stated sum, one word at a time in uint64 (wrapping) arithmetic, over the words of Note
// [fingerprint words]: 8-byte words where the byte count is a multiple of 8, else words of the
// element size, sign-extended (bytes zero-extended; a 16-byte element's bytes); each through
// splitmix64's finaliser after XOR with (j + key) times its golden-ratio increment.
int64_t reference_fingerprint(const at::Tensor& t, int64_t key) {
  const at::Tensor c = t.contiguous().cpu();
  const int64_t nbytes = c.numel() * c.element_size();
  const auto* bytes = static_cast<const unsigned char*>(c.data_ptr());
  const int64_t size = nbytes % 8 == 0 ? 8 : c.element_size() <= 8 ? c.element_size() : 1;
  const int64_t words = nbytes / size;
  uint64_t total = 0;
  for (int64_t j = 0; j < words; ++j) {
    int64_t w = 0;
    if (size == 1) w = bytes[j];
    if (size == 2) { int16_t v; std::memcpy(&v, bytes + 2 * j, 2); w = v; }
    if (size == 4) { int32_t v; std::memcpy(&v, bytes + 4 * j, 4); w = v; }
    if (size == 8) std::memcpy(&w, bytes + 8 * j, 8);
    uint64_t z = static_cast<uint64_t>(w) ^
                 ((static_cast<uint64_t>(j) + static_cast<uint64_t>(key)) * 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    total += z ^ (z >> 31);
  }
  return static_cast<int64_t>(total);
}

// On the host's multi-threaded pass and on a GPU's one launch (kernels/cuda/fingerprint.cu; the
// CUDA case skips without one): both give the word-by-word reference's bits.
class StateFingerprint : public ::testing::TestWithParam<at::DeviceType> {
 protected:
  void SetUp() override {
    if (GetParam() == at::kCUDA && !cuda_available()) GTEST_SKIP() << kNoCuda;
  }
};

INSTANTIATE_TEST_SUITE_P(Devices, StateFingerprint, ::testing::Values(at::kCPU, at::kCUDA),
                         [](const auto& info) { return info.param == at::kCUDA ? "Cuda" : "Cpu"; });

TEST_P(StateFingerprint, IsTheStatedSumAndSeesEveryChangedWord) {
  const int64_t key = 0x1234567890ABLL;
  torch::manual_seed(5);
  const std::vector<at::Tensor> tensors{
      torch::randn({7, 3}),                                        // 4-byte words
      torch::randn({5}, at::kDouble),                              // 8
      torch::randn({6}).to(at::kBFloat16),                         // 2, negative words
      // Eight lanes a step and a tail on a CPU with AVX-512 (kernels/cpu/fingerprint_simd.h); more
      // than one thread's range (2^16 words) with a tail.
      torch::randn({37}).to(at::kBFloat16), torch::randn({19}, at::kDouble),
      torch::randn({(int64_t{1} << 17) + 11}).to(at::kBFloat16),
      torch::randint(-100, 100, {9}, at::TensorOptions().dtype(at::kChar)),  // 1 (as bytes)
      torch::rand({4}).gt(0.5),                                    // bool
      torch::randn({3}, at::kComplexDouble),                       // 16: bytes
      torch::randn({(int64_t{1} << 20) + 5}),                      // many blocks, a tail
      torch::randn({4, 6}).t(),                                    // not contiguous
      torch::empty({0}),
      // Byte counts that are multiples of 8: 8-byte words (Note [fingerprint words]), from
      // float32, bfloat16 and bytes, with lane tails and past one thread's range; and a view whose
      // bytes start 4 bytes past an 8-byte boundary (copied first on the host).
      torch::randn({8, 5}), torch::randn({(int64_t{1} << 18) + 6}),
      torch::randn({(int64_t{1} << 17) + 12}).to(at::kBFloat16),
      torch::randint(-100, 100, {24}, at::TensorOptions().dtype(at::kChar)),
      torch::randn({19}).narrow(0, 1, 18),
  };
  const at::Device device(GetParam());
  // The fingerprint of `t` moved to the device under test, read on the host.
  const auto fp = [&](const at::Tensor& t, int64_t k) {
    return state_fingerprint(t.to(device), k).item<int64_t>();
  };
  for (const at::Tensor& t : tensors) {
    const std::string what = std::string(c10::toString(t.scalar_type())) + " " +
                             c10::str(t.sizes());
    const at::Tensor on_device = state_fingerprint(t.to(device), key);
    ASSERT_EQ(on_device.dim(), 0) << what;
    ASSERT_EQ(on_device.device(), device) << what;
    const int64_t f = on_device.item<int64_t>();
    EXPECT_EQ(f, reference_fingerprint(t, key)) << what;
    EXPECT_EQ(fp(t.clone(), key), f) << what;
    // The same bytes at an odd offset of another storage: the same words, so the same sum.
    at::Tensor shifted = torch::empty({t.numel() + 1}, t.options()).narrow(0, 1, t.numel());
    shifted.copy_(t.contiguous().reshape({-1}));
    EXPECT_EQ(fp(shifted.view(t.contiguous().sizes()), key), f) << what << " at an odd offset";
    if (t.numel() == 0) continue;
    EXPECT_NE(fp(t, key + 1), f) << what;
    // The top bits of two 8-byte words flipped together (two float64 entries negated): a
    // linear sum of w_j m_j, m_j odd, moved by 2^63 twice and did not see it.
    if (t.element_size() == 8 && t.numel() >= 2) {
      at::Tensor negated = t.contiguous().reshape({-1}).clone();
      at::Tensor words = negated.view(at::kLong);
      words.narrow(0, 0, 2).bitwise_xor_(std::numeric_limits<int64_t>::min());
      EXPECT_NE(fp(negated, key), f) << what;
    }
    // Each byte of the first and last element flipped in turn.
    at::Tensor flat = t.contiguous().reshape({-1});
    at::Tensor bytes = flat.view(at::kByte);
    for (int64_t i : {int64_t{0}, bytes.numel() - 1}) {
      at::Tensor changed = bytes.clone();
      changed[i] = changed[i].item<int64_t>() ^ 0x10;
      EXPECT_NE(fp(changed.view(t.scalar_type()), key), f) << what << " byte " << i;
    }
  }
}

TEST_P(StateFingerprint, AListIsEachTensorsFingerprintInOneCall) {
  // More than one launch's 96 tensors on a GPU, of every word size, empty ones among them, and
  // lengths from one word to several blocks' worth.
  const int64_t key = 0x5EED;
  const at::Device device(GetParam());
  torch::manual_seed(6);
  std::vector<at::Tensor> tensors;
  for (int64_t l = 0; l < 203; ++l) {
    const int64_t n = l % 7 == 0 ? 0 : (l * 977) % 5000 + (l % 3 == 0 ? 70000 : 1);
    switch (l % 4) {
      case 0: tensors.push_back(torch::randn({n})); break;
      case 1: tensors.push_back(torch::randn({n}).to(at::kBFloat16)); break;
      case 2: tensors.push_back(torch::randn({n}, at::kDouble)); break;
      default: tensors.push_back(torch::randint(0, 256, {n}).to(at::kByte));
    }
  }
  std::vector<at::Tensor> on_device;
  for (const at::Tensor& t : tensors) on_device.push_back(t.to(device));
  const at::Tensor all = state_fingerprints(on_device, key);
  ASSERT_EQ(all.sizes(), at::IntArrayRef({203}));
  ASSERT_EQ(all.device(), device);
  const at::Tensor host = all.cpu();
  for (size_t l = 0; l < tensors.size(); ++l)
    EXPECT_EQ(host[l].item<int64_t>(), reference_fingerprint(tensors[l], key)) << "tensor " << l;
}

// ---- the engine -----------------------------------------------------------------------------

// State held one level down, for dotted names: a buffer the forward may write, a buffer it only
// reads, and a frozen parameter it multiplies by.
struct Inner : torch::nn::Module {
  Inner() {
    seen = register_buffer("seen", torch::zeros({kIn}));
    shift = register_buffer("shift", torch::full({kIn}, 0.25));
    scale = register_parameter("scale", torch::ones({kIn}), /*requires_grad=*/false);
  }
  at::Tensor seen, shift, scale;
};

enum class Write {
  kNone, kBuffer, kFirstForwardOnly, kFrozen, kTrained, kTrainedData, kClear,
  kTrainedIntoWeights, kTrainedNegated  // the bias re-pointed inside its unit's memory
};

struct Stateful : torch::nn::Module {
  Stateful() {
    torch::manual_seed(3);
    fc = register_module("fc", nn::Linear(kIn, kClasses));
    inner = register_module("inner", std::make_shared<Inner>());
  }
  at::Tensor forward(const at::Tensor& x) {
    ++forwards;
    {
      torch::NoGradGuard no_grad;
      read.push_back(inner->seen.abs().sum().item<double>());
      if (write == Write::kBuffer || (write == Write::kFirstForwardOnly && forwards == 1))
        inner->seen.add_(x.sum(0));  // the batch's sum: data in the model's state
      if (write == Write::kFrozen) inner->scale.add_(x.sum(0) * 1e-3);
      if (write == Write::kTrained) fc->weight.mul_(0.5);
      if (write == Write::kTrainedData)  // no version counter moves: a data-dependent init
        fc->bias.data().copy_(x.mean(0).narrow(0, 0, kClasses));
      if (write == Write::kClear) inner->seen.zero_();  // read above, then cleared
      // No version counter moves and no byte changes: only where the bias reads from.
      if (write == Write::kTrainedIntoWeights && forwards == 1)
        fc->bias.set_data(fc->weight.data().reshape({-1}).narrow(0, 0, kClasses));
      if (write == Write::kTrainedNegated && forwards == 1)
        fc->bias.set_data(fc->bias.data()._neg_view());
    }
    return fc((x + inner->shift) * inner->scale);
  }
  nn::Linear fc{nullptr};
  std::shared_ptr<Inner> inner;
  Write write = Write::kNone;
  int64_t forwards = 0;
  std::vector<double> read;  // |seen| as each forward read it
};

std::pair<at::Tensor, at::Tensor> data() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  return {at::randn({kN, kIn}, gen), at::randint(kClasses, {kN}, gen)};
}

PrivacyOptions options() {
  PrivacyOptions o;
  o.noise_multiplier = 0.7;
  o.max_grad_norm = 0.5;
  o.sample_rate = 0.25;
  o.dataset_size = kN;
  o.max_physical_batch_size = 4;  // several micro-batches a step
  o.optimizer.lr = 0.4;
  o.seed = 99;
  o.trust_batch_first = true;
  return o;
}

// One logical step: every micro-batch of sample() forward and backward, then step(); returns how
// many micro-batches it had.
size_t train_step(PrivacyEngine& engine, Stateful& net) {
  const auto [x, y] = data();
  const std::vector<MicroBatch> batches = engine.sample();
  for (const MicroBatch& mb : batches) {
    engine.hand_out(mb);
    torch::cross_entropy_loss(net.forward(x.index_select(0, mb.indices())),
                              y.index_select(0, mb.indices()))
        .backward();
  }
  engine.step();
  return batches.size();
}

std::string refusal(PrivacyEngine& engine, Stateful& net) {
  return testing::error_message<PrivacyError>([&] { train_step(engine, net); });
}

TEST(PrivacyEngineState, ABufferWrittenFromTheBatchRefusesTheStepAndIsPutBack) {
  auto net = std::make_shared<Stateful>();
  PrivacyEngine engine(net, options());
  net->write = Write::kBuffer;
  const std::string why = refusal(engine, *net);
  EXPECT_TRUE(contains(why, "buffer 'inner.seen' of module 'inner'") &&
              contains(why, "accept_state_change"))
      << why;
  EXPECT_FALSE(contains(why, "inner.shift")) << why;
  EXPECT_EQ(engine.charges(), 0);
  EXPECT_TRUE(torch::equal(net->inner->seen, torch::zeros({kIn})));  // nothing of it remains
  engine.zero_grad();
  net->write = Write::kNone;
  train_step(engine, *net);
  EXPECT_EQ(engine.charges(), 1);
  engine.verify_state();
}

TEST(PrivacyEngineState, AWriteGoneByTheStepStillRefusesItAndLaterForwardsReadTheFixedValue) {
  auto net = std::make_shared<Stateful>();
  PrivacyEngine engine(net, options());
  net->write = Write::kFirstForwardOnly;  // the second hand-out puts it back
  const std::string why = testing::error_message<PrivacyError>([&] { train_step(engine, *net); });
  EXPECT_TRUE(contains(why, "buffer 'inner.seen'")) << why;
  ASSERT_GE(net->forwards, 2) << "the step needs several micro-batches";
  for (size_t i = 0; i < net->read.size(); ++i) EXPECT_EQ(net->read[i], 0.0) << "forward " << i;
  EXPECT_EQ(engine.charges(), 0);
}

TEST(PrivacyEngineState, AFrozenParameterWrittenRefusesEveryStepUntilAccepted) {
  auto net = std::make_shared<Stateful>();
  PrivacyEngine engine(net, options());
  net->write = Write::kFrozen;
  EXPECT_TRUE(contains(refusal(engine, *net), "frozen parameter 'inner.scale' of module 'inner'"));
  engine.zero_grad();
  net->write = Write::kNone;  // it cannot be put back: still changed
  EXPECT_TRUE(contains(refusal(engine, *net), "frozen parameter 'inner.scale'"));
  EXPECT_THROW(engine.verify_state(), PrivacyError);
  engine.zero_grad();
  EXPECT_TRUE(contains(testing::error_message<std::invalid_argument>(
                           [&] { engine.accept_state_change({"inner.nope"}); }),
                       "'inner.nope' names no buffer or frozen parameter"));
  engine.accept_state_change({"inner.scale"});
  train_step(engine, *net);
  EXPECT_EQ(engine.charges(), 1);
}

TEST(PrivacyEngineState, ATrainedParameterWrittenInTheForwardIsRefusedUntilAccepted) {
  for (const auto& [write, name] : {std::pair{Write::kTrained, "fc.weight"},
                                    std::pair{Write::kTrainedData, "fc.bias"}}) {
    auto net = std::make_shared<Stateful>();
    PrivacyEngine engine(net, options());
    net->write = write;
    // Named alone by its version counter, or with the unit's others by its buffer's fingerprint.
    const std::string why = refusal(engine, *net);
    EXPECT_TRUE(contains(why, std::string("'") + name + "'") &&
                contains(why, "written outside the private step"))
        << why;
    engine.zero_grad();
    net->write = Write::kNone;
    EXPECT_THROW(train_step(engine, *net), PrivacyError);
    engine.zero_grad();
    engine.accept_state_change();
    train_step(engine, *net);
    EXPECT_EQ(engine.charges(), 1);
  }
}

// A trained parameter pointed at another part of its unit's memory, or at a negated view of its
// own, moves no version and no byte: its recorded place (TensorPlace) sees it.
TEST(PrivacyEngineState, ATrainedParameterRePointedInsideItsMemoryIsRefused) {
  for (const Write write : {Write::kTrainedIntoWeights, Write::kTrainedNegated}) {
    auto net = std::make_shared<Stateful>();
    PrivacyEngine engine(net, options());
    net->write = write;
    const std::string why = refusal(engine, *net);
    EXPECT_TRUE(contains(why, "trainable parameter 'fc.bias' was given other memory")) << why;
    EXPECT_EQ(engine.charges(), 0);
    EXPECT_THROW(engine.verify_state(), PrivacyError);
  }
}

// An evaluation on training rows between two steps writes the buffer; the next step's first
// forward reads and clears it: the check before the first micro-batch refuses that step (a review
// moved two steps 2.6 times the bound this way when only later micro-batches were checked).
TEST(PrivacyEngineState, AWriteBetweenStepsThatTheNextForwardClearsIsRefused) {
  auto net = std::make_shared<Stateful>();
  PrivacyEngine engine(net, options());
  train_step(engine, *net);
  const auto [x, y] = data();
  net->write = Write::kBuffer;
  {
    torch::NoGradGuard no_grad;
    net->forward(x.narrow(0, 0, 8));
  }
  net->write = Write::kClear;
  EXPECT_TRUE(contains(refusal(engine, *net), "buffer 'inner.seen'"));
  EXPECT_EQ(engine.charges(), 1);
  for (size_t i = 2; i < net->read.size(); ++i)  // the training forwards read the fixed value
    EXPECT_EQ(net->read[i], 0.0) << "forward " << i;
}

// Accepting a buffer by name takes nothing else: a trained parameter written from the data stays
// refused (a review laundered such a write through an unrelated buffer's acceptance).
TEST(PrivacyEngineState, ANamedAcceptanceTakesNoTrainedParametersWrite) {
  auto net = std::make_shared<Stateful>();
  PrivacyEngine engine(net, options());
  net->write = Write::kTrainedData;
  EXPECT_TRUE(contains(refusal(engine, *net), "'fc.bias'"));
  engine.zero_grad();
  net->write = Write::kNone;
  engine.accept_state_change({"inner.seen"});
  EXPECT_TRUE(contains(refusal(engine, *net), "'fc.bias'"));
  EXPECT_THROW(engine.verify_state(), PrivacyError);
  EXPECT_EQ(engine.charges(), 0);
}

TEST(PrivacyEngineState, StateRegisteredAfterTheEngineTookTheModelIsRefused) {
  auto net = std::make_shared<Stateful>();
  PrivacyEngine engine(net, options());
  net->inner->register_buffer("late", torch::zeros({2}));
  const std::string why = refusal(engine, *net);
  EXPECT_TRUE(contains(why, "buffer 'inner.late'") && contains(why, "registered after")) << why;
  engine.zero_grad();
  engine.accept_state_change({"inner.late"});
  train_step(engine, *net);
  EXPECT_EQ(engine.charges(), 1);
}

// State that is only read trains at every stage this door has (SGD, Adam and AdamW), on two
// ranks, step after step, parameter() and verify_state() between steps; the state stays what it
// was.
TEST(PrivacyEngineState, StateOnlyReadTrainsAtStagesZeroToTwoOnTwoRanks) {
  for (int64_t stage : {0, 1, 2}) {
    std::vector<std::shared_ptr<Stateful>> nets;
    for (int r = 0; r < 2; ++r) nets.push_back(std::make_shared<Stateful>());
    testing::run_ranks(2, std::chrono::seconds(60), [&](int rank, auto pg) {
      Stateful& net = *nets[rank];
      PrivacyOptions o = options();
      o.zero_stage = stage;
      const zero::OptimizerKind kinds[] = {zero::OptimizerKind::kSgd, zero::OptimizerKind::kAdam,
                                           zero::OptimizerKind::kAdamW};
      o.optimizer.kind = kinds[stage];
      o.optimizer.weight_decay = 0.01;
      PrivacyEngine engine(nets[rank], o, pg);
      for (int s = 0; s < 3; ++s) {
        train_step(engine, net);
        engine.parameter("fc.weight");
        engine.verify_state();
      }
      EXPECT_EQ(engine.charges(), 3) << "stage " << stage;
      EXPECT_TRUE(torch::equal(net.inner->seen, torch::zeros({kIn})));
      EXPECT_TRUE(torch::equal(net.inner->scale, torch::ones({kIn})));
    });
  }
}

// verify_state is agreed: a write on one rank (an evaluation there) refuses the release on every
// rank, since what one rank releases can hold another's writes (parameter() gathers the shards).
TEST(PrivacyEngineState, VerifyStateRefusesOnEveryRankWhenOneRanksStateChanged) {
  std::vector<std::shared_ptr<Stateful>> nets;
  for (int r = 0; r < 2; ++r) nets.push_back(std::make_shared<Stateful>());
  std::vector<std::string> why(2);
  testing::run_ranks(2, std::chrono::seconds(60), [&](int rank, auto pg) {
    Stateful& net = *nets[rank];
    PrivacyOptions o = options();
    o.zero_stage = 1;
    PrivacyEngine engine(nets[rank], o, pg);
    train_step(engine, net);
    engine.verify_state();  // nothing changed anywhere: passes on both
    if (rank == 1) {  // an evaluation on training rows, outside the loop, on rank 1 only
      net.write = Write::kBuffer;
      torch::NoGradGuard no_grad;
      net.forward(data().first.narrow(0, 0, 8));
      net.write = Write::kNone;
    }
    why[rank] = testing::error_message<PrivacyError>([&] { engine.verify_state(); });
    if (rank == 1) engine.accept_state_change({"inner.seen"});
    engine.verify_state();  // accepted where it changed: passes on both again
  });
  EXPECT_TRUE(contains(why[1], "buffer 'inner.seen'")) << why[1];
  EXPECT_TRUE(contains(why[0], "rank(s) 1") && contains(why[0], "accept_state_change"))
      << why[0];
}

TEST(PrivacyEngineState, TheBatchFirstCheckLeavesNoTraceAndVerifyStateSeesAnEvaluation) {
  auto net = std::make_shared<Stateful>();
  PrivacyOptions o = options();
  o.trust_batch_first = false;
  PrivacyEngine engine(net, o);
  const auto [x, y] = data();
  net->write = Write::kBuffer;
  engine.check_batch_first([&](const at::Tensor& rows) {
    return torch::nn::functional::cross_entropy(
        net->forward(x.index_select(0, rows)), y.index_select(0, rows),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  });
  EXPECT_TRUE(torch::equal(net->inner->seen, torch::zeros({kIn})));
  net->write = Write::kNone;
  train_step(engine, *net);
  EXPECT_EQ(engine.charges(), 1);
  // An evaluation on training rows, outside the loop, that writes the buffer.
  net->write = Write::kBuffer;
  {
    torch::NoGradGuard no_grad;
    net->forward(x.narrow(0, 0, 8));
  }
  const std::string why = testing::error_message<PrivacyError>([&] { engine.verify_state(); });
  EXPECT_TRUE(contains(why, "verify_state") && contains(why, "buffer 'inner.seen'")) << why;
  engine.accept_state_change({"inner.seen"});  // say, a value the caller computed from public data
  engine.verify_state();
}

}  // namespace
}  // namespace dpzero::dp
