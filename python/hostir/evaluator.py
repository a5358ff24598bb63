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

from typing import Any, Callable, Mapping

import torch

from hostir import ir, printer, transports
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
        # For each slice bound by a HirAliasSelect, where the selected axis
        # was in its source: matmul and linear put it back as a size-1 dim.
        self._slice_dim = {
            e.out: e.input.runtime_position(e.axis)
            for e in container.walk()
            if isinstance(e, ir.HirAliasSelect)
        }
        # A chunk of such a slice lacks the same axis.
        for e in container.walk():
            if isinstance(e, ir.HirAliasChunk) and e.input in self._slice_dim:
                self._slice_dim[e.out] = self._slice_dim[e.input]
        self._values: dict = {}
        self._loops: list[list] = []
        self._used_streams: list = []
        # Posted communications until their Wait: expr -> _Posted.
        self._works: dict = {}
        self._coalescing: list | None = None
        self.ops_executed = 0
        # Runs so far; buffers that peers write alternate by its parity.
        self._calls = 0
        self.call_parity = 0

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
        self.call_parity = self._calls % 2
        self._calls += 1
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
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{printer.format_tv(tv)} must be bound to a torch.Tensor, got {type(value).__name__}")
        axes = tv.runtime_domain()
        if value.dim() != len(axes):
            raise ValueError(f"{printer.format_tv(tv)} has {len(axes)} dims but its tensor has shape {list(value.shape)}")
        for i, (d, size) in enumerate(zip(axes, value.shape)):
            if d.is_device_parallel:
                if size != 1:
                    raise ValueError(
                        f"axis {i} of {printer.format_tv(tv)} is sharded ({printer.format_id(d)}): "
                        f"each rank holds size 1 of it, got {size}"
                    )
                size = tv.mesh.x_size
            known = self.get(d.extent, None)
            if known is None:
                self._bind_extent(d.extent, size)
            elif known != size:
                raise ValueError(
                    f"axis {i} of {printer.format_tv(tv)} is {size} but its extent "
                    f"{printer.format_scalar(d.extent)} is {known}"
                )

    def _bind_extent(self, extent: ir.Scalar, size: int) -> None:
        """Bind a symbolic extent; for `( i0 / f )` (a split axis) bind i0."""
        if isinstance(extent, ir.ScalarExpr):
            if extent.op == "/" and extent.rhs.is_constant and not isinstance(extent.lhs, ir.ScalarExpr):
                self._bind_extent(extent.lhs, size * extent.rhs.value)
                return
            raise ValueError(f"cannot infer {printer.format_scalar(extent)} from a size")
        self.bind(extent, size)

    def full_sizes(self, tv: ir.TensorView) -> list[int]:
        """The runtime sizes of `tv` across all ranks (mesh_x axes whole)."""
        return [int(self.get(d.extent)) for d in tv.runtime_domain()]

    def local_sizes(self, tv: ir.TensorView) -> list[int]:
        """This rank's runtime sizes of `tv` (1 on a mesh_x axis)."""
        return tv.local_sizes(self.full_sizes(tv))

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

        def scan(exprs, before: set) -> None:
            # `before`: buffers bound ahead of this scope; an op in a loop
            # that writes one of them (a communication into a slice made
            # outside) writes it, it does not define a fresh one.
            seen = set(before)
            for e in exprs:
                if isinstance(e, ir.ForLoop):
                    local = {resolve(t) for inner in ir.walk(e.body) for t in ir.defined_tvs(inner)}
                    found[id(e)] = list(local - keep - seen)
                    scan(e.body, seen)
                seen.update(resolve(t) for t in ir.defined_tvs(e))

        scan(container.exprs, set())
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
    index = 0 if e.axis.is_broadcast else int(ev.get(e.index))
    ev.bind(e.out, src.select(ev._slice_dim[e.out], index))


@impl(ir.HirAliasChunk)
def _chunk(ev: HostIrEvaluator, e: ir.HirAliasChunk) -> None:
    src = ev.get(e.input)
    dim = e.input.runtime_position(e.axis)
    size = src.shape[dim]
    if size % e.parts:
        raise ValueError(f"axis {dim} of size {size} does not split into {e.parts} equal pieces")
    piece = size // e.parts
    ev.bind(e.out, src.narrow(dim, int(ev.get(e.index)) * piece, piece))


@impl(ir.Allocate)
def _allocate(ev: HostIrEvaluator, e: ir.Allocate) -> None:
    if ev.get(e.buffer, None) is not None:
        return
    shape = ev.local_sizes(e.buffer)
    if e.memory_type is ir.MemoryType.symmetric:
        ev.bind(e.buffer, transports.allocate(ev, e.buffer, shape))
        return
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
    dims = e.reduced_dims()
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


# ---------------------------------------------------------------- communications

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
        ev._works[e] = transports.post(ev, e, group)
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
    ops = None
    if ev._coalescing is not None:
        backend, ops = ev._coalescing
        if backend is None:
            ev._coalescing = (e.backend, ops)
        elif backend != e.backend:
            raise ValueError(f"one coalescing group mixes backends {backend} and {e.backend}")
    try:
        ev._works[e] = transports.post_p2p(ev, e, buf, peer, ops)
    except Exception as err:
        raise _classify(err, e, ev) from err


@impl(ir.StartCoalescing)
def _start_coalescing(ev: HostIrEvaluator, e: ir.StartCoalescing) -> None:
    if ev._coalescing is not None:
        raise RuntimeError("StartCoalescing inside an open coalescing group")
    ev._coalescing = (None, [])


@impl(ir.EndCoalescing)
def _end_coalescing(ev: HostIrEvaluator, e: ir.EndCoalescing) -> None:
    if ev._coalescing is None:
        raise RuntimeError("EndCoalescing without StartCoalescing")
    (backend, ops), ev._coalescing = ev._coalescing, None
    if backend is None:
        ev._works[e] = transports.Posted([])
        return
    try:
        ev._works[e] = transports.end_coalescing(ev, backend, ops)
    except Exception as err:
        raise _classify(err, e, ev) from err


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
