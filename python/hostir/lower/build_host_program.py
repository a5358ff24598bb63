"""Turn a fusion into a host program: every fusion op becomes a top-level op.

Precondition: a `Fusion` whose ops each have one output.
Postcondition: a verified `HostIrContainer` holding copies of the fusion's
TensorViews (same names, meshes, splits, parallel types and explicit
schedules; memory type host for a tensor in host memory, and for each input
in `host_inputs`, else global) and one top-level op per fusion op, in
definition order. The user's fusion is not changed.

    %Fusion { (T0_g_float[iS0{i0}]) -> (T1_l_float[iS1{i0}]) :
      T1_l_float[iS1{i0}] = Set( T0_g_float[iS0{i0}], cache_op=Streaming )
    becomes the same ops in a %HostIrContainer, with T1_g_float.
"""

from __future__ import annotations

from hostir import ir
from hostir.container import HostIrContainer
from hostir.errors import DefinitionError


def build_host_program(fusion: ir.Fusion, host_inputs: frozenset = frozenset()) -> HostIrContainer:
    """`host_inputs`: positions of fusion inputs that a call passes in host
    memory to stream (an execute's `host_inputs="stream"`)."""
    in_host = {id(tv) for i, tv in enumerate(fusion.inputs) if i in host_inputs}
    container = HostIrContainer(counters=fusion._counters)
    ids: dict[ir.IterDomain, ir.IterDomain] = {}
    tvs: dict[ir.TensorView, ir.TensorView] = {}

    def copy_id(d: ir.IterDomain) -> ir.IterDomain:
        if d not in ids:
            new = ids[d] = ir.IterDomain(container, d.extent, d.iter_type, d.parallel_type, name=d.name)
            new.scheduled = d.scheduled
            if d.parent is not None:
                new.parent = copy_id(d.parent)
            if d.leaves is not None:
                new.leaves = [copy_id(leaf) for leaf in d.leaves]
        return ids[d]

    def copy(v):
        if not isinstance(v, ir.TensorView):
            return v
        if v not in tvs:
            tvs[v] = ir.TensorView(
                container,
                [copy_id(d) for d in v.domain],
                v.dtype,
                ir.MemoryType.host if ir.in_host_memory(v) or id(v) in in_host else ir.MemoryType.global_,
                name=v.name,
                mesh=v.mesh,
                logical=[copy_id(d) for d in v.logical],
            )
        return tvs[v]

    for tv in fusion.inputs:
        container.add_input(copy(tv))
    for e in fusion.exprs:
        if isinstance(e, ir.SHAPE_OPS) and not isinstance(e, ir.PermuteOp):
            _check_unsharded(e)
        if len(e.outputs()) != 1:
            raise DefinitionError(f"each op must have one output:\n{e!r}")
        fields = {f: copy(getattr(e, f)) for f in e.INPUTS + e.OUTPUTS}
        container.push_back(e.replace(**fields))
    for tv in fusion.outputs:
        container.add_output(copy(tv))
    return container


def _check_unsharded(e: ir.Expr) -> None:
    if isinstance(e, ir.SliceOp) and _keeps_shards_whole(e):
        return
    for v in e.inputs() + e.outputs():
        if isinstance(v, ir.TensorView) and v.device_axes():
            raise DefinitionError(
                f"reshape, slice and select take and give tensors without mesh_x axes (a slice may "
                f"take one that is an axis of its own, kept whole); T{v.name} has one (gather it first "
                f"with a set):\n{e!r}"
            )


def _keeps_shards_whole(e: ir.SliceOp) -> bool:
    """Whether slice `e` cuts no sharded axis: its operand's mesh_x axes
    are logical axes of their own (no split), each taken whole, so that
    each rank's piece is sliced as the whole tensor is."""
    x = e.input
    if len(x.domain) != len(x.logical):
        return False
    return all(not d.is_device_parallel or r == (0, None, 1) for d, r in zip(x.logical, e.ranges))
