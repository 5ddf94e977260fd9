// tests/cpp/torch/spread_values.h — random float32 values over a wide range of magnitudes and
// both signs, for the lane tests (a different order of additions shows in their bits).
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace dpzero::testing {

// n values ldexp(N(0, 1), e) with e uniform in [-spread, spread].
inline std::vector<float> spread_values(std::mt19937& rng, int64_t n, int spread) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> exponent(-spread, spread);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = std::ldexp(normal(rng), exponent(rng));
  return x;
}

}  // namespace dpzero::testing
