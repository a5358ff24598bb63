"""HostIrEvaluator: the reference interpreter of host programs.

It walks a `HostIrContainer` and runs each op with torch, on the CPU with
null streams or on CUDA with real ones. Handlers are found in a table keyed by
op class (`@impl`), and touch values only through `get` and `bind`, which
resolve aliases — the one place that does. An op whose output buffer is
already bound (a caller's preallocated output, an allocation, a slice) writes
into it with torch's `out=` variants; otherwise its result is bound fresh.
A failing op is reported with its dump line and the loop indices around it.
Communications post through `torch.distributed` on the process groups of a
`Communicator` (NCCL or gloo) and complete at their `Wait`; a timeout or a
lost peer keeps its type (`CommunicatorTimeout`, `PeerLostError`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from hostir import ir, layout, printer
from hostir.communicator import CommunicatorTimeout, PeerLostError
from hostir.container import AliasError, HostIrContainer
from hostir.streams import NullStreams

_HANDLERS: dict[type, Callable[[HostIrEvaluator, Any], None]] = {}


def impl(op_class: type):
    """Register the evaluator's handler of `op_class`."""

    def wrap(fn):
        _HANDLERS[op_class] = fn
        return fn

    return wrap


class HostIrRuntimeError(RuntimeError):
    """An op failed while the program ran; the message quotes the op."""


class UnboundValueError(LookupError):
    pass


_REQUIRED = object()


class HostIrEvaluator:
    """Runs one host program, any number of times.

    `streams` is a `CudaStreams` for a CUDA device or `NullStreams` (the
    default) for the CPU; `device` is where `Allocate` puts new buffers.
    """

    def __init__(self, container: HostIrContainer, streams=None, device="cpu", communicator=None, dumper=None):
        for tv in container.inputs:
            if container.aliases.is_alias(tv):
                raise AliasError(f"Inputs cannot be aliased: T{tv.name} is an alias")
        missing = {type(e).__name__ for e in container.walk() if type(e) not in _HANDLERS}
        if missing:
            raise NotImplementedError(f"the evaluator has no handler for {', '.join(sorted(missing))}")
        self.container = container
        self.streams = streams if streams is not None else NullStreams()
        self.device = torch.device(device)
        self.communicator = communicator
        self.dumper = dumper
        needs = [e for e in container.walk() if isinstance(e, ir.COMMUNICATION_OPS)]
        if needs and communicator is None:
            raise ValueError(
                f"A communicator must be provided: the program has communications, such as\n"
                f"{printer.format_expr_head(needs[0])}"
            )
        self._rank_scalar = container.named_scalars().get("rank")
        self._alias = container.aliases.resolved()
        self._number_of_streams = container.named_scalars().get("numberOfStreams")
        self._body_locals = self._find_body_locals(container)
        # For each slice bound by a HirAliasSelect: the dim of its source it
        # cuts and whether it selects one index or a chunk of rows.
        self._slices = {
            e.out: (layout.position(e.input, e.axis), layout.select_kind(e.input, e.axis))
            for e in container.walk()
            if isinstance(e, ir.HirAliasSelect)
        }
        # Where a select removed a dim: matmul and linear put it back as size 1.
        self._slice_dim = {out: dim for out, (dim, kind) in self._slices.items() if kind == "select"}
        self._values: dict = {}
        self._loops: list[list] = []
        self._used_streams: list = []
        # Posted communications until their Wait: expr -> _Posted.
        self._works: dict = {}
        self._coalescing: list | None = None
        self.ops_executed = 0

    # -- the one entry point
    def run(self, bindings: Mapping[Any, Any], number_of_streams: int = 4) -> list:
        """Bind `bindings` (inputs, and outputs to write into), run the
        program, and return one value per container output. The caller's
        current stream is current again at the end and has waited for every
        stream the program used."""
        if number_of_streams < 1:
            raise ValueError(f"number_of_streams must be at least 1, got {number_of_streams}")
        self._values = {}
        self._loops = []
        self._used_streams = []
        self._works = {}
        self._coalescing = None
        if self._number_of_streams is not None:
            self._values[self._number_of_streams] = number_of_streams
        if self._rank_scalar is not None:
            self._values[self._rank_scalar] = self.communicator.rank
        for val, value in bindings.items():
            if isinstance(val, ir.TensorView):
                self._bind_extents(val, value)
            self.bind(val, value)
        caller = self.streams.current()
        try:
            self._run_scope(self.container.exprs)
            return [self._output(tv) for tv in self.container.outputs]
        finally:
            for stream in self._used_streams:
                self.streams.wait(caller, stream)
            self.streams.set_current(caller)
            self._values = {}
            self._works = {}

    # -- the two accessors
    def get(self, val, default=_REQUIRED):
        """The value bound to `val` (through the alias map); a constant or
        derived scalar is computed."""
        value = self._values.get(self._alias.get(val, val))
        if value is not None:
            return value
        if isinstance(val, ir.ScalarExpr):
            try:
                return ir.ScalarExpr.OPS[val.op](self.get(val.lhs), self.get(val.rhs))
            except UnboundValueError:
                if default is not _REQUIRED:
                    return default
                raise
        if isinstance(val, ir.Scalar) and val.value is not None:
            return val.value
        if default is not _REQUIRED:
            return default
        raise UnboundValueError(f"value {printer.format_val(val)} is not bound")

    def bind(self, val, value) -> None:
        """Bind `val` (through the alias map); binding None unbinds it."""
        self._values[self._alias.get(val, val)] = value

    def _output(self, tv: ir.TensorView):
        if not self.container.holds(tv):
            return None
        value = self.get(tv, None)
        if value is None:
            raise HostIrRuntimeError(f"output {printer.format_tv(tv)} is not bound at the end of the program")
        return value

    # -- helpers for handlers
    def stream(self, s: ir.Stream):
        if s.index is not None:
            return self.streams.get(int(self.get(s.index)))
        captured = self.get(s, None)
        return captured if captured is not None else self.streams.get(s)

    def full_rank(self, tv: ir.TensorView, value: torch.Tensor) -> torch.Tensor:
        """`value` with the axis a select removed put back as size 1."""
        dim = self._slice_dim.get(tv)
        return value if dim is None else value.unsqueeze(dim)

    def _bind_extents(self, tv: ir.TensorView, value) -> None:
        """Bind the symbolic logical extents of `tv` from its runtime-shaped
        tensor, or check them against those already bound."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{printer.format_tv(tv)} must be bound to a torch.Tensor, got {type(value).__name__}")
        runtime = layout.dims(tv)
        if value.dim() != len(runtime):
            raise ValueError(
                f"{printer.format_tv(tv)} has {len(runtime)} dims but its tensor has shape {list(value.shape)}"
            )
        for i, (dim, size) in enumerate(zip(runtime, value.shape)):
            first = dim[0]
            if first.is_device_parallel:
                if size != 1:
                    raise ValueError(
                        f"axis {i} of {printer.format_tv(tv)} is sharded ({printer.format_id(first)}): "
                        f"each rank holds size 1 of it, got {size}"
                    )
                if first.parent is None:
                    self._bind_size(tv, i, first.extent, tv.mesh.x_size)
                continue
            axis = layout.logical_axis(first)
            self._bind_size(tv, i, axis.extent, layout.global_extent(axis, size))

    def _bind_size(self, tv: ir.TensorView, i: int, extent: ir.Scalar, size: int) -> None:
        known = self.get(extent, None)
        if known is None:
            if isinstance(extent, ir.ScalarExpr):
                raise ValueError(f"cannot infer {printer.format_scalar(extent)} from a size")
            self.bind(extent, size)
        elif known != size:
            raise ValueError(
                f"axis {i} of {printer.format_tv(tv)} is {size} but its extent "
                f"{printer.format_scalar(extent)} is {known}"
            )

    def full_sizes(self, tv: ir.TensorView) -> list[int]:
        """The runtime sizes of `tv` across all ranks (mesh_x axes whole):
        those of its bound tensor (a chunk may be shorter than its extent
        says), else from its extents."""
        value = self.get(tv, None)
        if isinstance(value, torch.Tensor):
            return layout.full_from_local(tv, list(value.shape), self.get)
        return layout.full_shape(tv, self.get)

    def local_sizes(self, tv: ir.TensorView) -> list[int]:
        """This rank's runtime sizes of `tv` (1 on a mesh_x axis)."""
        value = self.get(tv, None)
        if isinstance(value, torch.Tensor):
            return list(value.shape)
        return layout.local_shape(tv, self.get)

    def _run_scope(self, exprs) -> None:
        for e in exprs:
            try:
                _HANDLERS[type(e)](self, e)
            except HostIrRuntimeError:
                raise
            except (CommunicatorTimeout, PeerLostError) as err:
                # A lost peer or a timeout keeps its type, so callers can
                # catch it; the message says where the program was.
                raise type(err)(f"{err}\nWhile executing:\n{self._where(e)}") from err
            except Exception as err:
                raise HostIrRuntimeError(
                    f"{type(err).__name__}: {err}\nWhile executing:\n{self._where(e)}"
                ) from err
            self.ops_executed += 1

    def _where(self, e) -> str:
        loops = "".join(f"\n  in loop {printer.format_scalar(i)} = {v}" for i, v in self._loops)
        return printer.format_expr_head(e) + loops

    def _find_body_locals(self, container: HostIrContainer) -> dict[int, list]:
        """For each loop, the buffers first defined in its body (unbound at
        every iteration so that each writes fresh ones); program inputs and
        outputs excepted, since the caller may bind those."""
        resolve = container.aliases.resolve
        keep = {resolve(t) for t in container.inputs + container.outputs}
        found: dict[int, list] = {}
        for e in container.walk():
            if isinstance(e, ir.ForLoop):
                local = {resolve(t) for inner in ir.walk(e.body) for t in ir.defined_tvs(inner)}
                found[id(e)] = list(local - keep)
        return found


# ---------------------------------------------------------------- host ops


@impl(ir.ForLoop)
def _for(ev: HostIrEvaluator, e: ir.ForLoop) -> None:
    start, stop = int(ev.get(e.start)), int(ev.get(e.stop))
    local = ev._body_locals[id(e)]
    frame = [e.index, start]
    ev._loops.append(frame)
    try:
        for i in range(start, stop):
            for tv in local:
                ev.bind(tv, None)
            frame[1] = i
            ev.bind(e.index, i)
            ev._run_scope(e.body)
    finally:
        ev._loops.pop()
    # The last iteration's slices and buffers would otherwise keep their
    # sources alive past a Deallocate after the loop.
    for tv in local:
        ev.bind(tv, None)


@impl(ir.GetCurrentStream)
def _get_current_stream(ev: HostIrEvaluator, e: ir.GetCurrentStream) -> None:
    ev.bind(e.stream, ev.streams.current())


@impl(ir.SetCurrentStream)
def _set_current_stream(ev: HostIrEvaluator, e: ir.SetCurrentStream) -> None:
    stream = ev.stream(e.stream)
    ev.streams.set_current(stream)
    if stream is not None and stream not in ev._used_streams:
        ev._used_streams.append(stream)


@impl(ir.Synchronize)
def _synchronize(ev: HostIrEvaluator, e: ir.Synchronize) -> None:
    ev.streams.wait(ev.streams.current(), ev.stream(e.stream))


@impl(ir.HirAliasSelect)
def _select(ev: HostIrEvaluator, e: ir.HirAliasSelect) -> None:
    src = ev.get(e.input)
    dim, kind = ev._slices[e.out]
    index = 0 if e.axis.is_broadcast else int(ev.get(e.index))
    if kind == "select":
        ev.bind(e.out, src.select(dim, index))
        return
    start, length = layout.chunk_bounds(src.shape[dim], int(ev.get(e.axis.extent)), index)
    ev.bind(e.out, src.narrow(dim, start, length))


@impl(ir.Allocate)
def _allocate(ev: HostIrEvaluator, e: ir.Allocate) -> None:
    if ev.get(e.buffer, None) is not None:
        return
    shape = ev.local_sizes(e.buffer)
    make = torch.zeros if e.zero_init else torch.empty
    ev.bind(e.buffer, make(shape, dtype=e.buffer.dtype, device=ev.device))


@impl(ir.Deallocate)
def _deallocate(ev: HostIrEvaluator, e: ir.Deallocate) -> None:
    ev.get(e.buffer)
    ev.bind(e.buffer, None)


# ---------------------------------------------------------------- compute ops


@impl(ir.Set)
def _set(ev: HostIrEvaluator, e: ir.Set) -> None:
    src = ev.get(e.input)
    out = ev.get(e.out, None)
    if out is None:
        ev.bind(e.out, src.clone(memory_format=torch.contiguous_format))
    else:
        out.copy_(src)


_BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}


@impl(ir.BinaryOp)
def _binary(ev: HostIrEvaluator, e: ir.BinaryOp) -> None:
    fn = _BINARY[e.kind]
    lhs, rhs = ev.get(e.lhs), ev.get(e.rhs)
    if not isinstance(lhs, torch.Tensor):
        # torch takes a number only on the right; a 0-d tensor of the
        # number's default dtype promotes the same way.
        lhs = torch.tensor(lhs)
    out = ev.get(e.out, None)
    if out is None:
        ev.bind(e.out, fn(lhs, rhs))
    else:
        fn(lhs, rhs, out=out)


@impl(ir.ReductionOp)
def _reduction(ev: HostIrEvaluator, e: ir.ReductionOp) -> None:
    src = ev.get(e.input)
    dims = layout.reduced_dims(e.out)
    out = ev.get(e.out, None)
    extra = {"out": out} if out is not None else {}
    if e.kind == "sum":
        result = torch.sum(src, dims, dtype=e.out.dtype, **extra)
    elif e.kind == "max":
        result = torch.amax(src, dims, **extra)
    else:
        result = torch.amin(src, dims, **extra)
    if out is None:
        ev.bind(e.out, result)


def _full_rank_out(ev: HostIrEvaluator, e) -> tuple[torch.Tensor | None, Callable]:
    """The bound output at full rank (or None) and how to bind a fresh one."""
    out = ev.get(e.out, None)
    dim = ev._slice_dim.get(e.out)

    def bind_fresh(result: torch.Tensor) -> None:
        ev.bind(e.out, result if dim is None else result.squeeze(dim))

    return (None if out is None else ev.full_rank(e.out, out)), bind_fresh


@impl(ir.MatmulOp)
def _matmul(ev: HostIrEvaluator, e: ir.MatmulOp) -> None:
    a = ev.full_rank(e.a, ev.get(e.a))
    b = ev.full_rank(e.b, ev.get(e.b))
    out, bind_fresh = _full_rank_out(ev, e)
    if out is None:
        bind_fresh(torch.matmul(a, b))
    else:
        torch.matmul(a, b, out=out)


@impl(ir.LinearOp)
def _linear(ev: HostIrEvaluator, e: ir.LinearOp) -> None:
    x = ev.full_rank(e.input, ev.get(e.input))
    w = ev.full_rank(e.weight, ev.get(e.weight))
    bias = None if e.bias is None else ev.full_rank(e.bias, ev.get(e.bias))
    out, bind_fresh = _full_rank_out(ev, e)
    if out is None:
        bind_fresh(torch.nn.functional.linear(x, w, bias))
    else:
        torch.ops.aten.linear.out(x, w, bias, out=out)


def _copy_out(ev: HostIrEvaluator, e, result: torch.Tensor, source: torch.Tensor) -> None:
    """Write `result` (full rank) into the bound output, or bind a copy of
    it that shares no memory with `source`."""
    out, bind_fresh = _full_rank_out(ev, e)
    if out is not None:
        out.copy_(result)
        return
    if result.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        result = result.clone(memory_format=torch.contiguous_format)
    bind_fresh(result)


@impl(ir.PermuteOp)
def _permute(ev: HostIrEvaluator, e: ir.PermuteOp) -> None:
    src = ev.full_rank(e.input, ev.get(e.input))
    _copy_out(ev, e, src.permute(e.dims), src)


@impl(ir.ReshapeOp)
def _reshape(ev: HostIrEvaluator, e: ir.ReshapeOp) -> None:
    src = ev.get(e.input)
    try:
        result = src.reshape(e.shape)
    except RuntimeError as err:
        raise ValueError(f"cannot reshape T{e.input.name} of shape {list(src.shape)} to {list(e.shape)}") from err
    _copy_out(ev, e, result, src)


@impl(ir.SliceOp)
def _slice(ev: HostIrEvaluator, e: ir.SliceOp) -> None:
    src = ev.full_rank(e.input, ev.get(e.input))
    index = []
    for k, ((start, stop, step), size) in enumerate(zip(e.ranges, src.shape)):
        if start > size or (stop is not None and stop > size):
            raise ValueError(
                f"axis {k} of T{e.input.name} has size {size}; the slice [{start}:{stop}] is out of range"
            )
        index.append(slice(start, stop, step))
    _copy_out(ev, e, src[tuple(index)], src)


@impl(ir.SelectOp)
def _select_op(ev: HostIrEvaluator, e: ir.SelectOp) -> None:
    src = ev.full_rank(e.input, ev.get(e.input))
    index, size = int(ev.get(e.index)), src.shape[e.dim]
    if not -size <= index < size:
        raise IndexError(f"index {index} is out of range for axis {e.dim} of T{e.input.name} (size {size})")
    _copy_out(ev, e, src.select(e.dim, index), src)


# ---------------------------------------------------------------- communications

_RED_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# torch 2.13 renamed the tensor forms of all-gather and reduce-scatter.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass
class _Posted:
    """A posted communication: its works, and what to do after they finish
    (copy a staging buffer into a non-contiguous or reshaped output)."""

    works: list
    after: Callable[[], None] | None = None


class _NoWork:
    def wait(self, *args) -> bool:
        return True


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    # Never hand a strided view to a collective: gloo would read or write
    # the wrong memory.
    return t if t.is_contiguous() else t.contiguous()


def _staged(out: torch.Tensor, shape) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """A contiguous buffer of `shape` that a collective may write, and what
    copies it into `out` afterwards (nothing if it is `out` itself)."""
    if out.is_contiguous():
        return out.view(shape), None
    staging = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    return staging.view(shape), lambda: out.copy_(staging)


def _mesh_axis(tv: ir.TensorView) -> int:
    (axis,) = tv.device_axes()
    return layout.position(tv, axis)


def _outermost(shape, axis: int) -> bool:
    return all(s == 1 for s in shape[:axis])


def _post_allgather(ev, e, group) -> _Posted:
    src = _contiguous(ev.get(e.input))
    out = ev.get(e.out)
    full = ev.full_sizes(e.input)
    a = _mesh_axis(e.input)
    n = len(e.team)
    order = ev.communicator.group_order(e.team)
    if _outermost(full, a) and order == tuple(e.team):
        buf, after = _staged(out, [-1])
        return _Posted([_all_gather(buf, src.reshape(-1), group=group, async_op=True)], after)
    # Gather into [n, *local] in the group's order, then put each rank's
    # piece at its position in the team, on the sharded axis.
    staging = torch.empty([n] + list(src.shape), dtype=src.dtype, device=src.device)
    by_position = [order.index(r) for r in e.team]

    def after():
        moved = staging[by_position].squeeze(a + 1).movedim(0, a)
        out.copy_(moved.reshape(out.shape))

    return _Posted([_all_gather(staging.view(-1), src.reshape(-1), group=group, async_op=True)], after)


def _reduced_input(ev, e) -> torch.Tensor:
    """This rank's input with the rows it holds of the reduced axes reduced."""
    src = ev.get(e.input)
    if not e.local_reduce:
        return src
    dims = list(e.local_reduce)
    if e.red_op == "sum":
        return torch.sum(src, dims, keepdim=True)
    return (torch.amax if e.red_op == "max" else torch.amin)(src, dims, keepdim=True)


def _post_allreduce(ev, e, group) -> _Posted:
    src = _reduced_input(ev, e)
    out = ev.get(e.out)
    buf, after = _staged(out, out.shape)
    buf.copy_(src.reshape(out.shape))
    return _Posted([dist.all_reduce(buf, op=_RED_OPS[e.red_op], group=group, async_op=True)], after)


def _post_reduce_scatter(ev, e, group) -> _Posted:
    src = _reduced_input(ev, e)
    out = ev.get(e.out)
    full = ev.full_sizes(e.out)
    b = _mesh_axis(e.out)
    whole = src.reshape(full)
    if not _outermost(full, b):
        whole = whole.movedim(b, 0)
    order = ev.communicator.group_order(e.team)
    if order != tuple(e.team):
        # Group rank j receives chunk j: the chunk of team position of order[j].
        whole = whole.reshape(len(e.team), -1)[[e.team.index(r) for r in order]]
    whole = _contiguous(whole)
    buf, after = _staged(out, [-1])
    work = _reduce_scatter(buf, whole.reshape(-1), op=_RED_OPS[e.red_op], group=group, async_op=True)
    return _Posted([work], after)


def _holds(ev, tv: ir.TensorView) -> bool:
    return tv.mesh is None or ev.communicator.rank in tv.mesh


def _post_broadcast(ev, e, group) -> _Posted:
    rank = ev.communicator.rank
    out = ev.get(e.out) if _holds(ev, e.out) else None
    if rank == e.root:
        src = ev.get(e.input)
        if out is None:
            return _Posted([dist.broadcast(_contiguous(src), src=e.root, group=group, async_op=True)])
        out.copy_(src.reshape(out.shape))
    buf, after = _staged(out, out.shape)
    return _Posted([dist.broadcast(buf, src=e.root, group=group, async_op=True)], after)


def _post_gather(ev, e, group) -> _Posted:
    rank = ev.communicator.rank
    if _holds(ev, e.input):
        src = _contiguous(ev.get(e.input))
    else:
        # The root is outside the sender mesh: it sends a dummy piece.
        src = torch.empty(ev.local_sizes(e.input), dtype=e.input.dtype, device=ev.device)
    if rank != e.root:
        return _Posted([dist.gather(src, None, dst=e.root, group=group, async_op=True)])
    out = ev.get(e.out)
    pieces = [torch.empty_like(src) for _ in e.team]
    a = _mesh_axis(e.input)
    senders = [r for r in e.team if r in e.input.mesh]

    order = ev.communicator.group_order(e.team)

    def after():
        ordered = [pieces[order.index(r)] for r in senders]
        out.copy_(torch.cat(ordered, dim=a).reshape(out.shape))

    return _Posted([dist.gather(src, pieces, dst=e.root, group=group, async_op=True)], after)


def _post_scatter(ev, e, group) -> _Posted:
    rank = ev.communicator.rank
    out = ev.get(e.out) if _holds(ev, e.out) else None
    if out is None:
        # The root is outside the receiver mesh: it receives a dummy piece.
        out_buf = torch.empty(ev.local_sizes(e.out), dtype=e.out.dtype, device=ev.device)
        after = None
    else:
        out_buf, after = _staged(out, out.shape)
    pieces = None
    if rank == e.root:
        whole = ev.get(e.input).reshape(ev.full_sizes(e.out))
        b = _mesh_axis(e.out)
        chunks = whole.chunk(len(e.out.mesh.devices), dim=b)
        by_rank = dict(zip(e.out.mesh.devices, chunks))
        order = ev.communicator.group_order(e.team)
        pieces = [_contiguous(by_rank.get(r, chunks[0])).view(out_buf.shape) for r in order]
    return _Posted([dist.scatter(out_buf, pieces, src=e.root, group=group, async_op=True)], after)


def _post_reduce(ev, e, group) -> _Posted:
    rank = ev.communicator.rank
    red_op = _RED_OPS[e.red_op]
    if rank != e.root:
        # Every rank posts the output's shape (checked under TORCH_DISTRIBUTED_DEBUG=DETAIL).
        piece = _reduced_input(ev, e).reshape(ev.local_sizes(e.out)).clone(memory_format=torch.contiguous_format)
        return _Posted([dist.reduce(piece, dst=e.root, op=red_op, group=group, async_op=True)])
    out = ev.get(e.out)
    buf, after = _staged(out, out.shape)
    if _holds(ev, e.input):
        buf.copy_(_reduced_input(ev, e).reshape(out.shape))
    else:
        _fill_identity(buf, e.red_op)
    return _Posted([dist.reduce(buf, dst=e.root, op=red_op, group=group, async_op=True)], after)


def _fill_identity(t: torch.Tensor, red_op: str) -> None:
    if red_op == "sum":
        t.zero_()
    elif t.dtype.is_floating_point:
        t.fill_(float("-inf") if red_op == "max" else float("inf"))
    else:
        info = torch.iinfo(t.dtype)
        t.fill_(info.min if red_op == "max" else info.max)


def _post_send_recv(ev, e, group) -> _Posted:
    rank = ev.communicator.rank
    sender, receiver = e.root, (e.team[-1] if len(e.team) > 1 else e.team[0])
    if sender == receiver:
        ev.get(e.out).copy_(ev.get(e.input).reshape(ev.get(e.out).shape))
        return _Posted([_NoWork()])
    if rank == sender:
        return _Posted([dist.isend(_contiguous(ev.get(e.input)), dst=receiver, group=group)])
    out = ev.get(e.out)
    buf, after = _staged(out, out.shape)
    return _Posted([dist.irecv(buf, src=sender, group=group)], after)


_POST = {
    ir.CommunicationType.Allgather: _post_allgather,
    ir.CommunicationType.Allreduce: _post_allreduce,
    ir.CommunicationType.ReduceScatter: _post_reduce_scatter,
    ir.CommunicationType.Broadcast: _post_broadcast,
    ir.CommunicationType.Gather: _post_gather,
    ir.CommunicationType.Scatter: _post_scatter,
    ir.CommunicationType.Reduce: _post_reduce,
    ir.CommunicationType.SendRecv: _post_send_recv,
}


def _log_posting(ev: HostIrEvaluator, e: ir.Communication) -> None:
    if ev.dumper is None or not ev.dumper.enabled("communication"):
        return
    tensors = [("input", ev.get(e.input, None)), ("output", ev.get(e.out, None))]
    sizes = ", ".join(f"{name} {list(t.shape)}" for name, t in tensors if t is not None)
    ev.dumper.emit("communication", f"Posting {printer.format_expr_head(e)}", f"  with {sizes}")


@impl(ir.Communication)
def _communication(ev: HostIrEvaluator, e: ir.Communication) -> None:
    comm = ev.communicator
    if comm.rank not in e.team:
        return
    group = comm.group(e.team)
    _log_posting(ev, e)
    try:
        ev._works[e] = _POST[e.type](ev, e, group)
    except Exception as err:
        raise _classify(err, e, ev) from err


@impl(ir.P2PCommunication)
def _p2p(ev: HostIrEvaluator, e: ir.P2PCommunication) -> None:
    comm = ev.communicator
    peer = int(ev.get(e.peer))
    if not 0 <= peer < comm.world_size:
        raise ValueError(f"invalid peer {peer}: the world has {comm.world_size} ranks")
    buf = ev.get(e.buffer)
    if not buf.is_contiguous():
        raise ValueError(f"the buffer of a P2P communication must be contiguous (strides {list(buf.stride())})")
    if ev._coalescing is not None:
        fn = dist.isend if e.type == "send" else dist.irecv
        ev._coalescing.append(dist.P2POp(fn, buf, peer))
        ev._works[e] = _Posted([])
        return
    work = dist.isend(buf, dst=peer) if e.type == "send" else dist.irecv(buf, src=peer)
    ev._works[e] = _Posted([work])


@impl(ir.StartCoalescing)
def _start_coalescing(ev: HostIrEvaluator, e: ir.StartCoalescing) -> None:
    if ev._coalescing is not None:
        raise RuntimeError("StartCoalescing inside an open coalescing group")
    ev._coalescing = []


@impl(ir.EndCoalescing)
def _end_coalescing(ev: HostIrEvaluator, e: ir.EndCoalescing) -> None:
    if ev._coalescing is None:
        raise RuntimeError("EndCoalescing without StartCoalescing")
    ops, ev._coalescing = ev._coalescing, None
    works = dist.batch_isend_irecv(ops) if ops else []
    ev._works[e] = _Posted(list(works))


@impl(ir.Wait)
def _wait(ev: HostIrEvaluator, e: ir.Wait) -> None:
    target = e.communication
    if isinstance(target, ir.Communication) and ev.communicator.rank not in target.team:
        return
    posted = ev._works.pop(target, None)
    if posted is None:
        raise RuntimeError(f"no posted communication to wait for: {printer.format_expr_head(target)}")
    try:
        for work in posted.works:
            work.wait()
    except Exception as err:
        raise _classify(err, target, ev) from err
    if posted.after is not None:
        posted.after()


def _classify(err: Exception, e, ev: HostIrEvaluator) -> Exception:
    """The error of a failed collective, naming it and this rank."""
    from hostir.communicator import classify_error

    comm = ev.communicator
    return classify_error(err, printer.format_expr_head(e), rank=comm.rank, timeout=comm.timeout)
