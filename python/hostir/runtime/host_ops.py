"""The evaluator's handlers of the host ops (`hostir.host_ops`): loops and
conditionals, stream switches and synchronizations, the aliases of slices
and chunks, allocations."""

from __future__ import annotations

import torch

from hostir import ir, layout, printer
from hostir.runtime import transports
from hostir.runtime.frame import BindingError, Frame, ProgramError, impl


@impl(ir.ForLoop)
def _for(frame: Frame, e: ir.ForLoop) -> None:
    start, stop = int(frame.get(e.start)), int(frame.get(e.stop))
    local = frame.evaluator.body_locals[id(e)]
    position = [e.index, start]
    frame.loops.append(position)
    try:
        for i in range(start, stop):
            for tv in local:
                frame.bind(tv, None)
            position[1] = i
            frame.bind(e.index, i)
            frame.run_scope(e.body)
    finally:
        frame.loops.pop()
    # The last iteration's slices and buffers would otherwise keep their
    # sources alive past a Deallocate after the loop.
    for tv in local:
        frame.bind(tv, None)


@impl(ir.IfThenElse)
def _if(frame: Frame, e: ir.IfThenElse) -> None:
    value = frame.get(e.predicate)
    if isinstance(value, torch.Tensor) or not isinstance(value, (bool, int)):
        raise ProgramError(
            f"the predicate {printer.format_scalar(e.predicate)} is {value!r}; an IF takes a bool or an integer"
        )
    frame.run_scope(e.then_body if value else e.else_body)


@impl(ir.GetCurrentStream)
def _get_current_stream(frame: Frame, e: ir.GetCurrentStream) -> None:
    frame.bind(e.stream, frame.streams.current())


@impl(ir.SetCurrentStream)
def _set_current_stream(frame: Frame, e: ir.SetCurrentStream) -> None:
    stream = frame.stream(e.stream)
    frame.streams.set_current(stream)
    if stream is not None and stream not in frame.used_streams:
        frame.used_streams.append(stream)


@impl(ir.Synchronize)
def _synchronize(frame: Frame, e: ir.Synchronize) -> None:
    frame.streams.wait(frame.streams.current(), frame.stream(e.stream))


@impl(ir.HirAliasSelect)
def _select(frame: Frame, e: ir.HirAliasSelect) -> None:
    src = frame.get(e.input)
    dim, kind = frame.evaluator.slices[e.out]
    index = 0 if e.axis.is_broadcast else int(frame.get(e.index))
    if kind == "select":
        frame.bind(e.out, src.select(dim, index))
        return
    start, length = layout.chunk_bounds(src.shape[dim], int(frame.get(e.axis.extent)), index)
    frame.bind(e.out, src.narrow(dim, start, length))


@impl(ir.HirAliasChunk)
def _chunk(frame: Frame, e: ir.HirAliasChunk) -> None:
    src = frame.get(e.input)
    dim = layout.position(e.input, e.axis)
    size = src.shape[dim]
    if size % e.parts:
        raise BindingError(f"axis {dim} of size {size} does not split into {e.parts} equal pieces")
    piece = size // e.parts
    frame.bind(e.out, src.narrow(dim, int(frame.get(e.index)) * piece, piece))


@impl(ir.Allocate)
def _allocate(frame: Frame, e: ir.Allocate) -> None:
    if frame.get(e.buffer, None) is not None or e.buffer in frame.evaluator.local_views:
        return
    shape = frame.local_sizes(e.buffer)
    if e.memory_type is ir.MemoryType.symmetric:
        frame.bind(e.buffer, transports.allocate(frame, e.buffer, shape))
        return
    make = torch.zeros if e.zero_init else torch.empty
    if e.memory_type is ir.MemoryType.host:
        frame.bind(e.buffer, transports.allocate_host(frame, make, shape, e.buffer.dtype))
        return
    frame.bind(e.buffer, make(shape, dtype=e.buffer.dtype, device=frame.device))


@impl(ir.Deallocate)
def _deallocate(frame: Frame, e: ir.Deallocate) -> None:
    if id(e) in frame.evaluator.summed_products.skipped:
        return  # a product its sum's matmul never made
    frame.get(e.buffer)
    frame.bind(e.buffer, None)
