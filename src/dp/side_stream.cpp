// src/dp/side_stream.cpp — Note [norms on a side stream] (side_stream.h).
#include "src/dp/side_stream.h"

#include <atomic>

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace dpzero::dp {
namespace {

std::atomic<bool>& setting() {
  static std::atomic<bool> on{false};
  return on;
}

void record_on(const at::Tensor& t, const c10::Stream& stream,
               const c10::impl::VirtualGuardImpl& impl) {
  if (t.defined() && t.has_storage()) impl.recordDataPtrOnStream(t.storage().data_ptr(), stream);
}

}  // namespace

bool set_norm_stream(bool on) { return setting().exchange(on); }
bool norm_stream() { return setting().load(); }

bool norm_stream_for(const at::Device& device) {
  return norm_stream() && device.type() != at::kCPU && device.type() != at::kMeta;
}

std::pair<std::vector<at::Tensor>, c10::Event> run_aside(
    const at::Device& device, const std::vector<at::Tensor>& reads,
    const std::function<std::vector<at::Tensor>()>& work) {
  const c10::impl::VirtualGuardImpl impl(device.type());
  const c10::Stream main = impl.getStream(device);
  const c10::Stream side = impl.getStreamFromGlobalPool(device);
  c10::Event written(device.type());
  written.record(main);  // 1. after the kernels that wrote the reads
  written.block(side);
  for (const at::Tensor& t : reads) record_on(t, side, impl);  // 2.
  std::vector<at::Tensor> out;
  {
    const c10::StreamGuard on_side(side);
    out = work();
  }
  for (const at::Tensor& t : out) record_on(t, main, impl);  // 3.
  c10::Event done(device.type());
  done.record(side);  // 4.
  return {std::move(out), std::move(done)};
}

void wait_for(const c10::Event& event, const at::Device& device) {
  const c10::impl::VirtualGuardImpl impl(device.type());
  event.block(impl.getStream(device));
}

}  // namespace dpzero::dp
