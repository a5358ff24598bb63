"""Replace every op that moves data between ranks by communications.

Precondition: `propagate_shardings` has run (every tensor has a mesh when
any has), and `parallelize_streams` may have put resharding ops in loops.
Postcondition: each resharding `Set` or reduction, top level or in a loop
body, is replaced by `Allocate` of its output (unless a slice already binds
it) followed by one or more `Communication`s, each followed by its `Wait`
(survey §3.2's table):

    Set, sharded -> replicated, one mesh        Allgather over each team
    Set, sharded -> replicated, two meshes      Gather, one per receiver
    Set, replicated -> sharded                  Scatter from the sender mesh's first rank
    Set, sharded -> sharded, two meshes         SendRecv, one per position
    Set, sharded on another axis, one mesh      AllToAll over each team
    Set, otherwise (mesh to mesh)               Broadcast from the sender mesh's first rank
    reduction of the sharded axis, out sharded  ReduceScatter over each team
    same, out replicated, one mesh              Allreduce over each team
    same, out replicated, two meshes            Reduce, one per receiver

An op reshards along one mesh dimension: `mesh_x` (its teams are the rows
of the mesh) or `mesh_y` (the columns); on a 2-D mesh, Allgather,
Allreduce, ReduceScatter and AllToAll run per team, the others need 1-D
meshes (as in nvFuser).

Every rank gets every communication; `prune_for_rank` later drops those a
rank takes no part in, so the program before pruning is the same on every
rank (its dump is what ranks hash to agree).

    T1 = Set( T0 )            T1 = ALLOCATE(...)
    (T0 sharded, T1 not)  ->  Communication 0 (type=Allgather, team=(0 1), input=T0, output=T1, backend=NCCL)
                              Wait Communication 0
"""

from __future__ import annotations

import torch

from hostir import ir, layout, printer
from hostir.container import HostIrContainer
from hostir.errors import HostIrError
from hostir.lower.propagate_shardings import device_types, is_resharding

Type = ir.CommunicationType


class CommunicationLoweringError(HostIrError, ValueError):
    pass


def lower_communications(container: HostIrContainer, backend: str = "NCCL") -> HostIrContainer:
    """`backend`: the transport the communications name."""
    result = container.derive()
    for e in _rewrite(container, container.exprs, set(), backend):
        result.push_back(e)
    return result


def _rewrite(container: HostIrContainer, exprs, bound: set, backend: str, in_loop: bool = False) -> list[ir.Expr]:
    new: list[ir.Expr] = []
    for e in exprs:
        if isinstance(e, ir.ForLoop):
            new.append(e.replace(body=_rewrite(container, e.body, set(bound), backend, True)))
            continue
        if in_loop and isinstance(e, ir.Set) and e.rows is not None:
            raise CommunicationLoweringError(
                f"a set sized by rows moves whole pieces; a stream loop would cut them (take the stream "
                f"axis off its tensors):\n{printer.format_expr_head(e)}"
            )
        if isinstance(e, ir.HirAliasSelect):
            bound.add(e.out)
        if isinstance(e, ir.Allocate):
            bound.add(e.buffer)
        if not isinstance(e, (ir.Set, ir.ReductionOp)) or not is_resharding(e):
            if isinstance(e, ir.Set) and e.rows is not None:
                raise CommunicationLoweringError(
                    f"a set sized by rows must move a sharded axis between the ranks (an AllToAll); this one "
                    f"moves nothing:\n{printer.format_expr_head(e)}"
                )
            new.append(e)
            continue
        comms = _communications(container, e, backend)
        if e.out not in bound:
            new.append(ir.Allocate(e.out, ir.MemoryType.global_))
            bound.add(e.out)
        for c in comms:
            new += [c, ir.Wait(c)]
    return new


def _parallel_type(e: ir.Expr) -> ir.ParallelType:
    """The one mesh dimension along which `e` moves data."""
    changed = set()
    for o, i in e.id_pairs():
        outs = frozenset() if o.is_reduction else device_types(o)
        changed |= device_types(i) ^ outs
    if len(changed) > 1:
        names = ", ".join(sorted(pt.name for pt in changed))
        raise CommunicationLoweringError(
            f"this op reshards along {names} at once; reshard along one mesh dimension per op "
            f"(a set for each):\n{printer.format_expr_head(e)}"
        )
    return changed.pop() if changed else ir.ParallelType.mesh_x


def _sharded_on(tv: ir.TensorView, pt: ir.ParallelType) -> bool:
    return any(d.parallel_type is pt for d in tv.device_axes())


def _outermost_piece(e, tv: ir.TensorView, pt: ir.ParallelType) -> None:
    for d in tv.logical_runtime():
        leaves = d.loop_leaves()
        if any(x.parallel_type is pt for x in leaves) and leaves[0].parallel_type is not pt:
            raise CommunicationLoweringError(
                f"axis {printer.format_id(d)} of T{tv.name} is sharded on an inner piece; an AllToAll "
                f"needs the {pt.name} piece outermost (outer_split):\n{printer.format_expr_head(e)}"
            )


def _communications(container: HostIrContainer, e: ir.Expr, backend: str) -> list[ir.Communication]:
    src, dst = e.input, e.out
    sender, receiver = src.mesh, dst.mesh
    pt = _parallel_type(e)
    in_sharded = _sharded_on(src, pt)
    out_sharded = _sharded_on(dst, pt)

    local_reduce = layout.local_reduce_dims(e, pt) if isinstance(e, ir.ReductionOp) else ()
    rows, rows_in = (e.rows, e.rows_in) if isinstance(e, ir.Set) else (None, None)

    def make(type_, team, root=None, red_op=None):
        return ir.Communication(
            container.next_name("comm"),
            type_,
            dst,
            src,
            tuple(team),
            root=root,
            red_op=red_op,
            backend=backend,
            local_reduce=local_reduce if red_op is not None else (),
            parallel_type=pt,
            rows=rows,
            rows_in=rows_in,
        )

    def teams() -> list[tuple[int, ...]]:
        return sender.teams_along(pt)

    def with_root(mesh: ir.DeviceMesh, root: int) -> list[int]:
        team = list(mesh.devices)
        return team if root in team else team + [root]

    if isinstance(e, ir.ReductionOp):
        reduced = [i for o, i in e.id_pairs() if o.is_reduction]
        if not any(x.parallel_type is pt for d in reduced for x in d.loop_leaves()):
            raise CommunicationLoweringError(
                f"the input of a reduction that moves data must be sharded on a reduced axis; insert "
                f"a set before the reduction to reshard:\n{printer.format_expr_head(e)}"
            )
        if len(reduced) != 1:
            raise CommunicationLoweringError(
                f"a reduction lowered to a communication reduces exactly one axis, the sharded one; "
                f"this one reduces {len(reduced)}:\n{printer.format_expr_head(e)}"
            )
        red_op = e.kind
        if out_sharded:
            if sender != receiver:
                raise CommunicationLoweringError(
                    f"ReduceScatter needs the same sender and receiver mesh, got {sender!r} and "
                    f"{receiver!r}:\n{printer.format_expr_head(e)}"
                )
            return [make(Type.ReduceScatter, team, red_op=red_op) for team in teams()]
        if sender == receiver:
            return [make(Type.Allreduce, team, red_op=red_op) for team in teams()]
        _require_1d(e, sender, receiver, "Reduce")
        return [make(Type.Reduce, with_root(sender, r), root=r, red_op=red_op) for r in receiver.devices]

    if in_sharded and not out_sharded:
        if sender == receiver:
            return [make(Type.Allgather, team) for team in teams()]
        _require_1d(e, sender, receiver, "Gather")
        return [make(Type.Gather, with_root(sender, r), root=r) for r in receiver.devices]
    if not in_sharded and out_sharded:
        _require_1d(e, sender, receiver, "Scatter")
        root = sender.devices[0]
        return [make(Type.Scatter, with_root(receiver, root), root=root)]
    if in_sharded and out_sharded and sender == receiver:
        for tv in (src, dst):
            _outermost_piece(e, tv, pt)
        if rows is not None:
            _check_rows(e, pt)
        return [make(Type.AllToAll, team) for team in teams()]
    if rows is not None:
        raise CommunicationLoweringError(
            f"a set sized by rows must be an AllToAll (a sharded axis moved to another on one mesh):\n"
            f"{printer.format_expr_head(e)}"
        )
    if in_sharded and out_sharded:
        _require_1d(e, sender, receiver, "SendRecv")
        if sender.size != receiver.size:
            raise CommunicationLoweringError(
                f"the receiver and sender meshes have different sizes ({sender!r}, {receiver!r}):\n"
                f"{printer.format_expr_head(e)}"
            )
        return [
            make(Type.SendRecv, (s,) if s == r else (s, r), root=s)
            for s, r in zip(sender.devices, receiver.devices)
        ]
    _require_1d(e, sender, receiver, "Broadcast")
    root = sender.devices[0]
    return [make(Type.Broadcast, with_root(receiver, root), root=root)]


def _check_rows(e: ir.Set, pt: ir.ParallelType) -> None:
    """A run-time sized AllToAll's counts: `rows` sharded as the input,
    `rows_in` as the output, each with the two mesh-sized axes that lead
    the input (the sender's and the receiver's piece), then the bound axis
    of rows in the input, whose real rows they count (summed over their
    axes past the two)."""
    for tv, like, what in ((e.rows, e.input, "rows"), (e.rows_in, e.out, "rows_in")):
        if tv.dtype is not torch.int64:
            raise CommunicationLoweringError(f"{what} T{tv.name} must be int64, got {tv.dtype}")
        axes, ref = tv.logical_runtime(), like.logical_runtime()
        if len(axes) < 2 or len(ref) < 3:
            raise CommunicationLoweringError(
                f"a set sized by rows moves [sender piece, receiver piece, rows, ...] with {what} [sender "
                f"piece, receiver piece, ...]:\n{printer.format_expr_head(e)}"
            )
        for a, b in zip(axes[:2], ref[:2]):
            if a.extent.is_constant and b.extent.is_constant and a.extent.value != b.extent.value:
                raise CommunicationLoweringError(
                    f"{what} T{tv.name} must lead with the two piece axes of T{like.name} "
                    f"({b.extent.value}), got {a.extent.value}:\n{printer.format_expr_head(e)}"
                )
            if device_types(a) != device_types(b):
                raise CommunicationLoweringError(
                    f"{what} T{tv.name} must be sharded as T{like.name}:\n{printer.format_expr_head(e)}"
                )
    for tv in (e.input, e.out):
        axes = tv.logical_runtime()
        if not any(device_types(d) for d in axes[:2]) or any(device_types(d) for d in axes[2:]):
            raise CommunicationLoweringError(
                f"a set sized by rows moves T{tv.name} sharded on one of its two leading axes only:\n"
                f"{printer.format_expr_head(e)}"
            )


def _require_1d(e, sender: ir.DeviceMesh, receiver: ir.DeviceMesh, what: str) -> None:
    if sender.ndim != 1 or receiver.ndim != 1:
        raise CommunicationLoweringError(f"{what} is only supported on 1-D meshes:\n{printer.format_expr_head(e)}")
