// One run of a Program: the loop that walks its instructions (executor.cpp),
// the values it binds, its streams and events, and the works it posted. The
// compute ops (compute.cpp) and the transports (transports/) are separate
// rooms: they read and write the run's values only through the accessors
// below, and the loop hands each of them the instructions it owns.
#pragma once

#include "program.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <functional>

namespace hostir {

// Python's floor division and modulo, so scalars match the evaluator's.
inline int64_t floorDiv(int64_t a, int64_t b) {
  if (b == 0) {
    throw Error("integer division or modulo by zero", "ZeroDivisionError");
  }
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) {
    --q;
  }
  return q;
}

inline int64_t floorMod(int64_t a, int64_t b) {
  return a - floorDiv(a, b) * b;
}

// A posted communication or transfer: its works, and what to run once they
// are done (copy a staging buffer into a non-contiguous or reshaped output,
// make the waiting stream wait for a copy stream).
struct Posted {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::function<void()> after;
};

class Run {
 public:
  Run(
      const Program& program,
      bool uses_streams,
      EventPool& events,
      Staging& staging,
      Windows& windows,
      bool tracing = false);
  ~Run();

  RunResult go(
      const std::vector<at::Tensor>& inputs,
      const std::vector<at::Tensor>& outputs,
      int64_t number_of_streams);

  // What the run asks once, right before its first communication (a
  // prepared call's step, posted at the call's start, collected there):
  // false stops the run with a "StepGate" failure before anything is
  // posted. None: the run never asks.
  void setGate(std::function<bool()> gate) {
    gate_ = std::move(gate);
  }

  // Instructions run to their end so far (a loop counts once, its body's
  // once per iteration).
  int64_t executed() const {
    return executed_;
  }

  // The records of a traced run, in the order the instructions ended.
  std::vector<TraceRecord>& trace() {
    return trace_;
  }

  // -- what the compute ops and the transports use
  const Program& program() const {
    return p_;
  }
  bool usesStreams() const {
    return uses_streams_;
  }

  // A scalar node's value; an unbound one is an UnboundValueError.
  int64_t get(int node);
  std::vector<int64_t> sizes(const std::vector<int>& nodes);
  const at::Tensor& tensor(int slot);  // unbound: an UnboundValueError
  const at::Tensor* maybeTensor(int slot);
  void bind(int slot, at::Tensor value);
  // Holds `t` to the run's end (the compact copy of a view being sent).
  void keep(at::Tensor t) {
    kept_.push_back(std::move(t));
  }

  // Streams (used only where `usesStreams()`): the current one, the pool's
  // stream of `key`, `waiter` waiting for the work now on `target`, and a
  // stream the caller's must wait for at the run's end.
  c10::impl::VirtualGuardImpl guard() const {
    return c10::impl::VirtualGuardImpl(p_.device.type());
  }
  c10::Stream currentStream() const {
    return guard().getStream(p_.device);
  }
  c10::Stream poolStream(int64_t key);
  void wait(const c10::Stream& waiter, const c10::Stream& target);
  void noteUsed(const c10::Stream& s);
  // An event from the executor's pool, held by the run to its end.
  c10::Event* heldEvent();
  Staging& staging() {
    return staging_;
  }
  // The program's windows; this run's call parity; the windows this run
  // allocated (where its copy-engine transfers look their buffers up).
  Windows& windows() {
    return windows_;
  }
  int parity() const {
    return parity_;
  }
  std::vector<const Window*>& allocatedWindows() {
    return allocated_windows_;
  }
  // The index of `ins` in the program.
  int64_t indexOf(const Instr& ins) const {
    return &ins - p_.instrs.data();
  }
  const c10::intrusive_ptr<c10d::ProcessGroup>& worldGroup();

 private:
  // -- tracing: a host time and, on a GPU, an event on the current stream
  struct Stamp {
    double host_us = 0;
    std::shared_ptr<c10::Event> event;
  };
  struct Pending {
    int instr;
    int64_t track;
    int posted;
    Stamp start;
    Stamp end;
    std::vector<int64_t> input_sizes;
    std::vector<int64_t> output_sizes;
  };
  Stamp stamp();
  void traced(int i, const Instr& ins);
  double since(const Stamp& origin, const Stamp& s);
  void finishTrace();

  // -- binding the caller's values
  void bindAll(
      const std::vector<at::Tensor>& inputs,
      const std::vector<at::Tensor>& outputs,
      int64_t number_of_streams);
  std::optional<int64_t> eval(int node);
  std::string scalarText(int node);
  void bindInt(int slot, int64_t value);
  void bindTensor(int slot, const at::Tensor& value);
  void bindExtents(int slot, const at::Tensor& value, const std::vector<ExtentRule>& rules);

  // -- running
  c10::Stream stream(const Instr& ins);
  void join();
  void scope(int begin, int end);
  [[noreturn]] void fail(int instr, const std::string& kind, const std::string& message);
  void runFor(const Instr& ins);
  void exec(const Instr& ins);

  // -- communications: each posted on its instruction's transport
  void passGate();
  Posted communication(const Instr& ins);
  Posted keepLocal(const Instr& ins);
  void p2p(const Instr& ins);
  void startCoalescing(const Instr& ins);
  void endCoalescing(const Instr& ins);
  void waitFor(const Instr& ins);

  const Program& p_;
  bool uses_streams_;
  bool tracing_;
  int64_t track_ = -1;  // while tracing: the stream the ops now run on
  Stamp origin_;
  std::vector<Pending> pending_;
  std::vector<TraceRecord> trace_;
  EventPool& events_;
  Staging& staging_;
  Windows& windows_;
  int parity_ = 0;
  std::vector<const Window*> allocated_windows_;
  std::unique_ptr<c10::Event> event_;  // taken from events_ at the first wait
  // Events held to the run's end: one per posted transfer, each recorded on
  // the copy stream after its copy.
  std::vector<std::unique_ptr<c10::Event>> held_events_;
  int64_t executed_ = 0;
  std::vector<at::Tensor> tensors_;
  std::vector<int64_t> ints_;
  std::vector<char> bound_;
  std::vector<std::optional<c10::Stream>> streams_;
  std::vector<std::pair<int64_t, c10::Stream>> pool_streams_;
  std::vector<std::pair<int, int64_t>> loops_;
  std::vector<c10::Stream> used_;
  std::optional<c10::Stream> caller_;
  std::map<int64_t, Posted> posted_;
  // The open coalescing group: its StartCoalescing (null: none is open) and
  // the works its EndCoalescing completes, where the transport collects them.
  const Instr* coalescing_ = nullptr;
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_;
  std::vector<at::Tensor> kept_;  // compact copies of views being sent
  std::function<bool()> gate_;
  bool gated_ = false;
};

// -- the compute ops (compute.cpp)

// Reads what an op computes from its text once, when the Executor is made
// (ProgramError for an unknown kind, or a route that gives neither slots,
// sources nor counts), and makes the tensor of a constant number on the
// right of a binary op.
void prepareCompute(Instr& ins);

// Runs a binary, unary, reduction, matmul, linear or permute op, an index
// op (topk, route, take, put_add) or a grouped op (grouped_mm,
// grouped_outer).
void compute(Run& run, const Instr& ins);

// Binds a chunk of the input's rows (HirAliasChunk, or HirAliasSelect of
// a split axis's outer piece): a narrow, no copy.
void chunkView(Run& run, const Instr& ins);

// `t` read through `v`: its logical axes, cut to this rank's slice (the
// evaluator's `_operand`).
at::Tensor applyView(const View& v, at::Tensor t);

} // namespace hostir
