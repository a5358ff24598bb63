"""Builders of `broadcast_in_dim`, `broadcast` and `expand`: new axes and
grown size-1 axes, as nvFuser's ops of those names define them.

`broadcast_in_dim(x, shape, dims)` puts input axis i at output axis
`dims[i]` (increasing); every other output axis is new, of size
`shape[j]` (a size-1 axis is a broadcast axis). A size-1 input axis may
grow to `shape[dims[i]]`; any other input axis keeps its size (`-1`, or
that size). `broadcast(x, is_broadcast_dim)` is `broadcast_in_dim` that
only adds size-1 axes: one flag per output axis, True for a new one.
`expand(x, shape)` is `broadcast_in_dim` with the axes in place. Sizes are
checked when the op is defined where they are known, and when the program
runs where they are symbolic. The output is a copy: it
may be sharded (its kept axes as the input's) and stream-parallel.
"""

from __future__ import annotations

from typing import Sequence

from hostir import ir
from hostir.errors import DefinitionError, DefinitionIndexError, DefinitionTypeError


def broadcast_in_dim(x: ir.TensorView, shape: Sequence[int], dims: Sequence[int]) -> ir.TensorView:
    if not isinstance(x, ir.TensorView):
        raise DefinitionTypeError(f"broadcast_in_dim takes a TensorView, got {type(x).__name__}")
    shape, dims = _ints(shape, "shape"), _ints(dims, "broadcast_dims")
    axes = x.logical_runtime()
    if len(dims) != len(axes):
        raise DefinitionError(
            f"broadcast_in_dim: broadcast_dims {list(dims)} must name one output axis for each of the "
            f"{len(axes)} axes of T{x.name}"
        )
    for d in dims:
        if not 0 <= d < len(shape):
            raise DefinitionIndexError(f"broadcast_in_dim: output axis {d} is out of range for shape {list(shape)}")
    if list(dims) != sorted(set(dims)):
        raise DefinitionError(f"broadcast_in_dim: broadcast_dims {list(dims)} must be increasing and distinct")
    fusion = x.owner
    source = dict(zip(dims, axes))
    domain = []
    for j, size in enumerate(shape):
        if size < -1:
            raise DefinitionError(f"broadcast_in_dim: shape[{j}] = {size}; use a size >= 0, or -1 to keep an axis")
        d = source.get(j)
        if d is None:
            if size == -1:
                raise DefinitionError(f"broadcast_in_dim: shape[{j}] = -1 but output axis {j} is new; give its size")
            domain.append(_new_axis(fusion, size))
        elif size == -1:
            domain.append(d.clone(fusion))
        elif d.is_broadcast:
            domain.append(d.clone(fusion) if size == 1 else _new_axis(fusion, size))
        elif d.extent.is_constant:
            if d.extent.value != size:
                raise DefinitionError(
                    f"broadcast_in_dim: axis {dims.index(j)} of T{x.name} has size {d.extent.value}, not "
                    f"{size}; only a size-1 axis grows"
                )
            domain.append(d.clone(fusion))
        else:
            # A symbolic size given here: the program checks it at a call.
            domain.append(ir.IterDomain(fusion, ir.Scalar.constant(size), d.iter_type))
    out = ir.TensorView(fusion, domain, x.dtype)
    fusion.add_expr(ir.BroadcastInDimOp(out, x, tuple(dims)))
    return out


def broadcast(x: ir.TensorView, is_broadcast_dim: Sequence[bool]) -> ir.TensorView:
    """nvFuser's `broadcast(x, is_broadcast_dim)`: one flag per output axis,
    True where a new size-1 (broadcast) axis goes, False where the next axis
    of `x` goes, as `x.unsqueeze` at each True position. It is
    `broadcast_in_dim(x, shape, dims)` with `shape` 1 at the new axes and -1
    (the input's size, symbolic or not) at the kept ones, and `dims` the
    positions of the False flags."""
    if not isinstance(x, ir.TensorView):
        raise DefinitionTypeError(f"broadcast takes a TensorView, got {type(x).__name__}")
    if isinstance(is_broadcast_dim, (str, bytes)) or not isinstance(is_broadcast_dim, Sequence):
        raise DefinitionTypeError(f"broadcast: is_broadcast_dim must be a list of bools, got {is_broadcast_dim!r}")
    flags = tuple(is_broadcast_dim)
    if not all(isinstance(f, bool) for f in flags):
        raise DefinitionTypeError(f"broadcast: is_broadcast_dim must be a list of bools, got {list(flags)!r}")
    kept = [j for j, f in enumerate(flags) if not f]
    ndim = x.logical_ndim
    if len(kept) != ndim:
        raise DefinitionError(
            f"broadcast: is_broadcast_dim {list(flags)} (length {len(flags)}) must have one False entry per "
            f"axis of T{x.name}: expected {ndim} False entries, got {len(kept)}"
        )
    shape = [1 if f else -1 for f in flags]
    return broadcast_in_dim(x, shape, kept)


def expand(x: ir.TensorView, shape: Sequence[int]) -> ir.TensorView:
    if not isinstance(x, ir.TensorView):
        raise DefinitionTypeError(f"expand takes a TensorView, got {type(x).__name__}")
    shape = _ints(shape, "shape")
    if len(shape) != x.logical_ndim:
        raise DefinitionError(f"expand: shape {list(shape)} must have the {x.logical_ndim} axes of T{x.name}")
    return broadcast_in_dim(x, shape, range(len(shape)))


def _ints(values, what: str) -> tuple[int, ...]:
    if isinstance(values, int) or not isinstance(values, (Sequence, range)):
        raise DefinitionTypeError(f"{what} must be a list of ints, got {values!r}")
    values = tuple(values)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise DefinitionTypeError(f"{what} must be a list of ints, got {list(values)!r}")
    return values


def _new_axis(fusion, size: int) -> ir.IterDomain:
    if size == 1:
        return ir.IterDomain(fusion, ir.Scalar.constant(1), ir.IterType.broadcast)
    return ir.IterDomain(fusion, ir.Scalar.constant(size))
