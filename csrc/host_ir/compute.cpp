// The compute ops of a run, the C++ twins of python/hostir/runtime/
// evaluator.py's: binary, unary, reduction, matmul, linear, permute, the
// index ops of a mixture-of-experts layer (topk, route, take, put_add) and
// the grouped GEMM with its weights' gradient (grouped_mm, grouped_outer), with
// ATen's out= variants where an op writes into a bound output, and the
// layouts that read an operand with its logical axes (`_operand`) and put
// a result into its output (`_store`); the chunk views of a stream loop,
// and what a communication sends of its input.
#include "run.h"
#include "transports/transport.h"

#include <ATen/ExpandUtils.h>

#include <algorithm>
#include <array>
#include <initializer_list>
#include <optional>
#include <utility>

namespace hostir {
namespace {

// The 0-d CPU tensor torch makes of a number on the right of a binary op.
at::Tensor wrappedNumber(const at::Scalar& s) {
  at::Tensor t = c10::scalar_to_tensor(s);
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

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

at::Tensor fullRank(const at::Tensor& t, int dim) {
  return dim < 0 ? t : t.unsqueeze(dim);
}

at::Tensor operandTensor(Run& run, const Operand& o) {
  if (o.tensor >= 0) {
    return run.tensor(o.tensor);
  }
  // torch takes a number only on the right; the evaluator makes the left
  // one a 0-d CPU tensor of the number's default dtype.
  at::Scalar s = o.is_number ? o.number : at::Scalar(run.get(o.scalar));
  at::ScalarType dtype = s.isBoolean() ? at::kBool
      : s.isIntegral(false)            ? at::kLong
                                       : c10::typeMetaToScalarType(c10::get_default_dtype());
  return at::scalar_tensor(s, at::TensorOptions().dtype(dtype));
}

at::Tensor operandOther(Run& run, const Operand& o) {
  if (o.tensor >= 0) {
    return run.tensor(o.tensor);
  }
  if (o.wrapped.defined()) {
    return o.wrapped;
  }
  return wrappedNumber(at::Scalar(run.get(o.scalar)));
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

std::vector<int64_t> groupShape(const at::Tensor& t, const std::vector<std::vector<int64_t>>& groups) {
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

// A result with the output's logical axes, in its runtime dims.
at::Tensor toRuntime(const at::Tensor& r, const Store& s) {
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

void copySameSizes(at::Tensor& out, const at::Tensor& result) {
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

// Puts a result into `ins.out` as the evaluator's `_store` does: binds
// `fresh()` (in the output's runtime layout) if the output is not bound,
// else runs `into(view)` on the bound output's logical view. `full_rank`:
// the op computes at full rank, a selected slice's dim put back as 1.
template <typename Fresh, typename Into>
void store(Run& run, const Instr& ins, bool full_rank, Fresh fresh, Into into) {
  const Store& s = ins.store;
  const at::Tensor* bound = run.maybeTensor(ins.out);
  int dim = full_rank ? ins.out_dim : -1;
  if (s.slice || (s.runtime.empty() && s.logical.empty() && !s.partial)) {
    if (bound == nullptr) {
      at::Tensor r = fresh();
      run.bind(ins.out, dim < 0 ? r : r.squeeze(dim));
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
    run.bind(ins.out, toRuntime(r, s));
    return;
  }
  at::Tensor o = s.logical.empty() ? *bound : bound->reshape(groupShape(*bound, s.logical));
  if (s.partial) {
    o = o.squeeze(0);
  }
  into(o);
}

void binary(Run& run, const Instr& ins) {
  at::Tensor lhs =
      ins.lhs.tensor >= 0 ? viewed(ins, 0, operandTensor(run, ins.lhs)) : operandTensor(run, ins.lhs);
  at::Tensor rhs = ins.rhs.tensor >= 0 ? viewed(ins, 1, operandOther(run, ins.rhs)) : operandOther(run, ins.rhs);
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
  store(run, ins, false, fresh, [&](at::Tensor& o) {
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
at::Tensor unaryOf(OpKind kind, const at::Tensor& x, at::ScalarType dtype) {
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

void unary(Run& run, const Instr& ins) {
  at::Tensor x = viewed(ins, 0, run.tensor(ins.input));
  OpKind kind = ins.op_kind;
  at::ScalarType dtype = ins.dtype;
  store(
      run,
      ins,
      false,
      [&]() { return unaryOf(kind, x, dtype); },
      [&](at::Tensor& o) {
        // A cast copies, converting to the output's dtype.
        o.copy_(kind == OpKind::kCast ? x : unaryOf(kind, x, dtype));
      });
}

void permute(Run& run, const Instr& ins) {
  at::Tensor src = run.tensor(ins.input);
  if (!ins.views.empty()) {
    // On sharded tensors: this rank's piece, permuted, its sharded axes
    // moving with it (a view: the runtime dims only add size-1 dims and
    // split a dim), written into the output if it is bound.
    at::Tensor r = toRuntime(viewed(ins, 0, src).permute(ins.dims), ins.store);
    const at::Tensor* bound = run.maybeTensor(ins.out);
    if (bound != nullptr) {
      at::Tensor(*bound).copy_(r);
    } else {
      run.bind(ins.out, r);
    }
    return;
  }
  at::Tensor r = fullRank(src, ins.a_dim).permute(ins.dims);
  const at::Tensor* out = run.maybeTensor(ins.out);
  if (out != nullptr) {
    fullRank(*out, ins.out_dim).copy_(r);
    return;
  }
  run.bind(ins.out, ins.out_dim < 0 ? r : r.squeeze(ins.out_dim));
}

// Whether every axis a sum reduces has extent 1 in `src` and the sum keeps
// its dtype: then it is `src` without those axes.
bool unitSum(const Instr& ins, const at::Tensor& src) {
  if (!ins.view_sum || ins.op_kind != OpKind::kSum || src.scalar_type() != ins.dtype) {
    return false;
  }
  for (int64_t d : ins.dims) {
    if (src.size(d) != 1) {
      return false;
    }
  }
  return true;
}

void reduction(Run& run, const Instr& ins) {
  at::Tensor src = viewed(ins, 0, run.tensor(ins.input));
  OpKind kind = ins.op_kind;
  store(
      run,
      ins,
      false,
      [&]() {
        if (unitSum(ins, src)) {
          // A product made fresh in the program: its view, no kernel.
          return src.squeeze(ins.dims);
        }
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

// fusion_ops.py's UNEXPANDED_MIN and UNEXPANDED_MAX_CALLS.
constexpr int64_t kUnexpandedMin = int64_t{1} << 18;
constexpr int64_t kUnexpandedMaxCalls = 64;

// `matmul(a, b)` (into `out` if given), but where one operand is broadcast
// over leading batch dims that the other holds (the experts' weights beside
// tokens from every source rank), one matmul per leading index with the
// shared operand as it is: ATen's matmul copies it once per index to make
// one batched GEMM. fusion_ops.py's `matmul_unexpanded` does the same.
at::Tensor matmulUnexpanded(const at::Tensor& a, const at::Tensor& b, at::Tensor* out) {
  auto plain = [&]() { return out == nullptr ? at::matmul(a, b) : at::matmul_out(*out, a, b); };
  if (a.dim() < 3 || b.dim() < 3) {
    return plain();
  }
  std::vector<int64_t> batch = at::infer_size(a.sizes().slice(0, a.dim() - 2), b.sizes().slice(0, b.dim() - 2));
  auto n = static_cast<int64_t>(batch.size());
  auto padded = [&](const at::Tensor& t) {
    std::vector<int64_t> dims(n + 2 - t.dim(), 1);
    dims.insert(dims.end(), t.sizes().begin(), t.sizes().end() - 2);
    return dims;
  };
  std::vector<int64_t> a_batch = padded(a);
  std::vector<int64_t> b_batch = padded(b);
  int64_t lead = 0;
  int shared = 0;  // 1: a is shared, 2: b is
  while (lead < n && a_batch[lead] != b_batch[lead]) {
    int side = b_batch[lead] == 1 ? 2 : 1;
    if (shared != 0 && side != shared) {
      break;
    }
    shared = side;
    ++lead;
  }
  int64_t calls = 1;
  for (int64_t d = 0; d < lead; ++d) {
    calls *= batch[d];
  }
  std::vector<int64_t> shape(batch);
  shape.push_back(a.size(-2));
  shape.push_back(b.size(-1));
  const at::Tensor& one_of = shared == 1 ? a : b;
  if (shared == 0 ||
      !std::equal(a_batch.begin() + lead, a_batch.end(), b_batch.begin() + lead, b_batch.end()) ||
      calls > kUnexpandedMaxCalls || one_of.numel() < kUnexpandedMin ||
      (out != nullptr && out->sizes() != at::IntArrayRef(shape))) {
    return plain();
  }
  // The shared operand without its leading dims (each of size 1).
  std::vector<int64_t> full = shared == 1 ? a_batch : b_batch;
  full.push_back(one_of.size(-2));
  full.push_back(one_of.size(-1));
  at::Tensor one = one_of.reshape(full);
  for (int64_t d = 0; d < lead; ++d) {
    one = one.select(0, 0);
  }
  at::Tensor result = out != nullptr
      ? *out
      : at::empty(shape, a.options().dtype(at::promote_types(a.scalar_type(), b.scalar_type())));
  std::vector<int64_t> index(lead);
  for (int64_t i = 0; i < calls; ++i) {
    // The leading index of call i, in row-major order.
    int64_t rest = i;
    for (int64_t d = lead - 1; d >= 0; --d) {
      index[d] = rest % batch[d];
      rest /= batch[d];
    }
    at::Tensor other = shared == 1 ? b : a;
    at::Tensor into = result;
    for (int64_t d = 0; d < lead; ++d) {
      other = other.select(0, index[d]);
      into = into.select(0, index[d]);
    }
    if (shared == 2) {
      at::matmul_out(into, other, one);
    } else {
      at::matmul_out(into, one, other);
    }
  }
  return result;
}

// `out += a @ b` on the bound output, which holds the product's elements
// in its order (its runtime layout may add size-1 dims): with a 2-D `b`,
// one GEMM with beta = 1 (`a`'s leading dims folded into its rows), the sum
// rounded once; fusion_ops.py's `_accumulate` does the same.
void accumulate(Run& run, const Instr& ins, const at::Tensor& a, const at::Tensor& b, bool refused) {
  HOSTIR_CHECK(!refused, "a linear that accumulates into its output takes a 2-D weight and no bias");
  const at::Tensor* bound = run.maybeTensor(ins.out);
  HOSTIR_CHECK(bound != nullptr, "an op adds its product to an output that is not bound");
  at::Tensor out = *bound;
  if (b.dim() == 2) {
    at::Tensor rows = a.reshape({-1, a.size(-1)});
    HOSTIR_CHECK(
        out.numel() == rows.size(0) * b.size(1),
        "a product of ", rows.size(0), " x ", b.size(1), " does not fit its output of shape ", out.sizes());
    out.view({rows.size(0), b.size(1)}).addmm_(rows, b);
    return;
  }
  at::Tensor product = at::matmul(a, b);
  HOSTIR_CHECK(
      product.numel() == out.numel(),
      "a product of shape ", product.sizes(), " does not fit its output of shape ", out.sizes());
  out.add_(product.view(out.sizes()));
}

// `matmul(a, b).sum(dims, dtype)` over batch dims of the product, without
// the product: the summed batch indices walked in turn, each a batched GEMM
// into the result (beta = 1 after the first); over summed dims of extent 1,
// the product's view. fusion_ops.py's `sum_of_products` does the same.
at::Tensor sumOfProducts(
    const at::Tensor& a,
    const at::Tensor& b,
    const std::vector<int64_t>& dims,
    at::ScalarType dtype) {
  if (a.dim() < 2 || b.dim() < 2 || dtype != a.scalar_type() || dtype != b.scalar_type()) {
    return at::matmul(a, b).sum(dims, false, dtype);
  }
  std::vector<int64_t> batch = at::infer_size(a.sizes().slice(0, a.dim() - 2), b.sizes().slice(0, b.dim() - 2));
  auto nbatch = static_cast<int64_t>(batch.size());
  bool unit = true;
  for (int64_t d : dims) {
    if (d >= nbatch) {
      return at::matmul(a, b).sum(dims, false, dtype);
    }
    unit = unit && batch[d] == 1;
  }
  if (dims.empty()) {
    return at::matmul(a, b).sum(dims, false, dtype);
  }
  if (unit) {
    return at::matmul(a, b).squeeze(dims);
  }
  std::vector<int64_t> order(dims.begin(), dims.end());
  std::vector<int64_t> kept_sizes;
  int64_t summed = 1;
  int64_t kept = 1;
  for (int64_t d : dims) {
    summed *= batch[d];
  }
  for (int64_t d = 0; d < nbatch; ++d) {
    if (std::find(dims.begin(), dims.end(), d) == dims.end()) {
      order.push_back(d);
      kept_sizes.push_back(batch[d]);
      kept *= batch[d];
    }
  }
  order.push_back(nbatch);
  order.push_back(nbatch + 1);
  auto flat = [&](const at::Tensor& t) {
    std::vector<int64_t> shape(batch);
    shape.push_back(t.size(-2));
    shape.push_back(t.size(-1));
    return t.expand(shape).permute(order).reshape({summed, kept, t.size(-2), t.size(-1)});
  };
  at::Tensor a3 = flat(a);
  at::Tensor b3 = flat(b);
  kept_sizes.push_back(a.size(-2));
  kept_sizes.push_back(b.size(-1));
  at::Tensor out = at::empty(kept_sizes, a.options());
  at::Tensor rows = out.view({kept, a.size(-2), b.size(-1)});
  at::bmm_out(rows, a3[0], b3[0]);
  for (int64_t i = 1; i < summed; ++i) {
    rows.baddbmm_(a3[i], b3[i]);
  }
  return out;
}

void matmulOrLinear(Run& run, const Instr& ins) {
  at::Tensor a = viewed(ins, 0, fullRank(run.tensor(ins.a), ins.a_dim));
  at::Tensor b = viewed(ins, 1, fullRank(run.tensor(ins.b), ins.b_dim));
  std::optional<at::Tensor> bias;
  if (ins.bias >= 0) {
    bias = viewed(ins, 2, fullRank(run.tensor(ins.bias), ins.bias_dim));
  }
  bool linear = ins.op == Opcode::kLinear;
  if (ins.accumulate) {
    accumulate(run, ins, a, linear ? b.t() : b, linear && (bias.has_value() || b.dim() > 2));
    return;
  }
  if (!ins.sum_dims.empty()) {
    auto fresh = [&]() { return sumOfProducts(a, b, ins.sum_dims, ins.dtype); };
    store(run, ins, true, fresh, [&](at::Tensor& o) { o.copy_(fresh()); });
    return;
  }
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
    store(run, ins, true, fresh, [&](at::Tensor& o) { o.copy_(fresh()); });
    return;
  }
  if (linear) {
    store(
        run,
        ins,
        true,
        [&]() { return at::linear(a, b, bias); },
        [&](at::Tensor& o) { at::linear_out(o, a, b, bias); });
    return;
  }
  store(
      run,
      ins,
      true,
      [&]() { return matmulUnexpanded(a, b, nullptr); },
      [&](at::Tensor& o) { matmulUnexpanded(a, b, &o); });
}

// -- the index ops (fusion_ops.py's `topk_indices`, `route`, `take_rows` and
// `put_add_rows`, the same ATen calls), each at full rank, as the evaluator
// runs them; each writes into its output, if bound, by a copy.

// Operand `k` of `ins`, in `slot`, at full rank (`dim`: the dim a select
// removed from it).
at::Tensor fullOperand(Run& run, const Instr& ins, size_t k, int slot, int dim) {
  return viewed(ins, k, fullRank(run.tensor(slot), dim));
}

at::TensorOptions longsOn(const at::Tensor& t) {
  return at::TensorOptions().dtype(at::kLong).device(t.device());
}

// The pairs of router choices `indices` [*lead, T, k] ordered by expert,
// stably (argsort); a pair's place within its expert (within its group when
// `packed`) is its position in that order less the expert's (the group's)
// first one. Each pair's slot, each slot's token, or each expert's kept
// pairs.
at::Tensor routeOf(const at::Tensor& indices, const Instr& ins) {
  int64_t tokens = indices.size(-2);
  int64_t k = indices.size(-1);
  at::Tensor flat = indices.reshape({-1, tokens * k});
  int64_t n = flat.size(1);
  at::Tensor order = at::argsort(flat, /*stable=*/true, 1);
  at::Tensor counts = at::zeros({flat.size(0), ins.experts}, longsOn(flat));
  counts.scatter_add_(1, flat, at::ones_like(flat));
  int64_t per = ins.experts / ins.groups;
  at::Tensor starts;
  at::Tensor key;
  if (ins.packed) {
    // A group's pairs start after the earlier groups' pairs.
    at::Tensor group_counts = counts.view({-1, ins.groups, per}).sum(2);
    starts = (group_counts.cumsum(1) - group_counts).repeat_interleave(per, 1);
    key = at::floor_divide(flat, per);
  } else {
    starts = counts.cumsum(1) - counts;
    key = flat;
  }
  at::Tensor places = at::arange(n, longsOn(flat)).expand_as(flat) - starts.gather(1, flat.gather(1, order));
  at::Tensor within = at::empty_like(flat).scatter_(1, order, places);
  at::Tensor kept = within < ins.capacity;
  at::Tensor slot = at::where(kept, key * ins.capacity + within, -1);
  if (ins.what == "slot") {
    return slot.reshape(indices.sizes());
  }
  std::vector<int64_t> shape(indices.sizes().begin(), indices.sizes().end() - 2);
  if (ins.what == "counts") {
    at::Tensor out = at::zeros({flat.size(0), ins.experts}, longsOn(flat));
    out.scatter_add_(1, flat, kept.to(at::kLong));
    shape.insert(shape.end(), {ins.groups, per});
    return out.reshape(shape);
  }
  int64_t rows = (ins.packed ? ins.groups : ins.experts) * ins.capacity;
  at::Tensor source = at::full({flat.size(0), rows + 1}, -1, longsOn(flat));
  at::Tensor token = at::floor_divide(at::arange(n, longsOn(flat)), k).expand_as(flat);
  // A dropped pair writes the extra last column, which is cut off.
  source.scatter_(1, at::where(slot >= 0, slot, rows), token);
  if (ins.packed) {
    shape.insert(shape.end(), {ins.groups, ins.capacity});
  } else {
    shape.insert(shape.end(), {ins.groups, per, ins.capacity});
  }
  return source.slice(1, 0, rows).reshape(shape);
}

// A tensor of `shape` as (batch elements, rows per batch element, features
// per row): its leading `batch` dims, the dims between, its trailing
// `features` dims.
std::array<int64_t, 3> rowsOf(c10::IntArrayRef shape, const Instr& ins) {
  int64_t end = static_cast<int64_t>(shape.size()) - ins.features;
  std::array<int64_t, 3> counts = {1, 1, 1};
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    counts[d < ins.batch ? 0 : d < end ? 1 : 2] *= shape[d];
  }
  return counts;
}

// Each index as a row of the flattened [batch * rows] rows; a negative one
// as `missing`.
at::Tensor flatIndex(const at::Tensor& index, int64_t batch_count, int64_t rows, int64_t missing) {
  at::Tensor idx = index.reshape({batch_count, -1});
  at::Tensor offsets = at::arange(batch_count, longsOn(idx)).unsqueeze(1) * rows;
  return at::where(idx >= 0, idx + offsets, missing).reshape({-1});
}

// `t` viewed as 8-byte words where its rows allow it, else `t` itself: a
// select or fill whose mask is broadcast along the rows moves words at
// about a copy's bandwidth, 2-byte elements at less than half
// (fusion_ops.py's `as_words`).
at::Tensor asWords(const at::Tensor& t) {
  int64_t size = t.element_size();
  if (size >= 8 || t.dim() == 0 || t.stride(-1) != 1 || t.size(-1) * size % 8 != 0 ||
      t.storage_offset() * size % 8 != 0) {
    return t;
  }
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.stride(d) * size % 8 != 0) {
      return t;
    }
  }
  return t.view(at::kLong);
}

// `a` and `b` as words where both can be, else both as they are
// (fusion_ops.py's `as_words_together`).
std::pair<at::Tensor, at::Tensor> asWordsTogether(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor wa = asWords(a);
  at::Tensor wb = asWords(b);
  if (wa.scalar_type() != wb.scalar_type()) {
    return {a, b};
  }
  return {wa, wb};
}

// The rows of `x` at `index`, zeros where it is negative.
at::Tensor takeRows(const at::Tensor& x, const at::Tensor& index, const Instr& ins) {
  auto [nb, rows, f] = rowsOf(x.sizes(), ins);
  std::vector<int64_t> shape(index.sizes().begin(), index.sizes().end());
  shape.insert(shape.end(), x.sizes().end() - ins.features, x.sizes().end());
  // A negative index reads a zero row: one appended to the rows where they
  // are fewer than the picks (a copy of the smaller tensor), else the picks
  // it gave are zeroed after the gather (`take_rows`).
  if (nb * rows < index.numel()) {
    at::Tensor padded = at::cat({x.reshape({nb * rows, f}), at::zeros({1, f}, x.options())});
    return padded.index_select(0, flatIndex(index, nb, rows, nb * rows)).reshape(shape);
  }
  at::Tensor out = x.reshape({nb * rows, f}).index_select(0, flatIndex(index, nb, rows, 0));
  asWords(out).masked_fill_((index < 0).reshape({-1, 1}), 0);
  return out.reshape(shape);
}

// The rows of `x` added at `index` into zeros of `like`'s sizes; a
// negative index adds into an extra last row, which is cut off. `distinct`
// (each row named at most once): copied in as words, no atomic adds.
at::Tensor putAddRows(const at::Tensor& x, const at::Tensor& index, c10::IntArrayRef like, const Instr& ins) {
  auto [nb, rows, f] = rowsOf(like, ins);
  at::Tensor flat = flatIndex(index, nb, rows, nb * rows);
  at::Tensor out = at::zeros({nb * rows + 1, f}, x.options());
  at::Tensor src = x.reshape({-1, f});
  if (ins.distinct) {
    auto [words, into] = asWordsTogether(src, out);
    into.index_copy_(0, flat, words);
  } else {
    out.index_add_(0, flat, src);
  }
  return out.slice(0, 0, nb * rows).view(like);
}

// Binds `fresh()` to the output, or copies it into the bound output, as
// the evaluator's index ops do.
template <typename Fresh>
void storeCopy(Run& run, const Instr& ins, Fresh fresh) {
  store(run, ins, true, fresh, [&](at::Tensor& o) { o.copy_(fresh()); });
}

void topk(Run& run, const Instr& ins) {
  at::Tensor x = fullOperand(run, ins, 0, ins.input, ins.a_dim);
  storeCopy(run, ins, [&]() { return std::get<1>(at::topk(x, ins.k, -1)); });
}

void route(Run& run, const Instr& ins) {
  at::Tensor indices = fullOperand(run, ins, 0, ins.input, ins.a_dim);
  storeCopy(run, ins, [&]() { return routeOf(indices, ins); });
}

void take(Run& run, const Instr& ins) {
  at::Tensor x = fullOperand(run, ins, 0, ins.input, ins.a_dim);
  at::Tensor index = fullOperand(run, ins, 1, ins.b, ins.b_dim);
  storeCopy(run, ins, [&]() { return takeRows(x, index, ins); });
}

void putAdd(Run& run, const Instr& ins) {
  at::Tensor x = fullOperand(run, ins, 0, ins.input, ins.a_dim);
  at::Tensor index = fullOperand(run, ins, 1, ins.b, ins.b_dim);
  at::Tensor like = fullOperand(run, ins, 2, ins.like, ins.like_dim);
  storeCopy(run, ins, [&]() { return putAddRows(x, index, like.sizes(), ins); });
}

// -- the grouped ops (fusion_ops.py's `grouped_mm` and `grouped_outer`, the
// same ATen calls), at full rank as the evaluator runs them; each writes
// into its output, if bound, by a copy.

// Whether torch's grouped GEMM kernel takes `x` and these inner sizes
// (`_kernel_fits`): bfloat16 on a CUDA device of compute capability 9.0 or
// more (`ins.grouped_kernel`: the program's device, asked when the program
// was made), every row stride a multiple of 16 bytes. Elsewhere a matmul
// per group computes the same.
bool kernelFits(const Instr& ins, const at::Tensor& x, std::initializer_list<int64_t> sizes) {
  if (!x.is_cuda() || x.scalar_type() != at::kBFloat16 || !ins.grouped_kernel) {
    return false;
  }
  int64_t item = static_cast<int64_t>(x.element_size());
  return std::all_of(sizes.begin(), sizes.end(), [&](int64_t n) { return n * item % 16 == 0; });
}

int64_t product(c10::IntArrayRef sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) {
    n *= s;
  }
  return n;
}

// (start, end) of each group's rows, per batch element, from `counts`
// [*batch, G] read on the host (`_group_rows` of `counts.tolist()`), which
// must be >= 0 and total at most `limit` rows.
std::vector<std::vector<std::pair<int64_t, int64_t>>> groupRows(
    const at::Tensor& counts, int64_t nb, int64_t groups, int64_t limit) {
  at::Tensor host = counts.reshape({nb, groups}).to(at::kCPU, at::kLong).contiguous();
  const int64_t* c = host.const_data_ptr<int64_t>();
  std::vector<std::vector<std::pair<int64_t, int64_t>>> rows(nb);
  for (int64_t i = 0; i < nb; ++i) {
    int64_t end = 0;
    for (int64_t g = 0; g < groups; ++g) {
      int64_t start = end;
      HOSTIR_CHECK(
          c[i * groups + g] >= 0 && end + c[i * groups + g] <= limit, "grouped rows: the counts of batch element ", i,
          " must be >= 0 and total at most the ", limit, " rows");
      end += c[i * groups + g];
      rows[i].emplace_back(start, end);
    }
  }
  return rows;
}

// `ir.GroupedMmOp`: `x` [*batch, R, K], `weight` [*wbatch, G, N, K] (its
// batch axes a suffix of `x`'s: batch element i takes weight i % nw),
// `counts` [*batch, G]. `at::_grouped_mm` per batch element where its
// kernel takes the operands (no host synchronization), the rows past the
// groups' total zeroed by a mask; else one matmul per group, sized by the
// counts read on the host. On the meta device: the result's shape only.
// `into`, a contiguous tensor of the result's shape (the bound output),
// takes the result in place of a fresh one (`grouped_mm`'s `out`).
at::Tensor groupedMm(
    const Instr& ins, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& counts,
    const at::Tensor* into = nullptr) {
  int64_t rows = x.size(-2);
  int64_t k = x.size(-1);
  int64_t groups = weight.size(-3);
  int64_t n = weight.size(-2);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 2);
  int64_t nb = product(shape);
  int64_t nw = product(weight.sizes().slice(0, weight.dim() - 3));
  shape.insert(shape.end(), {rows, n});
  if (x.is_meta()) {
    return at::empty(shape, x.options());
  }
  at::Tensor xs = x.reshape({nb, rows, k});
  at::Tensor ws = weight.reshape({nw, groups, n, k});
  if (!kernelFits(ins, x, {k, n})) {
    at::Tensor out = into != nullptr ? into->view({nb, rows, n}).zero_() : at::zeros({nb, rows, n}, x.options());
    auto bounds = groupRows(counts, nb, groups, rows);
    for (int64_t i = 0; i < nb; ++i) {
      for (int64_t g = 0; g < groups; ++g) {
        auto [start, end] = bounds[i][g];
        at::Tensor o = out.select(0, i).slice(0, start, end);
        at::matmul_out(o, xs.select(0, i).slice(0, start, end), ws.select(0, i % nw).select(0, g).transpose(0, 1));
      }
    }
    return out.reshape(shape);
  }
  at::Tensor offs = counts.reshape({nb, groups}).cumsum(-1).to(at::kInt);
  // `_grouped_mm` leaves the rows past the groups' total unwritten: one
  // pass puts each element's product, or a zero past the rows, as 8-byte
  // words (`asWords`; a row is a multiple of 16 bytes where the kernel runs).
  at::Tensor real = (at::arange(rows, longsOn(x)).unsqueeze(0) < offs.slice(1, -1).to(at::kLong)).unsqueeze(-1);
  at::Tensor out = into != nullptr ? into->view({nb, rows, n}) : at::empty({nb, rows, n}, x.options());
  for (int64_t i = 0; i < nb; ++i) {
    at::Tensor product = at::_grouped_mm(xs.select(0, i), ws.select(0, i % nw).transpose(-2, -1), offs.select(0, i));
    auto [words, into] = asWordsTogether(product, out.select(0, i));
    at::where_out(into, real.select(0, i), words, at::zeros({}, words.options()));
  }
  return out.reshape(shape);
}

// `ir.GroupedOuterOp`: `x` [*batch, R, N], `other` [*batch, R, K], `counts`
// [*batch, G]; per group `x_g^T other_g` ([G, N, K], zeros for a group
// without rows), summed over the leading batch axes past the trailing
// `wbatch` ones (batch element i into i % nw), in float32 for a half type.
// `at::_grouped_mm(x^T, other, offs)` where its kernel takes the operands,
// else a matmul per group sized by the counts read on the host. On the meta
// device: the result's shape only.
at::Tensor groupedOuter(const Instr& ins, const at::Tensor& x, const at::Tensor& other, const at::Tensor& counts) {
  int64_t wbatch = ins.wbatch;
  int64_t rows = x.size(-2);
  int64_t n = x.size(-1);
  int64_t k = other.size(-1);
  int64_t groups = counts.size(-1);
  std::vector<int64_t> batch(x.sizes().begin(), x.sizes().end() - 2);
  HOSTIR_CHECK(
      wbatch >= 0 && wbatch <= static_cast<int64_t>(batch.size()),
      "a grouped_outer keeping ", wbatch, " batch axes of rows with ", batch.size());
  std::vector<int64_t> shape(batch.end() - wbatch, batch.end());
  int64_t nb = product(batch);
  int64_t nw = product(shape);
  shape.insert(shape.end(), {groups, n, k});
  if (x.is_meta()) {
    return at::empty(shape, x.options());
  }
  at::Tensor xs = x.reshape({nb, rows, n});
  at::Tensor os = other.reshape({nb, rows, k});
  at::ScalarType dtype = x.scalar_type();
  at::ScalarType wide = dtype == at::kHalf || dtype == at::kBFloat16 ? at::kFloat : dtype;
  if (nb > 0 && kernelFits(ins, x, {k, n, rows})) {
    at::Tensor offs = counts.reshape({nb, groups}).cumsum(-1).to(at::kInt);
    auto productOf = [&](int64_t i) {
      return at::_grouped_mm(xs.select(0, i).transpose(0, 1), os.select(0, i), offs.select(0, i));
    };
    std::vector<at::Tensor> sums;
    for (int64_t w = 0; w < nw; ++w) {
      // Batch elements w, w + nw, ... share weight w. Two products are
      // added as ATen adds a half type, in float32 rounded once (what a
      // float32 sum would give); more, in a float32 sum.
      int64_t terms = nb / nw;
      at::Tensor acc = productOf(w);
      if (terms == 2) {
        acc = acc + productOf(w + nw);
      } else if (terms > 2) {
        acc = acc.to(wide);
        for (int64_t i = w + nw; i < nb; i += nw) {
          acc.add_(productOf(i));
        }
        acc = acc.to(dtype);
      }
      sums.push_back(acc);
    }
    return (nw == 1 ? sums[0] : at::stack(sums)).reshape(shape);
  }
  at::Tensor out = at::zeros({nw, groups, n, k}, x.options().dtype(wide));
  {
    auto bounds = groupRows(counts, nb, groups, rows);
    for (int64_t i = 0; i < nb; ++i) {
      for (int64_t g = 0; g < groups; ++g) {
        auto [start, end] = bounds[i][g];
        at::Tensor xg = xs.select(0, i).slice(0, start, end).transpose(0, 1).to(wide);
        at::Tensor og = os.select(0, i).slice(0, start, end).to(wide);
        out.select(0, i % nw).select(0, g).add_(at::matmul(xg, og));
      }
    }
  }
  return out.to(dtype).reshape(shape);
}

void groupedMmOp(Run& run, const Instr& ins) {
  at::Tensor x = fullOperand(run, ins, 0, ins.input, ins.a_dim);
  at::Tensor weight = fullOperand(run, ins, 1, ins.b, ins.b_dim);
  at::Tensor counts = fullOperand(run, ins, 2, ins.counts, ins.counts_dim);
  auto fresh = [&]() { return groupedMm(ins, x, weight, counts); };
  store(run, ins, true, fresh, [&](at::Tensor& o) {
    // Straight into a bound output of the result's shape and dtype (a
    // stream loop's piece) that shares no memory with an operand, else a
    // fresh result copied in.
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
    shape.push_back(weight.size(-2));
    bool apart = !o.is_alias_of(x) && !o.is_alias_of(weight) && !o.is_alias_of(counts);
    if (apart && o.is_contiguous() && o.sizes().vec() == shape && o.scalar_type() == x.scalar_type() &&
        !x.is_meta()) {
      groupedMm(ins, x, weight, counts, &o);
    } else {
      o.copy_(fresh());
    }
  });
}

void groupedOuterOp(Run& run, const Instr& ins) {
  at::Tensor x = fullOperand(run, ins, 0, ins.input, ins.a_dim);
  at::Tensor other = fullOperand(run, ins, 1, ins.b, ins.b_dim);
  at::Tensor counts = fullOperand(run, ins, 2, ins.counts, ins.counts_dim);
  storeCopy(run, ins, [&]() { return groupedOuter(ins, x, other, counts); });
}

// -- the shape ops that cut and join (fusion_ops.py's `_slice`, `_cat`,
// `_insert`), at full rank as the evaluator runs them.

// `t` cut by `ranges` ((start, stop, step) per dim, stop -1: to the end):
// a view. A start or stop past a dim's size is an error, as the evaluator's
// (the Python side names the op).
at::Tensor sliced(const at::Tensor& t, const std::vector<int64_t>& ranges) {
  at::Tensor r = t;
  for (size_t k = 0; k * 3 < ranges.size(); ++k) {
    int64_t start = ranges[3 * k], stop = ranges[3 * k + 1], step = ranges[3 * k + 2];
    int64_t size = t.size(static_cast<int64_t>(k));
    if (start > size || stop > size) {
      throw Error(
          text("axis ", k, " has size ", size, "; the slice [", start, ":", stop < 0 ? std::string("None") :
               std::to_string(stop), "] is out of range"),
          "ShapeError");
    }
    if (start != 0 || stop >= 0 || step != 1) {
      r = r.slice(static_cast<int64_t>(k), start, stop < 0 ? size : stop, step);
    }
  }
  return r;
}

void sliceOp(Run& run, const Instr& ins) {
  at::Tensor r = sliced(fullRank(run.tensor(ins.input), ins.a_dim), ins.ranges);
  const at::Tensor* bound = run.maybeTensor(ins.out);
  if (bound != nullptr) {
    fullRank(*bound, ins.out_dim).copy_(r);
    return;
  }
  run.bind(ins.out, ins.out_dim < 0 ? r : r.squeeze(ins.out_dim));
}

void catOp(Run& run, const Instr& ins) {
  at::Tensor a = fullOperand(run, ins, 0, ins.input, ins.a_dim);
  at::Tensor b = fullOperand(run, ins, 1, ins.b, ins.b_dim);
  store(run, ins, true, [&]() { return at::cat({a, b}, ins.dim); }, [&](at::Tensor& o) {
    o.narrow(ins.dim, 0, a.size(ins.dim)).copy_(a);
    o.narrow(ins.dim, a.size(ins.dim), b.size(ins.dim)).copy_(b);
  });
}

void insertOp(Run& run, const Instr& ins) {
  at::Tensor src = fullOperand(run, ins, 0, ins.input, ins.a_dim);
  at::Tensor like = fullOperand(run, ins, 1, ins.like, ins.like_dim);
  auto fill = [&](at::Tensor& o) {
    if (!ins.ranges.empty()) {
      sliced(o, ins.ranges).copy_(src);
    } else {
      o.select(ins.dim, run.get(ins.index)).copy_(src);
    }
  };
  store(
      run, ins, true,
      [&]() {
        at::Tensor o = at::zeros(like.sizes(), like.options().dtype(ins.dtype));
        fill(o);
        return o;
      },
      [&](at::Tensor& o) {
        o.zero_();
        fill(o);
      });
}

} // namespace

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

void prepareCompute(Instr& ins) {
  if (ins.op == Opcode::kBinary || ins.op == Opcode::kReduction || ins.op == Opcode::kUnary) {
    ins.op_kind = opKind(ins.kind, ins.op);
  }
  if (ins.op == Opcode::kBinary && ins.rhs.is_number) {
    ins.rhs.wrapped = wrappedNumber(ins.rhs.number);
  }
  if (ins.op == Opcode::kRoute && ins.what != "slot" && ins.what != "source" && ins.what != "counts") {
    throw Error(text("a route gives 'slot', 'source' or 'counts', not '", ins.what, "'"), "ProgramError");
  }
}

void compute(Run& run, const Instr& ins) {
  switch (ins.op) {
    case Opcode::kBinary:
      binary(run, ins);
      break;
    case Opcode::kUnary:
      unary(run, ins);
      break;
    case Opcode::kPermute:
      permute(run, ins);
      break;
    case Opcode::kReduction:
      reduction(run, ins);
      break;
    case Opcode::kMatmul:
    case Opcode::kLinear:
      matmulOrLinear(run, ins);
      break;
    case Opcode::kTopK:
      topk(run, ins);
      break;
    case Opcode::kRoute:
      route(run, ins);
      break;
    case Opcode::kTake:
      take(run, ins);
      break;
    case Opcode::kPutAdd:
      putAdd(run, ins);
      break;
    case Opcode::kGroupedMm:
      groupedMmOp(run, ins);
      break;
    case Opcode::kGroupedOuter:
      groupedOuterOp(run, ins);
      break;
    case Opcode::kSlice:
      sliceOp(run, ins);
      break;
    case Opcode::kCat:
      catOp(run, ins);
      break;
    case Opcode::kInsert:
      insertOp(run, ins);
      break;
    default:
      throw Error(text("instruction ", run.indexOf(ins), " is no compute op"), "ProgramError");
  }
}

at::Tensor reducedInput(Run& run, const Instr& ins) {
  const at::Tensor& src = run.tensor(ins.input);
  if (ins.local_reduce.empty()) {
    return src;
  }
  if (ins.red_op == "sum") {
    return at::sum(src, ins.local_reduce, true);
  }
  return ins.red_op == "max" ? at::amax(src, ins.local_reduce, true) : at::amin(src, ins.local_reduce, true);
}

void chunkView(Run& run, const Instr& ins) {
  const at::Tensor& src = run.tensor(ins.input);
  int64_t size = src.size(ins.dim);
  int64_t parts = run.get(ins.parts);
  int64_t index = run.get(ins.index);
  if (parts < 1) {
    throw Error(text("cannot cut an axis into ", parts, " chunks"), "BindingError");
  }
  if (ins.equal && size % parts != 0) {
    throw Error(text("axis ", ins.dim, " of size ", size, " does not split into ", parts, " equal pieces"), "BindingError");
  }
  // layout.chunk_bounds: ceilDiv(size, parts) rows per chunk, the last ones
  // shorter or empty.
  int64_t step = (size + parts - 1) / parts;
  int64_t start = std::min(index * step, size);
  run.bind(ins.out, src.narrow(ins.dim, start, std::max<int64_t>(0, std::min(step, size - start))));
}

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

} // namespace hostir
