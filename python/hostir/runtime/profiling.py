"""Profiler ranges and stream timelines of host programs.

When the PyTorch profiler is on, every host op runs inside a
`torch.profiler.record_function` range named by its dump opcode and number
(`Communication 39 (Allgather)`, `matmul T6`, `Wait Communication 39`), and
on CUDA inside an NVTX range of the same name (also with `HOSTIR_NVTX=1`, for
Nsight Systems, which torch cannot detect). When a trace is recorded
(`HOSTIR_TRACE=DIR`, or `fd.execute(..., trace=DIR)`), every op also becomes
an event of a Chrome / Perfetto trace, one file per rank
(`DIR/hostir_trace_rank<R>.json`), with one track per stream: the caller's
stream and the worker streams `stream 0`, `stream 1`, ... of the loops. A
communication spans from its posting to the end of its `Wait`, on the track
of the stream it was posted on. On CUDA the times come from CUDA events on
the streams, so an event shows when the device ran the op; on the CPU they
are host times. Each event says its kind (compute, communication, copy,
sync, host), which `tools/plot_timeline.py` colours, and the program it
belongs to where that program has a label (`args.program`: the module of a
`hostir.parallel` Linear, as its dumps and log lines name it, such as
`(layers.0.mlp.up_proj, colwise nn.Linear) (backward)`).

With none of this on, the evaluator pays one `is None` test per op: the
observer that does the work is made only for runs that need it.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import json
import os
import pathlib
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Callable

import torch

from hostir import ir

__all__ = [
    "KINDS",
    "Trace",
    "op_kind",
    "op_name",
    "active_trace",
    "add_recorded_run",
    "traced_replay",
    "tracing",
    "trace_path",
    "write_env_trace",
]

KINDS = ir.EFFECTS


def op_kind(e: ir.Expr) -> str:
    """compute, communication, copy, sync or host (allocations, slices,
    loops): the op's declared effect."""
    return e.EFFECT


def op_name(e: ir.Expr) -> str:
    """The range name of an op: its dump opcode and number."""
    if isinstance(e, ir.Communication):
        return f"Communication {e.name} ({e.type.value})"
    if isinstance(e, ir.P2PCommunication):
        return f"P2PCommunication {e.name} ({e.type})"
    if isinstance(e, ir.EndCoalescing):
        return f"EndCoalescing {e.name}"
    if isinstance(e, ir.Transfer):
        return f"Transfer {e.name} ({e.direction})"
    if isinstance(e, ir.Wait):
        what = "Transfer" if isinstance(e.communication, ir.Transfer) else "Communication"
        return f"Wait {what} {getattr(e.communication, 'name', '?')}"
    if isinstance(e, ir.Synchronize):
        return f"Synchronize {_stream(e.stream)}"
    if isinstance(e, ir.SetCurrentStream):
        return f"SetCurrentStream to {_stream(e.stream)}"
    if isinstance(e, ir.ForLoop):
        return f"FOR {e.index.label or 'i'}"
    if isinstance(e, ir.BinaryOp):
        return f"{e.kind} T{e.out.name}"
    if isinstance(e, ir.ReductionOp):
        return f"{e.kind} T{e.out.name}"
    if isinstance(e, ir.MatmulOp):
        return f"matmul T{e.out.name}"
    if isinstance(e, ir.LinearOp):
        return f"linear T{e.out.name}"
    if isinstance(e, ir.Set):
        return f"Set T{e.out.name}"
    if isinstance(e, ir.HirAliasSelect):
        return f"HirAliasSelect T{e.out.name}"
    if isinstance(e, (ir.Allocate, ir.Deallocate)):
        return f"{type(e).__name__.upper()} T{e.buffer.name}"
    return type(e).__name__


def _stream(s: ir.Stream) -> str:
    return ir.format_stream(s)


# Names per program, computed once: an op's name is fixed after lowering.
_names: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


def _names_of(container: Any) -> dict[int, str]:
    names = _names.get(container)
    if names is None:
        names = _names[container] = {id(e): op_name(e) for e in container.walk()}
    return names


# ---------------------------------------------------------------- traces

TRACK_CALLER = "caller stream"


class Trace:
    """The events of one rank's runs, in the Chrome trace event format."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: list[dict[str, Any]] = []
        self._tracks: dict[str, int] = {}
        self._lock = threading.Lock()
        self.runs = 0

    def next_run(self) -> int:
        """The number of a new run (events carry it as `args.run`)."""
        with self._lock:
            self.runs += 1
            return self.runs - 1

    def track(self, label: str) -> int:
        tid = self._tracks.get(label)
        if tid is None:
            tid = self._tracks[label] = len(self._tracks)
        return tid

    def add(self, name: str, kind: str, track: str, start_us: float, end_us: float, **args: Any) -> None:
        event = {
            "name": name,
            "cat": kind,
            "ph": "X",
            "ts": start_us,
            "dur": max(end_us - start_us, 0.0),
            "pid": self.rank,
            "tid": self.track(track),
            "args": {"kind": kind, **args},
        }
        with self._lock:
            self.events.append(event)

    def to_json(self) -> dict[str, Any]:
        meta: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "args": {"sort_index": self.rank}},
        ]
        for label, tid in self._tracks.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": label}})
            meta.append(
                {"name": "thread_sort_index", "ph": "M", "pid": self.rank, "tid": tid, "args": {"sort_index": tid}}
            )
        return {"traceEvents": meta + self.events, "displayTimeUnit": "ms", "otherData": {"rank": self.rank}}

    def write(self, directory: str | os.PathLike[str]) -> pathlib.Path:
        path = trace_path(directory, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json()))
        return path


def trace_path(directory: str | os.PathLike[str], rank: int) -> pathlib.Path:
    """Where rank `rank`'s trace goes in `directory`."""
    return pathlib.Path(directory) / f"hostir_trace_rank{rank}.json"


_active: contextvars.ContextVar[Trace | None] = contextvars.ContextVar("hostir_trace", default=None)


@contextlib.contextmanager
def tracing(directory: str | os.PathLike[str], rank: int) -> Iterator[Trace]:
    """Record the runs inside the block and write them to `directory` as
    this rank's trace when it ends (also when it ends in an error)."""
    trace = Trace(rank)
    token = _active.set(trace)
    try:
        yield trace
    finally:
        _active.reset(token)
        trace.write(directory)


# HOSTIR_TRACE=DIR: one trace per process for all its runs, written at exit.
_env_trace: Trace | None = None
_env_dir: str | None = None
_env_read = False


def _env_trace_for(rank: int) -> Trace | None:
    global _env_trace, _env_dir, _env_read
    if not _env_read:
        _env_read = True
        _env_dir = os.environ.get("HOSTIR_TRACE") or None
    if _env_dir is None:
        return None
    if _env_trace is None:
        _env_trace = Trace(rank)
    return _env_trace


@atexit.register
def write_env_trace() -> pathlib.Path | None:
    """Write the `HOSTIR_TRACE` trace now (it is also written at exit)."""
    if _env_trace is None or _env_dir is None:
        return None
    return _env_trace.write(_env_dir)


def _nvtx_env() -> bool:
    return os.environ.get("HOSTIR_NVTX", "") not in ("", "0")


_NVTX = _nvtx_env()


# ---------------------------------------------------------------- the observer


def _now_us() -> float:
    return time.perf_counter_ns() / 1000.0


class Observer:
    """Wraps each op of one run in the ranges and trace events chosen.
    Made per run by `observer_for`; `finish` ends it."""

    def __init__(self, container: Any, streams: Any, rank: int, ranges: bool, nvtx: bool, trace: Trace | None):
        self.names = _names_of(container)
        self.streams = streams
        self.rank = rank
        self.ranges = ranges
        self.nvtx = nvtx
        self.trace = trace
        self.program = getattr(container, "label", "")
        self.track = TRACK_CALLER
        self.cuda = bool(getattr(streams, "is_cuda", False)) and trace is not None
        # Open communications: id(expr) -> (track, start).
        self._posted: dict[int, tuple[str, Any]] = {}
        # On CUDA: (name, kind, track, start event, end event, args) resolved at the end.
        self._pending: list[tuple[str, str, str, Any, Any, dict[str, Any]]] = []
        self._run = trace.next_run() if trace is not None else 0
        self._origin_us = _now_us()
        self._origin_event = self._event() if self.cuda else None

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def _stamp(self) -> Any:
        return self._event() if self.cuda else _now_us()

    def op(self, frame: Any, e: ir.Expr, run: Callable[[], None]) -> None:
        """Run `e` (by `run()`) inside its profiler range, NVTX range and
        trace event (an evaluator's `OpObserver`)."""
        name = self.names.get(id(e)) or op_name(e)
        if self.nvtx:
            torch.cuda.nvtx.range_push(name)  # type: ignore[no-untyped-call]
        try:
            if self.ranges:
                with torch.profiler.record_function(name):
                    self._timed(frame, e, run, name)
            else:
                self._timed(frame, e, run, name)
        finally:
            if self.nvtx:
                torch.cuda.nvtx.range_pop()  # type: ignore[no-untyped-call]

    def _timed(self, frame: Any, e: ir.Expr, run: Callable[[], None], name: str) -> None:
        if self.trace is None or isinstance(e, ir.ForLoop):
            run()
            return
        track = self.track
        start = self._stamp()
        run()
        end = self._stamp()
        kind = op_kind(e)
        if isinstance(e, ir.SetCurrentStream):
            self.track = self._label(frame, e.stream)
        if isinstance(e, (ir.Communication, ir.P2PCommunication, ir.EndCoalescing)):
            self._posted[id(e)] = (track, start)
        if isinstance(e, ir.Wait):
            posted = self._posted.pop(id(e.communication), None)
            if posted is not None:
                comm = e.communication
                self._record(self.names.get(id(comm)) or op_name(comm), "communication", posted[0], posted[1], end,
                             {"posted_to_wait": True})
        if not isinstance(e, (ir.Communication, ir.P2PCommunication, ir.EndCoalescing)):
            self._record(name, kind, track, start, end, {})

    def _label(self, frame: Any, stream: ir.Stream) -> str:
        if stream.index is None:
            return TRACK_CALLER
        return f"stream {int(frame.get(stream.index))}"

    def _record(self, name: str, kind: str, track: str, start: Any, end: Any, args: dict[str, Any]) -> None:
        assert self.trace is not None
        args["run"] = self._run
        if self.program:
            args["program"] = self.program
        if self.cuda:
            self._pending.append((name, kind, track, start, end, args))
            return
        self.trace.add(name, kind, track, start, end, **args)

    def finish(self) -> None:
        """Resolve the CUDA events of the run into trace events."""
        if not self.cuda or self.trace is None:
            return
        torch.cuda.synchronize()
        origin: Any = self._origin_event
        for name, kind, track, start, end, args in self._pending:
            start_us = self._origin_us + origin.elapsed_time(start) * 1000.0
            end_us = self._origin_us + origin.elapsed_time(end) * 1000.0
            self.trace.add(name, kind, track, start_us, end_us, **args)
        self._pending.clear()


def active_trace(rank: int) -> Trace | None:
    """The trace a run now records into: the open `tracing` block's, else
    `HOSTIR_TRACE`'s, else None."""
    trace = _active.get()
    return trace if trace is not None else _env_trace_for(rank)


def now_us() -> float:
    """The clock of trace events (µs): every rank of one machine shares it."""
    return _now_us()


def add_recorded_run(
    trace: Trace, container: Any, exprs: list[Any], records: list[tuple[Any, ...]], origin_us: float
) -> None:
    """One run that the C++ executor recorded, as trace events like the
    Python evaluator's: `records` are its (instruction, stream, waited
    instruction, start µs, end µs) from the run's start at `origin_us`,
    `exprs[i]` instruction i's op. A communication spans from its posting
    to the end of its `Wait`, on the track it was posted on."""
    names = _names_of(container)
    run = trace.next_run()
    program = getattr(container, "label", "")
    labelled = {"program": program} if program else {}
    posted: dict[int, tuple[str, float]] = {}
    for instr, track, waited, start, end in records:
        e = exprs[instr]
        label = TRACK_CALLER if track < 0 else f"stream {track}"
        if isinstance(e, (ir.Communication, ir.P2PCommunication, ir.EndCoalescing)):
            posted[instr] = (label, start)
            continue
        began = posted.pop(waited, None) if waited >= 0 else None
        if began is not None:
            comm = exprs[waited]
            trace.add(names.get(id(comm)) or op_name(comm), "communication", began[0], origin_us + began[1],
                      origin_us + end, posted_to_wait=True, run=run, runner="cpp", **labelled)
        trace.add(names.get(id(e)) or op_name(e), op_kind(e), label, origin_us + start, origin_us + end,
                  run=run, runner="cpp", **labelled)


_GRAPH_NOTE = (
    "a CUDA graph replays its ops as one launch, so a trace times the replay as a whole; "
    "trace an eager call (without cuda_graph) for its ops one by one"
)
_graph_note_said = False


def traced_replay(rank: int, replay: Callable[[], Any], what: str = "CUDA graph replay") -> Any:
    """Run `replay()` (a CUDA graph's), recorded as one event on the caller
    stream when a trace is active: the device time between events on the
    current stream before and after it. Says once, in the log, that the
    ops inside a replay are not timed one by one."""
    trace = active_trace(rank)
    if trace is None:
        return replay()
    global _graph_note_said
    if not _graph_note_said:
        _graph_note_said = True
        import logging

        logging.getLogger("hostir").warning("trace: %s", _GRAPH_NOTE)
    origin_us = _now_us()
    origin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    origin.record()
    result = replay()
    end.record()
    end.synchronize()
    trace.add(what, "compute", TRACK_CALLER, origin_us, origin_us + origin.elapsed_time(end) * 1000.0,
              run=trace.next_run(), runner="cuda_graph", note=_GRAPH_NOTE)
    return result


def tracing_active() -> bool:
    """Whether a `tracing(...)` block is open in this context."""
    return _active.get() is not None


def watched() -> bool:
    """Whether a run now would be watched by the profiler: only the Python
    evaluator opens a profiler range per op, so `auto` picks it then.
    (Traces come from both runners: the C++ executor records its ops
    itself.)"""
    return bool(torch.autograd._profiler_enabled())  # type: ignore[attr-defined]


def observer_for(container: Any, streams: Any, rank: int) -> Observer | None:
    """The observer of one run, or None when nothing watches it (profiler
    off, no NVTX, no trace): then the evaluator runs each op bare."""
    ranges = bool(torch.autograd._profiler_enabled())  # type: ignore[attr-defined]
    trace = _active.get()
    if trace is None:
        trace = _env_trace_for(rank)
    cuda = bool(getattr(streams, "is_cuda", False))
    nvtx = cuda and (ranges or _NVTX)
    if not ranges and not nvtx and trace is None:
        return None
    return Observer(container, streams, rank, ranges, nvtx, trace)
