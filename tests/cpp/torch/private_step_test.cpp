// tests/cpp/torch/private_step_test.cpp — the private step's transaction (src/dp/private_step.h)
// on real ZeRO states: W ranks as threads, each with its own Gloo group over one HashStore, a
// real ledger file, and one Linear weight W [2, 3] clipped by the real book.
//
// The invariants, each with the mutation of private_step.cpp that made its test fail:
//   - the ledger record is on disk, and no model has moved, when the step is charged; the update
//     is the reference step (the update moved before the ledger);
//   - a ledger that cannot be written, or was closed, stops the step before the update on every
//     rank, charging nothing (the ledger's error ignored);
//   - the budget guard stops at max_steps exactly, counting a reopened ledger's charges
//     (k + 1 >= max_steps; k > max_steps);
//   - a collective failure is reported with the step's charge state: before the ledger nothing
//     charged, in the update charged (the update's failure reported as not charged); any other
//     failure after the charge is an UpdateError saying it was charged (the catch removed);
//   - one rank's refusal, invalid settings, a stale batch, a forward without its backward or a
//     logical batch size outside [0, N] refuse the step on every rank (each check removed);
//     unequal logical batch sizes or charge counts are refused on every rank (the squares left
//     out of the check); more clipped rows than examples are refused (the check removed);
//   - every step stopped before its update drops the batch (no drop);
//   - the noise is drawn at the charge index k, not the sampler's step t (noise.step = t); the
//     charge count never goes back (the check removed).

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "accounting/ledger.h"
#include "src/comm/process_group.h"
#include "src/dp/book.h"
#include "src/dp/errors.h"
#include "src/dp/layer_ops.h"
#include "src/dp/private_step.h"
#include "src/dp/step_noise.h"
#include "src/zero/state.h"
#include "tests/cpp/common/error_message.h"
#include "tests/cpp/common/temp_dir.h"
#include "tests/cpp/torch/ranks.h"

namespace dpzero::dp {
namespace {

constexpr int64_t kB = 3, kT = 2, kN = 100;
constexpr double kC = 1.0, kQ = 0.04, kLr = 0.5;
constexpr int64_t kSeed = 1234;
// The process group timeout of the tests where a rank never joins: what rank 0 waits for.
constexpr std::chrono::milliseconds kShortTimeout{5000};

// A fresh directory for one test's ledger.
std::string temp_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return testing::fresh_temp_dir("dpzero_private_step_" + std::string(info->name()));
}

using testing::contains;
using testing::run_ranks;

struct Options {
  double sigma = 0.0;
  std::optional<int64_t> max_steps;
  std::string ledger_path;  // "" : no ledger
  int64_t charges = 0;
  std::function<void(double, double)> on_charge;  // run by the accountant as it composes a step
};

// The run's accountant as the step sees it (accounting/accountant.h): it runs the test's probe of
// the moment of the charge (or its failure) as it composes a step; its steps() count the steps
// composed.
class ProbeAccountant final : public accounting::Accountant {
 public:
  explicit ProbeAccountant(std::function<void(double, double)> probe) : probe_(std::move(probe)) {}
  accounting::AccountantKind kind() const override { return accounting::AccountantKind::kRdp; }
  double get_epsilon(double) const override {
    throw std::logic_error("ProbeAccountant only records charges; it has no epsilon");
  }

 private:
  void compose(const accounting::Phase& phase) override {
    if (probe_) probe_(phase.sigma, phase.q);
  }
  std::function<void(double, double)> probe_;
};

// One micro-batch of kB rows: the Linear call's input A [B, T, 3] and output gradient G [B, T, 2],
// the same for a given (seed, rank) wherever it is made.
struct Batch {
  at::Tensor a, g;
};

Batch batch_of(int64_t seed, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed * 10 + rank));
  return {at::randn({kB, kT, 3}, gen), at::randn({kB, kT, 2}, gen) * 3};
}

// The batch's clipped sum Σ_i min(1, C / (|g_i| + 1e-6)) g_i with g_i = G_i^T A_i, per example in
// float64 (privacy/clipping.h, flat).
at::Tensor clipped_sum(const Batch& x) {
  at::Tensor sum = torch::zeros({2, 3}, at::kDouble);
  for (int64_t i = 0; i < kB; ++i) {
    const at::Tensor gi = at::matmul(x.g[i].t().to(at::kDouble), x.a[i].to(at::kDouble));
    sum += std::min(1.0, kC / (gi.norm().item<double>() + 1e-6)) * gi;
  }
  return sum;
}

accounting::LedgerHeader header() {
  accounting::LedgerHeader h;
  h.run_id = "run";
  h.dataset_size = kN;
  return h;
}

// σC·z(seed, k, j) for W's six coordinates, drawn independently of the step by add_unit_noise_
// (every rank adds the whole unit's noise in stage 0).
at::Tensor noise_of(const zero::UnitLayout& layout, int64_t k, double sigma) {
  at::Tensor z = torch::zeros({layout.padded_numel()});
  NoiseKey key;
  key.seed = kSeed;
  add_unit_noise_(z, layout, 1.0, key, k);
  return z.narrow(0, 0, 6).view({2, 3}).to(at::kDouble) * (sigma * kC);
}

// One rank's private model: the engine over W, the book, the step.
struct Rank {
  Rank(int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, const Options& o) : rank(rank) {
    // The same W on every rank, from a generator of its own: ranks run as threads, and the
    // process-wide one would interleave their draws.
    w = at::randn({2, 3}, at::make_generator<at::CPUGeneratorImpl>(11)).requires_grad_();
    zero::ZeroConfig config;
    config.optimizer.lr = kLr;
    state = std::make_unique<zero::ZeroState>(
        std::vector<zero::UnitSpec>{{"unit", {w}, {"w"}, {0}}}, 6, config, pg);
    state->set_private(true);
    const int64_t padded = state->unit_at(0).flat().layout().padded_numel();
    std::vector<BookLayer> layers{
        {"w", linear_ops({true, false}, false), {Slot{0, 0, 6, {2, 3}}, std::nullopt}, 0, 0}};
    book = std::make_shared<Book>(
        std::move(layers),
        BookOptions{{kC}, {1}, "flat", 0.01, false, {padded}, {at::Device(at::kCPU)}}, *state);
    if (rank == 0 && !o.ledger_path.empty()) {
      ledger = std::make_shared<accounting::Ledger>(
          std::filesystem::exists(o.ledger_path)
              ? accounting::Ledger::open(o.ledger_path)
              : accounting::Ledger::create(o.ledger_path, header()));
    }
    StepSettings settings;
    settings.noise_multiplier = o.sigma;
    settings.max_grad_norm = kC;
    settings.sample_rate = kQ;
    settings.dataset_size = kN;
    settings.max_steps = o.max_steps;
    settings.budget = "epsilon=1 at delta=1e-05 (rdp)";
    settings.noise_key.seed = kSeed;
    accountant = std::make_shared<ProbeAccountant>(o.on_charge);
    if (o.charges > 0 && o.sigma > 0.0) accountant->step(kQ, o.sigma, o.charges);
    step = std::make_unique<PrivateStep>(book, *state, ledger, settings, accountant, o.charges);
  }

  // Micro-batch batch_of(seed, rank) through the book, as a DP Linear's backward reports it.
  void micro_batch(int64_t seed) {
    const Batch x = batch_of(seed, rank);
    book->set_expected_rows(kB);
    const int64_t part = book->on_forward(0);
    book->set_verdict(part);
    book->on_backward(book->generation(), part, x.a, x.g);
    book->finish_backward();
  }

  at::Tensor params() { return state->full_parameters(0).narrow(0, 0, 6).view({2, 3}); }
  at::Tensor grads() { return state->grad_accumulator(0); }

  StepOutcome take(int64_t t, int64_t size, std::optional<std::string> refusal = {},
                   bool caller = false, std::optional<std::string> bad_settings = {}) {
    return step->take(StepRequest{t, size, caller, std::move(refusal), std::move(bad_settings)});
  }
  bool dropped() { return torch::equal(grads(), torch::zeros_like(grads())); }

  int rank;
  at::Tensor w;
  std::unique_ptr<zero::ZeroState> state;
  std::shared_ptr<Book> book;
  std::shared_ptr<accounting::Ledger> ledger;  // rank 0's
  std::unique_ptr<PrivateStep> step;
  std::shared_ptr<ProbeAccountant> accountant;
  int64_t charged() const { return accountant->steps(); }  // the steps ε counts
};

int64_t ledger_steps(const std::string& path) {
  return accounting::Ledger::open_read_only(path).total_steps();
}

// When the step is charged, its ledger record is already on disk (a fresh read-only open finds
// it) and no rank's model has moved; after take() the update is the reference SGD step on both
// ranks' clipped sums, W -= lr · (S_0 + S_1 + σC·z_k) / (q·N).
TEST(PrivateStep, LedgerRecordIsOnDiskBeforeTheUpdate) {
  const std::string path = temp_dir() + "/ledger.jsonl";
  run_ranks(2, std::chrono::seconds(60), [&](int r, auto pg) {
    Rank* self = nullptr;
    at::Tensor before;
    std::vector<int64_t> on_disk;
    Options o;
    o.ledger_path = path;
    o.sigma = 0.5;
    o.on_charge = [&](double, double) {
      on_disk.push_back(ledger_steps(path));
      EXPECT_TRUE(torch::equal(self->params(), before)) << "updated before the charge";
    };
    Rank rank(r, pg, o);
    self = &rank;
    for (int64_t t = 0; t < 2; ++t) {
      before = rank.params().clone();
      rank.micro_batch(t);
      const StepOutcome out = rank.take(t, 2 * kB);
      EXPECT_EQ(out.noise_index, t);
      EXPECT_EQ(out.samples, 2 * kB);
      const at::Tensor sums = clipped_sum(batch_of(t, 0)) + clipped_sum(batch_of(t, 1)) +
                              noise_of(rank.state->unit_at(0).flat().layout(), t, 0.5);
      const at::Tensor expected = before.to(at::kDouble) - kLr * sums / (kQ * kN);
      EXPECT_TRUE(torch::allclose(rank.params().to(at::kDouble), expected, 1e-5, 1e-6))
          << rank.params() << expected;
    }
    EXPECT_EQ(on_disk, (std::vector<int64_t>{1, 2}));
    EXPECT_EQ(rank.step->charges(), 2);
  });
  EXPECT_EQ(ledger_steps(path), 2);
}

// A ledger that cannot be written (the file size limit reached: write() fails with EFBIG) stops
// the step before the update on every rank: rank 0 raises the ledger's error, rank 1 says rank 0
// could not write; nothing is charged, no model moves and every batch is dropped.
TEST(PrivateStep, LedgerThatCannotBeWrittenStopsTheStepBeforeTheUpdate) {
  const std::string path = temp_dir() + "/ledger.jsonl";
  std::atomic<int> created{0};
  run_ranks(2, std::chrono::seconds(60), [&](int r, auto pg) {
    Options o;
    o.ledger_path = path;
    o.sigma = 1.0;
    Rank rank(r, pg, o);
    const at::Tensor before = rank.params().clone();
    rank.micro_batch(0);
    std::string why;
    if (r == 0) {
      rlimit old{};
      getrlimit(RLIMIT_FSIZE, &old);
      const auto size = static_cast<rlim_t>(std::filesystem::file_size(path));
      rlimit small{size, old.rlim_max};
      auto old_handler = signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of the signal
      ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
      why = testing::error_message<accounting::LedgerError>([&] { rank.take(0, 2 * kB); });
      setrlimit(RLIMIT_FSIZE, &old);
      signal(SIGXFSZ, old_handler);
      EXPECT_TRUE(contains(why, "cannot append to ledger " + path)) << why;
    } else {
      why = testing::error_message<accounting::LedgerError>([&] { rank.take(0, 2 * kB); });
      EXPECT_TRUE(contains(why, "rank 0 could not write the privacy ledger")) << why;
    }
    EXPECT_EQ(rank.step->charges(), 0);
    EXPECT_EQ(rank.charged(), 0);
    EXPECT_TRUE(torch::equal(rank.params(), before));
    EXPECT_TRUE(rank.dropped());
  });
  EXPECT_EQ(ledger_steps(path), 0);
}

// A ledger its owner closed refuses the append: the step stops before the update.
TEST(PrivateStep, ClosedLedgerStopsTheStepBeforeTheUpdate) {
  const std::string path = temp_dir() + "/ledger.jsonl";
  run_ranks(1, std::chrono::seconds(60), [&](int r, auto pg) {
    Options o;
    o.ledger_path = path;
    o.sigma = 1.0;
    Rank rank(r, pg, o);
    const at::Tensor before = rank.params().clone();
    rank.micro_batch(0);
    accounting::Ledger::open_read_only(path);  // (readers never block)
    rank.ledger->close();
    const std::string why =
        testing::error_message<accounting::LedgerError>([&] { rank.take(0, kB); });
    EXPECT_TRUE(contains(why, "is closed")) << why;
    EXPECT_EQ(rank.step->charges(), 0);
    EXPECT_TRUE(torch::equal(rank.params(), before));
    EXPECT_TRUE(rank.dropped());
  });
  EXPECT_EQ(ledger_steps(path), 0);
}

// With a budget of 2 steps the first two are taken and the third is refused on every rank before
// anything is written: the ledger holds 2 steps, the model is the one after step 2, the batch is
// dropped, and the message names the budget and the charges.
TEST(PrivateStep, BudgetGuardStopsAtTheTarget) {
  const std::string path = temp_dir() + "/ledger.jsonl";
  run_ranks(2, std::chrono::seconds(60), [&](int r, auto pg) {
    Options o;
    o.ledger_path = path;
    o.sigma = 1.0;
    o.max_steps = 2;
    Rank rank(r, pg, o);
    for (int64_t t = 0; t < 2; ++t) {
      rank.micro_batch(t);
      rank.take(t, 2 * kB);
    }
    const at::Tensor after_two = rank.params().clone();
    rank.micro_batch(2);
    const std::string why = testing::error_message<BudgetExhausted>([&] { rank.take(2, 2 * kB); });
    EXPECT_TRUE(contains(why, "budget epsilon=1 at delta=1e-05 (rdp) allows 2 steps")) << why;
    EXPECT_TRUE(contains(why, "2 are charged, so step 3 was not taken")) << why;
    EXPECT_EQ(rank.step->charges(), 2);
    EXPECT_EQ(rank.charged(), 2);
    EXPECT_TRUE(torch::equal(rank.params(), after_two));
    EXPECT_TRUE(rank.dropped());
  });
  EXPECT_EQ(ledger_steps(path), 2);
  // Reopened with its 2 charges (as make_private does), the budget is already spent.
  run_ranks(2, std::chrono::seconds(60), [&](int r, auto pg) {
    Options o;
    o.ledger_path = path;
    o.sigma = 1.0;
    o.max_steps = 2;
    o.charges = 2;
    Rank rank(r, pg, o);
    rank.micro_batch(3);
    const std::string why = testing::error_message<BudgetExhausted>([&] { rank.take(3, 2 * kB); });
    EXPECT_TRUE(contains(why, "2 are charged, so step 3 was not taken")) << why;
    EXPECT_EQ(rank.charged(), 2);  // the reopened ledger's, nothing more
  });
  EXPECT_EQ(ledger_steps(path), 2);
}

// Rank 1 never joins the step (it hangs): rank 0's agreement times out, and its CollectiveError
// says nothing was charged; the ledger holds nothing.
TEST(PrivateStep, CollectiveFailureBeforeTheLedgerChargesNothing) {
  const std::string path = temp_dir() + "/ledger.jsonl";
  std::atomic<bool> done{false};
  run_ranks(2, kShortTimeout, [&](int r, auto pg) {
    Options o;
    o.ledger_path = path;
    o.sigma = 1.0;
    Rank rank(r, pg, o);
    rank.micro_batch(0);
    if (r == 1) {
      while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      return;
    }
    const at::Tensor before = rank.params().clone();
    try {
      rank.take(0, 2 * kB);
      ADD_FAILURE() << "the step was taken without rank 1";
    } catch (const CollectiveError& e) {
      EXPECT_EQ(e.charge_state(), ChargeState::kNotCharged);
      EXPECT_TRUE(contains(e.what(), "rank 0 of 2, step 0: agreeing on the step failed"))
          << e.what();
      EXPECT_TRUE(contains(e.what(), "nothing was charged or applied")) << e.what();
    }
    done = true;
    EXPECT_EQ(rank.step->charges(), 0);
    EXPECT_TRUE(torch::equal(rank.params(), before));
  });
  EXPECT_EQ(ledger_steps(path), 0);
}

// Rank 1 stops right after the charge (its accountant fails) and never joins the update: rank 0's
// update times out, and its CollectiveError says the step was charged; the ledger holds it, rank
// 0 counts it, and rank 0's model is unchanged.
TEST(PrivateStep, CollectiveFailureInTheUpdateSaysTheStepWasCharged) {
  const std::string path = temp_dir() + "/ledger.jsonl";
  std::atomic<bool> done{false};
  run_ranks(2, kShortTimeout, [&](int r, auto pg) {
    Options o;
    o.ledger_path = path;
    o.sigma = 1.0;
    if (r == 1) o.on_charge = [](double, double) { throw std::runtime_error("rank 1 stops"); };
    Rank rank(r, pg, o);
    rank.micro_batch(0);
    const at::Tensor before = rank.params().clone();
    if (r == 1) {  // its own failure after the charge: an UpdateError (the next test)
      const std::string what =
          testing::error_message<UpdateError>([&] { rank.take(0, 2 * kB); });
      EXPECT_TRUE(contains(what, "rank 1 of 2, step 0 (charge 0): the step was charged")) << what;
      while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      return;
    }
    try {
      rank.take(0, 2 * kB);
      ADD_FAILURE() << "the update completed without rank 1";
    } catch (const CollectiveError& e) {
      EXPECT_EQ(e.charge_state(), ChargeState::kCharged);
      EXPECT_TRUE(contains(e.what(), "rank 0 of 2, step 0: the noisy update failed")) << e.what();
      EXPECT_TRUE(contains(e.what(), "the step was charged to the privacy ledger")) << e.what();
    }
    done = true;
    EXPECT_EQ(rank.step->charges(), 1);
    EXPECT_EQ(rank.charged(), 1);
    EXPECT_TRUE(torch::equal(rank.params(), before));
  });
  EXPECT_EQ(ledger_steps(path), 1);
}

// A failure after the charge that is not a collective's (here the accountant's composition raises;
// an allocation in the update would do the same) is an UpdateError saying the step was charged,
// with the cause nested: the ledger holds the step, the count has it, the model is unchanged and
// the batch is dropped; the next step draws the next charge index, and the accountant composes
// the step it missed with it.
TEST(PrivateStep, FailureAfterTheChargeSaysTheStepWasCharged) {
  const std::string path = temp_dir() + "/ledger.jsonl";
  run_ranks(1, std::chrono::seconds(60), [&](int r, auto pg) {
    bool fail = true;
    Options o;
    o.ledger_path = path;
    o.sigma = 1.0;
    o.on_charge = [&](double, double) {
      if (fail) throw std::runtime_error("accountant unavailable");
    };
    Rank rank(r, pg, o);
    rank.micro_batch(0);
    const at::Tensor before = rank.params().clone();
    try {
      rank.take(0, kB);
      ADD_FAILURE() << "the step completed";
    } catch (const UpdateError& e) {
      EXPECT_TRUE(contains(e.what(), "rank 0 of 1, step 0 (charge 0): the step was charged to "
                                     "the privacy ledger, then failed on this rank before its "
                                     "update was applied"))
          << e.what();
      EXPECT_TRUE(contains(e.what(), "(accountant unavailable)")) << e.what();
      EXPECT_EQ(testing::error_message<std::runtime_error>([&] { std::rethrow_if_nested(e); }),
                "accountant unavailable");
    }
    EXPECT_EQ(rank.step->charges(), 1);
    EXPECT_TRUE(torch::equal(rank.params(), before));
    EXPECT_TRUE(rank.dropped());
    EXPECT_EQ(rank.charged(), 0);  // the accountant failed on charge 0
    fail = false;
    rank.micro_batch(1);
    EXPECT_EQ(rank.take(1, kB).noise_index, 1);
    EXPECT_EQ(rank.charged(), 2);  // the next charge composes the one it missed
    ASSERT_EQ(rank.accountant->phases().size(), 1u);
    EXPECT_EQ(rank.accountant->phases()[0].steps, 2);
  });
  EXPECT_EQ(ledger_steps(path), 2);
}

// One rank's refusal refuses the step on every rank (the others name "another rank"), with every
// rank's batch dropped and nothing charged; the next step goes through.
TEST(PrivateStep, OneRanksRefusalRefusesTheStepOnEveryRank) {
  run_ranks(2, std::chrono::seconds(60), [&](int r, auto pg) {
    Rank rank(r, pg, Options{});
    const at::Tensor before = rank.params().clone();
    rank.micro_batch(0);
    std::optional<std::string> refusal;
    if (r == 1) refusal = "the trainable parameters changed";
    const std::string why =
        testing::error_message<PrivacyError>([&] { rank.take(0, 2 * kB, refusal); });
    EXPECT_TRUE(contains(why, r == 1 ? "the trainable parameters changed"
                                     : "another rank "
                                       "refused it"))
        << why;
    EXPECT_TRUE(rank.dropped());
    EXPECT_TRUE(torch::equal(rank.params(), before));
    EXPECT_EQ(rank.step->charges(), 0);
    rank.micro_batch(1);
    rank.take(1, 2 * kB);
    EXPECT_EQ(rank.step->charges(), 1);
  });
}

// Logical batch sizes 20, 40 and 60 on three ranks (9 rows clipped in all): rank 1's size is the
// mean, so the sums alone would pass it while ranks 0 and 2 refuse; with the squares every rank
// refuses (Note [one agreement per step]). The refusal stays until the caller clears the book's
// error.
TEST(PrivateStep, UnequalLogicalBatchSizesAreRefusedOnEveryRank) {
  run_ranks(3, kShortTimeout, [&](int r, auto pg) {
    Rank rank(r, pg, Options{});
    rank.micro_batch(0);
    const int64_t size = 20 * (r + 1);
    const std::string why =
        testing::error_message<PrivacyError>([&] { rank.take(0, size, std::nullopt, true); });
    EXPECT_TRUE(contains(why, "the ranks gave different logical batch sizes (this rank " +
                                  std::to_string(size) + ")"))
        << why;
    EXPECT_TRUE(rank.book->error().has_value());
    EXPECT_TRUE(rank.dropped());
  });
}

// Ranks that charged different numbers of steps (checkpoints of different steps loaded) refuse
// the step everywhere: the budget guard and the noise index read the count.
TEST(PrivateStep, UnequalChargeCountsAreRefusedOnEveryRank) {
  run_ranks(3, kShortTimeout, [&](int r, auto pg) {
    Options o;
    o.charges = 2 * r;
    Rank rank(r, pg, o);
    rank.micro_batch(0);
    const std::string why = testing::error_message<PrivacyError>([&] { rank.take(0, 3 * kB); });
    EXPECT_TRUE(contains(why, "the ranks have charged different numbers of steps (this rank " +
                                  std::to_string(2 * r) + ")"))
        << why;
    EXPECT_TRUE(rank.dropped());
  });
}

// What makes a rank refuse on its own: invalid optimizer settings (std::invalid_argument, every
// rank), a stale logical batch, a forward whose backward has not run, a logical batch size
// outside [0, N]; each drops the batch and charges nothing.
TEST(PrivateStep, EveryLocalRefusalIsTheStepsOnEveryRank) {
  run_ranks(2, kShortTimeout, [&](int r, auto pg) {
    Rank rank(r, pg, Options{});
    rank.micro_batch(0);
    std::optional<std::string> bad;
    if (r == 0) bad = "lr must be >= 0, got -1";
    const std::string why = testing::error_message<std::invalid_argument>(
        [&] { rank.take(0, 2 * kB, std::nullopt, false, bad); });
    EXPECT_TRUE(contains(
        why, r == 0 ? "lr must be >= 0, got -1" : "another rank has invalid optimizer settings"))
        << why;
    EXPECT_TRUE(rank.dropped());

    rank.micro_batch(1);
    if (r == 1) rank.book->set_stale(true);
    EXPECT_TRUE(contains(testing::error_message<PrivacyError>([&] { rank.take(1, 2 * kB); }),
                         r == 1 ? "a new logical batch began" : "another rank refused it"));
    rank.book->set_stale(false);

    rank.book->set_expected_rows(kB);
    rank.book->set_verdict(rank.book->on_forward(0));  // a forward, no backward
    EXPECT_TRUE(contains(testing::error_message<PrivacyError>([&] { rank.take(2, 2 * kB); }),
                         "step() after a forward whose backward has not run"));

    rank.micro_batch(3);
    EXPECT_TRUE(
        contains(testing::error_message<PrivacyError>([&] { rank.take(3, r == 0 ? -1 : kN + 1); }),
                 r == 0 ? "got -1" : "got 101"));
    EXPECT_TRUE(rank.dropped());
    EXPECT_EQ(rank.step->charges(), 0);
  });
}

// Note [noise index]: a charge count never goes back, and a secure key has 8 words.
TEST(PrivateStep, ChargesNeverGoBackAndSecureKeysHaveEightWords) {
  run_ranks(1, std::chrono::seconds(60), [&](int r, auto pg) {
    Options o;
    o.charges = 4;
    Rank rank(r, pg, o);
    EXPECT_THROW(rank.step->restore(3, rank.accountant), std::invalid_argument);
    EXPECT_EQ(rank.step->charges(), 4);
    rank.step->restore(6, rank.accountant);
    EXPECT_EQ(rank.step->charges(), 6);
    NoiseKey key;
    key.secure = true;
    key.key = {1, 2, 3};
    EXPECT_TRUE(contains(
        testing::error_message<std::invalid_argument>([&] { rank.step->set_noise_key(key); }),
        "got 3"));
  });
}

// More rows reached the clipping than the logical batch has examples (each rank clipped kB rows
// of a caller-sampled batch of kB over both ranks): some example counted twice; refused on every
// rank, the counts named because the caller gave the size.
TEST(PrivateStep, MoreClippedRowsThanExamplesAreRefused) {
  run_ranks(2, std::chrono::seconds(60), [&](int r, auto pg) {
    Rank rank(r, pg, Options{});
    rank.micro_batch(0);
    const std::string why =
        testing::error_message<PrivacyError>([&] { rank.take(0, kB, std::nullopt, true); });
    EXPECT_TRUE(contains(why,
                         "more rows reached the clipping in logical step 0 than its batch "
                         "has examples (6 rows, logical_batch_size=3)"))
        << why;
    EXPECT_EQ(rank.step->charges(), 0);
    EXPECT_TRUE(rank.dropped());
  });
}

// Note [noise index]: a step's noise is drawn at its charge index k, not at the sampler's step t.
// With 5 steps charged before (a reopened ledger), step t = 0 adds σC·z(seed, 5, j): the update
// is W -= lr · (S + σC·z_5) / (q·N).
TEST(PrivateStep, NoiseIsDrawnAtTheChargeIndex) {
  run_ranks(1, std::chrono::seconds(60), [&](int r, auto pg) {
    Options o;
    o.sigma = 0.7;
    o.charges = 5;
    Rank rank(r, pg, o);
    const at::Tensor before = rank.params().clone();
    rank.micro_batch(0);
    const StepOutcome out = rank.take(0, kB);
    EXPECT_EQ(out.step, 0);
    EXPECT_EQ(out.noise_index, 5);
    EXPECT_EQ(rank.step->charges(), 6);
    const at::Tensor noise = noise_of(rank.state->unit_at(0).flat().layout(), 5, 0.7);
    const at::Tensor expected =
        before.to(at::kDouble) - kLr * (clipped_sum(batch_of(0, 0)) + noise) / (kQ * kN);
    EXPECT_TRUE(torch::allclose(rank.params().to(at::kDouble), expected, 1e-5, 1e-5))
        << rank.params() << expected;
  });
}

// Note [noise index]: a sampler's step is drawn once. Step 0 charged, the sampler's step 0 again
// is refused before its charge (its Poisson batch would be charged twice as if independent),
// nothing charged, the batch dropped; the next step goes on.
TEST(PrivateStep, ASamplersStepIsChargedOnce) {
  run_ranks(1, std::chrono::seconds(60), [&](int r, auto pg) {
    Rank rank(r, pg, Options{});
    rank.micro_batch(0);
    rank.take(0, kB);
    EXPECT_EQ(rank.step->charges(), 1);
    EXPECT_EQ(rank.step->rows(), 1);
    rank.micro_batch(1);
    const std::string why = testing::error_message<PrivacyError>([&] { rank.take(0, kB); });
    EXPECT_TRUE(contains(why, "step 0 is at or before step 0, which this run has charged: its "
                              "Poisson batch would repeat"))
        << why;
    EXPECT_EQ(rank.step->charges(), 1);
    EXPECT_TRUE(rank.dropped());
    rank.micro_batch(2);
    EXPECT_EQ(rank.take(1, kB).noise_index, 1);
  });
}

}  // namespace
}  // namespace dpzero::dp
