// src/dp/generators.h — the global random generators a private run's model and data draw from
// (dropout, augmentations), keyed by the run's secret. Both front doors reseed through here; the
// Python door also reseeds Python's `random` and numpy's generator from the words it returns.
//
// Note [the model's own randomness]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Dropout in the forward and augmentation in a dataset's `__getitem__` draw from torch's global
// generators (CPU and CUDA), Python's `random` and numpy's global generator. How many numbers an
// example's draws come after depends on the other examples: a dropout mask is drawn for the
// whole padded batch [B, L_max, d], and an augmentation draws as many numbers as its example is
// long. So one example, replaced or added, shifts the draws of every example after it. Each of
// their contributions is still clipped, but all of them move: a privacy review moved one step's
// clipped sum 3.6 times its bound 2C that way (dropout 0.5, dynamic padding, one longer example),
// in both isolation modes, and 3.3 times with an augmentation that drew one number per token.
//
// The clipping argument covers this only when nobody who sees the release knows the draws. For
// every fixed value of the model's random numbers, one example moves the sum by at most C; the
// other examples' draws are i.i.d. uniform under both neighbouring datasets, whatever positions
// of the stream they take, so the two runs can be coupled to give every other example the same
// draws, and the release is a mixture, over those secret draws, of mechanisms each within the
// bound. A generator seeded from a public value (`torch.manual_seed(0)`, a Trainer's `seed=42`, a
// config file) makes the draws a known function of the batch's shapes instead, and the coupling
// is gone. So a private run keys these generators by a secret of its own: the run's noise key in
// secure mode, its seed when seeded (whose noise is then as secret as that seed, Note [secure by
// default] in privacy/entropy.h). Their state at each reseed is ChaCha20 (RFC 8439) under a key
// derived from that secret (generator_key: the first half of the block at nonce word 2 =
// kGeneratorStream, which neither the noise nor the sampler uses), at counters 0..39 and nonce
// (purpose and rank, step, micro-batch). They are reseeded
//  * before each micro-batch's examples are fetched in the Python process (kFetch), so that
//    augmentations draw from it;
//  * when each micro-batch is handed out (kForward; also by own_batch), so that dropout draws
//    from it whether or not DataLoader workers fetched the examples;
//  * when a Python epoch's iteration starts (kIter), before DataLoader workers start: each
//    worker's base seed is drawn from torch's generator then, and each worker reseeds itself
//    from the run's secret and that base seed (kWorker; torch's own per-worker seeding keeps 32
//    bits of it for its Mersenne twister);
//  * when a logical batch closes, stepped, refused or dropped (kBetween): checkpoints save the
//    states then (dpzero.checkpoint's extras, the Trainer's rng_state.pth), and a state after a
//    step's draws would give them away (torch's state even records the seed it started from); it
//    also holds nothing of the realised batch sizes (two earlier reviews read them off saved
//    states under add/remove neighbours). Nothing that trains draws from it: the next batch's
//    fetch and forward reseed first;
//  * never, for dpzero.checkpoint's saved states (kSaved): a checkpoint of a private model holds
//    the states of kSaved at the next step, which nothing draws from, not the live ones (a save
//    in the middle of a logical batch, or after a micro-batch is handed out, would hold the
//    states its draws come from).
// Each reseed sets a generator's whole state, not a seed: torch's CPU generator (a Mersenne
// twister, MT19937) keeps only 32 bits of `manual_seed`, and numpy's `seed(int)` 32, so a run's
// draws would have 2^32 possibilities a step, few enough to search and to repeat within a run (a
// review found two steps of one run drawing the same stream). So the twister gets 624 words,
// CUDA's Philox generators a 64-bit key, and the Python door's `random` and numpy eight words.
//
// Seeded runs stay reproducible (the same seed, the same draws at every step, a resumed run's
// too); secure runs draw afresh. What this cannot reach: generators the caller makes and seeds
// (`torch.Generator().manual_seed(0)` inside an augmentation), reseeding in the caller's own loop,
// and a caller's own data pipeline before own_batch (or before the C++ door's hand_out), whose
// augmentations draw from the state between steps (secret, but saved by checkpoints).
#pragma once

#include <array>
#include <cstdint>

#include "src/dp/step_noise.h"

namespace dpzero::dp {

enum class DrawPurpose : uint32_t {
  kIter = 1, kFetch = 2, kForward = 3, kBetween = 4, kWorker = 5, kSaved = 6
};

constexpr uint32_t kGeneratorStream = 0x67656e73u;  // "gens"; privacy/streams.h has the others

// What one reseed sets.
struct GeneratorWords {
  std::array<uint32_t, 624> twister;  // the CPU generator's MT19937 state, twisted before use
  uint64_t seed = 0;                  // CUDA's Philox key, and the CPU state's recorded seed
  std::array<uint32_t, 8> extra;      // for the Python door: Python's random and numpy
};

// The run's generator key from its noise key (a secure key's eight words, or a seed's two).
// std::invalid_argument naming a secure key that does not have 8 words.
std::array<uint32_t, 8> generator_key(const NoiseKey& key);

// The words of one reseed: ChaCha20 under `key` at nonce (nonce0, nonce1, nonce2).
GeneratorWords generator_words(const std::array<uint32_t, 8>& key, uint32_t nonce0,
                               uint32_t nonce1, uint32_t nonce2);

// The nonce of `purpose` on `rank` at micro-batch `index` of logical step `step` (each below
// 2^32; rank below 2^24): std::invalid_argument naming a value out of range.
std::array<uint32_t, 3> draw_nonce(DrawPurpose purpose, int64_t rank, int64_t step,
                                   int64_t index);

// torch's default CPU generator set to `words` (its engine's whole state) and, when `cuda`, every
// CUDA device's default generator seeded with words.seed (the Python door passes false and
// seeds CUDA through torch.cuda, which defers the seeding of a device not yet initialised).
void reseed_torch(const GeneratorWords& words, bool cuda);

// The C++ front door's reseed: generator_words of `purpose` on `rank` at (`step`, `index`), into
// torch's CPU and CUDA generators.
void reseed(const std::array<uint32_t, 8>& key, DrawPurpose purpose, int64_t rank, int64_t step,
            int64_t index);

}  // namespace dpzero::dp
