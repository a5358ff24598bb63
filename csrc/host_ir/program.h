// The flat host program and the executor that runs it.
//
// Python compiles a lowered HostIrContainer into a Program (python/hostir/
// flat.py): instructions over numbered tensor, integer and stream slots, with
// aliases and selects resolved and scalar expressions as small trees. An
// Executor runs a Program any number of times, from any number of threads at
// once: everything a run binds lives in a Frame on that run's stack, and the
// Program is shared read-only; the stream pool and the executor's spare
// events are shared behind a mutex each.
// Nothing here includes pybind11: bindings.cpp is the only file that does.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace hostir {

class Transport;  // transports/transport.h

// The text of an error message: strings, integers and integer lists
// ([2, 3], as Python prints a shape) joined without iostreams. Not c10::str:
// built by the GPU machine's compiler (CXX=/opt/gcc/bin/g++), code in this
// extension that streams an integer into a std::ostringstream crashes the
// process (tools/check_cpp_exceptions.py shows it), so no message here
// goes through one.
namespace text_detail {
inline void append(std::string& out, const std::string& s) {
  out += s;
}
inline void append(std::string& out, const char* s) {
  out += s;
}
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
void append(std::string& out, T value) {
  out += std::to_string(value);
}
inline void append(std::string& out, c10::IntArrayRef values) {
  out += '[';
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) {
      out += ", ";
    }
    out += std::to_string(values[i]);
  }
  out += ']';
}
} // namespace text_detail

template <typename... Args>
std::string text(const Args&... args) {
  std::string out;
  (text_detail::append(out, args), ...);
  return out;
}

// Throws hostir::Error with the message when `cond` is false.
#define HOSTIR_CHECK(cond, ...)                                       \
  do {                                                                \
    if (!(cond)) {                                                    \
      throw ::hostir::Error(::hostir::text(__VA_ARGS__), "RuntimeError"); \
    }                                                                 \
  } while (0)

// An error of the executor; `kind` is the Python exception class name it
// stands for (ValueError, RuntimeError, ...).
class Error : public std::runtime_error {
 public:
  Error(const std::string& message, std::string kind)
      : std::runtime_error(message), kind_(std::move(kind)) {}
  const std::string& kind() const {
    return kind_;
  }

 private:
  std::string kind_;
};

// Shared with python/hostir/flat.py (OPCODES).
enum class Opcode : int {
  kFor,
  kGetStream,
  kSetStream,
  kSynchronize,
  kSelect,
  kAllocate,
  kDeallocate,
  kSet,
  kBinary,
  kReduction,
  kMatmul,
  kLinear,
  kCommunication,
  kP2P,
  kStartCoalescing,
  kEndCoalescing,
  kWait,
  kIf,
  kUnary,
  kPermute,
  kTransfer,
  kChunk,
  kTopK,
  kRoute,
  kTake,
  kPutAdd,
  kGroupedMm,
  kGroupedOuter,
  kSlice,
  kCat,
  kInsert,
};

// Shared with ir.CommunicationType (in declaration order).
enum class CommType : int {
  kAllgather,
  kAllreduce,
  kReduceScatter,
  kBroadcast,
  kGather,
  kScatter,
  kReduce,
  kSendRecv,
  kAllToAll,
};

// A node of a scalar expression: a constant, an integer slot, or an
// operation on two other nodes.
struct ScalarNode {
  enum Kind { kConst, kSlot, kAdd, kSub, kMul, kDiv, kMod, kEq, kNe, kLt, kLe, kGt, kGe, kAnd, kOr, kCeilDiv } kind = kConst;
  int64_t value = 0;  // kConst: the value; kSlot: the slot
  int lhs = -1;
  int rhs = -1;
};

// An operand of a binary op: a tensor slot, a number, or a scalar node.
struct Operand {
  int tensor = -1;
  int scalar = -1;
  bool is_number = false;
  at::Scalar number;
  // Made by the Executor from `number` once, not per run: the 0-d CPU
  // "wrapped number" tensor torch passes for a number on the right of an op.
  at::Tensor wrapped;
};

// What a binary, unary or reduction op computes; the Executor reads
// `kind`'s text once and runs on this.
enum class OpKind : int {
  kAdd,
  kSub,
  kMul,
  kDiv,
  kSum,
  kMax,
  kMin,
  kRelu,
  kNeg,
  kAbs,
  kCast,
  kGelu,
  kGeluTanh,
  kSilu,
  kExp,
  kTanh,
  kSigmoid,
  // The derivative kinds of BinaryKind: torch's backward kernels,
  // kind(grad, saved), and eq's 0/1 mask.
  kReluGrad,
  kGeluGrad,
  kGeluTanhGrad,
  kSiluGrad,
  kTanhGrad,
  kSigmoidGrad,
  kAbsGrad,
  kEq,
};

// This rank's slice of a replicated operand axis where the op's output is
// sharded: dim `pos` viewed as `sizes` (-1: the rest of the dim), each
// (dim, index) pair of `narrows` cut to one index, then merged back.
struct Cut {
  int64_t pos = 0;
  std::vector<int64_t> sizes;
  std::vector<int64_t> narrows;  // dim offset from pos, index, ...
};

// How an op reads a tensor operand (python/hostir/runtime/evaluator.py's
// `_operand`): the runtime dims each logical axis merges (empty: the
// runtime shape is the logical one), then the cuts.
struct View {
  std::vector<std::vector<int64_t>> logical;
  std::vector<Cut> cuts;
};

// How an op puts its result into its output (the evaluator's `_store`):
// `runtime` gives each runtime dim of a fresh result as a logical axis
// (-1: a mesh_x piece of size 1; empty: the logical shape is the runtime
// one), `logical` views a bound output with its logical axes; `partial`
// adds (or drops) the leading axis of partial sums; `slice` says the
// output is a slice a stream loop selected.
struct Store {
  bool partial = false;
  bool slice = false;
  std::vector<int64_t> runtime;
  std::vector<std::vector<int64_t>> logical;
};

// How one axis of a bound tensor binds or checks its extent.
struct ExtentRule {
  int extent = -1;  // scalar node; -1: nothing to bind or check
  std::string text;  // the extent as the dump prints it
  int64_t mesh_size = 0;  // > 0: a mesh_x axis (size 1 here, extent mesh_size)
  std::string axis_text;
  int bind_slot = -1;
  int64_t factor = 1;
  int64_t scale = 1;  // the dim's size times this is its logical axis's extent
  std::string error;  // non-empty: the extent cannot be inferred from a size
};

struct Instr {
  Opcode op = Opcode::kFor;
  // Tensor slots (-1: none).
  int out = -1;
  int input = -1;
  int a = -1;
  int b = -1;
  int bias = -1;
  int buffer = -1;
  int out_dim = -1;
  int a_dim = -1;
  int b_dim = -1;
  int bias_dim = -1;
  // PutAdd's `like`, whose sizes its result takes, and the dim a select
  // removed from it.
  int like = -1;
  int like_dim = -1;
  // The grouped ops' `counts` (int64 [*batch, G], the rows of each group),
  // and the dim a select removed from it.
  int counts = -1;
  int counts_dim = -1;
  // Matmul and linear: add the product to the bound output (beta = 1).
  bool accumulate = false;
  // A sum of a product made fresh in the program (fusion_ops.py's
  // `sums_that_view`): over axes of extent 1 it binds the input's view.
  bool view_sum = false;
  // Matmul: the product's batch dims a sum over them alone reads; the
  // instruction then makes that sum (`out` is the sum's, `dtype` its dtype),
  // never the product (fusion_ops.py's `summed_products`).
  std::vector<int64_t> sum_dims;
  // Loops: index slot, start/stop nodes, end of body, slots to unbind.
  int index = -1;
  int start = -1;
  int stop = -1;
  int end = -1;
  // Conditionals: the predicate's node; the then-branch is [this + 1, end),
  // the else-branch [end, else_end).
  int cond = -1;
  int else_end = -1;
  std::vector<int> locals;
  // Streams: a stream slot (GetCurrentStream) or a pool key.
  int stream_slot = -1;
  int stream_index = -1;  // scalar node of an indexed stream
  int64_t stream_key = 0;
  // Select and chunk: the dim cut; a chunk's count of pieces (a scalar
  // node) and whether they must be equal (HirAliasChunk) or are a split
  // axis's ceilDiv-sized chunks (HirAliasSelect of its outer piece).
  int dim = 0;
  int parts = -1;
  bool equal = false;
  // Allocate; `symmetric`: a window of the copy-engine transport.
  std::vector<int> shape;
  bool symmetric = false;
  at::ScalarType dtype = at::kFloat;
  bool zero_init = false;
  // Binary and reductions: "add", "sub", "mul", "div" or "sum", "max",
  // "min"; `op_kind` is filled from it by the Executor.
  std::string kind;
  OpKind op_kind = OpKind::kAdd;
  Operand lhs, rhs;
  std::vector<int64_t> dims;
  // The index ops (compute.cpp): topk's `k`; route's `experts`,
  // `capacity` (slots per expert, or per group when `packed`), `groups`,
  // `packed` (a group's pairs fill its rows expert after expert, with no
  // gap) and what it gives ("slot": each pair's slot, "source": each
  // slot's token, "counts": the pairs each expert keeps); take's and
  // put_add's leading `batch` and trailing `features` axes, and put_add's
  // `distinct` (its index names each row at most once). Their operands:
  // `input`, take's and put_add's index `b`, put_add's `like`, each at full
  // rank (`a_dim`, `b_dim`, `like_dim`). The grouped ops (grouped_mm,
  // grouped_outer): the rows `input`, the weight (grouped_mm) or the other
  // rows (grouped_outer) `b`, the `counts`, each at full rank (`a_dim`,
  // `b_dim`, `counts_dim`); grouped_outer's `wbatch`, the batch axes its
  // output keeps (the trailing ones); `grouped_kernel`: the program's
  // device has torch's grouped GEMM kernel (CUDA, compute capability 9.0 or
  // more: bindings.cpp asks torch when it builds the program).
  int64_t k = 0;
  int64_t experts = 0;
  int64_t capacity = 0;
  int64_t groups = 1;
  bool packed = false;
  bool distinct = false;
  std::string what;
  int64_t batch = 0;
  int64_t features = 0;
  int64_t wbatch = 0;
  bool grouped_kernel = false;
  // The shape ops (compute.cpp): slice's and insert's `ranges`, a (start,
  // stop, step) per axis (stop -1: to the end), or insert's select (`dim`
  // and the scalar node `index`, with no ranges); cat's two operands
  // `input` and `b` joined along `dim`. Operands at full rank (`a_dim`,
  // `b_dim`, insert's `like` and `like_dim`).
  std::vector<int64_t> ranges;
  // Layouts: one view per tensor operand in the op's operand order (none:
  // every operand is read as it is bound), and the output's store.
  std::vector<View> views;
  Store store;
  // Communications, P2P and coalescing: the backend that carries them
  // (NCCL, gloo; empty for a coalescing group with no member), and its
  // transport, chosen once by the Executor.
  std::string backend;
  const Transport* transport = nullptr;
  CommType comm_type = CommType::kAllgather;
  int group = -1;
  int64_t team_size = 0;
  bool is_root = false;
  int64_t root = -1;  // group rank
  std::string red_op;
  std::vector<int64_t> local_reduce;
  std::vector<int> in_shape, out_shape, in_full, out_full;
  at::ScalarType dtype_in = at::kFloat;
  at::ScalarType dtype_out = at::kFloat;
  int64_t in_axis = -1;
  int64_t out_axis = -1;
  bool in_order = true;
  std::vector<int64_t> perm;
  // AllToAll: the group rank each team position's piece comes from, and
  // the input's logical view.
  std::vector<int64_t> recv_perm;
  View in_view;
  // An AllToAll sized at run time (`ir.Set`'s `rows`): the counts of the
  // rows this rank sends each team position (`rows`) and receives from it
  // (`rows_in`), int64 tensor slots (-1: an AllToAll of whole pieces),
  // each read through its logical view; the output's logical view; this
  // rank's team position (`me`); the counts' dump text, for errors.
  int rows = -1;
  int rows_in = -1;
  View rows_view;
  View rows_in_view;
  View out_view;
  int64_t me = -1;
  std::string rows_text;
  std::string rows_in_text;
  int64_t chunks = 0;
  double identity = 0.0;
  int64_t peer = -1;  // group rank (SendRecv), else a scalar node (P2P)
  bool self_copy = false;
  // A communication over a team of one whose output is bound to a view of
  // its input (the program allocates it for this communication alone).
  bool view_out = false;
  bool out_may_be_given = false;  // ... unless it is a program output the caller gave
  bool send = false;
  int into = -1;  // P2P send: its place in the peer's window (a tensor slot)
  bool h2d = false;  // Transfer: host to device (else device to host)
  // Transfer: posted on the copy stream of its direction and completed by
  // its Wait (else a copy on the current stream).
  bool copy_stream = false;
  int64_t world_size = 0;
  int posted = -1;  // Wait: the posting instruction
  std::string text;  // Wait: the dump line of what it waits for
};

struct Program {
  std::vector<Instr> instrs;
  std::vector<ScalarNode> scalars;
  int num_tensors = 0;
  int num_ints = 0;
  int num_streams = 0;
  std::vector<int> inputs;
  std::vector<int> outputs;  // -1: this rank does not hold the output
  std::vector<std::pair<int, std::vector<ExtentRule>>> extent_rules;
  std::vector<std::string> tensor_names;
  std::vector<std::string> int_names;
  int number_of_streams = -1;  // int slot
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups;
  int world_group = -1;
  c10::Device device = c10::Device(c10::kCPU);
  std::vector<int> symmetric_allocs;  // the instructions of symmetric Allocates (the Executor's)
};

// Where a run failed: the instruction (-1: before any, binding the caller's
// values), the loop indices around it (outer first, as (index slot, value)),
// the Python class name and the message. Every error of a run comes back as
// one: no exception leaves Executor::run.
struct Failure {
  int instr = -1;
  std::vector<std::pair<int, int64_t>> loops;
  std::string kind;
  std::string message;
};

// One instruction of a traced run (`Executor::setTracing`): its index, the
// stream it ran on (-1: the caller's; else the index its SetCurrentStream
// named), for a Wait the instruction it completes (else -1), and when it
// ran, in µs from the run's start: device times on a GPU (events on the
// current stream around the op), host times (steady clock) elsewhere; for
// a collective, the sizes of its input and output (empty: not bound), which
// the `communication` dump prints.
struct TraceRecord {
  int instr = -1;
  int64_t track = -1;
  int posted = -1;
  double start_us = 0;
  double end_us = 0;
  std::vector<int64_t> input_sizes;
  std::vector<int64_t> output_sizes;
};

struct RunResult {
  std::vector<at::Tensor> outputs;  // undefined: not held by this rank
  std::optional<Failure> failure;
};

// One stream per key and device, created on first use from the device's
// pool; shared by every program and run in the process.
class StreamPool {
 public:
  c10::Stream get(c10::Device device, int64_t key);
  size_t size();

 private:
  std::mutex mutex_;
  std::map<std::tuple<int, int, int64_t>, c10::Stream> streams_;
};

// Events a run records on one stream for another to wait on, kept by the
// Executor across runs: creating and destroying a CUDA event costs more
// than recording it. An event may be recorded again as soon as a stream
// was made to wait on it (the wait takes the event's state at that call).
class EventPool {
 public:
  std::unique_ptr<c10::Event> take(c10::DeviceType type);
  void give(std::unique_ptr<c10::Event> event);

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<c10::Event>> events_;
};

// The pinned staging of a pageable host tensor that a posted host-to-device
// transfer reads: the copy engine reads host memory asynchronously only from
// pinned memory. Kept per transfer instruction across runs, and refreshed only
// when the transfer reads another tensor or one written since (its version
// counter moved). `source` is held, so that its memory cannot be reused by
// another tensor while the entry says it was copied; `read` completes the
// latest copy that read `buffer`, which a refresh waits for.
struct Staged {
  at::Tensor source;
  at::Tensor buffer;
  int64_t version = -1;
  std::shared_ptr<c10::Event> read;
};

struct Staging {
  std::mutex mutex;
  std::map<int64_t, Staged> entries;
};

// One window of the copy-engine transport (transports/cuda.cpp): an
// allocation every rank maps, made and exchanged once by Python
// (python/hostir/runtime/transports/cuda.py) and handed over as addresses:
// per rank the first byte of its copy and of its uint32 flags, flag
// [channel * world + src] on rank r being where rank src signals r.
struct Window {
  int64_t nbytes = 0;
  std::vector<uint64_t> bases;
  std::vector<uint64_t> flags;
  int64_t flag_bytes = 0;
  int rank = -1;
};

// The windows of one program, per (symmetric Allocate, call parity,
// bytes), and its calls so far (a run's parity is its number's, as the
// Python evaluator's frame.call_parity).
struct Windows {
  std::mutex mutex;
  std::map<std::tuple<int, int, int64_t>, Window> entries;
  std::atomic<int64_t> calls{0};
};

class Executor {
 public:
  // Checks and prepares `program` once (operation kinds from their text,
  // the tensors of constant numbers, each communication's transport from
  // its backend), so that a run builds no string and no tensor that does
  // not depend on its inputs, and looks no transport up.
  explicit Executor(Program program);

  // Binds `inputs` (and `outputs` to write into, if not empty), runs the
  // program and returns one tensor per program output, or the failure (a
  // bad binding is a failure at instruction -1; nothing throws). The
  // caller's current stream is current again at the end and has waited for
  // every stream the run used.
  RunResult run(
      const std::vector<at::Tensor>& inputs,
      const std::vector<at::Tensor>& outputs,
      int64_t number_of_streams,
      const std::function<bool()>& gate = {}) const;

  // The views between a caller's tensors, with the fusion's logical axes,
  // and the program's runtime axes, where they differ (an empty plan: they
  // do not). Per input, for each runtime dim, the logical axis it takes its
  // size from, or -1 for a device piece (size 1 on a rank); per output, for
  // each logical axis, the runtime dims it is made of.
  void setViews(std::vector<std::vector<int64_t>> inputs, std::vector<std::vector<std::vector<int64_t>>> outputs);

  // `run` on the caller's logical tensors, with no outputs to write into:
  // the inputs viewed with runtime axes first and the results with logical
  // axes after, as `hostir.runtime.bind.Binding` does.
  // `gate`: asked once, right before the run's first communication (see
  // Run::setGate).
  RunResult runLogical(
      const std::vector<at::Tensor>& inputs,
      int64_t number_of_streams,
      const std::function<bool()>& gate = {}) const;

  const Program& program() const {
    return program_;
  }
  int64_t opsExecuted() const {
    return ops_executed_.load(std::memory_order_relaxed);
  }

  // With tracing on, every run records when each instruction ran; the
  // records wait, one list per run, for `takeTrace`. A run on a GPU then
  // synchronizes its events at its end.
  void setTracing(bool on) {
    tracing_.store(on, std::memory_order_relaxed);
  }
  std::vector<std::vector<TraceRecord>> takeTrace() const;

  // Registers the window of symmetric Allocate `instr` for calls of
  // `parity` (ProgramError if `instr` is no symmetric Allocate).
  void setWindow(int instr, int parity, Window window);

 private:
  Program program_;
  bool uses_streams_;
  std::vector<std::vector<int64_t>> input_views_;
  std::vector<std::vector<std::vector<int64_t>>> output_views_;
  mutable std::atomic<int64_t> ops_executed_{0};
  std::atomic<bool> tracing_{false};
  mutable std::mutex trace_mutex_;
  mutable std::vector<std::vector<TraceRecord>> traces_;
  mutable EventPool events_;
  mutable Staging staging_;
  mutable Windows windows_;
};

// The process-wide pool of worker streams.
StreamPool& streamPool();

// The names of the unary and binary kinds the executor runs.
std::vector<std::string> unaryKindNames();
std::vector<std::string> binaryKindNames();

// The backends the executor has a transport for (transports/transport.h).
std::vector<std::string> transportNames();

} // namespace hostir
