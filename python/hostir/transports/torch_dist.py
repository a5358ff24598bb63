"""The NCCL and gloo transports: normalized communications translated to
`torch.distributed` calls, in this one place.

Each `_post_<type>` takes the run's frame (for `get`), the `Communication`,
its process group and its root as a global rank (resolved from a scalar
when the program names the root by a loop index), and returns a `Posted`:
the works to wait for and what to do after (copy a staging buffer into a
non-contiguous or reshaped output). Never hand a strided view to a
collective: gloo would read or write the wrong memory.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from hostir import ir, layout, printer
from hostir.transports.base import NoWork, Posted, Transport, TransportUsageError

_RED_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# torch 2.13 renamed the tensor forms of all-gather and reduce-scatter.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
    """The local dim of `tv` that is sharded along `parallel_type`."""
    for axis in tv.device_axes():
        if axis.parallel_type is parallel_type:
            return layout.position(tv, axis)
    raise TransportUsageError(f"{printer.format_tv(tv)} has no {parallel_type.name} axis")


def _outermost(shape, axis: int) -> bool:
    return all(s == 1 for s in shape[:axis])


def _post_allgather(frame, e, group, root=None) -> Posted:
    src = _contiguous(frame.get(e.input))
    out = frame.get(e.out)
    a = _mesh_axis(e.input, e.parallel_type)
    n = len(e.team)
    order = frame.communicator.group_order(e.team)
    if _outermost(src.shape, a) and order == tuple(e.team):
        buf, after = _staged(out, [-1])
        return Posted([_all_gather(buf, src.reshape(-1), group=group, async_op=True)], after)
    # Gather into [n, *local] in the group's order, then put each rank's
    # piece at its position in the team, on the sharded axis.
    staging = torch.empty([n] + list(src.shape), dtype=src.dtype, device=src.device)
    by_position = [order.index(r) for r in e.team]

    def after():
        moved = staging[by_position].squeeze(a + 1).movedim(0, a)
        out.copy_(moved.reshape(out.shape))

    return Posted([_all_gather(staging.view(-1), src.reshape(-1), group=group, async_op=True)], after)


def _reduced_input(frame, e) -> torch.Tensor:
    """This rank's input with the rows it holds of the reduced axes reduced."""
    src = frame.get(e.input)
    if not e.local_reduce:
        return src
    dims = list(e.local_reduce)
    if e.red_op == "sum":
        return torch.sum(src, dims, keepdim=True)
    return (torch.amax if e.red_op == "max" else torch.amin)(src, dims, keepdim=True)


def _nan_flags(t: torch.Tensor, red_op: str) -> torch.Tensor | None:
    """1 where `t` is NaN, for a max or min of floating values; else None."""
    if red_op not in ("max", "min") or not t.dtype.is_floating_point:
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
            buf.masked_fill_(flags_out.view(buf.shape) > 0, float("nan"))
        if after is not None:
            after()

    return Posted(posted.works + [flag_work], fill_nan)


def _post_allreduce(frame, e, group, root=None) -> Posted:
    src = _reduced_input(frame, e)
    out = frame.get(e.out)
    buf, after = _staged(out, out.shape)
    buf.copy_(src.reshape(out.shape))
    flags = _nan_flags(buf, e.red_op)
    posted = Posted([dist.all_reduce(buf, op=_RED_OPS[e.red_op], group=group, async_op=True)], after)
    if flags is None:
        return posted
    return _with_nan_flags(
        posted, buf, flags, lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)
    )


def _post_reduce_scatter(frame, e, group, root=None) -> Posted:
    src = _reduced_input(frame, e)
    out = frame.get(e.out)
    b = _mesh_axis(e.out, e.parallel_type)
    # The output's local shape with the team's pieces of its sharded dim.
    full = [len(e.team) if i == b else s for i, s in enumerate(out.shape)]
    whole = src.reshape(full)
    if not _outermost(full, b):
        whole = whole.movedim(b, 0)
    order = frame.communicator.group_order(e.team)
    if order != tuple(e.team):
        # Group rank j receives chunk j: the chunk of team position of order[j].
        whole = whole.reshape(len(e.team), -1)[[e.team.index(r) for r in order]]
    whole = _contiguous(whole)
    buf, after = _staged(out, [-1])
    flags = _nan_flags(whole, e.red_op)
    posted = Posted([_reduce_scatter(buf, whole.reshape(-1), op=_RED_OPS[e.red_op], group=group, async_op=True)], after)
    if flags is None:
        return posted
    received = torch.empty(buf.shape, dtype=flags.dtype, device=buf.device)
    return _with_nan_flags(
        posted,
        buf,
        received,
        lambda: _reduce_scatter(received, flags.reshape(-1), op=dist.ReduceOp.MAX, group=group, async_op=True),
    )


def _holds(frame, tv: ir.TensorView) -> bool:
    return tv.mesh is None or frame.communicator.rank in tv.mesh


def _post_broadcast(frame, e, group, root: int) -> Posted:
    rank = frame.communicator.rank
    out = frame.get(e.out) if _holds(frame, e.out) else None
    if rank == root:
        src = frame.get(e.input)
        if out is None:
            return Posted([dist.broadcast(_contiguous(src), src=root, group=group, async_op=True)])
        out.copy_(src.reshape(out.shape))
    buf, after = _staged(out, out.shape)
    return Posted([dist.broadcast(buf, src=root, group=group, async_op=True)], after)


def _post_gather(frame, e, group, root: int) -> Posted:
    rank = frame.communicator.rank
    if _holds(frame, e.input):
        src = _contiguous(frame.get(e.input))
    else:
        # The root is outside the sender mesh: it sends a dummy piece.
        src = torch.empty(frame.local_sizes(e.input), dtype=e.input.dtype, device=frame.device)
    if rank != root:
        return Posted([dist.gather(src, None, dst=root, group=group, async_op=True)])
    out = frame.get(e.out)
    pieces = [torch.empty_like(src) for _ in e.team]
    a = _mesh_axis(e.input)
    senders = [r for r in e.team if r in e.input.mesh]

    order = frame.communicator.group_order(e.team)

    def after():
        ordered = [pieces[order.index(r)] for r in senders]
        out.copy_(torch.cat(ordered, dim=a).reshape(out.shape))

    return Posted([dist.gather(src, pieces, dst=root, group=group, async_op=True)], after)


def _post_scatter(frame, e, group, root: int) -> Posted:
    rank = frame.communicator.rank
    out = frame.get(e.out) if _holds(frame, e.out) else None
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
    return Posted([dist.scatter(out_buf, pieces, src=root, group=group, async_op=True)], after)


def _post_reduce(frame, e, group, root: int) -> Posted:
    rank = frame.communicator.rank
    if rank != root:
        # Every rank posts the output's shape (checked under TORCH_DISTRIBUTED_DEBUG=DETAIL).
        piece = _reduced_input(frame, e).reshape(frame.local_sizes(e.out)).clone(memory_format=torch.contiguous_format)
        buf, after = None, None
    else:
        out = frame.get(e.out)
        buf, after = _staged(out, out.shape)
        if _holds(frame, e.input):
            buf.copy_(_reduced_input(frame, e).reshape(out.shape))
        else:
            _fill_identity(buf, e.red_op)
        piece = buf
    # The flags are read before the collective may write `piece`.
    flags = _nan_flags(piece, e.red_op)
    posted = Posted([dist.reduce(piece, dst=root, op=_RED_OPS[e.red_op], group=group, async_op=True)], after)
    if flags is None:
        return posted
    return _with_nan_flags(
        posted, buf, flags, lambda: dist.reduce(flags, dst=root, op=dist.ReduceOp.MAX, group=group, async_op=True)
    )


def _fill_identity(t: torch.Tensor, red_op: str) -> None:
    if red_op == "sum":
        t.zero_()
    elif t.dtype.is_floating_point:
        t.fill_(float("-inf") if red_op == "max" else float("inf"))
    else:
        info = torch.iinfo(t.dtype)
        t.fill_(info.min if red_op == "max" else info.max)


def _post_send_recv(frame, e, group, root: int) -> Posted:
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
        return Posted([dist.isend(_contiguous(frame.get(e.input)), dst=receiver, group=group)])
    out = frame.get(e.out)
    buf, after = _staged(out, out.shape)
    return Posted([dist.irecv(buf, src=sender, group=group)], after)


def _post_all_to_all(frame, e, group, root=None) -> Posted:
    """Each rank sends team position j the j-th piece of the output's
    sharded axis of its input, and puts the piece from position j at the
    j-th place of the input's sharded axis. Works on logical layouts; the
    lowering checks that both sharded pieces are outermost."""
    from hostir.evaluator import as_logical, as_loop  # the evaluator imports this module

    pt, team = e.parallel_type, e.team
    n = len(team)
    src = as_logical(e.input, frame.get(e.input))
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
        out.copy_(as_loop(e.out, whole).reshape(out.shape))

    return Posted([dist.all_to_all_single(recv, send, group=group, async_op=True)], after)


def _sharded_logical_axis(tv: ir.TensorView, pt: ir.ParallelType) -> int:
    for pos, d in enumerate(tv.logical_runtime()):
        if any(x.parallel_type is pt for x in d.loop_leaves()):
            return pos
    raise TransportUsageError(f"{printer.format_tv(tv)} has no {pt.name} axis")


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




class TorchDistTransport(Transport):
    """NCCL or gloo through `torch.distributed` process groups. P2P
    communications use global ranks on the default group; inside a
    coalescing group they are batched into one `batch_isend_irecv`."""

    def __init__(self, name: str):
        self.name = name

    def post(self, frame, e, group, root: int | None) -> Posted:
        return POST[e.type](frame, e, group, root)

    def post_p2p(self, frame, e, buf, peer: int, ops: list | None) -> Posted:
        if ops is not None:
            fn = dist.isend if e.type == "send" else dist.irecv
            ops.append(dist.P2POp(fn, buf, peer))
            return Posted([])
        work = dist.isend(buf, dst=peer) if e.type == "send" else dist.irecv(buf, src=peer)
        return Posted([work])

    def end_coalescing(self, frame, ops: list) -> Posted:
        return Posted(list(dist.batch_isend_irecv(ops)) if ops else [])
