// The transports that carry a run's communications, behind one interface.
// The run loop hands each collective, P2P and coalescing group to the
// transport its instruction's backend names; the Executor chooses it once,
// when it is made (`findTransport`). One file per transport, as nvFuser
// splits post_communication.cpp from cuda_p2p.cpp: c10d.cpp posts NCCL's and
// gloo's communications on the c10d::ProcessGroup objects the Python
// communicator created; host.cpp copies between host and device memory
// (ir.Transfer, which names no backend); cuda.cpp pushes with the copy
// engine into windows the peers map. A new transport is one file that
// implements Transport and registers it under its backend's name with a
// `TransportRegistration` (the backend's entry in python/hostir/backends.py
// says `cpp=True`; a test holds the two to each other).
#pragma once

#include "../run.h"

namespace hostir {

using Works = std::vector<c10::intrusive_ptr<c10d::Work>>;

class Transport {
 public:
  virtual ~Transport() = default;

  // A collective over a team of more than one rank (the run keeps a team
  // of one's communication local): its works, and what to run after them.
  virtual Posted post(Run& run, const Instr& ins) const = 0;

  // A send or receive of `buf` (contiguous) with the world rank `peer`.
  // Inside an open coalescing group (`group` not null) what the group's
  // EndCoalescing must wait for goes there (or stays with the backend, if it
  // coalesces itself), and the P2P's own Posted is empty.
  virtual Posted postP2P(Run& run, const Instr& ins, const at::Tensor& buf, int peer, Works* group) const = 0;

  // Opens and posts a coalescing group: the P2Ps between are posted
  // together (one NCCL group), so that a send and a recv between two ranks
  // cannot deadlock each other. `group` holds what postP2P put there.
  virtual void startCoalescing(Run& run) const = 0;
  virtual Posted endCoalescing(Run& run, Works& group) const = 0;
};

// Makes `to` the current stream until the end of the scope, then `back`.
struct StreamSwitch {
  StreamSwitch(c10::impl::VirtualGuardImpl impl, const c10::Stream& to, const c10::Stream& back)
      : impl_(impl), back_(back) {
    impl_.exchangeStream(to);
  }
  ~StreamSwitch() {
    impl_.exchangeStream(back_);
  }
  c10::impl::VirtualGuardImpl impl_;
  c10::Stream back_;
};

// The registry of backends the C++ executor has a transport for: each
// transport file registers its own, as
//
//   const TransportRegistration kCuda{"cuda", &transport};
//
// at namespace scope (its backend spelled as ir.backend_name spells it).
// Registrations run during static initialisation, in no set order across
// files; the registry is a function-local static (executor.cpp), made by
// whichever registration comes first. A backend registered twice, or with
// no transport, is an Error, which stops the library from loading.
void registerTransport(const std::string& backend, const Transport* transport);

struct TransportRegistration {
  TransportRegistration(const char* backend, const Transport* transport) {
    registerTransport(backend, transport);
  }
};

// The transport of `backend`; null if the C++ executor has none.
const Transport* findTransport(const std::string& backend);

// What a communication sends of its input: the rows this rank holds of a
// reduced axis reduced (`local_reduce`), else the input (compute.cpp).
at::Tensor reducedInput(Run& run, const Instr& ins);

// -- the copy engine's windows (cuda.cpp)

// Before a run's first instruction: every symmetric Allocate whose size the
// bound values give has a window of that size for both call parities, else
// an Error of kind WindowsNeeded listing "instr:nbytes" pairs (Python makes
// them, hands them over with Executor::setWindow and runs again); a
// program with windows on a device other than CUDA is an Error.
void checkWindows(Run& run);

// The view of this rank's copy of the window of symmetric Allocate `ins`
// for the run's call parity.
at::Tensor windowView(Run& run, const Instr& ins);

// The address of flag [channel * world + src] on rank `on_rank` of `w`;
// an Error beyond its flags.
uint64_t flagAddress(const Window& w, int on_rank, int64_t channel, int src);

// libcuda's stream memory operations, looked up in `library` (libcuda.so.1)
// when first used: a 32-bit write, and a wait for a value, enqueued on a
// stream, run by the GPU's front end (no SM, no host round trip, capturable
// in CUDA graphs). Loading never fails: `error` says why they cannot run,
// and `write` and `wait` raise it. A wait has no timeout: the mechanism
// offers none.
class StreamMemOps {
 public:
  explicit StreamMemOps(const char* library);
  void write(const c10::Stream& stream, uint64_t addr, uint32_t value) const;
  void wait(const c10::Stream& stream, uint64_t addr, uint32_t value) const;
  const std::string& error() const {
    return error_;
  }

 private:
  using Fn = int (*)(void*, uint64_t, uint32_t, unsigned int);
  Fn write_ = nullptr;
  Fn wait_ = nullptr;
  std::string error_;
};

// -- host<->device transfers (host.cpp)

// A transfer on the current stream, in order with the ops around it.
void copyInOrder(Run& run, const Instr& ins);

// A host-to-device transfer posted on the copy stream; its Wait completes it.
Posted postTransfer(Run& run, const Instr& ins);

} // namespace hostir
