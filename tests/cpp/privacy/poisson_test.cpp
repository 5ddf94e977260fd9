// Poisson sampling (Note [poisson schedule]): inclusion is a pure function of (seed, t, k); the
// per-rank schedules partition the logical batch and agree on the micro-batch count.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <stdexcept>

#include "privacy/poisson.h"
#include "tests/cpp/common/error_message.h"

namespace dpzero::privacy {
namespace {

TEST(Poisson, LogicalBatchIsThePureInclusionFunction) {
  const auto batch = poisson_logical_batch(SamplerSource{7}, 3, 5000, 0.01);
  std::set<int64_t> in(batch.begin(), batch.end());
  for (int64_t k = 0; k < 5000; ++k) {
    EXPECT_EQ(in.count(k) == 1, sampler_uniform(7, 3, static_cast<uint64_t>(k)) < 0.01) << k;
  }
  EXPECT_TRUE(std::is_sorted(batch.begin(), batch.end()));
  EXPECT_EQ(poisson_logical_batch(SamplerSource{7}, 3, 5000, 0.0).size(), 0u);
  EXPECT_EQ(poisson_logical_batch(SamplerSource{7}, 3, 5000, 1.0).size(), 5000u);
  EXPECT_NE(poisson_logical_batch(SamplerSource{7}, 4, 5000, 0.01), batch);  // another step, another batch
}

TEST(Poisson, RanksPartitionTheBatchAndAgreeOnMicroBatchCount) {
  for (int64_t world : {1, 2, 3, 4, 8}) {
    for (int64_t m : {1, 3, 16}) {
      const auto batch = poisson_logical_batch(SamplerSource{99}, 12, 997, 0.05);
      std::vector<int64_t> union_of_ranks;
      size_t agreed = 0;
      for (int64_t r = 0; r < world; ++r) {
        const auto s = poisson_micro_batches(SamplerSource{99}, 12, 997, 0.05, r, world, m);
        if (r == 0) agreed = s.micro_batches.size();
        EXPECT_EQ(s.micro_batches.size(), agreed) << "rank " << r;
        EXPECT_EQ(s.logical_batch_size, static_cast<int64_t>(batch.size()));
        for (const auto& mb : s.micro_batches) {
          EXPECT_LE(static_cast<int64_t>(mb.size()), m);
          for (int64_t k : mb) {
            EXPECT_EQ(k % world, r);
            union_of_ranks.push_back(k);
          }
        }
      }
      std::sort(union_of_ranks.begin(), union_of_ranks.end());
      EXPECT_EQ(union_of_ranks, batch) << "world " << world << " m " << m;
    }
  }
}

// Note [cyclic poisson]: with b partitions step t samples partition t mod b alone, by the very
// draws of the ordinary schedule (its batch is the ordinary batch cut to that partition), each
// example only in steps of its own residue; the ranks' shares still partition the batch, every
// rank with a share of each partition.
TEST(Poisson, CyclicPartitionsSampleOnePartitionPerStepWithTheSameDraws) {
  constexpr int64_t kN = 997, kB = 4;
  EXPECT_EQ(poisson_logical_batch(SamplerSource{99}, 12, kN, 0.05, 1),
            poisson_logical_batch(SamplerSource{99}, 12, kN, 0.05));
  std::vector<int64_t> seen(kN, 0);
  for (uint32_t t = 0; t < 12; ++t) {
    const auto ordinary = poisson_logical_batch(SamplerSource{5}, t, kN, 0.3);
    std::vector<int64_t> want;
    for (int64_t k : ordinary)
      if (k % kB == static_cast<int64_t>(t) % kB) want.push_back(k);
    const auto cyclic = poisson_logical_batch(SamplerSource{5}, t, kN, 0.3, kB);
    EXPECT_EQ(cyclic, want) << "step " << t;
    EXPECT_FALSE(cyclic.empty());
    for (int64_t k : cyclic) {
      EXPECT_EQ(k % kB, static_cast<int64_t>(t) % kB);
      ++seen[k];
    }
    for (int64_t world : {2, 4}) {
      std::vector<int64_t> union_of_ranks;
      for (int64_t r = 0; r < world; ++r) {
        const auto s = poisson_micro_batches(SamplerSource{5}, t, kN, 0.3, r, world, 8, kB);
        EXPECT_EQ(s.logical_batch_size, static_cast<int64_t>(cyclic.size()));
        EXPECT_GT(s.rank_counts[r], 0) << "rank " << r << " of " << world << " step " << t;
        for (const auto& mb : s.micro_batches) union_of_ranks.insert(union_of_ranks.end(), mb.begin(), mb.end());
      }
      std::sort(union_of_ranks.begin(), union_of_ranks.end());
      EXPECT_EQ(union_of_ranks, cyclic) << "world " << world << " step " << t;
    }
  }
  EXPECT_NE(testing::error_message<std::invalid_argument>(
                [] { poisson_logical_batch(SamplerSource{1}, 1, 10, 0.1, 0); })
                .find("partitions must be >= 1, got 0"),
            std::string::npos);
}

TEST(Poisson, EmptyLogicalBatchIsOneEmptyMicroBatch) {
  const auto s = poisson_micro_batches(SamplerSource{1}, 1, 100, 0.0, 0, 2, 8);
  EXPECT_EQ(s.logical_batch_size, 0);
  ASSERT_EQ(s.micro_batches.size(), 1u);
  EXPECT_TRUE(s.micro_batches[0].empty());
}

TEST(Poisson, BadArgumentsNameTheValue) {
  auto message = [](auto fn) { return testing::error_message<std::invalid_argument>(fn); };
  EXPECT_NE(message([] { poisson_logical_batch(SamplerSource{1}, 1, -5, 0.1); }).find("-5"), std::string::npos);
  EXPECT_NE(message([] { poisson_logical_batch(SamplerSource{1}, 1, 5, 1.5); }).find("1.5"), std::string::npos);
  EXPECT_NE(message([] { poisson_micro_batches(SamplerSource{1}, 1, 5, 0.1, 3, 2, 4); }).find("got 3"),
            std::string::npos);
  EXPECT_NE(message([] { poisson_micro_batches(SamplerSource{1}, 1, 5, 0.1, 0, 2, 0); }).find("got 0"),
            std::string::npos);
}

TEST(Poisson, SecureSourceUsesChaCha20AndPartitionsTheSame) {
  SamplerSource secure;
  secure.secure = true;
  secure.key = ChaCha20Key{{9, 8, 7, 6, 5, 4, 3, 2}};
  const auto batch = poisson_logical_batch(secure, 5, 3000, 0.02);
  std::set<int64_t> in(batch.begin(), batch.end());
  for (int64_t k = 0; k < 3000; ++k) {
    EXPECT_EQ(in.count(k) == 1, secure_sampler_uniform(secure.key, 5, static_cast<uint64_t>(k)) < 0.02);
  }
  EXPECT_NE(batch, poisson_logical_batch(SamplerSource{0}, 5, 3000, 0.02));
  std::vector<int64_t> union_of_ranks;
  for (int64_t r = 0; r < 3; ++r) {
    for (const auto& mb : poisson_micro_batches(secure, 5, 3000, 0.02, r, 3, 10).micro_batches) {
      union_of_ranks.insert(union_of_ranks.end(), mb.begin(), mb.end());
    }
  }
  std::sort(union_of_ranks.begin(), union_of_ranks.end());
  EXPECT_EQ(union_of_ranks, batch);
}

}  // namespace
}  // namespace dpzero::privacy
