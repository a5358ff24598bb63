"""Builders of the index ops of a mixture-of-experts layer: `topk`,
`route`, `take` and `put_add`, and of the grouped GEMM (`grouped_mm`) with
its weights' gradient (`grouped_outer`).

A layer routes each token to its `k` best experts (`topk` of the router's
scores), places each (token, choice) pair in a slot of a buffer of
`capacity` rows per expert (`route`: the stable permutation of the pairs
by expert and its inverse), gathers the tokens into those rows (`take` of
the tokens at each slot's source) and, after the experts, gathers each
pair's result back (`take` at each pair's slot). `put_add` is `take`'s
transpose (rows added at their index), the backward of both gathers. A
negative index names no row: `take` gives zeros, `put_add` drops it, so
empty slots and pairs past an expert's capacity cost nothing wrong.

Each builder checks its operands when the op is defined (a wrong dtype,
axis count or size is an error naming the op) and appends the op.
"""

from __future__ import annotations

import torch

from hostir import ir
from hostir.errors import DefinitionError, DefinitionTypeError


def _tensor(x, what: str) -> ir.TensorView:
    if not isinstance(x, ir.TensorView):
        raise DefinitionTypeError(f"{what} takes a TensorView, got {type(x).__name__}")
    return x


def _count(v, what: str, low: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise DefinitionError(f"{what} must be an int >= {low}, got {v!r}")
    return v


def _index(index, what: str) -> ir.TensorView:
    index = _tensor(index, what)
    if index.dtype is not torch.int64:
        raise DefinitionTypeError(f"{what}: the index T{index.name} must be int64, got {index.dtype}")
    return index


def _same_size(a: ir.IterDomain, b: ir.IterDomain, what: str) -> None:
    if a.extent.is_constant and b.extent.is_constant and a.extent.value != b.extent.value:
        raise DefinitionError(f"{what}: sizes {a.extent.value} and {b.extent.value} differ")


def _emit(e: ir.Expr) -> ir.TensorView:
    e.out.owner.add_expr(e)
    return e.out


def _new(fusion, extents_or_axes, dtype) -> ir.TensorView:
    axes = [
        d.clone(fusion) if isinstance(d, ir.IterDomain) else ir.IterDomain(fusion, ir.Scalar.constant(d))
        for d in extents_or_axes
    ]
    return ir.TensorView(fusion, axes, dtype)


def topk(x: ir.TensorView, k: int) -> ir.TensorView:
    """The positions (int64) of the `k` largest elements of `x` along its
    last axis, largest first."""
    x = _tensor(x, "topk")
    k = _count(k, "topk: k")
    axes = x.logical_runtime()
    if not axes:
        raise DefinitionError(f"topk: T{x.name} has no axis to choose along")
    last = axes[-1]
    if last.extent.is_constant and k > last.extent.value:
        raise DefinitionError(f"topk: k = {k} is more than the {last.extent.value} elements of T{x.name}'s last axis")
    out = _new(x.owner, axes[:-1] + [k], torch.int64)
    return _emit(ir.TopKOp(out, x, k))


def route(
    indices: ir.TensorView, experts: int, capacity: int, what: str, groups: int = 1, packed: bool = False
) -> ir.TensorView:
    """Each (token, choice) pair's slot (`what="slot"`), each slot's token
    (`what="source"`), or the pairs each expert keeps (`what="counts"`), in
    a buffer of `capacity` rows per expert (per group when `packed`); see
    `ir.RouteOp`."""
    indices = _index(indices, "route")
    experts = _count(experts, "route: experts")
    capacity = _count(capacity, "route: capacity")
    groups = _count(groups, "route: groups")
    if what not in ("slot", "source", "counts"):
        raise DefinitionError(f"route: what must be 'slot', 'source' or 'counts', got {what!r}")
    if not isinstance(packed, bool):
        raise DefinitionTypeError(f"route: packed must be a bool, got {packed!r}")
    if experts % groups:
        raise DefinitionError(f"route: {experts} experts do not divide into {groups} groups")
    axes = indices.logical_runtime()
    if len(axes) < 2:
        raise DefinitionError(f"route: the choices T{indices.name} must be [..., tokens, k], got {len(axes)} axes")
    if what == "slot":
        out = _new(indices.owner, axes, torch.int64)
    elif what == "counts":
        out = _new(indices.owner, axes[:-2] + [groups, experts // groups], torch.int64)
    elif packed:
        out = _new(indices.owner, axes[:-2] + [groups, capacity], torch.int64)
    else:
        out = _new(indices.owner, axes[:-2] + [groups, experts // groups, capacity], torch.int64)
    return _emit(ir.RouteOp(out, indices, experts, capacity, what, groups, packed))


def grouped_mm(x: ir.TensorView, weight: ir.TensorView, counts: ir.TensorView) -> ir.TensorView:
    """Each row of `x` [*batch, R, K] times its group's `weight` [*wbatch,
    G, N, K] transposed, the rows grouped by `counts` [*batch, G]; see
    `ir.GroupedMmOp`."""
    x, weight = _tensor(x, "grouped_mm"), _tensor(weight, "grouped_mm")
    counts = _index(counts, "grouped_mm: counts")
    xa, wa, ca = x.logical_runtime(), weight.logical_runtime(), counts.logical_runtime()
    if x.dtype != weight.dtype:
        raise DefinitionTypeError(f"grouped_mm: T{x.name} is {x.dtype} but the weight T{weight.name} is {weight.dtype}")
    if len(xa) < 2 or len(wa) < 3:
        raise DefinitionError(
            f"grouped_mm: the rows T{x.name} must be [..., R, K] and the weight T{weight.name} [..., G, N, K], "
            f"got {len(xa)} and {len(wa)} axes"
        )
    _check_groups(xa, wa[:-3], wa[-3], ca, "grouped_mm")
    _same_size(xa[-1], wa[-1], "grouped_mm: the rows' K and the weight's K")
    out = _new(x.owner, xa[:-1] + [wa[-2]], x.dtype)
    return _emit(ir.GroupedMmOp(out, x, weight, counts))


def grouped_outer(x: ir.TensorView, other: ir.TensorView, counts: ir.TensorView, wbatch: int = 0) -> ir.TensorView:
    """Per group of rows (`counts` [*batch, G]), `x_g^T other_g` for `x`
    [*batch, R, N] and `other` [*batch, R, K], summed over all but the
    last `wbatch` batch axes: [*wbatch, G, N, K]; see `ir.GroupedOuterOp`."""
    x, other = _tensor(x, "grouped_outer"), _tensor(other, "grouped_outer")
    counts = _index(counts, "grouped_outer: counts")
    xa, oa, ca = x.logical_runtime(), other.logical_runtime(), counts.logical_runtime()
    if x.dtype != other.dtype:
        raise DefinitionTypeError(f"grouped_outer: T{x.name} is {x.dtype} but T{other.name} is {other.dtype}")
    if len(xa) < 2 or len(xa) != len(oa):
        raise DefinitionError(
            f"grouped_outer: T{x.name} and T{other.name} must both be [..., R, features], got {len(xa)} and "
            f"{len(oa)} axes"
        )
    _count(wbatch, "grouped_outer: wbatch", 0)
    if wbatch > len(xa) - 2:
        raise DefinitionError(f"grouped_outer: {wbatch} weight batch axes, but the rows have {len(xa) - 2}")
    for k, (a, b) in enumerate(zip(xa[:-1], oa[:-1])):
        _same_size(a, b, f"grouped_outer: axis {k} of the two row tensors")
    if len(ca) != len(xa) - 1:
        raise DefinitionError(f"grouped_outer: the counts T{counts.name} must be [*batch, G], got {len(ca)} axes")
    for k, (a, b) in enumerate(zip(ca[:-1], xa[:-2])):
        _same_size(a, b, f"grouped_outer: batch axis {k} of the counts and the rows")
    wb = xa[len(xa) - 2 - wbatch : len(xa) - 2]
    out = _new(x.owner, wb + [ca[-1], xa[-1], oa[-1]], x.dtype)
    return _emit(ir.GroupedOuterOp(out, x, other, counts))


def _check_groups(xa: list, wbatch: list, groups: ir.IterDomain, ca: list, what: str) -> None:
    batch = xa[:-2]
    if len(wbatch) > len(batch):
        raise DefinitionError(f"{what}: the weight has {len(wbatch)} batch axes, more than the rows' {len(batch)}")
    for k, (a, b) in enumerate(zip(reversed(wbatch), reversed(batch))):
        _same_size(a, b, f"{what}: trailing batch axis {k} of the weight and the rows")
    if len(ca) != len(batch) + 1:
        raise DefinitionError(f"{what}: the counts must be [*batch, G] ({len(batch) + 1} axes), got {len(ca)}")
    for k, (a, b) in enumerate(zip(ca[:-1], batch)):
        _same_size(a, b, f"{what}: batch axis {k} of the counts and the rows")
    _same_size(ca[-1], groups, f"{what}: the counts' groups and the weight's")


def _split(x: ir.TensorView, batch: int, features: int, what: str) -> tuple[list, list, list]:
    axes = x.logical_runtime()
    _count(batch, f"{what}: batch", 0)
    _count(features, f"{what}: features", 0)
    if batch + features >= len(axes):
        raise DefinitionError(
            f"{what}: T{x.name} has {len(axes)} axes, which leaves no row axis between {batch} batch "
            f"and {features} feature axes"
        )
    return axes[:batch], axes[batch : len(axes) - features], axes[len(axes) - features :]


def _check_batch(batch_axes: list, index: ir.TensorView, what: str) -> list:
    ia = index.logical_runtime()
    if len(ia) <= len(batch_axes):
        raise DefinitionError(
            f"{what}: the index T{index.name} needs its {len(batch_axes)} batch axes and at least one more, "
            f"got {len(ia)} axes"
        )
    for k, (a, b) in enumerate(zip(batch_axes, ia)):
        _same_size(a, b, f"{what}: batch axis {k} of the rows and the index")
    return ia


def take(
    x: ir.TensorView, index: ir.TensorView, batch: int = 0, features: int = 1, inverse: ir.TensorView | None = None
) -> ir.TensorView:
    """The rows of `x` at `index` (zeros where it is negative); `inverse`,
    each row's picks, makes its transpose a gather (see `ir.TakeOp`)."""
    x = _tensor(x, "take")
    index = _index(index, "take")
    b, rows, f = _split(x, batch, features, "take")
    ia = _check_batch(b, index, "take")
    if inverse is not None:
        inverse = _index(inverse, "take")
        va = inverse.logical_runtime()
        if len(va) != len(b) + len(rows) + 1:
            raise DefinitionError(
                f"take: the inverse T{inverse.name} must be [*batch, *rows, picks per row] "
                f"({len(b) + len(rows) + 1} axes), got {len(va)}"
            )
        for k, (a, r) in enumerate(zip(va, b + rows)):
            _same_size(a, r, f"take: axis {k} of the inverse and of the rows")
    out = _new(x.owner, ia + f, x.dtype)
    return _emit(ir.TakeOp(out, x, index, batch, features, inverse))


def put_add(
    x: ir.TensorView,
    index: ir.TensorView,
    like: ir.TensorView,
    batch: int = 0,
    features: int = 1,
    distinct: bool = False,
):
    """Zeros shaped as `like` with the rows of `x` added at `index`
    (negative indices dropped); see `ir.PutAddOp`. `distinct` is for the
    derivation alone, which knows when an index names each row once."""
    x, like = _tensor(x, "put_add"), _tensor(like, "put_add")
    index = _index(index, "put_add")
    if x.dtype != like.dtype:
        raise DefinitionTypeError(f"put_add: T{x.name} is {x.dtype} but T{like.name} is {like.dtype}")
    b, _, f = _split(like, batch, features, "put_add")
    ia = _check_batch(b, index, "put_add")
    xa = x.logical_runtime()
    if len(xa) != len(ia) + len(f):
        raise DefinitionError(
            f"put_add: the rows T{x.name} must be [*index axes, *features] ({len(ia) + len(f)} axes), got {len(xa)}"
        )
    for k, (a, i) in enumerate(zip(xa, ia)):
        _same_size(a, i, f"put_add: axis {k} of the rows and the index")
    for k, (a, g) in enumerate(zip(xa[len(ia) :], f)):
        _same_size(a, g, f"put_add: feature axis {k}")
    out = _new(like.owner, like.logical_runtime(), like.dtype)
    return _emit(ir.PutAddOp(out, x, index, like, batch, features, distinct))
