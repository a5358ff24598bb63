// hostir._C: the Python face of the C++ executor. Builds a Program from the
// FlatProgram that python/hostir/flat.py compiled, and runs it with the GIL
// released. The only file that includes pybind11.
#include "program.h"

#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <algorithm>

namespace py = pybind11;

namespace hostir {
namespace {

// The order of ir.SUPPORTED_DTYPES.
const at::ScalarType kDtypes[] = {
    at::kFloat,
    at::kDouble,
    at::kHalf,
    at::kBFloat16,
    at::kLong,
    at::kInt,
    at::kShort,
    at::kChar,
    at::kByte,
    at::kBool,
};

template <typename T>
T field(const py::dict& d, const char* name, T fallback) {
  if (!d.contains(name)) {
    return fallback;
  }
  return d[name].cast<T>();
}

ScalarNode scalarNode(const py::tuple& t) {
  ScalarNode n;
  auto kind = t[0].cast<std::string>();
  if (kind == "const") {
    n.kind = ScalarNode::kConst;
    n.value = t[1].cast<int64_t>();
    return n;
  }
  if (kind == "slot") {
    n.kind = ScalarNode::kSlot;
    n.value = t[1].cast<int64_t>();
    return n;
  }
  n.lhs = t[1].cast<int>();
  n.rhs = t[2].cast<int>();
  n.kind = kind == "+" ? ScalarNode::kAdd
      : kind == "-"    ? ScalarNode::kSub
      : kind == "*"    ? ScalarNode::kMul
      : kind == "/"    ? ScalarNode::kDiv
      : kind == "=="   ? ScalarNode::kEq
      : kind == "!="   ? ScalarNode::kNe
      : kind == "<"    ? ScalarNode::kLt
      : kind == "<="   ? ScalarNode::kLe
      : kind == ">"    ? ScalarNode::kGt
      : kind == ">="   ? ScalarNode::kGe
      : kind == "&&"   ? ScalarNode::kAnd
      : kind == "||"   ? ScalarNode::kOr
      : kind == "ceilDiv" ? ScalarNode::kCeilDiv
      : kind == "%"    ? ScalarNode::kMod
                       : throw Error("unknown scalar operation '" + kind + "'", "ProgramError");
  return n;
}

Operand operand(const py::dict& d) {
  Operand o;
  if (d.contains("tensor")) {
    o.tensor = d["tensor"].cast<int>();
  } else if (d.contains("scalar")) {
    o.scalar = d["scalar"].cast<int>();
  } else {
    o.is_number = true;
    auto kind = d["kind"].cast<std::string>();
    double v = d["number"].cast<double>();
    o.number = kind == "bool" ? at::Scalar(v != 0.0)
        : kind == "int"       ? at::Scalar(static_cast<int64_t>(v))
                              : at::Scalar(v);
  }
  return o;
}

View view(const py::dict& d) {
  View v;
  v.logical = field(d, "logical", std::vector<std::vector<int64_t>>{});
  if (d.contains("cuts")) {
    for (auto c : d["cuts"].cast<py::list>()) {
      auto cd = c.cast<py::dict>();
      Cut cut;
      cut.pos = cd["pos"].cast<int64_t>();
      cut.sizes = cd["sizes"].cast<std::vector<int64_t>>();
      cut.narrows = cd["narrows"].cast<std::vector<int64_t>>();
      v.cuts.push_back(std::move(cut));
    }
  }
  return v;
}

Store store(const py::dict& d) {
  Store s;
  s.partial = d["partial"].cast<bool>();
  s.slice = d["slice"].cast<bool>();
  s.runtime = d["runtime"].cast<std::vector<int64_t>>();
  s.logical = d["logical"].cast<std::vector<std::vector<int64_t>>>();
  return s;
}

Instr instr(int opcode, const py::dict& f) {
  Instr i;
  i.op = static_cast<Opcode>(opcode);
  i.out = field(f, "out", -1);
  i.input = field(f, "input", -1);
  i.a = field(f, "a", -1);
  i.b = field(f, "b", -1);
  i.bias = field(f, "bias", -1);
  i.buffer = field(f, "buffer", -1);
  i.out_dim = field(f, "out_dim", -1);
  i.a_dim = field(f, "a_dim", -1);
  i.b_dim = field(f, "b_dim", -1);
  i.bias_dim = field(f, "bias_dim", -1);
  i.like = field(f, "like", -1);
  i.like_dim = field(f, "like_dim", -1);
  i.start = field(f, "start", -1);
  i.stop = field(f, "stop", -1);
  i.end = field(f, "end", -1);
  i.cond = field(f, "cond", -1);
  i.else_end = field(f, "else_end", -1);
  i.locals = field(f, "locals", std::vector<int>{});
  i.stream_index = field(f, "stream_index", -1);
  i.stream_key = field<int64_t>(f, "stream_key", 0);
  i.dim = field(f, "dim", 0);
  i.shape = field(f, "shape", std::vector<int>{});
  i.zero_init = field(f, "zero_init", false);
  i.symmetric = field(f, "symmetric", false);
  i.accumulate = field(f, "accumulate", false);
  i.view_sum = field(f, "view_sum", false);
  i.sum_dims = field(f, "sum_dims", std::vector<int64_t>{});
  i.parts = field(f, "parts", -1);
  i.equal = field(f, "equal", false);
  i.kind = field(f, "kind", std::string());
  i.dims = field(f, "dims", std::vector<int64_t>{});
  if (f.contains("dtype")) {
    i.dtype = kDtypes[f["dtype"].cast<int>()];
  }
  if (f.contains("lhs")) {
    i.lhs = operand(f["lhs"].cast<py::dict>());
    i.rhs = operand(f["rhs"].cast<py::dict>());
  }
  if (f.contains("views")) {
    for (auto v : f["views"].cast<py::list>()) {
      i.views.push_back(view(v.cast<py::dict>()));
    }
  }
  if (f.contains("store")) {
    i.store = store(f["store"].cast<py::dict>());
  }
  // A loop's index and a select's index are both "index": a loop's is an
  // int slot, a select's a scalar node.
  i.index = field(f, "index", -1);
  // GetCurrentStream names its slot "slot".
  i.stream_slot = field(f, "stream_slot", field(f, "slot", -1));
  // Communications, P2P and coalescing name the backend that carries them.
  i.backend = field(f, "backend", std::string());
  if (i.op == Opcode::kCommunication) {
    i.comm_type = static_cast<CommType>(f["type"].cast<int>());
    i.group = f["group"].cast<int>();
    i.team_size = f["team_size"].cast<int64_t>();
    i.is_root = f["is_root"].cast<bool>();
    i.root = f["root"].cast<int64_t>();
    i.red_op = f["red_op"].cast<std::string>();
    i.local_reduce = f["local_reduce"].cast<std::vector<int64_t>>();
    i.in_shape = f["in_shape"].cast<std::vector<int>>();
    i.out_shape = f["out_shape"].cast<std::vector<int>>();
    i.in_full = f["in_full"].cast<std::vector<int>>();
    i.out_full = f["out_full"].cast<std::vector<int>>();
    i.dtype_in = kDtypes[f["dtype_in"].cast<int>()];
    i.dtype_out = kDtypes[f["dtype_out"].cast<int>()];
    i.in_axis = f["in_axis"].cast<int64_t>();
    i.out_axis = f["out_axis"].cast<int64_t>();
    i.in_order = f["in_order"].cast<bool>();
    i.perm = f["perm"].cast<std::vector<int64_t>>();
    i.recv_perm = field(f, "recv_perm", std::vector<int64_t>{});
    if (f.contains("in_view")) {
      i.in_view = view(f["in_view"].cast<py::dict>());
    }
    if (f.contains("rows")) {
      i.rows = f["rows"].cast<int>();
      i.rows_in = f["rows_in"].cast<int>();
      i.rows_view = view(f["rows_view"].cast<py::dict>());
      i.rows_in_view = view(f["rows_in_view"].cast<py::dict>());
      i.out_view = view(f["out_view"].cast<py::dict>());
      i.me = f["me"].cast<int64_t>();
      i.rows_text = f["rows_text"].cast<std::string>();
      i.rows_in_text = f["rows_in_text"].cast<std::string>();
    }
    i.chunks = field<int64_t>(f, "chunks", 0);
    i.identity = f["identity"].cast<double>();
    i.peer = f["peer"].cast<int64_t>();
    i.self_copy = f["self_copy"].cast<bool>();
    i.view_out = field<bool>(f, "view_out", false);
    i.out_may_be_given = field<bool>(f, "out_may_be_given", false);
  }
  if (i.op == Opcode::kTopK) {
    i.k = f["k"].cast<int64_t>();
  }
  if (i.op == Opcode::kRoute) {
    i.experts = f["experts"].cast<int64_t>();
    i.capacity = f["capacity"].cast<int64_t>();
    i.what = f["what"].cast<std::string>();
    i.groups = f["groups"].cast<int64_t>();
    i.packed = field<bool>(f, "packed", false);
  }
  if (i.op == Opcode::kGroupedMm || i.op == Opcode::kGroupedOuter) {
    i.counts = f["counts"].cast<int>();
    i.counts_dim = field(f, "counts_dim", -1);
    i.wbatch = field<int64_t>(f, "wbatch", 0);
  }
  if (i.op == Opcode::kTake || i.op == Opcode::kPutAdd) {
    i.batch = f["batch"].cast<int64_t>();
    i.features = f["features"].cast<int64_t>();
    i.distinct = field<bool>(f, "distinct", false);
  }
  if (i.op == Opcode::kSlice || i.op == Opcode::kInsert) {
    i.ranges = field(f, "ranges", std::vector<int64_t>{});
  }
  if (i.op == Opcode::kTransfer) {
    i.h2d = f["h2d"].cast<bool>();
    i.copy_stream = field<bool>(f, "copy_stream", false);
  }
  if (i.op == Opcode::kP2P) {
    i.send = f["send"].cast<bool>();
    i.peer = f["peer"].cast<int64_t>();
    i.world_size = f["world_size"].cast<int64_t>();
    i.into = field(f, "into", -1);
  }
  i.posted = field(f, "posted", -1);
  i.text = field(f, "text", std::string());
  return i;
}

// A Program from a hostir.flat.FlatProgram, to run on `device`.
Program program(const py::object& flat, const std::string& device, const std::vector<int>& opcodes) {
  Program p;
  p.device = c10::Device(device);
  auto instrs = flat.attr("instrs").cast<py::list>();
  for (size_t k = 0; k < instrs.size(); ++k) {
    p.instrs.push_back(instr(opcodes[k], instrs[k].attr("fields").cast<py::dict>()));
  }
  // The grouped ops take torch's grouped GEMM kernel on a CUDA device of
  // compute capability 9.0 or more (fusion_ops.py's `_kernel_fits`).
  bool grouped = std::any_of(p.instrs.begin(), p.instrs.end(), [](const Instr& i) {
    return i.op == Opcode::kGroupedMm || i.op == Opcode::kGroupedOuter;
  });
  if (grouped && p.device.is_cuda()) {
    auto capability = py::module_::import("torch.cuda").attr("get_device_capability")(device).cast<py::tuple>();
    bool kernel = capability[0].cast<int>() >= 9;
    for (Instr& i : p.instrs) {
      i.grouped_kernel = kernel;
    }
  }
  for (auto node : flat.attr("scalars").cast<py::list>()) {
    p.scalars.push_back(scalarNode(node.cast<py::tuple>()));
  }
  p.num_tensors = flat.attr("num_tensors").cast<int>();
  p.num_ints = flat.attr("num_ints").cast<int>();
  p.num_streams = flat.attr("num_streams").cast<int>();
  p.inputs = flat.attr("inputs").cast<std::vector<int>>();
  p.outputs = flat.attr("outputs").cast<std::vector<int>>();
  for (auto item : flat.attr("extent_rules").cast<py::dict>()) {
    std::vector<ExtentRule> rules;
    for (auto r : item.second.cast<py::list>()) {
      auto d = r.cast<py::dict>();
      ExtentRule rule;
      rule.extent = d["extent"].cast<int>();
      rule.text = d["text"].cast<std::string>();
      rule.mesh_size = d["mesh_size"].cast<int64_t>();
      rule.axis_text = d["axis_text"].cast<std::string>();
      rule.bind_slot = d["bind_slot"].cast<int>();
      rule.factor = d["factor"].cast<int64_t>();
      rule.scale = d.contains("scale") ? d["scale"].cast<int64_t>() : 1;
      rule.error = d["error"].cast<std::string>();
      rules.push_back(std::move(rule));
    }
    p.extent_rules.emplace_back(item.first.cast<int>(), std::move(rules));
  }
  p.tensor_names = flat.attr("tensor_names").cast<std::vector<std::string>>();
  p.int_names = flat.attr("int_names").cast<std::vector<std::string>>();
  p.number_of_streams = flat.attr("number_of_streams").cast<int>();
  for (auto g : flat.attr("groups").cast<py::list>()) {
    p.groups.push_back(g.cast<c10::intrusive_ptr<c10d::ProcessGroup>>());
  }
  p.world_group = flat.attr("world_group").cast<int>();
  return p;
}

// The (values, failure) pair Python gets back from a run.
py::object returned(const RunResult& result) {
  py::list values;
  for (const auto& t : result.outputs) {
    if (t.defined()) {
      values.append(py::cast(t));
    } else {
      values.append(py::none());
    }
  }
  if (!result.failure) {
    return py::make_tuple(values, py::none());
  }
  const Failure& f = *result.failure;
  py::list loops;
  for (const auto& [slot, value] : f.loops) {
    loops.append(py::make_tuple(slot, value));
  }
  return py::make_tuple(values, py::make_tuple(f.instr, loops, f.kind, f.message));
}

py::object runExecutor(
    const Executor& executor,
    const std::vector<at::Tensor>& inputs,
    const std::vector<std::optional<at::Tensor>>& outputs,
    int64_t number_of_streams) {
  std::vector<at::Tensor> outs;
  outs.reserve(outputs.size());
  for (const auto& o : outputs) {
    outs.push_back(o ? *o : at::Tensor());
  }
  // Executor::run never throws: every error, a bad binding included, comes
  // back in the result, and Python raises it (python/hostir/cpp.py).
  RunResult result;
  {
    py::gil_scoped_release release;
    result = executor.run(inputs, outs, number_of_streams);
  }
  return returned(result);
}

// `gate` (a Python callable returning a bool, or None): asked with the GIL
// held, once, before the run's first communication. The caller keeps it
// alive for the call (a borrowed handle: nothing here owns a reference that
// would be dropped without the GIL); an exception it raises reads as false.
py::object runLogical(
    const Executor& executor,
    const std::vector<at::Tensor>& inputs,
    int64_t number_of_streams,
    const py::object& gate) {
  std::function<bool()> ask;
  if (!gate.is_none()) {
    py::handle callable = gate;
    ask = [callable]() {
      py::gil_scoped_acquire acquire;
      try {
        return callable().cast<bool>();
      } catch (py::error_already_set& e) {
        return false;
      }
    };
  }
  RunResult result;
  {
    py::gil_scoped_release release;
    result = executor.runLogical(inputs, number_of_streams, ask);
  }
  return returned(result);
}

} // namespace
} // namespace hostir

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The C++ executor of flat host programs (see python/hostir/flat.py).";
  py::class_<hostir::Executor>(m, "Executor")
      .def(
          py::init([](const py::object& flat, const std::string& device, const std::vector<int>& opcodes) {
            return std::make_unique<hostir::Executor>(hostir::program(flat, device, opcodes));
          }),
          py::arg("flat"),
          py::arg("device"),
          py::arg("opcodes"))
      .def("run", &hostir::runExecutor, py::arg("inputs"), py::arg("outputs"), py::arg("number_of_streams"))
      .def(
          "run_logical",
          &hostir::runLogical,
          py::arg("inputs"),
          py::arg("number_of_streams"),
          py::arg("gate") = py::none())
      .def("set_views", &hostir::Executor::setViews, py::arg("inputs"), py::arg("outputs"))
      .def(
          "set_window",
          [](hostir::Executor& executor, int instr, int parity, int64_t nbytes, std::vector<uint64_t> bases,
             std::vector<uint64_t> flags, int64_t flag_bytes, int rank) {
            executor.setWindow(
                instr, parity, hostir::Window{nbytes, std::move(bases), std::move(flags), flag_bytes, rank});
          },
          py::arg("instr"),
          py::arg("parity"),
          py::arg("nbytes"),
          py::arg("bases"),
          py::arg("flags"),
          py::arg("flag_bytes"),
          py::arg("rank"))
      .def("set_tracing", &hostir::Executor::setTracing, py::arg("on"))
      .def(
          "take_trace",
          [](const hostir::Executor& executor) {
            // One list per run: (instr, track, posted, start_us, end_us,
            // input sizes, output sizes).
            py::list runs;
            for (const auto& records : executor.takeTrace()) {
              py::list run;
              for (const auto& r : records) {
                run.append(py::make_tuple(
                    r.instr, r.track, r.posted, r.start_us, r.end_us, py::cast(r.input_sizes),
                    py::cast(r.output_sizes)));
              }
              runs.append(run);
            }
            return runs;
          })
      .def_property_readonly("ops_executed", &hostir::Executor::opsExecuted);
  m.attr("OPCODE_COUNT") = static_cast<int>(hostir::Opcode::kInsert) + 1;
  m.attr("UNARY_KINDS") = py::tuple(py::cast(hostir::unaryKindNames()));
  m.attr("BINARY_KINDS") = py::tuple(py::cast(hostir::binaryKindNames()));
  m.attr("TRANSPORTS") = py::tuple(py::cast(hostir::transportNames()));
  m.def(
      "stream_pool_size",
      []() { return hostir::streamPool().size(); },
      "How many worker streams the process-wide pool holds (all devices).");
}
