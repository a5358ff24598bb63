// GoogleTest tests of the C++ executor on programs built by hand, without
// Python: loops, conditionals and scalar expressions (scalar inputs among
// them), selects into preallocated buffers,
// the out= variants, every unary kind, operand views and partial sums,
// extent binding, failures with loop indices, the index ops (take,
// put_add, route: per expert or packed, slots, sources or counts), the
// grouped ops (grouped_mm, grouped_outer), runs on a caller's logical
// tensors (runLogical), two threads running one Executor at once, and the
// transport registry (a backend chosen once, an unknown one refused, one
// registered twice or with no transport refused), and the checks of an
// AllToAll's counts sized at run time.
#include "../../csrc/host_ir/program.h"
#include "../../csrc/host_ir/transports/transport.h"

#include <gtest/gtest.h>

#include <thread>

namespace hostir {
namespace {

int addNode(Program& p, ScalarNode n) {
  p.scalars.push_back(n);
  return static_cast<int>(p.scalars.size()) - 1;
}

int constNode(Program& p, int64_t v) {
  ScalarNode n;
  n.kind = ScalarNode::kConst;
  n.value = v;
  return addNode(p, n);
}

int slotNode(Program& p, int slot) {
  ScalarNode n;
  n.kind = ScalarNode::kSlot;
  n.value = slot;
  return addNode(p, n);
}

// out[i] = in[i] * 2 + i % numberOfStreams for each row i, through a loop
// of selects: slots %t0 = in [rows, cols], %t1 = out, %t2/%t3 the rows,
// %t4 a loop-local product; ints $0 = rows, $1 = cols, $2 = i,
// $3 = numberOfStreams.
Program rowLoop() {
  Program p;
  p.num_tensors = 5;
  p.num_ints = 4;
  p.inputs = {0};
  p.outputs = {1};
  p.tensor_names = {"T0", "T1", "T2", "T3", "T4"};
  p.int_names = {"i0", "i1", "i", "numberOfStreams"};
  p.number_of_streams = 3;
  int rows = slotNode(p, 0);
  int cols = slotNode(p, 1);
  int index = slotNode(p, 2);
  ScalarNode mod;
  mod.kind = ScalarNode::kMod;
  mod.lhs = index;
  mod.rhs = slotNode(p, 3);
  int stream = addNode(p, mod);
  for (int slot : {0, 1}) {
    std::vector<ExtentRule> rules(2);
    rules[0].extent = rows;
    rules[0].bind_slot = 0;
    rules[0].text = "i0";
    rules[1].extent = cols;
    rules[1].bind_slot = 1;
    rules[1].text = "i1";
    p.extent_rules.emplace_back(slot, rules);
  }
  Instr alloc;
  alloc.op = Opcode::kAllocate;
  alloc.out = 1;
  alloc.shape = {rows, cols};
  p.instrs.push_back(alloc);
  Instr loop;
  loop.op = Opcode::kFor;
  loop.index = 2;
  loop.start = constNode(p, 0);
  loop.stop = rows;
  loop.locals = {2, 3, 4};
  loop.end = 6;
  p.instrs.push_back(loop);
  Instr in_row;
  in_row.op = Opcode::kSelect;
  in_row.out = 2;
  in_row.input = 0;
  in_row.index = index;
  p.instrs.push_back(in_row);
  Instr out_row = in_row;
  out_row.out = 3;
  out_row.input = 1;
  p.instrs.push_back(out_row);
  Instr twice;
  twice.op = Opcode::kBinary;
  twice.kind = "mul";
  twice.out = 4;
  twice.lhs.tensor = 2;
  twice.rhs.is_number = true;
  twice.rhs.number = at::Scalar(2.0);
  p.instrs.push_back(twice);
  Instr plus;
  plus.op = Opcode::kBinary;
  plus.kind = "add";
  plus.out = 3;
  plus.lhs.tensor = 4;
  plus.rhs.scalar = stream;
  p.instrs.push_back(plus);
  return p;
}

at::Tensor expectedRows(const at::Tensor& x, int64_t streams) {
  at::Tensor out = x * 2;
  for (int64_t i = 0; i < x.size(0); ++i) {
    out[i] += i % streams;
  }
  return out;
}

TEST(Executor, LoopOfSelectsWritesEveryRow) {
  Executor executor(rowLoop());
  at::Tensor x = at::randn({5, 4});
  RunResult r = executor.run({x}, {}, 3);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  ASSERT_EQ(r.outputs.size(), 1u);
  EXPECT_TRUE(at::allclose(r.outputs[0], expectedRows(x, 3)));
  // Allocate, the loop, and 4 instructions in each of 5 iterations.
  EXPECT_EQ(executor.opsExecuted(), 2 + 5 * 4);
}

TEST(Executor, NumberOfStreamsIsBoundEachRun) {
  Executor executor(rowLoop());
  at::Tensor x = at::randn({6, 2});
  for (int64_t n : {1, 2, 4}) {
    RunResult r = executor.run({x}, {}, n);
    ASSERT_FALSE(r.failure.has_value());
    EXPECT_TRUE(at::allclose(r.outputs[0], expectedRows(x, n)));
  }
}

TEST(Executor, WritesIntoPreallocatedOutput) {
  Executor executor(rowLoop());
  at::Tensor x = at::randn({3, 4});
  at::Tensor out = at::empty({3, 4});
  RunResult r = executor.run({x}, {out}, 2);
  ASSERT_FALSE(r.failure.has_value());
  EXPECT_TRUE(r.outputs[0].is_same(out));
  EXPECT_TRUE(at::allclose(out, expectedRows(x, 2)));
}

// A bad binding is a failure before any instruction (-1), returned like an
// instruction's failure: nothing throws out of Executor::run.
void expectBindingFailure(const RunResult& r, const std::string& message) {
  ASSERT_TRUE(r.failure.has_value());
  EXPECT_EQ(r.failure->instr, -1);
  EXPECT_TRUE(r.failure->loops.empty());
  EXPECT_EQ(r.failure->kind, "BindingError");
  EXPECT_EQ(r.failure->message, message);
  EXPECT_TRUE(r.outputs.empty());
}

TEST(Executor, InconsistentExtentIsABindingError) {
  Executor executor(rowLoop());
  expectBindingFailure(
      executor.run({at::randn({3, 4})}, {at::empty({3, 5})}, 2), "axis 1 of T1 is 5 but its extent i1 is 4");
}

TEST(Executor, WrongRankIsABindingError) {
  Executor executor(rowLoop());
  expectBindingFailure(
      executor.run({at::randn({2, 3, 4})}, {}, 2), "T0 has 2 dims but its tensor has shape [2, 3, 4]");
  // The executor is still usable.
  RunResult r = executor.run({at::randn({3, 4})}, {}, 2);
  EXPECT_FALSE(r.failure.has_value());
}

TEST(Executor, FailureNamesInstructionAndLoopIndex) {
  Program p = rowLoop();
  // Select row i + 2: out of range at i = 3 of 5.
  ScalarNode shifted;
  shifted.kind = ScalarNode::kAdd;
  shifted.lhs = p.instrs[2].index;
  shifted.rhs = constNode(p, 2);
  p.instrs[2].index = addNode(p, shifted);
  Executor executor(std::move(p));
  RunResult r = executor.run({at::randn({5, 4})}, {}, 2);
  ASSERT_TRUE(r.failure.has_value());
  EXPECT_EQ(r.failure->instr, 2);
  ASSERT_EQ(r.failure->loops.size(), 1u);
  EXPECT_EQ(r.failure->loops[0], std::make_pair(2, int64_t{3}));
  EXPECT_EQ(r.failure->kind, "IndexError");
}

TEST(Executor, BadNumberOfStreamsIsABindingError) {
  Executor executor(rowLoop());
  expectBindingFailure(
      executor.run({at::randn({2, 2})}, {}, 0), "number_of_streams must be an integer >= 1, got 0");
}

TEST(Executor, TextFormatsWithoutIostreams) {
  std::vector<int64_t> shape{2, 0, -1};
  EXPECT_EQ(text("a ", std::string("b"), " ", int64_t{-7}, " ", size_t{3}, " ", c10::IntArrayRef(shape)),
            "a b -7 3 [2, 0, -1]");
  EXPECT_EQ(text("empty ", c10::IntArrayRef()), "empty []");
}

TEST(Executor, ScalarsFollowPythonFloorSemantics) {
  Program p = rowLoop();
  // Start the loop at -3: ( i % n ) must be Python's modulo (never negative)
  // and the select index is i + 3.
  p.instrs[1].start = constNode(p, -3);
  ScalarNode shifted;
  shifted.kind = ScalarNode::kAdd;
  shifted.lhs = p.instrs[2].index;
  shifted.rhs = constNode(p, 3);
  int row = addNode(p, shifted);
  p.instrs[2].index = row;
  p.instrs[3].index = row;
  ScalarNode stop;
  stop.kind = ScalarNode::kSub;
  stop.lhs = slotNode(p, 0);
  stop.rhs = constNode(p, 3);
  p.instrs[1].stop = addNode(p, stop);
  Executor executor(std::move(p));
  at::Tensor x = at::randn({4, 2});
  RunResult r = executor.run({x}, {}, 3);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  at::Tensor expected = x * 2;
  for (int64_t i = -3; i < 1; ++i) {
    expected[i + 3] += ((i % 3) + 3) % 3;
  }
  EXPECT_TRUE(at::allclose(r.outputs[0], expected));
}

TEST(Executor, UnknownOpKindIsRejectedWhenMade) {
  Program p = rowLoop();
  p.instrs[4].kind = "pow";
  try {
    Executor executor(std::move(p));
    FAIL() << "an unknown binary op was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), "ProgramError");
    EXPECT_STREQ(e.what(), "unknown binary op 'pow'");
  }
}

TEST(Executor, EveryKindOfBinaryOpByNumber) {
  // The number on the right is made into a tensor once, when the Executor
  // is made, and reused by every run.
  const std::pair<const char*, double> cases[] = {{"add", 6.0}, {"sub", 2.0}, {"mul", 8.0}, {"div", 2.0}};
  for (const auto& [kind, expected_for_four] : cases) {
    Program p = rowLoop();
    p.instrs[4].kind = kind;
    Executor executor(std::move(p));
    at::Tensor x = at::full({2, 3}, 4.0);
    for (int run = 0; run < 2; ++run) {
      RunResult r = executor.run({x}, {}, 1);
      ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
      // Row i: x op 2, plus i % 1 = 0.
      EXPECT_TRUE(at::allclose(r.outputs[0], at::full({2, 3}, expected_for_four))) << kind;
    }
  }
}

// %t1 = <kind>(%t0), both [rows, cols] bound by the caller.
Program unaryProgram(const char* kind) {
  Program p;
  p.num_tensors = 2;
  p.num_ints = 2;
  p.inputs = {0};
  p.outputs = {1};
  p.tensor_names = {"T0", "T1"};
  p.int_names = {"i0", "i1"};
  std::vector<ExtentRule> rules(2);
  for (int d = 0; d < 2; ++d) {
    rules[d].extent = slotNode(p, d);
    rules[d].bind_slot = d;
  }
  p.extent_rules.emplace_back(0, rules);
  Instr op;
  op.op = Opcode::kUnary;
  op.kind = kind;
  op.out = 1;
  op.input = 0;
  op.dtype = at::kDouble;  // what a cast converts to
  p.instrs.push_back(op);
  return p;
}

TEST(Executor, EveryUnaryKindCallsItsAtenFunction) {
  at::Tensor x = at::randn({4, 5}) * 3;
  const std::pair<const char*, at::Tensor> cases[] = {
      {"relu", at::relu(x)},
      {"neg", at::neg(x)},
      {"abs", at::abs(x)},
      {"cast", x.to(at::kDouble)},
      {"gelu", at::gelu(x)},
      {"gelu_tanh", at::gelu(x, "tanh")},
      {"silu", at::silu(x)},
      {"exp", at::exp(x)},
      {"tanh", at::tanh(x)},
      {"sigmoid", at::sigmoid(x)}};
  ASSERT_EQ(unaryKindNames().size(), std::size(cases));
  for (const auto& [kind, expected] : cases) {
    Executor executor(unaryProgram(kind));
    RunResult r = executor.run({x}, {}, 1);
    ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
    EXPECT_TRUE(at::equal(r.outputs[0], expected)) << kind;
    // Into a bound output: the result converted to its dtype.
    at::Tensor out = at::full({4, 5}, 7.0, expected.options());
    r = executor.run({x}, {out}, 1);
    ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
    EXPECT_TRUE(at::equal(out, expected)) << kind;
  }
}

TEST(Executor, UnknownUnaryKindIsRejectedWhenMade) {
  try {
    Executor executor(unaryProgram("sqrt"));
    FAIL() << "an unknown unary op was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), "ProgramError");
    EXPECT_STREQ(e.what(), "unknown unary op 'sqrt'");
  }
}

// A matmul whose operands are read through views and whose result keeps a
// leading axis of partial sums: %t0 [M, 1, K] (its K split off a mesh
// piece, the two dims one logical axis [M, K]) times %t1 [K, N] cut to the
// rows of this rank's piece (index 1 of 2 along K), into %t2 [1, M, N].
TEST(Executor, ViewsCutOperandsAndPartialSumsKeepTheirAxis) {
  Program p;
  p.num_tensors = 3;
  p.inputs = {0, 1};
  p.outputs = {2};
  p.tensor_names = {"T0", "T1", "T2"};
  Instr mm;
  mm.op = Opcode::kMatmul;
  mm.a = 0;
  mm.b = 1;
  mm.out = 2;
  View a;
  a.logical = {{0}, {1, 2}};
  View b;
  b.cuts.push_back(Cut{0, {2, -1}, {0, 1}});
  mm.views = {a, b};
  mm.store.partial = true;
  p.instrs.push_back(mm);
  Executor executor(std::move(p));
  at::Tensor x = at::randn({3, 1, 4});
  at::Tensor w = at::randn({8, 5});
  RunResult r = executor.run({x, w}, {}, 1);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  at::Tensor expected = at::matmul(x.reshape({3, 4}), w.narrow(0, 4, 4)).unsqueeze(0);
  EXPECT_TRUE(at::equal(r.outputs[0], expected));
  // Into a bound output: the partial axis dropped from its view.
  at::Tensor out = at::zeros({1, 3, 5});
  r = executor.run({x, w}, {out}, 1);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  EXPECT_TRUE(at::allclose(out, expected));
}

// rowLoop with its two compute instructions under IF ( i < limit ), limit
// a scalar input (integer slot $4, listed in the inputs as -2 - 4); the
// ELSE branch copies the input row.
Program rowLoopWithBranch() {
  Program p = rowLoop();
  p.num_ints = 5;
  p.int_names.push_back("limit");
  p.inputs = {0, -2 - 4};
  ScalarNode less;
  less.kind = ScalarNode::kLt;
  less.lhs = p.instrs[2].index;
  less.rhs = slotNode(p, 4);
  Instr branch;
  branch.op = Opcode::kIf;
  branch.cond = addNode(p, less);
  branch.end = 7;
  branch.else_end = 8;
  Instr copy;
  copy.op = Opcode::kSet;
  copy.out = 3;
  copy.input = 2;
  p.instrs.insert(p.instrs.begin() + 4, branch);
  p.instrs.push_back(copy);
  p.instrs[1].end = 8;
  return p;
}

TEST(Executor, IfRunsOneBranchOnAScalarInput) {
  Executor executor(rowLoopWithBranch());
  at::Tensor x = at::randn({5, 4});
  for (int64_t limit : {0, 2, 5}) {
    RunResult r = executor.run({x, at::scalar_tensor(limit, at::kLong)}, {}, 3);
    ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
    at::Tensor expected = expectedRows(x, 3);
    for (int64_t i = limit; i < 5; ++i) {
      expected[i] = x[i];
    }
    EXPECT_TRUE(at::allclose(r.outputs[0], expected)) << "limit " << limit;
  }
}

TEST(Executor, RunsRecordNoAutogradHistory) {
  Executor executor(rowLoop());
  at::Tensor x = at::randn({3, 4}).requires_grad_();
  at::Tensor out = at::empty({3, 4});
  RunResult r = executor.run({x}, {out}, 2);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  EXPECT_FALSE(r.outputs[0].requires_grad());
  EXPECT_FALSE(out.requires_grad());
  // The writes into the caller's buffer count for autograd's checks.
  EXPECT_GT(out._version(), 0u);
  EXPECT_TRUE(at::allclose(out, expectedRows(x.detach(), 2)));
}

// runLogical views a caller's tensors with the program's runtime axes and
// the results with the caller's: here a logical [rows, 1, cols] input whose
// size-1 axis the program does not have, and the same axes back.
TEST(Executor, RunLogicalViewsInputsAndResults) {
  Executor executor(rowLoop());
  executor.setViews({{0, 2}}, {{{0}, {}, {1}}});
  at::Tensor x = at::randn({5, 1, 4});
  RunResult r = executor.runLogical({x}, 3);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  ASSERT_EQ(r.outputs[0].sizes(), (std::vector<int64_t>{5, 1, 4}));
  EXPECT_TRUE(at::allclose(r.outputs[0], expectedRows(x.reshape({5, 4}), 3).reshape({5, 1, 4})));
  // A -1 in an input's view is a device piece: a dim of size 1.
  executor.setViews({{0, -1}}, {{{0, 1}}});
  at::Tensor rows = at::randn({6});
  RunResult ones = executor.runLogical({rows}, 2);
  ASSERT_FALSE(ones.failure.has_value()) << ones.failure->message;
  ASSERT_EQ(ones.outputs[0].sizes(), (std::vector<int64_t>{6}));
  EXPECT_TRUE(at::allclose(ones.outputs[0], expectedRows(rows.reshape({6, 1}), 2).reshape({6})));
}

TEST(Executor, RunLogicalOnAnInputOfOtherAxesIsABindingError) {
  Executor executor(rowLoop());
  executor.setViews({{0, 2}}, {{}});
  RunResult r = executor.runLogical({at::randn({5, 4})}, 2);
  ASSERT_TRUE(r.failure.has_value());
  EXPECT_EQ(r.failure->instr, -1);
  EXPECT_EQ(r.failure->kind, "BindingError");
  EXPECT_TRUE(r.outputs.empty());
}

TEST(Executor, TwoThreadsRunOneExecutorAtOnce) {
  Executor executor(rowLoop());
  auto work = [&executor](int64_t streams, bool* ok) {
    *ok = true;
    for (int k = 0; k < 50; ++k) {
      at::Tensor x = at::randn({7, 3});
      RunResult r = executor.run({x}, {}, streams);
      *ok = *ok && !r.failure && at::allclose(r.outputs[0], expectedRows(x, streams));
    }
  };
  bool ok1 = false, ok2 = false;
  std::thread t1(work, 2, &ok1);
  std::thread t2(work, 5, &ok2);
  t1.join();
  t2.join();
  EXPECT_TRUE(ok1);
  EXPECT_TRUE(ok2);
}

// -- transports

// %t0 [4] in, %t1 [4] out: an Allreduce over a team of one on `backend`
// (it moves nothing, so it needs no process group) and its Wait.
Program teamOfOne(const std::string& backend) {
  Program p;
  p.num_tensors = 2;
  p.inputs = {0};
  p.outputs = {1};
  p.tensor_names = {"T0", "T1"};
  Instr alloc;
  alloc.op = Opcode::kAllocate;
  alloc.out = 1;
  alloc.shape = {constNode(p, 4)};
  p.instrs.push_back(alloc);
  Instr comm;
  comm.op = Opcode::kCommunication;
  comm.comm_type = CommType::kAllreduce;
  comm.team_size = 1;
  comm.input = 0;
  comm.out = 1;
  comm.red_op = "sum";
  comm.backend = backend;
  p.instrs.push_back(comm);
  Instr wait;
  wait.op = Opcode::kWait;
  wait.posted = 1;
  wait.text = "Communication 0";
  p.instrs.push_back(wait);
  return p;
}

TEST(Transports, UnknownBackendIsRejectedWhenMade) {
  try {
    Executor executor(teamOfOne("mpi"));
    FAIL() << "a communication on an unknown backend was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), "ProgramError");
    EXPECT_STREQ(
        e.what(), "instruction 1 names the backend 'mpi', which the C++ executor has no transport for (it has NCCL, cuda, gloo)");
  }
}

TEST(Transports, RegistryHasTheC10dTransportAndTheCopyEngine) {
  // Each transport file registered its own backends, in name order.
  EXPECT_EQ(transportNames(), (std::vector<std::string>{"NCCL", "cuda", "gloo"}));
  ASSERT_NE(findTransport("NCCL"), nullptr);
  ASSERT_NE(findTransport("cuda"), nullptr);
  EXPECT_EQ(findTransport("gloo"), findTransport("NCCL"));  // both post on c10d process groups
  EXPECT_NE(findTransport("cuda"), findTransport("NCCL"));
  EXPECT_EQ(findTransport("nccl"), nullptr);  // ir.backend_name's spelling only
}

TEST(Transports, ABackendRegisteredTwiceIsRefused) {
  const Transport* nccl = findTransport("NCCL");
  try {
    registerTransport("NCCL", findTransport("cuda"));
    FAIL() << "a second transport for NCCL was registered";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "the backend 'NCCL' is registered twice: one transport per backend");
  }
  EXPECT_EQ(findTransport("NCCL"), nccl);
  EXPECT_EQ(transportNames(), (std::vector<std::string>{"NCCL", "cuda", "gloo"}));
}

TEST(Transports, ABackendRegisteredWithNoTransportIsRefused) {
  try {
    registerTransport("mpi", nullptr);
    FAIL() << "a backend with no transport was registered";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "the backend 'mpi' is registered with no transport");
  }
  EXPECT_EQ(findTransport("mpi"), nullptr);
}

// -- the copy engine's windows and chunk views (what runs without CUDA)

// %t1 = chunk `index` of `parts` of input %t0's rows ($0 rows, $1 cols).
Program chunkOfRows(int64_t parts, int64_t index, bool equal) {
  Program p;
  p.num_tensors = 2;
  p.num_ints = 2;
  p.inputs = {0};
  p.outputs = {1};
  p.tensor_names = {"T0", "T1"};
  p.int_names = {"i0", "i1"};
  Instr chunk;
  chunk.op = Opcode::kChunk;
  chunk.out = 1;
  chunk.input = 0;
  chunk.dim = 0;
  chunk.index = constNode(p, index);
  chunk.parts = constNode(p, parts);
  chunk.equal = equal;
  p.instrs.push_back(chunk);
  return p;
}

TEST(Chunks, ChunkOfASplitAxisHasCeilDivRowsAndTheLastIsShorter) {
  at::Tensor x = at::randn({7, 3});
  for (int64_t index = 0; index < 3; ++index) {
    Executor executor(chunkOfRows(3, index, false));
    RunResult r = executor.run({x}, {}, 1);
    ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
    int64_t start = index * 3;
    int64_t length = std::min<int64_t>(3, 7 - start);
    EXPECT_TRUE(at::equal(r.outputs[0], x.narrow(0, start, length))) << "chunk " << index;
    EXPECT_EQ(r.outputs[0].data_ptr(), x[start].data_ptr()) << "a chunk is a view, not a copy";
  }
}

TEST(Chunks, EqualPiecesThatDoNotDivideAreABindingError) {
  Executor executor(chunkOfRows(2, 0, true));
  RunResult r = executor.run({at::randn({5, 3})}, {}, 1);
  ASSERT_TRUE(r.failure.has_value());
  EXPECT_EQ(r.failure->kind, "BindingError");
  EXPECT_EQ(r.failure->message, "axis 0 of size 5 does not split into 2 equal pieces");
  EXPECT_EQ(r.failure->instr, 0);
}

// %t2 = take(%t0, %t1), %t3 = put_add(%t2, %t1, like %t0): %t0 [rows, 3]
// (no batch axis, one feature axis), %t1 the picked rows.
Program takeThenPutAdd() {
  Program p;
  p.num_tensors = 4;
  p.inputs = {0, 1};
  p.outputs = {2, 3};
  p.tensor_names = {"T0", "T1", "T2", "T3"};
  Instr take;
  take.op = Opcode::kTake;
  take.out = 2;
  take.input = 0;
  take.b = 1;
  take.features = 1;
  p.instrs.push_back(take);
  Instr put = take;
  put.op = Opcode::kPutAdd;
  put.out = 3;
  put.input = 2;
  put.like = 0;
  p.instrs.push_back(put);
  return p;
}

TEST(IndexOps, TakeGivesZerosAndPutAddDropsANegativeIndex) {
  Executor executor(takeThenPutAdd());
  at::Tensor x = at::randn({5, 3});
  at::Tensor index = at::tensor(std::vector<int64_t>{4, -1, 0, 4});
  RunResult r = executor.run({x, index}, {}, 1);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  at::Tensor expected = at::stack({x[4], at::zeros({3}), x[0], x[4]});
  EXPECT_TRUE(at::equal(r.outputs[0], expected));
  at::Tensor put = at::zeros({5, 3});
  put[0] = x[0];
  put[4] = x[4] + x[4];
  EXPECT_TRUE(at::equal(r.outputs[1], put));
  // Into bound outputs: the same values, copied.
  at::Tensor taken = at::full({4, 3}, 7.0);
  at::Tensor added = at::full({5, 3}, 7.0);
  r = executor.run({x, index}, {taken, added}, 1);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  EXPECT_TRUE(r.outputs[0].is_same(taken) && r.outputs[1].is_same(added));
  EXPECT_TRUE(at::equal(taken, expected) && at::equal(added, put));
}

// %t1 = route(%t0) of 3 experts with 1 slot each, giving `what`.
Program routeOf(const char* what) {
  Program p;
  p.num_tensors = 2;
  p.inputs = {0};
  p.outputs = {1};
  p.tensor_names = {"T0", "T1"};
  Instr route;
  route.op = Opcode::kRoute;
  route.out = 1;
  route.input = 0;
  route.experts = 3;
  route.capacity = 1;
  route.what = what;
  p.instrs.push_back(route);
  return p;
}

TEST(IndexOps, RoutePlacesPairsInTokenOrderAndDropsPastCapacity) {
  // Tokens 0, 1, 2 choose experts (2, 0), (0, 1), (2, 1): expert 0 takes
  // token 0's pair, expert 1 token 1's, expert 2 token 0's; the rest drop.
  at::Tensor indices = at::tensor(std::vector<int64_t>{2, 0, 0, 1, 2, 1}).reshape({3, 2});
  Executor slots(routeOf("slot"));
  RunResult r = slots.run({indices}, {}, 1);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  EXPECT_TRUE(at::equal(r.outputs[0], at::tensor(std::vector<int64_t>{2, 0, -1, 1, -1, -1}).reshape({3, 2})));
  Executor sources(routeOf("source"));
  r = sources.run({indices}, {}, 1);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  EXPECT_TRUE(at::equal(r.outputs[0], at::tensor(std::vector<int64_t>{0, 1, 0}).reshape({1, 3, 1})));
}

TEST(IndexOps, UnknownRouteIsRejectedWhenMade) {
  try {
    Executor executor(routeOf("slots"));
    FAIL() << "an unknown route was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), "ProgramError");
    EXPECT_STREQ(e.what(), "a route gives 'slot', 'source' or 'counts', not 'slots'");
  }
}

// %t1 = route(%t0) of 4 experts in 2 groups (2 experts each), giving
// `what`, with `capacity` slots per group (`packed`) or per expert.
Program groupedRouteOf(const char* what, int64_t capacity, bool packed) {
  Program p = routeOf(what);
  p.instrs[0].experts = 4;
  p.instrs[0].groups = 2;
  p.instrs[0].capacity = capacity;
  p.instrs[0].packed = packed;
  return p;
}

// Tokens 0..3 choose experts (0, 3), (1, 0), (2, 3), (0, 1). In expert
// order, stably: expert 0 has tokens 0, 1, 3; expert 1 tokens 1, 3;
// expert 2 token 2; expert 3 tokens 0, 2.
at::Tensor fourTokens() {
  return at::tensor(std::vector<int64_t>{0, 3, 1, 0, 2, 3, 0, 1}).reshape({4, 2});
}

RunResult runRoute(const char* what, int64_t capacity, bool packed) {
  Executor executor(groupedRouteOf(what, capacity, packed));
  return executor.run({fourTokens()}, {}, 1);
}

TEST(IndexOps, PackedRouteFillsEachGroupsRowsExpertAfterExpert) {
  // Group 0 (experts 0, 1) places tokens 0, 1, 3 of expert 0 in its rows
  // 0..2, and drops expert 1's pairs past its 3 rows; group 1 (experts 2,
  // 3) places token 2, then tokens 0 and 2, from its first row (slot 3).
  RunResult r = runRoute("slot", 3, true);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  EXPECT_TRUE(at::equal(r.outputs[0], at::tensor(std::vector<int64_t>{0, 4, -1, 1, 3, 5, 2, -1}).reshape({4, 2})))
      << r.outputs[0];
  r = runRoute("source", 3, true);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  EXPECT_TRUE(at::equal(r.outputs[0], at::tensor(std::vector<int64_t>{0, 1, 3, 2, 0, 2}).reshape({2, 3})))
      << r.outputs[0];
  r = runRoute("counts", 3, true);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  EXPECT_TRUE(at::equal(r.outputs[0], at::tensor(std::vector<int64_t>{3, 0, 1, 2}).reshape({2, 2})))
      << r.outputs[0];
}

TEST(IndexOps, RouteCountsThePairsEachExpertKeeps) {
  // Two slots per expert: expert 0 keeps 2 of its 3 pairs, the others all.
  RunResult r = runRoute("counts", 2, false);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  EXPECT_TRUE(at::equal(r.outputs[0], at::tensor(std::vector<int64_t>{2, 2, 1, 2}).reshape({2, 2})))
      << r.outputs[0];
  // Per expert, the unpacked sources: [groups, experts / groups, capacity].
  r = runRoute("source", 2, false);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  EXPECT_TRUE(at::equal(r.outputs[0], at::tensor(std::vector<int64_t>{0, 1, 1, 3, 2, -1, 0, 2}).reshape({2, 2, 2})))
      << r.outputs[0];
}

// %t3 = grouped_mm(%t0, %t1, counts %t2) (`outer`: grouped_outer(%t0,
// %t1, counts %t2) keeping `wbatch` batch axes).
Program groupedOp(bool outer, int64_t wbatch = 0) {
  Program p;
  p.num_tensors = 4;
  p.inputs = {0, 1, 2};
  p.outputs = {3};
  p.tensor_names = {"T0", "T1", "T2", "T3"};
  Instr op;
  op.op = outer ? Opcode::kGroupedOuter : Opcode::kGroupedMm;
  op.out = 3;
  op.input = 0;
  op.b = 1;
  op.counts = 2;
  op.wbatch = wbatch;
  // Where the device had the kernel: on the CPU a matmul per group still.
  op.grouped_kernel = true;
  p.instrs.push_back(op);
  return p;
}

// Batch element i's rows grouped by counts[i]: each row times its group's
// weight (the weight shared by both elements), zeros past the total.
at::Tensor groupedMmByRows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& counts) {
  at::Tensor out = at::zeros({x.size(0), x.size(1), weight.size(1)});
  for (int64_t i = 0; i < x.size(0); ++i) {
    int64_t row = 0;
    for (int64_t g = 0; g < counts.size(1); ++g) {
      for (int64_t c = 0; c < counts[i][g].item<int64_t>(); ++c, ++row) {
        out[i][row] = at::mv(weight[g], x[i][row]);
      }
    }
  }
  return out;
}

TEST(GroupedOps, GroupedMmZerosTheRowsPastTheGroupsAndSkipsAnEmptyGroup) {
  Executor executor(groupedOp(false));
  // Two batch elements of 5 rows sharing one weight [2 groups, N 2, K 3]:
  // the first's group 1 is empty, the second has one row past its groups.
  at::Tensor x = at::randn({2, 5, 3});
  at::Tensor weight = at::randn({2, 2, 3});
  at::Tensor counts = at::tensor(std::vector<int64_t>{2, 0, 1, 3}).reshape({2, 2});
  RunResult r = executor.run({x, weight, counts}, {}, 1);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  at::Tensor expected = groupedMmByRows(x, weight, counts);
  ASSERT_EQ(r.outputs[0].sizes(), expected.sizes());
  EXPECT_TRUE(at::allclose(r.outputs[0], expected, 1e-5, 1e-6)) << r.outputs[0] << expected;
  EXPECT_TRUE(at::equal(r.outputs[0].narrow(1, 2, 3)[0], at::zeros({3, 2})));
  EXPECT_TRUE(at::equal(r.outputs[0][1][4], at::zeros({2})));
  // Into a bound output: the same values copied, its rows past the groups
  // zeroed.
  at::Tensor bound = at::full({2, 5, 2}, 7.0);
  r = executor.run({x, weight, counts}, {bound}, 1);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  EXPECT_TRUE(r.outputs[0].is_same(bound));
  EXPECT_TRUE(at::allclose(bound, expected, 1e-5, 1e-6)) << bound;
}

TEST(GroupedOps, GroupedMmTakesAWeightPerTrailingBatchElement) {
  // Rows [3, 2, R 4, K 3], a weight [2, G 2, N 2, K 3] per element of the
  // trailing batch axis: element (a, b) takes weight b.
  Executor executor(groupedOp(false));
  at::Tensor x = at::randn({3, 2, 4, 3});
  at::Tensor weight = at::randn({2, 2, 2, 3});
  at::Tensor counts = at::randint(0, 3, {3, 2, 2}, at::TensorOptions().dtype(at::kLong));
  RunResult r = executor.run({x, weight, counts}, {}, 1);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  ASSERT_EQ(r.outputs[0].sizes(), (std::vector<int64_t>{3, 2, 4, 2}));
  for (int64_t a = 0; a < 3; ++a) {
    for (int64_t b = 0; b < 2; ++b) {
      at::Tensor expected = groupedMmByRows(x[a][b].unsqueeze(0), weight[b], counts[a][b].unsqueeze(0));
      EXPECT_TRUE(at::allclose(r.outputs[0][a][b], expected[0], 1e-5, 1e-6)) << a << ", " << b;
    }
  }
}

// Per batch element and group, the rows' outer products: [batch, G, N, K].
at::Tensor groupedOuterByElement(const at::Tensor& x, const at::Tensor& other, const at::Tensor& counts) {
  at::Tensor out = at::zeros({x.size(0), counts.size(1), x.size(2), other.size(2)});
  for (int64_t i = 0; i < x.size(0); ++i) {
    int64_t start = 0;
    for (int64_t g = 0; g < counts.size(1); ++g) {
      int64_t c = counts[i][g].item<int64_t>();
      out[i][g] = at::matmul(x[i].narrow(0, start, c).t().to(at::kFloat), other[i].narrow(0, start, c).to(at::kFloat));
      start += c;
    }
  }
  return out;
}

TEST(GroupedOps, GroupedOuterSumsTheBatchAxesItsOutputLacks) {
  // Rows [2, R 4, N 2] and [2, R 4, K 3]; the first element's group 1 is
  // empty (but for the second's rows), the second's group 0 is.
  at::Tensor x = at::randn({2, 4, 2});
  at::Tensor other = at::randn({2, 4, 3});
  at::Tensor counts = at::tensor(std::vector<int64_t>{3, 0, 0, 4}).reshape({2, 2});
  at::Tensor each = groupedOuterByElement(x, other, counts);
  Executor summed(groupedOp(true, 0));
  RunResult r = summed.run({x, other, counts}, {}, 1);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  ASSERT_EQ(r.outputs[0].sizes(), (std::vector<int64_t>{2, 2, 3}));
  EXPECT_TRUE(at::allclose(r.outputs[0], each.sum(0), 1e-5, 1e-6)) << r.outputs[0];
  Executor kept(groupedOp(true, 1));
  r = kept.run({x, other, counts}, {}, 1);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  ASSERT_EQ(r.outputs[0].sizes(), (std::vector<int64_t>{2, 2, 2, 3}));
  EXPECT_TRUE(at::allclose(r.outputs[0], each, 1e-5, 1e-6)) << r.outputs[0];
  EXPECT_TRUE(at::equal(r.outputs[0][0][1], at::zeros({2, 3})) && at::equal(r.outputs[0][1][0], at::zeros({2, 3})));
}

TEST(GroupedOps, GroupedOuterOfAHalfTypeSumsInFloat) {
  // bfloat16 rows: the products summed over both elements in float32, then
  // rounded once.
  at::Tensor x = at::randn({2, 6, 2}).to(at::kBFloat16);
  at::Tensor other = at::randn({2, 6, 3}).to(at::kBFloat16);
  at::Tensor counts = at::tensor(std::vector<int64_t>{2, 4, 5, 1}).reshape({2, 2});
  Executor executor(groupedOp(true, 0));
  RunResult r = executor.run({x, other, counts}, {}, 1);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  EXPECT_EQ(r.outputs[0].scalar_type(), at::kBFloat16);
  at::Tensor each = groupedOuterByElement(x, other, counts);
  EXPECT_TRUE(at::equal(r.outputs[0], (each[0] + each[1]).to(at::kBFloat16))) << r.outputs[0];
}

TEST(GroupedOps, OnTheMetaDeviceTheGroupedOpsGiveShapesOnly) {
  auto meta = at::TensorOptions().device(at::kMeta);
  at::Tensor counts = at::empty({3, 2}, meta.dtype(at::kLong));
  Executor mm(groupedOp(false));
  RunResult r = mm.run({at::empty({3, 5, 4}, meta), at::empty({2, 6, 4}, meta), counts}, {}, 1);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  EXPECT_TRUE(r.outputs[0].is_meta());
  EXPECT_EQ(r.outputs[0].sizes(), (std::vector<int64_t>{3, 5, 6}));
  Executor outer(groupedOp(true, 1));
  r = outer.run({at::empty({3, 5, 4}, meta), at::empty({3, 5, 7}, meta), counts}, {}, 1);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  EXPECT_EQ(r.outputs[0].sizes(), (std::vector<int64_t>{3, 2, 4, 7}));
}

Window twoRankWindow() {
  return Window{64, {0x10000, 0x20000}, {0x1000, 0x2000}, 64, 0};
}

TEST(Windows, FlagOfChannelAndSourceSitsOnTheReceiver) {
  Window w = twoRankWindow();
  // Flag [channel * world + src], uint32 each, on the rank it is asked for.
  EXPECT_EQ(flagAddress(w, 1, 0, 0), 0x2000u);
  EXPECT_EQ(flagAddress(w, 1, 0, 1), 0x2004u);
  EXPECT_EQ(flagAddress(w, 0, 3, 1), 0x1000u + 4 * (3 * 2 + 1));
}

TEST(Windows, AChannelBeyondTheFlagsIsAnError) {
  Window w = twoRankWindow();  // 64 bytes: 16 flags, 8 channels of 2 ranks
  EXPECT_EQ(flagAddress(w, 0, 7, 1), 0x1000u + 60);
  try {
    flagAddress(w, 0, 8, 0);
    FAIL() << "a channel beyond the flags was given an address";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), "TransportUsageError");
    EXPECT_STREQ(e.what(), "signal channel 8 is beyond the window's 8 (64 bytes of flags for 2 ranks)");
  }
}

TEST(Windows, MissingLibcudaIsAClearErrorOnlyWhenUsed) {
  StreamMemOps ops("libhostir-no-such-library.so.1");  // loading never throws
  EXPECT_NE(ops.error().find("libhostir-no-such-library.so.1 does not load"), std::string::npos) << ops.error();
  try {
    ops.write(c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU)), 0x1000, 1);
    FAIL() << "a stream memory write without libcuda ran";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), "TransportUnsupported");
    EXPECT_EQ(std::string(e.what()), ops.error());
  }
}

// A program with one symmetric Allocate of $0 x 4 floats, its output.
Program oneWindow() {
  Program p;
  p.num_tensors = 2;
  p.num_ints = 1;
  p.inputs = {0};
  p.outputs = {1};
  p.tensor_names = {"T0", "T1"};
  p.int_names = {"i0"};
  std::vector<ExtentRule> rules(1);
  rules[0].extent = slotNode(p, 0);
  rules[0].bind_slot = 0;
  rules[0].text = "i0";
  p.extent_rules.emplace_back(0, rules);
  Instr alloc;
  alloc.op = Opcode::kAllocate;
  alloc.out = 1;
  alloc.shape = {slotNode(p, 0), constNode(p, 4)};
  alloc.symmetric = true;
  p.instrs.push_back(alloc);
  return p;
}

TEST(Windows, OnlyASymmetricAllocateTakesAWindow) {
  Executor executor(oneWindow());
  executor.setWindow(0, 1, twoRankWindow());  // accepted
  for (auto [instr, parity, why] : {std::tuple<int, int, const char*>{1, 0, "instruction 1 is no symmetric Allocate"},
                                    {0, 2, "a call parity is 0 or 1, got 2"}}) {
    try {
      executor.setWindow(instr, parity, twoRankWindow());
      FAIL() << why;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), "ProgramError");
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  }
  Window lonely = twoRankWindow();
  lonely.flags.pop_back();
  EXPECT_THROW(executor.setWindow(0, 0, lonely), Error);
}

TEST(Windows, AWindowOnTheCpuIsAClearErrorBeforeAnyInstruction) {
  Executor executor(oneWindow());
  RunResult r = executor.run({at::randn({3})}, {}, 1);
  ASSERT_TRUE(r.failure.has_value());
  EXPECT_EQ(r.failure->instr, -1);
  EXPECT_EQ(r.failure->kind, "TransportUnsupported");
  EXPECT_EQ(r.failure->message, "the cuda transport moves data between CUDA devices, but this program runs on cpu");
  EXPECT_EQ(executor.opsExecuted(), 0);
}

TEST(Transports, TeamOfOneKeepsItsInputOnEveryTransport) {
  for (const std::string& backend : transportNames()) {
    Executor executor(teamOfOne(backend));
    EXPECT_EQ(executor.program().instrs[1].transport, findTransport(backend));
    at::Tensor x = at::randn({4});
    RunResult r = executor.run({x}, {}, 1);
    ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
    EXPECT_TRUE(at::equal(r.outputs[0], x)) << backend;
  }
}

// An AllToAll sized at run time over a team of two, this rank its first
// position: %t0 = x [1, 2, 3, 2] (sender, receiver, bound 3, hidden), the
// counts %t1 = rows (as x) and %t2 = rows_in (as the output), %t3 = the
// output [2, 1, 3, 2]. Its group is never reached: every case below fails
// the counts' checks before anything is posted.
Program sizedAllToAll() {
  Program p;
  p.num_tensors = 4;
  p.inputs = {0, 1, 2};
  p.outputs = {3};
  p.tensor_names = {"T0", "T1", "T2", "T3"};
  p.groups.push_back(c10::intrusive_ptr<c10d::ProcessGroup>());
  Instr alloc;
  alloc.op = Opcode::kAllocate;
  alloc.out = 3;
  alloc.shape = {constNode(p, 2), constNode(p, 1), constNode(p, 3), constNode(p, 2)};
  p.instrs.push_back(alloc);
  Instr comm;
  comm.op = Opcode::kCommunication;
  comm.comm_type = CommType::kAllToAll;
  comm.backend = "gloo";
  comm.group = 0;
  comm.team_size = 2;
  comm.input = 0;
  comm.out = 3;
  comm.in_axis = 0;
  comm.out_axis = 1;
  comm.perm = {0, 1};
  comm.recv_perm = {0, 1};
  comm.rows = 1;
  comm.rows_in = 2;
  comm.me = 0;
  comm.rows_text = "R";
  comm.rows_in_text = "Rin";
  p.instrs.push_back(comm);
  Instr wait;
  wait.op = Opcode::kWait;
  wait.posted = 1;
  wait.text = "Communication 0";
  p.instrs.push_back(wait);
  return p;
}

// The failure of a sized AllToAll on counts `rows` and `rows_in`.
Failure sizedFailure(const at::Tensor& rows, const at::Tensor& rows_in) {
  Executor executor(sizedAllToAll());
  RunResult r = executor.run({at::randn({1, 2, 3, 2}), rows, rows_in}, {}, 1);
  EXPECT_TRUE(r.failure.has_value());
  return r.failure.value_or(Failure());
}

at::Tensor longs(std::vector<int64_t> values, std::vector<int64_t> shape) {
  return at::tensor(values, at::TensorOptions().dtype(at::kLong)).reshape(shape);
}

TEST(Transports, SizedAllToAllChecksItsCountsAsThePythonTransport) {
  // Counts summed over their trailing axes: 2 and 1 sent, 3 and 0 received.
  Failure f = sizedFailure(longs({1, 1, 0, 1}, {1, 2, 2}), longs({3, 0}, {2, 1}));
  EXPECT_EQ(f.instr, 1);
  EXPECT_EQ(f.kind, "TransportUsageError");
  EXPECT_EQ(f.message, "this rank keeps 2 rows of its own piece by rows but 3 by rows_in: R and Rin disagree");
  f = sizedFailure(longs({4, 0}, {1, 2}), longs({4, 0}, {2, 1}));
  EXPECT_EQ(f.kind, "TransportUsageError");
  EXPECT_EQ(f.message, "rows R says piece 0 has 4 rows, outside the bound [0, 3]");
  f = sizedFailure(longs({1, 1}, {1, 2}), longs({1, -1}, {2, 1}));
  EXPECT_EQ(f.message, "rows_in Rin says piece 1 has -1 rows, outside the bound [0, 3]");
  f = sizedFailure(longs({1, 1, 1}, {1, 3}), longs({1, 1}, {2, 1}));
  EXPECT_EQ(f.message, "rows R counts 3 pieces, not 2");
}

// StartCoalescing, a P2P send of %t0 to rank 0, EndCoalescing, its Wait.
Program coalescedSend(const std::string& group_backend, const std::string& send_backend) {
  Program p;
  p.num_tensors = 1;
  p.inputs = {0};
  p.outputs = {0};
  p.tensor_names = {"T0"};
  Instr start;
  start.op = Opcode::kStartCoalescing;
  start.backend = group_backend;
  p.instrs.push_back(start);
  Instr send;
  send.op = Opcode::kP2P;
  send.send = true;
  send.buffer = 0;
  send.peer = constNode(p, 0);
  send.world_size = 1;
  send.backend = send_backend;
  p.instrs.push_back(send);
  Instr end = start;
  end.op = Opcode::kEndCoalescing;
  p.instrs.push_back(end);
  Instr wait;
  wait.op = Opcode::kWait;
  wait.posted = 2;
  p.instrs.push_back(wait);
  return p;
}

TEST(Transports, CoalescingGroupOfTwoBackendsIsAProgramError) {
  Executor executor(coalescedSend("NCCL", "gloo"));
  RunResult r = executor.run({at::randn({3})}, {}, 1);
  ASSERT_TRUE(r.failure.has_value());
  EXPECT_EQ(r.failure->instr, 1);
  EXPECT_EQ(r.failure->kind, "ProgramError");
  EXPECT_EQ(r.failure->message, "one coalescing group mixes backends NCCL and gloo");
}

TEST(Transports, EmptyCoalescingGroupPostsNothing) {
  Program p = coalescedSend("", "gloo");
  p.instrs.erase(p.instrs.begin() + 1);
  p.instrs[2].posted = 1;
  Executor executor(std::move(p));
  at::Tensor x = at::randn({3});
  RunResult r = executor.run({x}, {}, 1);
  ASSERT_FALSE(r.failure.has_value()) << r.failure->message;
  EXPECT_TRUE(at::equal(r.outputs[0], x));
}

} // namespace
} // namespace hostir
