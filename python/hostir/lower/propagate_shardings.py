"""Give every tensor of a multi-device program a mesh and a sharding.

Precondition: top-level fusion ops, as `build_host_program` leaves them.
Postcondition: if any tensor has a mesh, every tensor has one. A tensor the
user did not place (no `set_device_mesh`) takes the mesh of its placed
operands, and each of its axes takes the splits and the `mesh_x`/`mesh_y`
of an operand axis it iterates with: a matmul's or linear's output from the
weight first (weights stay where they are; activations move), any other
op's from its most sharded operand first, each mesh dimension used once (a
reduced axis stays replicated, so a sum over a sharded axis becomes an
Allreduce). An input nobody placed takes the mesh of its first placed
consumer, replicated. A tensor has at most one axis per mesh dimension,
and a constant sharded extent equals the mesh's size along it. Whether each
op computes or reshards is `insert_reshardings`' to check. The pass mutates
the program's own TensorViews (copies of the user's), not the user's fusion.

    T0 (DeviceMesh{0 1})[iS0{i0}, ideviceIdx.x1{2}]    T1 = Set(T0)
    T1[iS2{i0}, iS3{2}]  (unplaced)                ->   T1 (DeviceMesh{0 1})[iS2{i0}, ideviceIdx.x3{2}]
"""

from __future__ import annotations

from hostir import ir, printer
from hostir.container import HostIrContainer
from hostir.errors import HostIrError
from hostir.layout import device_types


class ShardingError(HostIrError, ValueError):
    pass


RESHARDING_OPS = (ir.Set, ir.ReductionOp)


def propagate_shardings(container: HostIrContainer) -> HostIrContainer:
    tvs = all_tvs(container)
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
        if out.mesh is not None or not placed:
            continue
        out.mesh = max(placed, key=lambda v: len(v.device_axes())).mesh
        for ref in _references(e, [v for v in placed if v.mesh == out.mesh]):
            for o, i in e.id_pairs():
                if i in ref.logical:
                    _copy_sharding(out, o, i)
    for e in reversed(container.exprs):
        (out,) = e.outputs()
        for v in e.inputs():
            if isinstance(v, ir.TensorView) and v.mesh is None and out.mesh is not None:
                v.mesh = out.mesh

    for tv in tvs:
        _check_tensor(tv)
    return container


def all_tvs(container: HostIrContainer) -> list[ir.TensorView]:
    seen: dict[int, ir.TensorView] = {}
    for tv in container.inputs + container.outputs:
        if isinstance(tv, ir.TensorView):
            seen.setdefault(id(tv), tv)
    for e in container.walk():
        for v in e.inputs() + e.outputs():
            if isinstance(v, ir.TensorView):
                seen.setdefault(id(v), v)
    return list(seen.values())


def _references(e: ir.Expr, placed: list[ir.TensorView]) -> list[ir.TensorView]:
    """The operands an output copies shardings from, first one first."""
    weight = {ir.MatmulOp: "b", ir.LinearOp: "weight"}.get(type(e))
    first = [getattr(e, weight)] if weight is not None else []
    rest = sorted((v for v in placed if all(v is not f for f in first)), key=lambda v: -len(v.device_axes()))
    return [v for v in first if v in placed] + rest


def _used_types(tv: ir.TensorView) -> set:
    return {d.parallel_type for d in tv.device_axes()}


def _copy_sharding(out: ir.TensorView, o: ir.IterDomain, i: ir.IterDomain) -> None:
    """Give `out`'s logical axis `o` the splits and mesh dimensions of `i`,
    unless `o` has its own or `out` already uses one of those dimensions,
    or is a broadcast axis (size 1 on every rank, nothing to shard)."""
    if o.is_reduction or o.is_broadcast or o.leaves is not None or o.is_device_parallel:
        return
    if device_types(i) & _used_types(out):
        return
    if i.leaves is None:
        if i.is_device_parallel:
            o.parallel_type = i.parallel_type
        return
    made = []
    for leaf in i.leaves:
        new = ir.IterDomain(out.owner, leaf.extent, o.iter_type)
        if leaf.is_device_parallel:
            new.parallel_type = leaf.parallel_type
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
    for pt in ir.DEVICE_PARALLEL_TYPES:
        axes = [d for d in tv.device_axes() if d.parallel_type is pt]
        if len(axes) > 1:
            ids = ", ".join(printer.format_id(d) for d in axes)
            raise ShardingError(
                f"{printer.format_tv(tv)} has {len(axes)} {pt.name} axes ({ids}); at most one is allowed"
            )
        if not axes:
            continue
        (d,) = axes
        try:
            n = tv.mesh.size_along(pt)
        except ValueError as err:
            raise ShardingError(f"axis {printer.format_id(d)} of T{tv.name}: {err}") from err
        if d.extent.is_constant and d.extent.value != n:
            raise ShardingError(
                f"{pt.name} axis {printer.format_id(d)} of T{tv.name} has extent {d.extent.value} but "
                f"{tv.mesh!r} shards {n} ways; the extents must be equal "
                f"(outer_split the axis by {n} first)"
            )
        if d.is_broadcast and n > 1:
            raise ShardingError(f"broadcast axis {printer.format_id(d)} of T{tv.name} cannot be {pt.name}")


def slices_locally(e: ir.Expr, o: ir.IterDomain, i: ir.IterDomain) -> bool:
    """Whether a compute op's operand axis `i`, replicated on mesh
    dimensions where its output axis `o` is sharded, is read as this rank's
    slice (no communication): not for a `Set`, whose replicated-to-sharded
    form is a Scatter. A partial matmul reads its slice of a replicated K
    the same way."""
    if isinstance(e, ir.Set) or (o.is_reduction and getattr(e, "partial", None) is None):
        return False
    ins, outs = device_types(i), device_types(o)
    return ins < outs and (i.leaves is None or len(i.loop_leaves()) == len(o.loop_leaves()))


def is_resharding(e: ir.Expr) -> bool:
    """True if `e` moves data between ranks: its operand and output differ
    in mesh or in which axes are sharded (other than a replicated operand
    a compute op reads its slice of), or it reduces a sharded axis (but not
    a matmul's partial sums, which each rank keeps)."""
    tvs = [v for v in e.inputs() + e.outputs() if isinstance(v, ir.TensorView)]
    if any(v.mesh is None for v in tvs):
        return False
    if len({v.mesh for v in tvs}) > 1:
        return True
    partial = getattr(e, "partial", None)
    for o, i in e.id_pairs():
        if o.is_reduction and partial is not None:
            continue
        ins = device_types(i)
        outs = frozenset() if o.is_reduction else device_types(o)
        if ins != outs and not slices_locally(e, o, i):
            return True
    return False
