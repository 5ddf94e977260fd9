// src/dp/norm_schedule.h — when and where the clipping book computes the norms it keeps: the two
// process settings of Note [norms when their input is done] (src/dp/book.cpp) and the second
// stream of Note [norms on a side stream].
//
// Note [norms on a side stream]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With early norms (Note [norms when their input is done]) a set's norms are computed while
// autograd goes on to the earlier layers' input-gradient GEMMs; on a GPU both are queued on one
// stream and run one after the other. With the side stream on as well, the book queues a set's
// norm op on a stream of its own:
//   1. an event recorded by each call of the set on its current stream when it reports (mark),
//      and one on the current stream when the set fires, all of which the side stream waits
//      for: the norms read A and G only after the kernels that wrote them, whichever streams
//      the calls' backwards ran on;
//   2. A, G and anything else they read are recorded as used on the side stream, so the caching
//      allocator does not hand their memory to another allocation before the norms have read it
//      (a discarded micro-batch frees them while the norms may still run);
//   3. an event recorded on the side stream after the norms, kept by each part of the set; the
//      stream that completes the part's group waits for it before reading the norms, and records
//      them as used there (wait_and_use), whichever stream that is (a group may complete on
//      another stream than the one its set fired on).
// The arithmetic is the same kernels' on the same inputs: the norms, and so the clip factors,
// should be bitwise those of the one-stream path (tests/python/test_norm_schedule.py compares
// the trained models on a GPU; cuBLAS, which the float64 Gram strips call, promises equal bits
// across streams only with a fixed workspace, CUBLAS_WORKSPACE_CONFIG). Nothing here reads the
// device from the host. The CPU has no streams; there the setting changes nothing. Both settings
// are off by default: whether they win is a measurement (experiments/private_bench.py's
// dp-flat-stream), and early norms add a premise (Note [kept inputs stay unwritten]).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Event.h>

namespace dpzero::dp {

// The process settings (tests and benchmarks: dpzero._C.dp._set_early_norms and
// _set_norm_stream). Each setter returns the previous value.
bool set_early_norms(bool on);
bool early_norms();
bool set_norm_stream(bool on);
bool norm_stream();

// Whether early norms on tensors of `device` go to a side stream: the setting is on and the
// device has streams (not the CPU).
bool norm_stream_for(const at::Device& device);

// What run_aside queued: the event the readers of its outputs wait for, on `device`.
struct Aside {
  c10::Event done;
  at::Device device;
};

// Step 1 at a call's report: an event on the current stream of `device`.
std::shared_ptr<const c10::Event> mark(const at::Device& device);

// Runs `work` on a side stream of `device` (steps 1 and 2 of the Note) after the events `after`
// (the set's marks) and the current stream's work so far: `reads` are the tensors it reads.
// Returns its outputs and the event after them (step 3).
std::pair<std::vector<at::Tensor>, std::shared_ptr<const Aside>> run_aside(
    const at::Device& device, const std::vector<std::shared_ptr<const c10::Event>>& after,
    const std::vector<at::Tensor>& reads, const std::function<std::vector<at::Tensor>()>& work);

// Step 3 on the reader's side: the current stream of `aside`'s device waits for its event, and
// `used` (outputs of that work) are recorded as used on that stream.
void wait_and_use(const Aside& aside, const std::vector<at::Tensor>& used);

}  // namespace dpzero::dp
