"""The shapes of a tensor and the conversions between them.

A TensorView has three shapes:

- its *logical* shape: the axes as defined (what a single-device user passes
  and gets back, and what a multi-device user sees of the whole tensor);
- its *loop* shape: the logical axes with each split axis replaced by the
  pieces it was split into (`tv.domain`), which is what ops, loops and
  shardings are written against;
- its *runtime* shape: the dims of the tensor a rank actually holds while the
  program runs. A `mesh_x` piece is a dim of its own of size 1 (the rank
  holds one index of it); the other pieces of a split axis stay merged into
  one dim, so an axis split only for streaming keeps its logical size and a
  stream loop cuts it into chunks (`chunk_bounds`) instead of reshaping it.

Reduction axes stay in the loop domain but have no dim at run time. Every
conversion between these shapes, on the single- and the multi-device path,
goes through this module.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

from hostir import ir
from hostir.errors import HostIrError


class LayoutError(HostIrError, ValueError):
    """A tensor or a schedule whose shapes cannot be reconciled."""


def logical_axis(d: ir.IterDomain) -> ir.IterDomain:
    """The logical axis a loop axis is a piece of (itself if unsplit)."""
    return d.parent or d


def dims(tv: ir.TensorView, reductions: bool = False) -> list[list[ir.IterDomain]]:
    """The runtime dims of `tv`, each as the loop axes it holds, in order.
    With `reductions`, reduction axes count as dims too (how a reduction's
    output lines up with its input)."""
    found: list[list[ir.IterDomain]] = []
    for d in tv.domain:
        if d.is_reduction and not reductions:
            continue
        last = found[-1] if found else None
        if (
            last is not None
            and d.parent is not None
            and not d.is_device_parallel
            and not last[-1].is_device_parallel
            and last[-1].parent is d.parent
        ):
            last.append(d)
        else:
            found.append([d])
    return found


def position(tv: ir.TensorView, axis: ir.IterDomain) -> int:
    """The runtime dim of `tv` that holds loop axis `axis`."""
    for i, dim in enumerate(dims(tv)):
        if any(d is axis for d in dim):
            return i
    raise LayoutError(f"{axis!r} is not a runtime axis of T{tv.name}")


def reduced_dims(tv: ir.TensorView) -> list[int]:
    """Dims of a reduction's input (lined up with `tv`, its output) that the
    reduction removes."""
    return [i for i, dim in enumerate(dims(tv, reductions=True)) if dim[0].is_reduction]


def _mesh_factor(axis: ir.IterDomain, extent_of: Callable[[ir.Scalar], int]) -> int:
    n = 1
    for leaf in axis.loop_leaves():
        if leaf.is_device_parallel and leaf is not axis:
            n *= int(extent_of(leaf.extent))
    return n


def _dim_size(dim: list[ir.IterDomain], extent_of, local: bool) -> int:
    (first, *_) = dim
    if first.is_device_parallel:
        return 1 if local else int(extent_of(first.extent))
    if first.parent is None:
        return int(extent_of(first.extent))
    # The non-mesh pieces of a split axis: the rows a rank holds of it.
    parent = first.parent
    return int(extent_of(parent.extent)) // _mesh_factor(parent, extent_of)


def local_shape(tv: ir.TensorView, extent_of: Callable[[ir.Scalar], int]) -> list[int]:
    """The runtime shape of this rank's tensor of `tv` (1 on a mesh_x dim)."""
    return [_dim_size(dim, extent_of, local=True) for dim in dims(tv)]


def full_shape(tv: ir.TensorView, extent_of: Callable[[ir.Scalar], int]) -> list[int]:
    """The runtime shape across all ranks (a mesh_x dim whole)."""
    return [_dim_size(dim, extent_of, local=False) for dim in dims(tv)]


def full_from_local(tv: ir.TensorView, local: Sequence[int], extent_of: Callable[[ir.Scalar], int]) -> list[int]:
    """The runtime shape across all ranks from this rank's runtime shape."""
    return [
        int(extent_of(dim[0].extent)) if dim[0].is_device_parallel else size
        for dim, size in zip(dims(tv), local)
    ]


def to_runtime(tv: ir.TensorView, t: torch.Tensor) -> torch.Tensor:
    """View a rank's piece `t` (logical axes, mesh_x axes of size 1 and split
    axes holding this rank's rows) with `tv`'s runtime dims."""
    runtime = dims(tv)
    logical = tv.logical_runtime()
    if len(runtime) == len(logical):
        return t
    shape: list[int] = []
    for axis, size in zip(logical, t.shape):
        pieces = [dim for dim in runtime if logical_axis(dim[0]) is axis]
        shape += [1 if dim[0].is_device_parallel else size for dim in pieces]
    return t.reshape(shape)


def to_logical(tv: ir.TensorView, t: torch.Tensor) -> torch.Tensor:
    """View a runtime-shaped tensor of `tv` with its logical axes."""
    runtime = dims(tv)
    if len(runtime) == tv.logical_ndim:
        return t
    shape: list[int] = []
    for axis in tv.logical_runtime():
        size = 1
        for i, dim in enumerate(runtime):
            if logical_axis(dim[0]) is axis:
                size *= t.shape[i]
        shape.append(size)
    return t.reshape(shape)


class Conversions:
    """`dims`, `to_runtime` and `to_logical` for the tensors of one lowered
    program, each tensor's plan worked out on first use and kept: a lowered
    program's tensors do not change (a fusion changed since is lowered
    again), and a call converts the same tensors every time."""

    __slots__ = ("_dims", "_runtime", "_logical")

    def __init__(self) -> None:
        self._dims: dict = {}
        self._runtime: dict = {}
        self._logical: dict = {}

    def dims(self, tv: ir.TensorView) -> list[list[ir.IterDomain]]:
        found = self._dims.get(tv)
        if found is None:
            found = self._dims[tv] = dims(tv)
        return found

    def to_runtime(self, tv: ir.TensorView, t: torch.Tensor) -> torch.Tensor:
        """`to_runtime(tv, t)`."""
        plan = self._runtime.get(tv, _UNPLANNED)
        if plan is _UNPLANNED:
            plan = self._runtime[tv] = _runtime_plan(tv, self.dims(tv))
        if plan is None:
            return t
        shape: list[int] = []
        for pieces, size in zip(plan, t.shape):
            shape += [1 if device else size for device in pieces]
        return t.reshape(shape)

    def to_logical(self, tv: ir.TensorView, t: torch.Tensor) -> torch.Tensor:
        """`to_logical(tv, t)`."""
        plan = self._logical.get(tv, _UNPLANNED)
        if plan is _UNPLANNED:
            plan = self._logical[tv] = _logical_plan(tv, self.dims(tv))
        if plan is None:
            return t
        shape = []
        for held in plan:
            size = 1
            for i in held:
                size *= t.shape[i]
            shape.append(size)
        return t.reshape(shape)

    def runtime_view(self, tv: ir.TensorView) -> list[int]:
        """`to_runtime(tv, t)` as numbers, for a runner that views tensors
        itself: for each runtime dim, the logical axis of `t` it takes its
        size from, or -1 for a device piece (size 1); empty where the
        runtime dims are the logical axes."""
        plan = _runtime_plan(tv, self.dims(tv))
        if plan is None:
            return []
        return [-1 if device else k for k, pieces in enumerate(plan) for device in pieces]

    def logical_view(self, tv: ir.TensorView) -> list[list[int]]:
        """`to_logical(tv, t)` as numbers: for each logical axis, the
        runtime dims whose sizes multiply to its size; empty where the
        runtime dims are the logical axes."""
        return _logical_plan(tv, self.dims(tv)) or []


_UNPLANNED = object()


def _runtime_plan(tv: ir.TensorView, runtime: list) -> list | None:
    """Per logical axis, whether each of its runtime dims is a device
    piece; None where the runtime dims are the logical axes."""
    logical = tv.logical_runtime()
    if len(runtime) == len(logical):
        return None
    return [[dim[0].is_device_parallel for dim in runtime if logical_axis(dim[0]) is axis] for axis in logical]


def _logical_plan(tv: ir.TensorView, runtime: list) -> list | None:
    """Per logical axis, the runtime dims it is made of; None where the
    runtime dims are the logical axes."""
    if len(runtime) == tv.logical_ndim:
        return None
    return [[i for i, dim in enumerate(runtime) if logical_axis(dim[0]) is axis] for axis in tv.logical_runtime()]


def local_extent(d: ir.IterDomain) -> int | None:
    """This rank's size of logical axis `d` if it is fixed, else None: 1 on
    a mesh_x axis, extent / mesh size on an axis split with a mesh_x piece."""
    if d.is_device_parallel:
        return 1
    if not d.extent.is_constant:
        return None
    return d.extent.value // _mesh_factor(d, lambda e: e.value)


def global_extent(d: ir.IterDomain, local: int) -> int:
    """The whole size of logical axis `d` from this rank's size of it."""
    if d.is_device_parallel:
        return int(d.extent.value) if d.extent.is_constant else local
    n = 1
    for leaf in d.loop_leaves():
        if leaf.is_device_parallel and leaf is not d:
            if not leaf.extent.is_constant:
                raise LayoutError(f"the mesh_x piece {leaf!r} needs a constant extent")
            n *= leaf.extent.value
    return local * n


def device_types(d: ir.IterDomain) -> frozenset:
    """The mesh dimensions a logical axis is sharded on (through its pieces)."""
    return frozenset(x.parallel_type for x in d.loop_leaves() if x.is_device_parallel)


def shard_count(mesh: ir.DeviceMesh | None, d: ir.IterDomain) -> int:
    """How many pieces logical axis `d` is cut into across `mesh`: the
    product of the mesh's sizes along its device-parallel pieces (1
    without a mesh or a sharded piece)."""
    n = 1
    if mesh is not None:
        for leaf in d.loop_leaves():
            if leaf.is_device_parallel:
                n *= mesh.size_along(leaf.parallel_type)
    return n


def whole_size(tv: ir.TensorView, d: ir.IterDomain, size: int) -> int:
    """The size of logical axis `d` across all ranks, from this rank's."""
    for leaf in d.loop_leaves():
        if leaf.is_device_parallel:
            # A sharded piece's extent is the mesh's size along it (checked
            # when lowering); a symbolic one takes it from the mesh.
            if leaf.extent.is_constant:
                size *= leaf.extent.value
            elif tv.mesh is not None:
                size *= tv.mesh.size_along(leaf.parallel_type)
    return size


def local_size(tv: ir.TensorView, d: ir.IterDomain, sizes) -> int | None:
    """This rank's size of `tv`'s logical axis `d`, from the whole sizes
    of the symbolic extents (None where unknown)."""
    fixed = local_extent(d)
    if fixed is not None:
        return fixed
    size = whole_extent(d.extent, sizes)
    if size is None:
        return None
    return size // shard_count(tv.mesh, d)


def whole_extent(extent: ir.Scalar, sizes) -> int | None:
    """An extent's whole size: a constant, an input's symbolic extent (from
    `sizes`), or an expression of them (a reshape's inferred size); None
    where unknown."""
    if isinstance(extent, ir.ScalarExpr):
        lhs, rhs = whole_extent(extent.lhs, sizes), whole_extent(extent.rhs, sizes)
        if lhs is None or rhs is None or (extent.op in ("/", "%", "ceilDiv") and rhs == 0):
            return None
        return int(ir.ScalarExpr.OPS[extent.op](lhs, rhs))
    if extent.is_constant:
        return int(extent.value)
    return sizes.get(extent)


def select_kind(tv: ir.TensorView, axis: ir.IterDomain) -> str:
    """How a loop over `axis` slices `tv`: "select" when the axis is a dim
    of its own (the dim goes away), "chunk" when it is the outer piece of a
    split axis (the dim keeps, cut into `axis.extent` chunks)."""
    dim = dims(tv)[position(tv, axis)]
    if len(dim) == 1:
        return "select"
    if dim[0] is not axis:
        raise LayoutError(
            f"{axis!r} of T{tv.name} is an inner piece of a split axis; a stream loop can only "
            f"walk the outer piece (use outer_split)"
        )
    return "chunk"


def chunk_bounds(size: int, chunks: int, index: int) -> tuple[int, int]:
    """(start, length) of chunk `index` when `size` rows are cut into
    `chunks` chunks of ceilDiv(size, chunks) rows: the last chunks are
    shorter, or empty when there are fewer rows than chunks."""
    if chunks < 1:
        raise LayoutError(f"cannot cut an axis into {chunks} chunks")
    step = -(-size // chunks)
    start = min(index * step, size)
    return start, max(0, min(step, size - start))


def leaf_sizes(leaves: Sequence[ir.IterDomain], size: int, mesh, whole=None) -> list[int]:
    """The sizes of the pieces `leaves` of one axis held in a dim of `size`:
    a device-parallel piece has the mesh's size along its mesh dimension
    where that dimension is in `whole` (every one when `whole` is None), 1
    otherwise; a constant piece its extent; the symbolic piece the rest."""
    sizes = []
    for x in leaves:
        if x.is_device_parallel:
            sizes.append(mesh.size_along(x.parallel_type) if whole is None or x.parallel_type in whole else 1)
        elif x.extent.is_constant:
            sizes.append(x.extent.value)
        else:
            sizes.append(None)
    known = 1
    for v in sizes:
        known *= v if v is not None else 1
    return [size // known if v is None else v for v in sizes]


def is_chunked(tv: ir.TensorView) -> bool:
    """Whether a split of `tv` shows at run time: a runtime dim merges the
    pieces of a split axis (a loop walks it in chunks), or an extent is a
    ceilDiv. (`tv.is_split` asks only whether any axis is split.)"""
    if any(len(dim) > 1 for dim in dims(tv)):
        return True
    return any(isinstance(d.extent, ir.ScalarExpr) and d.extent.op == "ceilDiv" for d in tv.domain)


def sharded_axis(tv: ir.TensorView, parallel_type=None) -> tuple[int, int] | None:
    """(logical axis, position of the piece among that axis's loop pieces)
    of the axis of `tv` sharded along `parallel_type` (mesh_x by default),
    or None if no axis is."""
    parallel_type = ir.ParallelType.mesh_x if parallel_type is None else parallel_type
    for index, d in enumerate(tv.logical_runtime()):
        for at, leaf in enumerate(d.loop_leaves()):
            if leaf.parallel_type is parallel_type:
                return index, at
    return None


# ---------------------------------------------------------------- counts


def numel(shape: Iterable[int]) -> int:
    """The number of elements of a tensor of `shape`."""
    n = 1
    for size in shape:
        n *= int(size)
    return n


def reshape_numel(shape: Sequence[int], numel_in: int) -> int:
    """The number of elements a reshape to `shape` holds for an input of
    `numel_in` elements: a -1 takes the rest where the known sizes divide
    it."""
    known = numel(size for size in shape if size != -1)
    if -1 in shape and known and numel_in % known == 0:
        return numel_in
    return known


def product(extents: Sequence[ir.Scalar]) -> ir.Scalar:
    """`( ( a * b ) * c )`: the left-nested product nvFuser prints for sizes."""
    if not extents:
        return ir.Scalar.constant(1)
    acc = extents[0]
    for e in extents[1:]:
        acc = ir.ScalarExpr("*", acc, e)
    return acc


def local_loop_extents(tv: ir.TensorView) -> list[ir.Scalar]:
    """The extents of `tv`'s loop axes (reductions excluded) on one rank:
    a mesh_x axis is 1."""
    one = ir.Scalar.constant(1)
    return [one if d.is_device_parallel else d.extent for d in tv.loop_axes()]


def allocated_extents(tv: ir.TensorView) -> list[ir.Scalar]:
    """The extents whose product is the element count an allocation of
    `tv` prints: a split axis whose pieces are all runtime dims counts as
    its whole extent."""
    extents: list[ir.Scalar] = []
    for dim in dims(tv):
        parent = dim[0].parent
        whole = parent is not None and len(dim) == len(parent.loop_leaves())
        extents += [parent.extent] if whole else [d.extent for d in dim]
    return extents


def constant_bytes(tv: ir.TensorView) -> int | None:
    """The bytes of `tv`'s buffer on one rank when every extent is a
    constant, else None."""
    n = tv.dtype.itemsize
    for d in tv.loop_axes():
        if not d.extent.is_constant:
            return None
        n *= 1 if d.is_device_parallel else d.extent.value
    return n


def local_reduce_dims(e: ir.ReductionOp, parallel_type: ir.ParallelType) -> tuple[int, ...]:
    """Runtime dims of a reduction's input that are pieces of a reduced axis
    but not its piece sharded along `parallel_type`: each rank sums its rows
    of them before the collective sums across ranks."""
    found = []
    for o, i in e.id_pairs():
        if not o.is_reduction:
            continue
        for leaf in i.loop_leaves():
            if leaf.parallel_type is not parallel_type and leaf in e.input.domain and not leaf.is_reduction:
                found.append(position(e.input, leaf))
    return tuple(sorted(found))
