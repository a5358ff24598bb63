"""The IR's values: the axes (`IterDomain`), tensors (`TensorView`),
scalars (`Scalar`, `ScalarExpr`, `InputScalar`) and streams (`Stream`) that
ops read and write, the container that names them (`IrContainer`), the
iteration and memory types, the dtypes a tensor may have, and the text of
each value as nvFuser spells it (`format_*`; printer.py builds the dump of
ops and programs on top). Part of the IR; `hostir.ir` re-exports it.
Every value is plain data compared by identity; names are small integers
drawn from the owning container's counters at creation, so a dump is the
same on every run and every rank.
"""

from __future__ import annotations

import enum
import math
from typing import Sequence

import torch

from hostir.errors import DefinitionError, DefinitionIndexError, DefinitionTypeError
from hostir.mesh import DeviceMesh, ParallelType, _is_torch_mesh


class IterType(enum.Enum):
    iteration = "i"
    reduction = "r"
    broadcast = "b"


class MemoryType(enum.Enum):
    global_ = "g"
    local = "l"
    # Device memory that peers map and write (the cuda transport's windows).
    symmetric = "s"
    # Host memory (pinned when the program runs on a GPU): reached from the
    # device only through a `Transfer`.
    host = "h"

    @property
    def word(self) -> str:
        return {"g": "global", "l": "local", "s": "symmetric", "h": "host"}[self.value]

    @classmethod
    def from_word(cls, word: str) -> MemoryType:
        """`"device"` (global memory) or `"host"`, as `define_tensor(memory=)` takes them."""
        found = {"device": cls.global_, "host": cls.host}.get(word) if isinstance(word, str) else None
        if found is None:
            raise DefinitionError(f'memory must be "device" or "host", got {word!r}')
        return found


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
            raise DefinitionError("a Scalar is either named or constant")
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

    def __mod__(self, other: Scalar | int) -> ScalarExpr:
        return ScalarExpr("%", self, _scalar(other))

    def __add__(self, other: Scalar | int) -> ScalarExpr:
        return ScalarExpr("+", self, _scalar(other))

    def __sub__(self, other: Scalar | int) -> ScalarExpr:
        return ScalarExpr("-", self, _scalar(other))

    def __rsub__(self, other: int) -> ScalarExpr:
        return ScalarExpr("-", _scalar(other), self)

    def __repr__(self) -> str:
        return format_scalar(self)


class ScalarExpr(Scalar):
    """A scalar computed from two others, evaluated whenever it is read."""

    __slots__ = ("op", "lhs", "rhs")
    OPS = {
        "%": lambda a, b: a % b,
        "*": lambda a, b: a * b,
        "+": lambda a, b: a + b,
        "-": lambda a, b: a - b,
        "/": lambda a, b: a // b,
        "ceilDiv": lambda a, b: -(-a // b),
        # Comparisons and logic: an IfThenElse's predicate.
        "==": lambda a, b: a == b,
        "!=": lambda a, b: a != b,
        "<": lambda a, b: a < b,
        "<=": lambda a, b: a <= b,
        ">": lambda a, b: a > b,
        ">=": lambda a, b: a >= b,
        "&&": lambda a, b: bool(a) and bool(b),
        "||": lambda a, b: bool(a) or bool(b),
    }
    COMPARISONS = ("==", "!=", "<", "<=", ">", ">=", "&&", "||")

    def __init__(self, op: str, lhs: Scalar, rhs: Scalar):
        if op not in self.OPS:
            raise DefinitionError(f"unknown scalar op {op!r}")
        self.label = None
        self.value = None
        self.op, self.lhs, self.rhs = op, lhs, rhs

    @property
    def is_constant(self) -> bool:
        return False


class InputScalar(Scalar):
    """A number the caller passes to `execute`, like a tensor input (from
    `define_scalar`). Prints as `d<n>` (floating), `i<n>` (integer) or
    `b<n>` (bool), as nvFuser names scalars."""

    __slots__ = ("dtype",)
    PREFIX = {torch.float64: "d", torch.int64: "i", torch.bool: "b"}

    def __init__(self, owner: IrContainer, dtype: torch.dtype):
        if dtype not in self.PREFIX:
            raise DefinitionTypeError(f"a scalar input is float64, int64 or bool, got {dtype}")
        super().__init__(label=f"{self.PREFIX[dtype]}{owner.next_name('scalar')}")
        self.dtype = dtype

    def accepts(self, value) -> bool:
        """Whether `value` (a Python number) can be bound to this scalar."""
        if self.dtype is torch.bool:
            return isinstance(value, bool)
        if self.dtype is torch.int64:
            return isinstance(value, int) and not isinstance(value, bool)
        return isinstance(value, (int, float)) and not isinstance(value, bool)


def _scalar(v) -> Scalar:
    return v if isinstance(v, Scalar) else Scalar.constant(v)


def same_scalar(a: Scalar, b: Scalar, equal=None) -> bool:
    """Structural equality: the same object, equal constants, or the same
    op of structurally equal operands. `equal(x, y)` may declare two leaf
    scalars equal (extents the program makes equal); names are never
    compared as text."""
    if a is b:
        return True
    if isinstance(a, ScalarExpr) or isinstance(b, ScalarExpr):
        if not (isinstance(a, ScalarExpr) and isinstance(b, ScalarExpr)) or a.op != b.op:
            return False
        return same_scalar(a.lhs, b.lhs, equal) and same_scalar(a.rhs, b.rhs, equal)
    if a.is_constant and b.is_constant:
        return a.value == b.value
    return equal is not None and equal(a, b)


class IterDomain:
    """One axis of a tensor: an extent, an iteration type, a parallel type.

    An axis made by splitting another records the logical axis it came from
    (`parent`); a split logical axis lists the axes it became (`leaves`)."""

    __slots__ = ("name", "extent", "iter_type", "parallel_type", "owner", "parent", "leaves", "scheduled")

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
        self.parent: IterDomain | None = None
        self.leaves: list[IterDomain] | None = None
        # Set by `parallelize`: the user chose this axis's parallel type,
        # `serial` included, so propagation leaves its tensor alone.
        self.scheduled = False

    def clone(self, owner: IrContainer, iter_type: IterType | None = None) -> IterDomain:
        return IterDomain(owner, self.extent, iter_type or self.iter_type, self.parallel_type)

    @property
    def is_reduction(self) -> bool:
        return self.iter_type is IterType.reduction

    @property
    def is_broadcast(self) -> bool:
        return self.iter_type is IterType.broadcast

    @property
    def is_device_parallel(self) -> bool:
        return self.parallel_type.is_device

    def loop_leaves(self) -> list[IterDomain]:
        """The loop axes this logical axis became (itself if unsplit)."""
        return self.leaves if self.leaves is not None else [self]

    def parallelize(self, parallel_type: ParallelType) -> IterDomain:
        """Mark this axis `stream`, `mesh_x` or `mesh_y`, or back to
        `serial`. An axis takes one parallel type: giving a parallelized
        axis another one is an error naming both (make it `serial` first
        to change it)."""
        if not isinstance(parallel_type, ParallelType):
            raise DefinitionTypeError(f"parallelize takes a ParallelType, got {parallel_type!r}")
        if self.leaves is not None:
            raise DefinitionError(f"{self!r} has been split; parallelize one of the axes it was split into")
        serial = ParallelType.serial
        if serial not in (self.parallel_type, parallel_type) and parallel_type is not self.parallel_type:
            raise DefinitionError(
                f"{self!r} is already parallelized as {self.parallel_type.name}; it cannot also be "
                f"{parallel_type.name} (an axis takes one parallel type: split it to use both, or "
                f"parallelize it as serial first to change it)"
            )
        self.parallel_type = parallel_type
        self.scheduled = True
        bump = getattr(self.owner, "bump_version", None)
        if bump is not None:
            bump()
        return self

    def __repr__(self) -> str:
        return format_id(self)


class TensorView:
    """A tensor of the program: a name `T<n>`, a dtype, a memory type, a
    logical domain and a loop domain, and optionally the mesh it lives on.

    The logical domain is the tensor as defined; the loop domain (`domain`)
    is the logical one with split axes replaced by the axes they were split
    into. Ops, allocations and slices work on the loop domain. Reduction axes
    stay in the domain (printed `r...`) but have no extent in the runtime
    tensor; a `mesh_x` axis has extent 1 in each rank's local tensor."""

    __slots__ = ("name", "logical", "domain", "dtype", "memory_type", "owner", "mesh", "static_dims", "__weakref__")

    def __init__(
        self,
        owner: IrContainer,
        domain: Sequence[IterDomain],
        dtype: torch.dtype,
        memory_type: MemoryType = MemoryType.local,
        name: int | None = None,
        mesh: DeviceMesh | None = None,
        logical: Sequence[IterDomain] | None = None,
    ):
        if dtype not in _DTYPE_NAMES:
            raise DefinitionTypeError(f"dtype {dtype} is not supported; use one of {list(_DTYPE_NAMES)}")
        self.owner = owner
        self.name = owner.next_name("tv") if name is None else name
        self.domain = list(domain)
        self.logical = list(logical) if logical is not None else list(domain)
        self.dtype = dtype
        self.memory_type = memory_type
        self.mesh = mesh
        # Logical axes whose sizes enter the program cache's key.
        self.static_dims: tuple[int, ...] = ()

    @property
    def ndim(self) -> int:
        """Number of axes of the runtime tensor (reduction axes excluded)."""
        return sum(1 for d in self.domain if not d.is_reduction)

    @property
    def logical_ndim(self) -> int:
        """Number of axes of the tensor a user passes or gets back."""
        return sum(1 for d in self.logical if not d.is_reduction)

    def loop_axes(self) -> list[IterDomain]:
        """The loop axes without reductions: each split axis as its pieces.
        (The dims a rank holds are `layout.dims`: there the pieces of a
        split axis other than a mesh_x one stay merged.)"""
        return [d for d in self.domain if not d.is_reduction]

    def logical_runtime(self) -> list[IterDomain]:
        return [d for d in self.logical if not d.is_reduction]

    def axis(self, i: int) -> IterDomain:
        """The i-th loop axis (negative counts from the end), reduction axes
        included; after a split, the axes it made."""
        n = len(self.domain)
        if not isinstance(i, int) or not -n <= i < n:
            raise DefinitionIndexError(f"axis {i} is out of range for T{self.name}, which has {n} axes")
        return self.domain[i]

    def stream_axes(self) -> list[IterDomain]:
        return [d for d in self.domain if d.parallel_type is ParallelType.stream]

    def held_by(self, rank: int | None) -> bool:
        """Whether rank `rank` holds this tensor: always without a mesh or
        a rank (a program not yet pruned for one), else if the mesh names
        it."""
        return rank is None or self.mesh is None or rank in self.mesh

    def device_axes(self) -> list[IterDomain]:
        return [d for d in self.domain if d.is_device_parallel and not d.is_reduction]

    @property
    def is_split(self) -> bool:
        """Whether any logical axis is split into loop pieces (how those
        pieces lie in the runtime dims is `layout.is_chunked`)."""
        return len(self.domain) != len(self.logical) or any(d.leaves is not None for d in self.logical)

    # -- scheduling
    def mark_static(self, dims: Sequence[int] | None = None) -> TensorView:
        """Make the sizes of logical axes `dims` (all if None) of this fusion
        input part of the program cache's key: a call with other sizes gets
        a program of its own. Programs are dynamic by default (one lowering
        serves every size); mark an axis static when something made for a
        program (a schedule, a captured graph) may depend on its size."""
        inputs = getattr(self.owner, "inputs", ())
        if self not in inputs:
            raise DefinitionError(
                f"mark_static: T{self.name} is not a fusion input; only inputs' sizes are known at a call"
            )
        n = self.logical_ndim
        if dims is None:
            dims = range(n)
        elif isinstance(dims, int):
            dims = [dims]
        chosen = set()
        for d in dims:
            if isinstance(d, bool) or not isinstance(d, int) or not -n <= d < n:
                raise DefinitionIndexError(
                    f"mark_static: axis {d!r} is out of range for T{self.name}, which has {n} axes"
                )
            chosen.add(d % n)
        self.static_dims = tuple(sorted(chosen))
        self._bump()
        return self

    def set_device_mesh(self, mesh: DeviceMesh) -> TensorView:
        """Place this tensor on `mesh` (replicated until an axis is `mesh_x`);
        a torch DeviceMesh is taken as its hostir equivalent."""
        if _is_torch_mesh(mesh):
            mesh = DeviceMesh(mesh)
        if not isinstance(mesh, DeviceMesh):
            raise DefinitionTypeError(f"set_device_mesh takes a DeviceMesh, got {type(mesh).__name__}")
        self.mesh = mesh
        self._bump()
        return self

    def outer_split(self, axis: int, factor: int) -> TensorView:
        """Replace loop axis `axis` (extent e) by [factor, ceilDiv(e, factor)]: the
        outer axis can then be `mesh_x` (each rank holds e / factor) or
        `stream`."""
        return self._split(axis, factor, outer=True)

    def split(self, axis: int, factor: int) -> TensorView:
        """Replace loop axis `axis` (extent e) by [ceilDiv(e, factor), factor]."""
        return self._split(axis, factor, outer=False)

    def _split(self, axis: int, factor: int, outer: bool) -> TensorView:
        d = self.axis(axis)
        if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
            raise DefinitionError(f"split factor must be an integer >= 1, got {factor!r}")
        if d.is_broadcast:
            raise DefinitionError(f"cannot split broadcast axis {d!r} of T{self.name}")
        if d.parallel_type is not ParallelType.serial:
            raise DefinitionError(f"split {d!r} of T{self.name} before parallelizing it")
        if d.extent.is_constant and d.extent.value % factor:
            raise DefinitionError(f"axis {axis} of T{self.name}: extent {d.extent.value} not divisible by {factor}")
        if d.extent.is_constant:
            rest = Scalar.constant(d.extent.value // factor)
        else:
            # nvFuser's split: ceilDiv, so a stream split of an extent the
            # factor does not divide has a ragged last chunk.
            rest = ScalarExpr("ceilDiv", d.extent, Scalar.constant(factor))
        f = Scalar.constant(factor)
        outer_ext, inner_ext = (f, rest) if outer else (rest, f)
        root = d.parent or d
        made = [IterDomain(self.owner, outer_ext, d.iter_type), IterDomain(self.owner, inner_ext, d.iter_type)]
        for m in made:
            m.parent = root
        leaves = root.loop_leaves()
        at = leaves.index(d)
        root.leaves = leaves[:at] + made + leaves[at + 1 :]
        i = self.domain.index(d)
        self.domain[i : i + 1] = made
        self._bump()
        return self

    def _bump(self) -> None:
        bump = getattr(self.owner, "bump_version", None)
        if bump is not None:
            bump()

    def __repr__(self) -> str:
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
        return format_stream(self)


# ---------------------------------------------------------------- text of values
#
# Values format themselves (nvFuser's spelling); printer.py builds the dump
# of ops and programs on top and depends on this module, never the reverse.


def format_scalar(s: Scalar) -> str:
    if isinstance(s, ScalarExpr):
        if s.op == "ceilDiv":
            return f"( ceilDiv({format_scalar(s.lhs)}, {format_scalar(s.rhs)}) )"
        return f"( {format_scalar(s.lhs)} {s.op} {format_scalar(s.rhs)} )"
    if s.label is not None:
        return s.label
    v = s.value
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if math.isinf(v):
            return "-inf" if v < 0 else "inf"
        return repr(v)
    return str(v)


def format_id(d: IterDomain) -> str:
    return f"{d.iter_type.value}{d.parallel_type.value}{d.name}{{{format_scalar(d.extent)}}}"


def format_tv(tv: TensorView) -> str:
    axes = ", ".join(format_id(d) for d in tv.domain)
    text = f"T{tv.name}_{tv.memory_type.value}_{dtype_name(tv.dtype)}[{axes}]"
    if tv.mesh is not None:
        text += f" ({tv.mesh!r})"
    return text


def format_stream(s: Stream) -> str:
    if s.index is not None:
        return f"Stream {format_scalar(s.index)}"
    return f"Stream {s.name}"
