// The executor of flat host programs: the C++ twin of python/hostir/
// evaluator.py, instruction for instruction, with ATen out= variants,
// device-generic streams and events (c10), and collectives posted on the
// c10d::ProcessGroup objects the Python communicator created. A run keeps
// everything it binds in a Frame, so runs of one Executor may overlap.
#include "program.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <functional>
#include <limits>
#include <utility>

// _allgather_base and _reduce_scatter_base are the names every supported
// torch has (2.13 deprecates them for all_gather_single and
// reduce_scatter_single, which 2.11 lacks).
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

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

namespace {

// The pool key of the copy stream that posted host-to-device transfers run
// on: far from the keys of the program's own streams (an indexed stream's
// index, or -1 - slot).
constexpr int64_t kH2DCopyStream = int64_t{1} << 40;

// A run failed at an instruction; carries the Failure up through loops.
struct Failed {
  Failure failure;
};

// Python's floor division and modulo, so scalars match the evaluator's.
int64_t floorDiv(int64_t a, int64_t b) {
  if (b == 0) {
    throw Error("integer division or modulo by zero", "ZeroDivisionError");
  }
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) {
    --q;
  }
  return q;
}

int64_t floorMod(int64_t a, int64_t b) {
  return a - floorDiv(a, b) * b;
}

// The 0-d CPU tensor torch makes of a number on the right of a binary op.
at::Tensor wrappedNumber(const at::Scalar& s) {
  at::Tensor t = c10::scalar_to_tensor(s);
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

// A posted communication: its works, and what to run once they are done
// (copy a staging buffer into a non-contiguous or reshaped output).
struct Posted {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::function<void()> after;
};

// What a reducing collective is handed for `t`: bool buffers go as uint8
// (the same bytes), so a max or min is a logical or / and on every backend.
at::Tensor onWire(const at::Tensor& t) {
  return t.scalar_type() == at::kBool ? t.view(at::kByte) : t;
}

at::Tensor contiguous(const at::Tensor& t) {
  // Never hand a strided view to a collective: gloo would read or write the
  // wrong memory.
  return t.is_contiguous() ? t : t.contiguous();
}

// A contiguous buffer of `shape` a collective may write, and the copy into
// `out` afterwards (none if it is `out` itself).
std::pair<at::Tensor, std::function<void()>> staged(
    const at::Tensor& out,
    at::IntArrayRef shape) {
  if (out.is_contiguous()) {
    return {out.view(shape), nullptr};
  }
  at::Tensor staging = at::empty(shape, out.options());
  at::Tensor target = out;
  return {staging, [staging, target]() {
            target.copy_(staging.view(target.sizes()));
          }};
}

bool outermost(const std::vector<int64_t>& shape, int64_t axis) {
  for (int64_t i = 0; i < axis; ++i) {
    if (shape[i] != 1) {
      return false;
    }
  }
  return true;
}

// 1 where `t` is NaN, for a max or min of floating values; else undefined.
at::Tensor nanFlags(const at::Tensor& t, const std::string& red_op) {
  if ((red_op != "max" && red_op != "min") || !at::isFloatingType(t.scalar_type())) {
    return at::Tensor();
  }
  return at::isnan(t).to(at::kFloat);
}

// Makes a max or min keep NaN, as amax and amin do (gloo and NCCL compare
// with `<`, so a NaN may lose to any number): `flag_work` reduced 0/1 NaN
// flags with MAX into `flags_out`; once both are done, `buf` (undefined on a
// rank that receives nothing) gets NaN wherever a rank had one.
void withNanFlags(
    Posted& posted,
    const at::Tensor& buf,
    const at::Tensor& flags_out,
    c10::intrusive_ptr<c10d::Work> flag_work) {
  posted.works.push_back(std::move(flag_work));
  auto after = posted.after;
  at::Tensor target = buf;
  at::Tensor flags = flags_out;
  posted.after = [target, flags, after]() mutable {
    if (target.defined()) {
      target.masked_fill_(flags.view(target.sizes()) > 0, std::numeric_limits<double>::quiet_NaN());
    }
    if (after) {
      after();
    }
  };
}

c10d::ReduceOp reduceOp(const std::string& name) {
  if (name == "sum") {
    return c10d::ReduceOp(c10d::ReduceOp::SUM);
  }
  if (name == "max") {
    return c10d::ReduceOp(c10d::ReduceOp::MAX);
  }
  return c10d::ReduceOp(c10d::ReduceOp::MIN);
}

class Run {
 public:
  Run(const Program& program, bool uses_streams, EventPool& events, Staging& staging, bool tracing = false)
      : p_(program),
        uses_streams_(uses_streams),
        tracing_(tracing),
        events_(events),
        staging_(staging),
        tensors_(program.num_tensors),
        ints_(program.num_ints),
        bound_(program.num_ints, 0),
        streams_(program.num_streams) {}

  ~Run() {
    if (event_) {
      events_.give(std::move(event_));
    }
    for (auto& e : copy_events_) {
      events_.give(std::move(e));
    }
  }

  // Instructions run to their end so far (a loop counts once, its body's
  // once per iteration).
  int64_t executed() const {
    return executed_;
  }

  RunResult go(
      const std::vector<at::Tensor>& inputs,
      const std::vector<at::Tensor>& outputs,
      int64_t number_of_streams) {
    RunResult result;
    // Binding comes first and touches no stream; a bad binding is a Failure
    // with no instruction (-1), returned like an instruction's failure, so no
    // C++ exception ever leaves the executor.
    try {
      bindAll(inputs, outputs, number_of_streams);
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
      caller_ = guard().getStream(p_.device);
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

  // The records of a traced run, in the order the instructions ended.
  std::vector<TraceRecord>& trace() {
    return trace_;
  }

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
  };

  Stamp stamp() {
    Stamp s;
    s.host_us = std::chrono::duration<double, std::micro>(
                    std::chrono::steady_clock::now().time_since_epoch())
                    .count();
    if (uses_streams_) {
      s.event = std::make_shared<c10::Event>(p_.device.type(), c10::EventFlag::BACKEND_DEFAULT);
      s.event->record(guard().getStream(p_.device));
    }
    return s;
  }

  void traced(int i, const Instr& ins) {
    int64_t track = track_;
    Stamp start = stamp();
    exec(ins);
    pending_.push_back({i, track, ins.op == Opcode::kWait ? ins.posted : -1, std::move(start), stamp()});
    if (ins.op == Opcode::kSetStream) {
      track_ = ins.stream_index >= 0 ? get(ins.stream_index) : -1;
    }
  }

  double since(const Stamp& origin, const Stamp& s) {
    if (origin.event && s.event) {
      s.event->synchronize();
      return origin.event->elapsedTime(*s.event) * 1000.0;
    }
    return s.host_us - origin.host_us;
  }

  void finishTrace() {
    trace_.reserve(pending_.size());
    for (const Pending& p : pending_) {
      trace_.push_back({p.instr, p.track, p.posted, since(origin_, p.start), since(origin_, p.end)});
    }
    pending_.clear();
  }

  // The caller's values: number_of_streams, the inputs and the outputs to
  // write into, with the extents their sizes give. Throws on a bad one.
  void bindAll(
      const std::vector<at::Tensor>& inputs,
      const std::vector<at::Tensor>& outputs,
      int64_t number_of_streams) {
    if (number_of_streams < 1) {
      throw Error(
          text("number_of_streams must be an integer >= 1, got ", number_of_streams),
          "BindingError");
    }
    if (p_.number_of_streams >= 0) {
      bindInt(p_.number_of_streams, number_of_streams);
    }
    HOSTIR_CHECK(
        inputs.size() == p_.inputs.size(),
        "the program takes ",
        p_.inputs.size(),
        " inputs, got ",
        inputs.size());
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
          outputs.size() == p_.outputs.size(),
          "the program has ",
          p_.outputs.size(),
          " outputs, got ",
          outputs.size());
      for (size_t i = 0; i < outputs.size(); ++i) {
        if (p_.outputs[i] >= 0 && outputs[i].defined()) {
          bindTensor(p_.outputs[i], outputs[i]);
        }
      }
    }
  }

  // -- the accessors: every read and write of a slot goes through these
  std::optional<int64_t> eval(int node) {
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

  int64_t get(int node) {
    auto v = eval(node);
    if (!v) {
      throw Error(text("value ", scalarText(node), " is not bound"), "UnboundValueError");
    }
    return *v;
  }

  std::string scalarText(int node) {
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

  void bindInt(int slot, int64_t value) {
    ints_[slot] = value;
    bound_[slot] = 1;
  }

  const at::Tensor& tensor(int slot) {
    const at::Tensor& t = tensors_[slot];
    if (!t.defined()) {
      throw Error(text("value ", p_.tensor_names[slot], " is not bound"), "UnboundValueError");
    }
    return t;
  }

  const at::Tensor* maybeTensor(int slot) {
    const at::Tensor& t = tensors_[slot];
    return t.defined() ? &t : nullptr;
  }

  void bind(int slot, at::Tensor value) {
    tensors_[slot] = std::move(value);
  }

  // A caller's tensor: bind the extents its sizes give, check the rest.
  void bindTensor(int slot, const at::Tensor& value) {
    for (const auto& [rule_slot, rules] : p_.extent_rules) {
      if (rule_slot == slot) {
        bindExtents(slot, value, rules);
        break;
      }
    }
    bind(slot, value);
  }

  void bindExtents(int slot, const at::Tensor& value, const std::vector<ExtentRule>& rules) {
    const std::string& name = p_.tensor_names[slot];
    if (value.dim() != static_cast<int64_t>(rules.size())) {
      throw Error(
          text(name, " has ", rules.size(), " dims but its tensor has shape ", value.sizes()),
          "BindingError");
    }
    for (size_t i = 0; i < rules.size(); ++i) {
      const ExtentRule& r = rules[i];
      int64_t size = value.size(static_cast<int64_t>(i));
      if (r.mesh_size > 0) {
        if (size != 1) {
          throw Error(
              text(
                  "axis ", i, " of ", name, " is sharded (", r.axis_text,
                  "): each rank holds size 1 of it, got ", size),
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
            text("axis ", i, " of ", name, " is ", size, " but its extent ", r.text, " is ", *known),
            "BindingError");
      }
    }
  }

  // -- streams (no-ops on the CPU)
  c10::impl::VirtualGuardImpl guard() const {
    return c10::impl::VirtualGuardImpl(p_.device.type());
  }

  c10::Stream stream(const Instr& ins) {
    if (ins.stream_index >= 0) {
      return poolStream(get(ins.stream_index));
    }
    if (ins.stream_slot >= 0 && streams_[ins.stream_slot]) {
      return *streams_[ins.stream_slot];
    }
    return poolStream(ins.stream_key);
  }

  // The pool's stream of `key`, looked up once per run and key.
  c10::Stream poolStream(int64_t key) {
    for (const auto& [k, s] : pool_streams_) {
      if (k == key) {
        return s;
      }
    }
    c10::Stream s = streamPool().get(p_.device, key);
    pool_streams_.emplace_back(key, s);
    return s;
  }

  void wait(const c10::Stream& waiter, const c10::Stream& target) {
    if (waiter == target) {
      return;
    }
    if (!event_) {
      event_ = events_.take(p_.device.type());
    }
    event_->record(target);
    event_->block(waiter);
  }

  void join() {
    if (!uses_streams_) {
      return;
    }
    for (const auto& s : used_) {
      wait(*caller_, s);
    }
    guard().exchangeStream(*caller_);
  }

  // -- running
  void scope(int begin, int end) {
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

  static std::string kindOf(const c10::Error& e) {
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

  [[noreturn]] void fail(int instr, const std::string& kind, const std::string& message) {
    throw Failed{Failure{instr, loops_, kind, message}};
  }

  void runFor(const Instr& ins) {
    int64_t start = get(ins.start);
    int64_t stop = get(ins.stop);
    int body = static_cast<int>(&ins - p_.instrs.data()) + 1;
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

  at::Tensor fullRank(const at::Tensor& t, int dim) {
    return dim < 0 ? t : t.unsqueeze(dim);
  }

  std::vector<int64_t> sizes(const std::vector<int>& nodes) {
    std::vector<int64_t> out;
    out.reserve(nodes.size());
    for (int n : nodes) {
      out.push_back(get(n));
    }
    return out;
  }

  at::Tensor operandTensor(const Operand& o) {
    if (o.tensor >= 0) {
      return tensor(o.tensor);
    }
    // torch takes a number only on the right; the evaluator makes the left
    // one a 0-d CPU tensor of the number's default dtype.
    at::Scalar s = o.is_number ? o.number : at::Scalar(get(o.scalar));
    at::ScalarType dtype = s.isBoolean() ? at::kBool
        : s.isIntegral(false)            ? at::kLong
                                         : c10::typeMetaToScalarType(c10::get_default_dtype());
    return at::scalar_tensor(s, at::TensorOptions().dtype(dtype));
  }

  at::Tensor operandOther(const Operand& o) {
    if (o.tensor >= 0) {
      return tensor(o.tensor);
    }
    if (o.wrapped.defined()) {
      return o.wrapped;
    }
    return wrappedNumber(at::Scalar(get(o.scalar)));
  }

  void exec(const Instr& ins) {
    switch (ins.op) {
      case Opcode::kFor:
      case Opcode::kIf:
        break;
      case Opcode::kGetStream:
        if (uses_streams_) {
          streams_[ins.stream_slot] = guard().getStream(p_.device);
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
        wait(guard().getStream(p_.device), stream(ins));
        break;
      case Opcode::kSelect: {
        const at::Tensor& src = tensor(ins.input);
        int64_t index = ins.index < 0 ? 0 : get(ins.index);
        bind(ins.out, src.select(ins.dim, index));
        break;
      }
      case Opcode::kAllocate: {
        if (maybeTensor(ins.out) != nullptr) {
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
        binary(ins);
        break;
      case Opcode::kUnary:
        unary(ins);
        break;
      case Opcode::kPermute:
        permute(ins);
        break;
      case Opcode::kTransfer:
        if (ins.copy_stream) {
          posted_[&ins - p_.instrs.data()] = postTransfer(ins);
        } else {
          transfer(ins);
        }
        break;
      case Opcode::kReduction:
        reduction(ins);
        break;
      case Opcode::kMatmul:
      case Opcode::kLinear:
        matmulOrLinear(ins);
        break;
      case Opcode::kCommunication:
        try {
          posted_[&ins - p_.instrs.data()] = communication(ins);
        } catch (const c10::Error& e) {
          throw Error(e.what_without_backtrace(), "Communication:" + kindOf(e));
        } catch (const Error& e) {
          throw;
        } catch (const std::exception& e) {
          throw Error(e.what(), "Communication:RuntimeError");
        }
        break;
      case Opcode::kP2P:
        p2p(ins);
        break;
      case Opcode::kStartCoalescing:
        if (coalescing_) {
          throw Error("StartCoalescing inside an open coalescing group", "ProgramError");
        }
        coalescing_ = true;
        coalesced_.clear();
        if (groupCoalesces()) {
          worldGroup()->startCoalescing(p_.device.type());
        }
        break;
      case Opcode::kEndCoalescing: {
        if (!coalescing_) {
          throw Error("EndCoalescing without StartCoalescing", "ProgramError");
        }
        coalescing_ = false;
        Posted posted;
        if (groupCoalesces()) {
          auto work = worldGroup()->endCoalescing(p_.device.type());
          if (work) {
            posted.works.push_back(work);
          }
        } else {
          posted.works = std::move(coalesced_);
        }
        coalesced_.clear();
        posted_[&ins - p_.instrs.data()] = std::move(posted);
        break;
      }
      case Opcode::kWait:
        waitFor(ins);
        break;
    }
  }

  // -- layouts (the evaluator's `_operand` and `_store`)
  // Operand `k` of `ins` as the op reads it: with its logical axes, cut to
  // this rank's slice where the output is sharded and it is not.
  at::Tensor viewed(const Instr& ins, size_t k, at::Tensor t) {
    if (k >= ins.views.size()) {
      return t;
    }
    return applyView(ins.views[k], std::move(t));
  }

  static std::vector<int64_t> groupShape(const at::Tensor& t, const std::vector<std::vector<int64_t>>& groups) {
    std::vector<int64_t> shape;
    shape.reserve(groups.size());
    for (const auto& group : groups) {
      int64_t size = 1;
      for (int64_t d : group) {
        size *= t.size(d);
      }
      shape.push_back(size);
    }
    return shape;
  }

  at::Tensor applyView(const View& v, at::Tensor t) {
    if (!v.logical.empty()) {
      t = t.reshape(groupShape(t, v.logical));
    }
    for (const Cut& c : v.cuts) {
      int64_t size = t.size(c.pos);
      int64_t known = 1;
      for (int64_t s : c.sizes) {
        known *= s < 0 ? 1 : s;
      }
      std::vector<int64_t> shape(t.sizes().begin(), t.sizes().begin() + c.pos);
      std::vector<int64_t> back = shape;
      for (int64_t s : c.sizes) {
        shape.push_back(s < 0 ? floorDiv(size, known) : s);
      }
      back.push_back(-1);
      for (int64_t d = c.pos + 1; d < t.dim(); ++d) {
        shape.push_back(t.size(d));
        back.push_back(t.size(d));
      }
      at::Tensor pieces = t.reshape(shape);
      for (size_t j = 0; j + 1 < c.narrows.size(); j += 2) {
        pieces = pieces.narrow(c.pos + c.narrows[j], c.narrows[j + 1], 1);
      }
      t = pieces.reshape(back);
    }
    return t;
  }

  // A result with the output's logical axes, in its runtime dims.
  static at::Tensor toRuntime(const at::Tensor& r, const Store& s) {
    if (s.runtime.empty()) {
      return r;
    }
    std::vector<int64_t> shape;
    shape.reserve(s.runtime.size());
    for (int64_t axis : s.runtime) {
      shape.push_back(axis < 0 ? 1 : r.size(axis));
    }
    return r.reshape(shape);
  }

  // Puts a result into `ins.out` as the evaluator's `_store` does: binds
  // `fresh()` (in the output's runtime layout) if the output is not bound,
  // else runs `into(view)` on the bound output's logical view. `full_rank`:
  // the op computes at full rank, a selected slice's dim put back as 1.
  template <typename Fresh, typename Into>
  void store(const Instr& ins, bool full_rank, Fresh fresh, Into into) {
    const Store& s = ins.store;
    const at::Tensor* bound = maybeTensor(ins.out);
    int dim = full_rank ? ins.out_dim : -1;
    if (s.slice || (s.runtime.empty() && s.logical.empty() && !s.partial)) {
      if (bound == nullptr) {
        at::Tensor r = fresh();
        bind(ins.out, dim < 0 ? r : r.squeeze(dim));
        return;
      }
      at::Tensor o = fullRank(*bound, dim);
      if (!s.partial) {
        into(o);
      } else {
        copySameSizes(o, fresh());
      }
      return;
    }
    if (bound == nullptr) {
      at::Tensor r = fresh();
      if (s.partial) {
        r = r.unsqueeze(0);
      }
      bind(ins.out, toRuntime(r, s));
      return;
    }
    at::Tensor o = s.logical.empty() ? *bound : bound->reshape(groupShape(*bound, s.logical));
    if (s.partial) {
      o = o.squeeze(0);
    }
    into(o);
  }

  static void copySameSizes(at::Tensor& out, const at::Tensor& result) {
    std::vector<int64_t> a, b;
    for (int64_t v : out.sizes()) {
      if (v != 1) {
        a.push_back(v);
      }
    }
    for (int64_t v : result.sizes()) {
      if (v != 1) {
        b.push_back(v);
      }
    }
    if (a != b) {
      throw Error(
          text("a result of shape ", result.sizes(), " does not fit its buffer of shape ", out.sizes()),
          "BindingError");
    }
    out.copy_(result.reshape(out.sizes()));
  }

  void binary(const Instr& ins) {
    at::Tensor lhs = ins.lhs.tensor >= 0 ? viewed(ins, 0, operandTensor(ins.lhs)) : operandTensor(ins.lhs);
    at::Tensor rhs = ins.rhs.tensor >= 0 ? viewed(ins, 1, operandOther(ins.rhs)) : operandOther(ins.rhs);
    OpKind kind = ins.op_kind;
    auto fresh = [&]() {
      switch (kind) {
        case OpKind::kAdd:
          return at::add(lhs, rhs);
        case OpKind::kSub:
          return at::sub(lhs, rhs);
        case OpKind::kMul:
          return at::mul(lhs, rhs);
        case OpKind::kDiv:
          return at::div(lhs, rhs);
        case OpKind::kReluGrad:
          return at::threshold_backward(lhs, rhs, 0);
        case OpKind::kGeluGrad:
          return at::gelu_backward(lhs, rhs);
        case OpKind::kGeluTanhGrad:
          return at::gelu_backward(lhs, rhs, "tanh");
        case OpKind::kSiluGrad:
          return at::silu_backward(lhs, rhs);
        case OpKind::kTanhGrad:
          return at::tanh_backward(lhs, rhs);
        case OpKind::kSigmoidGrad:
          return at::sigmoid_backward(lhs, rhs);
        case OpKind::kAbsGrad:
          return at::mul(lhs, at::sgn(rhs));
        default:
          return at::eq(lhs, rhs).to(lhs.scalar_type());
      }
    };
    bool copies = kind != OpKind::kAdd && kind != OpKind::kSub && kind != OpKind::kMul && kind != OpKind::kDiv;
    store(
        ins,
        false,
        fresh,
        [&](at::Tensor& o) {
          if (copies) {
            // The derivative kinds have no out= form: computed, then copied.
            o.copy_(fresh());
            return;
          }
          switch (kind) {
            case OpKind::kAdd:
              at::add_out(o, lhs, rhs);
              break;
            case OpKind::kSub:
              at::sub_out(o, lhs, rhs);
              break;
            case OpKind::kMul:
              at::mul_out(o, lhs, rhs);
              break;
            default:
              at::div_out(o, lhs, rhs);
              break;
          }
        });
  }

  // The torch function of a unary kind (python/hostir/kinds.py), on `x`.
  static at::Tensor unaryOf(OpKind kind, const at::Tensor& x, at::ScalarType dtype) {
    switch (kind) {
      case OpKind::kRelu:
        return at::relu(x);
      case OpKind::kNeg:
        return at::neg(x);
      case OpKind::kAbs:
        return at::abs(x);
      case OpKind::kCast:
        return x.to(dtype);
      case OpKind::kGelu:
        return at::gelu(x);
      case OpKind::kGeluTanh:
        return at::gelu(x, "tanh");
      case OpKind::kSilu:
        return at::silu(x);
      case OpKind::kExp:
        return at::exp(x);
      case OpKind::kTanh:
        return at::tanh(x);
      default:
        return at::sigmoid(x);
    }
  }

  void unary(const Instr& ins) {
    at::Tensor x = viewed(ins, 0, tensor(ins.input));
    OpKind kind = ins.op_kind;
    at::ScalarType dtype = ins.dtype;
    store(
        ins,
        false,
        [&]() { return unaryOf(kind, x, dtype); },
        [&](at::Tensor& o) {
          // A cast copies, converting to the output's dtype.
          o.copy_(kind == OpKind::kCast ? x : unaryOf(kind, x, dtype));
        });
  }

  // A transfer on the current stream (`ir.Transfer` with stream="current"):
  // a host-to-device copy is enqueued in order with the ops around it, a
  // device-to-host one blocks until the bytes are in host memory. The H2D
  // copy is always asked for non-blocking: from pinned memory it does not
  // block the host, and from pageable memory the CUDA runtime stages the
  // bytes before the call returns, so the source may change right after
  // either way, and no driver query (`is_pinned`) is needed to choose.
  void transfer(const Instr& ins) {
    const at::Tensor& src = tensor(ins.input);
    at::Tensor out = tensor(ins.out);
    out.copy_(src.reshape(out.sizes()), /*non_blocking=*/ins.h2d);
  }

  // A posted host-to-device transfer (`ir.Transfer` on a copy stream): the
  // copy runs on the copy stream after the work already on the current
  // stream, from pinned memory (the source itself, else its staging), and
  // its Wait makes the waiting stream wait for it; the host blocks at
  // neither. On the CPU it is a copy made at the post. (A posted
  // device-to-host transfer runs on the Python evaluator: its output is
  // host memory the program allocates.)
  Posted postTransfer(const Instr& ins) {
    const at::Tensor& src = tensor(ins.input);
    at::Tensor out = tensor(ins.out);
    Posted posted;
    if (!uses_streams_) {
      out.copy_(src.reshape(out.sizes()));
      return posted;
    }
    c10::Stream caller = guard().getStream(p_.device);
    c10::Stream copy = poolStream(kH2DCopyStream);
    wait(copy, caller);
    noteUsed(copy);
    copy_events_.push_back(events_.take(p_.device.type()));
    c10::Event* done = copy_events_.back().get();
    StreamSwitch on(guard(), copy, caller);
    if (src.is_contiguous() && src.is_pinned()) {
      out.copy_(src.reshape(out.sizes()), /*non_blocking=*/true);
      done->record(copy);
    } else {
      // The staging is refreshed and read under its lock, so that a run of
      // the same program on another thread cannot refresh it between.
      std::lock_guard<std::mutex> lock(staging_.mutex);
      Staged& entry = staging_.entries[&ins - p_.instrs.data()];
      refresh(entry, src);
      out.copy_(entry.buffer.reshape(out.sizes()), /*non_blocking=*/true);
      done->record(copy);
      entry.read = std::make_shared<c10::Event>(p_.device.type());
      entry.read->record(copy);
    }
    posted.after = [this, done]() { done->block(guard().getStream(p_.device)); };
    return posted;
  }

  // `entry`'s buffer holding `src`'s bytes: copied again only if `src` is
  // another tensor than the one last copied, or was written since.
  static void refresh(Staged& entry, const at::Tensor& src) {
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

  void noteUsed(const c10::Stream& s) {
    for (const auto& u : used_) {
      if (u == s) {
        return;
      }
    }
    used_.push_back(s);
  }

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

  void permute(const Instr& ins) {
    at::Tensor src = tensor(ins.input);
    if (!ins.views.empty()) {
      // On sharded tensors: this rank's piece, permuted, its sharded axes
      // moving with it (a view: the runtime dims only add size-1 dims and
      // split a dim), written into the output if it is bound.
      at::Tensor r = toRuntime(viewed(ins, 0, src).permute(ins.dims), ins.store);
      const at::Tensor* bound = maybeTensor(ins.out);
      if (bound != nullptr) {
        at::Tensor(*bound).copy_(r);
      } else {
        bind(ins.out, r);
      }
      return;
    }
    at::Tensor r = fullRank(src, ins.a_dim).permute(ins.dims);
    const at::Tensor* out = maybeTensor(ins.out);
    if (out != nullptr) {
      fullRank(*out, ins.out_dim).copy_(r);
      return;
    }
    bind(ins.out, ins.out_dim < 0 ? r : r.squeeze(ins.out_dim));
  }

  void reduction(const Instr& ins) {
    at::Tensor src = viewed(ins, 0, tensor(ins.input));
    OpKind kind = ins.op_kind;
    store(
        ins,
        false,
        [&]() {
          return kind == OpKind::kSum ? at::sum(src, ins.dims, false, ins.dtype)
              : kind == OpKind::kMax  ? at::amax(src, ins.dims)
                                      : at::amin(src, ins.dims);
        },
        [&](at::Tensor& o) {
          if (kind == OpKind::kSum) {
            at::sum_out(o, src, ins.dims, false, ins.dtype);
          } else if (kind == OpKind::kMax) {
            at::amax_out(o, src, ins.dims);
          } else {
            at::amin_out(o, src, ins.dims);
          }
        });
  }

  void matmulOrLinear(const Instr& ins) {
    at::Tensor a = viewed(ins, 0, fullRank(tensor(ins.a), ins.a_dim));
    at::Tensor b = viewed(ins, 1, fullRank(tensor(ins.b), ins.b_dim));
    std::optional<at::Tensor> bias;
    if (ins.bias >= 0) {
      bias = viewed(ins, 2, fullRank(tensor(ins.bias), ins.bias_dim));
    }
    bool linear = ins.op == Opcode::kLinear;
    if (linear && b.dim() > 2) {
      // A weight [*W, N, K]: linear on [W*N, K], the result unflattened
      // to [..., *W, N]; the bias is [*W, N] or a trailing part of it.
      auto fresh = [&]() {
        std::vector<int64_t> lead(b.sizes().begin(), b.sizes().end() - 1);
        std::optional<at::Tensor> flat_bias;
        if (bias.has_value()) {
          flat_bias = bias->expand(lead).reshape({-1});
        }
        return at::linear(a, b.reshape({-1, b.size(-1)}), flat_bias).unflatten(-1, lead);
      };
      store(ins, true, fresh, [&](at::Tensor& o) { o.copy_(fresh()); });
      return;
    }
    if (linear) {
      store(
          ins,
          true,
          [&]() { return at::linear(a, b, bias); },
          [&](at::Tensor& o) { at::linear_out(o, a, b, bias); });
      return;
    }
    store(
        ins,
        true,
        [&]() { return at::matmul(a, b); },
        [&](at::Tensor& o) { at::matmul_out(o, a, b); });
  }

  // -- communications
  const c10::intrusive_ptr<c10d::ProcessGroup>& worldGroup() {
    HOSTIR_CHECK(p_.world_group >= 0, "the program has no default process group");
    return p_.groups[p_.world_group];
  }

  // Only NCCL groups coalesce P2P operations themselves (gloo refuses
  // startCoalescing, also on CUDA tensors, as when two ranks share one GPU):
  // for any other backend a group's works are collected and waited on
  // together.
  bool groupCoalesces() {
    return p_.device.is_cuda() &&
        worldGroup()->getBackendType() == c10d::ProcessGroup::BackendType::NCCL;
  }

  at::Tensor reducedInput(const Instr& ins) {
    const at::Tensor& src = tensor(ins.input);
    if (ins.local_reduce.empty()) {
      return src;
    }
    if (ins.red_op == "sum") {
      return at::sum(src, ins.local_reduce, true);
    }
    return ins.red_op == "max" ? at::amax(src, ins.local_reduce, true)
                               : at::amin(src, ins.local_reduce, true);
  }

  // A communication over a team of one rank moves nothing: its output is its
  // input (the rows this rank holds of a reduced axis reduced, in the
  // output's dtype), bound as a view of it where the program allocates the
  // output for this communication alone (`view_out`), else copied into the
  // output's buffer on the current stream; its Wait makes the waiting stream
  // wait for this one, as a collective's would.
  Posted keepLocal(const Instr& ins) {
    at::Tensor src = reducedInput(ins);
    if (ins.view_out && !(ins.out_may_be_given && maybeTensor(ins.out))) {
      bind(ins.out, src.to(ins.dtype_out).reshape(sizes(ins.out_shape)));
    } else {
      at::Tensor out = tensor(ins.out);
      out.copy_(src.reshape(out.sizes()));
    }
    Posted posted;
    if (uses_streams_) {
      c10::Stream posting = guard().getStream(p_.device);
      posted.after = [this, posting]() { wait(guard().getStream(p_.device), posting); };
    }
    return posted;
  }

  Posted communication(const Instr& ins) {
    if (ins.team_size == 1) {
      return keepLocal(ins);
    }
    auto& group = p_.groups[ins.group];
    Posted posted;
    switch (ins.comm_type) {
      case CommType::kAllgather: {
        at::Tensor src = contiguous(tensor(ins.input));
        at::Tensor out = tensor(ins.out);
        auto full = sizes(ins.in_full);
        int64_t a = ins.in_axis;
        at::Tensor flat_src = src.reshape({-1});
        if (outermost(full, a) && ins.in_order) {
          auto [buf, after] = staged(out, {-1});
          posted.works.push_back(group->_allgather_base(buf, flat_src));
          posted.after = after;
          break;
        }
        // Gather into [n, *local] in the group's order, then put each rank's
        // piece at its position in the team, on the sharded axis.
        std::vector<int64_t> shape{ins.team_size};
        shape.insert(shape.end(), src.sizes().begin(), src.sizes().end());
        at::Tensor staging = at::empty(shape, src.options());
        at::Tensor flat = staging.view({-1});
        posted.works.push_back(group->_allgather_base(flat, flat_src));
        at::Tensor index = at::tensor(ins.perm, at::TensorOptions().dtype(at::kLong)).to(src.device());
        posted.after = [staging, index, a, out]() mutable {
          at::Tensor moved = staging.index_select(0, index).squeeze(a + 1).movedim(0, a);
          out.copy_(moved.reshape(out.sizes()));
        };
        break;
      }
      case CommType::kAllreduce: {
        at::Tensor src = reducedInput(ins);
        at::Tensor out = tensor(ins.out);
        auto [buf, after] = staged(out, out.sizes());
        buf.copy_(src.reshape(out.sizes()));
        at::Tensor flags = nanFlags(buf, ins.red_op);
        std::vector<at::Tensor> bufs{onWire(buf)};
        c10d::AllreduceOptions opts;
        opts.reduceOp = reduceOp(ins.red_op);
        posted.works.push_back(group->allreduce(bufs, opts));
        posted.after = after;
        if (flags.defined()) {
          std::vector<at::Tensor> flag_bufs{flags};
          c10d::AllreduceOptions flag_opts;
          flag_opts.reduceOp = c10d::ReduceOp(c10d::ReduceOp::MAX);
          withNanFlags(posted, buf, flags, group->allreduce(flag_bufs, flag_opts));
        }
        break;
      }
      case CommType::kReduceScatter: {
        at::Tensor src = reducedInput(ins);
        at::Tensor out = tensor(ins.out);
        // The output's local sizes with the team's pieces of its sharded dim.
        int64_t b = ins.out_axis;
        std::vector<int64_t> full(out.sizes().begin(), out.sizes().end());
        full[b] *= ins.team_size;
        at::Tensor whole = src.reshape(full);
        if (!outermost(full, b)) {
          whole = whole.movedim(b, 0);
        }
        if (!ins.in_order) {
          at::Tensor index = at::tensor(ins.perm, at::TensorOptions().dtype(at::kLong)).to(src.device());
          whole = whole.reshape({ins.team_size, -1}).index_select(0, index);
        }
        // In the output's dtype: a sum of integers or bools is int64, as
        // in torch, and the backend reduces buffers of one dtype.
        whole = contiguous(whole.to(ins.dtype_out));
        auto [buf, after] = staged(out, {-1});
        at::Tensor flat = whole.reshape({-1});
        at::Tensor flags = nanFlags(whole, ins.red_op);
        c10d::ReduceScatterOptions opts;
        opts.reduceOp = reduceOp(ins.red_op);
        at::Tensor wire_out = onWire(buf);
        at::Tensor wire_in = onWire(flat);
        posted.works.push_back(group->_reduce_scatter_base(wire_out, wire_in, opts));
        posted.after = after;
        if (flags.defined()) {
          at::Tensor received = at::empty(buf.sizes(), flags.options());
          at::Tensor flat_flags = flags.reshape({-1});
          c10d::ReduceScatterOptions flag_opts;
          flag_opts.reduceOp = c10d::ReduceOp(c10d::ReduceOp::MAX);
          withNanFlags(posted, buf, received, group->_reduce_scatter_base(received, flat_flags, flag_opts));
        }
        break;
      }
      case CommType::kBroadcast: {
        c10d::BroadcastOptions opts;
        opts.rootRank = ins.root;
        const at::Tensor* outp = ins.out >= 0 ? &tensor(ins.out) : nullptr;
        if (ins.is_root) {
          const at::Tensor& src = tensor(ins.input);
          if (outp == nullptr) {
            std::vector<at::Tensor> bufs{contiguous(src)};
            posted.works.push_back(group->broadcast(bufs, opts));
            break;
          }
          at::Tensor(*outp).copy_(src.reshape(outp->sizes()));
        }
        HOSTIR_CHECK(outp != nullptr, "value ", p_.tensor_names[ins.out < 0 ? 0 : ins.out], " is not bound");
        at::Tensor out = *outp;
        auto [buf, after] = staged(out, out.sizes());
        std::vector<at::Tensor> bufs{buf};
        posted.works.push_back(group->broadcast(bufs, opts));
        posted.after = after;
        break;
      }
      case CommType::kGather: {
        at::Tensor src = ins.input >= 0
            ? contiguous(tensor(ins.input))
            // The root is outside the sender mesh: it sends a dummy piece.
            : at::empty(sizes(ins.in_shape), at::TensorOptions().dtype(ins.dtype_in).device(p_.device));
        c10d::GatherOptions opts;
        opts.rootRank = ins.root;
        std::vector<at::Tensor> inputs{src};
        if (!ins.is_root) {
          std::vector<std::vector<at::Tensor>> none;
          posted.works.push_back(group->gather(none, inputs, opts));
          break;
        }
        at::Tensor out = tensor(ins.out);
        std::vector<at::Tensor> pieces;
        for (int64_t i = 0; i < ins.team_size; ++i) {
          pieces.push_back(at::empty_like(src));
        }
        std::vector<std::vector<at::Tensor>> outputs{pieces};
        posted.works.push_back(group->gather(outputs, inputs, opts));
        auto order = ins.perm;
        int64_t a = ins.in_axis;
        posted.after = [pieces, order, a, out]() mutable {
          std::vector<at::Tensor> ordered;
          for (int64_t j : order) {
            ordered.push_back(pieces[j]);
          }
          out.copy_(at::cat(ordered, a).reshape(out.sizes()));
        };
        break;
      }
      case CommType::kScatter: {
        at::Tensor out_buf;
        std::function<void()> after;
        if (ins.out < 0) {
          // The root is outside the receiver mesh: it receives a dummy piece.
          out_buf = at::empty(sizes(ins.out_shape), at::TensorOptions().dtype(ins.dtype_out).device(p_.device));
        } else {
          at::Tensor out = tensor(ins.out);
          std::tie(out_buf, after) = staged(out, out.sizes());
        }
        c10d::ScatterOptions opts;
        opts.rootRank = ins.root;
        std::vector<at::Tensor> outputs{out_buf};
        std::vector<std::vector<at::Tensor>> inputs;
        if (ins.is_root) {
          at::Tensor whole = tensor(ins.input).reshape(sizes(ins.out_full));
          auto chunks = whole.chunk(ins.chunks, ins.out_axis);
          std::vector<at::Tensor> pieces;
          for (int64_t j : ins.perm) {
            pieces.push_back(contiguous(chunks[j]).view(out_buf.sizes()));
          }
          inputs.push_back(std::move(pieces));
        }
        posted.works.push_back(group->scatter(outputs, inputs, opts));
        posted.after = after;
        break;
      }
      case CommType::kReduce: {
        c10d::ReduceOptions opts;
        opts.rootRank = ins.root;
        opts.reduceOp = reduceOp(ins.red_op);
        at::Tensor piece;
        at::Tensor buf;
        if (!ins.is_root) {
          // Every rank posts the output's shape.
          // In the output's dtype, as the root's buffer is.
          piece = reducedInput(ins).reshape(sizes(ins.out_shape)).to(ins.dtype_out).clone(at::MemoryFormat::Contiguous);
        } else {
          at::Tensor out = tensor(ins.out);
          std::tie(buf, posted.after) = staged(out, out.sizes());
          if (ins.input >= 0) {
            buf.copy_(reducedInput(ins).reshape(out.sizes()));
          } else {
            buf.fill_(ins.identity);
          }
          piece = buf;
        }
        // The flags are read before the collective may write `piece`.
        at::Tensor flags = nanFlags(piece, ins.red_op);
        std::vector<at::Tensor> bufs{onWire(piece)};
        posted.works.push_back(group->reduce(bufs, opts));
        if (flags.defined()) {
          std::vector<at::Tensor> flag_bufs{flags};
          c10d::ReduceOptions flag_opts;
          flag_opts.rootRank = ins.root;
          flag_opts.reduceOp = c10d::ReduceOp(c10d::ReduceOp::MAX);
          withNanFlags(posted, buf, flags, group->reduce(flag_bufs, flag_opts));
        }
        break;
      }
      case CommType::kAllToAll: {
        // Team position j gets the j-th piece of the output's sharded
        // (logical) axis `out_axis` of this rank's input; the piece from
        // position j goes to the j-th place of the input's sharded axis
        // `in_axis`. The buffers are in the group's order.
        at::Tensor src = applyView(ins.in_view, tensor(ins.input));
        at::Tensor out = tensor(ins.out);
        auto chunks = src.chunk(ins.team_size, ins.out_axis);
        std::vector<at::Tensor> ordered;
        ordered.reserve(ins.perm.size());
        for (int64_t j : ins.perm) {
          ordered.push_back(chunks.at(j));
        }
        at::Tensor send = at::stack(ordered).contiguous();
        at::Tensor recv = at::empty_like(send);
        std::vector<int64_t> no_splits;
        c10d::AllToAllOptions opts;
        posted.works.push_back(group->alltoall_base(recv, send, no_splits, no_splits, opts));
        auto order = ins.recv_perm;
        int64_t a = ins.in_axis;
        posted.after = [recv, order, a, out]() mutable {
          std::vector<at::Tensor> pieces;
          pieces.reserve(order.size());
          for (int64_t j : order) {
            pieces.push_back(recv[j]);
          }
          out.copy_(at::cat(pieces, a).reshape(out.sizes()));
        };
        break;
      }
      case CommType::kSendRecv: {
        if (ins.self_copy) {
          at::Tensor out = tensor(ins.out);
          out.copy_(tensor(ins.input).reshape(out.sizes()));
          break;
        }
        if (ins.is_root) {
          std::vector<at::Tensor> bufs{contiguous(tensor(ins.input))};
          posted.works.push_back(group->send(bufs, static_cast<int>(ins.peer), 0));
          break;
        }
        at::Tensor out = tensor(ins.out);
        auto [buf, after] = staged(out, out.sizes());
        std::vector<at::Tensor> bufs{buf};
        posted.works.push_back(group->recv(bufs, static_cast<int>(ins.peer), 0));
        posted.after = after;
        break;
      }
    }
    return posted;
  }

  // gloo's sends and receives read and write host addresses only: a device
  // buffer handed to them is read as whatever the address maps to on the
  // host. The lowering refuses such programs on every rank
  // (`torch_dist.check_backends`); this guards a program built by hand.
  static void checkCarries(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& buf) {
    if (!buf.is_cuda()) {
      return;
    }
    const std::string name = group->getBackend(c10::DeviceType::CUDA)->getBackendName();
    if (name == "gloo") {
      throw Error(
          text("gloo sends and receives only host memory, but the buffer is on ", buf.device().str(),
               " and the process group carries device memory through gloo; use backend='nccl' (one GPU "
               "per rank) or the cuda transport"),
          "TransportUnsupported");
    }
  }

  void p2p(const Instr& ins) {
    int64_t peer = get(static_cast<int>(ins.peer));
    if (peer < 0 || peer >= ins.world_size) {
      throw Error(
          text("invalid peer ", peer, ": the world has ", ins.world_size, " ranks"), "BindingError");
    }
    at::Tensor buf = tensor(ins.buffer);
    if (!buf.is_contiguous()) {
      if (!ins.send) {
        throw Error(
            text("the buffer of a P2P receive must be contiguous (strides ", buf.strides(), ")"),
            "BindingError");
      }
      // A send of a view (a permute's): the backends move contiguous
      // memory, so the send goes from a compact copy, kept to the run's end.
      buf = buf.contiguous();
      kept_.push_back(buf);
    }
    std::vector<at::Tensor> bufs{buf};
    auto& group = worldGroup();
    checkCarries(group, buf);
    auto work = ins.send ? group->send(bufs, static_cast<int>(peer), 0)
                         : group->recv(bufs, static_cast<int>(peer), 0);
    Posted posted;
    if (coalescing_) {
      if (!groupCoalesces() && work) {
        coalesced_.push_back(work);
      }
    } else {
      posted.works.push_back(work);
    }
    posted_[&ins - p_.instrs.data()] = std::move(posted);
  }

  void waitFor(const Instr& ins) {
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

  const Program& p_;
  bool uses_streams_;
  bool tracing_;
  int64_t track_ = -1;  // while tracing: the stream the ops now run on
  Stamp origin_;
  std::vector<Pending> pending_;
  std::vector<TraceRecord> trace_;
  EventPool& events_;
  Staging& staging_;
  std::unique_ptr<c10::Event> event_;  // taken from events_ at the first wait
  // One per posted transfer, each recorded on the copy stream after its copy.
  std::vector<std::unique_ptr<c10::Event>> copy_events_;
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
  bool coalescing_ = false;
  std::vector<at::Tensor> kept_;  // compact copies of views being sent
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_;
};

// The binary kinds the core runs (python/hostir/kinds.py's BinaryKind
// names); the flat compiler reads them through `binaryKindNames`.
const std::pair<const char*, OpKind> kBinary[] = {
    {"add", OpKind::kAdd},
    {"sub", OpKind::kSub},
    {"mul", OpKind::kMul},
    {"div", OpKind::kDiv},
    {"relu_grad", OpKind::kReluGrad},
    {"gelu_grad", OpKind::kGeluGrad},
    {"gelu_tanh_grad", OpKind::kGeluTanhGrad},
    {"silu_grad", OpKind::kSiluGrad},
    {"tanh_grad", OpKind::kTanhGrad},
    {"sigmoid_grad", OpKind::kSigmoidGrad},
    {"abs_grad", OpKind::kAbsGrad},
    {"eq", OpKind::kEq}};

// The unary kinds the core runs (python/hostir/kinds.py's UnaryKind names);
// the flat compiler reads them through `unaryKindNames`.
const std::pair<const char*, OpKind> kUnary[] = {
    {"relu", OpKind::kRelu},
    {"neg", OpKind::kNeg},
    {"abs", OpKind::kAbs},
    {"cast", OpKind::kCast},
    {"gelu", OpKind::kGelu},
    {"gelu_tanh", OpKind::kGeluTanh},
    {"silu", OpKind::kSilu},
    {"exp", OpKind::kExp},
    {"tanh", OpKind::kTanh},
    {"sigmoid", OpKind::kSigmoid}};

OpKind opKind(const std::string& kind, Opcode op) {
  // The kinds of python/hostir/kinds.py the C++ core runs, by their names.
  static const std::pair<const char*, OpKind> kReduction[] = {
      {"sum", OpKind::kSum}, {"max", OpKind::kMax}, {"min", OpKind::kMin}};
  auto find = [&](const auto& table) -> std::optional<OpKind> {
    for (const auto& [name, k] : table) {
      if (kind == name) {
        return k;
      }
    }
    return std::nullopt;
  };
  std::optional<OpKind> found = op == Opcode::kBinary ? find(kBinary)
      : op == Opcode::kUnary                          ? find(kUnary)
                                                      : find(kReduction);
  if (found) {
    return *found;
  }
  const char* what = op == Opcode::kBinary ? "binary op" : op == Opcode::kUnary ? "unary op" : "reduction";
  throw Error(text("unknown ", what, " '", kind, "'"), "ProgramError");
}

} // namespace

std::vector<std::string> binaryKindNames() {
  std::vector<std::string> names;
  for (const auto& [name, kind] : kBinary) {
    names.emplace_back(name);
  }
  return names;
}

std::vector<std::string> unaryKindNames() {
  std::vector<std::string> names;
  for (const auto& [name, kind] : kUnary) {
    names.emplace_back(name);
  }
  return names;
}

Executor::Executor(Program program)
    : program_(std::move(program)), uses_streams_(program_.device.type() != c10::kCPU) {
  for (Instr& ins : program_.instrs) {
    if (ins.op == Opcode::kBinary || ins.op == Opcode::kReduction || ins.op == Opcode::kUnary) {
      ins.op_kind = opKind(ins.kind, ins.op);
    }
    if (ins.op == Opcode::kBinary && ins.rhs.is_number) {
      ins.rhs.wrapped = wrappedNumber(ins.rhs.number);
    }
  }
}

RunResult Executor::run(
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    int64_t number_of_streams) const {
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
    Run run(program_, uses_streams_, events_, staging_, tracing);
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

RunResult Executor::runLogical(const std::vector<at::Tensor>& inputs, int64_t number_of_streams) const {
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
  RunResult result = run(bound, {}, number_of_streams);
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
