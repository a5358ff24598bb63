"""The dry run: every rank's program, run in one process on meta tensors.

`dry_run(fd, inputs, world_size=D)` lowers the fusion for each of the D
ranks and runs each rank's host program with the reference evaluator on
meta tensors (shapes and dtypes, no data, no device), through a
`RecordingCommunicator` that records each communication instead of sending
it and `RecordingStreams` that name streams instead of making them. A
`_Recorder` observer on the evaluator counts the ops executed and lists the
buffers the program holds; `Allocations`, a dispatch mode over the whole run,
is its allocator: it follows every storage an op makes until its last tensor
is dropped (temporaries included), so the peak is the one a real run's
allocator sees. A communication is posted by the backend's own post
(`torch_dist`) on meta tensors with calls that record instead of sending:
its staging buffers live as long as in a real run, and what the backend
allocates itself is added from `torch_dist.backend_scratch_bytes` until
the program's Wait. Allocations made in C++ outside torch's dispatch (a
Python scalar or index list turned into a tensor inside an op) are not
seen, so the transports make such tensors explicitly. An error a post
raises is reported after the ranks are matched.
Afterwards the ranks' communications are matched (`match_ranks`): same
order, type, root and sizes on every team, every send paired with a recv,
every post completed by a Wait. The result is a `DryRunReport` (printable,
and `to_json()`); a failure on any rank is a `DryRunError` naming the rank
and the op, a mismatch between ranks a `CommunicationMismatchError` quoting
both ranks' dump lines.

Traffic is counted per peer, independent of the algorithm a backend uses:
a collective sends each peer the bytes of this rank's contribution that the
peer needs (an Allgather or Allreduce its whole piece, a ReduceScatter the
peer's chunk, a Gather or Reduce to the root, a Broadcast or Scatter from
it, an AllToAll each peer its piece); each communication type declares
its formula (`ir.CommunicationType.traffic`). A ring Allreduce moves 2(n-1)/n of the buffer instead; the counts here
are what a rank's data must reach, not the wire.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import re
import sys
import threading
from collections import Counter
from typing import Any, Mapping, Sequence

import weakref

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hostir import ir, layout, printer
from hostir.errors import HostIrError
from hostir.lower import LoweredProgram, lower
from hostir.runtime import checks
from hostir.runtime.bind import Binding
from hostir.runtime.checks import signature
from hostir.runtime.evaluator import HostIrEvaluator
from hostir.runtime.transports import Posted, Transport, torch_dist


class DryRunError(HostIrError, RuntimeError):
    """A rank's program cannot run: the message names the rank and the op."""


class DryRunInputError(HostIrError, ValueError):
    """A bad argument of a dry run (inputs, world size, streams)."""


class DryRunTypeError(HostIrError, TypeError):
    """An argument of a dry run of the wrong type."""


class CommunicationMismatchError(HostIrError, RuntimeError):
    """The ranks' communications do not pair up; the message quotes the
    dump lines of both ranks involved."""


# ---------------------------------------------------------------- records


@dataclasses.dataclass
class Transfer:
    """One posted communication on one rank."""

    rank: int
    kind: str  # a CommunicationType's name, or "send" / "recv"
    team: tuple
    root: int | None
    red_op: str | None
    line: str
    loops: list
    stream: str
    dtype: str
    input_bytes: int
    output_bytes: int
    sent: dict
    received: dict
    waited: bool = False
    # What the transport holds while the communication is in flight, beyond
    # the program's buffers: its staging buffers and the backend's scratch.
    staging_bytes: int = 0

    def where(self) -> str:
        loops = "".join(f" (in loop {name} = {value})" for name, value in self.loops)
        return f"rank {self.rank}: {self.line}{loops}"

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["team"] = list(self.team)
        d["loops"] = [{"index": n, "value": v} for n, v in self.loops]
        d["sent"] = {str(k): v for k, v in self.sent.items()}
        d["received"] = {str(k): v for k, v in self.received.items()}
        return d


@dataclasses.dataclass
class Buffer:
    """A tensor the program allocated (an Allocate, or an op's fresh result)."""

    name: str
    bytes: int
    shape: list
    dtype: str
    stream: str
    line: str
    loops: list

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["loops"] = [{"index": n, "value": v} for n, v in self.loops]
        return d


@dataclasses.dataclass
class RankReport:
    rank: int
    outputs: list  # (name, shape or None, dtype)
    inputs: list  # (name, shape, dtype)
    buffers: list
    peak_bytes: int
    peak_at: str
    peak_by_stream: dict
    communications: list
    ops_executed: dict
    # What the backend's post of a communication raised (see `check_posts`).
    post_errors: list = dataclasses.field(default_factory=list)
    # Host memory apart from the device's: `peak_bytes` is the device's.
    host_peak_bytes: int = 0
    # Each transfer between host and device memory: direction, bytes, line.
    transfers: list = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "rank": self.rank,
            "inputs": [{"name": n, "shape": s, "dtype": d} for n, s, d in self.inputs],
            "outputs": [{"name": n, "shape": s, "dtype": d} for n, s, d in self.outputs],
            "memory": {
                "buffers": [b.as_dict() for b in self.buffers],
                "peak_bytes": self.peak_bytes,
                "peak_at": self.peak_at,
                "peak_by_stream": dict(self.peak_by_stream),
                "host_peak_bytes": self.host_peak_bytes,
            },
            "communications": [t.as_dict() for t in self.communications],
            "transfers": [dict(t) for t in self.transfers],
            "ops_executed": dict(self.ops_executed),
        }

    def bytes_sent(self) -> dict:
        total: Counter = Counter()
        for t in self.communications:
            total.update(t.sent)
        return dict(total)

    def bytes_received(self) -> dict:
        total: Counter = Counter()
        for t in self.communications:
            total.update(t.received)
        return dict(total)


@dataclasses.dataclass
class DryRunReport:
    """What every rank's program does, found without running it."""

    world_size: int
    number_of_streams: int
    ranks: list

    def __getitem__(self, rank: int) -> RankReport:
        return self.ranks[rank]

    def as_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "number_of_streams": self.number_of_streams,
            "ranks": [r.as_dict() for r in self.ranks],
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.as_dict(), **kwargs)

    def __str__(self) -> str:
        return format_report(self)


# ---------------------------------------------------------------- fakes


class RecordingStreams:
    """Streams of a dry run: each is its name ("caller", "stream 3"), so the
    memory plan can say on which stream a buffer was allocated. The program
    runs in program order; waits are no-ops."""

    is_cuda = False

    def __init__(self):
        self._current = "caller"

    def current(self) -> str:
        return self._current

    def set_current(self, stream: str) -> None:
        self._current = stream

    def get(self, key) -> str:
        if isinstance(key, ir.Stream):
            return printer.format_stream(key).lower()
        return f"stream {key}"

    def wait(self, waiter, target) -> None:
        pass


class _RecordedWork:
    """A recorded communication's work. Like a process group's work it holds
    the tensors handed to the call until it is dropped; the `scratch` bytes
    the backend allocates for the call (see
    `torch_dist.backend_scratch_bytes`) are live until it is waited for."""

    def __init__(self, transfer: Transfer, comm: RecordingCommunicator, tensors=(), scratch: int = 0):
        self.transfer = transfer
        self.comm = comm
        self.tensors = tensors
        self.scratch = scratch
        if scratch and comm.allocations is not None:
            comm.allocations.add_scratch(scratch)

    def wait(self, *args) -> bool:
        # Only a wait of the program's own counts: the evaluator completes
        # what is still in flight when the run ends, but until then the
        # buffer of a communication nobody waits for is in use.
        if self.comm.ops_running > 0:
            self.transfer.waited = True
        if self.scratch and self.comm.allocations is not None:
            self.comm.allocations.add_scratch(-self.scratch)
            self.scratch = 0
        return True


_warming: threading.Thread | None = None


def warm_up() -> None:
    """Start importing, on a thread of its own, what a dry run's first meta
    kernel imports (torch's symbolic-shape module and sympy, most of a
    second on a CPU), so that it overlaps the rendezvous a multi-device
    program's first call waits for. Once per process."""
    global _warming
    if _warming is not None or "torch.fx.experimental.symbolic_shapes" in sys.modules:
        return

    def load() -> None:
        with contextlib.suppress(Exception):
            importlib.import_module("torch.fx.experimental.symbolic_shapes")

    _warming = threading.Thread(target=load, name="hostir-dry-run-imports", daemon=True)
    _warming.start()


class Allocations(TorchDispatchMode):
    """The allocator of a dry run: follows every storage an op makes while
    the mode is on, from the op that makes it until the last tensor on it
    is dropped, as a real run's allocator would see them (temporaries of an
    op and staging buffers of a post included), and keeps the peak of the
    live bytes, where it happened and per stream. Storages in `excluded`
    (the inputs) are not counted; `where` and `space` ("device" or
    "host": what the op allocates in) are set by the recorder before every
    op. Host memory has a peak of its own (`host_peak`)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch.compile never traces a dry run; saying so keeps torch from
        # wrapping __torch_dispatch__ in a dynamo guard, whose first call
        # imports torch._dynamo (most of a second on a CPU).
        return False

    def __init__(self, excluded: set[int]):
        super().__init__()
        self.excluded = excluded
        self.where: tuple[str, str] = ("(before the program)", "caller")
        self.space = "device"
        self.host_live = 0
        self.host_peak = 0
        self.live = 0
        self.peak = 0
        self.peak_at = "(nothing allocated)"
        self.by_stream: Counter = Counter()
        self.peak_by_stream: Counter = Counter()
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, tuple[int, str]] = {}
        self._made: list[weakref.ref] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(result):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return result

    def _track(self, t: torch.Tensor) -> None:
        if self._made is not None:
            # Weakly: a temporary of the post dies when the real one would.
            self._made.append(weakref.ref(t))
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.excluded:
            return
        if key in self._refs:
            self._refs[key] += 1
        else:
            self._refs[key] = 1
            nbytes, stream = storage.nbytes(), self.where[1]
            if self.space == "host":
                self._sizes[key] = (nbytes, None)
                self._change_host(nbytes)
            else:
                self._sizes[key] = (nbytes, stream)
                self._change(nbytes, stream)
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            nbytes, stream = self._sizes.pop(key)
            if stream is None:
                self._change_host(-nbytes)
            else:
                self._change(-nbytes, stream)

    def _change_host(self, nbytes: int) -> None:
        self.host_live += nbytes
        self.host_peak = max(self.host_peak, self.host_live)

    def add_scratch(self, nbytes: int) -> None:
        """Bytes a backend allocates (or, negative, frees) outside torch's
        dispatch."""
        self._change(nbytes, self.where[1])

    def _change(self, nbytes: int, stream: str) -> None:
        self.live += nbytes
        self.by_stream[stream] += nbytes
        if self.live > self.peak:
            self.peak = self.live
            self.peak_at = self.where[0]
        if self.by_stream[stream] > self.peak_by_stream[stream]:
            self.peak_by_stream[stream] = self.by_stream[stream]

    @contextlib.contextmanager
    def collecting(self):
        """Weak references to the tensors ops make inside the block."""
        made: list[weakref.ref] = []
        outer, self._made = self._made, made
        try:
            yield made
        finally:
            self._made = outer


def _recording_calls(backend: str, transfer: Transfer, comm: RecordingCommunicator):
    """`torch_dist.Calls` that post nothing: each returns a work holding
    its tensors and the backend's scratch for the call."""

    def call(name: str):
        def record(*args, **kwargs):
            tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            scratch = torch_dist.backend_scratch_bytes(backend, name, comm.rank, *args, **kwargs)
            transfer.staging_bytes += scratch
            return _RecordedWork(transfer, comm, tuple(tensors), scratch)

        return record

    return torch_dist.Calls(**{f.name: call(f.name) for f in dataclasses.fields(torch_dist.Calls)})


class RecordingTransport(Transport):
    """The transport of a dry run: each posted communication becomes a
    `Transfer` of its rank, and a work whose `wait` marks it completed.
    Output buffers keep whatever the program put in them (their shapes are
    all a dry run needs)."""

    name = "recording"

    def __init__(self, comm: RecordingCommunicator):
        self.comm = comm

    def post(self, frame, e, group, root: int | None) -> Posted:
        input, out = frame.get(e.input, None), frame.get(e.out, None)
        t = self._transfer(e, input, out, tuple(e.team), root)
        _count_traffic(e, t, input, out, self.comm.rank, root)
        if e.backend not in torch_dist.BACKENDS:
            return Posted([_RecordedWork(t, self.comm)])
        # The backend's own post, on meta tensors, with calls that record:
        # the staging buffers it makes live as long as in a real run.
        collecting = self.comm.allocations.collecting() if self.comm.allocations else contextlib.nullcontext([])
        try:
            with collecting as made:
                posted = torch_dist.POST[e.type](_recording_calls(e.backend, t, self.comm), frame, e, group, root)
        except Exception as err:
            # Reported once the ranks are matched: a mismatch between ranks
            # is the cause to name when there is one.
            self.comm.post_errors.append((t, err))
            return Posted([_RecordedWork(t, self.comm)])
        program = {x.untyped_storage()._cdata for x in _bound_tensors(frame)}
        staged = {}
        for ref in made:
            x = ref()
            if x is None:
                continue
            storage = x.untyped_storage()
            if storage._cdata not in program:
                staged[storage._cdata] = storage.nbytes()
        t.staging_bytes += sum(staged.values())
        # A post that completes at once (a SendRecv to itself) has no work
        # whose wait marks the transfer completed: the program's Wait does.
        return Posted(posted.works + [_RecordedWork(t, self.comm)], posted.after)

    def post_p2p(self, frame, e, buf, peer: int, ops: list | None) -> Posted:
        send = e.type == "send"
        t = self._transfer(e, buf if send else None, None if send else buf, tuple(sorted({self.comm.rank, peer})), None)
        (t.sent if send else t.received)[peer] = ir.nbytes(buf)
        work = _RecordedWork(t, self.comm)
        if ops is not None:
            # Coalesced: the group's Wait completes it.
            ops.append(work)
            return Posted([])
        return Posted([work])

    def end_coalescing(self, frame, ops: list) -> Posted:
        return Posted(list(ops))

    def allocate(self, frame, tv, shape):
        return torch.empty(shape, dtype=tv.dtype, device=frame.device)

    def _transfer(self, e, input, out, team: tuple, root: int | None) -> Transfer:
        src = input if input is not None else out
        t = Transfer(
            rank=self.comm.rank,
            kind=e.type if isinstance(e.type, str) else e.type.value,
            team=team,
            root=root,
            red_op=getattr(e, "red_op", None),
            line=printer.format_expr_head(e),
            loops=[],
            stream="",
            dtype=_dtype(src.dtype) if src is not None else "",
            input_bytes=ir.nbytes(input),
            output_bytes=ir.nbytes(out),
            sent={},
            received={},
        )
        self.comm.transfers.append(t)
        return t


class RecordingCommunicator:
    """The communicator of one rank of a dry run: no process groups (a
    team's group is the team itself), and a `RecordingTransport` that takes
    every communication."""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self.timeout = 0.0
        self.transfers: list[Transfer] = []
        self.transport = RecordingTransport(self)
        # The dry run's allocator (None when the run is not followed).
        self.allocations: Allocations | None = None
        # The errors the backend's post raised, with their transfers.
        self.post_errors: list[tuple[Transfer, Exception]] = []
        # How many ops of the program are running (loops nest); 0 once the
        # program's ops are done.
        self.ops_running = 0

    def group(self, team) -> tuple:
        return tuple(team)

    def group_order(self, team) -> tuple:
        return tuple(team)


def _count_traffic(e: ir.Communication, t: Transfer, input, out, me: int, root: int | None) -> None:
    """Per-peer bytes of one collective on rank `me`: the type's own
    formula (`ir.CommunicationType.traffic`; see the module doc)."""
    sent, received = e.type.traffic(e, me, root, input, out)
    t.sent.update(sent)
    t.received.update(received)


def _bound_tensors(frame) -> list[torch.Tensor]:
    return [v for v in frame.values.values() if isinstance(v, torch.Tensor)]


def _loops(frame) -> list:
    return [(printer.format_scalar(i), v) for i, v in frame.loops]


class _Recorder:
    """The evaluator's observer in a dry run: counts ops, lists the buffers
    the run's frame holds (looked at before and after every op) and tells
    the dry run's allocator which op runs, on which stream."""

    def __init__(self, comm: RecordingCommunicator | None, allocations: Allocations):
        self.comm = comm
        self.allocations = allocations
        self.ops: Counter = Counter()
        self.live: dict[int, tuple[Any, Buffer]] = {}
        self.buffers: list[Buffer] = []
        self.transfers: list[dict] = []
        self._annotated = 0

    def op(self, frame, e, run) -> None:
        self._before(frame, e)
        run()
        self._after(frame, e)

    def _before(self, frame, e) -> None:
        if self.comm is not None:
            self.comm.ops_running += 1
        self._snapshot(frame, e)
        loops = "".join(f" (in loop {n} = {v})" for n, v in _loops(frame))
        self.allocations.where = (f"{printer.format_expr_head(e)}{loops}", frame.streams.current())
        self.allocations.space = "host" if _allocates_host(e) else "device"

    def _after(self, frame, e) -> None:
        if self.comm is not None:
            self.comm.ops_running -= 1
        self.ops[type(e).__name__] += 1
        self._snapshot(frame, e)
        if isinstance(e, ir.Transfer):
            moved = frame.get(e.out, None)
            self.transfers.append(
                {"direction": e.direction, "bytes": ir.nbytes(moved), "line": printer.format_expr_head(e), "loops": _loops(frame)}
            )
        if self.comm is not None:
            for t in self.comm.transfers[self._annotated :]:
                t.loops = _loops(frame)
                t.stream = frame.streams.current()
            self._annotated = len(self.comm.transfers)

    def _snapshot(self, frame, e) -> None:
        now: dict[int, Any] = {}
        for t in _bound_tensors(frame):
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in self.allocations.excluded:
                now.setdefault(key, (storage, t))
        for key in [k for k in self.live if k not in now]:
            del self.live[key]
        defined = ir.defined_tvs(e) if not isinstance(e, ir.ForLoop) else []
        for key, (storage, t) in now.items():
            if key in self.live:
                continue
            names = [f"T{tv.name}" for tv in defined if frame.get(tv, None) is not None]
            buf = Buffer(
                name=names[0] if names else "?",
                bytes=storage.nbytes(),
                shape=list(t.shape),
                dtype=str(t.dtype).removeprefix("torch."),
                stream=frame.streams.current(),
                line=printer.format_expr_head(e),
                loops=_loops(frame),
            )
            self.live[key] = (storage, buf)
            self.buffers.append(buf)


# ---------------------------------------------------------------- inputs


def _allocates_host(e) -> bool:
    """Whether what `e` makes lives in host memory."""
    if isinstance(e, ir.Allocate):
        return e.memory_type is ir.MemoryType.host
    return isinstance(e, ir.Set) and ir.in_host_memory(e.out)


def _input_entry(v, value) -> tuple:
    """An input as the report lists it: (name, shape, dtype); a scalar input
    has no shape and its Python type as its dtype."""
    if isinstance(v, ir.TensorView):
        return (f"T{v.name}", list(value.shape), _dtype(value.dtype))
    return (printer.format_val(v), [], type(value).__name__)


def _as_meta(tv: ir.TensorView, given, i: int) -> torch.Tensor:
    if not isinstance(tv, ir.TensorView):
        return given  # a scalar input: its value, as execute takes it
    what = f"input {i} (T{tv.name})"
    if isinstance(given, torch.Tensor):
        return torch.empty(given.shape, dtype=given.dtype, device="meta")
    if isinstance(given, (torch.Size, list, tuple)) and all(
        isinstance(s, int) and not isinstance(s, bool) for s in given
    ):
        return torch.empty(list(given), dtype=tv.dtype, device="meta")
    raise DryRunTypeError(f"{what}: give a tensor (real, meta or fake) or a shape, got {given!r}")


def meta_inputs(fusion: ir.Fusion, inputs: Sequence) -> list[torch.Tensor]:
    """Each input as a meta tensor: shapes take the input's dtype."""
    if isinstance(inputs, torch.Tensor) or not isinstance(inputs, (list, tuple)):
        raise DryRunTypeError(f"inputs must be a list of tensors or shapes, got {type(inputs).__name__}")
    if len(inputs) != len(fusion.inputs):
        raise DryRunInputError(
            f"Wrong number of inputs: the fusion takes {len(fusion.inputs)} {signature(fusion)}, got {len(inputs)}"
        )
    return [_as_meta(tv, t, i) for i, (tv, t) in enumerate(zip(fusion.inputs, inputs))]


# ---------------------------------------------------------------- running


def dry_run(
    fd,
    inputs: Sequence | Mapping[int, Sequence],
    world_size: int | None = None,
    number_of_streams: int = 4,
    backend: str = "NCCL",
    check: bool = True,
    schedule=None,
    resharding: str = "auto",
    hoisting=None,
) -> DryRunReport:
    """Run every rank's program of `fd` (a FusionDefinition or a Fusion) on
    meta tensors and return the report.

    `inputs` are this rank's pieces, as `fd.execute` takes them (tensors of
    any device, meta or fake tensors, or shapes), the same for every rank,
    or a dict from rank to such a list. `world_size` defaults to the number
    of ranks the fusion's meshes name (1 for a single-device fusion).
    `backend`, `schedule`, `resharding` and `hoisting` are what the programs
    are lowered with (as `hostir.lower.lower` takes them, or a schedule's
    text as `execute` takes it; an execute passes its own). With
    `check`, the ranks' communications are matched and a mismatch raises
    `CommunicationMismatchError`."""
    from hostir.lower.schedule import parse

    if isinstance(schedule, str):
        # As an execute takes it: `ring:chunks=2`, `collective`, ...
        schedule = parse(schedule)
    fusion = getattr(fd, "fusion", fd)
    if not isinstance(fusion, ir.Fusion):
        raise DryRunTypeError(f"dry_run takes a FusionDefinition, got {type(fd).__name__}")
    if isinstance(number_of_streams, bool) or not isinstance(number_of_streams, int) or number_of_streams < 1:
        raise DryRunInputError(f"number_of_streams must be an integer >= 1, got {number_of_streams!r}")
    multi = checks.is_multi_device(fusion)
    needed = checks.ranks_needed(fusion)
    if world_size is None:
        world_size = needed if multi else 1
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise DryRunInputError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not multi and world_size != 1:
        raise DryRunInputError(f"the fusion is single-device (no mesh); dry-run it with world_size=1, not {world_size}")
    ranks = [
        run_rank(
            fusion,
            _inputs_of(inputs, r),
            r,
            world_size,
            number_of_streams,
            backend,
            multi,
            schedule=schedule,
            resharding=resharding,
            hoisting=hoisting,
        )
        for r in range(world_size)
    ]
    report = DryRunReport(world_size, number_of_streams, ranks)
    if check:
        match_ranks(report)
    check_posts(report)
    return report


def _inputs_of(inputs, rank: int):
    if isinstance(inputs, Mapping):
        if rank not in inputs:
            raise DryRunError(f"rank {rank}: no inputs given for this rank (inputs has ranks {sorted(inputs)})")
        return inputs[rank]
    return inputs


def run_rank(
    fusion: ir.Fusion,
    inputs: Sequence,
    rank: int,
    world_size: int,
    number_of_streams: int = 4,
    backend: str = "NCCL",
    multi: bool | None = None,
    program: LoweredProgram | None = None,
    raw_errors: bool = False,
    schedule=None,
    resharding: str = "auto",
    hoisting=None,
) -> RankReport:
    """One rank's part of a dry run (`program`: that rank's lowered
    program, if the caller has it; `raw_errors`: see `_run_container`)."""
    multi = checks.is_multi_device(fusion) if multi is None else multi
    try:
        metas = meta_inputs(fusion, inputs)
        if multi:
            checks.check_world(fusion, world_size)
        checks.check_inputs(fusion, metas, "meta", sharded=multi)
        if program is None:
            if multi:
                program = lower(
                    fusion, rank=rank, backend=backend, schedule=schedule, resharding=resharding, hoisting=hoisting
                )
            else:
                program = lower(fusion, resharding=resharding, hoisting=hoisting)
        checks.check_sizes(fusion, metas, checks.equal_input_axes(fusion))
    except Exception as err:
        raise DryRunError(f"rank {rank}: {type(err).__name__}: {err}") from err
    container = program.program
    binding = Binding.of(container)
    bindings = binding.bind(metas)
    report = _run_container(
        container, bindings, rank, world_size if multi else None, number_of_streams, raw_errors, program.rank
    )
    report.inputs = [_input_entry(tv, t) for tv, t in zip(fusion.inputs, metas)]
    report.outputs = [
        (name, None if shape is None else list(layout.to_logical(tv, _shaped(shape)).shape), dtype)
        for tv, (name, shape, dtype) in zip(container.outputs, report.outputs)
    ]
    return report


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shaped(shape) -> torch.Tensor:
    return torch.empty(shape, device="meta")


def _run_container(
    container,
    bindings: dict,
    rank: int,
    world_size: int | None,
    number_of_streams: int,
    raw_errors: bool = False,
    pruned_for: int | None = None,
) -> RankReport:
    """Run one rank's program on the meta tensors of `bindings`; with a
    `world_size`, through a recording communicator (`pruned_for`: the rank
    the program was pruned for, if it was). A failure is a
    `DryRunError` naming the rank, or with `raw_errors` the evaluator's own
    error (what a real run of the program would raise)."""
    comm = RecordingCommunicator(rank, world_size) if world_size is not None else None
    allocations = Allocations({t.untyped_storage()._cdata for t in bindings.values() if isinstance(t, torch.Tensor)})
    if comm is not None:
        comm.allocations = allocations
    recorder = _Recorder(comm, allocations)
    try:
        ev = HostIrEvaluator(
            container, streams=RecordingStreams(), device="meta", communicator=comm, rank=pruned_for
        )
        ev.profiled = False
        ev.observers.append(recorder)
        with allocations:
            results = ev.run(bindings, number_of_streams=number_of_streams)
    except Exception as err:
        if raw_errors:
            raise
        # torch's own errors carry the op's dump line as a note.
        notes = "".join(f"\n{n}" for n in getattr(err, "__notes__", ()))
        what = "" if isinstance(err, HostIrError) else f"{type(err).__name__}: "
        raise DryRunError(f"rank {rank}: {what}{err}{notes}") from err
    return RankReport(
        rank=rank,
        inputs=[_input_entry(tv, t) for tv, t in bindings.items() if tv in container.inputs],
        outputs=[
            (f"T{tv.name}", None if r is None else list(r.shape), _dtype(tv.dtype))
            for tv, r in zip(container.outputs, results)
        ],
        buffers=recorder.buffers,
        peak_bytes=allocations.peak,
        peak_at=allocations.peak_at,
        peak_by_stream=dict(allocations.peak_by_stream),
        communications=comm.transfers if comm is not None else [],
        ops_executed=dict(recorder.ops),
        post_errors=comm.post_errors if comm is not None else [],
        host_peak_bytes=allocations.host_peak,
        transfers=recorder.transfers,
    )


def dry_run_programs(
    programs: Mapping[int, Any],
    inputs: Sequence | Mapping[int, Sequence],
    world_size: int | None = None,
    number_of_streams: int = 4,
    check: bool = True,
) -> DryRunReport:
    """The dry run of hand-built host programs: `programs` maps each rank to
    its `HostIrContainer` (the program that rank runs: a tensor on a mesh
    without the rank is not held there), `inputs` gives tensors or shapes
    for each container input (the same for every rank, or per rank)."""
    world_size = len(programs) if world_size is None else world_size
    missing = [r for r in range(world_size) if r not in programs]
    if missing:
        raise DryRunInputError(f"dry_run_programs: no program for ranks {missing} of {world_size}")
    ranks = []
    for r in range(world_size):
        container = programs[r]
        given = _inputs_of(inputs, r)
        if len(given) != len(container.inputs):
            raise DryRunError(f"rank {r}: the program takes {len(container.inputs)} inputs, got {len(given)}")
        bindings = {tv: _as_meta(tv, t, i) for i, (tv, t) in enumerate(zip(container.inputs, given))}
        ranks.append(_run_container(container, bindings, r, world_size, number_of_streams, pruned_for=r))
    report = DryRunReport(world_size, number_of_streams, ranks)
    if check:
        match_ranks(report)
    check_posts(report)
    return report


def check_posts(report: DryRunReport) -> None:
    """Raise the first error a backend's post raised on any rank, as the
    real run would raise it there: a `DryRunError` naming the rank and the
    communication."""
    for r in report.ranks:
        for t, err in r.post_errors:
            what = "" if isinstance(err, HostIrError) else f"{type(err).__name__}: "
            loops = "".join(f"\n  in loop {n} = {v}" for n, v in t.loops)
            raise DryRunError(f"rank {r.rank}: {what}{err}\nWhile executing:\n{t.line}{loops}") from err


# ---------------------------------------------------------------- matching


def match_ranks(report: DryRunReport) -> None:
    """Raise `CommunicationMismatchError` at the first communication that
    does not pair up across ranks: one never waited for, a team whose
    members post different sequences (order, type, root, reduction, sizes),
    or a send without its recv (or the reverse)."""
    for r in report.ranks:
        for t in r.communications:
            if not t.waited:
                raise CommunicationMismatchError(
                    f"a communication is posted but never waited for (a missing Wait):\n  {t.where()}"
                )
    _match_teams(report)
    _match_p2p(report)


def _collectives_by_team(report: DryRunReport) -> dict[tuple, dict[int, list[Transfer]]]:
    teams: dict[tuple, dict[int, list[Transfer]]] = {}
    for r in report.ranks:
        for t in r.communications:
            if t.kind in ("send", "recv"):
                continue
            teams.setdefault(t.team, {})
            teams[t.team].setdefault(r.rank, []).append(t)
    return teams


def _match_teams(report: DryRunReport) -> None:
    for team, by_rank in _collectives_by_team(report).items():
        members = [p for p in team if p < report.world_size]
        first = members[0]
        ref = by_rank.get(first, [])
        for p in members[1:]:
            mine = by_rank.get(p, [])
            for k in range(max(len(ref), len(mine))):
                a = ref[k] if k < len(ref) else None
                b = mine[k] if k < len(mine) else None
                if a is None or b is None:
                    present, absent_rank = (a, p) if b is None else (b, first)
                    raise CommunicationMismatchError(
                        f"team {_team(team)}: rank {absent_rank} posts no communication #{k} on this team, "
                        f"where the other rank posts (a skipped collective?):\n  {present.where()}"
                    )
                problem = _differ(a, b)
                if problem:
                    raise CommunicationMismatchError(
                        f"team {_team(team)}: communication #{k} differs ({problem}):\n  {a.where()}\n  {b.where()}"
                    )
        # Each pair's traffic must agree: what a sends b, b receives from a.
        for k in range(len(ref)):
            for a_rank in members:
                for b_rank in members:
                    a, b = by_rank[a_rank][k], by_rank[b_rank][k]
                    if a.sent.get(b_rank, 0) != b.received.get(a_rank, 0):
                        raise CommunicationMismatchError(
                            f"team {_team(team)}: communication #{k}: rank {a_rank} sends "
                            f"{a.sent.get(b_rank, 0)} bytes to rank {b_rank}, which receives "
                            f"{b.received.get(a_rank, 0)} bytes from it:\n  {a.where()}\n  {b.where()}"
                        )


def _differ(a: Transfer, b: Transfer) -> str:
    for field in ("kind", "root", "red_op", "dtype"):
        x, y = getattr(a, field), getattr(b, field)
        # A rank that holds neither buffer of a communication has no dtype.
        if x != y and not (field == "dtype" and "" in (x, y)):
            return f"{field} {x} vs {y}"
    symmetric = ("Allgather", "Allreduce", "ReduceScatter")
    if a.kind in symmetric and (a.input_bytes, a.output_bytes) != (b.input_bytes, b.output_bytes):
        return (
            f"sizes: {a.input_bytes} -> {a.output_bytes} bytes on rank {a.rank}, "
            f"{b.input_bytes} -> {b.output_bytes} bytes on rank {b.rank}"
        )
    return ""


def _match_p2p(report: DryRunReport) -> None:
    sends: dict[tuple, list[Transfer]] = {}
    recvs: dict[tuple, list[Transfer]] = {}
    for r in report.ranks:
        for t in r.communications:
            if t.kind == "send":
                (peer,) = t.sent
                sends.setdefault((r.rank, peer), []).append(t)
            elif t.kind == "recv":
                (peer,) = t.received
                recvs.setdefault((peer, r.rank), []).append(t)
    for pair in sorted(set(sends) | set(recvs)):
        src, dst = pair
        out, into = sends.get(pair, []), recvs.get(pair, [])
        for k in range(max(len(out), len(into))):
            s = out[k] if k < len(out) else None
            v = into[k] if k < len(into) else None
            if s is None:
                raise CommunicationMismatchError(
                    f"rank {dst} receives from rank {src}, which sends it nothing more "
                    f"(recv #{k} from rank {src}){_elsewhere(recvs, sends, src, 'sends')}:\n  {v.where()}"
                )
            if v is None:
                raise CommunicationMismatchError(
                    f"rank {src} sends to rank {dst}, which receives nothing more from it "
                    f"(send #{k} to rank {dst}){_elsewhere(sends, recvs, dst, 'receives')}:\n  {s.where()}"
                )
            if s.sent[dst] != v.received[src]:
                raise CommunicationMismatchError(
                    f"rank {src} sends {s.sent[dst]} bytes to rank {dst}, which receives "
                    f"{v.received[src]} bytes:\n  {s.where()}\n  {v.where()}"
                )


def _elsewhere(mine, theirs, rank: int, verb: str) -> str:
    """Where `rank`'s unpaired posts go, to name the peer it expects."""
    lines = [t.where() for (a, b), ts in theirs.items() for t in ts if rank in (a, b) and t.rank == rank]
    if not lines:
        return ""
    return f"; rank {rank} {verb}:\n  " + "\n  ".join(lines[:3]) + "\n and the unpaired one is"


def _team(team) -> str:
    return "(" + " ".join(map(str, team)) + ")"


# ---------------------------------------------------------------- printing


_TENSOR = re.compile(r"(T\d+)_[glsh]_\w+\[[^\]]*\](?: \(DeviceMesh\{[^()]*\}\))?")


def short(line: str) -> str:
    """A dump line with each tensor written by its name alone."""
    return " ".join(_TENSOR.sub(r"\1", line).split())


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size:
            return f"{n / size:.1f} {unit} ({n} B)"
    return f"{n} B"


def _per_peer(t: Transfer, counts: dict, verb: str, prep: str) -> str:
    if not counts:
        return ""
    sizes = set(counts.values())
    others = set(t.team) - {t.rank}
    if len(sizes) == 1 and len(counts) > 1:
        return f"{verb} {_bytes(sizes.pop())} {prep} each of {len(counts)} peers"
    if len(sizes) == 1 and set(counts) == others:
        # Written without the peer's number, so ranks that differ only in
        # it print as one group.
        return f"{verb} {_bytes(sizes.pop())} {prep} the other team member"
    return f"{verb} " + ", ".join(f"{_bytes(n)} {prep} rank {p}" for p, n in sorted(counts.items()))


def _rank_body(r: RankReport) -> list[str]:
    lines = []
    outs = ", ".join(f"{n} {d}{s}" if s is not None else f"{n} (not held)" for n, s, d in r.outputs)
    lines.append(f"  outputs: {outs}")
    lines.append(f"  memory: peak {_bytes(r.peak_bytes)} after {short(r.peak_at)}")
    if r.host_peak_bytes or r.transfers:
        lines.append(f"    host memory: peak {_bytes(r.host_peak_bytes)} (apart from the device's)")
    if r.peak_by_stream:
        per = ", ".join(f"{s} {_bytes(n)}" for s, n in sorted(r.peak_by_stream.items()))
        lines.append(f"    peak per stream: {per}")
    seen: Counter = Counter()
    first: dict = {}
    for b in r.buffers:
        key = (b.name, b.bytes, b.stream if not b.loops else "", b.line)
        seen[key] += 1
        first.setdefault(key, b)
    if seen:
        lines.append("    buffers:")
    for key, count in seen.items():
        b = first[key]
        times = f" x{count} (one per iteration)" if count > 1 else ""
        lines.append(f"      {b.name} {b.dtype}{b.shape} {_bytes(b.bytes)} on {b.stream}{times}")
    lines.append(f"  communications: {len(r.communications)}")
    for t in r.communications:
        loops = "".join(f" [{n}={v}]" for n, v in t.loops)
        traffic = "; ".join(
            x for x in (_per_peer(t, t.sent, "sends", "to"), _per_peer(t, t.received, "receives", "from")) if x
        )
        sizes = f"input {_bytes(t.input_bytes)}, output {_bytes(t.output_bytes)}"
        if t.staging_bytes:
            sizes += f", staging {_bytes(t.staging_bytes)}"
        lines.append(f"    {t.kind} team={_team(t.team)}{loops} on {t.stream} ({sizes}): {traffic or 'no traffic'}")
    if r.transfers:
        moved = Counter()
        for t in r.transfers:
            moved[t["direction"]] += t["bytes"]
        per = ", ".join(f"{d} {_bytes(n)}" for d, n in sorted(moved.items()))
        lines.append(f"  transfers: {len(r.transfers)} ({per})")
    sent, received = sum(r.bytes_sent().values()), sum(r.bytes_received().values())
    lines.append(f"    total: sends {_bytes(sent)}, receives {_bytes(received)}")
    ops = ", ".join(f"{k} {v}" for k, v in sorted(r.ops_executed.items()))
    lines.append(f"  ops executed: {sum(r.ops_executed.values())} ({ops})")
    return lines


def format_report(report: DryRunReport) -> str:
    """The report as text; ranks whose reports read the same are printed once."""
    head = f"Dry run of {report.world_size} rank{'s' if report.world_size > 1 else ''}, {report.number_of_streams} streams"
    lines = [head]
    if report.ranks:
        ins = ", ".join(f"{n} {d}{s}" for n, s, d in report.ranks[0].inputs)
        lines.append(f"inputs (each rank's piece): {ins}")
    groups: dict[tuple, list[int]] = {}
    for r in report.ranks:
        groups.setdefault(tuple(_rank_body(r)), []).append(r.rank)
    for body, ranks in groups.items():
        lines.append(f"{_rank_list(ranks)}:")
        lines.extend(body)
    return "\n".join(lines) + "\n"


def _rank_list(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))
