"""The dry run's stand-ins for a real run's machinery: streams that are
names (`RecordingStreams`), the allocator that follows every storage
(`Allocations`), and a communicator and transport that record each
communication, posted by the backend's own post on meta tensors, instead
of sending it (`RecordingCommunicator`, `RecordingTransport`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter

import weakref

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hostir import ir, printer
from hostir.runtime.transports import Posted, Transport, torch_dist
from hostir.analysis.dry_run_report import Transfer, _dtype


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
