// The copy-engine transport, the C++ twin of python/hostir/runtime/
// transports/cuda.py: a send is a copy into the peer's window on the send
// stream (the copy engine, no SM) after the current stream's work, then a
// stream memory write of the peer's flag; its Wait makes the waiting stream
// wait for the send stream. A receive posts nothing; its Wait enqueues the
// wait for its flag on the waiting stream and resets the flag, so the
// consumer waits on the GPU, never on the host. Python makes the windows
// (both call parities at a program's first call) and hands over their
// addresses; the flags sit where Python's windows keep them (symmetric
// memory's signal pads, or the head of a CUDA IPC block), [channel * world
// + src] on the receiver, channel being the piece's offset / its size.
// Everything here is device-generic c10 and libcuda through dlopen, so the
// extension builds and loads without CUDA; a cuda instruction run without
// it is a clear error.
#include "transport.h"

#include <ATen/ops/from_blob.h>

#include <dlfcn.h>

#include <algorithm>
#include <utility>

namespace hostir {

// c10d.cpp's transport: the collectives the copy engine does not move itself.
const Transport& c10dTransport();

namespace {

// The pool key of the send stream: far from the program's own streams' keys
// and from the host-to-device copy stream's (host.cpp).
constexpr int64_t kSendStream = int64_t{1} << 41;

constexpr uint32_t kWaitEq = 1;  // CU_STREAM_WAIT_VALUE_EQ

const StreamMemOps& memOps() {
  static const StreamMemOps ops("libcuda.so.1");
  return ops;
}

void checkCuda(const Run& run) {
  if (run.program().device.type() != c10::kCUDA) {
    throw Error(
        text("the cuda transport moves data between CUDA devices, but this program runs on ",
             c10::DeviceTypeName(run.program().device.type(), true)),
        "TransportUnsupported");
  }
}

int64_t elementBytes(at::ScalarType dtype) {
  return static_cast<int64_t>(c10::elementSize(dtype));
}

// The bytes of the window of symmetric Allocate `ins` at these sizes, as
// Python's allocate counts them (at least one element).
int64_t windowBytes(const Instr& ins, const std::vector<int64_t>& sizes) {
  int64_t numel = 1;
  for (int64_t s : sizes) {
    numel *= s;
  }
  return std::max<int64_t>(1, numel) * elementBytes(ins.dtype);
}

// The window of this run holding `t`, and `t`'s byte offset in it.
std::pair<const Window*, int64_t> locate(Run& run, const at::Tensor& t) {
  auto ptr = reinterpret_cast<uint64_t>(t.data_ptr());
  for (const Window* w : run.allocatedWindows()) {
    uint64_t base = w->bases[w->rank];
    if (base <= ptr && ptr < base + static_cast<uint64_t>(w->nbytes)) {
      return {w, static_cast<int64_t>(ptr - base)};
    }
  }
  throw Error(
      "a cuda-transport buffer must be a view of a symmetric allocation (Allocate with mem_type=symmetric)",
      "TransportUsageError");
}

// The signal channel of a piece at `offset`: its offset in pieces of its size.
int64_t channelOf(const at::Tensor& t, int64_t offset) {
  int64_t piece = t.numel() * t.element_size();
  if (piece == 0 || offset % piece != 0) {
    throw Error(text("a piece of ", piece, " bytes at offset ", offset, " is not aligned to its size"),
                "TransportUsageError");
  }
  return offset / piece;
}

// A tensor over window memory at `addr`, said to be on `device`: a peer's
// copy is mapped into this device's address space, and naming the device
// keeps from_blob from asking the driver where the memory lives (a peer's
// GPU, which would not match).
at::Tensor windowTensor(uint64_t addr, at::IntArrayRef sizes, at::ScalarType dtype, c10::Device device) {
  return at::for_blob(reinterpret_cast<void*>(addr), sizes)
      .options(at::TensorOptions().dtype(dtype).device(device))
      .target_device(device)
      .make_tensor();
}

// A posted push or receive: its Wait enqueues what completes it on the
// waiting stream (the host never blocks).
class StreamWork : public c10d::Work {
 public:
  explicit StreamWork(std::function<void()> enqueue) : enqueue_(std::move(enqueue)) {}
  bool wait(std::chrono::milliseconds /*timeout*/) override {
    enqueue_();
    return true;
  }

 private:
  std::function<void()> enqueue_;
};

Posted posted(Works* group, c10::intrusive_ptr<c10d::Work> work) {
  if (group != nullptr) {
    // In a coalescing group the group's Wait completes every member.
    group->push_back(std::move(work));
    return Posted{};
  }
  return Posted{{std::move(work)}, nullptr};
}

class CudaTransport final : public Transport {
 public:
  // Collectives the copy engine does not move itself go to NCCL (as in Python).
  Posted post(Run& run, const Instr& ins) const override {
    return c10dTransport().post(run, ins);
  }

  Posted postP2P(Run& run, const Instr& ins, const at::Tensor& buf, int peer, Works* group) const override {
    checkCuda(run);
    if (ins.send) {
      return posted(group, push(run, ins, buf, peer));
    }
    auto [w, offset] = locate(run, buf);
    checkPeer(*w, peer);
    uint64_t flag = flagAddress(*w, w->rank, channelOf(buf, offset), peer);
    const StreamMemOps& ops = memOps();
    if (!ops.error().empty()) {
      throw Error(ops.error(), "TransportUnsupported");  // at the post, not at its Wait
    }
    Run* waiting = &run;
    return posted(group, c10::make_intrusive<StreamWork>([waiting, flag, &ops]() {
      c10::Stream stream = waiting->currentStream();
      ops.wait(stream, flag, 1);
      ops.write(stream, flag, 0);
    }));
  }

  void startCoalescing(Run& /*run*/) const override {}

  Posted endCoalescing(Run& /*run*/, Works& group) const override {
    return Posted{group, nullptr};
  }

 private:
  static void checkPeer(const Window& w, int peer) {
    if (peer == w.rank || peer < 0 || peer >= static_cast<int>(w.bases.size())) {
      throw Error(
          text("a cuda-transport send or receive needs another rank of the window's ", w.bases.size(),
               " as its peer, got ", peer, " on rank ", w.rank),
          "TransportUsageError");
    }
  }

  static c10::intrusive_ptr<c10d::Work> push(Run& run, const Instr& ins, const at::Tensor& buf, int peer) {
    if (ins.into < 0) {
      throw Error("a cuda-transport send needs `into`, the place of its data in the peer's window",
                  "TransportUsageError");
    }
    const at::Tensor& into = run.tensor(ins.into);
    auto [w, offset] = locate(run, into);
    checkPeer(*w, peer);
    if (!into.is_contiguous() || into.numel() != buf.numel()) {
      throw Error(text("send buffer ", buf.sizes(), " does not fill its contiguous place ", into.sizes(),
                       " in the window"),
                  "TransportUsageError");
    }
    uint64_t flag = flagAddress(*w, peer, channelOf(into, offset), w->rank);
    const StreamMemOps& ops = memOps();
    if (!ops.error().empty()) {
      throw Error(ops.error(), "TransportUnsupported");
    }
    // The peer's copy, viewed as a tensor of this device: its memory is
    // mapped here (peer access or the same GPU), so the copy is one
    // device-to-device copy on the send stream.
    at::Tensor remote =
        windowTensor(w->bases[peer] + static_cast<uint64_t>(offset), into.sizes(), into.scalar_type(), into.device());
    c10::Stream current = run.currentStream();
    c10::Stream send = run.poolStream(kSendStream);
    run.wait(send, current);
    run.noteUsed(send);
    c10::Event* done = run.heldEvent();
    {
      StreamSwitch on(run.guard(), send, current);
      remote.copy_(buf.view(into.sizes()), /*non_blocking=*/true);
      ops.write(send, flag, 1);
      done->record(send);
    }
    // The caching allocator must not hand `buf` out again before the copy read it.
    buf.record_stream(send);
    Run* waiting = &run;
    return c10::make_intrusive<StreamWork>([waiting, done]() { done->block(waiting->currentStream()); });
  }
};

} // namespace

StreamMemOps::StreamMemOps(const char* library) {
  void* lib = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    error_ = text("the cuda transport needs libcuda's stream memory operations, but ", library,
                  " does not load (", why != nullptr ? why : "unknown reason", ")");
    return;
  }
  write_ = reinterpret_cast<Fn>(dlsym(lib, "cuStreamWriteValue32_v2"));
  if (write_ == nullptr) {
    write_ = reinterpret_cast<Fn>(dlsym(lib, "cuStreamWriteValue32"));
  }
  wait_ = reinterpret_cast<Fn>(dlsym(lib, "cuStreamWaitValue32_v2"));
  if (wait_ == nullptr) {
    wait_ = reinterpret_cast<Fn>(dlsym(lib, "cuStreamWaitValue32"));
  }
  if (write_ == nullptr || wait_ == nullptr) {
    error_ = text(library, " exports neither cuStreamWriteValue32_v2 and cuStreamWaitValue32_v2 nor their v1 names");
  }
}

void StreamMemOps::write(const c10::Stream& stream, uint64_t addr, uint32_t value) const {
  if (!error_.empty()) {
    throw Error(error_, "TransportUnsupported");
  }
  int code = write_(stream.native_handle(), addr, value, 0);
  if (code != 0) {
    throw Error(text("cuStreamWriteValue32 failed with CUresult ", code), "RuntimeError");
  }
}

void StreamMemOps::wait(const c10::Stream& stream, uint64_t addr, uint32_t value) const {
  if (!error_.empty()) {
    throw Error(error_, "TransportUnsupported");
  }
  int code = wait_(stream.native_handle(), addr, value, kWaitEq);
  if (code != 0) {
    throw Error(text("cuStreamWaitValue32 failed with CUresult ", code), "RuntimeError");
  }
}

namespace {
// The copy engine: one-sided pushes into windows the peers map, as
// python/hostir/runtime/transports/cuda.py does (cpp=True in its entry of
// python/hostir/backends.py).
const CudaTransport kTransport{};
const TransportRegistration kCuda{"cuda", &kTransport};
} // namespace

uint64_t flagAddress(const Window& w, int on_rank, int64_t channel, int src) {
  auto world = static_cast<int64_t>(w.flags.size());
  int64_t offset = 4 * (channel * world + src);
  if (channel < 0 || offset + 4 > w.flag_bytes) {
    throw Error(
        text("signal channel ", channel, " is beyond the window's ", w.flag_bytes / 4 / std::max<int64_t>(world, 1),
             " (", w.flag_bytes, " bytes of flags for ", world, " ranks)"),
        "TransportUsageError");
  }
  return w.flags[on_rank] + static_cast<uint64_t>(offset);
}

void checkWindows(Run& run) {
  const Program& p = run.program();
  if (p.symmetric_allocs.empty()) {
    return;
  }
  checkCuda(run);
  std::string missing;
  Windows& windows = run.windows();
  std::lock_guard<std::mutex> lock(windows.mutex);
  for (int i : p.symmetric_allocs) {
    const Instr& ins = p.instrs[i];
    std::vector<int64_t> sizes;
    try {
      sizes = run.sizes(ins.shape);
    } catch (const Error&) {
      continue;  // sized inside a loop: its Allocate names a missing window
    }
    int64_t nbytes = windowBytes(ins, sizes);
    for (int parity : {0, 1}) {
      if (windows.entries.count({i, parity, nbytes}) == 0) {
        missing += text(missing.empty() ? "" : " ", i, ":", nbytes);
        break;
      }
    }
  }
  if (!missing.empty()) {
    throw Error(missing, "WindowsNeeded");
  }
}

at::Tensor windowView(Run& run, const Instr& ins) {
  checkCuda(run);
  auto sizes = run.sizes(ins.shape);
  int64_t nbytes = windowBytes(ins, sizes);
  Windows& windows = run.windows();
  const Window* w = nullptr;
  {
    std::lock_guard<std::mutex> lock(windows.mutex);
    auto it = windows.entries.find({static_cast<int>(run.indexOf(ins)), run.parity(), nbytes});
    if (it != windows.entries.end()) {
      w = &it->second;  // entries are never erased: the address holds
    }
  }
  if (w == nullptr) {
    throw Error(
        text("no window is registered for this symmetric allocation of ", nbytes, " bytes (call parity ",
             run.parity(), "): its windows are made before the run (python/hostir/runtime/transports/cuda.py)"),
        "TransportUsageError");
  }
  run.allocatedWindows().push_back(w);
  c10::Device device = run.program().device.has_index() ? run.program().device : run.guard().getDevice();
  return windowTensor(w->bases[w->rank], sizes, ins.dtype, device);
}

} // namespace hostir
