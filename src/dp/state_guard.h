// src/dp/state_guard.h — module state the private step does not write, held fixed for the C++
// front door (privacy_engine.h): Note [state written from data], whose rule and reasons live in
// python/dpzero/private/state_guard.py (the Python front door's guard, with more to see: tensor
// provenance, releases through state_dict). What both doors share is the fingerprint below.
//
// Buffers and frozen parameters are released with the model and read by every later forward, so
// a forward that writes something computed from the batch into one (a running mean, a counter of
// forward calls, which follows the realised Poisson batch sizes) releases it without noise and
// lets one example reach later steps' gradients outside the clipping. The guard:
//   - when the engine takes the model, copies every buffer's bytes (all of its storage, unless a
//     trained parameter shares it) and fingerprints every frozen parameter on its device;
//   - before each micro-batch of a logical batch, compares on the device (no host read), ORs
//     what changed into pending flags and puts every buffer back, so that nothing of one
//     micro-batch reaches the next one's forward, even a write that a later forward undoes, nor
//     a write made between logical batches (an evaluation forward on training rows);
//   - at every step, reads those flags with the step's one read (Book::read_checks) and refuses
//     the step naming each changed tensor, then puts the buffers back; a changed frozen
//     parameter cannot be put back, so every later step is refused until it is accepted;
//   - also refuses a buffer or frozen parameter added, removed or replaced, and a trained
//     parameter written outside the step: its version counter moved (an in-place write in the
//     forward) or its fingerprint did (a write through .data(), which moves no version counter:
//     a data-dependent initialisation); the update's own writes are recorded after each step.
// A write of the caller's that holds nothing of the training data (a load, a value computed from
// the released model) is accepted by name (accept).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

namespace dpzero::dp {

// A 0-dim int64 on t's device: sum mod 2^64 over t's words w_j (Note [fingerprint words]) of
// mix(w_j XOR (j + key)·g), with g splitmix64's golden-ratio increment and mix its finaliser (a
// bijection of 64-bit words whose xor-shifts and multiplications leave no linear relation among
// outputs; the one definition is kernels/fingerprint_words.h). A changed word moves its term to a
// value that, without the key, is unpredictable, so several changes cancel only by chance, about
// 2^-64 (an earlier linear sum, w_j·m_j, cancelled whenever the top bits of two words flipped: a
// review's negated float64 entries). A check against accidents and forwards, not a cryptographic
// hash. Equal bytes give equal fingerprints (integer arithmetic, any order). One pass over the
// words, by the op dpzero::_state_fingerprint: multi-threaded on the host, one launch on a GPU (no
// copy of the whole tensor beyond a contiguous one).
//
// Note [fingerprint words]
// The words are t's contiguous bytes read as little-endian 8-byte integers when their count is a
// multiple of 8 (a view whose bytes do not start 8-byte aligned is copied first; every whole
// storage torch allocates is aligned), else as integers of t's element size, sign-extended (bytes
// zero-extended; a 16-byte element as its bytes). The cost is per word (two 64-bit multiplies,
// whatever the word's width), so 8-byte words make a float32 memory's pass half as long and a
// bfloat16 one's a quarter. Nothing is lost: a changed byte changes its word, and a changed word
// its term; and the words depend on the bytes and their count only, so equal bytes still give
// equal fingerprints.
at::Tensor state_fingerprint(const at::Tensor& t, int64_t key);

// Where a tensor's elements are and how they are read: its storage (data pointer and bytes),
// offset, sizes, strides, dtype and lazy negation and conjugation bits. A trained parameter's place
// is recorded after each update and must be the same at every later check: a parameter pointed at
// other memory, or at another part of its own unit's memory, or at a negated view of it (through
// .data or set_data, which move no version counter and, for the last two, no byte) is read by the
// forwards where the optimizer does not write (Note [trained parameters written outside the step]
// in python/dpzero/private/state_guard.py). `readable` is false where the tensor has no storage or
// the storage refuses access (a resharded ZeRO stage-3 parameter); such a place equals none.
struct TensorPlace {
  bool readable = false;
  int64_t data = 0, nbytes = 0, offset = 0;
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype = at::kFloat;
  bool neg = false, conj = false;

  explicit TensorPlace(const at::Tensor& t);
  bool operator==(const TensorPlace& o) const;
  bool operator!=(const TensorPlace& o) const { return !(*this == o); }
};
// [L] int64 on their device: state_fingerprint of each of `ts` (L >= 1 tensors on one device) in
// one op call (on a GPU one launch per 96 tensors).
at::Tensor state_fingerprints(const std::vector<at::Tensor>& ts, int64_t key);

class StateGuard {
 public:
  // Fixes `model`'s state now. `trained`: the parameters the private step writes (not state),
  // named as named_parameters() names them.
  StateGuard(std::shared_ptr<torch::nn::Module> model,
             std::vector<std::pair<std::string, at::Tensor>> trained);

  // Before each micro-batch of the logical batch is handed out (see above). No host read.
  void check_micro_batch();
  // What changed, unread: one 0-dim bool per entry and then per memory the trained parameters
  // live in (a unit's flat buffer), on its device (pending changes included), for the step's
  // Book::read_checks.
  std::vector<at::Tensor> step_flags();
  // The step's verdict from the read flags (step_flags's, flattened; empty when there are no
  // entries): the refusal, naming what changed, or nullopt. Puts every buffer back and forgets
  // the pending flags either way.
  std::optional<std::string> verdict(const std::vector<bool>& flags);
  // The logical batch was dropped: forgets the pending flags.
  void clear_pending();
  // The trained parameters' versions and fingerprints now (after the step's update).
  void record_trained();
  // Takes the state now as fixed: all of it, the trained parameters' writes included (`names`
  // empty), or only the named buffers and frozen parameters (dotted, as named_buffers() /
  // named_parameters() name them). std::invalid_argument naming an unknown name.
  void accept(const std::vector<std::string>& names);
  // A release's check, read here: the refusal (what changed), or nullopt. Changes nothing.
  std::optional<std::string> release_refusal() const;
  // Puts every buffer back to its copy (after the step's verdict, and after a probe's forwards,
  // which must leave no trace).
  void restore_buffers();

 private:
  struct Entry {
    std::string name;                         // dotted ("encoder.ema")
    std::shared_ptr<torch::nn::Module> owner;
    std::string local;                        // its name in the owner
    bool buffer = false;                      // else a frozen parameter
    at::Tensor tensor;                        // the tensor fixed
    at::Tensor copy;                          // a buffer's bytes, [nbytes] uint8
    at::Tensor fingerprint;                   // a frozen parameter's, on its device
  };
  std::vector<Entry> walk() const;            // the model's state now (no copies)
  void fix(const std::vector<std::string>& names);
  std::vector<std::string> structure() const;  // added, removed, replaced
  std::vector<std::string> written_trained() const;
  std::vector<at::Tensor> flags() const;
  std::set<const void*> trained_storages() const;

  std::shared_ptr<torch::nn::Module> model_;
  std::vector<std::pair<std::string, at::Tensor>> trained_;
  std::vector<int64_t> versions_;  // trained_'s, recorded
  std::vector<TensorPlace> places_;  // trained_'s, recorded
  struct TrainedMemory {           // a storage the trained parameters live in (a unit's buffer)
    std::vector<std::string> names;  // the trained parameters in it
    at::Tensor memory;               // all of it, flat
    const void* data = nullptr;      // its data pointer when recorded
    at::Tensor fingerprint;          // recorded, on its device
  };
  std::vector<TrainedMemory> trained_memories_;
  // The fingerprint of each trained memory now, in order (one op call when they share a device).
  std::vector<at::Tensor> trained_fingerprints() const;
  int64_t key_ = 0;                // the fingerprints'
  std::vector<Entry> entries_;
  std::vector<at::Tensor> pending_;             // per entry, OR-ed (empty: none)
  std::vector<std::string> pending_problems_;   // seen at a micro-batch without a read
};

}  // namespace dpzero::dp
