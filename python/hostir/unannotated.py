"""Communications on tensors without sharding annotations, as a hand-built
container may hold them (nvFuser's tests build such containers).

Where a collective moves pieces of a tensor (an Allgather's input, a
ReduceScatter's output) and that tensor has no mesh and no sharded axis,
the pieces are inferred from the communication's type and team: they lie
along the outermost axis, one per team rank in team order, so the whole
tensor's outermost extent is the team's size times the piece's. `check`
(called by `HostIrContainer.verify`) accepts that form where the extents
prove it and refuses, with the reason, every communication whose pieces
cannot be inferred, so that nothing fails once ranks have started
communicating.

    Communication (type=Allgather, team=(0 1), input=T0_g_float[iS0{1}, iS1{4}],
                   output=T1_g_float[iS2{2}, iS3{4}])   pieces: rows of T1
"""

from __future__ import annotations

from hostir import ir, printer
from hostir.errors import HostIrError

# The side of each type whose sharded axis says where the pieces lie.
_PIECES = {
    ir.CommunicationType.Allgather: "input",
    ir.CommunicationType.ReduceScatter: "out",
    ir.CommunicationType.Gather: "input",
    ir.CommunicationType.Scatter: "out",
    ir.CommunicationType.AllToAll: "input",
}
# The types whose pieces can be inferred without annotations.
_INFERRED = (ir.CommunicationType.Allgather, ir.CommunicationType.ReduceScatter)


class UnannotatedCommunicationError(HostIrError, ValueError):
    """A communication whose pieces neither annotations nor its type and
    team determine."""


def inferred(e: ir.Communication) -> bool:
    """Whether `e`'s pieces are inferred (outermost axis, team order)."""
    side = _PIECES.get(e.type)
    if side is None or e.type not in _INFERRED:
        return False
    return e.input.mesh is None and e.out.mesh is None and not (e.input.device_axes() or e.out.device_axes())


def check(e: ir.Communication) -> None:
    side = _PIECES.get(e.type)
    if side is None:
        return
    tv = getattr(e, side)
    if any(d.parallel_type is e.parallel_type for d in tv.device_axes()):
        return
    head = printer.format_expr_head(e)
    if not inferred(e):
        raise UnannotatedCommunicationError(
            f"the {side} of this {e.type.value} has no {e.parallel_type.name} axis, so which piece each "
            f"rank holds is unknown; "
            + (
                f"put both tensors on a mesh and parallelize the sharded axis with {e.parallel_type.name}"
                if e.type not in _INFERRED
                else "leave both tensors without meshes and sharded axes (pieces along the outermost axis), "
                "or annotate both"
            )
            + f":\n{head}"
        )
    piece, whole = (e.input, e.out) if e.type is ir.CommunicationType.Allgather else (e.out, e.input)
    p, w = piece.loop_axes(), whole.loop_axes()
    n = len(e.team)
    why = None
    if len(p) != len(w) or not p:
        why = f"the tensors must have the same number of axes (at least one), got {len(p)} and {len(w)}"
    elif not (p[0].extent.is_constant and w[0].extent.is_constant):
        why = "their outermost extents must be constants to show how the pieces lie"
    elif w[0].extent.value != n * p[0].extent.value:
        why = (
            f"the outermost extent of {printer.format_tv(whole)} must be the team's size {n} times "
            f"that of {printer.format_tv(piece)} ({p[0].extent.value}), got {w[0].extent.value}"
        )
    else:
        for i, (a, b) in enumerate(zip(p[1:], w[1:]), start=1):
            if a.extent.is_constant and b.extent.is_constant and a.extent.value != b.extent.value:
                why = f"axis {i} differs: {a.extent.value} and {b.extent.value}"
                break
    if why is not None:
        raise UnannotatedCommunicationError(
            f"this {e.type.value} has tensors without sharding annotations, so its pieces are taken along "
            f"the outermost axis, one per rank of team {e.team}; {why}:\n{head}"
        )
