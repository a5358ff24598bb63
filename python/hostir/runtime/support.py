"""What the C++ core runs, declared once.

One table: the op classes the flat compiler has an instruction for, the
unary and binary kinds the core has an ATen call for, the communication
types it posts, the backends it has a transport for (the backend table's
`cpp` column, `hostir.backends`), and the program features it has a path for
(`FEATURES`). `flat.unsupported_reasons` reads it to say why a lowered
program runs on the Python evaluator, and the planner reads it to say so
before lowering (`fusion_reasons`, `schedule_reasons`), so that the
schedule is costed for the runner that will run it. Teaching the core a
feature is flipping its entry here (`tests/python/test_cpp_support.py`
holds the table to the flat compiler and to what `hostir._C` binds).
"""

from __future__ import annotations

import dataclasses

import torch

from hostir import backends, ir, printer

__all__ = [
    "BINARY_KINDS",
    "COMMUNICATION_TYPES",
    "FEATURES",
    "OPS",
    "UNARY_KINDS",
    "Features",
    "expr_reasons",
    "fusion_reasons",
    "runs_backend",
    "schedule_reasons",
]

# The op classes the C++ core has an instruction for (`flat._COMPILERS`
# compiles exactly these).
OPS: frozenset[type] = frozenset(
    {
        ir.ForLoop, ir.IfThenElse, ir.GetCurrentStream, ir.SetCurrentStream, ir.Synchronize,
        ir.HirAliasSelect, ir.HirAliasChunk, ir.Allocate, ir.Deallocate, ir.Set, ir.UnaryOp, ir.BinaryOp,
        ir.ReductionOp, ir.MatmulOp, ir.LinearOp, ir.PermuteOp, ir.Transfer, ir.Communication,
        ir.P2PCommunication, ir.StartCoalescing, ir.EndCoalescing, ir.Wait, ir.TopKOp, ir.RouteOp, ir.TakeOp,
        ir.PutAddOp, ir.GroupedMmOp, ir.GroupedOuterOp, ir.SliceOp, ir.CatOp, ir.InsertOp,
    }
)  # fmt: skip

# The unary and binary kinds with an ATen call in csrc/host_ir/compute.cpp;
# none without the extension, which then runs nothing.
try:
    from hostir._C import BINARY_KINDS, UNARY_KINDS
except Exception:  # noqa: BLE001 - any failure to load means "not built"
    UNARY_KINDS = BINARY_KINDS = ()

# The communication types with a C++ opcode, in the core's order.
COMMUNICATION_TYPES: tuple[str, ...] = tuple(t.value for t in ir.CommunicationType if t.in_cpp)


def runs_backend(name: str) -> bool:
    """Whether the C++ core has a transport for backend `name`: the backend
    table's `cpp` column (`hostir.backends`), read where it is declared."""
    return backends.get(name).cpp


@dataclasses.dataclass(frozen=True)
class Features:
    """The program features the C++ core has a path for (True) or not.

    float_scalars: scalar inputs of a floating type.
    bool_scalar_compute: an op computing with a bool scalar input (one
        that only picks a branch is an integer slot).
    chunk_views: a stream loop over the outer piece of a split axis
        (`HirAliasSelect` of kind "chunk").
    posted_d2h: a device-to-host transfer posted on a copy stream.
    into_pushes: a P2P send that pushes into a peer's buffer.
    host_allocations: an `Allocate` in host memory.
    symmetric_allocations: an `Allocate` in symmetric memory.
    meshes_2d: a communication over a 2-D mesh.
    runtime_roots: a communication whose root is chosen at run time.
    runtime_rows: an AllToAll sized at run time (`ir.Set`'s `rows`)."""

    float_scalars: bool = False
    bool_scalar_compute: bool = False
    chunk_views: bool = True
    posted_d2h: bool = False
    into_pushes: bool = True
    host_allocations: bool = False
    symmetric_allocations: bool = True
    meshes_2d: bool = False
    runtime_roots: bool = False
    runtime_rows: bool = True


FEATURES = Features()


def _head(e: ir.Expr) -> str:
    return printer.format_expr_head(e)


def scalar_reasons(inputs: list, exprs) -> dict[str, str]:
    """The reasons a program's scalar inputs give (by kind): a float one,
    or a bool one an op computes with (torch promotes a bool unlike its
    integer)."""
    found: dict[str, str] = {}
    floats = [v for v in inputs if isinstance(v, ir.InputScalar) and v.dtype is torch.float64]
    if floats and not FEATURES.float_scalars:
        listed = ", ".join(printer.format_val(v) for v in floats)
        found["scalars"] = f"it takes scalar inputs ({listed}) of a floating type"
    bools = {v for v in inputs if isinstance(v, ir.InputScalar) and v.dtype is torch.bool}
    if bools and not FEATURES.bool_scalar_compute:
        for e in exprs:
            used = [v for v in e.inputs() if v in bools and not isinstance(e, ir.IfThenElse)]
            if used:
                found["bool scalars"] = (
                    f"it computes with a bool scalar input ({printer.format_val(used[0])}): {_head(e)}"
                )
                break
    return found


def expr_reasons(e: ir.Expr, chunk: bool = False) -> dict[str, str]:
    """The reasons one op gives (by kind) that the C++ core cannot run it;
    `chunk`: it is a `HirAliasSelect` of a split axis's outer piece."""
    found: dict[str, str] = {}
    if chunk and not FEATURES.chunk_views:
        found["chunk"] = f"it walks chunks of a split axis: {_head(e)}"
    if isinstance(e, ir.Transfer) and e.posted and e.direction == "D2H" and not FEATURES.posted_d2h:
        found["transfer"] = (
            f"it posts a device-to-host transfer on a copy stream, which the C++ executor has no "
            f"instruction for: {_head(e)}"
        )
        return found
    if type(e) not in OPS:
        found[f"op {type(e).__name__}"] = f"it has no instruction for {type(e).__name__}"
        return found
    if isinstance(e, ir.UnaryOp) and e.kind.value not in UNARY_KINDS:
        found[f"kind {e.kind}"] = f"it has no instruction for {e.kind}: {_head(e)}"
    if isinstance(e, ir.BinaryOp) and e.kind.value not in BINARY_KINDS:
        found[f"kind {e.kind}"] = f"it has no instruction for {e.kind}: {_head(e)}"
    if isinstance(e, (ir.Communication, ir.P2PCommunication)) and not runs_backend(e.backend):
        found[f"transport {e.backend}"] = f"the {e.backend} transport runs in Python: {_head(e)}"
    if isinstance(e, ir.Communication):
        if e.type.value not in COMMUNICATION_TYPES:
            found[f"type {e.type.value}"] = f"it has no {e.type.value}: {_head(e)}"
        two_d = any((v.mesh is not None and v.mesh.ndim > 1) or len(v.device_axes()) > 1 for v in (e.input, e.out))
        if two_d and not FEATURES.meshes_2d:
            found["2-D"] = f"it communicates over a 2-D mesh: {_head(e)}"
        if not (e.root is None or isinstance(e.root, int)) and not FEATURES.runtime_roots:
            found["root"] = f"its root is chosen at run time: {_head(e)}"
    if isinstance(e, (ir.Communication, ir.Set)) and e.rows is not None and not FEATURES.runtime_rows:
        found["rows"] = f"it exchanges rows counted at run time: {_head(e)}"
    if isinstance(e, ir.P2PCommunication) and getattr(e, "into", None) is not None and not FEATURES.into_pushes:
        found["push"] = f"it pushes into a peer's buffer: {_head(e)}"
    if isinstance(e, ir.Allocate):
        if e.memory_type.word == "symmetric" and not FEATURES.symmetric_allocations:
            found["symmetric"] = f"it allocates symmetric memory: {_head(e)}"
        if e.memory_type is ir.MemoryType.host and not FEATURES.host_allocations:
            found["host"] = f"it allocates host memory: {_head(e)}"
    return found


def fusion_reasons(fusion: ir.Fusion) -> list[str]:
    """Every reason, known from the fusion alone, that the C++ core cannot
    run its programs: its scalar inputs, and each op it has no instruction
    for (an op class or a kind), each kind once with its first op. (What
    the lowering adds depends on the schedule: `schedule_reasons`.)"""
    found = scalar_reasons(fusion.inputs, fusion.exprs)
    for e in fusion.exprs:
        if type(e) not in OPS or isinstance(e, (ir.UnaryOp, ir.BinaryOp)) or getattr(e, "rows", None) is not None:
            for kind, text in expr_reasons(e).items():
                found.setdefault(kind, text)
    return list(found.values())


def schedule_reasons(transport: str | None, chunks: int, weight_pieces: int = 1) -> list[str]:
    """The reasons the C++ core cannot run a program lowered with a ring on
    `transport` (None: none, or the program's backend) cut into `chunks`
    pieces per peer, and weights moved in `weight_pieces` pieces."""
    found: list[str] = []
    if transport is not None:
        declared = backends.get(transport)
        if not declared.cpp:
            found.append(f"the {declared.name} transport runs in Python")
        elif declared.capabilities.one_sided and not FEATURES.into_pushes:
            found.append(f"the {declared.name} transport pushes into a peer's buffer")
        elif declared.capabilities.needs_symmetric_buffers and not FEATURES.symmetric_allocations:
            found.append(f"the {declared.name} transport allocates symmetric memory")
    if max(chunks, weight_pieces) > 1 and not FEATURES.chunk_views:
        found.append("it walks chunks of a split axis")
    return found
