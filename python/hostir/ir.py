"""The IR shared by fusions and host programs.

Its data lives in five modules, each re-exported here, so that the rest of
the package and users name it `ir.X`:

- `mesh.py`: the parallel types of an axis and the `DeviceMesh` a tensor
  lives on;
- `values.py`: the values (`Scalar`, `IterDomain`, `TensorView`,
  `Stream`), iteration and memory types, dtypes, and the text of each value;
- `exprs.py`: the ops' base `Expr` and the fusion ops a user writes (`Set`,
  `UnaryOp`, `BinaryOp`, `ReductionOp`, `MatmulOp`, `LinearOp`, the shape
  ops and broadcasts);
- `host_ops.py`: the host ops a lowering emits (`ForLoop`, `IfThenElse`,
  `HirAliasSelect`, `Allocate`, stream ops);
- `communications.py`: `Communication` and its `CommunicationType`,
  `P2PCommunication`, coalescing, `Transfer` and `Wait`.

This module adds the `Fusion` a user's program is held in and the walks
over a list of ops. The builders that check operands and infer an op's
output are in `builders.py` (and `shape_ops.py`, `broadcast_ops.py`); the
walks over the axes ops iterate together (`IdGraph`, `ExtentClasses`) are
in `axis_graph.py`. Both import the IR; it imports neither.
Every node is plain data compared by identity. Names are small integers drawn
from the owning container's counters at creation, so a dump is the same on
every run and every rank; nothing prints an address.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from hostir.communications import (
    BACKENDS,
    COMMUNICATION_OPS,
    POSTED_OPS,
    Communication,
    CommunicationType,
    EndCoalescing,
    P2PCommunication,
    StartCoalescing,
    Transfer,
    Wait,
    backend_name,
    nbytes,
    needs_communicator,
)
from hostir.errors import DefinitionError, DefinitionTypeError
from hostir.exprs import (
    COMPUTE_OPS,
    EFFECTS,
    FUSION_OPS,
    GROUPED_OPS,
    INDEX_OPS,
    SHAPE_OPS,
    BinaryOp,
    BroadcastInDimOp,
    CatOp,
    ExpandOp,
    Expr,
    InsertOp,
    LinearOp,
    MatmulOp,
    PermuteOp,
    PutAddOp,
    ReductionOp,
    ReshapeOp,
    RouteOp,
    SelectOp,
    Set,
    SliceOp,
    GroupedMmOp,
    GroupedOuterOp,
    TakeOp,
    TopKOp,
    UnaryOp,
    as_kind,
)
from hostir.host_ops import (
    Allocate,
    Deallocate,
    ForLoop,
    GetCurrentStream,
    HirAliasChunk,
    HirAliasSelect,
    IfThenElse,
    SetCurrentStream,
    Synchronize,
    bodies,
    compare,
)
from hostir.mesh import DEVICE_PARALLEL_TYPES, DeviceMesh, ParallelType, loaded_class
from hostir.values import (
    SUPPORTED_DTYPES,
    InputScalar,
    IrContainer,
    IterDomain,
    IterType,
    MemoryType,
    Scalar,
    ScalarExpr,
    Stream,
    TensorView,
    dtype_name,
    format_id,
    format_scalar,
    format_stream,
    format_tv,
    same_scalar,
)

__all__ = [
    "BACKENDS",
    "COMMUNICATION_OPS",
    "COMPUTE_OPS",
    "DEVICE_PARALLEL_TYPES",
    "EFFECTS",
    "FUSION_OPS",
    "GROUPED_OPS",
    "INDEX_OPS",
    "POSTED_OPS",
    "SHAPE_OPS",
    "SUPPORTED_DTYPES",
    "Allocate",
    "BinaryOp",
    "BroadcastInDimOp",
    "CatOp",
    "Communication",
    "CommunicationType",
    "Deallocate",
    "DefinitionError",
    "DeviceMesh",
    "EndCoalescing",
    "ExpandOp",
    "Expr",
    "ForLoop",
    "Fusion",
    "GetCurrentStream",
    "HirAliasChunk",
    "HirAliasSelect",
    "IfThenElse",
    "InputScalar",
    "InsertOp",
    "IrContainer",
    "IterDomain",
    "IterType",
    "LinearOp",
    "MatmulOp",
    "MemoryType",
    "P2PCommunication",
    "ParallelType",
    "PermuteOp",
    "PutAddOp",
    "ReductionOp",
    "ReshapeOp",
    "RouteOp",
    "Scalar",
    "ScalarExpr",
    "SelectOp",
    "Set",
    "SetCurrentStream",
    "SliceOp",
    "StartCoalescing",
    "Stream",
    "Synchronize",
    "GroupedMmOp",
    "GroupedOuterOp",
    "TakeOp",
    "TensorView",
    "TopKOp",
    "Transfer",
    "UnaryOp",
    "Wait",
    "as_kind",
    "backend_name",
    "bodies",
    "compare",
    "defined_tvs",
    "dtype_name",
    "format_id",
    "format_scalar",
    "format_stream",
    "format_tv",
    "in_host_memory",
    "loaded_class",
    "nbytes",
    "needs_communicator",
    "read_vals",
    "same_scalar",
    "walk",
]


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
