"""Lowering: from a fusion to a verified host program.

`build_host_program` turns the fusion into a container; then each pass of
`PIPELINE`, in order, takes the container and returns the next one. The
result is the same on every rank; its dump's hash (`digest`) is what ranks
compare to agree on the program. Then, for a multi-device program lowered
for one rank, the passes of `RANK_PIPELINE` keep what that rank runs.
`lower(fusion, options)` does it all and returns a `LoweredProgram`: the
program, which holds ops and values only, beside what running it needs
(digest, teams, the axes cut into chunks, the rank it was pruned for) and
the `LoweringOptions` it was lowered with. The passes take their options
as arguments (`pass_options`). After
every pass the program is verified and, with `HOSTIR_DUMP=host_ir_lowering`,
printed under the pass's name; with `HOSTIR_CHECK=races` it is checked for
stream races (`hostir.races`), and a race fails the lowering. An error
names the pass that raised it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from hostir import ir, printer
from hostir.analysis.races import check_races
from hostir.container import HostIrContainer

from hostir.lower.assign_streams import assign_streams
from hostir.lower.build_host_program import build_host_program
from hostir.lower.decompose_device_axis import decompose_device_axis
from hostir.lower.insert_deallocations import insert_deallocations
from hostir.lower.insert_reshardings import insert_reshardings
from hostir.lower.hoist_transfers import Hoisting, hoist_transfers
from hostir.lower.lower_communications import lower_communications
from hostir.lower.lower_transfers import lower_transfers
from hostir.lower.parallelize_streams import parallelize_streams
from hostir.lower.propagate_shardings import propagate_shardings
from hostir.lower.propagate_stream_axes import propagate_stream_axes
from hostir.lower.prune_for_rank import prune_for_rank
from hostir.lower.record import ChunkedAxis, LoweredProgram, LoweringError, LoweringOptions
from hostir.options import Dumper, check_options

__all__ = [
    "PIPELINE",
    "RANK_PIPELINE",
    "ChunkedAxis",
    "LoweredProgram",
    "LoweringError",
    "LoweringOptions",
    "check_communication_dtypes",
    "lower",
    "pass_names",
    "pass_options",
    "run_passes",
]

PIPELINE = [
    propagate_stream_axes,
    propagate_shardings,
    insert_reshardings,
    decompose_device_axis,
    parallelize_streams,
    assign_streams,
    lower_communications,
    lower_transfers,
    insert_deallocations,
    hoist_transfers,
]
RANK_PIPELINE = [
    prune_for_rank,
]


def run_passes(
    container: HostIrContainer, passes=None, dumper: Dumper | None = None, options: dict | None = None
) -> HostIrContainer:
    """Run `passes` (default `PIPELINE`); `options` maps a pass to the
    keyword arguments it takes."""
    for p in PIPELINE if passes is None else passes:
        container = _run_one(p, container, dumper, (options or {}).get(p, {}))
    return container


def lower(
    fusion: ir.Fusion,
    options: LoweringOptions | None = None,
    dumper: Dumper | None = None,
    until: str | None = None,
    **fields: Any,
) -> LoweredProgram:
    """The lowered program of `fusion`: a `LoweredProgram`, whose `program`
    is the host program and whose other fields say what running it needs
    (`digest`, `teams`, `chunking`, `rank`) and what it was lowered with
    (`options`).

    `options` is a `LoweringOptions`; its fields may be given as keywords
    instead (`lower(fusion, rank=0, backend="gloo")` is
    `lower(fusion, LoweringOptions(rank=0, backend="gloo"))`), not both.
    With `options.rank`, a multi-device program is pruned to the part that
    rank runs. With `until` (a name of `pass_names()`), the program is the
    one right after that pass (a rank pass is skipped, as in a full
    lowering, where there is no rank or no mesh); `digest` and `teams` are
    empty unless `until` comes after `PIPELINE`. `dumper` prints the
    program after each pass (`HOSTIR_DUMP=host_ir_lowering`)."""
    if options is None:
        options = LoweringOptions(**fields)
    elif fields:
        raise LoweringError(f"pass LoweringOptions or its fields as keywords, not both (got {', '.join(fields)})")
    if until is not None and until not in pass_names():
        raise LoweringError(f"unknown pass {until!r}; passes in order: {', '.join(pass_names())}")
    container = _run_one(build_host_program, fusion, dumper, {"host_inputs": options.host_inputs})
    if until == build_host_program.__name__:
        return LoweredProgram(container, options)
    # `decompose_device_axis` adds the axes it cuts into chunks.
    chunking: list[ChunkedAxis] = []
    by_pass = pass_options(
        options.rank,
        options.backend,
        options.resharding,
        options.schedule,
        options.stream_form,
        options.hoisting,
        chunking,
    )
    for p in PIPELINE:
        container = _run_one(p, container, dumper, by_pass.get(p))
        if p.__name__ == until:
            return LoweredProgram(container, options, chunking=tuple(chunking))
    check_communication_dtypes(container)
    digest = hashlib.sha256(str(container).encode()).hexdigest()
    teams = tuple(container.teams())
    rank = None
    if options.rank is not None and container.meshes():
        rank = options.rank
        for p in RANK_PIPELINE:
            container = _run_one(p, container, dumper, by_pass.get(p), rank)
            if p.__name__ == until:
                break
    return LoweredProgram(container, options, digest, teams, tuple(chunking), rank)


# The dtypes each backend's collectives cannot move (gloo's and NCCL's own
# type tables); the copy-engine transport moves bytes and takes any.
_UNSUPPORTED_DTYPES = {
    "gloo": (torch.int16, torch.uint16, torch.uint32, torch.uint64),
    "NCCL": (torch.int16, torch.uint16),
}


def check_communication_dtypes(container: HostIrContainer) -> None:
    """Refuse, when the program is lowered (on every rank alike, before any
    communication), a communication of a dtype its backend cannot move,
    rather than leave it to fail inside the backend."""
    for e in container.walk():
        if isinstance(e, ir.Communication):
            tensors = [e.input, e.out]
        elif isinstance(e, ir.P2PCommunication):
            tensors = [e.buffer]
        else:
            continue
        refused = _UNSUPPORTED_DTYPES.get(e.backend, ())
        for tv in tensors:
            if tv.dtype in refused:
                wider = "int32" if tv.dtype in (torch.int16, torch.uint16) else "int64"
                raise LoweringError(
                    f"{e.backend} cannot communicate {str(tv.dtype).removeprefix('torch.')} tensors "
                    f"({printer.format_expr_head(e)}); cast to {wider} before the communication "
                    f"(fd.ops.cast) and back after it"
                )


def pass_options(
    rank: int | None = None,
    backend: str = "NCCL",
    resharding: str = "auto",
    schedule=None,
    stream_form=None,
    hoisting: Hoisting | None = None,
    chunking: list | None = None,
) -> dict:
    """The arguments each pass takes beyond the program, by pass
    (`chunking`: a list `decompose_device_axis` adds the axes it cuts into
    chunks to)."""
    return {
        insert_reshardings: {"mode": resharding},
        assign_streams: {"form": stream_form},
        decompose_device_axis: {"schedule": schedule, "backend": backend, "chunking": chunking},
        lower_communications: {"backend": backend},
        lower_transfers: {"chunks": hoisting.chunks if hoisting is not None else 1},
        hoist_transfers: {"hoisting": hoisting},
        prune_for_rank: {"rank": rank},
    }


def pass_names() -> list[str]:
    """The passes of a lowering, in order: `build_host_program`, then
    `PIPELINE`, then `RANK_PIPELINE`."""
    return [p.__name__ for p in [build_host_program, *PIPELINE, *RANK_PIPELINE]]


def _run_one(p, program, dumper: Dumper | None, options: dict | None = None, rank: int | None = None):
    """Run pass `p` with `options`, then verify its result, dump it and
    check it for races; `rank`: the rank the result is pruned for, if it is."""
    name = p.__name__
    try:
        result = p(program, **(options or {}))
    except (ValueError, TypeError, IndexError) as e:
        raise LoweringError(f"lowering pass {name}: {e}") from e
    try:
        result.verify(rank)
    except ValueError as e:
        raise LoweringError(f"the host program is invalid after pass {name}: {e}") from e
    if dumper is not None:
        dumper.emit("host_ir_lowering", f"Host program after pass {name}:", str(result))
    if "races" in check_options():
        races = check_races(result, rank)
        if races:
            found = "\n".join(str(r) for r in races)
            raise LoweringError(f"pass {name} left {len(races)} stream race(s) in the host program:\n{found}")
    return result
