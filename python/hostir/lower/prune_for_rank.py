"""Keep only what this rank takes part in (each rank runs its own program).

Precondition: communications are lowered.
Postcondition: a communication whose team excludes the rank is gone, with
its `Wait` (in one the rank keeps, the evaluator reads the input only if
the input's mesh holds the rank and writes the output likewise). Any other op, and any
`Allocate`, whose tensors all live on meshes without the rank is gone. A
loop left with nothing but stream switches is gone. Programs without
meshes are unchanged.

    T2 = Set( T0 )   (T0, T2 on DeviceMesh{0})        on rank 1:
    Communication 3 (type=Allgather, team=(2 3), ...)   ->   (both gone)
"""

from __future__ import annotations

from hostir import ir
from hostir.container import HostIrContainer
from hostir.errors import DefinitionError

_STREAM_OPS = (ir.GetCurrentStream, ir.SetCurrentStream, ir.Synchronize)


def prune_for_rank(container: HostIrContainer, rank: int | None = None) -> HostIrContainer:
    """The part of `container` that `rank` runs."""
    if rank is None:
        raise DefinitionError("prune_for_rank needs a rank")
    result = container.derive()
    for e in _prune(container.exprs, rank, kept=set()):
        result.push_back(e)
    return result


def _on_rank(tv, rank: int) -> bool:
    return not isinstance(tv, ir.TensorView) or tv.held_by(rank)


def _prune(exprs, rank: int, kept: set) -> list[ir.Expr]:
    """`kept` holds the ids of kept communications and transfers, for their
    Waits."""
    new: list[ir.Expr] = []
    for e in exprs:
        if isinstance(e, ir.ForLoop):
            body = _prune(e.body, rank, kept)
            had_work = any(not isinstance(b, _STREAM_OPS) for b in e.body)
            if not had_work or any(not isinstance(b, _STREAM_OPS) for b in body):
                new.append(e.replace(body=body))
            continue
        if isinstance(e, ir.Communication):
            if rank not in e.team:
                continue
            kept.add(id(e))
            new.append(e)
            continue
        if isinstance(e, ir.Wait):
            if isinstance(e.communication, (ir.Communication, ir.Transfer)):
                if id(e.communication) not in kept:
                    continue
                new.append(e)
                continue
            new.append(e)
            continue
        if isinstance(e, ir.Transfer):
            # Kept where the rank holds what it moves, with its Wait.
            if _on_rank(e.input, rank) or _on_rank(e.out, rank):
                kept.add(id(e))
                new.append(e)
            continue
        if isinstance(e, ir.Allocate):
            if _on_rank(e.buffer, rank):
                new.append(e)
            continue
        tvs = [v for v in e.inputs() + e.outputs() if isinstance(v, ir.TensorView)]
        if not tvs or any(_on_rank(v, rank) for v in tvs):
            new.append(e)
    return new

