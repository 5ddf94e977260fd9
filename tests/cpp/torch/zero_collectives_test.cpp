// tests/cpp/torch/zero_collectives_test.cpp — the engine's collectives and units with ranks as
// threads over one c10d::HashStore (design.md §6 "Multi-rank").
//
// Each thread gets a real Gloo process group (tests/cpp/torch/ranks.h).

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "src/comm/collectives.h"
#include "src/comm/process_group.h"
#include "src/zero/flat_param.h"
#include "src/zero/unit.h"
#include "src/zero/state.h"
#include "src/dp/step_noise.h"
#include "tests/cpp/common/error_message.h"
#include "tests/cpp/torch/ranks.h"

namespace dpzero::zero {
namespace {

// Runs body(rank, collectives) on `world_size` threads, each with its own process group.
void run_ranks(int world_size, const std::function<void(int, const comm::Collectives&)>& body) {
  testing::run_ranks(world_size, std::chrono::seconds(120), [&](int rank, auto pg) {
    comm::Collectives comm(pg);
    body(rank, comm);
  });
}

// A unit of three parameters (5, 7 and 3 elements, global coordinates [0, 15)), aligned to 4.
// Its own generator, not the global one: rank threads draw concurrently.
std::vector<at::Tensor> unit_params(uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<at::Tensor> out;
  for (int64_t n : {5, 7, 3}) out.push_back(at::randn({n}, gen).requires_grad_());
  return out;
}
UnitLayout unit_layout(int64_t world_size) {
  return UnitLayout({{5, 0}, {7, 5}, {3, 12}}, world_size, /*alignment=*/4);
}
// Rank r's gradient of parameter i: small integers, so every sum below is exact in fp32.
at::Tensor rank_grad(int rank, size_t i, int64_t numel) {
  return torch::arange(numel, at::kFloat) * static_cast<double>(rank + 1) +
         static_cast<double>(10 * i);
}

class ZeroCollectives : public ::testing::TestWithParam<int> {};

TEST_P(ZeroCollectives, UnitGradientReduceScatterGivesEachRankItsShardSum) {
  const int world = GetParam();
  const UnitLayout layout = unit_layout(world);
  std::vector<at::Tensor> shards(world);
  run_ranks(world, [&](int rank, const comm::Collectives& comm) {
    std::vector<at::Tensor> params = unit_params(0);
    FlatParam flat(params, {"a", "b", "c"}, layout, comm, /*sync=*/true, FlatParamOptions{});
    Unit group("unit", std::move(flat), Stage::k2, make_sgd({}), at::kFloat);
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = rank_grad(rank, i, params[i].numel());
    }
    for (size_t i = 0; i < params.size(); ++i) group.grad_ready(static_cast<int64_t>(i), comm);
    for (const at::Tensor& p : params) EXPECT_FALSE(p.grad().defined());  // full gradient freed
    shards[rank] = group.grad_shard().clone();
  });
  // Expected: the unit's flat gradient summed over ranks, cut into W equal shards.
  at::Tensor full = torch::zeros({layout.padded_numel()});
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < 3; ++i) {
      full.narrow(0, layout.flat_offsets()[i], layout.params()[i].numel)
          .add_(rank_grad(r, i, layout.params()[i].numel));
    }
  }
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(shards[r].numel(), layout.shard_numel());
    EXPECT_TRUE(torch::equal(shards[r], full.narrow(0, r * layout.shard_numel(),
                                                    layout.shard_numel())))
        << "rank " << r;
  }
}

TEST_P(ZeroCollectives, Stage3GathersBroadcastValuesAndFreesStorage) {
  const int world = GetParam();
  run_ranks(world, [&](int rank, const comm::Collectives& comm) {
    std::vector<at::Tensor> params = unit_params(100 + rank);  // differ per rank before the sync
    std::vector<at::Tensor> root = unit_params(100);
    FlatParamOptions options;
    options.shard_params = true;
    FlatParam flat(params, {"a", "b", "c"}, unit_layout(world), comm, /*sync=*/true, options);
    EXPECT_FALSE(flat.unsharded());
    EXPECT_EQ(flat.full().storage().nbytes(), 0u);
    // Note [reading a resharded parameter]: a parameter keeps its shape and refuses every read,
    // naming itself (a view of the freed storage read address 0 plus its offset: SIGSEGV).
    const auto refused = [&](size_t i) {
      EXPECT_EQ(params[i].sizes(), root[i].sizes()) << "param " << i;
      const std::string message =
          testing::error_message<c10::Error>([&] { (void)params[i].sum().item<float>(); });
      EXPECT_TRUE(testing::contains(message, std::string("parameter '") + "abc"[i] +
                                                 "' has no memory here"))
          << message;
    };
    for (size_t i = 0; i < params.size(); ++i) refused(i);
    flat.unshard(comm);
    ASSERT_TRUE(flat.unsharded());
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(torch::equal(params[i].detach(), root[i].detach())) << "param " << i;
    }
    // Note [views kept across a reshard]: a view made while gathered refuses reads and writes
    // once the unit is resharded (it read address 0 plus its offset: SIGSEGV), naming the unit,
    // and reads the gathered values again after the next gather.
    const at::Tensor kept = params[1].detach();
    flat.reshard();
    EXPECT_EQ(flat.full().storage().nbytes(), 0u);
    for (size_t i = 0; i < params.size(); ++i) refused(i);
    for (const auto& access : std::vector<std::function<void()>>{
             [&] { (void)kept.sum().item<float>(); }, [&] { kept.add_(1); },
             [&] { (void)kept.clone(); }}) {
      const std::string message = testing::error_message<c10::Error>(access);
      EXPECT_TRUE(testing::contains(message, "unit holding parameter 'a' (and 2 more)")) << message;
    }
    // A prefetch: readable once its gather completes (on one rank, when it is issued; the
    // parameters stayed refusing there before).
    flat.unshard_async(comm);
    // Note [gathers land apart]: until the gather is waited for, full_ holds no memory (a view
    // of it kept from an earlier gather cannot write into the copy about to be fingerprinted).
    if (world > 1) EXPECT_EQ(flat.full().storage().nbytes(), 0u);
    flat.unshard(comm);
    ASSERT_TRUE(flat.unsharded());
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(torch::equal(params[i].detach(), root[i].detach())) << "param " << i;
    }
    EXPECT_TRUE(torch::equal(kept, root[1].detach()));
    flat.reshard();
  });
}

TEST_P(ZeroCollectives, EveryStageTakesTheSameSgdStep) {
  const int world = GetParam();
  // One SGD-momentum step (lr 0.5, weight decay 0.1) from rank-specific gradients, grad_scale
  // 1/W: every stage must land on p - 0.5·(mean_r g_r + 0.1·p).
  std::vector<std::vector<at::Tensor>> results(4);
  for (int s = 0; s < 4; ++s) {
    std::vector<at::Tensor> per_rank(world);
    run_ranks(world, [&](int rank, const comm::Collectives& comm) {
      std::vector<at::Tensor> params = unit_params(0);
      ZeroConfig config;
      config.stage = parse_stage(s);
      config.optimizer.lr = 0.5;
      config.optimizer.momentum = 0.9;
      config.optimizer.weight_decay = 0.1;
      config.grad_scale = 1.0 / world;
      ZeroState state({{"unit", params, {"a", "b", "c"}, {0, 5, 12}}}, 15, config,
                      comm.process_group());
      EXPECT_EQ(state.plan().total_coordinates(), 15);
      {
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < params.size(); ++i) {
          at::Tensor g = rank_grad(rank, i, params[i].numel());
          if (s < 2) {
            params[i].mutable_grad().add_(g);  // a view of the flat gradient, as autograd would
          } else {
            params[i].mutable_grad() = g;
          }
        }
      }
      if (s >= 2) {
        for (int64_t i = 0; i < 3; ++i) state.grad_ready(0, i);
      }
      state.step();
      per_rank[rank] = state.full_parameters(0);
    });
    results[s] = per_rank;
  }
  std::vector<at::Tensor> start = unit_params(0);
  const UnitLayout layout = unit_layout(world);
  for (size_t i = 0; i < 3; ++i) {
    at::Tensor mean = torch::zeros({layout.params()[i].numel});
    for (int r = 0; r < world; ++r) mean += rank_grad(r, i, mean.numel());
    mean /= world;
    at::Tensor expected = start[i].detach() - 0.5 * (mean + 0.1 * start[i].detach());
    for (int s = 0; s < 4; ++s) {
      for (int r = 0; r < world; ++r) {
        at::Tensor got = results[s][r].narrow(0, layout.flat_offsets()[i], mean.numel());
        EXPECT_TRUE(torch::allclose(got, expected, 1e-6, 1e-6))
            << "stage " << s << " rank " << r << " param " << i;
      }
    }
  }
}

// The private path (Note [private gradients]): a unit gradient handed over as one packed tensor,
// in two micro-batches (one lent, one donated), is reduced and applied exactly like autograd's
// per-parameter gradients — every stage lands on the same SGD step as the per-parameter path above.
TEST_P(ZeroCollectives, PackedPrivateGradientsTakeTheSameStepInEveryStage) {
  const int world = GetParam();
  const UnitLayout layout = unit_layout(world);
  std::vector<at::Tensor> start = unit_params(0);
  for (int s = 0; s < 4; ++s) {
    std::vector<at::Tensor> per_rank(world);
    run_ranks(world, [&](int rank, const comm::Collectives& comm) {
      std::vector<at::Tensor> params = unit_params(0);
      ZeroConfig config;
      config.stage = parse_stage(s);
      config.optimizer.lr = 0.5;
      ZeroState state({{"unit", params, {"a", "b", "c"}, {0, 5, 12}}}, 15, config,
                      comm.process_group());
      for (int micro = 0; micro < 2; ++micro) {  // two halves of each rank's gradient
        at::Tensor packed = torch::zeros({layout.padded_numel()});
        for (size_t i = 0; i < 3; ++i) {
          packed.narrow(0, layout.flat_offsets()[i], layout.params()[i].numel)
              .copy_(rank_grad(rank, i, layout.params()[i].numel) * 0.5);
        }
        // The first half is lent (the engine copies it where it reduces asynchronously, so
        // reusing the buffer changes nothing); the second is donated and never touched again.
        const bool donated = micro == 1;
        state.add_unit_grad(0, packed, /*release_params=*/true, donated);
        if (!donated) packed.fill_(1e9);
      }
      state.noisy_step(nullptr, 1.0 / world);  // no noise
      per_rank[rank] = state.full_parameters(0);
    });
    for (size_t i = 0; i < 3; ++i) {
      at::Tensor mean = torch::zeros({layout.params()[i].numel});
      for (int r = 0; r < world; ++r) mean += rank_grad(r, i, mean.numel());
      mean /= world;
      at::Tensor expected = start[i].detach() - 0.5 * mean;
      for (int r = 0; r < world; ++r) {
        at::Tensor got = per_rank[r].narrow(0, layout.flat_offsets()[i], mean.numel());
        EXPECT_TRUE(torch::allclose(got, expected, 1e-6, 1e-6))
            << "stage " << s << " rank " << r << " param " << i;
      }
    }
  }
}

TEST(ZeroCollectivesChecks, PrivateGradientOfTheWrongShapeIsRejectedNamingIt) {
  run_ranks(1, [&](int, const comm::Collectives& comm) {
    std::vector<at::Tensor> params = unit_params(0);
    ZeroConfig config;
    config.stage = Stage::k2;
    ZeroState state({{"unit", params, {"a", "b", "c"}, {0, 5, 12}}}, 15, config,
                    comm.process_group());
    try {
      state.add_unit_grad(0, torch::zeros({15}));  // the padded layout has 19 (alignment 4)
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("unit 'unit': a private gradient must have shape [19]"),
                std::string::npos)
          << e.what();
    }
  });
}

TEST(ZeroCollectivesChecks, RejectsMismatchedShapesNamingThem) {
  run_ranks(2, [&](int, const comm::Collectives& comm) {
    at::Tensor full = torch::zeros({10});
    at::Tensor shard = torch::zeros({4});
    EXPECT_THROW(
        {
          try {
            comm.reduce_scatter_sum(shard, full);
          } catch (const c10::Error& e) {
            EXPECT_NE(std::string(e.what()).find("full has 10 elements"), std::string::npos);
            throw;
          }
        },
        c10::Error);
    at::Tensor inside = full.narrow(0, 0, 5);
    EXPECT_THROW(comm.all_gather(full, inside), c10::Error);  // overlapping
  });
}

// The private step adds noise exactly once to every global coordinate, whatever the world size
// and stage (design.md §3 "Noise"): with a zero gradient, SGD's update is -lr · grad_scale · σ z_j
// on every coordinate j, z_j the counter-based draw a single process makes for the whole model
// ([0, 15) at offset 0), on every rank. Mutations tried in src/dp/step_noise.cpp: each run's
// noise added twice (2σ z), and a run's global offset shifted by one (another draw); both fail
// here for every world size.
TEST_P(ZeroCollectives, NoiseIsAddedOncePerCoordinateInEveryStage) {
  const int world = GetParam();
  const UnitLayout layout = unit_layout(world);
  const std::vector<at::Tensor> start = unit_params(0);
  constexpr double kStd = 0.75, kLr = 0.5, kScale = 0.25;
  at::Tensor z = torch::zeros({15});
  static const auto add_noise =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpzero::add_noise_", "")
          .typed<at::Tensor&(at::Tensor&, double, int64_t, int64_t, int64_t)>();
  add_noise.call(z, kStd, /*seed=*/7, /*step=*/3, /*offset=*/0);  // σ z over [0, 15)
  for (int s = 0; s < 4; ++s) {
    std::vector<at::Tensor> per_rank(world);
    run_ranks(world, [&](int rank, const comm::Collectives& comm) {
      std::vector<at::Tensor> params = unit_params(0);
      ZeroConfig config;
      config.stage = parse_stage(s);
      config.optimizer.lr = kLr;
      ZeroState state({{"unit", params, {"a", "b", "c"}, {0, 5, 12}}}, 15, config,
                      comm.process_group());
      state.add_unit_grad(0, torch::zeros({layout.padded_numel()}), /*release_params=*/true,
                          /*donated=*/true);
      dp::StepNoise noise(kStd, dp::NoiseKey{false, 7, {}}, 3);
      state.noisy_step(&noise, kScale);
      per_rank[rank] = state.full_parameters(0);
    });
    int64_t global = 0;
    for (size_t i = 0; i < 3; ++i) {
      const int64_t n = layout.params()[i].numel;
      const at::Tensor want =
          start[i].detach() - kLr * kScale * z.narrow(0, global, n);  // once, on every j
      for (int r = 0; r < world; ++r) {
        const at::Tensor got = per_rank[r].narrow(0, layout.flat_offsets()[i], n);
        EXPECT_TRUE(torch::allclose(got, want, 1e-6, 1e-7))
            << "stage " << s << " rank " << r << " param " << i << ": " << got << " vs " << want;
      }
      global += n;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ZeroCollectives, ::testing::Values(1, 2, 3, 4));

}  // namespace
}  // namespace dpzero::zero
