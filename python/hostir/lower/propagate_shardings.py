"""Give every tensor of a multi-device program a mesh and a sharding, and
check that each op either computes or reshards.

Precondition: top-level fusion ops, as `build_host_program` leaves them.
Postcondition: if any tensor has a mesh, every tensor has one. A tensor the
user did not place (no `set_device_mesh`) takes the mesh of its first
placed operand, and each of its axes takes the splits and the `mesh_x` of
the operand axis it iterates with (a reduced axis stays replicated, so a sum
over a sharded axis becomes an Allreduce). An input nobody placed takes the
mesh of its first placed consumer, replicated. Every op that is not a `Set`
or a reduction (the resharding ops) has operands split and sharded as its
output is, on one mesh. At most one axis of a tensor is `mesh_x`; a
constant `mesh_x` extent equals the mesh size. The pass mutates the
program's own TensorViews (copies of the user's), not the user's fusion.

    T0 (DeviceMesh{0 1})[iS0{i0}, ideviceIdx.x1{2}]    T1 = Set(T0)
    T1[iS2{i0}, iS3{2}]  (unplaced)                ->   T1 (DeviceMesh{0 1})[iS2{i0}, ideviceIdx.x3{2}]
"""

from __future__ import annotations

from hostir import ir, printer
from hostir.container import HostIrContainer
from hostir.errors import HostIrError


class ShardingError(HostIrError, ValueError):
    pass


RESHARDING_OPS = (ir.Set, ir.ReductionOp)


def propagate_shardings(container: HostIrContainer) -> HostIrContainer:
    tvs = _all_tvs(container)
    if not any(tv.mesh is not None for tv in tvs):
        for tv in tvs:
            if tv.device_axes():
                raise ShardingError(
                    f"{printer.format_tv(tv)} has a mesh_x axis but no mesh; call set_device_mesh"
                )
        return container

    for e in container.exprs:
        (out,) = e.outputs()
        placed = [v for v in e.inputs() if isinstance(v, ir.TensorView) and v.mesh is not None]
        if out.mesh is None and placed:
            ref = max(placed, key=lambda v: len(v.device_axes()))
            out.mesh = ref.mesh
            for o, i in e.id_pairs():
                if any(v is ref for v in _tv_of(e, i)):
                    _copy_sharding(out, o, i)
    for e in reversed(container.exprs):
        (out,) = e.outputs()
        for v in e.inputs():
            if isinstance(v, ir.TensorView) and v.mesh is None and out.mesh is not None:
                v.mesh = out.mesh

    for tv in tvs:
        _check_tensor(tv)
    for e in container.exprs:
        _check_op(e)
    return container


def _all_tvs(container: HostIrContainer) -> list[ir.TensorView]:
    seen: dict[int, ir.TensorView] = {}
    for tv in container.inputs + container.outputs:
        if isinstance(tv, ir.TensorView):
            seen.setdefault(id(tv), tv)
    for e in container.walk():
        for v in e.inputs() + e.outputs():
            if isinstance(v, ir.TensorView):
                seen.setdefault(id(v), v)
    return list(seen.values())


def _tv_of(e: ir.Expr, d: ir.IterDomain) -> list[ir.TensorView]:
    return [v for v in e.inputs() if isinstance(v, ir.TensorView) and d in v.logical]


def _copy_sharding(out: ir.TensorView, o: ir.IterDomain, i: ir.IterDomain) -> None:
    """Give `out`'s logical axis `o` the splits and `mesh_x` of `i`."""
    if o.is_reduction or o.leaves is not None:
        return
    if i.leaves is None:
        if i.is_device_parallel and o.parallel_type is ir.ParallelType.serial:
            o.parallel_type = ir.ParallelType.mesh_x
        return
    made = []
    for leaf in i.leaves:
        new = ir.IterDomain(out.owner, leaf.extent, o.iter_type)
        if leaf.is_device_parallel:
            new.parallel_type = ir.ParallelType.mesh_x
        new.parent = o
        made.append(new)
    o.leaves = made
    at = out.domain.index(o)
    out.domain[at : at + 1] = made


def _check_tensor(tv: ir.TensorView) -> None:
    if tv.mesh is None:
        raise ShardingError(
            f"{printer.format_tv(tv)} has no mesh while other tensors of the program have one; "
            f"call set_device_mesh on it"
        )
    axes = tv.device_axes()
    if len(axes) > 1:
        ids = ", ".join(printer.format_id(d) for d in axes)
        raise ShardingError(f"{printer.format_tv(tv)} has {len(axes)} mesh_x axes ({ids}); at most one is allowed")
    for d in axes:
        if d.extent.is_constant and d.extent.value != tv.mesh.x_size:
            raise ShardingError(
                f"mesh_x axis {printer.format_id(d)} of T{tv.name} has extent {d.extent.value} but "
                f"{tv.mesh!r} shards {tv.mesh.x_size} ways; the extents must be equal "
                f"(outer_split the axis by {tv.mesh.x_size} first)"
            )
        if d.is_broadcast and tv.mesh.x_size > 1:
            raise ShardingError(f"broadcast axis {printer.format_id(d)} of T{tv.name} cannot be mesh_x")


def _signature(d: ir.IterDomain) -> list[tuple[str, bool]]:
    return [(printer.format_scalar(x.extent), x.is_device_parallel) for x in d.loop_leaves()]


def is_resharding(e: ir.Expr) -> bool:
    """True if `e` moves data between ranks: its operand and output differ
    in mesh or in which axes are `mesh_x`, or it reduces a `mesh_x` axis."""
    tvs = [v for v in e.inputs() + e.outputs() if isinstance(v, ir.TensorView)]
    if any(v.mesh is None for v in tvs):
        return False
    if len({v.mesh for v in tvs}) > 1:
        return True
    for o, i in e.id_pairs():
        in_sharded = any(x.is_device_parallel for x in i.loop_leaves())
        out_sharded = any(x.is_device_parallel for x in o.loop_leaves()) and not o.is_reduction
        if in_sharded != out_sharded:
            return True
    return False


def _check_op(e: ir.Expr) -> None:
    resharding = is_resharding(e)
    if resharding and not isinstance(e, RESHARDING_OPS):
        raise ShardingError(
            f"this op both computes and moves data between ranks (its operands and output are "
            f"sharded differently):\n{printer.format_expr_head(e)}\nreshard an operand first with "
            f"fd.ops.set and shard the copy as the output"
        )
    if isinstance(e, (ir.MatmulOp, ir.LinearOp)):
        _check_matmul_splits(e)
    if resharding:
        return
    for o, i in e.id_pairs():
        if o.is_reduction and isinstance(e, ir.ReductionOp):
            continue
        if i.is_broadcast or o.is_broadcast:
            continue
        if _signature(o) != _signature(i) and not (o.is_reduction and i.leaves is None and o.leaves is None):
            raise ShardingError(
                f"axis {printer.format_id(o)} and its operand axis {printer.format_id(i)} are split "
                f"differently ({_leaves_text(o)} vs {_leaves_text(i)}); split both the same way:\n"
                f"{printer.format_expr_head(e)}"
            )


def _leaves_text(d: ir.IterDomain) -> str:
    return "[" + ", ".join(printer.format_id(x) for x in d.loop_leaves()) + "]"


def _check_matmul_splits(e: ir.Expr) -> None:
    """Splits of a matmul's K or N axis would change what the runtime op
    computes; batch and M axes may be split."""
    if isinstance(e, ir.MatmulOp):
        k_axes = [e.a.logical_runtime()[-1], e.b.logical_runtime()[-2]]
        n_axes = [e.b.logical_runtime()[-1]]
    else:
        k_axes = [e.input.logical_runtime()[-1], e.weight.logical_runtime()[1]]
        n_axes = [e.weight.logical_runtime()[0]]
    for d in k_axes + n_axes + [e.out.logical[-1], e.out.logical[-2]]:
        if d.leaves is not None:
            raise ShardingError(
                f"{printer.format_id(d)} is split, but only batch and M axes of a matmul or linear "
                f"can be split:\n{printer.format_expr_head(e)}"
            )
