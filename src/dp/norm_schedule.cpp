// src/dp/norm_schedule.cpp — see norm_schedule.h.
#include "src/dp/norm_schedule.h"

#include <atomic>

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace dpzero::dp {
namespace {

std::atomic<bool> early_setting{false};
std::atomic<bool> stream_setting{false};

void record_on(const at::Tensor& t, const c10::Stream& stream,
               const c10::impl::VirtualGuardImpl& impl) {
  if (t.defined() && t.has_storage()) impl.recordDataPtrOnStream(t.storage().data_ptr(), stream);
}

}  // namespace

bool set_early_norms(bool on) { return early_setting.exchange(on); }
bool early_norms() { return early_setting.load(); }
bool set_norm_stream(bool on) { return stream_setting.exchange(on); }
bool norm_stream() { return stream_setting.load(); }

bool norm_stream_for(const at::Device& device) {
  return norm_stream() && device.type() != at::kCPU && device.type() != at::kMeta;
}

std::shared_ptr<const c10::Event> mark(const at::Device& device) {
  const c10::impl::VirtualGuardImpl impl(device.type());
  auto event = std::make_shared<c10::Event>(device.type());
  event->record(impl.getStream(device));
  return event;
}

std::pair<std::vector<at::Tensor>, std::shared_ptr<const Aside>> run_aside(
    const at::Device& device, const std::vector<std::shared_ptr<const c10::Event>>& after,
    const std::vector<at::Tensor>& reads, const std::function<std::vector<at::Tensor>()>& work) {
  const c10::impl::VirtualGuardImpl impl(device.type());
  const c10::Stream main = impl.getStream(device);
  const c10::Stream side = impl.getStreamFromGlobalPool(device);
  c10::Event written(device.type());
  written.record(main);  // 1. after the kernels that wrote the reads, on every stream
  written.block(side);
  for (const auto& event : after) event->block(side);
  for (const at::Tensor& t : reads) record_on(t, side, impl);  // 2.
  std::vector<at::Tensor> out;
  {
    const c10::StreamGuard on_side(side);
    out = work();
  }
  auto aside = std::make_shared<Aside>(Aside{c10::Event(device.type()), device});
  aside->done.record(side);  // 3.
  return {std::move(out), std::move(aside)};
}

void wait_and_use(const Aside& aside, const std::vector<at::Tensor>& used) {
  const c10::impl::VirtualGuardImpl impl(aside.device.type());
  const c10::Stream reader = impl.getStream(aside.device);
  aside.done.block(reader);
  for (const at::Tensor& t : used) record_on(t, reader, impl);
}

}  // namespace dpzero::dp
