"""Builders of the fusion ops a user writes: `set_`, the elementwise
`unary` and `binary`, `reduction`, `matmul` and `linear`.

Each checks its operands when the op is defined (so a bad axis, size or
dtype is an error naming the op, before anything runs), infers the output's
axes and dtype, and appends the op to the operands' fusion. The ops
themselves are data in the IR (`exprs.py`); the builders of the shape
ops are in `shape_ops.py` and `broadcast_ops.py`.
"""

from __future__ import annotations

import torch

from hostir.errors import DefinitionError, DefinitionIndexError, DefinitionTypeError
from hostir.ir import (
    SUPPORTED_DTYPES,
    BinaryOp,
    Expr,
    Fusion,
    InputScalar,
    IterDomain,
    IterType,
    LinearOp,
    MatmulOp,
    MemoryType,
    ReductionOp,
    Scalar,
    Set,
    TensorView,
    UnaryOp,
    as_kind,
)
from hostir.kinds import BinaryKind, ReductionKind, UnaryKind


def _owner(*operands) -> Fusion:
    owners = {id(v.owner): v.owner for v in operands if isinstance(v, TensorView)}
    if not owners:
        raise DefinitionTypeError("an op needs at least one TensorView operand")
    if len(owners) > 1:
        raise DefinitionError("operands belong to different fusions")
    (fusion,) = owners.values()
    return fusion


def _emit(fusion: Fusion, e: Expr) -> TensorView:
    fusion.add_expr(e)
    return e.out


def set_(
    x: TensorView,
    memory_type: MemoryType = MemoryType.local,
    rows: TensorView | None = None,
    rows_in: TensorView | None = None,
) -> TensorView:
    """A copy of `x`; in `MemoryType.host` it is a device-to-host transfer.
    `rows`, `rows_in`: the real rows of each piece sent and received, when
    it is an AllToAll sized at run time (see `ir.Set`)."""
    fusion = _owner(x)
    if (rows is None) != (rows_in is None):
        raise DefinitionError("a set sized at run time takes both rows and rows_in")
    for what, t in (("rows", rows), ("rows_in", rows_in)):
        if t is None:
            continue
        if not isinstance(t, TensorView) or t.dtype is not torch.int64:
            raise DefinitionTypeError(f"set: {what} must be an int64 TensorView, got {t!r}")
        if memory_type is not MemoryType.local:
            raise DefinitionError("set: rows size an exchange between ranks, not a transfer to another memory")
    out = TensorView(fusion, [d.clone(fusion) for d in x.logical_runtime()], x.dtype, memory_type)
    return _emit(fusion, Set(out, x, rows, rows_in))


def _as_operand(v) -> TensorView | Scalar:
    if isinstance(v, (TensorView, InputScalar)):
        return v
    if isinstance(v, (bool, int, float)):
        return Scalar.constant(v)
    raise DefinitionTypeError(f"operand must be a TensorView or a Python number, got {type(v).__name__}")


def _probe(v):
    """A value with v's dtype for asking torch about type promotion."""
    if isinstance(v, TensorView):
        return torch.empty(0, dtype=v.dtype)
    if isinstance(v, InputScalar):
        return torch.zeros((), dtype=v.dtype)
    return v.value


def binary(kind: str, lhs, rhs) -> TensorView:
    kind = as_kind(BinaryKind, kind, "binary op")
    lhs, rhs = _as_operand(lhs), _as_operand(rhs)
    fusion = _owner(lhs, rhs)
    tensors = [v for v in (lhs, rhs) if isinstance(v, TensorView)]
    ranks = {t.logical_ndim for t in tensors}
    if len(ranks) > 1:
        shapes = " and ".join(f"T{t.name} ({t.logical_ndim} axes)" for t in tensors)
        raise DefinitionError(f"{kind}: operands must have the same number of axes, got {shapes}")
    probe = [_probe(v) for v in (lhs, rhs)]
    if not isinstance(probe[0], torch.Tensor):
        probe[0] = torch.tensor(probe[0])
    dtype = kind.torch_fn(*probe).dtype
    domain = []
    for axes in zip(*(t.logical_runtime() for t in tensors)):
        wide = [d for d in axes if not d.is_broadcast]
        src = wide[0] if wide else axes[0]
        for d in wide[1:]:
            if d.extent.is_constant and src.extent.is_constant and d.extent.value != src.extent.value:
                raise DefinitionError(f"{kind}: axis sizes {src.extent.value} and {d.extent.value} differ")
        domain.append(src.clone(fusion))
    out = TensorView(fusion, domain, dtype)
    return _emit(fusion, BinaryOp(out, kind, lhs, rhs))


def unary(kind: str, x: TensorView, dtype: torch.dtype | None = None) -> TensorView:
    kind = as_kind(UnaryKind, kind, "unary op")
    if not isinstance(x, TensorView):
        raise DefinitionTypeError(f"{kind} takes a TensorView, got {type(x).__name__}")
    fusion = _owner(x)
    if kind is UnaryKind.cast:
        if not isinstance(dtype, torch.dtype):
            raise DefinitionTypeError(f"cast needs a torch.dtype, got {dtype!r}")
        if dtype not in SUPPORTED_DTYPES:
            raise DefinitionTypeError(f"cast: dtype {dtype} is not supported; use one of {list(SUPPORTED_DTYPES)}")
    elif dtype is not None:
        raise DefinitionTypeError(f"{kind} takes no dtype")
    if kind.floating and not x.dtype.is_floating_point:
        raise DefinitionTypeError(f"{kind}: T{x.name} is {x.dtype}; {kind} takes a floating-point tensor")
    out = TensorView(fusion, [d.clone(fusion) for d in x.logical_runtime()], dtype or x.dtype)
    return _emit(fusion, UnaryOp(out, kind, x))


def _normalize_dims(x: TensorView, dims, what: str) -> list[int]:
    if isinstance(dims, int):
        dims = [dims]
    dims = list(dims)
    if not dims:
        raise DefinitionError(f"{what}: give at least one axis to reduce")
    n = x.logical_ndim
    norm = []
    for d in dims:
        if not isinstance(d, int) or not -n <= d < n:
            raise DefinitionIndexError(f"{what}: axis {d} is out of range for T{x.name}, which has {n} axes")
        norm.append(d % n)
    if len(set(norm)) != len(norm):
        raise DefinitionError(f"{what}: axes {dims} repeat an axis")
    return sorted(norm)


def reduction(kind: str, x: TensorView, dims) -> TensorView:
    kind = as_kind(ReductionKind, kind, "reduction")
    fusion = _owner(x)
    reduced = _normalize_dims(x, dims, kind)
    dtype = x.dtype
    if kind is ReductionKind.sum and not (dtype.is_floating_point or dtype.is_complex):
        dtype = torch.int64
    domain = [d.clone(fusion, IterType.reduction if i in reduced else None) for i, d in enumerate(x.logical_runtime())]
    out = TensorView(fusion, domain, dtype)
    return _emit(fusion, ReductionOp(out, kind, x))


def matmul(a: TensorView, b: TensorView) -> TensorView:
    fusion = _owner(a, b)
    for t in (a, b):
        if not isinstance(t, TensorView):
            raise DefinitionTypeError(f"matmul takes TensorViews, got {type(t).__name__}")
        if t.logical_ndim < 2:
            raise DefinitionError(f"matmul: T{t.name} must have at least 2 axes, got {t.logical_ndim}")
    if a.dtype != b.dtype:
        raise DefinitionTypeError(f"matmul: dtypes differ, T{a.name} is {a.dtype} and T{b.name} is {b.dtype}")
    ad, bd = a.logical_runtime(), b.logical_runtime()
    _check_same_size(ad[-1], bd[-2], "matmul: K of a and b")
    # torch's batch broadcasting: batch axes align from the right; a
    # broadcast (size-1) axis takes the other operand's.
    n_batch = max(len(ad), len(bd)) - 2
    batch = []
    for i in range(n_batch):
        j_a, j_b = len(ad) - 2 - n_batch + i, len(bd) - 2 - n_batch + i
        pair = [d for d in (ad[j_a] if j_a >= 0 else None, bd[j_b] if j_b >= 0 else None) if d is not None]
        wide = [d for d in pair if not d.is_broadcast]
        if len(wide) == 2:
            _check_same_size(wide[0], wide[1], f"matmul: batch axis {i}")
        batch.append((wide or pair)[0].clone(fusion))
    domain = batch + [
        ad[-2].clone(fusion),
        bd[-1].clone(fusion),
        ad[-1].clone(fusion, IterType.reduction),
    ]
    out = TensorView(fusion, domain, a.dtype)
    return _emit(fusion, MatmulOp(out, a, b))


def linear(x: TensorView, weight: TensorView, bias: TensorView | None = None) -> TensorView:
    """`x @ weight.T + bias` for a weight [N, K]; a weight [*W, N, K] (its
    leading axes a logical split of N, as nvFuser allows) gives out
    [..., *W, N], with a bias [*W, N] or [N]."""
    fusion = _owner(x, weight, bias)
    for t in (x, weight, bias):
        if t is not None and not isinstance(t, TensorView):
            raise DefinitionTypeError(f"linear takes TensorViews, got {type(t).__name__}")
    if x.logical_ndim < 1 or weight.logical_ndim < 2:
        raise DefinitionError(
            f"linear: weight T{weight.name} must have at least 2 axes [N, K], got {weight.logical_ndim}"
        )
    wd = weight.logical_runtime()
    if bias is not None and not 1 <= bias.logical_ndim <= len(wd) - 1:
        raise DefinitionError(
            f"linear: bias T{bias.name} must have the weight's leading axes {len(wd) - 1} or 1 axis [N], "
            f"got {bias.logical_ndim}"
        )
    for t in (weight, bias):
        if t is not None and t.dtype != x.dtype:
            raise DefinitionTypeError(f"linear: T{t.name} is {t.dtype} but T{x.name} is {x.dtype}")
    xd = x.logical_runtime()
    _check_same_size(xd[-1], wd[-1], "linear: K of input and weight")
    if bias is not None:
        for i, (wa, ba) in enumerate(zip(reversed(wd[:-1]), reversed(bias.logical_runtime()))):
            _check_same_size(wa, ba, f"linear: axis {len(wd) - 2 - i} of weight and bias")
    domain = (
        [d.clone(fusion) for d in xd[:-1]]
        + [d.clone(fusion, IterType.iteration) for d in wd[:-1]]
        + [xd[-1].clone(fusion, IterType.reduction)]
    )
    out = TensorView(fusion, domain, x.dtype)
    return _emit(fusion, LinearOp(out, x, weight, bias))


def _check_same_size(a: IterDomain, b: IterDomain, what: str) -> None:
    if a.extent.is_constant and b.extent.is_constant and a.extent.value != b.extent.value:
        raise DefinitionError(f"{what} differ: {a.extent.value} vs {b.extent.value}")
