"""Spread stream parallelization to the tensors the user left unscheduled,
and replay stream splits on the operands a stream loop must cut.

Precondition: top-level fusion ops with one output each, as
`build_host_program` leaves them (the program's own copies of the user's
TensorViews, so the user's fusion is not changed).

Postcondition, in two steps (nvFuser's sharding propagation, for the
`stream` type):
1. A tensor is *scheduled* when the user placed it on a mesh, split it or
   parallelized one of its axes (`parallelize(ParallelType.serial)`
   included: an explicit serial axis keeps its tensor out of the loop, so a
   non-stream op between two stream ops ends the first loop). Going forward over the ops, an unscheduled
   output takes the stream axis of its first operand that has one, on the
   output axis that iterates with it (split the same way when the operand's
   stream axis is the outer piece of a split); going backward, an
   unscheduled operand that is not a program input takes its consumer's
   stream axis likewise. Reduction and broadcast axes never become stream
   axes. Repeated until nothing changes.
2. For every op whose output's stream axis is the outer piece of a split,
   each operand axis that iterates with the split axis and is not split is
   split the same way (no parallel type), so that the stream loop can cut
   the operand into the same chunks.

    T1 = Set( T0 )  T1 scheduled [iStreamIdx3{2}, iS4{( ceilDiv(i0, 2) )}, iS2{i1}]
    T2 = Set( T1 )  T2 unscheduled [iS5{i0}, iS6{i1}]
    ->  T0 [iS7{2}, iS8{( ceilDiv(i0, 2) )}, iS1{i1}], T2 [iStreamIdx9{2}, iS10{( ceilDiv(i0, 2) )}, iS6{i1}]
"""

from __future__ import annotations

from hostir import ir, printer
from hostir.container import HostIrContainer
from hostir.errors import HostIrError


class StreamPropagationError(HostIrError, ValueError):
    """A stream split that cannot be replayed on a tensor."""


def propagate_stream_axes(container: HostIrContainer) -> HostIrContainer:
    exprs = [e for e in container.exprs if isinstance(e, ir.FUSION_OPS)]
    inputs = set(container.inputs)
    scheduled = {tv for tv in _all_tvs(exprs, container) if _is_scheduled(tv)}

    changed = True
    while changed:
        changed = False
        for e in exprs:
            (out,) = e.outputs()
            if out in scheduled or out.stream_axes():
                continue
            for tv in _operands(e):
                if tv.stream_axes() and _copy_stream_axis(e, src=tv, dst=out, forward=True):
                    changed = True
                    break
        for e in reversed(exprs):
            (out,) = e.outputs()
            if not out.stream_axes():
                continue
            for tv in _operands(e):
                if tv in scheduled or tv in inputs or tv.stream_axes():
                    continue
                if _copy_stream_axis(e, src=out, dst=tv, forward=False):
                    changed = True

    for e in exprs:
        (out,) = e.outputs()
        for axis in out.stream_axes():
            if axis.parent is None or axis is not axis.parent.leaves[0]:
                # An inner piece cannot be chunked: parallelize_streams says so.
                continue
            for o, i in e.id_pairs():
                if o is axis.parent and i.leaves is None and _can_split(i):
                    _split_like(_owner_of(e, i), i, axis.parent, stream=False)
    return container


def _can_split(d: ir.IterDomain) -> bool:
    return not (d.is_broadcast or d.is_reduction) and d.parallel_type is ir.ParallelType.serial


def _all_tvs(exprs, container: HostIrContainer) -> list[ir.TensorView]:
    found = dict.fromkeys(v for v in container.inputs + container.outputs if isinstance(v, ir.TensorView))
    for e in exprs:
        for v in e.inputs() + e.outputs():
            if isinstance(v, ir.TensorView):
                found.setdefault(v)
    return list(found)


def _is_scheduled(tv: ir.TensorView) -> bool:
    return (
        tv.mesh is not None
        or tv.is_split
        or any(d.parallel_type is not ir.ParallelType.serial or d.scheduled for d in tv.domain)
    )


def _operands(e: ir.Expr) -> list[ir.TensorView]:
    return [v for v in e.inputs() if isinstance(v, ir.TensorView)]


def _owner_of(e: ir.Expr, d: ir.IterDomain) -> ir.TensorView:
    for v in e.inputs() + e.outputs():
        if isinstance(v, ir.TensorView) and d in v.logical:
            return v
    raise StreamPropagationError(f"{printer.format_id(d)} is not an axis of an operand of\n{printer.format_expr_head(e)}")


def _copy_stream_axis(e: ir.Expr, src: ir.TensorView, dst: ir.TensorView, forward: bool) -> bool:
    """Give `dst` the stream axis of `src` on the axis the op pairs with it;
    False if no axis of `dst` can take it."""
    (axis,) = src.stream_axes()[:1]
    src_logical = axis.parent or axis
    if axis.parent is not None and axis is not axis.parent.leaves[0]:
        return False
    for o, i in e.id_pairs():
        mine, theirs = (o, i) if forward else (i, o)
        if theirs is not src_logical or mine not in dst.logical:
            continue
        if not _can_split(mine) or mine.leaves is not None:
            return False
        if axis.parent is None:
            mine.parallel_type = ir.ParallelType.stream
        else:
            _split_like(dst, mine, src_logical, stream=True)
        return True
    return False


def _split_like(tv: ir.TensorView, target: ir.IterDomain, ref: ir.IterDomain, stream: bool) -> None:
    """Outer-split `target` of `tv` as `ref` is split (its outer piece a
    stream axis when `stream`)."""
    leaves = ref.loop_leaves()
    if len(leaves) != 2 or not leaves[0].extent.is_constant:
        raise StreamPropagationError(
            f"cannot replay the split of {printer.format_id(ref)} on {printer.format_tv(tv)}: only an "
            f"outer split by a constant can be propagated"
        )
    tv.outer_split(tv.domain.index(target), leaves[0].extent.value)
    if stream:
        target.leaves[0].parallel_type = ir.ParallelType.stream
