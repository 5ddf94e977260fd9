// src/dp/side_stream.h — the clipping book's work on a second stream of the device, beside the
// backward's own (Note [norms on a side stream]).
//
// Note [norms on a side stream]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The per-sample norms of a layer need only its A and G, which exist once its backward node has
// run; autograd then goes on to the previous layer's input-gradient GEMMs. On a GPU both are
// queued on one stream, so the norm kernels (small grids at small T) and the GEMMs run one after
// the other. With the side stream on, the book queues a layer's norms on a stream of its own:
//   1. an event recorded on the current stream, which the side stream waits for: the norms read
//      A and G only after the kernels that wrote them;
//   2. A and G are recorded as used on the side stream, so the caching allocator does not hand
//      their memory to the current stream's next allocation before the norms have read it (a
//      discarded micro-batch frees them while the norms may still run);
//   3. the norms' outputs are recorded as used on the current stream, where they are read;
//   4. an event recorded on the side stream after the norms, which the current stream waits for
//      before anything reads what they computed (Book::wait_aside: before a group's factors, and
//      at the end of the backward).
// The arithmetic is the same kernels' on the same inputs: the norms, and so the clip factors,
// should be bitwise those of the one-stream path (tests/python/test_norm_schedule.py compares
// the trained models on a GPU; cuBLAS, which the float64 Gram strips call, promises equal bits
// across streams only with a fixed workspace, CUBLAS_WORKSPACE_CONFIG). Nothing here reads the
// device from the host. The CPU has no streams; there the setting changes nothing. Off by
// default: whether it wins is a measurement (experiments/private_bench.py's dp-flat-stream).
#pragma once

#include <functional>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Event.h>

namespace dpzero::dp {

// The process setting (tests and benchmarks: dpzero._C.dp._set_norm_stream). Returns the previous
// value.
bool set_norm_stream(bool on);
bool norm_stream();

// Whether work on tensors of `device` goes to a side stream: the setting is on and the device
// has streams (not the CPU).
bool norm_stream_for(const at::Device& device);

// Runs `work` on a side stream of `device` as the Note says: `reads` are the tensors it reads,
// and the tensors it returns are recorded on the current stream. Returns them and the event the
// current stream must wait for before reading them.
std::pair<std::vector<at::Tensor>, c10::Event> run_aside(
    const at::Device& device, const std::vector<at::Tensor>& reads,
    const std::function<std::vector<at::Tensor>()>& work);

// Makes the current stream of `event`'s device wait for it (no host wait).
void wait_for(const c10::Event& event, const at::Device& device);

}  // namespace dpzero::dp
