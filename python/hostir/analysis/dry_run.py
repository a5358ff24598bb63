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
import importlib
import sys
import threading
from collections import Counter
from typing import Any, Mapping, Sequence


import torch

from hostir import ir, layout, printer
from hostir.errors import HostIrError
from hostir.lower import LoweredProgram, lower
from hostir.runtime import checks
from hostir.runtime.bind import Binding
from hostir.runtime.checks import signature
from hostir.runtime.evaluator import HostIrEvaluator
from hostir.analysis.dry_run_report import (  # noqa: F401 - the report types are the dry run's API
    Buffer,
    DryRunReport as DryRunReport,
    RankReport as RankReport,
    Transfer,
    _bytes,
    _dtype,
    _team,
    format_report,
    short,
)
from hostir.analysis.recording import (  # noqa: F401 - the recorders are the dry run's API
    Allocations,
    RecordingCommunicator,
    RecordingStreams,
    RecordingTransport,
    _bound_tensors,
)


class DryRunError(HostIrError, RuntimeError):
    """A rank's program cannot run: the message names the rank and the op."""


class DryRunInputError(HostIrError, ValueError):
    """A bad argument of a dry run (inputs, world size, streams)."""


class DryRunTypeError(HostIrError, TypeError):
    """An argument of a dry run of the wrong type."""


class CommunicationMismatchError(HostIrError, RuntimeError):
    """The ranks' communications do not pair up; the message quotes the
    dump lines of both ranks involved."""


# ---------------------------------------------------------------- fakes


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
                {
                    "direction": e.direction,
                    "bytes": ir.nbytes(moved),
                    "line": printer.format_expr_head(e),
                    "loops": _loops(frame),
                }
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
        ev = HostIrEvaluator(container, streams=RecordingStreams(), device="meta", communicator=comm, rank=pruned_for)
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


def dry_run_program(fusion: ir.Fusion, program: LoweredProgram, inputs, number_of_streams: int, world_size: int,
                    multi: bool) -> DryRunReport:
    """The dry run of a call about to run `program` (this rank's, lowered):
    on one rank of a single-device fusion, that program alone, its error
    the one the real run would raise; else every rank's program, lowered
    with `program`'s options."""
    if world_size == 1 and not multi:
        only = run_rank(fusion, inputs, 0, 1, number_of_streams, multi=False, program=program, raw_errors=True)
        return DryRunReport(1, number_of_streams, [only])
    return dry_run(
        fusion, inputs, world_size=world_size, number_of_streams=number_of_streams, backend=program.backend,
        schedule=program.schedule, resharding=program.options.resharding, hoisting=program.hoisting,
    )  # fmt: skip


class FakeRun:
    """The fake runner (HOSTIR_FAKE=1): a dry run's outputs of one rank
    (their `shapes`) as meta tensors."""

    def __init__(self, outputs, shapes):
        self._outputs = list(zip(outputs, shapes))

    def run(self, bindings, number_of_streams: int) -> list:
        return [
            None if shape is None else torch.empty(shape, dtype=tv.dtype, device="meta")
            for tv, shape in self._outputs
        ]
