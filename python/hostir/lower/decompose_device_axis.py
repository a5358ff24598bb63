"""Decompose a device axis walked as a stream axis: a loop over the ranks.

Precondition: `propagate_shardings` has run; the `schedule` argument says how
(a `hostir.lower.schedule.Schedule`; the default is a ring, one chunk per peer).
Two patterns are rewritten, each on a 1-D mesh of consecutive ranks:

  gather side: `xg = set(x)` with x sharded on a mesh_x axis that maps to
    xg's stream axis, followed by the ops whose stream axis maps to it
    (`y = matmul(xg, w)`): an all-gather overlapped with the compute.
  reduce side: ops with a stream axis (`c = matmul(a, b)`, K sharded)
    followed by a reduction of the mesh_x axis whose output is sharded on an
    axis that maps to that stream axis: a matmul overlapped with a
    reduce-scatter.

Postcondition: each pattern is a host program with no stream axis left in
its ops; the loop of steps is marked `stream_parallel`, and the ops right
before it (gather) or after it (reduce) that compute the rank's own chunk
are its `caller_ops` or `caller_after` (the streams are written by
`assign_streams`). Decompositions
(`Schedule.decomposition`):

  ring        gather: the local shard's ops run first on the caller's
              stream, on the shard in place (copied into its slot first
              only where the gathered tensor is needed whole afterwards);
              then step i = 1 .. D-1
              receives the shard of position (p + d*i) % D and sends its own
              to (p - d*i) % D (p: this rank's position, d: the direction),
              and runs the ops on that shard, on worker streams.
              reduce: step i computes the partial for position (p - d*i) % D
              and sends it while the next step computes; a slot buffer
              receives the peers' partials; the local partial is computed
              last into its own slot, on the caller's stream while the
              peers' partials move (the loop's `caller_after`); one reduction over the slots (fp32
              accumulation inside torch's reduction, one rounding, no fp32
              copy of a partial). With one peer and chunks
              (`fuses_reduction`), no reduction: each arrived chunk is
              copied into this rank's piece of the result on its worker,
              and the local chunk's GEMM adds its product to it (beta = 1,
              one rounding) in a loop after the steps that waits for each
              step's worker in turn (`ForLoop.joins_workers`).
  collective  gather: iteration i broadcasts shard i from rank i;
              reduce: iteration i computes partial i and reduces it onto
              rank i.
  sequential  one all-gather then the ops, or the ops then one
              reduce-scatter (no overlap; for shapes too small to pay).

The walked axis need not be outermost (a sequence-sharded [b, s/D, h]):
a slice along it is then strided, so the ring and the collective receive
into slots with that axis first and copy each shard into its place in the
gathered tensor, where the ops read it. The pieces an op reads keep the
tensor's other splits (a weight sharded on N beside the walked sequence).

With `chunks` c > 1 each shard or partial moves in c row pieces, each
consumed as soon as it lands. With the `cuda` transport, buffers that peers
write are allocated `symmetric` and each send names where it lands
(`into`). The loop's head names the decomposition, chunks, direction and
transport (and why the transport was not `cuda`, if it was asked for).

    T2 = Set( T0 )   (T0 sharded, T2 stream)     FOR StreamIdx from 1 to 2 (ring, ...; on worker streams ...):
    T3 = matmul( T2, T1 )  (T3 stream)      ->     StartCoalescing ... P2PCommunication ...
"""

from __future__ import annotations

from hostir import axis_graph, backends, ir, layout, printer
from hostir.container import HostIrContainer
from hostir.errors import HostIrError
from hostir.kinds import ReductionKind
from hostir.lower.propagate_shardings import is_resharding
from hostir.lower.record import ChunkedAxis
from hostir.lower.schedule import Schedule


class DecompositionError(HostIrError, ValueError):
    """A device axis this pass cannot decompose (mesh, chunks, reduction)."""


def decompose_device_axis(
    container: HostIrContainer, schedule: Schedule | None = None, backend: str = "NCCL", chunking: list | None = None
) -> HostIrContainer:
    """`schedule`: how to decompose (by default a ring, one chunk per peer);
    `backend`: the program's transport, which the ring uses unless the
    schedule names another; `chunking`: a list this pass adds
    `(extent, parts, where)` to for each axis of symbolic extent it cuts
    into chunks, whose sizes the runtime checks divide."""
    schedule = schedule or Schedule()
    graph = axis_graph.IdGraph(container.exprs, broadcast=True)
    result = container.derive()
    exprs = list(container.exprs)
    i = 0
    while i < len(exprs):
        e = exprs[i]
        gather = _gather_axis(e, graph)
        if gather is not None:
            if schedule.decomposition == "ring" and _moved_axis(e, graph) is not None:
                reordered = _gathered_to_return(exprs, i, gather[1], graph)
                if reordered is not exprs:
                    # Ops hoisted above the walk come first, each as any
                    # other op; then the walk, its ops now contiguous.
                    exprs = reordered
                    continue
            start = i
            group, i = _run_of(exprs, i + 1, gather[1], graph)
            back = None
            if i < len(exprs) and schedule.decomposition == "ring" and _returns_pieces(e, exprs[i], group, graph):
                # An all-to-all's pieces, computed, sent back where they
                # came from (a MoE layer's combine): in the same steps.
                back, i = exprs[i], i + 1
            escapes = _read_elsewhere(e.out, container, exprs[:start] + exprs[i:])
            _Builder(result, graph, schedule, backend, chunking).gather(e, gather, group, escapes, back)
            continue
        reduce = _reduce_run(exprs, i, graph)
        if reduce is not None:
            group, red, i = reduce
            _Builder(result, graph, schedule, backend, chunking).reduce(group, red)
            continue
        result.push_back(e)
        i += 1
    return result


def _dims_without(tv: ir.TensorView, axis: ir.IterDomain) -> list | None:
    """`tv`'s runtime dims without the one `axis` is alone in (None where it
    shares a dim with other axes)."""
    found = layout.dims(tv)
    if any(axis in g and len(g) > 1 for g in found):
        return None
    return [g for g in found if axis not in g]


def _read_elsewhere(tv: ir.TensorView, container: HostIrContainer, others: list) -> bool:
    """Whether the gathered tensor is needed whole beyond the ops that walk
    it: an output of the program, or read by another op."""
    if tv in container.outputs:
        return True
    for e in ir.walk(others):
        if any(getattr(e, f, None) is tv for f in e.INPUTS):
            return True
    return False


# ---------------------------------------------------------------- patterns


def walks_device_axis(exprs) -> bool:
    """Whether `exprs` (a fusion's, before sharding propagation) hold a
    pattern this pass decomposes, so that a schedule matters."""
    graph = axis_graph.IdGraph(exprs, broadcast=True)
    for e in exprs:
        if _gather_axis(e, graph) is not None:
            return True
        if isinstance(e, ir.Set) and e.out.stream_axes() and e.out.device_axes():
            # An all-to-all walked as a stream axis (a MoE layer's
            # dispatch), whose input sharding propagation has yet to place.
            return True
        if isinstance(e, ir.ReductionOp):
            s = _stream_axis(e.input)
            if s is not None and any(graph.mapped(d, s) for d in e.out.device_axes()):
                return True
        if scattered_operand(e, graph) is not None:
            return True
    return False


def scattered_operand(e, graph) -> ir.TensorView | None:
    """The operand of a row-parallel product (`linear` or `matmul`) whose
    stream axis maps to an axis its output shards: the partial sums are
    reduce-scattered along that axis step by step (GEMM+RS); else None."""
    if not isinstance(e, (ir.LinearOp, ir.MatmulOp)):
        return None
    for v in e.inputs():
        s = _stream_axis(v)
        if s is not None and any(graph.mapped(d, s) for d in e.out.device_axes()):
            return v
    return None


def _stream_axis(tv) -> ir.IterDomain | None:
    if not isinstance(tv, ir.TensorView):
        return None
    axes = tv.stream_axes()
    return axes[0] if len(axes) == 1 else None


def _gather_axis(e, graph) -> tuple[ir.IterDomain, ir.IterDomain] | None:
    """(x's mesh_x axis, xg's stream axis) if `e` is `xg = set(x)` that
    gathers the axis the stream walks, or moves it (an all-to-all: xg
    sharded on another axis, which x holds whole, `_moved_axis`)."""
    if not isinstance(e, ir.Set) or e.input.mesh is None:
        return None
    s = _stream_axis(e.out)
    if s is not None and e.rows is not None:
        raise DecompositionError(
            f"an exchange sized at run time (rows=...) is not walked along a stream axis; leave "
            f"{printer.format_tv(e.out)} without one:\n{printer.format_expr_head(e)}"
        )
    if s is None or (e.out.device_axes() and _moved_axis(e, graph) is None):
        return None
    for d in e.input.device_axes():
        if graph.mapped(d, s):
            return d, s
    return None


def _returns_pieces(walk: ir.Set, e, group: list, graph) -> bool:
    """Whether `e`, right after the ops `group` that a walked all-to-all
    `walk` feeds, is the all-to-all back: a `set` of the group's last
    result that moves the walked axis back to be sharded (each peer's
    piece returned to the peer it came from)."""
    if not group or _moved_axis(walk, graph) is None:
        return False
    if not isinstance(e, ir.Set) or e.input is not group[-1].out or e.out.stream_axes():
        return False
    moved = _moved_axis(e, graph)
    s = _stream_axis(e.input)
    return moved is not None and s is not None and graph.mapped(moved, s)


def _gathered_to_return(exprs: list, at: int, axis: ir.IterDomain, graph) -> list:
    """`exprs` reordered so that the walked all-to-all `exprs[at]`, the ops
    that walk its pieces and the all-to-all that returns their result
    (`_returns_pieces`) are contiguous, where ops between them that walk
    nothing allow it (a MoE layer's backward, whose weight gradients read
    the walked tensors whole): an op that reads nothing the walk fills
    moves above it, one that does (or reads such an op's result) below the
    all-to-all back. Each op keeps its order among those it moves with,
    and every op still follows what it reads. `exprs` itself where nothing
    moves or no all-to-all back closes the walk."""
    walk = exprs[at]
    group: list = []
    above: list = []
    below: list = []
    filled = {walk.out}  # what the steps fill piece by piece
    deferred: set = set()  # results of ops moved below
    for j in range(at + 1, len(exprs)):
        e = exprs[j]
        if not isinstance(e, ir.FUSION_OPS):
            return exprs
        if group and _returns_pieces(walk, e, group, graph):
            if not above and not below:
                return exprs
            return exprs[:at] + above + [walk] + group + [e] + below + exprs[j + 1 :]
        if is_resharding(e):
            return exprs
        reads = {v for v in e.inputs() if isinstance(v, ir.TensorView)}
        s = _stream_axis(e.outputs()[0])
        if s is not None and graph.mapped(s, axis) and not reads & deferred:
            group.append(e)
            filled.add(e.out)
        elif reads & (filled | deferred):
            below.append(e)
            deferred.add(e.out)
        else:
            above.append(e)
    return exprs


def _moved_axis(e: ir.Set, graph) -> ir.IterDomain | None:
    """For `xg = set(x)` whose one sharded axis is one x holds whole on
    every rank (an all-to-all), that axis of xg; else None."""
    out = [d for d in e.out.logical if d.is_device_parallel and d.leaves is None]
    if len(out) != 1 or len(e.out.device_axes()) != 1 or len(e.input.device_axes()) != 1:
        return None
    (m,) = out
    for d in e.input.logical:
        if graph.mapped(d, m):
            return m if not layout.device_types(d) and d.leaves is None else None
    return None


def _run_of(exprs, start, axis, graph) -> tuple[list, int]:
    """The fusion ops from `start` whose stream axis maps to `axis`."""
    group = []
    i = start
    while i < len(exprs):
        e = exprs[i]
        s = _stream_axis(e.outputs()[0]) if isinstance(e, ir.FUSION_OPS) else None
        if s is None or not graph.mapped(s, axis) or is_resharding(e):
            break
        group.append(e)
        i += 1
    return group, i


def _reduce_run(exprs, start, graph):
    """(ops, reduction, next index) if the stream ops from `start` end in a
    reduction of a mesh_x axis whose sharded output axis maps to their
    stream axis."""
    e = exprs[start]
    if not isinstance(e, ir.FUSION_OPS) or is_resharding(e):
        return None
    s = _stream_axis(e.outputs()[0])
    if s is None or e.outputs()[0].mesh is None:
        return None
    group, i = _run_of(exprs, start, s, graph)
    if not group or i >= len(exprs):
        return None
    red = exprs[i]
    if not isinstance(red, ir.ReductionOp) or red.input is not group[-1].out or not is_resharding(red):
        return None
    if not any(graph.mapped(d, s) for d in red.out.device_axes()):
        return None
    return group, red, i + 1


def _outermost(tv: ir.TensorView, axis: ir.IterDomain) -> bool:
    """Whether a slice of `tv` along `axis` is contiguous: every loop axis
    before it has one element per rank (broadcast, a mesh piece, extent 1)."""
    for d in tv.domain:
        if d is axis:
            return True
        if d.is_reduction or d.is_broadcast or d.is_device_parallel:
            continue
        if not (d.extent.is_constant and d.extent.value == 1):
            return False
    return True


def fuses_reduction(D: int, chunks: int) -> bool:
    """Whether a reduce ring of D ranks and `chunks` per peer adds the
    peer's partial in its local GEMM instead of summing its slots after the
    last arrival (where the sum is a matmul's or a linear's, without bias,
    over slots of the result's dtype, the walked axis outermost): with one
    peer, and chunks for the local GEMM to wait for one at a time."""
    return D == 2 and chunks > 1


# ---------------------------------------------------------------- building


class _Builder:
    def __init__(
        self, result: HostIrContainer, graph: axis_graph.IdGraph, schedule: Schedule, backend: str, chunking: list | None
    ):
        self.c = result
        self.graph = graph
        self.schedule = schedule
        self.backend = backend
        self.chunking = chunking if chunking is not None else []
        # The program's axis each cloned axis stands for (clones are not in the graph).
        self._origin: dict[ir.IterDomain, ir.IterDomain] = {}

    def _clone(self, d: ir.IterDomain, **changes) -> ir.IterDomain:
        new = d.clone(self.c)
        for name, value in changes.items():
            setattr(new, name, value)
        self._origin[new] = self._origin.get(d, d)
        return new

    # -- helpers
    def _mesh(self, e, tv: ir.TensorView) -> tuple[ir.DeviceMesh, int]:
        mesh = tv.mesh
        devices = list(mesh.devices)
        if mesh.ndim != 1 or devices != list(range(devices[0], devices[0] + len(devices))):
            raise DecompositionError(
                f"decomposing a device axis needs a 1-D mesh of consecutive ranks, got {mesh!r}:\n"
                f"{printer.format_expr_head(e)}"
            )
        return mesh, devices[0]

    def _position(self, first: int) -> ir.Scalar:
        rank = self.c.named_scalar("rank")
        return rank if first == 0 else rank - first

    @staticmethod
    def _wrap(pos: ir.Scalar, D: int) -> ir.Scalar:
        return ir.ScalarExpr("%", pos, ir.Scalar.constant(D))

    def _rank_at(self, position: ir.Scalar, first: int) -> ir.Scalar:
        return position if first == 0 else position + first

    def _axis_of(self, tv: ir.TensorView, axis: ir.IterDomain) -> ir.IterDomain | None:
        axis = self._origin.get(axis, axis)
        for d in tv.domain:
            if not d.is_reduction and self.graph.mapped(self._origin.get(d, d), axis):
                return d
        return None

    def _like(self, tv: ir.TensorView, made: dict, resized=None, memory=ir.MemoryType.local) -> ir.TensorView:
        """A local TensorView of `made`'s clones of `tv`'s loop axes (an
        axis absent from `made` is dropped; `resized`: one whose extent the
        clone changes), each logical axis split as in `tv`: a sharded axis
        stays one logical axis of its pieces, so ops see on a piece the
        logical shape they see on `tv`."""
        domain = [made[d] for d in tv.domain if d in made]
        logical = []
        for axis in tv.logical:
            leaves = axis.loop_leaves()
            kept = [made[leaf] for leaf in leaves if leaf in made]
            if not kept:
                continue
            if len(kept) == 1:
                # An unsplit axis, or what a select leaves of a split one.
                logical.append(kept[0])
                continue
            extent = axis.extent
            if len(kept) != len(leaves) or resized in leaves:
                extent = kept[0].extent
                for k in kept[1:]:
                    extent = extent * k.extent
            root = ir.IterDomain(self.c, extent, axis.iter_type)
            root.leaves = kept
            for k in kept:
                k.parent = root
            self._origin[root] = self._origin.get(axis, axis)
            logical.append(root)
        return ir.TensorView(self.c, domain, tv.dtype, memory, mesh=tv.mesh, logical=logical)

    def _select(self, body: list, tv: ir.TensorView, axis: ir.IterDomain, index: ir.Scalar) -> ir.TensorView:
        piece = self._like(tv, {d: self._serial(d) for d in tv.domain if d is not axis})
        body.append(ir.HirAliasSelect(piece, tv, axis, index))
        return piece

    def _chunk(self, body: list, tv: ir.TensorView, axis: ir.IterDomain, index, parts: int) -> ir.TensorView:
        if parts == 1:
            return tv
        at = tv.domain.index(axis)
        made = {d: self._clone(d) for d in tv.domain}
        domain = [made[d] for d in tv.domain]
        rows = axis.extent
        if rows.is_constant:
            if rows.value % parts:
                raise DecompositionError(
                    f"axis {printer.format_id(axis)} of {printer.format_tv(tv)}: extent {rows.value} "
                    f"does not split into {parts} chunks per peer"
                )
            domain[at].extent = ir.Scalar.constant(rows.value // parts)
        else:
            domain[at].extent = ir.ScalarExpr("/", rows, ir.Scalar.constant(parts))
            origin = self._origin.get(axis, axis)
            where = f"axis {printer.format_id(origin)} (the rows a decomposition cuts into chunks)"
            if not any(x is rows and p == parts for x, p, _ in self.chunking):
                self.chunking.append(ChunkedAxis(rows, parts, where))
        piece = self._like(tv, made, resized=axis)
        body.append(ir.HirAliasChunk(piece, tv, axis, index, parts))
        return piece

    def _row_axis(self, tv: ir.TensorView, skip: ir.IterDomain) -> ir.IterDomain:
        """The axis chunks split: the first iteration axis after the walked one."""
        for d in tv.domain:
            if d is skip or d.is_reduction or d.is_broadcast or d.is_device_parallel:
                continue
            if d.parallel_type is ir.ParallelType.stream:
                continue
            return d
        raise DecompositionError(f"{printer.format_tv(tv)} has no axis to split into chunks")

    def _transport(self) -> str:
        asked = self.schedule.transport
        return asked if asked is not None else self.backend

    def _head(self, kind: str) -> str:
        s = self.schedule
        parts = [kind]
        if kind != "sequential":
            parts.append(f"chunks={s.chunks}")
        if kind == "ring":
            parts.append(f"direction={'+1' if s.direction > 0 else '-1'}")
            parts.append(f"transport={self._transport()}")
        if s.note:
            parts.append(s.note)
        return ", ".join(parts)

    def _pipeline(
        self, start: int, stop: int, make_body, head: str, local_first=None, local_last=None, own_last: int = 0
    ):
        """The loop of the steps, marked stream-parallel (`assign_streams`
        runs them on worker streams); `local_first`, the rank's own chunk,
        right before it, counted as the ops the caller runs while the
        workers run the steps; `local_last` after it, of which the first
        `own_last` compute the rank's own chunk from none of the steps'
        communications (the caller runs them while the steps' partials
        move)."""
        own = list(local_first or [])
        for e in own:
            self.c.push_back(e)
        index = ir.Scalar(label="StreamIdx")
        self.c.push_back(
            ir.ForLoop(
                index, ir.Scalar.constant(start), ir.Scalar.constant(stop), make_body(index), schedule=head,
                stream_parallel=True, caller_ops=len(own), caller_after=own_last,
            )
        )
        for e in local_last or []:
            self.c.push_back(e)

    def _step_and_chunk(self, index: ir.Scalar) -> tuple[ir.Scalar, ir.Scalar]:
        c = self.schedule.chunks
        if c == 1:
            return index, ir.Scalar.constant(0)
        return ir.ScalarExpr("/", index, ir.Scalar.constant(c)), index % c

    def _ops_on(self, body: list, group: list, axis: ir.IterDomain, index, chunk, row_ref, replace=None) -> list:
        """`group`'s ops on the slice `index` (and chunk) of every operand
        and output mapped to `axis`; `replace` maps a tensor to the piece to
        use for it (already sliced)."""
        pieces = dict(replace or {})
        parts = self.schedule.chunks
        for e in group:
            changes = {}
            for field in e.INPUTS + e.OUTPUTS:
                tv = getattr(e, field)
                if not isinstance(tv, ir.TensorView):
                    continue
                if tv in pieces:
                    changes[field] = pieces[tv]
                    continue
                a = self._axis_of(tv, axis)
                if a is None:
                    continue
                piece = self._select(body, tv, a, ir.Scalar.constant(0) if a.is_broadcast else index)
                row = self._axis_of(piece, row_ref) if parts > 1 else None
                if row is not None:
                    piece = self._chunk(body, piece, row, chunk, parts)
                pieces[tv] = changes[field] = piece
            body.append(e.replace(**changes))
        return body

    def _serial(self, d: ir.IterDomain) -> ir.IterDomain:
        """A clone of `d`, serial where `d` is stream-parallel."""
        if d.parallel_type is ir.ParallelType.stream:
            return self._clone(d, parallel_type=ir.ParallelType.serial)
        return self._clone(d)

    def _serial_alias(self, tv: ir.TensorView) -> ir.TensorView:
        alias = self._like(tv, {d: self._serial(d) for d in tv.domain}, memory=ir.MemoryType.global_)
        self.c.mark_alias(tv, alias)
        return alias

    def _comm(self, type_, out, input, team, root=None, red_op=None, schedule=None):
        return ir.Communication(
            self.c.next_name("comm"), type_, out, input, tuple(team), root=root, red_op=red_op,
            backend=self.backend, schedule=schedule,
        )

    def _p2p(self, type_, buffer, peer, into=None):
        return ir.P2PCommunication(self.c.next_name("comm"), type_, buffer, peer, backend=self._transport(), into=into)

    def _exchange(self, body, send, to, recv, frm, into):
        """Send `send` to `to` and receive `recv` from `frm` as one group."""
        one_sided = backends.get(self._transport()).capabilities.one_sided
        posts = [self._p2p("send", send, to, into if one_sided else None), self._p2p("recv", recv, frm)]
        end = ir.EndCoalescing(self.c.next_name("comm"))
        body += [ir.StartCoalescing(), *posts, end, ir.Wait(end)]

    def _result(self, body: list, back: ir.Set, s: ir.IterDomain, index) -> ir.TensorView:
        """The piece of the walked result (`back`'s input) for source
        `index`, as a plain local tensor."""
        y = back.input
        piece = self._select(body, y, self._axis_of(y, s), index)
        (sharded,) = [d for d in piece.logical if d.is_device_parallel]
        return self._select(body, piece, sharded, ir.Scalar.constant(0))

    def _returned(self, body: list, back: ir.Set, index, out: ir.TensorView | None = None) -> ir.TensorView:
        """Where the result rank `index` computed for this rank's piece
        lands: this rank's shard of `back`'s output (or of `out`, its
        landing buffer), at `index` along the axis the result was sharded
        on."""
        out, y = out if out is not None else back.out, back.input
        (sharded,) = [d for d in out.logical if d.is_device_parallel]
        mine = self._select(body, out, sharded, ir.Scalar.constant(0))
        (computed_on,) = [d for d in y.logical if d.is_device_parallel]
        return self._select(body, mine, self._axis_of(mine, computed_on), index)

    def _unsharded(self, body: list, piece: ir.TensorView, axis: ir.IterDomain) -> ir.TensorView:
        """`piece` without its sharded `axis` (this rank's size-1 slice):
        what an all-to-all's pieces move as, plain local tensors."""
        return self._select(body, piece, self._axis_of(piece, axis), ir.Scalar.constant(0))

    # -- the gather side
    def _slots(self, tv: ir.TensorView, axis: ir.IterDomain) -> tuple[ir.TensorView, ir.IterDomain]:
        """A buffer of `tv`'s loop axes with `axis` moved first (serial),
        and that axis: its slices along it are contiguous."""
        domain = [self._serial(d) for d in tv.domain if not d.is_reduction]
        at = [d for d in tv.domain if not d.is_reduction].index(axis)
        domain.insert(0, domain.pop(at))
        return ir.TensorView(self.c, domain, tv.dtype, ir.MemoryType.global_, mesh=tv.mesh), domain[0]

    def gather(self, set_op: ir.Set, axes, group: list, escapes: bool = True, back: ir.Set | None = None) -> None:
        """`escapes`: whether the gathered tensor is needed whole after the
        ops of `group` (else the ring leaves this rank's own slot of it
        unfilled: its ops read the rank's shard in place). `back`: for a
        ring of an all-to-all, the all-to-all that returns the group's
        result piece by piece (`_returns_pieces`), each step sending the
        piece it computed to the peer it came from."""
        dx, s = axes
        x, xg = set_op.input, set_op.out
        mesh, first = self._mesh(set_op, x)
        D = mesh.size
        kind = self.schedule.decomposition
        outs = [xg] + [e.out for e in group]
        # An all-to-all: xg is sharded on an axis x holds whole; each step
        # receives the peer's piece of that axis for this rank, and sends
        # this rank's piece for the peer.
        moved = _moved_axis(set_op, self.graph)
        if moved is not None and (kind == "collective" or self.schedule.chunks > 1):
            raise DecompositionError(
                "an all-to-all walked as a stream axis decomposes as a ring of one piece per peer or "
                f"sequentially, not as collectives or in chunks:\n{printer.format_expr_head(set_op)}"
            )
        if kind == "sequential":
            for tv in outs:
                self.c.push_back(ir.Allocate(tv, ir.MemoryType.global_))
            flat = {tv: self._serial_alias(tv) for tv in outs}
            type_ = ir.CommunicationType.Allgather if moved is None else ir.CommunicationType.AllToAll
            comm = self._comm(type_, flat[xg], x, mesh.devices, schedule=self._head("sequential"))
            self.c.push_back(comm)
            self.c.push_back(ir.Wait(comm))
            for e in group:
                changes = {f: flat[getattr(e, f)] for f in e.INPUTS + e.OUTPUTS if getattr(e, f) in flat}
                self.c.push_back(e.replace(**changes))
            return
        symmetric = kind == "ring" and backends.get(self._transport()).capabilities.needs_symmetric_buffers
        memory = ir.MemoryType.symmetric if symmetric else ir.MemoryType.global_
        # The buffer shards land in, and its walked axis. A shard of xg is
        # contiguous only where xg's walked axis is outermost; otherwise
        # (a sequence-sharded [b, s/D, h]) the ring receives into slots with
        # that axis first and copies each shard into its place in xg, where
        # the ops read it.
        buf, bs = xg, s
        # A symmetric buffer is a window the call after next writes again:
        # a tensor the program returns (an output, or one saved for the
        # backward) lands in slots of its own and is copied out of them.
        returned = symmetric and any(xg is o for o in self.c.outputs)
        if kind != "sequential" and (not _outermost(xg, s) or returned):
            buf, bs = self._slots(xg, s)
            self.c.push_back(ir.Allocate(buf, memory))
            memory = ir.MemoryType.global_
        self.c.push_back(ir.Allocate(xg, memory))
        for tv in outs[1:]:
            self.c.push_back(ir.Allocate(tv, ir.MemoryType.global_))
        land = None
        if back is not None:
            # Where the peers' results for this rank's pieces land (pushed
            # into, on a one-sided transport); a returned one, as xg above,
            # lands in a symmetric buffer of its own and is copied out.
            pushed = backends.get(self._transport()).capabilities.needs_symmetric_buffers
            if pushed and any(back.out is o for o in self.c.outputs):
                land = self._like(back.out, {d: self._serial(d) for d in back.out.domain}, memory=ir.MemoryType.global_)
                self.c.push_back(ir.Allocate(land, ir.MemoryType.symmetric))
                self.c.push_back(ir.Allocate(back.out, ir.MemoryType.global_))
            else:
                self.c.push_back(ir.Allocate(back.out, ir.MemoryType.symmetric if pushed else ir.MemoryType.global_))
        parts = self.schedule.chunks
        row_ref = self._row_axis(xg, s)
        # This rank's shard, without its size-1 mesh_x axis.
        local: list = []
        xl = self._select(local, x, dx, ir.Scalar.constant(0))
        xl_row = self._axis_of(xl, row_ref) if parts > 1 else None
        if parts > 1 and xl_row is None:
            raise DecompositionError(f"{printer.format_tv(x)} has no axis matching the chunked rows")
        pos = self._position(first)
        if kind == "collective":
            for e in local:
                self.c.push_back(e)

            def body_of(index):
                body: list = []
                step, chunk = self._step_and_chunk(index)
                slot = self._select(body, buf, bs, step)
                if parts > 1:
                    slot = self._chunk(body, slot, self._axis_of(slot, row_ref), chunk, parts)
                mine = self._chunk(body, xl, xl_row, chunk, parts) if parts > 1 else xl
                comm = self._comm(
                    ir.CommunicationType.Broadcast, slot, mine, mesh.devices, root=self._rank_at(step, first)
                )
                body += [comm, ir.Wait(comm)]
                if buf is not xg:
                    landed = slot
                    slot = self._select(body, xg, s, step)
                    if parts > 1:
                        slot = self._chunk(body, slot, self._axis_of(slot, row_ref), chunk, parts)
                    body.append(ir.Set(slot, landed))
                return self._ops_on(body, group, s, step, chunk, row_ref, {xg: slot})

            self._pipeline(0, D * parts, body_of, self._head("collective"))
            return
        # ring: the local shard is computed first, read in place where the
        # gathered tensor is needed no further (else copied into its slot
        # first). (This rank's slot of the buffer always names where its
        # shard lands on the peers.)
        # The shard can stand in for its slot only where it has the slot's
        # runtime dims, axis for axis (a shard that keeps a split's outer
        # piece as a dim of its own keeps the copy).
        mine_slot = self._select(local, buf, bs, pos)
        kept, slot_dims = _dims_without(x, dx), _dims_without(xg, s)
        # An all-to-all's own piece is a slice of the shard: copied.
        in_place = (
            moved is None
            and kept is not None
            and slot_dims is not None
            and len(kept) == len(slot_dims)
            and all(len(a) == len(b) and all(self.graph.mapped(i, j) for i, j in zip(a, b)) for a, b in zip(kept, slot_dims))
        )
        fills = escapes or buf is not xg or not in_place
        if not fills and not backends.get(self._transport()).capabilities.one_sided:
            # No push names it as its place on the peers: not needed.
            local.pop()
            mine_slot = None
        xm = None if moved is None else self._axis_of(xl, moved)
        if moved is not None and xm is None:
            raise DecompositionError(f"{printer.format_tv(x)} has no axis matching the all-to-all's moved axis")
        if fills:
            mine = mine_slot if buf is xg else self._select(local, xg, s, pos)
            if xm is None:
                local.append(ir.Set(mine, xl))
            else:
                local.append(ir.Set(self._unsharded(local, mine, moved), self._select(local, xl, xm, pos)))
        else:
            mine = xl
        saved, self.schedule = self.schedule, self.schedule.with_chunks(1)
        self._ops_on(local, group, s, pos, ir.Scalar.constant(0), row_ref, {xg: mine})
        self.schedule = saved
        if back is not None:
            # This rank's own result stays: copied into its place.
            local.append(ir.Set(self._returned(local, back, pos), self._result(local, back, s, pos)))
        d = self.schedule.direction

        def body_of(index):
            body: list = []
            step, chunk = self._step_and_chunk(index)
            frm = self._wrap(pos + step if d > 0 else pos - step, D)
            to = self._wrap(pos - step if d > 0 else pos + step, D)
            slot = self._select(body, buf, bs, frm)
            send, into = xl, mine_slot
            if parts > 1:
                slot = self._chunk(body, slot, self._axis_of(slot, row_ref), chunk, parts)
                send = self._chunk(body, xl, xl_row, chunk, parts)
                if mine_slot is not None:
                    into = self._chunk(body, mine_slot, self._axis_of(mine_slot, row_ref), chunk, parts)
            recv = slot
            if xm is not None:
                # All-to-all: this rank's piece for the peer it sends to;
                # the pieces move as this rank's slice of the moved axis.
                send = self._select(body, send, self._axis_of(send, moved), to)
                recv = self._unsharded(body, slot, moved)
                if into is not None and backends.get(self._transport()).capabilities.one_sided:
                    into = self._unsharded(body, into, moved)
            self._exchange(body, send, self._rank_at(to, first), recv, self._rank_at(frm, first), into)
            if buf is not xg:
                landed = slot
                slot = self._select(body, xg, s, frm)
                if parts > 1:
                    slot = self._chunk(body, slot, self._axis_of(slot, row_ref), chunk, parts)
                body.append(ir.Set(slot, landed))
            self._ops_on(body, group, s, frm, chunk, row_ref, {xg: slot})
            if back is not None:
                # The result of the piece from `frm` goes back to it; the
                # result of this rank's piece that `to` computed arrives.
                one_sided = backends.get(self._transport()).capabilities.one_sided
                home = self._returned(body, back, pos, land) if one_sided else None
                arrived = self._returned(body, back, to, land)
                self._exchange(
                    body, self._result(body, back, s, frm), self._rank_at(frm, first),
                    arrived, self._rank_at(to, first), home,
                )
                if land is not None:
                    body.append(ir.Set(self._returned(body, back, to), arrived))
            return body

        self._pipeline(parts, D * parts, body_of, self._head("ring"), local_first=local)

    # -- the reduce side
    def reduce(self, group: list, red: ir.ReductionOp) -> None:
        c = red.input
        s = _stream_axis(c)
        mesh, first = self._mesh(red, c)
        D = mesh.size
        kind = self.schedule.decomposition
        y = red.out
        if len(layout.reduced_dims(red.out)) != 1:
            raise DecompositionError(
                f"a decomposed reduce-scatter reduces exactly the mesh_x axis:\n{printer.format_expr_head(red)}"
            )
        (dy,) = [d for d in y.device_axes() if self.graph.mapped(d, s)]
        inner = [e.out for e in group]
        if kind == "sequential":
            for tv in inner:
                self.c.push_back(ir.Allocate(tv, ir.MemoryType.global_))
            flat = {tv: self._serial_alias(tv) for tv in inner}
            for e in group:
                changes = {f: flat[getattr(e, f)] for f in e.INPUTS + e.OUTPUTS if getattr(e, f) in flat}
                partial = getattr(e, "partial", None)
                if partial is not None and e.out in flat:
                    # The partial sums' axis, on the alias the op now writes.
                    changes["partial"] = flat[e.out].domain[e.out.domain.index(partial)]
                self.c.push_back(e.replace(**changes))
            self.c.push_back(ir.Allocate(y, ir.MemoryType.global_))
            # The result may mark its reduced axis as the stream axis (as
            # nvFuser's reduce-based program does): one ReduceScatter walks
            # no stream, so it writes a serial alias of the result.
            out = self._serial_alias(y) if any(d.parallel_type is ir.ParallelType.stream for d in y.domain) else y
            comm = self._comm(
                ir.CommunicationType.ReduceScatter, out, flat[c], mesh.devices, red_op=red.kind,
                schedule=self._head("sequential"),
            )
            self.c.push_back(comm)
            self.c.push_back(ir.Wait(comm))
            return
        for tv in inner:
            self.c.push_back(ir.Allocate(tv, ir.MemoryType.global_))
        self.c.push_back(ir.Allocate(y, ir.MemoryType.global_))
        parts = self.schedule.chunks
        row_ref = self._row_axis(c, s)
        pos = self._position(first)
        # y without its size-1 mesh_x axis: what this rank keeps.
        top: list = []
        mine_out = self._select(top, y, dy, ir.Scalar.constant(0))
        mine_row = self._axis_of(mine_out, row_ref) if parts > 1 else None
        for e in top:
            self.c.push_back(e)
        if kind == "collective":

            def body_of(index):
                body: list = []
                step, chunk = self._step_and_chunk(index)
                self._ops_on(body, group, s, step, chunk, row_ref)
                partial = next(b.out for b in reversed(body) if isinstance(b, ir.FUSION_OPS))
                target = self._chunk(body, mine_out, mine_row, chunk, parts) if parts > 1 else mine_out
                comm = self._comm(
                    ir.CommunicationType.Reduce, target, partial, mesh.devices,
                    root=self._rank_at(step, first), red_op=red.kind,
                )
                body += [comm, ir.Wait(comm)]
                return body

            self._pipeline(0, D * parts, body_of, self._head("collective"))
            return
        # ring: slots receive the peers' partials; the local one lands in its own slot.
        slot_domain = [self._serial(d) for d in c.domain]
        at = c.domain.index(s)
        # Where the walked axis is not outermost (a sequence-sharded
        # [b, s, h]), it goes first in the slots, so that each slot (a peer's
        # partial, which a P2P receive writes) is contiguous.
        reordered = not _outermost(c, s)
        if reordered:
            slot_domain.insert(0, slot_domain.pop(at))
            at = 0
        slots = ir.TensorView(self.c, slot_domain, c.dtype, ir.MemoryType.global_, mesh=c.mesh)
        symmetric = backends.get(self._transport()).capabilities.needs_symmetric_buffers
        self.c.push_back(ir.Allocate(slots, ir.MemoryType.symmetric if symmetric else ir.MemoryType.global_))
        slot_axis = slot_domain[at]
        pre: list = []
        mine_slot = self._select(pre, slots, slot_axis, pos)
        for e in pre:
            self.c.push_back(e)
        d = self.schedule.direction
        # With one peer and chunks, the peer's partial is added in the
        # local GEMM: each arrived chunk is copied into this rank's piece of
        # y on its worker, and the local chunk's GEMM adds its product to
        # it (beta = 1), after the arrival, in a loop that waits for each
        # step's worker in turn: no reduction over the slots.
        last_op = group[-1]
        fused = (
            fuses_reduction(D, parts)
            and red.kind is ReductionKind.sum
            and not reordered
            and c.dtype == y.dtype
            and isinstance(last_op, (ir.MatmulOp, ir.LinearOp))
            and getattr(last_op, "bias", None) is None
        )
        acc = None
        if fused:
            # This rank's piece of y, viewed with its slot's axes.
            acc = self._like(mine_slot, {x: self._clone(x) for x in mine_slot.domain}, memory=ir.MemoryType.global_)
            self.c.mark_alias(y, acc)

        def body_of(index):
            body: list = []
            step, chunk = self._step_and_chunk(index)
            frm = self._wrap(pos + step if d > 0 else pos - step, D)
            to = self._wrap(pos - step if d > 0 else pos + step, D)
            self._ops_on(body, group, s, to, chunk, row_ref)
            partial = next(b.out for b in reversed(body) if isinstance(b, ir.FUSION_OPS))
            recv = self._select(body, slots, slot_axis, frm)
            into = mine_slot
            if parts > 1:
                recv = self._chunk(body, recv, self._axis_of(recv, row_ref), chunk, parts)
                into = self._chunk(body, mine_slot, self._axis_of(mine_slot, row_ref), chunk, parts)
            self._exchange(body, partial, self._rank_at(to, first), recv, self._rank_at(frm, first), into)
            if fused:
                body.append(ir.Set(self._chunk(body, acc, self._axis_of(acc, row_ref), chunk, parts), recv))
            return body

        if fused:
            index = ir.Scalar(label="StreamIdx")
            body: list = []
            _, chunk = self._step_and_chunk(index)
            piece = self._chunk(body, acc, self._axis_of(acc, row_ref), chunk, parts)
            self._ops_on(body, group, s, pos, chunk, row_ref, {c: piece})
            body[-1] = body[-1].replace(accumulate=True)
            epilogue = ir.ForLoop(
                index, ir.Scalar.constant(parts), ir.Scalar.constant(D * parts), body, joins_workers=True
            )
            head = f"{self._head('ring')}, sum in the local GEMM"
            self._pipeline(parts, D * parts, body_of, head, local_last=[epilogue], own_last=1)
            return

        # The local partial last, straight into its slot, while the last pieces move.
        last: list = []
        saved, self.schedule = self.schedule, self.schedule.with_chunks(1)
        self._ops_on(last, group, s, pos, ir.Scalar.constant(0), row_ref, {c: mine_slot})
        self.schedule = saved
        own_last = len(last)
        # One reduction over the slots into this rank's piece of y (y's
        # buffer). Reordered slots are read through a view with the walked
        # axis back in its place and the partial sums' own device axis (one
        # piece per rank) right after it, where y has its piece of that
        # axis, so that the result's axes are y's.
        nonred = [x for x in c.domain if not x.is_reduction]
        partial = getattr(group[-1], "partial", None)
        target, in_slots = nonred, nonred
        if reordered:
            target = [x for x in nonred if x is not partial]
            if partial is not None:
                target.insert(target.index(s) + 1, partial)
            in_slots = [s] + [x for x in nonred if x is not s]
        w_at = target.index(s)
        summed = slots
        if target != in_slots:
            rest = [x for x in slot_domain if not x.is_reduction]
            dims = tuple(in_slots.index(x) for x in target)
            summed = ir.TensorView(
                self.c, [self._clone(rest[i]) for i in dims], c.dtype, ir.MemoryType.global_, mesh=c.mesh
            )
            last.append(ir.PermuteOp(summed, slots, dims))
        kept = [self._clone(x) for x in summed.domain if not x.is_reduction]
        kept[w_at] = ir.IterDomain(self.c, slot_axis.extent, ir.IterType.reduction)
        y_slots = ir.TensorView(self.c, kept, y.dtype, ir.MemoryType.global_, mesh=y.mesh)
        self.c.mark_alias(y, y_slots)
        last.append(ir.ReductionOp(y_slots, red.kind, summed))
        self._pipeline(parts, D * parts, body_of, self._head("ring"), local_last=last, own_last=own_last)
