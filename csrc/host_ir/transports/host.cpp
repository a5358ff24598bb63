// Host<->device transfers (ir.Transfer), the C++ twin of python/hostir/
// runtime/transports/host.py: a copy on the current stream, in order with
// the ops around it, or a host-to-device copy posted on the copy stream
// from pinned memory and completed by its Wait.
#include "transport.h"

#include <mutex>

namespace hostir {
namespace {

// The pool key of the copy stream that posted host-to-device transfers run
// on: far from the keys of the program's own streams (an indexed stream's
// index, or -1 - slot).
constexpr int64_t kH2DCopyStream = int64_t{1} << 40;

// `entry`'s buffer holding `src`'s bytes: copied again only if `src` is
// another tensor than the one last copied, or was written since.
void refresh(Staged& entry, const at::Tensor& src) {
  if (entry.source.defined() && entry.source.data_ptr() == src.data_ptr() &&
      entry.version == src._version() && entry.source.sizes() == src.sizes() &&
      entry.source.strides() == src.strides() && entry.source.scalar_type() == src.scalar_type()) {
    return;
  }
  if (entry.read) {
    entry.read->synchronize();  // the last copy out of the buffer is done
  }
  if (!entry.buffer.defined() || entry.buffer.sizes() != src.sizes() ||
      entry.buffer.scalar_type() != src.scalar_type()) {
    entry.buffer = at::empty(src.sizes(), src.options().memory_format(at::MemoryFormat::Contiguous).pinned_memory(true));
  }
  entry.buffer.copy_(src);
  entry.source = src;
  entry.version = src._version();
}

} // namespace

// A transfer on the current stream (`ir.Transfer` with stream="current"):
// a host-to-device copy is enqueued in order with the ops around it, a
// device-to-host one blocks until the bytes are in host memory. The H2D
// copy is always asked for non-blocking: from pinned memory it does not
// block the host, and from pageable memory the CUDA runtime stages the
// bytes before the call returns, so the source may change right after
// either way, and no driver query (`is_pinned`) is needed to choose.
void copyInOrder(Run& run, const Instr& ins) {
  const at::Tensor& src = run.tensor(ins.input);
  at::Tensor out = run.tensor(ins.out);
  out.copy_(src.reshape(out.sizes()), /*non_blocking=*/ins.h2d);
}

// A posted host-to-device transfer (`ir.Transfer` on a copy stream): the
// copy runs on the copy stream after the work already on the current
// stream, from pinned memory (the source itself, else its staging), and
// its Wait makes the waiting stream wait for it; the host blocks at
// neither. On the CPU it is a copy made at the post. (A posted
// device-to-host transfer runs on the Python evaluator: its output is
// host memory the program allocates.)
Posted postTransfer(Run& run, const Instr& ins) {
  const at::Tensor& src = run.tensor(ins.input);
  at::Tensor out = run.tensor(ins.out);
  Posted posted;
  if (!run.usesStreams()) {
    out.copy_(src.reshape(out.sizes()));
    return posted;
  }
  c10::Stream caller = run.currentStream();
  c10::Stream copy = run.poolStream(kH2DCopyStream);
  run.wait(copy, caller);
  run.noteUsed(copy);
  c10::Event* done = run.heldEvent();
  StreamSwitch on(run.guard(), copy, caller);
  if (src.is_contiguous() && src.is_pinned()) {
    out.copy_(src.reshape(out.sizes()), /*non_blocking=*/true);
    done->record(copy);
  } else {
    // The staging is refreshed and read under its lock, so that a run of
    // the same program on another thread cannot refresh it between.
    Staging& staging = run.staging();
    std::lock_guard<std::mutex> lock(staging.mutex);
    Staged& entry = staging.entries[run.indexOf(ins)];
    refresh(entry, src);
    out.copy_(entry.buffer.reshape(out.sizes()), /*non_blocking=*/true);
    done->record(copy);
    entry.read = std::make_shared<c10::Event>(run.program().device.type());
    entry.read->record(copy);
  }
  Run* waiting = &run;
  posted.after = [waiting, done]() { done->block(waiting->currentStream()); };
  return posted;
}

} // namespace hostir
