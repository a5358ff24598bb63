"""The IR shared by fusions and host programs.

Values (`Scalar`, `IterDomain`, `TensorView`, `Stream`, and the `DeviceMesh`
a tensor lives on), the fusion ops a user writes (`Set`, `BinaryOp`,
`ReductionOp`, `MatmulOp`, `LinearOp`) and the host ops a lowering emits
(`ForLoop`, `HirAliasSelect`, `Allocate`, stream ops, `Communication`,
`P2PCommunication`, coalescing and `Wait`).
The builders that check operands and infer an op's output are in
`builders.py` (and `shape_ops.py`, `broadcast_ops.py`); the walks over the
axes ops iterate together (`IdGraph`, `ExtentClasses`) are in
`axis_graph.py`. Both import this module; it imports neither.
Every node is plain data compared by identity. Names are small integers drawn
from the owning container's counters at creation, so a dump is the same on
every run and every rank; nothing prints an address.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import sys
from typing import Any, Callable, Iterator, Sequence

import torch

from hostir import backends
from hostir.errors import DefinitionError, DefinitionIndexError, DefinitionTypeError
from hostir.kinds import BinaryKind, ReductionKind, UnaryKind


class ParallelType(enum.Enum):
    """How the iterations of one axis are spread."""

    serial = "S"
    stream = "StreamIdx"
    mesh_x = "deviceIdx.x"
    mesh_y = "deviceIdx.y"

    @property
    def is_device(self) -> bool:
        return self in (ParallelType.mesh_x, ParallelType.mesh_y)


DEVICE_PARALLEL_TYPES = (ParallelType.mesh_x, ParallelType.mesh_y)


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




# ---------------------------------------------------------------- domains


# Set by hostir.communicator when it is imported: the conversion of a mesh
# to torch's, which may make the process groups.
_torch_mesh: Any = None


def loaded_class(module: str, name: str) -> type | None:
    """Class `name` of `module` if the program imported that module, else
    None; never imports it. A module that another thread is still importing
    may not have bound the class yet: no instance of it can exist then, and
    None is the answer (never the half-made module's AttributeError)."""
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def _is_torch_mesh(value) -> bool:
    # Only a program that imported torch's device_mesh can hold one.
    cls = loaded_class("torch.distributed.device_mesh", "DeviceMesh")
    return cls is not None and isinstance(value, cls)


class DeviceMesh:
    """The ranks a tensor lives on. A 1-D mesh is a list of ranks; an n-D
    mesh (a nested list or an n-D tensor) is accepted too, and `mesh_x` then
    shards along its last dimension (each row of that dimension is one
    team), `mesh_y` along the one before it (each column is one team).
    A mesh is a value: two meshes with the same shape and ranks are equal.
    A torch `DeviceMesh` is accepted wherever a mesh is, with its shape and
    ranks (`DeviceMesh.from_torch`, `to_torch` convert explicitly)."""

    __slots__ = ("shape", "devices")

    def __init__(self, devices: object) -> None:
        if isinstance(devices, DeviceMesh):
            self.shape, self.devices = devices.shape, devices.devices
            return
        if _is_torch_mesh(devices):
            devices = devices.mesh
        if isinstance(devices, range):
            devices = list(devices)
        if isinstance(devices, (list, tuple)) and not devices:
            raise DefinitionError("a DeviceMesh needs at least one rank")
        try:
            t = torch.as_tensor(devices)
        except (TypeError, ValueError, RuntimeError) as e:
            raise DefinitionTypeError(f"DeviceMesh takes a list, range or tensor of ranks, got {devices!r}") from e
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype is torch.bool:
            raise DefinitionTypeError(f"DeviceMesh ranks must be integers, got {t.dtype}")
        if t.numel() == 0:
            raise DefinitionError("a DeviceMesh needs at least one rank")
        if t.dim() == 0:
            t = t.reshape(1)
        flat = [int(r) for r in t.flatten().tolist()]
        bad = [r for r in flat if r < 0]
        if bad:
            raise DefinitionError(f"DeviceMesh ranks must be >= 0, got {bad}")
        dup = sorted({r for r in flat if flat.count(r) > 1})
        if dup:
            raise DefinitionError(f"DeviceMesh ranks must be unique; {dup} appear more than once")
        self.shape = tuple(t.shape)
        self.devices = tuple(flat)

    @classmethod
    def from_torch(cls, mesh: object) -> DeviceMesh:
        """The hostir mesh of a `torch.distributed.device_mesh.DeviceMesh`:
        the same shape and ranks."""
        if not _is_torch_mesh(mesh):
            raise DefinitionTypeError(f"DeviceMesh.from_torch takes a torch DeviceMesh, got {type(mesh).__name__}")
        return cls(mesh.mesh)

    def to_torch(self, device_type: str | None = None) -> Any:
        """A `torch.distributed.device_mesh.DeviceMesh` of the same shape
        and ranks, on `device_type` ("cuda" where CUDA is available, else
        "cpu"). Every rank calls it (torch may create process groups);
        torch.distributed is initialized first if it is not yet (by the
        process layer, `hostir.communicator`, which gives the IR this
        conversion: the IR itself knows no processes)."""
        if _torch_mesh is None:
            raise DefinitionError("DeviceMesh.to_torch needs hostir.communicator: import hostir")
        return _torch_mesh(self.devices, self.shape, device_type)

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def x_size(self) -> int:
        """How many ways `mesh_x` shards: the size of the last dimension."""
        return self.shape[-1]

    def __contains__(self, rank: int) -> bool:
        return rank in self.devices

    def teams(self) -> list[tuple[int, ...]]:
        """The rows along the last dimension: the teams of a `mesh_x` axis."""
        n = self.x_size
        return [self.devices[i : i + n] for i in range(0, self.size, n)]

    def team_of(self, rank: int) -> tuple[int, ...]:
        for team in self.teams():
            if rank in team:
                return team
        raise DefinitionError(f"rank {rank} is not in {self}")

    def _dim(self, parallel_type: ParallelType) -> int:
        if parallel_type is ParallelType.mesh_x:
            return self.ndim - 1
        if parallel_type is ParallelType.mesh_y:
            if self.ndim < 2:
                raise DefinitionError(f"{self!r} is 1-D: mesh_y needs a mesh of at least 2 dimensions")
            return self.ndim - 2
        raise DefinitionError(f"{parallel_type} does not shard across a mesh")

    def size_along(self, parallel_type: ParallelType) -> int:
        """How many ways `parallel_type` (mesh_x or mesh_y) shards."""
        return self.shape[self._dim(parallel_type)]

    def teams_along(self, parallel_type: ParallelType) -> list[tuple[int, ...]]:
        """The teams of a `parallel_type` axis: the slices of the mesh along
        its dimension (rows for mesh_x, columns for mesh_y)."""
        dim = self._dim(parallel_type)
        grid = torch.tensor(self.devices).reshape(self.shape).movedim(dim, -1)
        return [tuple(row) for row in grid.reshape(-1, self.shape[dim]).tolist()]

    def index_along(self, rank: int, parallel_type: ParallelType) -> int:
        """Which shard of a `parallel_type` axis `rank` holds."""
        for team in self.teams_along(parallel_type):
            if rank in team:
                return team.index(rank)
        raise DefinitionError(f"rank {rank} is not in {self}")

    def __eq__(self, other) -> bool:
        return isinstance(other, DeviceMesh) and (self.shape, self.devices) == (other.shape, other.devices)

    def __hash__(self) -> int:
        return hash((self.shape, self.devices))

    def __repr__(self) -> str:
        if self.ndim == 1:
            return "DeviceMesh{" + " ".join(map(str, self.devices)) + "}"
        rows = " ".join("{" + " ".join(map(str, row)) + "}" for row in self.teams())
        return "DeviceMesh{" + rows + "}"


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
            raise DefinitionError(
                f"{self!r} has been split; parallelize one of the axes it was split into"
            )
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
            raise DefinitionError(f"mark_static: T{self.name} is not a fusion input; only inputs' sizes are known at a call")
        n = self.logical_ndim
        if dims is None:
            dims = range(n)
        elif isinstance(dims, int):
            dims = [dims]
        chosen = set()
        for d in dims:
            if isinstance(d, bool) or not isinstance(d, int) or not -n <= d < n:
                raise DefinitionIndexError(f"mark_static: axis {d!r} is out of range for T{self.name}, which has {n} axes")
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
            raise DefinitionError(
                f"axis {axis} of T{self.name}: extent {d.extent.value} not divisible by {factor}"
            )
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


# ---------------------------------------------------------------- exprs


# What an op does when it runs, as the profiler groups ops.
EFFECTS = ("compute", "communication", "copy", "sync", "host")


class Expr:
    """Base of all ops. Subclasses are dataclasses that declare their
    operand fields (`INPUTS`), their result fields (`OUTPUTS`), the fields
    whose tensors they bind when they run (`BINDS`; their outputs unless
    said otherwise) and their effect (`EFFECT`, one of `EFFECTS`)."""

    INPUTS: tuple[str, ...] = ()
    OUTPUTS: tuple[str, ...] = ()
    BINDS: tuple[str, ...] | None = None
    EFFECT: str = "host"

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
        # The dump line lives in printer.py, which depends on this module;
        # a repr names the op and its fields' values.
        parts = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            text = f"[{len(v)} exprs]" if f.name == "body" else repr(v)
            parts.append(f"{f.name}={text}")
        return f"{type(self).__name__}({', '.join(parts)})"


def _op(cls):
    return dataclasses.dataclass(eq=False, repr=False)(cls)


def as_kind(kinds: type, kind, what: str):
    """`kind` (a name or a member) as a member of the enum `kinds`."""
    try:
        return kinds(kind)
    except ValueError:
        raise DefinitionError(f"unknown {what} {kind!r}; expected one of {[k.value for k in kinds]}") from None


def _zip_axes(out: TensorView, inp: TensorView) -> Iterator[tuple[IterDomain, IterDomain]]:
    # An operand's reduction axes (left by the op that made it) take no part.
    yield from zip(out.logical_runtime(), inp.logical_runtime())


@_op
class Set(Expr):
    """`out = in` as a copy. Writes into `out` if its buffer is bound,
    otherwise binds a fresh copy. Runs on the current stream."""

    EFFECT = "copy"

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

    EFFECT = "compute"

    out: TensorView
    kind: BinaryKind
    lhs: TensorView | Scalar
    rhs: TensorView | Scalar
    INPUTS = ("lhs", "rhs")
    OUTPUTS = ("out",)

    def __post_init__(self):
        self.kind = as_kind(BinaryKind, self.kind, "binary op")

    def id_pairs(self):
        # Aligned from the last axis, as torch broadcasts.
        out = self.out.logical_runtime()
        for operand in (self.lhs, self.rhs):
            if isinstance(operand, TensorView):
                yield from zip(reversed(out), reversed(operand.logical_runtime()))


@_op
class UnaryOp(Expr):
    """Elementwise `out = <kind>(input)`; `cast` converts to `out`'s dtype,
    `gelu` is the exact (erf) form. Writes into `out` if bound (the `out=`
    variant). Runs on the current stream."""

    EFFECT = "compute"

    out: TensorView
    kind: UnaryKind
    input: TensorView
    INPUTS = ("input",)
    OUTPUTS = ("out",)

    def __post_init__(self):
        self.kind = as_kind(UnaryKind, self.kind, "unary op")

    def id_pairs(self):
        return _zip_axes(self.out, self.input)


@_op
class ReductionOp(Expr):
    """`out = <kind>(input)` over the axes of `out` that are reductions
    (sum, max, min). Writes into `out` if bound."""

    EFFECT = "compute"

    out: TensorView
    kind: ReductionKind
    input: TensorView
    INPUTS = ("input",)
    OUTPUTS = ("out",)

    def __post_init__(self):
        self.kind = as_kind(ReductionKind, self.kind, "reduction")

    def id_pairs(self):
        return zip(self.out.logical, self.input.logical_runtime())


@_op
class MatmulOp(Expr):
    """`out = a @ b` with torch.matmul's semantics (batch axes broadcast,
    aligned from the right); `out`'s last axis is the reduction over K.
    Writes into `out` if bound."""

    EFFECT = "compute"

    out: TensorView
    a: TensorView
    b: TensorView
    # An outermost sharded axis of `out` (on K's mesh dimension) holding
    # each rank's partial sums over its piece of a sharded K: a `sum` over it
    # then reduces across ranks. None for a whole result.
    partial: IterDomain | None = None
    INPUTS = ("a", "b")
    OUTPUTS = ("out",)

    def id_pairs(self):
        a, b = self.a.logical_runtime(), self.b.logical_runtime()
        out = [d for d in self.out.logical if d is not self.partial]
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

    EFFECT = "compute"

    out: TensorView
    input: TensorView
    weight: TensorView
    bias: TensorView | None = None
    # As in MatmulOp: the axis of `out` holding partial sums, or None.
    # A partial result leaves the bias to the op that completes the sum.
    partial: IterDomain | None = None
    INPUTS = ("input", "weight", "bias")
    OUTPUTS = ("out",)

    def id_pairs(self):
        x, w = self.input.logical_runtime(), self.weight.logical_runtime()
        out = [d for d in self.out.logical if d is not self.partial]
        k = out[-1]
        # A weight [*W, N, K] gives out [*lead, *W, N]: W and N pair with
        # the weight's (and the bias's) leading axes.
        lead, wn = out[: len(x) - 1], out[len(x) - 1 : -1]
        yield from zip(lead, x[:-1])
        yield from zip(wn, w[:-1])
        if self.bias is not None:
            yield from zip(reversed(wn), reversed(self.bias.logical_runtime()))
        yield k, x[-1]
        yield k, w[-1]


@_op
class PermuteOp(Expr):
    """`out = input.permute(dims)`: out axis i is input axis dims[i]. Binds
    a view of `input` (no copy, as torch's permute), or writes into `out`
    if it is bound. Runs on the current stream."""

    out: TensorView
    input: TensorView
    dims: tuple
    INPUTS = ("input",)
    OUTPUTS = ("out",)

    def id_pairs(self):
        ins = self.input.logical_runtime()
        for o, d in zip(self.out.logical_runtime(), self.dims):
            yield o, ins[d]


@_op
class ReshapeOp(Expr):
    """`out = input.reshape(shape)` (`shape` as given, -1 for the one
    inferred size): a view of `input` where torch's reshape makes one (its
    strides allow), else a copy; writes into `out` if it is bound. No axis
    of `out` iterates with one of `input`, so it cannot be stream-parallel."""

    out: TensorView
    input: TensorView
    shape: tuple
    INPUTS = ("input",)
    OUTPUTS = ("out",)


@_op
class SliceOp(Expr):
    """`out = input[start:stop:step, ...]` as a copy, one (start, stop,
    step) per axis (stop None: to the end). An axis taken whole iterates
    with its input axis; a cut one does not. Writes into `out` if bound."""

    out: TensorView
    input: TensorView
    ranges: tuple
    INPUTS = ("input",)
    OUTPUTS = ("out",)

    def id_pairs(self):
        for o, i, r in zip(self.out.logical_runtime(), self.input.logical_runtime(), self.ranges):
            if r == (0, None, 1):
                yield o, i


@_op
class SelectOp(Expr):
    """`out = input.select(dim, index)` as a copy: the axis `dim` goes
    away; `index` is a constant or a scalar input, negative counting from
    the end. Writes into `out` if bound."""

    out: TensorView
    input: TensorView
    dim: int
    index: Scalar
    INPUTS = ("input", "index")
    OUTPUTS = ("out",)

    def id_pairs(self):
        ins = [d for k, d in enumerate(self.input.logical_runtime()) if k != self.dim]
        return zip(self.out.logical_runtime(), ins)


@_op
class ExpandOp(Expr):
    """`out = input` broadcast to `like`'s shape, as a copy: the axes of
    `out` at `dims` are new (size-1 axes of `input` inserted there, then
    expanded), the others iterate with `input`'s. `like` gives the sizes
    only (the backward of a sum). Writes into `out` if bound."""

    EFFECT = "compute"

    out: TensorView
    input: TensorView
    like: TensorView
    dims: tuple
    INPUTS = ("input", "like")
    OUTPUTS = ("out",)

    def id_pairs(self):
        out = self.out.logical_runtime()
        kept = [d for k, d in enumerate(out) if k not in self.dims]
        yield from zip(kept, self.input.logical_runtime())
        yield from zip(out, self.like.logical_runtime())


@_op
class InsertOp(Expr):
    """`out = zeros like `like`, with `input` written where a slice
    (`ranges`, as SliceOp's) or a select (`dim`, `index`) of it reads`: the
    backward of slice and select. `like` gives the sizes only. Writes into
    `out` if bound."""

    EFFECT = "compute"

    out: TensorView
    input: TensorView
    like: TensorView
    ranges: tuple | None = None
    dim: int | None = None
    index: Scalar | None = None
    INPUTS = ("input", "like", "index")
    OUTPUTS = ("out",)

    def id_pairs(self):
        yield from zip(self.out.logical_runtime(), self.like.logical_runtime())


@_op
class BroadcastInDimOp(Expr):
    """`out` = `input` with input axis i as out axis `dims[i]`, out's other
    axes new, and size-1 input axes grown to out's sizes (nvFuser's
    broadcast_in_dim, torch's unsqueeze then expand), as a copy. Writes
    into `out` if bound. Runs on the current stream."""

    out: TensorView
    input: TensorView
    dims: tuple
    INPUTS = ("input",)
    OUTPUTS = ("out",)
    EFFECT = "compute"

    def id_pairs(self):
        out = self.out.logical_runtime()
        return zip([out[d] for d in self.dims], self.input.logical_runtime())


SHAPE_OPS = (PermuteOp, ReshapeOp, SliceOp, SelectOp)
FUSION_OPS = (Set, UnaryOp, BinaryOp, ReductionOp, MatmulOp, LinearOp, BroadcastInDimOp, ExpandOp, InsertOp) + SHAPE_OPS
COMPUTE_OPS = (UnaryOp, BinaryOp, ReductionOp, MatmulOp, LinearOp, BroadcastInDimOp, ExpandOp, InsertOp)


@_op
class GetCurrentStream(Expr):
    """Binds `stream` to the caller's current stream, on every run. Does not
    block and enqueues nothing."""

    EFFECT = "sync"

    stream: Stream


@_op
class SetCurrentStream(Expr):
    """Makes `stream` the current stream: the ops after it enqueue there."""

    EFFECT = "sync"

    stream: Stream
    INPUTS = ("stream",)


@_op
class Synchronize(Expr):
    """The current stream waits for all work enqueued so far on `stream`.
    The host does not block."""

    EFFECT = "sync"

    stream: Stream
    INPUTS = ("stream",)


@_op
class ForLoop(Expr):
    """Runs `body` once for each `index` in [start, stop), rebinding `index`.
    Values first defined in the body are unbound at each iteration, so each
    iteration writes fresh buffers or the slices its selects bind.
    `iter_domain` names the axis a stream loop walks (for the dump);
    `schedule` names the decomposition a loop over a device axis follows.
    `stream_parallel` marks a stream loop whose worker streams are not yet
    written: the loop-building passes set it, `assign_streams` writes the
    caller/worker pattern and clears it (it changes nothing at run time).
    `caller_ops`: how many ops right before such a loop compute the rank's
    own chunk on the caller's stream while the workers run the iterations
    (a ring's local shard), so the workers need not wait for them."""

    index: Scalar
    start: Scalar
    stop: Scalar
    body: list
    iter_domain: IterDomain | None = None
    schedule: str | None = None
    stream_parallel: bool = False
    caller_ops: int = 0
    INPUTS = ("start", "stop")


@_op
class IfThenElse(Expr):
    """Runs `then_body` if `predicate` (a scalar: a bool, or an integer
    that is true when non-zero) holds when it is reached, else `else_body`.
    What a branch defines is visible only inside it."""

    predicate: Scalar
    then_body: list
    else_body: list = dataclasses.field(default_factory=list)
    INPUTS = ("predicate",)


def compare(op: str, lhs: Scalar | int | bool, rhs: Scalar | int | bool) -> ScalarExpr:
    """The predicate `( lhs <op> rhs )`, op one of ==, !=, <, <=, >, >=,
    && and ||, for an `IfThenElse`."""
    if op not in ScalarExpr.COMPARISONS:
        raise DefinitionError(f"compare: unknown op {op!r}; expected one of {list(ScalarExpr.COMPARISONS)}")
    return ScalarExpr(op, _scalar(lhs), _scalar(rhs))


def bodies(e: Expr) -> list[list]:
    """The nested scopes of a control-flow expr (a loop's body, a
    conditional's two branches), none for any other."""
    if isinstance(e, ForLoop):
        return [e.body]
    if isinstance(e, IfThenElse):
        return [e.then_body, e.else_body]
    return []


@_op
class HirAliasSelect(Expr):
    """Binds `out` to a view of `input` at `index` along `axis`: no copy, so
    an op writing `out` writes `input`'s buffer. When `axis` is a dim of its
    own this is `input.select(dim, index)` (index 0 on a broadcast axis);
    when it is the outer piece of a split axis it is the index-th chunk of
    ceilDiv(size, axis extent) rows of that dim (the last chunks may be
    shorter or empty). `out` is bound, not defined, so it is not an SSA
    output. Does not block and enqueues nothing."""

    BINDS = ("out",)

    out: TensorView
    input: TensorView
    axis: IterDomain
    index: Scalar
    INPUTS = ("input", "index")

    def __post_init__(self):
        if self.axis not in self.input.domain:
            raise DefinitionError(f"select axis {self.axis} is not an axis of {self.input}")


@_op
class HirAliasChunk(Expr):
    """Binds `out` to the view of piece `index` of `parts` equal pieces of
    `input` along `axis` (a narrow, no copy): an op writing `out` writes
    `input`'s buffer. The axis's extent must divide by `parts`."""

    BINDS = ("out",)

    out: TensorView
    input: TensorView
    axis: IterDomain
    index: Scalar
    parts: int
    INPUTS = ("input", "index")

    def __post_init__(self):
        if self.axis not in self.input.domain:
            raise DefinitionError(f"chunk axis {self.axis} is not an axis of {self.input}")


@_op
class Allocate(Expr):
    """Binds `buffer` to a new tensor of its runtime shape on the program's
    device, unless it is bound already (a caller's preallocated output).
    The allocation is stream-ordered on the current stream."""

    BINDS = ("buffer",)

    buffer: TensorView
    memory_type: MemoryType = MemoryType.global_
    zero_init: bool = False


@_op
class Deallocate(Expr):
    """Drops the program's reference to `buffer`'s tensor."""

    buffer: TensorView
    INPUTS = ("buffer",)


def nbytes(t) -> int:
    """The bytes of tensor `t` (0 for None: a rank that holds none)."""
    return 0 if t is None else t.numel() * t.element_size()


# The traffic of one collective on rank `me`: (bytes sent to each peer,
# bytes received from each peer), from this rank's input and output
# tensors (None where it holds none) and the root of this post.


def _all_pairs_traffic(size):
    def traffic(e, me, root, input, out):
        each = size(e, input, out)
        others = [p for p in e.team if p != me]
        return {p: each for p in others}, {p: each for p in others}

    return traffic


def _broadcast_traffic(e, me, root, input, out):
    size = nbytes(out) if out is not None else nbytes(input)
    if me == root:
        return {p: size for p in e.team if p != me}, {}
    return {}, {root: size}


def _gather_traffic(e, me, root, input, out):
    senders = [p for p in e.team if p in e.input.mesh]
    if me == root:
        piece = nbytes(out) // max(len(senders), 1)
        return {}, {p: piece for p in senders if p != me}
    return ({root: nbytes(input)} if input is not None else {}), {}


def _scatter_traffic(e, me, root, input, out):
    receivers = [p for p in e.team if p in e.out.mesh]
    if me == root:
        piece = nbytes(input) // max(len(e.out.mesh.devices), 1)
        return {p: piece for p in receivers if p != me}, {}
    return {}, ({root: nbytes(out)} if out is not None else {})


def _reduce_traffic(e, me, root, input, out):
    if me == root:
        return {}, {p: nbytes(out) for p in e.team if p != me}
    # Sent in the output's dtype (a sum of integers is int64).
    piece = input.numel() * e.out.dtype.itemsize
    for d in e.local_reduce:
        piece //= max(input.shape[d], 1)
    return {root: piece}, {}


def _send_recv_traffic(e, me, root, input, out):
    sender, receiver = root, (e.team[-1] if len(e.team) > 1 else e.team[0])
    if sender == receiver:
        return {}, {}
    if me == sender:
        return {receiver: nbytes(input)}, {}
    if me == receiver:
        return {}, {sender: nbytes(out)}
    return {}, {}


def _all_to_all_traffic(e, me, root, input, out):
    # Each rank keeps its own piece and trades one with every other.
    n = max(len(e.team), 1)
    others = [p for p in e.team if p != me]
    return {p: nbytes(input) // n for p in others}, {p: nbytes(out) // n for p in others}


class CommunicationType(enum.Enum):
    """A collective's kind, with every fact the package reads about it:
    `has_root` (it names a root), `reduces` (it takes a `red_op`), who
    sends (`sends`: "all" the team, or the "root") and who receives
    (`receives`: "all", the "root", or "others" than the root), `in_cpp`
    (the C++ core has a path for it; the opcode order is the declaration
    order), and `traffic(e, me, root, input, out)`: the bytes rank `me`
    sends to and receives from each peer, as dicts."""

    has_root: bool
    reduces: bool
    sends: str
    receives: str
    in_cpp: bool
    traffic: Callable

    def __new__(cls, value: str, has_root: bool, reduces: bool, sends: str, receives: str, in_cpp: bool, traffic):
        member = object.__new__(cls)
        member._value_ = value
        member.has_root = has_root
        member.reduces = reduces
        member.sends = sends
        member.receives = receives
        member.in_cpp = in_cpp
        member.traffic = traffic
        return member

    Allgather = "Allgather", False, False, "all", "all", True, _all_pairs_traffic(lambda e, i, o: nbytes(i))
    Allreduce = "Allreduce", False, True, "all", "all", True, _all_pairs_traffic(lambda e, i, o: nbytes(o))
    ReduceScatter = "ReduceScatter", False, True, "all", "all", True, _all_pairs_traffic(lambda e, i, o: nbytes(o))
    Broadcast = "Broadcast", True, False, "root", "others", True, _broadcast_traffic
    Gather = "Gather", True, False, "all", "root", True, _gather_traffic
    Scatter = "Scatter", True, False, "root", "all", True, _scatter_traffic
    Reduce = "Reduce", True, True, "all", "root", True, _reduce_traffic
    SendRecv = "SendRecv", True, False, "root", "others", True, _send_recv_traffic
    AllToAll = "AllToAll", False, False, "all", "all", True, _all_to_all_traffic


# The backends' spellings are declared in `hostir.backends`.
BACKENDS = backends.NAMES
backend_name = backends.backend_name


@_op
class Communication(Expr):
    """A collective over `team` (global ranks) that moves `input` (this
    rank's local piece) into `out`. Posting it does not block the host: it
    is enqueued after the work already on the current stream (NCCL) or runs
    in the background (gloo), and its `Wait` makes the current stream (NCCL)
    or the host (gloo) wait for it. A rank outside `team` does nothing; a
    rank outside `input`'s mesh sends nothing of its own, one outside
    `out`'s mesh keeps nothing. `root` is a global rank (Broadcast, Gather, Scatter,
    Reduce; the sender of SendRecv), or a Scalar evaluated at each post (a
    decomposition's loop names the root by its index); `red_op` is sum, max
    or min."""

    EFFECT = "communication"

    name: int
    type: CommunicationType
    out: TensorView
    input: TensorView
    team: tuple
    root: int | Scalar | None = None
    red_op: ReductionKind | None = None
    backend: str = "NCCL"
    # Dims of the input's local tensor that each rank reduces itself first
    # (the rows of a split mesh_x axis that a rank holds).
    local_reduce: tuple = ()
    # The mesh dimension the team slices: mesh_x (rows) or mesh_y (columns).
    parallel_type: ParallelType = ParallelType.mesh_x
    # The schedule that chose this collective, when a decomposition did (dump only).
    schedule: str | None = None
    INPUTS = ("input",)
    OUTPUTS = ("out",)

    def __post_init__(self):
        self.backend = backend_name(self.backend)
        if self.red_op is not None:
            self.red_op = as_kind(ReductionKind, self.red_op, "reduction")
        if not self.team:
            raise DefinitionError("a Communication needs a non-empty team")
        if self.type.has_root != (self.root is not None):
            raise DefinitionError(f"root {self.root} is not expected by {self.type.value}")
        if isinstance(self.root, int) and self.root not in self.team:
            raise DefinitionError(f"root {self.root} is not in team {self.team}")
        if self.type.reduces != (self.red_op is not None):
            raise DefinitionError(f"{self.type.value} {'needs' if self.type.reduces else 'takes no'} red_op")

    def id_pairs(self):
        if self.out.ndim == self.input.ndim:
            yield from zip(self.out.loop_axes(), self.input.loop_axes())


@_op
class P2PCommunication(Expr):
    """Sends `buffer` to, or receives it from, the global rank `peer` (a
    scalar evaluated at run time). Posting does not block the host; a `Wait`
    on it, or on the `EndCoalescing` of its group, completes it. The buffer
    must be bound before (a recv writes into it). A one-sided transport
    (cuda) pushes a send into the peer's buffer at `into`: the view of the
    receiver's window that the peer's recv binds, named on the sender."""

    EFFECT = "communication"

    name: int
    type: str  # "send" or "recv"
    buffer: TensorView
    peer: Scalar
    backend: str = "NCCL"
    into: TensorView | None = None
    INPUTS = ("buffer", "peer", "into")

    def __post_init__(self):
        self.backend = backend_name(self.backend)
        if self.type not in ("send", "recv"):
            raise DefinitionError(f"P2PCommunication type must be send or recv, got {self.type!r}")


@_op
class StartCoalescing(Expr):
    """P2P communications posted until the matching `EndCoalescing` are
    grouped and posted together (one NCCL group), so a send and a recv
    between two ranks cannot deadlock each other."""

    EFFECT = "communication"


@_op
class EndCoalescing(Expr):
    """Posts the group opened by `StartCoalescing`; a `Wait` on it completes
    every communication of the group."""

    EFFECT = "communication"

    name: int


@_op
class Transfer(Expr):
    """Copies `input` into `out` between host and device memory (`H2D` or
    `D2H`), posted like a communication: it starts after the work already
    on the current stream, runs on a copy stream of its direction (the copy
    engine; on the CPU it is a plain copy), and its `Wait` completes it. The
    host does not block at the post. `out` must be bound (an `Allocate`).
    `schedule` says where the hoisting pass put it (dump only).

    With `stream="current"` it is no post: the copy runs on the current
    stream, in order with the ops around it, and has no `Wait` (a D2H one
    blocks the host until the bytes are there). `hoist_transfers` makes a
    transfer so where nothing would run between it and its `Wait`: a copy
    stream would then only add a cross-stream wait."""

    EFFECT = "copy"

    name: int
    direction: str  # "H2D" or "D2H"
    out: TensorView
    input: TensorView
    schedule: str | None = None
    stream: str = "copy"  # "copy" (posted, completed by a Wait) or "current"
    INPUTS = ("input",)
    OUTPUTS = ("out",)
    DIRECTIONS = ("H2D", "D2H")
    STREAMS = ("copy", "current")

    def __post_init__(self):
        if self.direction not in self.DIRECTIONS:
            raise DefinitionError(f"a Transfer goes H2D or D2H, got {self.direction!r}")
        if self.stream not in self.STREAMS:
            raise DefinitionError(f"a Transfer runs on the 'copy' or the 'current' stream, got {self.stream!r}")

    @property
    def posted(self) -> bool:
        """Whether it runs on a copy stream and a `Wait` completes it."""
        return self.stream == "copy"

    def id_pairs(self):
        return zip(self.out.loop_axes(), self.input.loop_axes())


@_op
class Wait(Expr):
    """Completes `communication` (a communication or a transfer): on NCCL
    and for a host-to-device transfer the current stream waits for it (the
    host does not block); on gloo and for a device-to-host transfer the host
    waits, with the communicator's timeout for gloo. After it, the output
    buffer holds the result."""

    EFFECT = "sync"

    communication: Expr

    def __post_init__(self):
        if not isinstance(self.communication, (Communication, P2PCommunication, EndCoalescing, Transfer)):
            raise DefinitionTypeError(
                f"Wait takes a Communication, a P2PCommunication, an EndCoalescing or a Transfer, "
                f"got {type(self.communication).__name__}"
            )
        if isinstance(self.communication, Transfer) and not self.communication.posted:
            raise DefinitionError(
                f"Transfer {self.communication.name} runs on the current stream: it has no Wait"
            )


COMMUNICATION_OPS = (Communication, P2PCommunication, StartCoalescing, EndCoalescing, Wait)
# Ops posted now and completed by a later `Wait`, which a hoisting pass may move.
POSTED_OPS = (Communication, P2PCommunication, Transfer)


def needs_communicator(e: Expr) -> bool:
    """Whether running `e` needs a communicator (a transfer does not)."""
    if isinstance(e, Wait):
        return not isinstance(e.communication, Transfer)
    return isinstance(e, COMMUNICATION_OPS)


def walk(exprs: Sequence[Expr]) -> Iterator[Expr]:
    """Every expr, loop bodies included, in program order."""
    for e in exprs:
        yield e
        for body in bodies(e):
            yield from walk(body)


def defined_tvs(e: Expr) -> list[TensorView]:
    """TensorViews an expr binds when it runs (its declared `BINDS`)."""
    fields = e.OUTPUTS if e.BINDS is None else e.BINDS
    return [v for v in (getattr(e, f) for f in fields) if isinstance(v, TensorView)]


def read_vals(e: Expr) -> list:
    """Values an expr reads (not those it defines)."""
    return [v for v in e.inputs() if isinstance(v, (TensorView, Scalar, Stream))]


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

    def new_tensor(
        self, shape: Sequence[int], dtype: torch.dtype, memory_type: MemoryType = MemoryType.global_
    ) -> TensorView:
        """A fusion input. -1 is a symbolic extent, 1 a broadcast axis, any
        other size a fixed extent that inputs must have. `memory_type` is
        `global_` (device memory) or `host`."""
        domain = []
        for i, size in enumerate(shape):
            if isinstance(size, bool) or not isinstance(size, int) or size < -1:
                raise DefinitionError(f"shape[{i}] = {size!r}: use -1 for a symbolic extent or a size >= 0")
            if size == -1:
                domain.append(IterDomain(self, Scalar.symbolic(self)))
            elif size == 1:
                domain.append(IterDomain(self, Scalar.constant(1), IterType.broadcast))
            else:
                domain.append(IterDomain(self, Scalar.constant(size)))
        tv = TensorView(self, domain, dtype, memory_type)
        self.inputs.append(tv)
        self.bump_version()
        return tv

    def new_scalar(self, dtype: torch.dtype) -> InputScalar:
        """A scalar input of the fusion, passed to `execute` as a number."""
        s = InputScalar(self, dtype)
        self.inputs.append(s)
        self.bump_version()
        return s

    def tensor_inputs(self) -> list[TensorView]:
        return [v for v in self.inputs if isinstance(v, TensorView)]

    def add_output(self, tv: TensorView) -> None:
        self._check_owned(tv, "add_output")
        if tv in self.inputs:
            raise DefinitionError(f"T{tv.name} is a fusion input; to return it, add_output(fd.ops.set(T{tv.name}))")
        if tv in self.outputs:
            raise DefinitionError(f"T{tv.name} is already an output")
        self.outputs.append(tv)
        self.bump_version()

    def add_expr(self, e: Expr) -> None:
        self.exprs.append(e)
        self.bump_version()

    def _check_owned(self, v, what: str) -> None:
        if not isinstance(v, TensorView):
            raise DefinitionTypeError(f"{what} takes a TensorView, got {type(v).__name__}")
        if v.owner is not self:
            raise DefinitionError(f"{what}: T{v.name} belongs to another fusion")


def in_host_memory(tv) -> bool:
    return isinstance(tv, TensorView) and tv.memory_type is MemoryType.host
