"""The IR shared by fusions and host programs.

Values (`Scalar`, `IterDomain`, `TensorView`, `Stream`), the fusion ops a user
writes (`Set`, `BinaryOp`, `ReductionOp`, `MatmulOp`, `LinearOp`) and the host
ops a lowering emits (`ForLoop`, `HirAliasSelect`, `Allocate`, stream ops).
Every node is plain data compared by identity. Names are small integers drawn
from the owning container's counters at creation, so a dump is the same on
every run and every rank; nothing prints an address.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Iterator, Sequence

import torch


class ParallelType(enum.Enum):
    """How the iterations of one axis are spread."""

    serial = "S"
    stream = "StreamIdx"
    mesh_x = "deviceIdx.x"


class IterType(enum.Enum):
    iteration = "i"
    reduction = "r"
    broadcast = "b"


class MemoryType(enum.Enum):
    global_ = "g"
    local = "l"

    @property
    def word(self) -> str:
        return "global" if self is MemoryType.global_ else "local"


# The dtype spellings of nvFuser's dumps.
_DTYPE_NAMES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "__half",
    torch.bfloat16: "__bfloat",
    torch.int64: "int64_t",
    torch.int32: "int",
    torch.int16: "int16_t",
    torch.int8: "int8_t",
    torch.uint8: "uint8_t",
    torch.bool: "bool",
}
SUPPORTED_DTYPES = tuple(_DTYPE_NAMES)


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


class IrContainer:
    """Owns the name counters of the values created in it.

    A `HostIrContainer` lowered from a fusion starts from the fusion's
    counters, so values it creates get fresh names after the fusion's.
    """

    def __init__(self, counters: dict[str, int] | None = None):
        self._counters: dict[str, int] = dict(counters or {})

    def next_name(self, kind: str) -> int:
        n = self._counters.get(kind, 0)
        self._counters[kind] = n + 1
        return n


# ---------------------------------------------------------------- scalars


class Scalar:
    """An integer or floating value: a constant, a named or symbolic leaf.

    Symbolic extents print as `i<n>`; named scalars (`StreamIdx`,
    `numberOfStreams`) print by name; a constant prints its value.
    """

    __slots__ = ("label", "value", "__weakref__")

    def __init__(self, label: str | None = None, value: int | float | bool | None = None):
        if (label is None) == (value is None):
            raise ValueError("a Scalar is either named or constant")
        self.label = label
        self.value = value

    @classmethod
    def constant(cls, value: int | float | bool) -> Scalar:
        return cls(value=value)

    @classmethod
    def symbolic(cls, owner: IrContainer) -> Scalar:
        return cls(label=f"i{owner.next_name('scalar')}")

    @property
    def is_constant(self) -> bool:
        return self.value is not None

    def __mod__(self, other: Scalar) -> ScalarExpr:
        return ScalarExpr("%", self, other)

    def __repr__(self) -> str:
        from hostir.printer import format_scalar

        return format_scalar(self)


class ScalarExpr(Scalar):
    """A scalar computed from two others, evaluated whenever it is read."""

    __slots__ = ("op", "lhs", "rhs")
    OPS = {"%": lambda a, b: a % b, "*": lambda a, b: a * b}

    def __init__(self, op: str, lhs: Scalar, rhs: Scalar):
        if op not in self.OPS:
            raise ValueError(f"unknown scalar op {op!r}")
        self.label = None
        self.value = None
        self.op, self.lhs, self.rhs = op, lhs, rhs

    @property
    def is_constant(self) -> bool:
        return False


def product(extents: Sequence[Scalar]) -> Scalar:
    """`( ( a * b ) * c )`: the left-nested product nvFuser prints for sizes."""
    if not extents:
        return Scalar.constant(1)
    acc = extents[0]
    for e in extents[1:]:
        acc = ScalarExpr("*", acc, e)
    return acc


# ---------------------------------------------------------------- domains


class IterDomain:
    """One axis of a tensor: an extent, an iteration type, a parallel type."""

    __slots__ = ("name", "extent", "iter_type", "parallel_type", "owner")

    def __init__(
        self,
        owner: IrContainer,
        extent: Scalar,
        iter_type: IterType = IterType.iteration,
        parallel_type: ParallelType = ParallelType.serial,
        name: int | None = None,
    ):
        self.owner = owner
        self.name = owner.next_name("id") if name is None else name
        self.extent = extent
        self.iter_type = iter_type
        self.parallel_type = parallel_type

    def clone(self, owner: IrContainer, iter_type: IterType | None = None) -> IterDomain:
        return IterDomain(owner, self.extent, iter_type or self.iter_type, self.parallel_type)

    @property
    def is_reduction(self) -> bool:
        return self.iter_type is IterType.reduction

    @property
    def is_broadcast(self) -> bool:
        return self.iter_type is IterType.broadcast

    def parallelize(self, parallel_type: ParallelType) -> IterDomain:
        """Mark this axis `stream`, `mesh_x` or back to `serial`."""
        if not isinstance(parallel_type, ParallelType):
            raise TypeError(f"parallelize takes a ParallelType, got {parallel_type!r}")
        self.parallel_type = parallel_type
        bump = getattr(self.owner, "bump_version", None)
        if bump is not None:
            bump()
        return self

    def __repr__(self) -> str:
        from hostir.printer import format_id

        return format_id(self)


class TensorView:
    """A tensor of the program: a name `T<n>`, a dtype, a memory type and a
    logical domain. Reduction axes stay in the domain (printed `r...`) but
    have no extent in the runtime tensor."""

    __slots__ = ("name", "domain", "dtype", "memory_type", "owner", "__weakref__")

    def __init__(
        self,
        owner: IrContainer,
        domain: Sequence[IterDomain],
        dtype: torch.dtype,
        memory_type: MemoryType = MemoryType.local,
        name: int | None = None,
    ):
        if dtype not in _DTYPE_NAMES:
            raise TypeError(f"dtype {dtype} is not supported; use one of {list(_DTYPE_NAMES)}")
        self.owner = owner
        self.name = owner.next_name("tv") if name is None else name
        self.domain = list(domain)
        self.dtype = dtype
        self.memory_type = memory_type

    @property
    def ndim(self) -> int:
        """Number of axes of the runtime tensor (reduction axes excluded)."""
        return sum(1 for d in self.domain if not d.is_reduction)

    def runtime_domain(self) -> list[IterDomain]:
        return [d for d in self.domain if not d.is_reduction]

    def runtime_position(self, axis: IterDomain) -> int:
        """Position of `axis` in the runtime tensor's dims."""
        pos = 0
        for d in self.domain:
            if d is axis:
                return pos
            if not d.is_reduction:
                pos += 1
        raise ValueError(f"{axis} is not an axis of {self}")

    def axis(self, i: int) -> IterDomain:
        """The i-th axis (negative counts from the end), reduction axes included."""
        n = len(self.domain)
        if not isinstance(i, int) or not -n <= i < n:
            raise IndexError(f"axis {i} is out of range for T{self.name}, which has {n} axes")
        return self.domain[i]

    def stream_axes(self) -> list[IterDomain]:
        return [d for d in self.domain if d.parallel_type is ParallelType.stream]

    def __repr__(self) -> str:
        from hostir.printer import format_tv

        return format_tv(self)


class Stream:
    """A CUDA stream named in the program. With an index it is "the stream
    whose key is the run-time value of `index`": two Streams with equal
    indices are one stream. Without one it names a stream that a
    `GetCurrentStream` captures, or else a worker stream of its own."""

    __slots__ = ("name", "index")

    def __init__(self, owner: IrContainer, index: Scalar | None = None):
        self.name = owner.next_name("stream")
        self.index = index

    def __repr__(self) -> str:
        from hostir.printer import format_stream

        return format_stream(self)


# ---------------------------------------------------------------- exprs


class Expr:
    """Base of all ops. Subclasses are dataclasses whose operand fields are
    listed in `INPUTS` and whose result fields are listed in `OUTPUTS`."""

    INPUTS: tuple[str, ...] = ()
    OUTPUTS: tuple[str, ...] = ()

    def inputs(self) -> list:
        vals = []
        for f in self.INPUTS:
            v = getattr(self, f)
            if v is not None:
                vals.append(v)
        return vals

    def outputs(self) -> list:
        return [getattr(self, f) for f in self.OUTPUTS]

    def replace(self, **changes) -> Expr:
        return dataclasses.replace(self, **changes)

    def id_pairs(self) -> Iterator[tuple[IterDomain, IterDomain]]:
        """(output axis, input axis) pairs that iterate together."""
        return iter(())

    def __repr__(self) -> str:
        from hostir.printer import format_expr

        return format_expr(self).strip()


def _op(cls):
    return dataclasses.dataclass(eq=False, repr=False)(cls)


def _zip_axes(out: TensorView, inp: TensorView) -> Iterator[tuple[IterDomain, IterDomain]]:
    # An operand's reduction axes (left by the op that made it) take no part.
    yield from zip(out.runtime_domain(), inp.runtime_domain())


@_op
class Set(Expr):
    """`out = in` as a copy. Writes into `out` if its buffer is bound,
    otherwise binds a fresh copy. Runs on the current stream."""

    out: TensorView
    input: TensorView
    INPUTS = ("input",)
    OUTPUTS = ("out",)

    def id_pairs(self):
        return _zip_axes(self.out, self.input)


@_op
class BinaryOp(Expr):
    """Elementwise `out = lhs <kind> rhs` (add, sub, mul, div, with torch's
    broadcasting of size-1 broadcast axes and its type promotion). A Scalar
    operand is a constant. Writes into `out` if bound (the `out=` variant)."""

    out: TensorView
    kind: str
    lhs: TensorView | Scalar
    rhs: TensorView | Scalar
    INPUTS = ("lhs", "rhs")
    OUTPUTS = ("out",)
    KINDS = {"add": "+", "sub": "-", "mul": "*", "div": "/"}

    def id_pairs(self):
        for operand in (self.lhs, self.rhs):
            if isinstance(operand, TensorView):
                yield from _zip_axes(self.out, operand)


@_op
class ReductionOp(Expr):
    """`out = <kind>(input)` over the axes of `out` that are reductions
    (sum, max, min). Writes into `out` if bound."""

    out: TensorView
    kind: str
    input: TensorView
    INPUTS = ("input",)
    OUTPUTS = ("out",)
    KINDS = {"sum": "add", "max": "max", "min": "min"}

    def reduced_dims(self) -> list[int]:
        return [i for i, d in enumerate(self.out.domain) if d.is_reduction]

    def id_pairs(self):
        return zip(self.out.domain, self.input.runtime_domain())


@_op
class MatmulOp(Expr):
    """`out = a @ b` with torch.matmul's semantics; `out`'s last axis is the
    reduction over K. Writes into `out` if bound."""

    out: TensorView
    a: TensorView
    b: TensorView
    INPUTS = ("a", "b")
    OUTPUTS = ("out",)

    def id_pairs(self):
        a, b, out = self.a.runtime_domain(), self.b.runtime_domain(), self.out.domain
        *batch_out, m, n, k = out
        yield m, a[-2]
        yield n, b[-1]
        yield k, a[-1]
        yield k, b[-2]
        for i, d in enumerate(reversed(batch_out)):
            for operand in (a, b):
                j = len(operand) - 3 - i
                if j >= 0:
                    yield d, operand[j]


@_op
class LinearOp(Expr):
    """`out = input @ weight.T + bias`; `out`'s last axis is the reduction
    over K. Writes into `out` if bound."""

    out: TensorView
    input: TensorView
    weight: TensorView
    bias: TensorView | None = None
    INPUTS = ("input", "weight", "bias")
    OUTPUTS = ("out",)

    def id_pairs(self):
        x, w = self.input.runtime_domain(), self.weight.runtime_domain()
        *lead, n, k = self.out.domain
        yield from zip(lead, x[:-1])
        yield n, w[0]
        if self.bias is not None:
            yield n, self.bias.runtime_domain()[0]
        yield k, x[-1]
        yield k, w[1]


FUSION_OPS = (Set, BinaryOp, ReductionOp, MatmulOp, LinearOp)


@_op
class GetCurrentStream(Expr):
    """Binds `stream` to the caller's current stream, on every run. Does not
    block and enqueues nothing."""

    stream: Stream


@_op
class SetCurrentStream(Expr):
    """Makes `stream` the current stream: the ops after it enqueue there."""

    stream: Stream
    INPUTS = ("stream",)


@_op
class Synchronize(Expr):
    """The current stream waits for all work enqueued so far on `stream`.
    The host does not block."""

    stream: Stream
    INPUTS = ("stream",)


@_op
class ForLoop(Expr):
    """Runs `body` once for each `index` in [start, stop), rebinding `index`.
    Values first defined in the body are unbound at each iteration, so each
    iteration writes fresh buffers or the slices its selects bind.
    `iter_domain` names the axis a stream loop walks (for the dump)."""

    index: Scalar
    start: Scalar
    stop: Scalar
    body: list
    iter_domain: IterDomain | None = None
    INPUTS = ("start", "stop")


@_op
class HirAliasSelect(Expr):
    """Binds `out` to the view `input.select(axis, index)`: no copy, so an op
    writing `out` writes `input`'s buffer. On a broadcast axis index 0 is
    used. `out` is bound, not defined, so it is not an SSA output."""

    out: TensorView
    input: TensorView
    axis: IterDomain
    index: Scalar
    INPUTS = ("input", "index")

    def __post_init__(self):
        if self.axis not in self.input.domain:
            raise ValueError(f"select axis {self.axis} is not an axis of {self.input}")


@_op
class Allocate(Expr):
    """Binds `buffer` to a new tensor of its runtime shape on the program's
    device, unless it is bound already (a caller's preallocated output).
    The allocation is stream-ordered on the current stream."""

    buffer: TensorView
    memory_type: MemoryType = MemoryType.global_
    zero_init: bool = False

    def size(self) -> Scalar:
        return product([d.extent for d in self.buffer.runtime_domain()])


@_op
class Deallocate(Expr):
    """Drops the program's reference to `buffer`'s tensor."""

    buffer: TensorView
    INPUTS = ("buffer",)


def walk(exprs: Sequence[Expr]) -> Iterator[Expr]:
    """Every expr, loop bodies included, in program order."""
    for e in exprs:
        yield e
        if isinstance(e, ForLoop):
            yield from walk(e.body)


def defined_tvs(e: Expr) -> list[TensorView]:
    """TensorViews an expr binds when it runs."""
    if isinstance(e, HirAliasSelect):
        return [e.out]
    if isinstance(e, Allocate):
        return [e.buffer]
    return [v for v in e.outputs() if isinstance(v, TensorView)]


def read_vals(e: Expr) -> list:
    """Values an expr reads (not those it defines)."""
    return [v for v in e.inputs() if isinstance(v, (TensorView, Scalar, Stream))]


# ---------------------------------------------------------------- ID graph


class IdGraph:
    """Union-find of axes that ops iterate together.

    With `broadcast=True` a broadcast axis joins the axis it broadcasts to
    (used to find which operand axes a stream axis walks); without, only
    axes whose extents must be equal are joined (used to check shapes).
    Built over ops as defined, before any pass replaces operands by slices.
    """

    def __init__(self, exprs: Sequence[Expr], broadcast: bool):
        self._parent: dict[IterDomain, IterDomain] = {}
        for e in walk(exprs):
            for a, b in e.id_pairs():
                if not broadcast and (a.is_broadcast or b.is_broadcast):
                    continue
                self._union(a, b)

    def _find(self, d: IterDomain) -> IterDomain:
        root = d
        while self._parent.get(root, root) is not root:
            root = self._parent[root]
        while d is not root:
            d, self._parent[d] = self._parent.get(d, d), root
        return root

    def _union(self, a: IterDomain, b: IterDomain) -> None:
        ra, rb = self._find(a), self._find(b)
        if ra is not rb:
            self._parent[ra] = rb

    def mapped(self, a: IterDomain, b: IterDomain) -> bool:
        return a is b or self._find(a) is self._find(b)

    def groups(self) -> list[list[IterDomain]]:
        by_root: dict[IterDomain, list[IterDomain]] = {}
        for d in list(self._parent):
            by_root.setdefault(self._find(d), []).append(d)
        for root, members in by_root.items():
            if root not in members:
                members.append(root)
        return list(by_root.values())



# ---------------------------------------------------------------- fusion


class Fusion(IrContainer):
    """A user's tensor program: inputs, outputs and ops in definition order.

    `version` grows with every change (an op, an output, a parallelized
    axis) so that lowered programs cached for an older version are not used.
    """

    def __init__(self):
        super().__init__()
        self.inputs: list[TensorView] = []
        self.outputs: list[TensorView] = []
        self.exprs: list[Expr] = []
        self.version = 0

    def bump_version(self) -> None:
        self.version += 1

    def new_tensor(self, shape: Sequence[int], dtype: torch.dtype) -> TensorView:
        """A fusion input. -1 is a symbolic extent, 1 a broadcast axis, any
        other size a fixed extent that inputs must have."""
        domain = []
        for i, size in enumerate(shape):
            if isinstance(size, bool) or not isinstance(size, int) or size < -1:
                raise ValueError(f"shape[{i}] = {size!r}: use -1 for a symbolic extent or a size >= 0")
            if size == -1:
                domain.append(IterDomain(self, Scalar.symbolic(self)))
            elif size == 1:
                domain.append(IterDomain(self, Scalar.constant(1), IterType.broadcast))
            else:
                domain.append(IterDomain(self, Scalar.constant(size)))
        tv = TensorView(self, domain, dtype, MemoryType.global_)
        self.inputs.append(tv)
        self.bump_version()
        return tv

    def add_output(self, tv: TensorView) -> None:
        self._check_owned(tv, "add_output")
        if tv in self.inputs:
            raise ValueError(f"T{tv.name} is a fusion input; to return it, add_output(fd.ops.set(T{tv.name}))")
        if tv in self.outputs:
            raise ValueError(f"T{tv.name} is already an output")
        self.outputs.append(tv)
        self.bump_version()

    def add_expr(self, e: Expr) -> None:
        self.exprs.append(e)
        self.bump_version()

    def _check_owned(self, v, what: str) -> None:
        if not isinstance(v, TensorView):
            raise TypeError(f"{what} takes a TensorView, got {type(v).__name__}")
        if v.owner is not self:
            raise ValueError(f"{what}: T{v.name} belongs to another fusion")


def _owner(*operands) -> Fusion:
    owners = {id(v.owner): v.owner for v in operands if isinstance(v, TensorView)}
    if not owners:
        raise TypeError("an op needs at least one TensorView operand")
    if len(owners) > 1:
        raise ValueError("operands belong to different fusions")
    (fusion,) = owners.values()
    return fusion


def _emit(fusion: Fusion, e: Expr) -> TensorView:
    fusion.add_expr(e)
    return e.out


def set_(x: TensorView) -> TensorView:
    fusion = _owner(x)
    out = TensorView(fusion, [d.clone(fusion) for d in x.runtime_domain()], x.dtype)
    return _emit(fusion, Set(out, x))


def _as_operand(v) -> TensorView | Scalar:
    if isinstance(v, TensorView):
        return v
    if isinstance(v, (bool, int, float)):
        return Scalar.constant(v)
    raise TypeError(f"operand must be a TensorView or a Python number, got {type(v).__name__}")


def _probe(v):
    """A value with v's dtype for asking torch about type promotion."""
    if isinstance(v, TensorView):
        return torch.empty(0, dtype=v.dtype)
    return v.value


def binary(kind: str, lhs, rhs) -> TensorView:
    if kind not in BinaryOp.KINDS:
        raise ValueError(f"unknown binary op {kind!r}; expected one of {list(BinaryOp.KINDS)}")
    lhs, rhs = _as_operand(lhs), _as_operand(rhs)
    fusion = _owner(lhs, rhs)
    tensors = [v for v in (lhs, rhs) if isinstance(v, TensorView)]
    ranks = {t.ndim for t in tensors}
    if len(ranks) > 1:
        shapes = " and ".join(f"T{t.name} ({t.ndim} axes)" for t in tensors)
        raise ValueError(f"{kind}: operands must have the same number of axes, got {shapes}")
    probe = [_probe(v) for v in (lhs, rhs)]
    if not isinstance(probe[0], torch.Tensor):
        probe[0] = torch.tensor(probe[0])
    dtype = getattr(torch, kind)(*probe).dtype
    domain = []
    for axes in zip(*(t.runtime_domain() for t in tensors)):
        wide = [d for d in axes if not d.is_broadcast]
        src = wide[0] if wide else axes[0]
        for d in wide[1:]:
            if d.extent.is_constant and src.extent.is_constant and d.extent.value != src.extent.value:
                raise ValueError(f"{kind}: axis sizes {src.extent.value} and {d.extent.value} differ")
        domain.append(src.clone(fusion))
    out = TensorView(fusion, domain, dtype)
    return _emit(fusion, BinaryOp(out, kind, lhs, rhs))


def _normalize_dims(x: TensorView, dims, what: str) -> list[int]:
    if isinstance(dims, int):
        dims = [dims]
    dims = list(dims)
    if not dims:
        raise ValueError(f"{what}: give at least one axis to reduce")
    n = x.ndim
    norm = []
    for d in dims:
        if not isinstance(d, int) or not -n <= d < n:
            raise IndexError(f"{what}: axis {d} is out of range for T{x.name}, which has {n} axes")
        norm.append(d % n)
    if len(set(norm)) != len(norm):
        raise ValueError(f"{what}: axes {dims} repeat an axis")
    return sorted(norm)


def reduction(kind: str, x: TensorView, dims) -> TensorView:
    if kind not in ReductionOp.KINDS:
        raise ValueError(f"unknown reduction {kind!r}; expected one of {list(ReductionOp.KINDS)}")
    fusion = _owner(x)
    reduced = _normalize_dims(x, dims, kind)
    dtype = x.dtype
    if kind == "sum" and not (dtype.is_floating_point or dtype.is_complex):
        dtype = torch.int64
    domain = [
        d.clone(fusion, IterType.reduction if i in reduced else None)
        for i, d in enumerate(x.runtime_domain())
    ]
    out = TensorView(fusion, domain, dtype)
    return _emit(fusion, ReductionOp(out, kind, x))


def matmul(a: TensorView, b: TensorView) -> TensorView:
    fusion = _owner(a, b)
    for t in (a, b):
        if not isinstance(t, TensorView):
            raise TypeError(f"matmul takes TensorViews, got {type(t).__name__}")
        if t.ndim < 2:
            raise ValueError(f"matmul: T{t.name} must have at least 2 axes, got {t.ndim}")
    if a.dtype != b.dtype:
        raise TypeError(f"matmul: dtypes differ, T{a.name} is {a.dtype} and T{b.name} is {b.dtype}")
    if b.ndim != 2 and b.ndim != a.ndim:
        raise ValueError(
            f"matmul: T{b.name} must have 2 axes or as many as T{a.name} ({a.ndim}), got {b.ndim}"
        )
    ad, bd = a.runtime_domain(), b.runtime_domain()
    _check_same_size(ad[-1], bd[-2], "matmul: K of a and b")
    batch = []
    for i, d in enumerate(ad[:-2]):
        if b.ndim > 2:
            _check_same_size(d, bd[i], f"matmul: batch axis {i}")
        batch.append(d.clone(fusion))
    domain = batch + [
        ad[-2].clone(fusion),
        bd[-1].clone(fusion),
        ad[-1].clone(fusion, IterType.reduction),
    ]
    out = TensorView(fusion, domain, a.dtype)
    return _emit(fusion, MatmulOp(out, a, b))


def linear(x: TensorView, weight: TensorView, bias: TensorView | None = None) -> TensorView:
    fusion = _owner(x, weight, bias)
    if x.ndim < 1 or weight.ndim != 2:
        raise ValueError(f"linear: weight T{weight.name} must have 2 axes [N, K], got {weight.ndim}")
    if bias is not None and bias.ndim != 1:
        raise ValueError(f"linear: bias T{bias.name} must have 1 axis [N], got {bias.ndim}")
    for t in (weight, bias):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"linear: T{t.name} is {t.dtype} but T{x.name} is {x.dtype}")
    xd, wd = x.runtime_domain(), weight.runtime_domain()
    _check_same_size(xd[-1], wd[1], "linear: K of input and weight")
    if bias is not None:
        _check_same_size(wd[0], bias.runtime_domain()[0], "linear: N of weight and bias")
    domain = [d.clone(fusion) for d in xd[:-1]] + [
        wd[0].clone(fusion, IterType.iteration),
        xd[-1].clone(fusion, IterType.reduction),
    ]
    out = TensorView(fusion, domain, x.dtype)
    return _emit(fusion, LinearOp(out, x, weight, bias))


def _check_same_size(a: IterDomain, b: IterDomain, what: str) -> None:
    if a.extent.is_constant and b.extent.is_constant and a.extent.value != b.extent.value:
        raise ValueError(f"{what} differ: {a.extent.value} vs {b.extent.value}")
