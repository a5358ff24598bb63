// The transports that carry a run's communications, behind one interface.
// The run loop hands each collective, P2P and coalescing group to the
// transport its instruction's backend names; the Executor chooses it once,
// when it is made (`findTransport`). One file per transport, as nvFuser
// splits post_communication.cpp from cuda_p2p.cpp: c10d.cpp posts NCCL's and
// gloo's communications on the c10d::ProcessGroup objects the Python
// communicator created; host.cpp copies between host and device memory
// (ir.Transfer, which names no backend). A new transport is one file that
// implements Transport and one entry in `transportRegistry`.
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

// The transports of transports/*.cpp, one object each, shared by every run.
const Transport& c10dTransport();

struct TransportEntry {
  const char* backend;  // as an op names it (ir.backend_name's spelling)
  const Transport* transport;
};

// Every backend the C++ executor has a transport for.
inline const std::vector<TransportEntry>& transportRegistry() {
  static const std::vector<TransportEntry> registry = {
      // NCCL and gloo both post on c10d process groups: one translation.
      {"NCCL", &c10dTransport()},
      {"gloo", &c10dTransport()},
      // The copy-engine transport goes here: {"cuda", &cudaTransport()},
      // with transports/cuda.cpp (one-sided pushes into memory the peers
      // map, as python/hostir/runtime/transports/cuda.py does), and
      // cpp=True in its entry of python/hostir/backends.py (a test holds the
      // table to this registry). Until then a program on it runs on the
      // Python evaluator (flat.unsupported_reasons reads the table).
  };
  return registry;
}

// The transport of `backend`; null if the C++ executor has none.
inline const Transport* findTransport(const std::string& backend) {
  for (const TransportEntry& entry : transportRegistry()) {
    if (backend == entry.backend) {
      return entry.transport;
    }
  }
  return nullptr;
}

// What a communication sends of its input: the rows this rank holds of a
// reduced axis reduced (`local_reduce`), else the input (executor.cpp).
at::Tensor reducedInput(Run& run, const Instr& ins);

// -- host<->device transfers (host.cpp)

// A transfer on the current stream, in order with the ops around it.
void copyInOrder(Run& run, const Instr& ins);

// A host-to-device transfer posted on the copy stream; its Wait completes it.
Posted postTransfer(Run& run, const Instr& ins);

} // namespace hostir
