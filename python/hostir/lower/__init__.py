"""Lowering: from a fusion to a verified host program.

`build_host_program` turns the fusion into a container; then each pass of
`PIPELINE`, in order, takes the container and returns the next one. After
every pass the program is verified and, with `HOSTIR_DUMP=host_ir_lowering`,
printed under the pass's name. An error names the pass that raised it.
"""

from __future__ import annotations

from hostir import ir
from hostir.container import HostIrContainer
from hostir.lower.build_host_program import build_host_program
from hostir.lower.parallelize_streams import parallelize_streams
from hostir.options import Dumper

PIPELINE = [
    parallelize_streams,
]


class LoweringError(ValueError):
    """A fusion that cannot be lowered; the message names the pass."""


def run_passes(container: HostIrContainer, passes=None, dumper: Dumper | None = None) -> HostIrContainer:
    for p in PIPELINE if passes is None else passes:
        container = _run_one(p, container, dumper)
    return container


def lower(fusion: ir.Fusion, dumper: Dumper | None = None) -> HostIrContainer:
    """The host program of `fusion`."""
    container = _run_one(build_host_program, fusion, dumper)
    return run_passes(container, dumper=dumper)


def _run_one(p, program, dumper: Dumper | None):
    name = p.__name__
    try:
        result = p(program)
    except (ValueError, TypeError, IndexError) as e:
        raise LoweringError(f"lowering pass {name}: {e}") from e
    try:
        result.verify()
    except ValueError as e:
        raise LoweringError(f"the host program is invalid after pass {name}: {e}") from e
    if dumper is not None:
        dumper.emit("host_ir_lowering", f"Host program after pass {name}:", str(result))
    return result
