"""How the flat compiler (`hostir.runtime.flat`) compiles communications.

Each collective becomes one `communication` instruction with its process
group, its roots as group ranks, its permutations in the group's order and
its backend (which C++ transport posts it); a P2P names its peer, its
backend and, for a push into a peer's window, its place there (`into`);
a coalescing group's ends name the backend of its first member; a Wait the
instruction it completes. An AllToAll sized at run time also names its
counts (`rows`, `rows_in`). Also the runtime shapes and logical groups the
communications and the compute ops share. The functions take the
compiler (`flat._Compiler`) as `cc`; `flat` registers them.
"""

from __future__ import annotations

from hostir import ir, layout, printer, unannotated
from hostir.runtime.evaluator import MissingHandlerError, ProgramError

# Shared with csrc/host_ir/program.h (enum class CommType), in this order:
# the C++ core's communication types, in declaration order.
COMMUNICATION_TYPES = tuple(t.value for t in ir.CommunicationType if t.in_cpp)

DTYPES = {dtype: i for i, dtype in enumerate(ir.SUPPORTED_DTYPES)}


def logical_groups(tv: ir.TensorView) -> list[list[int]]:
    """For each logical axis of `tv`, the runtime dims it merges (empty:
    the runtime shape is the logical one), as `layout.to_logical`."""
    runtime = layout.dims(tv)
    if len(runtime) == tv.logical_ndim:
        return []
    return [
        [i for i, dim in enumerate(runtime) if layout.logical_axis(dim[0]) is axis] for axis in tv.logical_runtime()
    ]


def local_shape(cc, tv: ir.TensorView) -> list[int]:
    """Scalar nodes of `tv`'s local runtime shape (a constant 1 on mesh_x),
    as `layout.local_shape`."""
    return [cc.scalar(dim_size(dim, local=True)) for dim in layout.dims(tv)]


def full_shape(cc, tv: ir.TensorView) -> list[int]:
    """Scalar nodes of `tv`'s runtime shape across all ranks, as
    `layout.full_shape`."""
    return [cc.scalar(dim_size(dim, local=False)) for dim in layout.dims(tv)]


def dim_size(dim: list, local: bool) -> ir.Scalar:
    """The size of one runtime dim as a scalar (`layout._dim_size`): a
    mesh_x piece 1 (or its extent across ranks), an unsplit axis its
    extent, the other pieces of a split axis the rows a rank holds."""
    first = dim[0]
    if first.is_device_parallel:
        return ir.Scalar.constant(1) if local else first.extent
    if first.parent is None:
        return first.extent
    parent = first.parent
    factor = None
    for leaf in parent.loop_leaves():
        if leaf.is_device_parallel and leaf is not parent:
            factor = leaf.extent if factor is None else ir.ScalarExpr("*", factor, leaf.extent)
    return parent.extent if factor is None else ir.ScalarExpr("/", parent.extent, factor)


def _mesh_axis(tv: ir.TensorView) -> int:
    (axis,) = tv.device_axes()
    return layout.position(tv, axis)


def communication(cc, e: ir.Communication) -> None:
    rank = cc.rank if cc.rank is not None else cc.comm.rank
    if rank not in e.team:
        return
    order = tuple(cc.comm.group_order(e.team))
    holds_in = e.input.mesh is None or rank in e.input.mesh
    holds_out = e.out.mesh is None or rank in e.out.mesh
    t = e.type
    f = {
        "type": COMMUNICATION_TYPES.index(t.value),
        "group": cc.group(e.team),
        "team_size": len(e.team),
        "is_root": e.root is not None and rank == e.root,
        "root": -1 if e.root is None else order.index(e.root),
        "red_op": e.red_op or "",
        "local_reduce": list(e.local_reduce),
        "input": cc.tensor(e.input) if holds_in else -1,
        "out": cc.tensor(e.out) if holds_out else -1,
        "in_shape": local_shape(cc, e.input),
        "out_shape": local_shape(cc, e.out),
        "in_full": full_shape(cc, e.input),
        "out_full": _out_full(cc, e),
        "dtype_in": DTYPES[e.input.dtype],
        "dtype_out": DTYPES[e.out.dtype],
        "in_axis": _mesh_axis(e.input) if e.input.device_axes() else (0 if unannotated.inferred(e) else -1),
        "out_axis": _mesh_axis(e.out) if e.out.device_axes() else (0 if unannotated.inferred(e) else -1),
        "in_order": order == tuple(e.team),
        "perm": [],
        "identity": float(e.red_op.identity(e.out.dtype)) if e.red_op else 0.0,
        "peer": -1,
        "self_copy": False,
        "view_out": e.out in cc.local_views,
        "out_may_be_given": e.out in cc.container.outputs,
        "backend": e.backend,
    }
    if t is ir.CommunicationType.Allgather:
        f["perm"] = [order.index(r) for r in e.team]
    elif t is ir.CommunicationType.ReduceScatter:
        f["perm"] = [e.team.index(r) for r in order]
    elif t is ir.CommunicationType.Gather:
        f["perm"] = [order.index(r) for r in e.team if r in e.input.mesh]
    elif t is ir.CommunicationType.Scatter:
        devices = list(e.out.mesh.devices)
        f["perm"] = [devices.index(r) if r in devices else 0 for r in order]
        f["chunks"] = len(devices)
    elif t is ir.CommunicationType.AllToAll:
        # Group rank j is sent the piece of team position perm[j]; the piece
        # for team position k comes from group rank recv_perm[k]. The axes
        # are the logical ones the transport chunks and concatenates.
        f["perm"] = [e.team.index(r) for r in order]
        f["recv_perm"] = [order.index(r) for r in e.team]
        f["in_view"] = {"logical": logical_groups(e.input), "cuts": []}
        f["in_axis"] = _logical_mesh_axis(e.input, e.parallel_type)
        f["out_axis"] = _logical_mesh_axis(e.out, e.parallel_type)
        if e.rows is not None:
            # Sized at run time (`ir.Set`'s `rows`): the counts of the rows
            # sent and received, read through their logical axes as the
            # transport reads them, the output's logical axes, this rank's
            # team position, and the counts' text for its errors.
            f["rows"] = cc.tensor(e.rows)
            f["rows_in"] = cc.tensor(e.rows_in)
            f["rows_view"] = {"logical": logical_groups(e.rows), "cuts": []}
            f["rows_in_view"] = {"logical": logical_groups(e.rows_in), "cuts": []}
            f["out_view"] = {"logical": logical_groups(e.out), "cuts": []}
            f["me"] = e.team.index(rank)
            f["rows_text"] = printer.format_tv(e.rows)
            f["rows_in_text"] = printer.format_tv(e.rows_in)
    elif t is ir.CommunicationType.SendRecv:
        # The receiver is the team's other rank, whichever order the team lists.
        others = [r for r in e.team if r != e.root]
        receiver = others[0] if others else e.root
        f["self_copy"] = receiver == e.root
        f["peer"] = order.index(receiver) if rank == e.root else order.index(e.root)
    cc.emit("communication", e, **f)


def _logical_mesh_axis(tv: ir.TensorView, parallel_type) -> int:
    found = layout.sharded_axis(tv, parallel_type)
    if found is None:
        raise MissingHandlerError(f"{printer.format_tv(tv)} has no {parallel_type.name} axis")
    return found[0]


def _out_full(cc, e: ir.Communication) -> list[int]:
    """The whole output's runtime sizes; for a ReduceScatter without
    annotations, the team's pieces along its outermost axis."""
    extents = [dim_size(dim, local=False) for dim in layout.dims(e.out)]
    if e.type is ir.CommunicationType.ReduceScatter and unannotated.inferred(e):
        extents[0] = ir.ScalarExpr("*", extents[0], ir.Scalar.constant(len(e.team)))
    return [cc.scalar(x) for x in extents]


def p2p(cc, e) -> None:
    cc.emit(
        "p2p",
        e,
        send=e.type == "send",
        buffer=cc.tensor(e.buffer),
        peer=cc.scalar(e.peer),
        world_size=cc.comm.world_size,
        backend=e.backend,
        # A push names its place in the peer's window (the cuda transport).
        **({"into": cc.tensor(e.into)} if e.into is not None else {}),
    )


def start_coalescing(cc, e) -> None:
    # Its backend is its group's, known at its EndCoalescing.
    cc.coalescing = cc.emit("start_coalescing", e, backend="")


def end_coalescing(cc, e) -> None:
    """Both ends of a coalescing group name the backend of its first P2P,
    as the evaluator takes it, so that the group opens and closes on the
    transport its members post on; an empty group names none and posts
    nothing."""
    start, cc.coalescing = cc.coalescing, None
    backend = ""
    if start is not None:
        opened = next(k for k, instr in enumerate(cc.instrs) if instr is start)
        members = [instr.fields["backend"] for instr in cc.instrs[opened + 1 :] if instr.op == "p2p"]
        backend = start.fields["backend"] = members[0] if members else ""
    cc.emit("end_coalescing", e, backend=backend)


def wait(cc, e) -> None:
    target = e.communication
    if isinstance(target, ir.Communication):
        rank = cc.rank if cc.rank is not None else cc.comm.rank
        if rank not in target.team:
            return
    # The posting instruction of the target: the last one emitted for it
    # (it precedes its Wait in program order).
    posted = [i for i, instr in enumerate(cc.instrs) if instr.expr is target]
    if not posted:
        raise ProgramError(f"Wait before its communication is posted: {printer.format_expr_head(target)}")
    cc.emit("wait", e, posted=posted[-1], text=printer.format_expr_head(target))
