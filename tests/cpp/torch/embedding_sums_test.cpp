// dpzero::_add_embedding_sums_ (Note [embedding sums] in kernels/embedding_sums.h) on every device
// against the Note's arithmetic written out here one sample, one id and one entry at a time (each
// product and addition a separately rounded float32 operation): the same bits, with repeated ids,
// padding tokens and dropped samples whose rows hold NaN, samples past one block's sort (the CUDA
// kernel's ATen-sorted path), many chunks of samples, a strided accumulator, and a repeat on the
// device that gives the same bits (no atomics). Mutations tried on the CPU kernel: adding the
// sample's rows straight into the accumulator (no per-sample run); reading a dropped sample.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "tests/cpp/torch/devices.h"

namespace dpzero {
namespace {

using testing::cuda_available;
using testing::devices;
using testing::kNoCuda;

at::Tensor& add_embedding_sums(at::Tensor& self, const at::Tensor& ids, const at::Tensor& g,
                               const at::Tensor& scale, int64_t pad) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpzero::_add_embedding_sums_", "")
          .typed<at::Tensor&(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             int64_t)>();
  return op.call(self, ids, g, scale, pad);
}

int64_t set_chunk_bytes(int64_t bytes) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpzero::_set_chunk_bytes", "")
                             .typed<int64_t(int64_t)>();
  return op.call(bytes);
}

// The Note's sums: self0 [V, d], ids [B, T], g [B, T, d] float32 (the values read), scale [B].
at::Tensor reference(const at::Tensor& self0, const at::Tensor& ids, const at::Tensor& g,
                     const at::Tensor& scale, int64_t pad) {
  at::Tensor out = self0.clone();
  const int64_t b = g.size(0), t = g.size(1), d = g.size(2);
  const int64_t* pi = ids.data_ptr<int64_t>();
  const float* pg = g.data_ptr<float>();
  const float* pc = scale.data_ptr<float>();
  float* po = out.data_ptr<float>();
  for (int64_t i = 0; i < b; ++i) {
    if (!std::isfinite(pc[i]) || pc[i] == 0.0f) continue;
    std::map<int64_t, std::vector<int64_t>> tokens;  // id -> positions, ascending
    for (int64_t k = 0; k < t; ++k) {
      if (pi[i * t + k] != pad) tokens[pi[i * t + k]].push_back(k);
    }
    for (const auto& [v, positions] : tokens) {
      for (int64_t j = 0; j < d; ++j) {
        volatile float run = 0.0f;
        for (const int64_t k : positions) {
          const volatile float term = pc[i] * pg[(i * t + k) * d + j];
          run = run + term;
        }
        po[v * d + j] = po[v * d + j] + run;
      }
    }
  }
  return out;
}

struct Case {
  int64_t b, t, v, d, pad;
};

TEST(EmbeddingSums, EveryDeviceGivesTheNotesBits) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  at::manual_seed(71);
  for (const Case c : {Case{7, 9, 3, 5, 2}, Case{5, 1, 4, 3, -1}, Case{3, 40, 50, 300, 0},
                       Case{70, 6, 2, 257, -1}, Case{2, 2100, 37, 5, 4}, Case{3, 2048, 5, 3, -1}}) {
    at::Tensor ids = at::randint(c.v, {c.b, c.t}, at::kLong);
    at::Tensor rows = at::randn({c.b, c.t, c.d}, at::kFloat) * 3;
    at::Tensor scale = at::rand({c.b}, at::kFloat) * 2;
    const float dropped[] = {0.0f, nan, -0.0f, inf};
    for (int64_t i = 1, k = 0; i < c.b && k < 4; i += 2, ++k) {
      scale[i] = dropped[k];
      rows[i][0][0] = nan;  // never read
    }
    if (c.pad >= 0) {
      ids.slice(1, 0, c.t, 2).fill_(c.pad);
      rows.masked_fill_((ids == c.pad).unsqueeze(-1), nan);
    }
    const at::Tensor self0 = at::randn({c.v, c.d}, at::kFloat);
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const at::Tensor g = rows.to(dtype);
      const at::Tensor want = reference(self0, ids, g.to(at::kFloat).contiguous(), scale, c.pad);
      ASSERT_TRUE(at::isfinite(want).all().item<bool>());
      for (const at::Device device : devices()) {
        const std::string what = std::to_string(c.b) + "x" + std::to_string(c.t) + "x" +
                                 std::to_string(c.d) + " " + c10::toString(dtype) + " on " +
                                 device.str();
        at::Tensor self = self0.to(device, /*non_blocking=*/false, /*copy=*/true);
        add_embedding_sums(self, ids.to(device), g.to(device), scale.to(device), c.pad);
        EXPECT_TRUE(self.cpu().equal(want)) << what << ": " << (self.cpu() - want).abs().max();
        at::Tensor wide = at::zeros({c.v, c.d, 2}, at::TensorOptions(device).dtype(at::kFloat));
        wide.select(2, 0).copy_(self0);
        at::Tensor strided = wide.select(2, 0);
        add_embedding_sums(strided, ids.to(device), g.to(device), scale.to(device), c.pad);
        EXPECT_TRUE(wide.select(2, 0).cpu().equal(want)) << what << " (strided)";
        EXPECT_TRUE(wide.select(2, 1).eq(0).all().item<bool>()) << what;
      }
    }
  }
}

TEST(EmbeddingSums, CudaChunksAndRepeatsGiveTheSameBits) {
  if (!cuda_available()) GTEST_SKIP() << kNoCuda;
  at::manual_seed(72);
  const int64_t b = 33, t = 17, v = 4, d = 600;
  const at::Tensor ids = at::randint(v, {b, t}, at::kLong).cuda();
  const at::Tensor g = at::randn({b, t, d}, at::kFloat).cuda();
  const at::Tensor scale = at::rand({b}, at::kFloat).cuda();
  const at::Tensor self0 = at::randn({v, d}, at::kFloat).cuda();
  at::Tensor once = self0.clone();
  add_embedding_sums(once, ids, g, scale, 1);
  at::Tensor again = self0.clone();
  add_embedding_sums(again, ids, g, scale, 1);
  EXPECT_TRUE(again.equal(once));
  // A budget of a few samples' workspace: many chunks, the last one short.
  const int64_t before = set_chunk_bytes(5 * t * (4 * d + 8));
  at::Tensor chunked = self0.clone();
  add_embedding_sums(chunked, ids, g, scale, 1);
  set_chunk_bytes(before);
  EXPECT_TRUE(chunked.equal(once));
}

TEST(EmbeddingSums, NoSamplesWriteNothingButMoveTheVersion) {
  for (const at::Device device : devices()) {
    const auto on = at::TensorOptions(device);
    at::Tensor self0 = at::randn({3, 4}, at::kFloat);
    self0[0][0] = -0.0f;
    at::Tensor self = self0.to(device, /*non_blocking=*/false, /*copy=*/true);
    const auto version = self._version();
    add_embedding_sums(self, at::zeros({0, 5}, on.dtype(at::kLong)), at::zeros({0, 5, 4}, on),
                       at::zeros({0}, on), -1);
    EXPECT_GT(self._version(), version) << device;
    EXPECT_TRUE(self.cpu().view(at::kInt).equal(self0.view(at::kInt))) << device;
  }
}

}  // namespace
}  // namespace dpzero
