"""Sizes of sharded axes, checked against the mesh when a call's sizes are
known: before lowering runs anything, on every rank alike.

An axis parallelized `mesh_x` (or `mesh_y`) without a split has the mesh's
size along that dimension (each rank holds one index); an axis split with a
sharded piece must divide by the number of ranks sharing it. A symbolic extent that an
op ties to an input's axis (a matmul's output rows are its operand's rows)
takes that input's size, so a program whose output shards rows the input
has too many of is refused here, naming the tensor and axis, rather than
failing inside an op or a communication.
"""

from __future__ import annotations

from hostir import axis_graph, ir, layout, printer
from hostir.errors import HostIrError


class MeshExtentError(HostIrError, ValueError):
    """A sharded axis whose size, for these inputs, does not fit the mesh."""


def check(fusion: ir.Fusion, sizes: dict) -> None:
    """`sizes`: the whole size of each symbolic input extent."""
    classes = axis_graph.ExtentClasses(fusion.exprs)
    known: dict = {}
    for extent, size in sizes.items():
        known.setdefault(_key(classes, extent), size)
    for tv in _tensors(fusion):
        if tv.mesh is None:
            continue
        for pos, d in enumerate(tv.logical_runtime()):
            sharded = [x for x in d.loop_leaves() if x.is_device_parallel]
            if not sharded or d.is_broadcast:
                continue
            whole = d.extent.value if d.extent.is_constant else known.get(_key(classes, d.extent))
            if whole is None:
                continue
            if d.leaves is None:
                n = tv.mesh.size_along(d.parallel_type)
                if whole != n:
                    raise MeshExtentError(
                        f"axis {pos} of {printer.format_tv(tv)} is {d.parallel_type.name} on a mesh of {n} "
                        f"along it, so its size must be {n}, but it is {whole} for these inputs; "
                        f"outer_split it by {n} to shard rows"
                    )
                continue
            # Each rank holds whole / ranks rows (stream chunks of them may
            # be ragged).
            ranks = layout.shard_count(tv.mesh, d)
            if whole % ranks:
                raise MeshExtentError(
                    f"axis {pos} of {printer.format_tv(tv)} is split across {ranks} ranks, but its size is "
                    f"{whole} for these inputs, which {ranks} does not divide"
                )


def _key(classes: axis_graph.ExtentClasses, extent: ir.Scalar):
    key = classes.key(extent)
    return id(key) if isinstance(key, ir.Scalar) else ("c", key)


def _tensors(fusion: ir.Fusion) -> list[ir.TensorView]:
    found: dict = {}
    for v in fusion.inputs + fusion.outputs:
        if isinstance(v, ir.TensorView):
            found.setdefault(id(v), v)
    for e in fusion.exprs:
        for v in e.inputs() + e.outputs():
            if isinstance(v, ir.TensorView):
                found.setdefault(id(v), v)
    return list(found.values())
