// The NCCL and gloo transport, the C++ twin of python/hostir/runtime/
// transports/torch_dist.py: collectives and P2P posted on the
// c10d::ProcessGroup objects the Python communicator created. Never hand a
// strided view to a collective: gloo would read or write the wrong memory.
#include "transport.h"

#include <limits>
#include <utility>

// _allgather_base and _reduce_scatter_base are the names every supported
// torch has (2.13 deprecates them for all_gather_single and
// reduce_scatter_single, which 2.11 lacks).
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace hostir {
namespace {

// What a reducing collective is handed for `t`: bool buffers go as uint8
// (the same bytes), so a max or min is a logical or / and on every backend.
at::Tensor onWire(const at::Tensor& t) {
  return t.scalar_type() == at::kBool ? t.view(at::kByte) : t;
}

at::Tensor contiguous(const at::Tensor& t) {
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
  // The staging buffer has the output's sizes, viewed as `shape` (which
  // may say -1, as a view does).
  at::Tensor staging = at::empty(out.sizes(), out.options());
  at::Tensor target = out;
  return {staging.view(shape), [staging, target]() { target.copy_(staging); }};
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

at::Tensor indexTensor(const std::vector<int64_t>& perm, const at::Tensor& like) {
  return at::tensor(perm, at::TensorOptions().dtype(at::kLong)).to(like.device());
}

// Only NCCL groups coalesce P2P operations themselves (gloo refuses
// startCoalescing, also on CUDA tensors, as when two ranks share one GPU):
// for any other backend a group's works are collected and waited on
// together.
bool groupCoalesces(Run& run) {
  return run.program().device.is_cuda() &&
      run.worldGroup()->getBackendType() == c10d::ProcessGroup::BackendType::NCCL;
}

// gloo's sends and receives read and write host addresses only: a device
// buffer handed to them is read as whatever the address maps to on the
// host. The lowering refuses such programs on every rank
// (`torch_dist.check_backends`); this guards a program built by hand.
void checkCarries(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& buf) {
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

using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

Posted allgather(Run& run, const Instr& ins, const Group& group) {
  Posted posted;
  at::Tensor src = contiguous(run.tensor(ins.input));
  at::Tensor out = run.tensor(ins.out);
  auto full = run.sizes(ins.in_full);
  int64_t a = ins.in_axis;
  at::Tensor flat_src = src.reshape({-1});
  if (outermost(full, a) && ins.in_order) {
    auto [buf, after] = staged(out, {-1});
    posted.works.push_back(group->_allgather_base(buf, flat_src));
    posted.after = after;
    return posted;
  }
  // Gather into [n, *local] in the group's order, then put each rank's
  // piece at its position in the team, on the sharded axis.
  std::vector<int64_t> shape{ins.team_size};
  shape.insert(shape.end(), src.sizes().begin(), src.sizes().end());
  at::Tensor staging = at::empty(shape, src.options());
  at::Tensor flat = staging.view({-1});
  posted.works.push_back(group->_allgather_base(flat, flat_src));
  at::Tensor index = indexTensor(ins.perm, src);
  posted.after = [staging, index, a, out]() mutable {
    at::Tensor moved = staging.index_select(0, index).squeeze(a + 1).movedim(0, a);
    out.copy_(moved.reshape(out.sizes()));
  };
  return posted;
}

Posted allreduce(Run& run, const Instr& ins, const Group& group) {
  Posted posted;
  at::Tensor src = reducedInput(run, ins);
  at::Tensor out = run.tensor(ins.out);
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
  return posted;
}

Posted reduceScatter(Run& run, const Instr& ins, const Group& group) {
  Posted posted;
  at::Tensor src = reducedInput(run, ins);
  at::Tensor out = run.tensor(ins.out);
  // The output's local sizes with the team's pieces of its sharded dim.
  int64_t b = ins.out_axis;
  std::vector<int64_t> full(out.sizes().begin(), out.sizes().end());
  full[b] *= ins.team_size;
  at::Tensor whole = src.reshape(full);
  if (!outermost(full, b)) {
    whole = whole.movedim(b, 0);
  }
  if (!ins.in_order) {
    whole = whole.reshape({ins.team_size, -1}).index_select(0, indexTensor(ins.perm, src));
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
  return posted;
}

Posted broadcast(Run& run, const Instr& ins, const Group& group) {
  Posted posted;
  c10d::BroadcastOptions opts;
  opts.rootRank = ins.root;
  const at::Tensor* outp = ins.out >= 0 ? &run.tensor(ins.out) : nullptr;
  if (ins.is_root) {
    const at::Tensor& src = run.tensor(ins.input);
    if (outp == nullptr) {
      std::vector<at::Tensor> bufs{contiguous(src)};
      posted.works.push_back(group->broadcast(bufs, opts));
      return posted;
    }
    at::Tensor(*outp).copy_(src.reshape(outp->sizes()));
  }
  HOSTIR_CHECK(
      outp != nullptr, "value ", run.program().tensor_names[ins.out < 0 ? 0 : ins.out], " is not bound");
  at::Tensor out = *outp;
  auto [buf, after] = staged(out, out.sizes());
  std::vector<at::Tensor> bufs{buf};
  posted.works.push_back(group->broadcast(bufs, opts));
  posted.after = after;
  return posted;
}

Posted gather(Run& run, const Instr& ins, const Group& group) {
  Posted posted;
  at::Tensor src = ins.input >= 0
      ? contiguous(run.tensor(ins.input))
      // The root is outside the sender mesh: it sends a dummy piece.
      : at::empty(run.sizes(ins.in_shape), at::TensorOptions().dtype(ins.dtype_in).device(run.program().device));
  c10d::GatherOptions opts;
  opts.rootRank = ins.root;
  std::vector<at::Tensor> inputs{src};
  if (!ins.is_root) {
    std::vector<std::vector<at::Tensor>> none;
    posted.works.push_back(group->gather(none, inputs, opts));
    return posted;
  }
  at::Tensor out = run.tensor(ins.out);
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
  return posted;
}

Posted scatter(Run& run, const Instr& ins, const Group& group) {
  Posted posted;
  at::Tensor out_buf;
  std::function<void()> after;
  if (ins.out < 0) {
    // The root is outside the receiver mesh: it receives a dummy piece.
    out_buf = at::empty(
        run.sizes(ins.out_shape), at::TensorOptions().dtype(ins.dtype_out).device(run.program().device));
  } else {
    at::Tensor out = run.tensor(ins.out);
    std::tie(out_buf, after) = staged(out, out.sizes());
  }
  c10d::ScatterOptions opts;
  opts.rootRank = ins.root;
  std::vector<at::Tensor> outputs{out_buf};
  std::vector<std::vector<at::Tensor>> inputs;
  if (ins.is_root) {
    at::Tensor whole = run.tensor(ins.input).reshape(run.sizes(ins.out_full));
    auto chunks = whole.chunk(ins.chunks, ins.out_axis);
    std::vector<at::Tensor> pieces;
    for (int64_t j : ins.perm) {
      pieces.push_back(contiguous(chunks[j]).view(out_buf.sizes()));
    }
    inputs.push_back(std::move(pieces));
  }
  posted.works.push_back(group->scatter(outputs, inputs, opts));
  posted.after = after;
  return posted;
}

Posted reduce(Run& run, const Instr& ins, const Group& group) {
  Posted posted;
  c10d::ReduceOptions opts;
  opts.rootRank = ins.root;
  opts.reduceOp = reduceOp(ins.red_op);
  at::Tensor piece;
  at::Tensor buf;
  if (!ins.is_root) {
    // Every rank posts the output's shape.
    // In the output's dtype, as the root's buffer is.
    piece = reducedInput(run, ins)
                .reshape(run.sizes(ins.out_shape))
                .to(ins.dtype_out)
                .clone(at::MemoryFormat::Contiguous);
  } else {
    at::Tensor out = run.tensor(ins.out);
    std::tie(buf, posted.after) = staged(out, out.sizes());
    if (ins.input >= 0) {
      buf.copy_(reducedInput(run, ins).reshape(out.sizes()));
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
  return posted;
}

// Team position j gets the j-th piece of the output's sharded (logical)
// axis `out_axis` of this rank's input; the piece from position j goes to
// the j-th place of the input's sharded axis `in_axis`. The buffers are in
// the group's order.
Posted allToAll(Run& run, const Instr& ins, const Group& group) {
  Posted posted;
  at::Tensor src = applyView(ins.in_view, run.tensor(ins.input));
  at::Tensor out = run.tensor(ins.out);
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
  return posted;
}

// Piece j of a sized AllToAll's logical tensor `t` sharded on its leading
// axis `axis` (0 or 1): t[0, j] or t[j, 0], as torch_dist.py's `piece`.
at::Tensor piece(const at::Tensor& t, int64_t axis, int64_t j) {
  return axis == 0 ? t.select(0, 0).select(0, j) : t.select(0, j).select(0, 0);
}

// The real rows of each of a sized AllToAll's `n` pieces, by the counts
// `counts` (logical [1, n, ...] or [n, 1, ...]), summed over their trailing
// axes: an int64 tensor of [n] where the counts have n pieces (still on
// the counts' device), as torch_dist.py's `_piece_rows` before its host read.
at::Tensor pieceRows(const at::Tensor& counts) {
  HOSTIR_CHECK(
      counts.dim() >= 2, "the counts of a sized AllToAll need two leading piece axes, got shape ", counts.sizes());
  return counts.reshape({counts.size(0) * counts.size(1), -1}).sum(1).to(at::kLong);
}

// The checks of `_piece_rows` on counts read on the host: as many pieces as
// the team has, each in [0, bound].
std::vector<int64_t> checkedRows(
    const at::Tensor& host,
    int64_t n,
    int64_t bound,
    const char* what,
    const std::string& name) {
  int64_t count = host.numel();
  if (count != n) {
    throw Error(text(what, " ", name, " counts ", count, " pieces, not ", n), "TransportUsageError");
  }
  const int64_t* data = host.data_ptr<int64_t>();
  std::vector<int64_t> per(data, data + count);
  for (int64_t j = 0; j < n; ++j) {
    if (per[j] < 0 || per[j] > bound) {
      throw Error(
          text(what, " ", name, " says piece ", j, " has ", per[j], " rows, outside the bound [0, ", bound, "]"),
          "TransportUsageError");
    }
  }
  return per;
}

// An AllToAll sized at run time (`ir.Set`'s `rows`), as torch_dist.py's
// `_post_all_to_all_rows`: the leading two logical axes are the sender's
// and the receiver's piece; this rank sends piece j's first rows[j] rows
// (summed over the counts' trailing axes) to team position j and receives
// position j's into the first rows_in[j] rows of its piece j, the rest
// zeros. The counts are read on the host (one synchronization, both at
// once) and checked as `_piece_rows` checks them: the messages take their
// sizes there. The pieces go as they lie,
// one message to and from each peer (empty where a piece has no rows), batched (as
// `batch_isend_irecv`: one NCCL group, or gloo's asynchronous messages);
// its own piece is a copy. So both runners put the same messages on the
// wire, on every backend.
Posted allToAllRows(Run& run, const Instr& ins, const Group& group) {
  Posted posted;
  const int64_t n = ins.team_size;
  at::Tensor src = applyView(ins.in_view, run.tensor(ins.input));
  at::Tensor out = run.tensor(ins.out);
  const int64_t a = ins.in_axis;
  const int64_t b = ins.out_axis;
  HOSTIR_CHECK(
      src.dim() >= 3 && a < 2 && b < 2,
      "a sized AllToAll moves [sender piece, receiver piece, rows, ...] sharded on one of its two leading axes, got "
      "shape ",
      src.sizes());
  const int64_t bound = src.size(2);
  at::Tensor counts = applyView(ins.rows_view, run.tensor(ins.rows));
  at::Tensor counts_in = applyView(ins.rows_in_view, run.tensor(ins.rows_in));
  // (A dry run, which moves the bound, is the Python evaluator's alone.)
  at::Tensor per = pieceRows(counts);
  at::Tensor per_in = pieceRows(counts_in);
  at::Tensor host = at::cat({per, per_in}).cpu();
  const int64_t split = per.numel();
  std::vector<int64_t> sent = checkedRows(host.narrow(0, 0, split).contiguous(), n, bound, "rows", ins.rows_text);
  std::vector<int64_t> got =
      checkedRows(host.narrow(0, split, host.numel() - split).contiguous(), n, bound, "rows_in", ins.rows_in_text);
  const int64_t me = ins.me;
  if (sent.at(me) != got.at(me)) {
    throw Error(
        text("this rank keeps ", sent[me], " rows of its own piece by rows but ", got[me], " by rows_in: ",
             ins.rows_text, " and ", ins.rows_in_text, " disagree"),
        "TransportUsageError");
  }
  // The output with its logical axes: `out` itself where it is contiguous,
  // else a staging buffer copied into it once the exchange is done.
  std::vector<int64_t> logical_shape;
  if (ins.out_view.logical.empty()) {
    logical_shape = out.sizes().vec();
  } else {
    for (const auto& dims : ins.out_view.logical) {
      int64_t size = 1;
      for (int64_t d : dims) {
        size *= out.size(d);
      }
      logical_shape.push_back(size);
    }
  }
  const bool direct = out.is_contiguous();
  at::Tensor whole = direct ? out.view(logical_shape) : at::empty(logical_shape, out.options());
  std::function<void()> copy_out;
  if (!direct) {
    at::Tensor target = out;
    copy_out = [whole, target]() mutable { target.copy_(whole.reshape(target.sizes())); };
  }
  // By team position: the rows sent to j and those received from j.
  std::vector<at::Tensor> sends, recvs;
  sends.reserve(n);
  recvs.reserve(n);
  for (int64_t j = 0; j < n; ++j) {
    at::Tensor mine = piece(whole, b, j);
    mine.slice(0, got[j]).zero_();
    sends.push_back(contiguous(piece(src, a, j).slice(0, 0, sent[j])));
    recvs.push_back(mine.slice(0, 0, got[j]));
  }
  recvs[me].copy_(sends[me]);
  // One message per peer with rows to send or receive (team position j is
  // group rank recv_perm[j]), batched: one NCCL group, or the messages'
  // works waited on together (gloo does not coalesce).
  // A message to and from every peer, an empty one where a piece has no
  // rows: every rank posts as many (a sequence-checking wrapper counts them).
  std::vector<std::pair<int64_t, bool>> messages;  // (team position, send)
  for (int64_t j = 0; j < n; ++j) {
    if (j != me) {
      messages.emplace_back(j, true);
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    if (j != me) {
      messages.emplace_back(j, false);
    }
  }
  if (!messages.empty()) {
    // As batch_isend_irecv: one group where the device's backend coalesces.
    const bool coalesce = src.is_cuda() && group->getBackend(src.device().type())->supportsCoalescing();
    if (coalesce) {
      group->startCoalescing(src.device().type());
    }
    for (const auto& [j, is_send] : messages) {
      std::vector<at::Tensor> bufs{is_send ? sends[j] : recvs[j]};
      checkCarries(group, bufs[0]);
      int peer = static_cast<int>(ins.recv_perm.at(j));
      auto work = is_send ? group->send(bufs, peer, 0) : group->recv(bufs, peer, 0);
      if (!coalesce && work) {
        posted.works.push_back(std::move(work));
      }
    }
    if (coalesce) {
      auto work = group->endCoalescing(src.device().type());
      if (work) {
        posted.works.push_back(std::move(work));
      }
    }
  }
  // The pieces sent and received live until the Wait.
  posted.after = [sends, recvs, copy_out]() {
    if (copy_out) {
      copy_out();
    }
  };
  return posted;
}

Posted sendRecv(Run& run, const Instr& ins, const Group& group) {
  Posted posted;
  if (ins.self_copy) {
    at::Tensor out = run.tensor(ins.out);
    out.copy_(run.tensor(ins.input).reshape(out.sizes()));
    return posted;
  }
  if (ins.is_root) {
    std::vector<at::Tensor> bufs{contiguous(run.tensor(ins.input))};
    posted.works.push_back(group->send(bufs, static_cast<int>(ins.peer), 0));
    return posted;
  }
  at::Tensor out = run.tensor(ins.out);
  auto [buf, after] = staged(out, out.sizes());
  std::vector<at::Tensor> bufs{buf};
  posted.works.push_back(group->recv(bufs, static_cast<int>(ins.peer), 0));
  posted.after = after;
  return posted;
}

class C10dTransport : public Transport {
 public:
  Posted post(Run& run, const Instr& ins) const override {
    const Group& group = run.program().groups[ins.group];
    switch (ins.comm_type) {
      case CommType::kAllgather:
        return allgather(run, ins, group);
      case CommType::kAllreduce:
        return allreduce(run, ins, group);
      case CommType::kReduceScatter:
        return reduceScatter(run, ins, group);
      case CommType::kBroadcast:
        return broadcast(run, ins, group);
      case CommType::kGather:
        return gather(run, ins, group);
      case CommType::kScatter:
        return scatter(run, ins, group);
      case CommType::kReduce:
        return reduce(run, ins, group);
      case CommType::kAllToAll:
        return ins.rows >= 0 ? allToAllRows(run, ins, group) : allToAll(run, ins, group);
      case CommType::kSendRecv:
        return sendRecv(run, ins, group);
    }
    return Posted();
  }

  Posted postP2P(Run& run, const Instr& ins, const at::Tensor& buf, int peer, Works* group) const override {
    std::vector<at::Tensor> bufs{buf};
    const Group& world = run.worldGroup();
    checkCarries(world, buf);
    auto work = ins.send ? world->send(bufs, peer, 0) : world->recv(bufs, peer, 0);
    Posted posted;
    if (group == nullptr) {
      posted.works.push_back(work);
    } else if (!groupCoalesces(run) && work) {
      group->push_back(work);
    }
    return posted;
  }

  void startCoalescing(Run& run) const override {
    if (groupCoalesces(run)) {
      run.worldGroup()->startCoalescing(run.program().device.type());
    }
  }

  Posted endCoalescing(Run& run, Works& group) const override {
    Posted posted;
    if (groupCoalesces(run)) {
      auto work = run.worldGroup()->endCoalescing(run.program().device.type());
      if (work) {
        posted.works.push_back(work);
      }
    } else {
      posted.works = std::move(group);
    }
    return posted;
  }
};

} // namespace

const Transport& c10dTransport() {
  static const C10dTransport transport;
  return transport;
}

namespace {
// NCCL and gloo both post on c10d process groups: one translation.
const TransportRegistration kNccl{"NCCL", &c10dTransport()};
const TransportRegistration kGloo{"gloo", &c10dTransport()};
} // namespace

} // namespace hostir
