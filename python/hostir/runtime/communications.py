"""The evaluator's handlers of the communications (`hostir.communications`):
collectives and P2P messages posted through `hostir.runtime.transports`
(NCCL and gloo on the process groups of a `Communicator`, or the
copy-engine `cuda` transport), their coalescing, transfers between host
and device memory, and the `Wait` that completes each. A failed post or
wait names the communication and this rank, and a timeout or a lost peer
keeps its type (`CommunicatorTimeout`, `PeerLostError`).
"""

from __future__ import annotations

from hostir import ir, printer
from hostir.communicator import classify_error
from hostir.container import HostIrContainer
from hostir.runtime import transports
from hostir.runtime.frame import BindingError, Frame, ProgramError, impl


def _log_posting(frame: Frame, e: ir.Communication) -> None:
    if frame.dumper is None or not frame.dumper.enabled("communication"):
        return
    tensors = [("input", frame.get(e.input, None)), ("output", frame.get(e.out, None))]
    sizes = ", ".join(f"{name} {list(t.shape)}" for name, t in tensors if t is not None)
    frame.dumper.emit("communication", f"Posting {printer.format_expr_head(e)}", f"  with {sizes}")


@impl(ir.Communication)
def _communication(frame: Frame, e: ir.Communication) -> None:
    comm = frame.communicator
    if comm.rank not in e.team:
        return
    if len(e.team) == 1:
        _keep_local(frame, e)
        return
    group = comm.group(e.team)
    _log_posting(frame, e)
    try:
        frame.works[e] = transports.post(frame, e, group)
    except Exception as err:
        classified = _classify(err, e, frame)
        if classified is err:
            raise
        raise classified from err


def _keep_local(frame: Frame, e: ir.Communication) -> None:
    """A communication over a team of one rank moves nothing: its output is
    its input (with the rows this rank holds of a reduced axis reduced, in
    the output's dtype), bound as a view of it where the program allocates
    the output for this communication alone (`local_views`), else copied
    into the output's buffer (a caller's preallocated output, a slice).
    Its `Wait` makes the stream current then wait for the one current now,
    as a collective's would."""
    src = frame.get(e.input)
    if e.local_reduce:
        src = e.red_op.torch_fn(src, list(e.local_reduce), keepdim=True)
    if src.dtype != e.out.dtype:
        src = src.to(e.out.dtype)
    out = frame.get(e.out, None)
    if out is None:
        frame.bind(e.out, src.reshape(frame.local_sizes(e.out)))
    else:
        out.copy_(src.reshape(out.shape))
    frame.works[e] = transports.Posted([_PostedOn(frame.streams, frame.streams.current())])


class _PostedOn:
    """The work of a communication that ran in place on `stream`: waiting
    for it makes the current stream wait for that one (nothing on the CPU,
    or when they are the same stream)."""

    __slots__ = ("streams", "stream")

    def __init__(self, streams, stream):
        self.streams, self.stream = streams, stream

    def wait(self) -> None:
        self.streams.wait(self.streams.current(), self.stream)


class _Holding:
    """A completed work that holds a tensor alive until its Wait."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    def wait(self) -> None:
        pass


def local_views(container: HostIrContainer, source: dict, alias: dict) -> frozenset:
    """The outputs of communications over a team of one that may be bound
    to a view of their input: each is allocated for that communication
    alone (one global `Allocate`, no other writer, no slice or alias of
    it, no P2P buffer), and its input is written by its own op alone (no
    slice, alias or P2P buffer), so the two never differ; and a program
    output never views a program input (as a `set` would not)."""
    writers: dict = {}
    for e in container.walk():
        for tv in e.outputs():
            writers[tv] = writers.get(tv, 0) + 1
    allocations: dict = {}
    for e in container.walk():
        if isinstance(e, ir.Allocate):
            allocations.setdefault(e.buffer, []).append(e)
    shared = set(source) | set(source.values()) | set(alias) | set(alias.values())
    # A P2P buffer is written by a receive (or read by a peer's push).
    shared |= {v for e in container.walk() if isinstance(e, ir.P2PCommunication) for v in (e.buffer, e.into) if v}
    inputs, outputs = set(container.inputs), set(container.outputs)
    found = set()
    for e in container.walk():
        if not isinstance(e, ir.Communication) or len(e.team) != 1:
            continue
        out, src = e.out, e.input
        made = allocations.get(out, [])
        if len(made) != 1 or made[0].memory_type is not ir.MemoryType.global_:
            continue
        if writers.get(out, 0) != 1 or writers.get(src, 0) > 1 or out in shared or src in shared:
            continue
        if src in inputs and out in outputs:
            continue
        found.add(out)
    return frozenset(found)


@impl(ir.Transfer)
def _transfer(frame: Frame, e: ir.Transfer) -> None:
    if e.posted:
        frame.works[e] = transports.post_transfer(frame, e)
    else:
        transports.copy_in_order(frame, e)


@impl(ir.P2PCommunication)
def _p2p(frame: Frame, e: ir.P2PCommunication) -> None:
    comm = frame.communicator
    peer = int(frame.get(e.peer))
    if not 0 <= peer < comm.world_size:
        raise BindingError(f"invalid peer {peer}: the world has {comm.world_size} ranks")
    buf = frame.get(e.buffer)
    compact = None
    if not buf.is_contiguous():
        if e.type == "recv":
            raise BindingError(f"the buffer of a P2P receive must be contiguous (strides {list(buf.stride())})")
        # A send of a view (a permute's): the transports move contiguous
        # memory, so the send goes from a compact copy, kept until its Wait.
        buf = compact = buf.contiguous()
    ops = None
    if frame.coalescing is not None:
        backend, ops = frame.coalescing
        if backend is None:
            frame.coalescing = (e.backend, ops)
        elif backend != e.backend:
            raise ProgramError(f"one coalescing group mixes backends {backend} and {e.backend}")
    try:
        posted = transports.post_p2p(frame, e, buf, peer, ops)
        if compact is not None:
            posted = transports.Posted([*posted.works, _Holding(compact)], posted.after)
        frame.works[e] = posted
    except Exception as err:
        classified = _classify(err, e, frame)
        if classified is err:
            raise
        raise classified from err


@impl(ir.StartCoalescing)
def _start_coalescing(frame: Frame, e: ir.StartCoalescing) -> None:
    if frame.coalescing is not None:
        raise ProgramError("StartCoalescing inside an open coalescing group")
    # (backend of the group's first member, the transport's pending ops)
    frame.coalescing = (None, [])


@impl(ir.EndCoalescing)
def _end_coalescing(frame: Frame, e: ir.EndCoalescing) -> None:
    if frame.coalescing is None:
        raise ProgramError("EndCoalescing without StartCoalescing")
    (backend, ops), frame.coalescing = frame.coalescing, None
    if backend is None:
        frame.works[e] = transports.Posted([])
        return
    try:
        frame.works[e] = transports.end_coalescing(frame, backend, ops)
    except Exception as err:
        classified = _classify(err, e, frame)
        if classified is err:
            raise
        raise classified from err


@impl(ir.Wait)
def _wait(frame: Frame, e: ir.Wait) -> None:
    target = e.communication
    if isinstance(target, ir.Communication) and frame.communicator.rank not in target.team:
        return
    posted = frame.works.pop(target, None)
    if posted is None:
        raise ProgramError(f"no posted communication to wait for: {printer.format_expr_head(target)}")
    try:
        for work in posted.works:
            work.wait()
    except Exception as err:
        if isinstance(target, ir.Transfer):
            raise
        classified = _classify(err, target, frame)
        if classified is err:
            raise
        raise classified from err
    if posted.after is not None:
        posted.after()


def _classify(err: Exception, e, frame: Frame) -> Exception:
    """The error of a failed collective, naming it and this rank."""
    comm = frame.communicator
    return classify_error(err, printer.format_expr_head(e), rank=comm.rank, timeout=comm.timeout)
