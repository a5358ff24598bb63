"""The C++ executor (`hostir._C`) behind the evaluator interface.

`CppEvaluator` takes the same container as `HostIrEvaluator` and has the same
`run(bindings, number_of_streams)`: it compiles the container into a flat
program (`hostir.runtime.flat`) on first use — after the process groups of a
multi-device program exist — and runs it in C++. A failure comes back as the
failing instruction and its loop indices and is raised exactly as the Python
evaluator raises it: hostir's errors as a `HostIrRuntimeError` quoting the
op's dump line and the loop indices, torch's own errors with their type and
that text as a note, a timeout or lost peer keeping its type.

If the extension was not built or fails to import, `available()` is False,
`reason()` says why, and hostir runs on the Python evaluator (it says so once,
on stderr, when the C++ executor is first wanted).
"""

from __future__ import annotations

import builtins
import sys
import threading
from typing import Any, Mapping

import torch

from hostir import ir, printer
from hostir.communicator import CommunicatorTimeout, PeerLostError, classify_error
from hostir.container import HostIrContainer
from hostir.errors import HostIrError
from hostir.runtime.evaluator import BindingError, HostIrRuntimeError
from hostir.runtime import flat_dump, profiling
from hostir.runtime.flat import OPCODES, FlatProgram, compile_program
from hostir.runtime.transports import cuda
from hostir.runtime.transports.base import TransportUnsupported, TransportUsageError

try:
    from hostir import _C
except Exception as err:  # noqa: BLE001 - any failure to load means "not built"
    _C = None
    _REASON = f"{type(err).__name__}: {err}"
else:
    _REASON = None
    if _C.OPCODE_COUNT != len(OPCODES):
        _REASON = (
            f"hostir._C knows {_C.OPCODE_COUNT} opcodes but hostir.runtime.flat has {len(OPCODES)}: "
            f"rebuild the extension (pip install --no-build-isolation -e .)"
        )
        _C = None

_warned = False
_warn_lock = threading.Lock()


class CppUnavailableError(HostIrError, RuntimeError):
    """The C++ executor was asked for but is not built or does not load."""


def available() -> bool:
    """Whether the C++ executor is built and loads."""
    return _C is not None


def reason() -> str | None:
    """Why the C++ executor is unavailable (None if it is available)."""
    return _REASON


def warn_unavailable() -> None:
    """Say once per process that programs run on the Python evaluator, and why."""
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    sys.stderr.write(f"hostir: the C++ executor is unavailable ({_REASON}); running on the Python evaluator\n")


class CppEvaluator:
    """Runs one host program with the C++ executor, any number of times and
    from several threads at once (each run has its own frame in C++).
    `rank`: the rank the program was pruned for, as `HostIrEvaluator` takes it."""

    def __init__(
        self, container: HostIrContainer, streams=None, device="cpu", communicator=None, dumper=None, rank=None
    ):
        if _C is None:
            raise CppUnavailableError(f"the C++ executor is unavailable: {_REASON}")
        self.container = container
        self.rank = rank
        self.device = torch.device(device)
        self.communicator = communicator
        self.dumper = dumper
        self._lock = threading.Lock()
        self._flat: FlatProgram | None = None
        self._executor = None
        self._views: tuple[list, list] | None = None
        # Positions of the scalar inputs (bound as integers).
        self._scalar_inputs = {i for i, v in enumerate(container.inputs) if not isinstance(v, ir.TensorView)}
        if communicator is None:
            # Without process groups to wait for, compile now: errors such
            # as a missing communicator surface when the program is made.
            self._compile()

    def _compile(self):
        with self._lock:
            if self._executor is None:
                flat = compile_program(self.container, self.communicator, self.rank)
                if self.dumper is not None:
                    self.dumper.emit("flat_program", "Flat program:", flat.dump())
                opcodes = [OPCODES.index(i.op) for i in flat.instrs]
                executor = _C.Executor(flat, str(self.device), opcodes)
                if self._views is not None:
                    executor.set_views(*self._views)
                self._flat = flat
                self._executor = executor
        return self._executor

    def take_views(self, views: tuple[list, list]) -> None:
        """The conversions between a caller's logical tensors and the
        program's (`Binding.views`), for `run_logical`."""
        with self._lock:
            self._views = views
            if self._executor is not None:
                self._executor.set_views(*views)

    @property
    def flat(self) -> FlatProgram:
        self._compile()
        return self._flat

    @property
    def ops_executed(self) -> int:
        return 0 if self._executor is None else self._executor.ops_executed

    def run(self, bindings: Mapping[Any, Any], number_of_streams: int = 4) -> list:
        """As `HostIrEvaluator.run`."""
        if isinstance(number_of_streams, bool) or not isinstance(number_of_streams, int) or number_of_streams < 1:
            raise BindingError(f"number_of_streams must be an integer >= 1, got {number_of_streams!r}")
        c = self.container
        inputs = []
        for tv in c.inputs:
            value = bindings[tv]
            if isinstance(tv, ir.InputScalar):
                if not tv.accepts(value):
                    raise BindingError(f"scalar input {printer.format_val(tv)} takes a {tv.dtype}, got {value!r}")
            elif not isinstance(value, torch.Tensor):
                raise BindingError(
                    f"{printer.format_tv(tv)} must be bound to a torch.Tensor, got {type(value).__name__}"
                )
            inputs.append(value)
        outputs = [bindings.get(tv) for tv in c.outputs] if len(bindings) > len(c.inputs) else []
        return self.run_tensors(inputs, outputs, number_of_streams)

    def run_tensors(self, inputs: list, outputs: list, number_of_streams: int) -> list:
        """`run` with the values as lists: one tensor per program input, and
        one per output to write into (None: not preallocated) or none at all."""
        executor = self._executor or self._compile()
        if self._scalar_inputs:
            # The executor binds a scalar input's integer slot from a 0-d tensor.
            inputs = [torch.tensor(int(v)) if i in self._scalar_inputs else v for i, v in enumerate(inputs)]
        # Every error comes back as a failure tuple (no C++ exception crosses
        # into Python); instruction -1 is a bad binding, before any op runs.
        if self._watched():
            values, failure = self._traced(executor, lambda: executor.run(inputs, outputs, number_of_streams))
        else:
            values, failure = executor.run(inputs, outputs, number_of_streams)
        if failure is not None and failure[2] == "WindowsNeeded":
            self._provide_windows(failure[3])
            values, failure = executor.run(inputs, outputs, number_of_streams)
        if failure is not None:
            raise self._error(*failure)
        for tv, slot, value in zip(self.container.outputs, self._flat.outputs, values):
            if value is None and slot >= 0:
                raise HostIrRuntimeError(f"output {printer.format_tv(tv)} is not bound at the end of the program")
        return values

    def run_logical(self, inputs: list, number_of_streams: int, gate=None) -> list:
        """`run_tensors` on tensors with the fusion's logical axes, with no
        outputs to write into: the C++ executor views them with the
        program's runtime axes, and its results with logical axes, by the
        conversions `take_views` gave it (one call for what `Binding` does
        in three). For calls with no scalar input. `gate` (a prepared
        call's `protocol.PostedStep`) is asked right before the run's first
        communication and settled after the run: where the ranks' steps
        differ the run stops there, and settling raises what differs on
        every rank (or, where the full record agrees after all, the call
        runs again)."""
        executor = self._executor or self._compile()
        if self._watched():
            values, failure = self._traced(executor, lambda: executor.run_logical(inputs, number_of_streams, gate))
        else:
            values, failure = executor.run_logical(inputs, number_of_streams, gate)
        if failure is not None and failure[2] == "WindowsNeeded":
            # Making windows exchanges them among the ranks: not before the
            # ranks are known to be in step.
            if gate is not None and not gate():
                gate.settle()
                return self.run_logical(inputs, number_of_streams)
            self._provide_windows(failure[3])
            values, failure = executor.run_logical(inputs, number_of_streams)
        if failure is not None and failure[2] == "StepGate":
            gate.settle()
            return self.run_logical(inputs, number_of_streams)
        if failure is not None:
            raise self._error(*failure)
        if gate is not None:
            gate.settle()
        for tv, slot, value in zip(self.container.outputs, self._flat.outputs, values):
            if value is None and slot >= 0:
                raise HostIrRuntimeError(f"output {printer.format_tv(tv)} is not bound at the end of the program")
        return values

    def _provide_windows(self, needed: str) -> None:
        """The copy-engine windows a run found missing before its first
        instruction (a program's first call, or a new size): made and handed
        over by the cuda transport, after which the run goes again."""
        cuda.provide_windows(self._executor, self.container, self.communicator, self.device, needed)

    def _watched(self) -> bool:
        """Whether a trace or the `communication` dump watches a run now."""
        if self.dumper is not None and self.dumper.enabled("communication"):
            return True
        return profiling.active_trace(self.rank or 0) is not None

    def _traced(self, executor, run):
        """`run()`, recorded op by op into the active trace if there is one
        (`HOSTIR_TRACE`, `execute(trace=...)`), and its collectives printed
        where the `communication` dump is on (as the Python evaluator
        prints them when it posts them); not under a CUDA graph's capture,
        where an event cannot be waited for."""
        trace = profiling.active_trace(self.rank or 0)
        dumping = self.dumper is not None and self.dumper.enabled("communication")
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return run()
        executor.set_tracing(True)
        origin = profiling.now_us()
        try:
            return run()
        finally:
            executor.set_tracing(False)
            exprs = [i.expr for i in self._flat.instrs]
            for records in executor.take_trace():
                if dumping:
                    flat_dump.dump_postings(self.dumper, exprs, records)
                if trace is not None:
                    profiling.add_recorded_run(trace, self.container, exprs, [r[:5] for r in records], origin)

    def _error(self, instr: int, loops: list, kind: str, message: str) -> Exception:
        if instr < 0:
            # Before the first op: binding the caller's values, or the
            # copy-engine windows on a device without CUDA.
            if kind == "TransportUnsupported":
                return TransportUnsupported(message)
            return BindingError(message) if kind == "BindingError" else HostIrRuntimeError(f"{kind}: {message}")
        flat = self._flat
        expr = flat.instrs[instr].expr
        where = printer.format_expr_head(expr) + "".join(
            f"\n  in loop {flat.int_names[slot]} = {value}" for slot, value in loops
        )
        if kind.startswith("Communication:"):
            kind = kind.split(":", 1)[1]
            target = expr.communication if isinstance(expr, ir.Wait) else expr
            comm = self.communicator
            err = classify_error(
                RuntimeError(message), printer.format_expr_head(target), rank=comm.rank, timeout=comm.timeout
            )
            if isinstance(err, (CommunicatorTimeout, PeerLostError)):
                return type(err)(f"{err}\nWhile executing:\n{where}")
        if kind == "TransportUnsupported":
            return TransportUnsupported(f"{printer.format_expr_head(expr)}: {message}")
        if kind == "TransportUsageError":
            return TransportUsageError(f"{message}\nWhile executing:\n{where}")
        if kind in _HOSTIR_KINDS:
            return HostIrRuntimeError(f"{kind}: {message}\nWhile executing:\n{where}")
        # torch's own error keeps its type; a note names the op (PEP 678).
        err = _torch_error(kind)(message)
        err.add_note(f"While executing:\n{where}")
        return err


# Errors of hostir's own that the executor reports by name (the Python
# evaluator raises these classes; both wrap them in HostIrRuntimeError).
_HOSTIR_KINDS = {"UnboundValueError", "BindingError", "ProgramError", "ShapeError"}


def _torch_error(kind: str) -> type:
    """The Python class of an error torch raised in C++ (as torch's own
    bindings translate it)."""
    import torch.distributed as dist

    found = getattr(builtins, kind, None) or getattr(torch, kind, None) or getattr(dist, kind, None)
    if isinstance(found, type) and issubclass(found, Exception):
        return found
    return RuntimeError
