// tests/cpp/torch/privacy_engine_test.cpp — the C++ front door (src/dp/privacy_engine.h) with the
// example's models (experiments/cpp_api/models.h), on 1 and 2 ranks (threads, real Gloo groups).
// tests/python/test_cpp_api.py compares it with the Python front door; here it is held to an
// independent per-example reference and to its refusals.
//
// The invariants, each with the mutation of privacy_engine.cpp that made its test fail:
//   - a step is the DP-SGD step of a per-example autograd loop over the Poisson batch (flat
//     clipping at C, σC·z(seed, 0, j) at global coordinate j, SGD with lr / (q·N)) on 1 and 2
//     ranks (parameters numbered in reverse; the threshold 2C);
//   - a module with trainable parameters outside the DP modules is refused, named (the check
//     removed);
//   - a forward while no micro-batch is handed out, a parameter used outside its DP module, a
//     step missing a micro-batch or a changed trainable set are refused and charge nothing (each
//     check removed);
//   - the ledger holds every charged step, and the budget stops at the steps ε allows;
//   - hand_out takes only sample()'s micro-batches, unchanged, never into an own_batch batch; a
//     BatchNorm and a second engine on one model are refused; the ranks agree on the seed and
//     the settings (each check removed);
//   - check_batch_first refuses a DP layer whose input has the examples off dim 0 or mixed
//     across rows (the forward comparison removed), a loss that mixes the rows after it (the
//     gradient test removed), and steps wait for it (the step's check removed).

#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "accounting/calibrate.h"
#include "accounting/ledger.h"
#include "experiments/cpp_api/models.h"
#include "privacy/clipping.h"
#include "privacy/noise.h"
#include "privacy/poisson.h"
#include "src/dp/errors.h"
#include "src/dp/privacy_engine.h"
#include "tests/cpp/common/error_message.h"
#include "tests/cpp/common/temp_dir.h"
#include "tests/cpp/torch/ranks.h"

namespace dpzero::dp {
namespace {

using example::Mlp;
using testing::contains;
using testing::run_ranks;

constexpr int64_t kIn = 6, kHidden = 5, kClasses = 3, kN = 64;
constexpr double kC = 0.5, kQ = 0.25, kSigma = 0.7, kLr = 0.4;
constexpr uint64_t kSeed = 99;

// The dataset: the same on every rank.
std::pair<at::Tensor, at::Tensor> data() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  return {at::randn({kN, kIn}, gen), at::randint(kClasses, {kN}, gen)};
}

Mlp model() {
  torch::manual_seed(3);
  return Mlp(kIn, kHidden, kClasses);
}

PrivacyOptions options() {
  PrivacyOptions o;
  o.noise_multiplier = kSigma;
  o.max_grad_norm = kC;
  o.sample_rate = kQ;
  o.dataset_size = kN;
  o.max_physical_batch_size = 4;
  o.optimizer.lr = kLr;
  o.seed = kSeed;
  o.trust_batch_first = true;  // the Mlp is batch-first; BatchFirst* tests check the check
  return o;
}

// check_batch_first with the dataset's rows through `forward`.
template <typename Net>
void check_batch_first(PrivacyEngine& engine, Net& net) {
  const auto [x, y] = data();
  engine.check_batch_first([&](const at::Tensor& rows) {
    return torch::nn::functional::cross_entropy(
        net->forward(x.index_select(0, rows)), y.index_select(0, rows),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  });
}

// One logical step through the engine: every micro-batch of sample() forward and backward.
template <typename Net>
void train_step(PrivacyEngine& engine, Net& net) {
  const auto [x, y] = data();
  for (const MicroBatch& mb : engine.sample()) {
    engine.hand_out(mb);
    torch::cross_entropy_loss(net->forward(x.index_select(0, mb.indices())),
                              y.index_select(0, mb.indices()))
        .backward();
  }
  engine.step();
}

std::string temp_path(const std::string& leaf) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string dir =
      testing::fresh_temp_dir("dpzero_privacy_engine_" + std::string(info->name()));
  return dir + "/" + leaf;
}

// The reference step, in float64: for every example i of step 0's Poisson batch its own gradient
// g_i by autograd (an unbound model: plain torch::nn), c_i = min(1, C / (|g_i| + 1e-6)) over the
// whole model (privacy/clipping.h, flat), S = Σ c_i g_i + σC·z(seed, 0, j) at global coordinate j
// (named_parameters() order), and θ − lr · S / (q·N).
std::vector<at::Tensor> reference_step() {
  Mlp net = model();
  const auto [x, y] = data();
  privacy::SamplerSource source;
  source.seed = kSeed;
  const std::vector<int64_t> batch = privacy::poisson_logical_batch(source, 0, kN, kQ);
  EXPECT_GT(batch.size(), 4u);  // several micro-batches
  std::vector<at::Tensor> params = net->parameters();
  std::vector<at::Tensor> sum;
  for (const at::Tensor& p : params) sum.push_back(torch::zeros(p.sizes(), at::kDouble));
  for (int64_t i : batch) {
    for (at::Tensor& p : params) p.mutable_grad() = at::Tensor();
    torch::cross_entropy_loss(net->forward(x.narrow(0, i, 1)), y.narrow(0, i, 1)).backward();
    double sq = 0.0;
    for (const at::Tensor& p : params) sq += p.grad().to(at::kDouble).pow(2).sum().item<double>();
    const double c = std::min(1.0, privacy::threshold_f32(kC) / (std::sqrt(sq) + 1e-6));
    for (size_t k = 0; k < params.size(); ++k) sum[k] += c * params[k].grad().to(at::kDouble);
  }
  std::vector<at::Tensor> out;
  int64_t j = 0;
  for (size_t k = 0; k < params.size(); ++k) {
    at::Tensor z = torch::empty({params[k].numel()}, at::kDouble);
    for (int64_t e = 0; e < z.numel(); ++e, ++j)
      z[e] = static_cast<double>(privacy::noise_draw(kSeed, 0, static_cast<uint64_t>(j)));
    out.push_back(params[k].detach().to(at::kDouble) -
                  kLr * (sum[k] + kSigma * kC * z.view(params[k].sizes())) / (kQ * kN));
  }
  return out;
}

TEST(PrivacyEngine, StepIsThePerExampleReferenceOnOneAndTwoRanks) {
  const std::vector<at::Tensor> want = reference_step();
  for (int world : {1, 2}) {
    // Built here, one thread: the global generator is one per process, and ranks as threads
    // seeding and drawing from it at once got each other's draws (different weights per rank).
    std::vector<Mlp> nets;
    for (int r = 0; r < world; ++r) nets.push_back(model());
    run_ranks(world, std::chrono::seconds(60), [&](int rank, auto pg) {
      Mlp net = nets[rank];
      PrivacyOptions o = options();
      o.trust_batch_first = false;
      PrivacyEngine engine(net.ptr(), o, world > 1 ? pg : nullptr);
      check_batch_first(engine, net);  // leaves no trace in the step
      train_step(engine, net);
      EXPECT_EQ(engine.charges(), 1);
      const auto named = net->named_parameters();
      for (size_t k = 0; k < want.size(); ++k) {
        const at::Tensor got = engine.parameter(named[k].key()).to(at::kDouble);
        EXPECT_TRUE(torch::allclose(got, want[k], 1e-5, 1e-6))
            << "W=" << world << " " << named[k].key() << "\n"
            << got - want[k];
        EXPECT_TRUE(torch::equal(named[k].value().detach(), engine.parameter(named[k].key())))
            << "the module's parameter is not the engine's";
      }
    });
  }
}

// A model whose Linear is torch::nn's: its gradient could not be clipped.
struct Mixed : torch::nn::Module {
  Mixed() {
    dp = register_module("dp", nn::Linear(3, 3));
    plain = register_module("plain", torch::nn::Linear(3, 2));
  }
  nn::Linear dp{nullptr};
  torch::nn::Linear plain{nullptr};
};

TEST(PrivacyEngine, RefusesTrainableParametersOutsideDpModules) {
  auto net = std::make_shared<Mixed>();
  const std::string why =
      testing::error_message<std::invalid_argument>([&] { PrivacyEngine engine(net, options()); });
  EXPECT_TRUE(contains(why, "module 'plain'") && contains(why, "dpzero::dp::nn")) << why;
  net->plain->weight.requires_grad_(false);  // frozen: nothing to clip there
  net->plain->bias.requires_grad_(false);
  PrivacyEngine engine(net, options());
  EXPECT_EQ(engine.zero().plan().total_coordinates(), 12);
}

TEST(PrivacyEngine, RefusesBadOptionsNamingThem) {
  Mlp net = model();
  PrivacyOptions o = options();
  o.noise_multiplier = 0.0;
  EXPECT_TRUE(contains(
      testing::error_message<std::invalid_argument>([&] { PrivacyEngine engine(net.ptr(), o); }),
      "allow_no_noise"));
  o = options();
  o.sample_rate = 1.5;
  EXPECT_TRUE(contains(
      testing::error_message<std::invalid_argument>([&] { PrivacyEngine engine(net.ptr(), o); }),
      "sample_rate must be in (0, 1], got 1.5"));
  o = options();
  o.zero_stage = 3;
  EXPECT_TRUE(contains(
      testing::error_message<std::invalid_argument>([&] { PrivacyEngine engine(net.ptr(), o); }),
      "stage 3"));
}

TEST(PrivacyEngine, ForwardWithoutAHandedOutBatchIsRefused) {
  Mlp net = model();
  PrivacyEngine engine(net.ptr(), options());
  const auto [x, y] = data();
  const std::string why = testing::error_message<PrivacyError>([&] {
    torch::cross_entropy_loss(net->forward(x.narrow(0, 0, 3)), y.narrow(0, 0, 3)).backward();
  });
  EXPECT_TRUE(contains(why, "DP layer 'fc2'") && contains(why, "no micro-batch was handed out"))
      << why;
  // The step refuses until zero_grad() drops the batch; then a handed-out batch trains.
  EXPECT_THROW(train_step(engine, net), PrivacyError);
  EXPECT_EQ(engine.charges(), 0);
  engine.zero_grad();
  train_step(engine, net);
  EXPECT_EQ(engine.charges(), 1);
}

TEST(PrivacyEngine, ParameterUsedOutsideItsDpModuleIsRefused) {
  Mlp net = model();
  PrivacyEngine engine(net.ptr(), options());
  const auto [x, y] = data();
  const auto batches = engine.sample();
  engine.hand_out(batches[0]);
  const std::string why = testing::error_message<PrivacyError>([&] {
    const at::Tensor idx = batches[0].indices();
    (torch::cross_entropy_loss(net->forward(x.index_select(0, idx)), y.index_select(0, idx)) +
     net->fc1->weight.sum())
        .backward();
  });
  EXPECT_TRUE(contains(why, "parameter 'fc1.weight' received a gradient from autograd")) << why;
  for (size_t i = 1; i < batches.size(); ++i) engine.hand_out(batches[i]);
  EXPECT_THROW(engine.step(), PrivacyError);
  EXPECT_EQ(engine.charges(), 0);
}

TEST(PrivacyEngine, StepMissingAMicroBatchIsRefusedOnEveryRank) {
  run_ranks(2, std::chrono::seconds(60), [&](int rank, auto pg) {
    Mlp net = model();
    PrivacyEngine engine(net.ptr(), options(), pg);
    const auto [x, y] = data();
    const auto batches = engine.sample();
    ASSERT_GT(batches.size(), 1u);
    // Rank 0 leaves out its last micro-batch; rank 1 runs them all.
    const size_t run = rank == 0 ? batches.size() - 1 : batches.size();
    for (size_t i = 0; i < run; ++i) {
      engine.hand_out(batches[i]);
      const at::Tensor idx = batches[i].indices();
      torch::cross_entropy_loss(net->forward(x.index_select(0, idx)), y.index_select(0, idx))
          .backward();
    }
    const std::string why = testing::error_message<PrivacyError>([&] { engine.step(); });
    if (rank == 0) EXPECT_TRUE(contains(why, "micro-batches of logical step 0")) << why;
    EXPECT_EQ(engine.charges(), 0);
    engine.zero_grad();
    train_step(engine, net);  // the next step goes on
    EXPECT_EQ(engine.charges(), 1);
  });
}

TEST(PrivacyEngine, ChangedTrainableSetIsRefused) {
  Mlp net = model();
  PrivacyEngine engine(net.ptr(), options());
  net->fc2->bias.requires_grad_(false);
  EXPECT_TRUE(contains(testing::error_message<PrivacyError>([&] { train_step(engine, net); }),
                       "trainable parameters changed"));
  EXPECT_EQ(engine.charges(), 0);
}

// hand_out takes only what sample() drew, unchanged, and never into an own_batch batch.
TEST(PrivacyEngine, HandOutTakesOnlyWhatTheSamplerDrew) {
  Mlp net = model();
  PrivacyEngine engine(net.ptr(), options());
  std::vector<MicroBatch> batches = engine.sample();
  ASSERT_GT(batches.size(), 1u);
  MicroBatch edited = batches[0];
  edited.rows.push_back(edited.rows.back() + 1 < kN ? edited.rows.back() + 1 : 0);
  EXPECT_TRUE(
      contains(testing::error_message<std::invalid_argument>([&] { engine.hand_out(edited); }),
               "is not what sample() returned"));
  edited = batches[0];
  edited.count = 1;  // would skip the other micro-batches
  EXPECT_THROW(engine.hand_out(edited), std::invalid_argument);
  EXPECT_THROW(engine.hand_out(batches[1]), std::logic_error);  // out of order
  engine.zero_grad();
  // After one own_batch micro-batch, sample()'s second one matches in step and position: only
  // the check that a caller-sampled batch is open keeps it out of a "caller" step.
  engine.own_batch(3, 3);
  EXPECT_TRUE(
      contains(testing::error_message<std::logic_error>([&] { engine.hand_out(batches[1]); }),
               "own_batch is accumulated"));
}

// A BatchNorm mixes the examples and writes running statistics of the data: refused even frozen.
struct WithBatchNorm : torch::nn::Module {
  WithBatchNorm() {
    fc = register_module("fc", nn::Linear(3, 3));
    bn =
        register_module("bn", torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(3).affine(false)));
  }
  nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};

TEST(PrivacyEngine, RefusesBatchNormAndASecondEngine) {
  const std::string why = testing::error_message<std::invalid_argument>(
      [&] { PrivacyEngine engine(std::make_shared<WithBatchNorm>(), options()); });
  EXPECT_TRUE(contains(why, "module 'bn'") && contains(why, "LayerNorm")) << why;
  Mlp net = model();
  PrivacyEngine engine(net.ptr(), options());
  EXPECT_TRUE(contains(testing::error_message<std::invalid_argument>(
                           [&] { PrivacyEngine second(net.ptr(), options()); }),
                       "held by another PrivacyEngine"));
}

// Note [secure by default]: without a seed every rank draws with rank 0's secure key, so the
// ranks' shares of each logical batch never overlap (with keys of their own, two ranks sampling
// at q = 0.75 would share rows at once); secure_mode=false without a seed takes rank 0's seed;
// a seed (or any setting) that differs from rank 0's is refused on every rank, and so is a seed
// with secure_mode=true.
TEST(PrivacyEngine, RanksAgreeOnTheKeyTheSeedAndTheSettings) {
  std::vector<std::vector<int64_t>> rows(2);
  run_ranks(2, std::chrono::seconds(60), [&](int rank, auto pg) {
    Mlp net = model();
    PrivacyOptions o = options();
    o.seed.reset();
    o.sample_rate = 0.75;
    PrivacyEngine engine(net.ptr(), o, pg);
    EXPECT_TRUE(engine.secure_mode());
    EXPECT_FALSE(engine.seed().has_value());
    for (int t = 0; t < 3; ++t) {
      for (const MicroBatch& mb : engine.sample()) {
        if (mb.padding) continue;
        for (int64_t r : mb.rows) rows[rank].push_back(t * kN + r);
      }
      engine.zero_grad();
    }
  });
  std::set<int64_t> both(rows[0].begin(), rows[0].end());
  both.insert(rows[1].begin(), rows[1].end());
  EXPECT_GT(rows[0].size() + rows[1].size(), static_cast<size_t>(kN));  // about 2.25 N
  EXPECT_EQ(both.size(), rows[0].size() + rows[1].size());               // disjoint shares
  std::vector<std::optional<uint64_t>> seeds(2);
  run_ranks(2, std::chrono::seconds(60), [&](int rank, auto pg) {
    Mlp net = model();
    PrivacyOptions o = options();
    o.seed.reset();
    o.secure_mode = false;
    PrivacyEngine engine(net.ptr(), o, pg);
    EXPECT_FALSE(engine.secure_mode());
    seeds[rank] = engine.seed();
  });
  ASSERT_TRUE(seeds[0].has_value());
  EXPECT_EQ(seeds[0], seeds[1]);
  run_ranks(2, std::chrono::seconds(60), [&](int rank, auto pg) {
    Mlp net = model();
    PrivacyOptions o = options();
    if (rank == 1) o.secure_mode = true;  // with options()'s seed
    const std::string why = testing::error_message<std::invalid_argument>(
        [&] { PrivacyEngine engine(net.ptr(), o, pg); });
    EXPECT_TRUE(contains(why, rank == 1 ? "seed=99 with secure_mode=True"
                                        : "another rank's privacy settings differ from rank 0's"))
        << why;
  });
  // A seed of 2^64 - 1 on rank 0 and none on rank 1 (secure_mode=false): "seed given" differs,
  // so both refuse (the same 64 bits must not pass for "no seed").
  run_ranks(2, std::chrono::seconds(60), [&](int rank, auto pg) {
    Mlp net = model();
    PrivacyOptions o = options();
    o.secure_mode = false;
    if (rank == 0) o.seed = ~uint64_t{0};
    else o.seed.reset();
    const std::string why = testing::error_message<std::invalid_argument>(
        [&] { PrivacyEngine engine(net.ptr(), o, pg); });
    EXPECT_TRUE(contains(why, rank == 1 ? "seed given=False on rank 1 differs from rank 0's"
                                        : "another rank's privacy settings differ"))
        << why;
  });
  for (const char* what : {"seed", "max_grad_norm"}) {
    run_ranks(2, std::chrono::seconds(60), [&](int rank, auto pg) {
      Mlp net = model();
      PrivacyOptions o = options();
      if (rank == 1 && std::string(what) == "seed") o.seed = kSeed + 1;
      if (rank == 1 && std::string(what) == "max_grad_norm") o.max_grad_norm = 2 * kC;
      const std::string why = testing::error_message<std::invalid_argument>(
          [&] { PrivacyEngine engine(net.ptr(), o, pg); });
      if (rank == 0)
        EXPECT_TRUE(contains(why, "another rank's privacy settings differ from rank 0's")) << why;
      if (rank == 1 && std::string(what) == "seed")
        EXPECT_TRUE(contains(why, "seed=100 on rank 1 differs from rank 0's")) << why;
      if (rank == 1 && std::string(what) == "max_grad_norm")
        EXPECT_TRUE(contains(why, "max_grad_norm=1 on rank 1 differs from rank 0's")) << why;
    });
  }
}

// A model that is not batch-first where a DP layer reads its input: rows (the examples) and a
// second dim swapped before fc2, which therefore sees [T, B, d]; with T = B its dim 0 passes the
// row count check, and only check_batch_first tells.
struct SwapsRows : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    // x [B, kIn] -> h [B, B, kHidden] (a "sequence" as long as the batch) -> swapped [B', B, d].
    const at::Tensor h = fc1(x).unsqueeze(1).expand({x.size(0), x.size(0), kHidden});
    return fc2(h.transpose(0, 1) * 1.0).mean(1);
  }
  nn::Linear fc1{register_module("fc1", nn::Linear(kIn, kHidden))};
  nn::Linear fc2{register_module("fc2", nn::Linear(kHidden, kClasses))};
};

// A model that mixes the examples before a DP layer: x - mean over the batch.
struct MixesRows : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) { return fc(x - x.mean(0, /*keepdim=*/true)); }
  nn::Linear fc{register_module("fc", nn::Linear(kIn, kClasses))};
};

// A model that mixes the examples after its DP layer: each logit minus the batch's mean, so
// example i's loss reaches every row's output (and its gradient every row's G).
struct MixesAfter : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor out = fc(x);
    return out - out.mean(0, /*keepdim=*/true);
  }
  nn::Linear fc{register_module("fc", nn::Linear(kIn, kClasses))};
};

// Dropout between DP layers (training mode) draws per row: the check's two runs draw the same
// masks, and training draws after it as if it had not run.
struct WithDropout : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) { return fc2(drop(torch::relu(fc1(x)))); }
  nn::Linear fc1{register_module("fc1", nn::Linear(kIn, kHidden))};
  torch::nn::Dropout drop{register_module("drop", torch::nn::Dropout(0.5))};
  nn::Linear fc2{register_module("fc2", nn::Linear(kHidden, kClasses))};
};

TEST(PrivacyEngine, BatchFirstCheckPassesDropoutAndLeavesTheRandomStreamAlone) {
  auto net = std::make_shared<WithDropout>();
  PrivacyEngine engine(net, options());
  torch::manual_seed(8);
  const at::Tensor expected = torch::rand({4});
  torch::manual_seed(8);
  check_batch_first(engine, net);
  EXPECT_TRUE(torch::equal(torch::rand({4}), expected));
}

// Mixing in one direction only: row 0 of fc's input sums every example (a reverse cumulative
// sum), rows 1.. do not see example 0; and a cumulative sum of the outputs, where example 0's
// loss reads row 0 only but later examples' losses read it too.
struct MixesOneWay : torch::nn::Module {
  explicit MixesOneWay(bool after) : after(after) {}
  at::Tensor forward(const at::Tensor& x) {
    if (after) return fc(x).cumsum(0);
    return fc(x.flip(0).cumsum(0).flip(0));
  }
  bool after;
  nn::Linear fc{register_module("fc", nn::Linear(kIn, kClasses))};
};

TEST(PrivacyEngine, BatchFirstCheckRefusesSwappedOrMixedRowsAndStepsWaitForIt) {
  {
    torch::manual_seed(0);
    auto net = std::make_shared<SwapsRows>();
    PrivacyOptions o = options();
    o.trust_batch_first = false;
    PrivacyEngine engine(net, o);
    const std::string why =
        testing::error_message<PrivacyError>([&] { check_batch_first(engine, net); });
    // fc2 reads [T, B, d]; fc1 is mixed too, seen through the swap: the first call is named.
    EXPECT_TRUE(contains(why, "DP layer 'fc") && contains(why, "changing example")) << why;
    EXPECT_TRUE(contains(testing::error_message<PrivacyError>([&] { train_step(engine, net); }),
                         "batch-first layout was not checked"));
    EXPECT_EQ(engine.charges(), 0);
  }
  {
    auto net = std::make_shared<MixesRows>();
    PrivacyEngine engine(net, options());
    const std::string why =
        testing::error_message<PrivacyError>([&] { check_batch_first(engine, net); });
    EXPECT_TRUE(contains(why, "DP layer 'fc'") && contains(why, "rows mix examples")) << why;
  }
  {
    auto net = std::make_shared<MixesAfter>();
    PrivacyEngine engine(net, options());
    const std::string why =
        testing::error_message<PrivacyError>([&] { check_batch_first(engine, net); });
    EXPECT_TRUE(contains(why, "the loss of example 0 reaches other rows of DP layer 'fc'")) << why;
  }
  for (bool after : {false, true}) {
    auto net = std::make_shared<MixesOneWay>(after);
    PrivacyEngine engine(net, options());
    const std::string why =
        testing::error_message<PrivacyError>([&] { check_batch_first(engine, net); });
    EXPECT_TRUE(contains(why, "DP layer 'fc'")) << "after=" << after << ": " << why;
  }
  Mlp net = model();
  PrivacyEngine engine(net.ptr(), options());
  const std::string why = testing::error_message<std::invalid_argument>([&] {
    engine.check_batch_first([&](const at::Tensor& rows) {
      const auto [x, y] = data();
      return torch::cross_entropy_loss(net->forward(x.index_select(0, rows)),
                                       y.index_select(0, rows));  // a mean: one number
    });
  });
  EXPECT_TRUE(contains(why, "one loss per example, [3]")) << why;
}

// Once the engine is gone the model is a plain torch::nn model again: autograd gives its
// parameters their gradients (no DP node, no escape hook), equal to a fresh copy's.
TEST(PrivacyEngine, WithoutTheEngineTheModelIsPlainAgain) {
  Mlp net = model();
  { PrivacyEngine engine(net.ptr(), options()); }
  Mlp fresh = model();
  const auto [x, y] = data();
  torch::cross_entropy_loss(net->forward(x), y).backward();
  torch::cross_entropy_loss(fresh->forward(x), y).backward();
  const auto got = net->parameters(), want = fresh->parameters();
  for (size_t k = 0; k < want.size(); ++k)
    EXPECT_TRUE(torch::allclose(got[k].grad(), want[k].grad())) << k;
}

TEST(PrivacyEngine, LedgerHoldsEveryStepAndTheBudgetStopsAtItsSteps) {
  const std::string path = temp_path("ledger.jsonl");
  PrivacyOptions o = options();
  o.ledger_path = path;
  o.accountant = "rdp";
  o.epsilon_budget = 12.0;
  o.budget_delta = 1e-5;
  const double delta = *o.budget_delta;
  const int64_t allowed = accounting::steps_for_epsilon(12.0, delta, kQ, kSigma);
  ASSERT_GT(allowed, 0);
  ASSERT_LT(allowed, 20);
  {
    Mlp net = model();
    PrivacyEngine engine(net.ptr(), o);
    for (int64_t s = 0; s < allowed; ++s) train_step(engine, net);
    EXPECT_EQ(accounting::Ledger::open_read_only(path).total_steps(), allowed);
    EXPECT_THROW(train_step(engine, net), BudgetExhausted);
    EXPECT_EQ(engine.charges(), allowed);
    accounting::RdpAccountant expected;
    expected.step(kQ, kSigma, allowed);
    EXPECT_DOUBLE_EQ(engine.epsilon(delta), expected.epsilon(delta).epsilon);
    EXPECT_LE(engine.epsilon(delta), 12.0);
  }
  // A new engine continues the ledger: its charges count, and the budget still stops it.
  Mlp net = model();
  PrivacyEngine engine(net.ptr(), o);
  EXPECT_EQ(engine.charges(), allowed);
  EXPECT_THROW(train_step(engine, net), BudgetExhausted);
  EXPECT_EQ(accounting::Ledger::open_read_only(path).total_steps(), allowed);
}

// A run id given with an existing ledger must be that ledger's (as make_private's run_id): a
// mistyped or reused path never continues another run's budget.
TEST(PrivacyEngine, AReopenedLedgerMustBeTheGivenRunsOwn) {
  const std::string path = temp_path("ledger.jsonl");
  PrivacyOptions o = options();
  o.ledger_path = path;
  o.run_id = "first";
  {
    Mlp net = model();
    PrivacyEngine engine(net.ptr(), o);
    train_step(engine, net);
  }
  o.run_id = "second";
  Mlp net = model();
  const std::string why = testing::error_message<accounting::LedgerError>(
      [&] { PrivacyEngine engine(net.ptr(), o); });
  EXPECT_TRUE(contains(why, "first") && contains(why, "second")) << why;
  EXPECT_EQ(accounting::Ledger::open_read_only(path).total_steps(), 1);
  o.run_id = "first";
  Mlp again = model();
  PrivacyEngine engine(again.ptr(), o);
  EXPECT_EQ(engine.charges(), 1);
}

}  // namespace
}  // namespace dpzero::dp
