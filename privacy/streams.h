// privacy/streams.h — stream tags that keep the uses of one seed or key independent: the same
// (seed, step, index) drawn for noise and for sampling go through different counters.
#pragma once

#include <cstdint>

namespace dpzero::privacy {

constexpr uint32_t kNoiseStream = 0x6e6f6973u;    // "nois"
constexpr uint32_t kSamplerStream = 0x73616d70u;  // "samp"

}  // namespace dpzero::privacy
