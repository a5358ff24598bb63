"""Builders of the fusion ops that change a tensor's shape: `permute`,
`reshape`, `slice`, `select` and `cat`.

Each checks its arguments against the operand's logical axes when it is
defined (so a bad axis or size is an error naming the op, before anything
runs) and makes the output's axes: permuted clones, new extents, or the
operand's axes less the selected one. `permute`, `reshape` and `slice`
return views of their operands where torch would (a permute and a slice
always, a reshape where the strides allow), and the race checker and the
dry run's memory plan see them as the operand's buffer; `select` and `cat`
copy.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hostir import ir, layout
from hostir.errors import DefinitionError, DefinitionIndexError, DefinitionTypeError


def _operand(x, what: str) -> ir.TensorView:
    if not isinstance(x, ir.TensorView):
        raise DefinitionTypeError(f"{what} takes a TensorView, got {type(x).__name__}")
    return x


def _axis(x: ir.TensorView, dim, what: str) -> int:
    n = x.logical_ndim
    if isinstance(dim, bool) or not isinstance(dim, int) or not -n <= dim < n:
        raise DefinitionIndexError(f"{what}: axis {dim!r} is out of range for T{x.name}, which has {n} axes")
    return dim % n


def _emit(e: ir.Expr) -> ir.TensorView:
    e.out.owner.add_expr(e)
    return e.out


def permute(x: ir.TensorView, dims: Sequence[int]) -> ir.TensorView:
    x = _operand(x, "permute")
    dims = tuple(_axis(x, d, "permute") for d in dims)
    if sorted(dims) != list(range(x.logical_ndim)):
        raise DefinitionError(f"permute: {list(dims)} is not a permutation of the {x.logical_ndim} axes of T{x.name}")
    fusion = x.owner
    axes = x.logical_runtime()
    out = ir.TensorView(fusion, [axes[d].clone(fusion) for d in dims], x.dtype)
    return _emit(ir.PermuteOp(out, x, dims))


def reshape(x: ir.TensorView, shape: Sequence[int]) -> ir.TensorView:
    x = _operand(x, "reshape")
    if isinstance(shape, int) or not isinstance(shape, Sequence):
        raise DefinitionTypeError(f"reshape: shape must be a list of ints, got {shape!r}")
    shape = tuple(shape)
    for i, size in enumerate(shape):
        if isinstance(size, bool) or not isinstance(size, int) or size < -1:
            raise DefinitionError(f"reshape: shape[{i}] = {size!r}; use a size >= 0, or -1 for one inferred size")
    if shape.count(-1) > 1:
        raise DefinitionError(f"reshape: shape {list(shape)} has more than one -1")
    fusion = x.owner
    extents = [d.extent for d in x.logical_runtime()]
    known = layout.numel(size for size in shape if size != -1)
    if all(e.is_constant for e in extents):
        numel = layout.numel(e.value for e in extents)
        inferred = numel // known if known else 0
        if (known and numel % known) or (-1 not in shape and known != numel) or (-1 in shape and known == 0):
            raise DefinitionError(f"reshape: T{x.name} has {numel} elements, which shape {list(shape)} cannot hold")
        rest = ir.Scalar.constant(inferred)
    else:
        rest = ir.ScalarExpr("/", layout.product(extents), ir.Scalar.constant(known))
    domain = []
    for size in shape:
        extent = rest if size == -1 else ir.Scalar.constant(size)
        domain.append(ir.IterDomain(fusion, extent))
    out = ir.TensorView(fusion, domain, x.dtype)
    return _emit(ir.ReshapeOp(out, x, shape))


def slice_(x: ir.TensorView, starts: Sequence[int], stops: Sequence, steps: Sequence[int] | None = None) -> ir.TensorView:
    x = _operand(x, "slice")
    n = x.logical_ndim
    steps = [1] * n if steps is None else list(steps)
    starts, stops = list(starts), list(stops)
    if not len(starts) == len(stops) == len(steps) == n:
        raise DefinitionError(
            f"slice: give one start, stop and step per axis of T{x.name} ({n}), got "
            f"{len(starts)}, {len(stops)} and {len(steps)}"
        )
    fusion = x.owner
    ranges, domain = [], []
    for k, (d, start, stop, step) in enumerate(zip(x.logical_runtime(), starts, stops, steps)):
        for name, v in (("start", start), ("step", step)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise DefinitionTypeError(f"slice: axis {k}: {name} must be an int, got {v!r}")
        if stop is not None and (isinstance(stop, bool) or not isinstance(stop, int)):
            raise DefinitionTypeError(f"slice: axis {k}: stop must be an int or None, got {stop!r}")
        if start < 0 or step < 1 or (stop is not None and stop < start):
            raise DefinitionError(
                f"slice: axis {k}: need 0 <= start <= stop and step >= 1, got start={start}, stop={stop}, step={step}"
            )
        if d.extent.is_constant:
            size = d.extent.value
            if start > size or (stop is not None and stop > size):
                raise DefinitionError(f"slice: axis {k} of T{x.name} has size {size}; [{start}:{stop}] is out of range")
        rng = (start, stop, step)
        if rng == (0, None, 1) or (d.extent.is_constant and rng == (0, d.extent.value, 1)):
            rng = (0, None, 1)
            domain.append(d.clone(fusion))
        elif stop is not None or d.extent.is_constant:
            stop = d.extent.value if stop is None else stop
            domain.append(ir.IterDomain(fusion, ir.Scalar.constant(-(-(stop - start) // step))))
        else:
            # ceilDiv(extent - start, step) rows, from the run's extent.
            extent = d.extent - start if start else d.extent
            if step > 1:
                extent = ir.ScalarExpr("ceilDiv", extent, ir.Scalar.constant(step))
            domain.append(ir.IterDomain(fusion, extent))
        ranges.append(rng)
    out = ir.TensorView(fusion, domain, x.dtype)
    return _emit(ir.SliceOp(out, x, tuple(ranges)))


def cat(tensors: Sequence[ir.TensorView], dim: int) -> ir.TensorView:
    tensors = list(tensors) if isinstance(tensors, (list, tuple)) else tensors
    if not isinstance(tensors, list) or not tensors:
        raise DefinitionTypeError(f"cat: give a non-empty list of TensorViews, got {tensors!r}")
    for t in tensors:
        _operand(t, "cat")
    first = tensors[0]
    dim = _axis(first, dim, "cat")
    for t in tensors[1:]:
        if t.logical_ndim != first.logical_ndim or t.dtype != first.dtype:
            raise DefinitionError(
                f"cat: T{t.name} ({t.logical_ndim} axes, {t.dtype}) does not match T{first.name} "
                f"({first.logical_ndim} axes, {first.dtype})"
            )
        for k, (a, b) in enumerate(zip(first.logical_runtime(), t.logical_runtime())):
            if k != dim and a.extent.is_constant and b.extent.is_constant and a.extent.value != b.extent.value:
                raise DefinitionError(
                    f"cat: axis {k} of T{t.name} has size {b.extent.value}, of T{first.name} {a.extent.value}; "
                    f"only axis {dim} may differ"
                )
    if len(tensors) == 1:
        fusion = first.owner
        copy = ir.TensorView(fusion, [d.clone(fusion) for d in first.logical_runtime()], first.dtype)
        return _emit(ir.Set(copy, first))
    out = first
    for t in tensors[1:]:
        out = _cat_two(out, t, dim)
    return out


def _cat_two(a: ir.TensorView, b: ir.TensorView, dim: int) -> ir.TensorView:
    fusion = a.owner
    domain = []
    for k, (x, y) in enumerate(zip(a.logical_runtime(), b.logical_runtime())):
        if k != dim:
            domain.append(x.clone(fusion))
        elif x.extent.is_constant and y.extent.is_constant:
            domain.append(ir.IterDomain(fusion, ir.Scalar.constant(x.extent.value + y.extent.value)))
        else:
            domain.append(ir.IterDomain(fusion, ir.ScalarExpr("+", x.extent, y.extent)))
    return _emit(ir.CatOp(ir.TensorView(fusion, domain, a.dtype), a, b, dim))


def select(x: ir.TensorView, dim: int, index) -> ir.TensorView:
    x = _operand(x, "select")
    dim = _axis(x, dim, "select")
    if isinstance(index, ir.InputScalar):
        if index.dtype is not torch.int64:
            raise DefinitionTypeError(f"select: the index must be an integer scalar, got {index.dtype}")
    elif isinstance(index, bool) or not isinstance(index, int):
        raise DefinitionTypeError(f"select: the index must be an int or an integer scalar input, got {index!r}")
    else:
        d = x.logical_runtime()[dim]
        if d.extent.is_constant and not -d.extent.value <= index < d.extent.value:
            raise DefinitionIndexError(f"select: index {index} is out of range for axis {dim} of T{x.name} (size {d.extent.value})")
        index = ir.Scalar.constant(index)
    fusion = x.owner
    axes = [d.clone(fusion) for k, d in enumerate(x.logical_runtime()) if k != dim]
    out = ir.TensorView(fusion, axes, x.dtype)
    return _emit(ir.SelectOp(out, x, dim, index))
