// One run of a flat host program: the C++ twin of python/hostir/runtime/
// evaluator.py's Frame and loop, instruction for instruction, with
// device-generic streams and events (c10). The loop binds the caller's
// values, evaluates scalars, walks loops and conditionals, switches and
// joins streams, and hands each compute op to compute.cpp and each
// communication to its instruction's transport (transports/), waiting for
// what they posted. Everything a run binds lives in its Run, so runs of one
// Executor may overlap.
#include "run.h"
#include "transports/transport.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <utility>

namespace hostir {

namespace {

// A run failed at an instruction; carries the Failure up through loops.
struct Failed {
  Failure failure;
};

// The name of the Python exception class a torch error stands for.
std::string kindOf(const c10::Error& e) {
  if (dynamic_cast<const c10::DistNetworkError*>(&e)) {
    return "DistNetworkError";
  }
  if (dynamic_cast<const c10::DistBackendError*>(&e)) {
    return "DistBackendError";
  }
  if (dynamic_cast<const c10::DistError*>(&e)) {
    return "DistError";
  }
  if (dynamic_cast<const c10::ValueError*>(&e)) {
    return "ValueError";
  }
  if (dynamic_cast<const c10::TypeError*>(&e)) {
    return "TypeError";
  }
  if (dynamic_cast<const c10::IndexError*>(&e)) {
    return "IndexError";
  }
  if (dynamic_cast<const c10::NotImplementedError*>(&e)) {
    return "NotImplementedError";
  }
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e)) {
    return "OutOfMemoryError";
  }
  return "RuntimeError";
}

} // namespace

Run::Run(const Program& p, bool uses_streams, EventPool& events, Staging& staging, Windows& windows, bool tracing)
    : p_(p),
      uses_streams_(uses_streams),
      tracing_(tracing),
      events_(events),
      staging_(staging),
      windows_(windows),
      tensors_(p.num_tensors),
      ints_(p.num_ints),
      bound_(p.num_ints, 0),
      streams_(p.num_streams) {}

Run::~Run() {
  if (event_) {
    events_.give(std::move(event_));
  }
  for (auto& e : held_events_) {
    events_.give(std::move(e));
  }
}

RunResult Run::go(
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    int64_t number_of_streams) {
  RunResult result;
  // Binding comes first and touches no stream; a bad binding is a Failure
  // with no instruction (-1), returned like an instruction's failure, so no
  // C++ exception ever leaves the executor. So is a missing window (Python
  // makes it and runs again); only a call past both counts a call parity.
  try {
    bindAll(inputs, outputs, number_of_streams);
    checkWindows(*this);
    parity_ = static_cast<int>(windows_.calls.fetch_add(1) % 2);
  } catch (const Error& e) {
    result.failure = Failure{-1, {}, e.kind(), e.what()};
    return result;
  } catch (const c10::Error& e) {
    result.failure = Failure{-1, {}, kindOf(e), e.what_without_backtrace()};
    return result;
  } catch (const std::exception& e) {
    result.failure = Failure{-1, {}, "RuntimeError", e.what()};
    return result;
  }
  if (uses_streams_) {
    caller_ = currentStream();
  }
  if (tracing_) {
    origin_ = stamp();
  }
  try {
    scope(0, static_cast<int>(p_.instrs.size()));
    for (size_t i = 0; i < p_.outputs.size(); ++i) {
      int slot = p_.outputs[i];
      if (slot < 0) {
        result.outputs.emplace_back();
        continue;
      }
      // Undefined if unbound: the caller reports it, naming the output.
      result.outputs.push_back(tensors_[slot]);
    }
  } catch (Failed& failed) {
    result.failure = std::move(failed.failure);
  }
  join();
  if (tracing_) {
    finishTrace();
  }
  return result;
}

// -- tracing
Run::Stamp Run::stamp() {
  Stamp s;
  s.host_us = std::chrono::duration<double, std::micro>(
                  std::chrono::steady_clock::now().time_since_epoch())
                  .count();
  if (uses_streams_) {
    s.event = std::make_shared<c10::Event>(p_.device.type(), c10::EventFlag::BACKEND_DEFAULT);
    s.event->record(currentStream());
  }
  return s;
}

void Run::traced(int i, const Instr& ins) {
  int64_t track = track_;
  Stamp start = stamp();
  exec(ins);
  pending_.push_back({i, track, ins.op == Opcode::kWait ? ins.posted : -1, std::move(start), stamp(), {}, {}});
  if (ins.op == Opcode::kCommunication) {
    if (const at::Tensor* t = ins.input >= 0 ? maybeTensor(ins.input) : nullptr) {
      pending_.back().input_sizes = t->sizes().vec();
    }
    if (const at::Tensor* t = ins.out >= 0 ? maybeTensor(ins.out) : nullptr) {
      pending_.back().output_sizes = t->sizes().vec();
    }
  }
  if (ins.op == Opcode::kSetStream) {
    track_ = ins.stream_index >= 0 ? get(ins.stream_index) : -1;
  }
}

double Run::since(const Stamp& origin, const Stamp& s) {
  if (origin.event && s.event) {
    s.event->synchronize();
    return origin.event->elapsedTime(*s.event) * 1000.0;
  }
  return s.host_us - origin.host_us;
}

void Run::finishTrace() {
  trace_.reserve(pending_.size());
  for (const Pending& p : pending_) {
    trace_.push_back(
        {p.instr, p.track, p.posted, since(origin_, p.start), since(origin_, p.end), p.input_sizes, p.output_sizes});
  }
  pending_.clear();
}

// The caller's values: number_of_streams, the inputs and the outputs to
// write into, with the extents their sizes give. Throws on a bad one.
void Run::bindAll(
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    int64_t number_of_streams) {
  if (number_of_streams < 1) {
    throw Error(text("number_of_streams must be an integer >= 1, got ", number_of_streams), "BindingError");
  }
  if (p_.number_of_streams >= 0) {
    bindInt(p_.number_of_streams, number_of_streams);
  }
  HOSTIR_CHECK(
      inputs.size() == p_.inputs.size(), "the program takes ", p_.inputs.size(), " inputs, got ", inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (p_.inputs[i] <= -2) {
      // A scalar input: its integer slot, from a 0-d tensor.
      bindInt(-2 - p_.inputs[i], inputs[i].item<int64_t>());
    } else {
      bindTensor(p_.inputs[i], inputs[i]);
    }
  }
  if (!outputs.empty()) {
    HOSTIR_CHECK(
        outputs.size() == p_.outputs.size(), "the program has ", p_.outputs.size(), " outputs, got ", outputs.size());
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (p_.outputs[i] >= 0 && outputs[i].defined()) {
        bindTensor(p_.outputs[i], outputs[i]);
      }
    }
  }
}

// -- the accessors: every read and write of a slot goes through these
std::optional<int64_t> Run::eval(int node) {
  const ScalarNode& n = p_.scalars[node];
  switch (n.kind) {
    case ScalarNode::kConst:
      return n.value;
    case ScalarNode::kSlot:
      if (!bound_[n.value]) {
        return std::nullopt;
      }
      return ints_[n.value];
    default:
      break;
  }
  auto lhs = eval(n.lhs);
  auto rhs = eval(n.rhs);
  if (!lhs || !rhs) {
    return std::nullopt;
  }
  switch (n.kind) {
    case ScalarNode::kAdd:
      return *lhs + *rhs;
    case ScalarNode::kSub:
      return *lhs - *rhs;
    case ScalarNode::kMul:
      return *lhs * *rhs;
    case ScalarNode::kDiv:
      return floorDiv(*lhs, *rhs);
    case ScalarNode::kEq:
      return *lhs == *rhs;
    case ScalarNode::kNe:
      return *lhs != *rhs;
    case ScalarNode::kLt:
      return *lhs < *rhs;
    case ScalarNode::kLe:
      return *lhs <= *rhs;
    case ScalarNode::kGt:
      return *lhs > *rhs;
    case ScalarNode::kGe:
      return *lhs >= *rhs;
    case ScalarNode::kAnd:
      return *lhs != 0 && *rhs != 0;
    case ScalarNode::kOr:
      return *lhs != 0 || *rhs != 0;
    case ScalarNode::kCeilDiv:
      return -floorDiv(-*lhs, *rhs);
    default:
      return floorMod(*lhs, *rhs);
  }
}

int64_t Run::get(int node) {
  auto v = eval(node);
  if (!v) {
    throw Error(text("value ", scalarText(node), " is not bound"), "UnboundValueError");
  }
  return *v;
}

std::string Run::scalarText(int node) {
  const ScalarNode& n = p_.scalars[node];
  if (n.kind == ScalarNode::kConst) {
    return std::to_string(n.value);
  }
  if (n.kind == ScalarNode::kSlot) {
    return p_.int_names[n.value];
  }
  static const char* ops[] = {"", "", "+", "-", "*", "/", "%", "==", "!=", "<", "<=", ">", ">=", "&&", "||"};
  if (n.kind == ScalarNode::kCeilDiv) {
    return text("ceilDiv(", scalarText(n.lhs), ", ", scalarText(n.rhs), ")");
  }
  return text("( ", scalarText(n.lhs), " ", ops[n.kind], " ", scalarText(n.rhs), " )");
}

std::vector<int64_t> Run::sizes(const std::vector<int>& nodes) {
  std::vector<int64_t> out;
  out.reserve(nodes.size());
  for (int n : nodes) {
    out.push_back(get(n));
  }
  return out;
}

void Run::bindInt(int slot, int64_t value) {
  ints_[slot] = value;
  bound_[slot] = 1;
}

const at::Tensor& Run::tensor(int slot) {
  const at::Tensor& t = tensors_[slot];
  if (!t.defined()) {
    throw Error(text("value ", p_.tensor_names[slot], " is not bound"), "UnboundValueError");
  }
  return t;
}

const at::Tensor* Run::maybeTensor(int slot) {
  const at::Tensor& t = tensors_[slot];
  return t.defined() ? &t : nullptr;
}

void Run::bind(int slot, at::Tensor value) {
  tensors_[slot] = std::move(value);
}

// A caller's tensor: bind the extents its sizes give, check the rest.
void Run::bindTensor(int slot, const at::Tensor& value) {
  for (const auto& [rule_slot, rules] : p_.extent_rules) {
    if (rule_slot == slot) {
      bindExtents(slot, value, rules);
      break;
    }
  }
  bind(slot, value);
}

void Run::bindExtents(int slot, const at::Tensor& value, const std::vector<ExtentRule>& rules) {
  const std::string& name = p_.tensor_names[slot];
  if (value.dim() != static_cast<int64_t>(rules.size())) {
    throw Error(text(name, " has ", rules.size(), " dims but its tensor has shape ", value.sizes()), "BindingError");
  }
  for (size_t i = 0; i < rules.size(); ++i) {
    const ExtentRule& r = rules[i];
    int64_t size = value.size(static_cast<int64_t>(i));
    if (r.mesh_size > 0) {
      if (size != 1) {
        throw Error(
            text("axis ", i, " of ", name, " is sharded (", r.axis_text, "): each rank holds size 1 of it, got ", size),
            "BindingError");
      }
      size = r.mesh_size;
    }
    if (r.extent < 0) {
      continue;
    }
    size *= r.scale;
    auto known = eval(r.extent);
    if (!known) {
      if (!r.error.empty()) {
        throw Error(r.error, "BindingError");
      }
      bindInt(r.bind_slot, size * r.factor);
    } else if (*known != size) {
      throw Error(
          text("axis ", i, " of ", name, " is ", size, " but its extent ", r.text, " is ", *known), "BindingError");
    }
  }
}

// -- streams (no-ops on the CPU)
c10::Stream Run::stream(const Instr& ins) {
  if (ins.stream_index >= 0) {
    return poolStream(get(ins.stream_index));
  }
  if (ins.stream_slot >= 0 && streams_[ins.stream_slot]) {
    return *streams_[ins.stream_slot];
  }
  return poolStream(ins.stream_key);
}

// The pool's stream of `key`, looked up once per run and key.
c10::Stream Run::poolStream(int64_t key) {
  for (const auto& [k, s] : pool_streams_) {
    if (k == key) {
      return s;
    }
  }
  c10::Stream s = streamPool().get(p_.device, key);
  pool_streams_.emplace_back(key, s);
  return s;
}

void Run::wait(const c10::Stream& waiter, const c10::Stream& target) {
  if (waiter == target) {
    return;
  }
  if (!event_) {
    event_ = events_.take(p_.device.type());
  }
  event_->record(target);
  event_->block(waiter);
}

void Run::noteUsed(const c10::Stream& s) {
  for (const auto& u : used_) {
    if (u == s) {
      return;
    }
  }
  used_.push_back(s);
}

c10::Event* Run::heldEvent() {
  held_events_.push_back(events_.take(p_.device.type()));
  return held_events_.back().get();
}

void Run::join() {
  if (!uses_streams_) {
    return;
  }
  for (const auto& s : used_) {
    wait(*caller_, s);
  }
  guard().exchangeStream(*caller_);
}

// -- running
void Run::scope(int begin, int end) {
  int i = begin;
  while (i < end) {
    const Instr& ins = p_.instrs[i];
    try {
      if (ins.op == Opcode::kFor) {
        runFor(ins);
      } else if (ins.op == Opcode::kIf) {
        // A failure inside a branch names its own instruction.
        bool taken = get(ins.cond) != 0;
        ++executed_;
        if (taken) {
          scope(i + 1, ins.end);
        } else {
          scope(ins.end, ins.else_end);
        }
        i = ins.else_end;
        continue;
      } else if (tracing_) {
        traced(i, ins);
      } else {
        exec(ins);
      }
    } catch (Failed&) {
      throw;
    } catch (const Error& e) {
      fail(i, e.kind(), e.what());
    } catch (const c10::Error& e) {
      fail(i, kindOf(e), e.what_without_backtrace());
    } catch (const std::exception& e) {
      fail(i, "RuntimeError", e.what());
    }
    ++executed_;
    i = ins.op == Opcode::kFor ? ins.end : i + 1;
  }
}

void Run::fail(int instr, const std::string& kind, const std::string& message) {
  throw Failed{Failure{instr, loops_, kind, message}};
}

void Run::runFor(const Instr& ins) {
  int64_t start = get(ins.start);
  int64_t stop = get(ins.stop);
  int body = static_cast<int>(indexOf(ins)) + 1;
  loops_.emplace_back(ins.index, start);
  for (int64_t i = start; i < stop; ++i) {
    for (int slot : ins.locals) {
      tensors_[slot] = at::Tensor();
    }
    loops_.back().second = i;
    bindInt(ins.index, i);
    scope(body, ins.end);
  }
  loops_.pop_back();
  // The last iteration's slices and buffers would otherwise keep their
  // sources alive past a Deallocate after the loop, to the run's end.
  for (int slot : ins.locals) {
    tensors_[slot] = at::Tensor();
  }
}

void Run::exec(const Instr& ins) {
  switch (ins.op) {
    case Opcode::kFor:
    case Opcode::kIf:
      break;
    case Opcode::kGetStream:
      if (uses_streams_) {
        streams_[ins.stream_slot] = currentStream();
      }
      break;
    case Opcode::kSetStream: {
      if (!uses_streams_) {
        if (ins.stream_index >= 0) {
          get(ins.stream_index);
        }
        break;
      }
      c10::Stream s = stream(ins);
      guard().exchangeStream(s);
      noteUsed(s);
      break;
    }
    case Opcode::kSynchronize:
      if (!uses_streams_) {
        if (ins.stream_index >= 0) {
          get(ins.stream_index);
        }
        break;
      }
      wait(currentStream(), stream(ins));
      break;
    case Opcode::kSelect:
      bind(ins.out, tensor(ins.input).select(ins.dim, ins.index < 0 ? 0 : get(ins.index)));
      break;
    case Opcode::kChunk:
      chunkView(*this, ins);
      break;
    case Opcode::kAllocate: {
      if (maybeTensor(ins.out) != nullptr) {
        break;
      }
      if (ins.symmetric) {
        bind(ins.out, windowView(*this, ins));
        break;
      }
      auto options = at::TensorOptions().dtype(ins.dtype).device(p_.device);
      auto shape = sizes(ins.shape);
      bind(ins.out, ins.zero_init ? at::zeros(shape, options) : at::empty(shape, options));
      break;
    }
    case Opcode::kDeallocate:
      tensor(ins.out);
      bind(ins.out, at::Tensor());
      break;
    case Opcode::kSet: {
      const at::Tensor& src = tensor(ins.input);
      const at::Tensor* out = maybeTensor(ins.out);
      if (out == nullptr) {
        bind(ins.out, src.clone(at::MemoryFormat::Contiguous));
      } else {
        const_cast<at::Tensor*>(out)->copy_(src);
      }
      break;
    }
    case Opcode::kBinary:
    case Opcode::kUnary:
    case Opcode::kPermute:
    case Opcode::kReduction:
    case Opcode::kMatmul:
    case Opcode::kLinear:
    case Opcode::kTopK:
    case Opcode::kRoute:
    case Opcode::kTake:
    case Opcode::kPutAdd:
    case Opcode::kGroupedMm:
    case Opcode::kGroupedOuter:
    case Opcode::kSlice:
    case Opcode::kCat:
    case Opcode::kInsert:
      compute(*this, ins);
      break;
    case Opcode::kTransfer:
      if (ins.copy_stream) {
        posted_[indexOf(ins)] = postTransfer(*this, ins);
      } else {
        copyInOrder(*this, ins);
      }
      break;
    case Opcode::kCommunication:
      passGate();
      try {
        posted_[indexOf(ins)] = communication(ins);
      } catch (const c10::Error& e) {
        throw Error(e.what_without_backtrace(), "Communication:" + kindOf(e));
      } catch (const Error& e) {
        throw;
      } catch (const std::exception& e) {
        throw Error(e.what(), "Communication:RuntimeError");
      }
      break;
    case Opcode::kP2P:
      passGate();
      p2p(ins);
      break;
    case Opcode::kStartCoalescing:
      passGate();
      startCoalescing(ins);
      break;
    case Opcode::kEndCoalescing:
      endCoalescing(ins);
      break;
    case Opcode::kWait:
      waitFor(ins);
      break;
  }
}

// -- communications
void Run::passGate() {
  if (gate_ && !std::exchange(gated_, true) && !gate_()) {
    throw Error("the ranks' steps differ: stopped before the first communication", "StepGate");
  }
}

const c10::intrusive_ptr<c10d::ProcessGroup>& Run::worldGroup() {
  HOSTIR_CHECK(p_.world_group >= 0, "the program has no default process group");
  return p_.groups[p_.world_group];
}

Posted Run::communication(const Instr& ins) {
  if (ins.team_size == 1) {
    return keepLocal(ins);
  }
  return ins.transport->post(*this, ins);
}

// A communication over a team of one rank moves nothing, on any transport:
// its output is its input (the rows this rank holds of a reduced axis
// reduced, in the output's dtype), bound as a view of it where the program
// allocates the output for this communication alone (`view_out`), else
// copied into the output's buffer on the current stream; its Wait makes the
// waiting stream wait for this one, as a collective's would.
Posted Run::keepLocal(const Instr& ins) {
  at::Tensor src = reducedInput(*this, ins);
  if (ins.view_out && !(ins.out_may_be_given && maybeTensor(ins.out))) {
    bind(ins.out, src.to(ins.dtype_out).reshape(sizes(ins.out_shape)));
  } else {
    at::Tensor out = tensor(ins.out);
    out.copy_(src.reshape(out.sizes()));
  }
  Posted posted;
  if (uses_streams_) {
    c10::Stream posting = currentStream();
    posted.after = [this, posting]() { wait(currentStream(), posting); };
  }
  return posted;
}

void Run::p2p(const Instr& ins) {
  int64_t peer = get(static_cast<int>(ins.peer));
  if (peer < 0 || peer >= ins.world_size) {
    throw Error(text("invalid peer ", peer, ": the world has ", ins.world_size, " ranks"), "BindingError");
  }
  at::Tensor buf = tensor(ins.buffer);
  if (!buf.is_contiguous()) {
    if (!ins.send) {
      throw Error(
          text("the buffer of a P2P receive must be contiguous (strides ", buf.strides(), ")"), "BindingError");
    }
    // A send of a view (a permute's): the transports move contiguous
    // memory, so the send goes from a compact copy, kept to the run's end.
    buf = buf.contiguous();
    keep(buf);
  }
  if (coalescing_ != nullptr && coalescing_->backend != ins.backend) {
    throw Error(
        text("one coalescing group mixes backends ", coalescing_->backend, " and ", ins.backend), "ProgramError");
  }
  Works* group = coalescing_ != nullptr ? &coalesced_ : nullptr;
  posted_[indexOf(ins)] = ins.transport->postP2P(*this, ins, buf, static_cast<int>(peer), group);
}

// A coalescing group's transport is its members' (the flat compiler gives
// both ends the backend of the first; an empty group has none, and posts
// nothing).
void Run::startCoalescing(const Instr& ins) {
  if (coalescing_ != nullptr) {
    throw Error("StartCoalescing inside an open coalescing group", "ProgramError");
  }
  coalescing_ = &ins;
  coalesced_.clear();
  if (ins.transport != nullptr) {
    ins.transport->startCoalescing(*this);
  }
}

void Run::endCoalescing(const Instr& ins) {
  if (coalescing_ == nullptr) {
    throw Error("EndCoalescing without StartCoalescing", "ProgramError");
  }
  coalescing_ = nullptr;
  Posted posted;
  if (ins.transport != nullptr) {
    posted = ins.transport->endCoalescing(*this, coalesced_);
  }
  coalesced_.clear();
  posted_[indexOf(ins)] = std::move(posted);
}

void Run::waitFor(const Instr& ins) {
  auto it = posted_.find(ins.posted);
  if (it == posted_.end()) {
    throw Error(text("no posted communication to wait for: ", ins.text), "ProgramError");
  }
  Posted posted = std::move(it->second);
  posted_.erase(it);
  try {
    for (auto& work : posted.works) {
      work->wait();
    }
  } catch (const c10::Error& e) {
    throw Error(e.what_without_backtrace(), "Communication:" + kindOf(e));
  } catch (const std::exception& e) {
    throw Error(e.what(), "Communication:RuntimeError");
  }
  if (posted.after) {
    posted.after();
  }
}

} // namespace hostir
