"""Wrap every op whose output has a `stream` axis in a for-loop over that axis.

Precondition: top-level ops with at most one output each; an op's output
has at most one stream axis, an iteration or broadcast axis of its domain:
a logical axis, or the outer piece of an outer split (the loop then walks
ceilDiv-sized chunks of that axis; `propagate_stream_axes` has split the
operands alike). A stream axis on a program input only says how the ops in
a loop cut it.

Postcondition: each run of consecutive stream-parallel ops whose stream axes
map (through the ops' operands, broadcasts included) is one `ForLoop`
walking the stream axis with index `StreamIdx`, marked `stream_parallel`
(`assign_streams` runs its iterations on worker streams). Before the loop,
each body output is allocated at full size, but a slice of another body
op's output, which is taken there once as a view of that whole buffer
(it keeps the stream axis whole); in the body, each operand and
output with an axis mapped to the loop's is replaced by a `HirAliasSelect`
slice (one slice per (tensor, axis, index) for the whole pass). Any op in
between ends the loop.

    T1 = Set(T0)                 T1 = ALLOCATE(...)
    (T1 axis 0 is stream)   →    FOR StreamIdx in iStreamIdx2{i0} (on worker streams):
                                   T3 = HirAliasSelect(T0, ...); T4 = HirAliasSelect(T1, ...); T4 = Set(T3)
"""

from __future__ import annotations

from hostir import axis_graph, ir, layout, printer
from hostir.container import HostIrContainer
from hostir.errors import HostIrError


class StreamParallelError(HostIrError, ValueError):
    pass


def parallelize_streams(container: HostIrContainer) -> HostIrContainer:
    graph = axis_graph.IdGraph(container.exprs, broadcast=True)

    grouped: list = []
    loops: set[int] = set()
    for e in container.exprs:
        axis = _stream_axis(e)
        if axis is None:
            grouped.append(e)
            continue
        last = grouped[-1] if grouped else None
        if id(last) in loops and graph.mapped(last.iter_domain, axis):
            last.body.append(e)
            continue
        loop = ir.ForLoop(
            index=ir.Scalar(label="StreamIdx"),
            start=ir.Scalar.constant(0),
            stop=axis.extent,
            body=[e],
            iter_domain=axis,
            stream_parallel=True,
        )
        loops.add(id(loop))
        grouped.append(loop)

    result = container.derive()
    slicer = _Slicer(result, graph)
    for item in grouped:
        if id(item) not in loops:
            result.push_back(item)
            continue
        views = _views(item, slicer)
        for e in item.body:
            (out,) = e.outputs()
            if e in views:
                # A view of a buffer the loop fills whole: taken once, on
                # the whole buffer, before the loop; the body reads its
                # slices (no buffer of its own, no copy per iteration).
                result.push_back(e)
            elif slicer.mapped_axis(out, item) is not None:
                result.push_back(ir.Allocate(out, ir.MemoryType.global_))
        body = [e for e in item.body if e not in views]
        result.push_back(item.replace(body=slicer.slice_body(item.replace(body=body))))
    return result


def _views(loop: ir.ForLoop, slicer: _Slicer) -> list[ir.Expr]:
    """The slices in `loop`'s body of an earlier body op's output that the
    loop allocates whole (it has the stream axis), or of such a view; they
    keep that axis whole (`_stream_axis` refuses the others)."""
    whole: set[int] = set()
    views = []
    for e in loop.body:
        if isinstance(e, ir.SliceOp) and id(e.input) in whole:
            views.append(e)
            whole.add(id(e.out))
        elif slicer.mapped_axis(e.out, loop) is not None:
            whole.add(id(e.out))
    return views


def _stream_axis(e: ir.Expr) -> ir.IterDomain | None:
    outs = e.outputs()
    if not outs:
        return None
    if len(outs) > 1:
        raise StreamParallelError(f"each op should have at most one output:\n{printer.format_expr_head(e)}")
    (out,) = outs
    if not isinstance(out, ir.TensorView):
        return None
    axes = out.stream_axes()
    if not axes:
        return None
    if len(axes) > 1:
        ids = ", ".join(printer.format_id(d) for d in axes)
        raise StreamParallelError(
            f"{printer.format_tv(out)} has {len(axes)} stream axes ({ids}); "
            f"at most one axis of a tensor can be stream-parallel"
        )
    (axis,) = axes
    if not isinstance(e, ir.FUSION_OPS):
        raise StreamParallelError(
            f"stream parallelization is not supported for this op:\n{printer.format_expr_head(e)}"
        )
    if isinstance(e, ir.ReshapeOp) or (
        isinstance(e, ir.SliceOp) and e.ranges[out.logical.index(axis.parent or axis)] != (0, None, 1)
    ):
        raise StreamParallelError(
            f"stream axis {printer.format_id(axis)} of {printer.format_tv(out)} does not walk an axis of "
            f"the op's input (a reshape, or a cut axis of a slice), so the op cannot run chunk by chunk:\n"
            f"{printer.format_expr_head(e)}"
        )
    if axis.is_reduction:
        raise StreamParallelError(
            f"stream axis {printer.format_id(axis)} of {printer.format_tv(out)} is a reduction axis; "
            f"a stream axis should be an iteration or broadcast axis"
        )
    return axis


class _Slicer:
    """Replaces operands by slices; one slice per (tensor, axis, index)."""

    def __init__(self, container: HostIrContainer, graph: axis_graph.IdGraph):
        self._container = container
        self._graph = graph
        self._cache: dict[tuple, ir.TensorView] = {}

    def mapped_axis(self, tv: ir.TensorView, loop: ir.ForLoop) -> ir.IterDomain | None:
        axes = [
            d for d in tv.domain if not d.is_reduction and self._graph.mapped(d, loop.iter_domain)
        ]
        if len(axes) > 1:
            ids = ", ".join(printer.format_id(d) for d in axes)
            raise StreamParallelError(
                f"{printer.format_tv(tv)} has {len(axes)} axes ({ids}) that map to the stream axis "
                f"{printer.format_id(loop.iter_domain)}; expected at most one"
            )
        if axes and axes[0].is_device_parallel:
            raise StreamParallelError(
                f"stream axis {printer.format_id(loop.iter_domain)} maps to the mesh_x axis "
                f"{printer.format_id(axes[0])} of {printer.format_tv(tv)}; a stream loop cannot walk a "
                f"sharded axis (each rank holds one index of it)"
            )
        if axes:
            try:
                layout.select_kind(tv, axes[0])
            except layout.LayoutError as err:
                raise StreamParallelError(str(err)) from err
        return axes[0] if axes else None

    def _check_split_alike(self, e: ir.Expr, loop: ir.ForLoop) -> None:
        """An operand axis that iterates with a streamed split axis must be
        split alike, or the loop would hand the op the whole operand."""
        (out,) = e.outputs()
        axis = self.mapped_axis(out, loop)
        if axis is None or axis.parent is None:
            return
        for o, i in e.id_pairs():
            if o is not axis.parent or i.is_broadcast:
                continue
            for tv in e.inputs():
                if isinstance(tv, ir.TensorView) and i in tv.logical and self.mapped_axis(tv, loop) is None:
                    raise StreamParallelError(
                        f"{printer.format_tv(tv)} is split differently from the stream axis "
                        f"{printer.format_id(axis)} it iterates with, so a chunk of it cannot be cut; "
                        f"split both alike:\n{printer.format_expr_head(e)}"
                    )

    def slice_body(self, loop: ir.ForLoop) -> list[ir.Expr]:
        body: list[ir.Expr] = []
        for e in loop.body:
            self._check_split_alike(e, loop)
            changes = {}
            for field in e.INPUTS + e.OUTPUTS:
                tv = getattr(e, field)
                if not isinstance(tv, ir.TensorView):
                    continue
                axis = self.mapped_axis(tv, loop)
                if axis is None:
                    continue
                key = (tv, axis, loop.index)
                piece = self._cache.get(key)
                if piece is None:
                    domain = [d.clone(self._container) for d in tv.domain if d is not axis]
                    piece = ir.TensorView(self._container, domain, tv.dtype, ir.MemoryType.local, mesh=tv.mesh)
                    self._cache[key] = piece
                    body.append(ir.HirAliasSelect(piece, tv, axis, loop.index))
                changes[field] = piece
            body.append(e.replace(**changes))
        return body

