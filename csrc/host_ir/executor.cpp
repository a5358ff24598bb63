// The executor of flat host programs: what its callers see (python/hostir/
// cpp.py through bindings.cpp, and the GoogleTest tests). Making one checks
// and prepares the program once: each compute op's kind (compute.cpp) and
// each communication's transport (transports/); each call runs the
// program in a Run of its own (run.cpp). The process-wide stream pool and
// the executor's spare events live here too.
#include "run.h"
#include "transports/transport.h"

#include <ATen/core/LegacyTypeDispatch.h>

#include <algorithm>
#include <map>
#include <utility>

namespace hostir {

StreamPool& streamPool() {
  static StreamPool pool;
  return pool;
}

c10::Stream StreamPool::get(c10::Device device, int64_t key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto id = std::make_tuple(static_cast<int>(device.type()), static_cast<int>(device.index()), key);
  auto it = streams_.find(id);
  if (it != streams_.end()) {
    return it->second;
  }
  c10::impl::VirtualGuardImpl impl(device.type());
  c10::Stream stream = impl.getStreamFromGlobalPool(device, false);
  streams_.emplace(id, stream);
  return stream;
}

size_t StreamPool::size() {
  std::lock_guard<std::mutex> lock(mutex_);
  return streams_.size();
}

std::unique_ptr<c10::Event> EventPool::take(c10::DeviceType type) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!events_.empty()) {
      auto event = std::move(events_.back());
      events_.pop_back();
      return event;
    }
  }
  return std::make_unique<c10::Event>(type);
}

void EventPool::give(std::unique_ptr<c10::Event> event) {
  std::lock_guard<std::mutex> lock(mutex_);
  events_.push_back(std::move(event));
}

// -- the transports' registry

namespace {

// Function-local, so that it exists before the first registration, in
// whichever file's static initialisation that runs. Ordered by name, so
// that the names it lists are the same on every build.
std::map<std::string, const Transport*>& registry() {
  static std::map<std::string, const Transport*> transports;
  return transports;
}

} // namespace

void registerTransport(const std::string& backend, const Transport* transport) {
  HOSTIR_CHECK(transport != nullptr, text("the backend '", backend, "' is registered with no transport"));
  bool added = registry().emplace(backend, transport).second;
  HOSTIR_CHECK(added, text("the backend '", backend, "' is registered twice: one transport per backend"));
}

const Transport* findTransport(const std::string& backend) {
  auto found = registry().find(backend);
  return found == registry().end() ? nullptr : found->second;
}

std::vector<std::string> transportNames() {
  std::vector<std::string> names;
  for (const auto& [backend, transport] : registry()) {
    names.push_back(backend);
  }
  return names;
}

// -- the Executor

namespace {

// Every instruction that posts a communication names a backend the C++
// executor has a transport for; the transport is chosen here, once.
void chooseTransport(Instr& ins, size_t index) {
  bool names_one = ins.op == Opcode::kCommunication || ins.op == Opcode::kP2P ||
      ((ins.op == Opcode::kStartCoalescing || ins.op == Opcode::kEndCoalescing) && !ins.backend.empty());
  if (!names_one) {
    return;
  }
  ins.transport = findTransport(ins.backend);
  if (ins.transport == nullptr) {
    std::string known;
    for (const std::string& backend : transportNames()) {
      known += known.empty() ? "" : ", ";
      known += backend;
    }
    throw Error(
        text("instruction ", index, " names the backend '", ins.backend,
             "', which the C++ executor has no transport for (it has ", known, ")"),
        "ProgramError");
  }
}

} // namespace

Executor::Executor(Program program)
    : program_(std::move(program)), uses_streams_(program_.device.type() != c10::kCPU) {
  for (size_t i = 0; i < program_.instrs.size(); ++i) {
    prepareCompute(program_.instrs[i]);
    chooseTransport(program_.instrs[i], i);
    if (program_.instrs[i].op == Opcode::kAllocate && program_.instrs[i].symmetric) {
      program_.symmetric_allocs.push_back(static_cast<int>(i));
    }
  }
}

void Executor::setWindow(int instr, int parity, Window window) {
  const auto& allocs = program_.symmetric_allocs;
  if (std::find(allocs.begin(), allocs.end(), instr) == allocs.end()) {
    throw Error(text("instruction ", instr, " is no symmetric Allocate: it has no window"), "ProgramError");
  }
  if (parity != 0 && parity != 1) {
    throw Error(text("a call parity is 0 or 1, got ", parity), "ProgramError");
  }
  auto world = static_cast<int64_t>(window.bases.size());
  if (window.rank < 0 || window.rank >= world || static_cast<int64_t>(window.flags.size()) != world) {
    throw Error(
        text("a window needs a base and a flag address per rank and this rank among them (", window.bases.size(),
             " bases, ", window.flags.size(), " flags, rank ", window.rank, ")"),
        "ProgramError");
  }
  std::lock_guard<std::mutex> lock(windows_.mutex);
  auto key = std::make_tuple(instr, parity, window.nbytes);
  windows_.entries.insert_or_assign(key, std::move(window));
}

RunResult Executor::run(
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    int64_t number_of_streams,
    const std::function<bool()>& gate) const {
  // Runs without autograd, as the Python evaluator does under no_grad: no
  // result needs a history, so the ops skip the autograd layer of the
  // dispatcher altogether (the in-place and view layer still bumps
  // version counters and tracks views).
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowAutograd below_autograd;
  // Run::go reports what fails as a Failure; anything else (restoring the
  // caller's stream) comes back the same way, never as an exception.
  try {
    bool tracing = tracing_.load(std::memory_order_relaxed);
    Run run(program_, uses_streams_, events_, staging_, windows_, tracing);
    run.setGate(gate);
    RunResult result = run.go(inputs, outputs, number_of_streams);
    ops_executed_.fetch_add(run.executed(), std::memory_order_relaxed);
    if (tracing) {
      std::lock_guard<std::mutex> lock(trace_mutex_);
      traces_.push_back(std::move(run.trace()));
    }
    return result;
  } catch (const c10::Error& e) {
    return RunResult{{}, Failure{-1, {}, "RuntimeError", e.what_without_backtrace()}};
  } catch (const std::exception& e) {
    return RunResult{{}, Failure{-1, {}, "RuntimeError", e.what()}};
  }
}

std::vector<std::vector<TraceRecord>> Executor::takeTrace() const {
  std::lock_guard<std::mutex> lock(trace_mutex_);
  std::vector<std::vector<TraceRecord>> taken;
  taken.swap(traces_);
  return taken;
}

void Executor::setViews(
    std::vector<std::vector<int64_t>> inputs,
    std::vector<std::vector<std::vector<int64_t>>> outputs) {
  input_views_ = std::move(inputs);
  output_views_ = std::move(outputs);
}

RunResult Executor::runLogical(
    const std::vector<at::Tensor>& inputs,
    int64_t number_of_streams,
    const std::function<bool()>& gate) const {
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowAutograd below_autograd;
  std::vector<at::Tensor> bound;
  bound.reserve(inputs.size());
  try {
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor& t = inputs[i];
      if (i >= input_views_.size() || input_views_[i].empty() || !t.defined()) {
        bound.push_back(t);
        continue;
      }
      std::vector<int64_t> sizes;
      sizes.reserve(input_views_[i].size());
      for (int64_t axis : input_views_[i]) {
        sizes.push_back(axis < 0 ? 1 : t.size(axis));
      }
      bound.push_back(t.reshape(sizes));
    }
  } catch (const c10::Error& e) {
    return RunResult{{}, Failure{-1, {}, "BindingError", e.what_without_backtrace()}};
  }
  RunResult result = run(bound, {}, number_of_streams, gate);
  if (result.failure) {
    return result;
  }
  try {
    for (size_t k = 0; k < result.outputs.size() && k < output_views_.size(); ++k) {
      at::Tensor& t = result.outputs[k];
      if (output_views_[k].empty() || !t.defined()) {
        continue;
      }
      std::vector<int64_t> sizes;
      sizes.reserve(output_views_[k].size());
      for (const auto& held : output_views_[k]) {
        int64_t size = 1;
        for (int64_t dim : held) {
          size *= t.size(dim);
        }
        sizes.push_back(size);
      }
      t = t.reshape(sizes);
    }
  } catch (const c10::Error& e) {
    return RunResult{{}, Failure{-1, {}, "RuntimeError", e.what_without_backtrace()}};
  }
  return result;
}

} // namespace hostir
