"""The NCCL and gloo transports: normalized communications translated to
`torch.distributed` calls, in this one place.

Each `_post_<type>` takes the `Calls` to make (the `torch.distributed`
functions, or a dry run's recording ones), the run's frame (for `get`), the
`Communication`, its process group and its root as a global rank (resolved
from a scalar when the program names the root by a loop index), and returns
a `Posted`: the works to wait for and what to do after (copy a staging
buffer into a non-contiguous or reshaped output). Never hand a strided view
to a collective: gloo would read or write the wrong memory.

A dry run posts through the same functions on meta tensors with recording
calls, so the staging buffers a post makes are in its memory plan exactly;
what the backend itself allocates while a collective is in flight is
`backend_scratch_bytes`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist

from hostir import backends, ir, layout, printer
from hostir.kinds import ReductionKind
from hostir.runtime.transports.base import NoWork, Posted, Transport, TransportUnsupported, TransportUsageError



@dataclasses.dataclass(frozen=True)
class Calls:
    """The collective calls a post makes, with `torch.distributed`'s
    signatures (each returns a work with `wait()`)."""

    all_gather: Callable
    reduce_scatter: Callable
    all_reduce: Callable
    broadcast: Callable
    gather: Callable
    scatter: Callable
    reduce: Callable
    isend: Callable
    irecv: Callable
    all_to_all_single: Callable
    all_to_all: Callable


DIST = Calls(
    # torch 2.13 renamed the tensor forms of all-gather and reduce-scatter.
    all_gather=getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,
    reduce_scatter=getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor,
    all_reduce=dist.all_reduce,
    broadcast=dist.broadcast,
    gather=dist.gather,
    scatter=dist.scatter,
    reduce=dist.reduce,
    isend=dist.isend,
    irecv=dist.irecv,
    all_to_all_single=dist.all_to_all_single,
    all_to_all=dist.all_to_all,
)


def _on_wire(t: torch.Tensor) -> torch.Tensor:
    """What a reducing collective is handed for `t`: bool buffers go as
    uint8 (the same bytes), so that a max or min is a logical or / and on
    every backend."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    # Never hand a strided view to a collective: gloo would read or write
    # the wrong memory.
    return t if t.is_contiguous() else t.contiguous()


def _staged(out: torch.Tensor, shape) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """A contiguous buffer of `shape` that a collective may write, and what
    copies it into `out` afterwards (nothing if it is `out` itself)."""
    if out.is_contiguous():
        return out.view(shape), None
    staging = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    return staging.view(shape), lambda: out.copy_(staging)


def _mesh_axis(tv: ir.TensorView, parallel_type: ir.ParallelType = ir.ParallelType.mesh_x) -> int:
    """The local dim of `tv` that is sharded along `parallel_type`; for a
    tensor without annotations, the outermost (`hostir.unannotated`)."""
    for axis in tv.device_axes():
        if axis.parallel_type is parallel_type:
            return layout.position(tv, axis)
    if tv.mesh is None and not tv.device_axes():
        return 0
    raise TransportUsageError(f"{printer.format_tv(tv)} has no {parallel_type.name} axis")


def _outermost(shape, axis: int) -> bool:
    return all(s == 1 for s in shape[:axis])


def _post_allgather(calls: Calls, frame, e, group, root=None) -> Posted:
    src = _contiguous(frame.get(e.input))
    out = frame.get(e.out)
    a = _mesh_axis(e.input, e.parallel_type)
    n = len(e.team)
    order = frame.communicator.group_order(e.team)
    if _outermost(src.shape, a) and order == tuple(e.team):
        buf, after = _staged(out, [-1])
        return Posted([calls.all_gather(buf, src.reshape(-1), group=group, async_op=True)], after)
    # Gather into [n, *local] in the group's order, then put each rank's
    # piece at its position in the team, on the sharded axis.
    staging = torch.empty([n] + list(src.shape), dtype=src.dtype, device=src.device)
    by_position = [order.index(r) for r in e.team]

    def after():
        # Stacked, not indexed with a list: an index list becomes a tensor
        # the dry run's allocator cannot see (so do Python scalars in an op).
        moved = torch.stack([staging[p] for p in by_position]).squeeze(a + 1).movedim(0, a)
        out.copy_(moved.reshape(out.shape))

    return Posted([calls.all_gather(staging.view(-1), src.reshape(-1), group=group, async_op=True)], after)


def _reduced_input(frame, e) -> torch.Tensor:
    """This rank's input with the rows it holds of the reduced axes reduced."""
    src = frame.get(e.input)
    if not e.local_reduce:
        return src
    return e.red_op.torch_fn(src, list(e.local_reduce), keepdim=True)


def _nan_flags(t: torch.Tensor, red_op: ReductionKind) -> torch.Tensor | None:
    """1 where `t` is NaN, for a max or min of floating values; else None."""
    if not red_op.ignores_nan or not t.dtype.is_floating_point:
        return None
    return torch.isnan(t).to(torch.float32)


def _with_nan_flags(posted: Posted, buf: torch.Tensor | None, flags_out: torch.Tensor, post_flags) -> Posted:
    """Make a max or min keep NaN, as torch's amax and amin do: gloo and
    NCCL compare with `<`, so a NaN may lose to any number. `post_flags()`
    posts a second collective, a MAX over 0/1 NaN flags laid out like the
    data, into `flags_out`; once both finish, the reduced result `buf`
    (None on a rank that receives nothing) gets NaN wherever a rank had one."""
    flag_work = post_flags()
    after = posted.after

    def fill_nan():
        if buf is not None:
            buf.masked_fill_(flags_out.view(buf.shape).bool(), float("nan"))
        if after is not None:
            after()

    return Posted(posted.works + [flag_work], fill_nan)


def _post_allreduce(calls: Calls, frame, e, group, root=None) -> Posted:
    src = _reduced_input(frame, e)
    out = frame.get(e.out)
    buf, after = _staged(out, out.shape)
    buf.copy_(src.reshape(out.shape))
    flags = _nan_flags(buf, e.red_op)
    posted = Posted([calls.all_reduce(_on_wire(buf), op=e.red_op.dist_op, group=group, async_op=True)], after)
    if flags is None:
        return posted
    return _with_nan_flags(
        posted, buf, flags, lambda: calls.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)
    )


def _post_reduce_scatter(calls: Calls, frame, e, group, root=None) -> Posted:
    src = _reduced_input(frame, e)
    out = frame.get(e.out)
    b = _mesh_axis(e.out, e.parallel_type)
    # The output's local shape with the team's pieces of its sharded dim.
    full = [len(e.team) * s if i == b else s for i, s in enumerate(out.shape)]
    whole = src.reshape(full)
    if not _outermost(full, b):
        whole = whole.movedim(b, 0)
    order = frame.communicator.group_order(e.team)
    if order != tuple(e.team):
        # Group rank j receives chunk j: the chunk of team position of order[j].
        chunks = whole.reshape(len(e.team), -1)
        whole = torch.stack([chunks[e.team.index(r)] for r in order])
    # In the output's dtype: a sum of integers or bools is int64, as in
    # torch, and the backend reduces buffers of one dtype.
    whole = _contiguous(whole.to(out.dtype))
    buf, after = _staged(out, [-1])
    flags = _nan_flags(whole, e.red_op)
    posted = Posted(
        [calls.reduce_scatter(_on_wire(buf), _on_wire(whole.reshape(-1)), op=e.red_op.dist_op, group=group, async_op=True)],
        after,
    )
    if flags is None:
        return posted
    received = torch.empty(buf.shape, dtype=flags.dtype, device=buf.device)
    return _with_nan_flags(
        posted,
        buf,
        received,
        lambda: calls.reduce_scatter(received, flags.reshape(-1), op=dist.ReduceOp.MAX, group=group, async_op=True),
    )


def _post_broadcast(calls: Calls, frame, e, group, root: int) -> Posted:
    rank = frame.communicator.rank
    out = frame.get(e.out) if e.out.held_by(frame.communicator.rank) else None
    if rank == root:
        src = frame.get(e.input)
        if out is None:
            return Posted([calls.broadcast(_contiguous(src), src=root, group=group, async_op=True)])
        out.copy_(src.reshape(out.shape))
    buf, after = _staged(out, out.shape)
    return Posted([calls.broadcast(buf, src=root, group=group, async_op=True)], after)


def _post_gather(calls: Calls, frame, e, group, root: int) -> Posted:
    rank = frame.communicator.rank
    if e.input.held_by(frame.communicator.rank):
        src = _contiguous(frame.get(e.input))
    else:
        # The root is outside the sender mesh: it sends a dummy piece.
        src = torch.empty(frame.local_sizes(e.input), dtype=e.input.dtype, device=frame.device)
    if rank != root:
        return Posted([calls.gather(src, None, dst=root, group=group, async_op=True)])
    out = frame.get(e.out)
    pieces = [torch.empty_like(src) for _ in e.team]
    a = _mesh_axis(e.input)
    senders = [r for r in e.team if r in e.input.mesh]

    order = frame.communicator.group_order(e.team)

    def after():
        ordered = [pieces[order.index(r)] for r in senders]
        out.copy_(torch.cat(ordered, dim=a).reshape(out.shape))

    return Posted([calls.gather(src, pieces, dst=root, group=group, async_op=True)], after)


def _post_scatter(calls: Calls, frame, e, group, root: int) -> Posted:
    rank = frame.communicator.rank
    out = frame.get(e.out) if e.out.held_by(frame.communicator.rank) else None
    if out is None:
        # The root is outside the receiver mesh: it receives a dummy piece.
        out_buf = torch.empty(frame.local_sizes(e.out), dtype=e.out.dtype, device=frame.device)
        after = None
    else:
        out_buf, after = _staged(out, out.shape)
    pieces = None
    if rank == root:
        whole = frame.get(e.input).reshape(frame.full_sizes(e.out))
        b = _mesh_axis(e.out)
        chunks = whole.chunk(len(e.out.mesh.devices), dim=b)
        by_rank = dict(zip(e.out.mesh.devices, chunks))
        order = frame.communicator.group_order(e.team)
        pieces = [_contiguous(by_rank.get(r, chunks[0])).view(out_buf.shape) for r in order]
    return Posted([calls.scatter(out_buf, pieces, src=root, group=group, async_op=True)], after)


def _post_reduce(calls: Calls, frame, e, group, root: int) -> Posted:
    rank = frame.communicator.rank
    if rank != root:
        # Every rank posts the output's shape (checked under TORCH_DISTRIBUTED_DEBUG=DETAIL).
        # In the output's dtype, as the root's buffer is.
        piece = _reduced_input(frame, e).reshape(frame.local_sizes(e.out)).to(e.out.dtype).clone(memory_format=torch.contiguous_format)
        buf, after = None, None
    else:
        out = frame.get(e.out)
        buf, after = _staged(out, out.shape)
        if e.input.held_by(frame.communicator.rank):
            buf.copy_(_reduced_input(frame, e).reshape(out.shape))
        else:
            _fill_identity(buf, e.red_op)
        piece = buf
    # The flags are read before the collective may write `piece`.
    flags = _nan_flags(piece, e.red_op)
    posted = Posted([calls.reduce(_on_wire(piece), dst=root, op=e.red_op.dist_op, group=group, async_op=True)], after)
    if flags is None:
        return posted
    return _with_nan_flags(
        posted, buf, flags, lambda: calls.reduce(flags, dst=root, op=dist.ReduceOp.MAX, group=group, async_op=True)
    )


def _fill_identity(t: torch.Tensor, red_op: ReductionKind) -> None:
    t.fill_(red_op.identity(t.dtype))


def _post_send_recv(calls: Calls, frame, e, group, root: int) -> Posted:
    rank = frame.communicator.rank
    # The receiver is the team's other rank, whichever order the team lists.
    others = [r for r in e.team if r != root]
    if len(others) > 1:
        raise TransportUsageError(f"a SendRecv team holds the sender and one receiver, got {e.team}")
    sender, receiver = root, (others[0] if others else root)
    if sender == receiver:
        frame.get(e.out).copy_(frame.get(e.input).reshape(frame.get(e.out).shape))
        return Posted([NoWork()])
    if rank == sender:
        return Posted([calls.isend(_contiguous(frame.get(e.input)), dst=receiver, group=group)])
    out = frame.get(e.out)
    buf, after = _staged(out, out.shape)
    return Posted([calls.irecv(buf, src=sender, group=group)], after)


def _post_all_to_all(calls: Calls, frame, e, group, root=None) -> Posted:
    """Each rank sends team position j the j-th piece of the output's
    sharded axis of its input, and puts the piece from position j at the
    j-th place of the input's sharded axis. Works on logical layouts; the
    lowering checks that both sharded pieces are outermost."""
    if e.rows is not None:
        return _post_all_to_all_rows(calls, frame, e, group)
    pt, team = e.parallel_type, e.team
    n = len(team)
    src = layout.to_logical(e.input, frame.get(e.input))
    out = frame.get(e.out)
    a = _sharded_logical_axis(e.input, pt)
    b = _sharded_logical_axis(e.out, pt)
    order = frame.communicator.group_order(team)
    chunks = src.chunk(n, dim=b)
    send = torch.stack([chunks[team.index(r)] for r in order]).contiguous()
    recv = torch.empty_like(send)

    def after():
        pieces = [recv[order.index(r)] for r in team]
        whole = torch.cat(pieces, dim=a)
        out.copy_(layout.to_runtime(e.out, whole).reshape(out.shape))

    return Posted([calls.all_to_all_single(recv, send, group=group, async_op=True)], after)


def _post_all_to_all_rows(calls: Calls, frame, e, group) -> Posted:
    """An AllToAll sized at run time (`ir.Set`'s `rows`): the leading two
    axes of the logical tensors are the sender's and the receiver's piece;
    each rank sends piece j's first `rows` rows (summed over the counts'
    trailing axes) to team position j and receives position j's into the
    first `rows_in` rows of its piece j, the rest zeros. The counts are
    read on the host (one synchronization): the messages take their sizes
    there. The pieces go as they lie, one message to and from each peer
    (empty where a piece has no rows), batched (`batch_isend_irecv`: one
    NCCL group, or gloo's asynchronous messages); its own piece is a copy.
    A dry run records the exchange at the bound."""
    pt, team = e.parallel_type, e.team
    src = layout.to_logical(e.input, frame.get(e.input))
    out = frame.get(e.out)
    a = _sharded_logical_axis(e.input, pt)
    b = _sharded_logical_axis(e.out, pt)
    sent = _piece_rows(frame, e.rows, len(team), src.shape[2], "rows")
    got = _piece_rows(frame, e.rows_in, len(team), src.shape[2], "rows_in")
    me = team.index(frame.communicator.rank)
    if sent[me] != got[me]:
        raise TransportUsageError(
            f"this rank keeps {sent[me]} rows of its own piece by rows but {got[me]} by rows_in: "
            f"{printer.format_tv(e.rows)} and {printer.format_tv(e.rows_in)} disagree"
        )

    def piece(t: torch.Tensor, axis: int, j: int) -> torch.Tensor:
        at = [0, 0]
        at[1 - axis] = j
        return t[at[0], at[1]]

    logical = layout.to_logical(e.out, out)
    direct = logical.is_contiguous() and logical.data_ptr() == out.data_ptr()
    whole = logical if direct else torch.empty_like(logical)
    ins = [_contiguous(piece(src, a, j)[: sent[j]]) for j in range(len(team))]
    outs = [piece(whole, b, j)[: got[j]] for j in range(len(team))]
    copy_out = None if direct else (lambda: out.copy_(layout.to_runtime(e.out, whole).reshape(out.shape)))
    if src.device.type == "meta":
        return Posted([calls.all_to_all(outs, ins, group=group, async_op=True)], copy_out)
    for j in range(len(team)):
        piece(whole, b, j)[got[j] :].zero_()
    outs[me].copy_(ins[me])
    # A message to and from every peer, an empty one where a piece has no
    # rows: every rank posts as many (a sequence-checking wrapper,
    # TORCH_DISTRIBUTED_DEBUG=DETAIL, counts them).
    ops = [dist.P2POp(dist.isend, ins[j], team[j], group) for j in range(len(team)) if j != me]
    ops += [dist.P2POp(dist.irecv, outs[j], team[j], group) for j in range(len(team)) if j != me]
    works = list(dist.batch_isend_irecv(ops)) if ops else []
    return Posted(works, copy_out)


def _piece_rows(frame, tv: ir.TensorView, n: int, bound: int, what: str) -> list[int]:
    """The real rows of each of the `n` pieces, from the counts `tv` (its
    local [1, n, ...] or [n, 1, ...]), on the host; a dry run (tensors
    without data) moves the bound."""
    counts = layout.to_logical(tv, frame.get(tv))
    if counts.device.type == "meta":
        return [bound] * n
    per = counts.reshape(counts.shape[0] * counts.shape[1], -1).sum(1).tolist()
    if len(per) != n:
        raise TransportUsageError(f"{what} {printer.format_tv(tv)} counts {len(per)} pieces, not {n}")
    for j, r in enumerate(per):
        if not 0 <= r <= bound:
            raise TransportUsageError(
                f"{what} {printer.format_tv(tv)} says piece {j} has {r} rows, outside the bound [0, {bound}]"
            )
    return per


def _sharded_logical_axis(tv: ir.TensorView, pt: ir.ParallelType) -> int:
    found = layout.sharded_axis(tv, pt)
    if found is None:
        raise TransportUsageError(f"{printer.format_tv(tv)} has no {pt.name} axis")
    return found[0]


POST = {
    ir.CommunicationType.AllToAll: _post_all_to_all,
    ir.CommunicationType.Allgather: _post_allgather,
    ir.CommunicationType.Allreduce: _post_allreduce,
    ir.CommunicationType.ReduceScatter: _post_reduce_scatter,
    ir.CommunicationType.Broadcast: _post_broadcast,
    ir.CommunicationType.Gather: _post_gather,
    ir.CommunicationType.Scatter: _post_scatter,
    ir.CommunicationType.Reduce: _post_reduce,
    ir.CommunicationType.SendRecv: _post_send_recv,
}




# The backends this module posts to: those with process groups of their own.
BACKENDS = tuple(b.name for b in backends.BACKENDS.values() if b.process_group is not None)


def backend_scratch_bytes(backend: str, call: str, rank: int, *args, **kwargs) -> int:
    """The bytes `backend` allocates through the torch allocator for one
    call of `Calls` (`call` its field name, the arguments as the post passes
    them) and holds until the call's work is dropped. Measured for gloo on
    CPU against the profiler's memory records
    (tests/python/multidevice/test_dry_run_vs_gloo.py); NCCL works in the
    buffers it is given.

    gloo gathers an all-gather into a flat buffer of the output's size, and
    reduces a reduce-scatter in a copy of its input; a scatter's root
    flattens the pieces into one buffer. Its other collectives work in
    place."""
    if backend != "gloo":
        return 0
    if call == "all_gather":
        return ir.nbytes(args[0])
    if call == "reduce_scatter":
        return ir.nbytes(args[1])
    if call == "scatter":
        pieces = args[1] if len(args) > 1 else kwargs.get("scatter_list")
        return sum(ir.nbytes(p) for p in pieces or ())
    return 0


class TorchDistTransport(Transport):
    """NCCL or gloo through `torch.distributed` process groups. P2P
    communications use global ranks on the default group; inside a
    coalescing group they are batched into one `batch_isend_irecv`."""

    def __init__(self, name: str, calls: Calls = DIST):
        self.name = name
        self.calls = calls
        self.capabilities = backends.BACKENDS[name].capabilities

    def post(self, frame, e, group, root: int | None) -> Posted:
        return POST[e.type](self.calls, frame, e, group, root)

    def post_p2p(self, frame, e, buf, peer: int, ops: list | None) -> Posted:
        if self.name == "gloo" and buf.is_cuda:
            # `check_backends` refuses such a program when it is lowered,
            # on every rank; this guards a program built by hand.
            raise TransportUnsupported(gloo_p2p_on_device(e, buf.device))
        if ops is not None:
            fn = dist.isend if e.type == "send" else dist.irecv
            ops.append(dist.P2POp(fn, buf, peer))
            return Posted([])
        work = self.calls.isend(buf, dst=peer) if e.type == "send" else self.calls.irecv(buf, src=peer)
        return Posted([work])

    def end_coalescing(self, frame, ops: list) -> Posted:
        return Posted(list(dist.batch_isend_irecv(ops)) if ops else [])


# One transport per backend, shared by every frame (a communication's
# process group comes with it).
_TRANSPORTS = {name: TorchDistTransport(name) for name in BACKENDS}


def for_frame(frame, backend: str) -> TorchDistTransport:
    """The transport of `backend` (NCCL or gloo), as `hostir.backends`
    names this module for it."""
    found = _TRANSPORTS.get(backend)
    if found is None:
        raise TransportUsageError(f"torch.distributed runs the backends {', '.join(BACKENDS)}, not {backend!r}")
    return found


def gloo_p2p_on_device(e, device) -> str:
    return (
        f"{printer.format_expr_head(e)}: gloo sends and receives only host memory, but the program runs on "
        f"{device}; run the ring on the cuda transport (schedule='ring:transport=cuda'), use backend='nccl' "
        f"(one GPU per rank), or a sequential schedule"
    )


def check_backends(container, device, communicator_backend: str | None = None) -> None:
    """Refuses a program whose communications name a backend that cannot
    carry their buffers where the program runs: each backend carries only
    what it can. Called when the program is lowered, before anything is
    posted; every rank lowers the same program on the same kind of device
    and fails the same way, for the Python and the C++ evaluator alike.

    - NCCL moves device memory between GPUs: it needs the program on a GPU,
      a communicator whose process groups have NCCL (`communicator_backend`
      "nccl"; a gloo communicator's groups would hand the device pointers
      to gloo), and no buffer in host memory. Without a communicator (a
      program lowered to be printed) nothing is posted, so nothing is
      checked.
    - gloo's sends and receives read and write host addresses only: a
      program on a GPU may post them only for host-memory buffers (gloo's
      collectives stage device memory themselves).
    """
    on_gpu = torch.device(device).type == "cuda"
    for e in container.walk():
        if isinstance(e, ir.P2PCommunication):
            buffers = [e.buffer]
        elif isinstance(e, ir.Communication) and len(e.team) > 1:
            buffers = [e.input, e.out]
        else:
            continue  # a team of one moves nothing
        if e.backend == "NCCL" and communicator_backend is not None:
            problem = _nccl_problem(buffers, on_gpu, device, communicator_backend)
            if problem:
                raise TransportUnsupported(f"{printer.format_expr_head(e)}: {problem}")
        elif e.backend == "gloo" and on_gpu and isinstance(e, ir.P2PCommunication):
            if e.buffer.memory_type is not ir.MemoryType.host:
                raise TransportUnsupported(gloo_p2p_on_device(e, device))


def _nccl_problem(buffers, on_gpu: bool, device, communicator_backend: str | None) -> str | None:
    host = [tv for tv in buffers if ir.in_host_memory(tv)]
    if host:
        return (
            f"NCCL carries device memory only, but {printer.format_val(host[0])} is in host memory; "
            f"move it to the device first (a Transfer), or run the program on gloo"
        )
    if not on_gpu:
        return (
            f"NCCL carries device memory only, but the program runs on {device}; pass the inputs on "
            f"this rank's GPU, or use backend='gloo'"
        )
    if communicator_backend is not None and communicator_backend != "nccl":
        return (
            f"the program posts device memory through NCCL, but the communicator runs "
            f"{communicator_backend} (its process groups have no NCCL), which would hand the device "
            f"buffers to {communicator_backend}; create the communicator with backend='nccl' (one GPU "
            f"per rank), or use transport=cuda or a gloo program"
        )
    return None
