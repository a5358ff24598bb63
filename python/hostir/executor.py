"""Run a fusion: one path for one rank or many.

`FusionExecutor.execute` takes every call through the same steps:

1. normalize: the parameters, the inputs and outputs as lists, the device
   to run on (a CPU input of a program that runs on a GPU is copied there);
2. check: every input and preallocated output against the fusion, before
   any work starts;
3. program: the lowered program for the inputs' signature (dtypes, ranks,
   device, contiguity, and the sizes of the axes marked static — no other
   sizes: extents are symbolic, so one program serves every shape), lowered
   on a miss; with `HOSTIR_FAKE=auto` (the default) each new input shape of
   a multi-device program is dry-run once (every rank, on meta tensors), so
   that a cross-rank error comes before any data moves (a single-device
   program has none to catch: its real run raises what a dry run would);
4. agree and make groups: for a multi-device fusion, the ranks exchange a
   fixed-size record (`agreement.py`) — the call, the program, the inputs'
   shapes and any local error — and every rank raises together if they
   differ; then they create the process groups the program needs. Nothing
   to do for one rank;
5. bind the inputs and outputs (a rank's pieces viewed with loop axes);
6. run with the evaluator, in a frame of its own, without autograd: the
   Python reference (`HostIrEvaluator`) or the C++ executor (`hostir.cpp`),
   both built from the same lowered container; with `cuda_graph=True` the
   run is captured once per exact input signature and replayed
   (`hostir.graphs`);
7. convert the results back to the fusion's logical axes.

A single-device call whose exact signature (every tensor's type, shape,
strides, dtype, device and requires_grad; the parameters; the variables
that pick the evaluator and the dry run) already ran goes from its record
to step 6 (`hostir.prepared`): steps 1-3 decided nothing else for it but
whether a preallocated output shares memory with an input, which the record
checks again on every call.

A failure in steps 1-3 on one rank of a multi-device fusion is carried by
step 4 to every rank, so all raise the same error instead of one raising and
the others waiting in a collective.

With `HOSTIR_FAKE=1`, execute returns the dry run's meta tensors instead and
runs nothing (no process group is made). A dry-run report depends on every
size, so it is kept per exact input shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import warnings
from typing import Sequence

import torch

from hostir import communicator, cpp, flat, ir, layout, prepared, printer, profiling, schedule
from hostir.agreement import Offer, RankMismatchError, check, exchange, input_signature
from hostir.container import HostIrContainer
from hostir.errors import HostIrError, UsageError
from hostir.evaluator import HostIrEvaluator
from hostir.graphs import CudaGraphs
from hostir.log import logger
from hostir.lower import RESHARDING_MODES, lower
from hostir.options import EVALUATORS, Dumper, evaluator_choice, fake_mode
from hostir.streams import streams_for

CHECK_RANKS = ("always", "first")

__all__ = [
    "CHECK_RANKS",
    "EVALUATORS",
    "ExecuteArgumentError",
    "ExecutorParams",
    "FusionExecutor",
    "InputError",
    "InputTypeError",
    "RankMismatchError",
]


class InputError(HostIrError, ValueError):
    """An input or preallocated output does not fit the fusion."""


class InputTypeError(HostIrError, TypeError):
    """An input, output or parameter of `execute` is of the wrong type or dtype."""


class ExecuteArgumentError(HostIrError, ValueError):
    """A bad execution parameter, or a fusion that needs more ranks than run."""


@dataclasses.dataclass
class ExecutorParams:
    """How to run a program.

    number_of_streams: worker streams a stream-parallel loop cycles through
        (`numberOfStreams` in the dump); at least 1.
    evaluator: "python" (the reference interpreter), "cpp" (the C++
        executor, an error if it is not built) or "auto" (C++ when built);
        by default HOSTIR_EVALUATOR, else "auto".
    cuda_graph: capture the run as a CUDA graph on first use for each exact
        input signature (sizes included) and replay it after; CUDA and NCCL
        only. Outputs of a replay are the graph's own tensors (or the
        caller's preallocated ones); inputs are copied into the graph's
        buffers unless the caller passes those buffers.
    device: where to run; by default, for a multi-device program, the
        communicator's (cuda:local_rank or cpu), else the device of the
        first input on a GPU, else that of input 0. CPU inputs of a program
        that runs on a GPU are copied there (with one warning per fusion).
    backend: "nccl" or "gloo" for a multi-device program; by default nccl
        where CUDA is available. Used when the communicator is created.
    timeout: seconds any collective may wait for a peer (default
        HOSTIR_TIMEOUT, else 300). Used when the communicator is created.
    check_ranks: "always" (default) makes the ranks agree before every run
        of a multi-device program, in one small collective on a control
        group: on the call (a rank that skipped or repeated an execute of a
        fusion makes every rank raise), the program, their inputs' shapes
        and dtypes, and any local error. "first" agrees only when a rank
        lowers a program; it saves that collective but turns these
        protections off: a rank that alone fails its checks, skips a call or
        changes its input shapes then meets the others' collectives out of
        step, and the job ends in a timeout or returns wrong data.
    resharding: where an op that would both compute and move data between
        ranks gets its resharding `set` (lower/insert_reshardings.py):
        "auto" (default) on the side that moves fewer elements, "before"
        or "after" the op where possible, or "strict", which refuses such
        an op and asks for an explicit `fd.ops.set`.
    schedule: how a device axis walked as a stream axis runs: a
        `hostir.schedule.Schedule` or its text (`ring:chunks=2`,
        `collective`, `sequential`, ...); by default `HOSTIR_SCHEDULE`, else
        the machine model's choice for the inputs' shapes.
    """

    number_of_streams: int = 4
    evaluator: str | None = None
    device: torch.device | str | None = None
    backend: str | None = None
    timeout: float | None = None
    check_ranks: str = "always"
    resharding: str = "auto"
    schedule: object = None
    cuda_graph: bool = False

    def validate(self) -> None:
        n = self.number_of_streams
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ExecuteArgumentError(f"number_of_streams must be an integer >= 1, got {n!r}")
        if self.evaluator is not None and self.evaluator not in EVALUATORS:
            raise ExecuteArgumentError(f"unknown evaluator {self.evaluator!r}; expected one of {list(EVALUATORS)}")
        if not isinstance(self.cuda_graph, bool):
            raise InputTypeError(f"cuda_graph must be True or False, got {self.cuda_graph!r}")
        if self.check_ranks not in CHECK_RANKS:
            raise ExecuteArgumentError(f"check_ranks must be one of {list(CHECK_RANKS)}, got {self.check_ranks!r}")
        if self.resharding not in RESHARDING_MODES:
            raise ExecuteArgumentError(f"resharding must be one of {list(RESHARDING_MODES)}, got {self.resharding!r}")

    def evaluator_name(self) -> str:
        """"python" or "cpp": the evaluator this run uses."""
        choice = self.evaluator if self.evaluator is not None else evaluator_choice()
        if choice == "python":
            return "python"
        if choice == "auto" and profiling.watched():
            # The profiler's ranges and traces come from the Python evaluator.
            return "python"
        if cpp.available():
            return "cpp"
        if choice == "cpp":
            raise ExecuteArgumentError(
                f"evaluator='cpp' was requested but the C++ executor is unavailable: {cpp.reason()}"
            )
        cpp.warn_unavailable()
        return "python"

    @classmethod
    def from_arguments(cls, params: ExecutorParams | None, kwargs: dict) -> ExecutorParams:
        """`params`, or one made of keyword arguments (not both)."""
        if params is not None and kwargs:
            raise InputTypeError("pass either params or keyword arguments, not both")
        if params is not None:
            if not isinstance(params, ExecutorParams):
                raise InputTypeError(f"params must be an ExecutorParams, got {type(params).__name__}")
            return params
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise InputTypeError(f"unknown execution parameters {unknown}; expected some of {sorted(fields)}")
        return cls(**kwargs)


@dataclasses.dataclass
class _Program:
    container: HostIrContainer
    evaluator: HostIrEvaluator | cpp.CppEvaluator
    # Input axes that ops iterate together: their sizes must be equal.
    equal_axes: list[list[tuple[int, int]]]
    # (input, axis, size) of every static axis: the sizes this program was
    # made for, part of its key.
    static_sizes: tuple = ()
    # Dry-run reports of this program, per exact input shapes (and number
    # of streams): a report holds every size, so it serves no other.
    reports: dict = dataclasses.field(default_factory=dict)


_MAX_REPORTS = 64


@dataclasses.dataclass
class _Call:
    """One call, normalized and checked, ready to bind and run."""

    program: _Program
    inputs: list
    outputs: list | None
    lowered: bool


class FusionExecutor:
    """Runs one fusion: its lowered programs (one per input signature) and,
    for a multi-device fusion, its place in the ranks' call sequence. Safe to
    call from several threads at once; the runs of a multi-device fusion
    take the communicator one at a time (a second thread gets a clear error)."""

    def __init__(self, fusion: ir.Fusion):
        self.fusion = fusion
        self._programs: dict[tuple, _Program] = {}
        self._version = fusion.version
        self._streams: dict[torch.device, object] = {}
        self._lock = threading.Lock()
        self._comm = None
        self.lowerings = 0
        self._multi_device_at: int | None = None
        self._is_multi_device = False
        # (communicator, this fusion's number on it, calls made so far)
        self._sequence: tuple[object, int, int] | None = None
        self._warned: set[str] = set()
        self.dry_runs = 0
        self._fake_reports: dict = {}
        self._graphs = CudaGraphs()
        self._prepared = prepared.PreparedCalls(self._lock)

    @property
    def num_programs(self) -> int:
        """Programs cached for the fusion as it is now."""
        return len(self._programs) if self._version == self.fusion.version else 0

    def host_program(self, resharding: str = "auto") -> HostIrContainer:
        """The program the fusion lowers to now (for a multi-device fusion,
        this rank's program), with `resharding` as ExecutorParams takes it."""
        if is_multi_device(self.fusion):
            rank = communicator.rank()
            backend = _BACKEND_NAMES["nccl" if torch.cuda.is_available() else "gloo"]
            return lower(self.fusion, rank=rank, backend=backend, resharding=resharding)
        return lower(self.fusion, resharding=resharding)

    def host_ir(self, resharding: str = "auto") -> str:
        """The dump of `host_program(resharding)`."""
        return str(self.host_program(resharding))

    def execute(
        self,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor] | None = None,
        params: ExecutorParams | None = None,
        **kwargs,
    ) -> list[torch.Tensor | None]:
        """Run the fusion on `inputs` (see the module's docstring for the
        steps). `params`, or keyword arguments naming its fields."""
        key = None
        if not self._multi_device():
            key = prepared.signature(inputs, outputs, params, kwargs)
            ready = None if key is None else self._prepared.get(key, self.fusion.version)
            if ready is not None:
                results = ready.run(inputs, outputs)
                if results is not None:
                    return results
        mode = fake_mode()
        if mode == "1":
            return self._execute_fake(inputs, outputs, params, kwargs)
        if key is not None:
            # A single-device call of a new signature: the full path, then
            # its record for the next call (the same depth of calls as
            # below, for the warnings' stack levels).
            # No dry run under `auto`: a single-device program has no
            # cross-rank error for it to catch, and its real run raises
            # every error the dry run would.
            params = ExecutorParams.from_arguments(params, kwargs)
            call = self._prepare(inputs, outputs, params, None, dry_run=False)
            results = self._run(call, params, None)
            self._keep(key, call, params, inputs)
            return results
        if mode == "auto" and self._multi_device():
            # The dry run below comes after the rendezvous: load its imports meanwhile.
            from hostir.analysis.dry_run import warm_up

            warm_up()
        comm, error = self._communicator(params, kwargs) if self._multi_device() else (None, None)
        with _exclusive(comm):
            sequence = self._next_call(comm) if comm is not None else None
            call = None
            try:
                if error is not None:
                    raise error
                params = ExecutorParams.from_arguments(params, kwargs)
                call = self._prepare(inputs, outputs, params, comm, dry_run=mode == "auto" and comm is not None)
            except Exception as err:
                if comm is None or _agrees_first_only(params):
                    raise
                error = err
            if comm is not None:
                self._agree(comm, sequence, call, inputs, error, _agrees_first_only(params))
            return self._run(call, params, comm)

    def graph_inputs(
        self,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor] | None = None,
        params: ExecutorParams | None = None,
        **kwargs,
    ) -> list[torch.Tensor]:
        """The captured graph's own input buffers for the call
        `execute(inputs, outputs, params, **kwargs)` with cuda_graph=True,
        running that call once first if its graph is not captured yet.
        Write new values into them and pass them to `execute` with the same
        arguments: the replay then copies no input."""
        if self._multi_device():
            raise UsageError(
                "graph_inputs is for single-device programs; a multi-device program's graphs are "
                "captured with hostir.graphs.capture(fd, inputs), whose inputs are the ones it was given"
            )
        chosen = ExecutorParams.from_arguments(params, dict(kwargs))
        if not chosen.cuda_graph:
            raise UsageError("graph_inputs returns a CUDA graph's input buffers: pass cuda_graph=True")
        key = prepared.signature(inputs, outputs, params, kwargs)
        if key is None:
            raise UsageError(
                "graph_inputs needs a call that can be replayed from its record: plain tensors in lists, "
                "no profiler, trace or DEBUG log watching, HOSTIR_FAKE unset, auto or 0"
            )
        ready = self._prepared.get(key, self.fusion.version)
        if ready is None:
            self.execute(inputs, outputs, params, **kwargs)
            ready = self._prepared.get(key, self.fusion.version)
        if ready is None or ready.graph_inputs is None:
            raise UsageError(
                "the call was not kept for replay (inputs on the CPU are copied to the GPU on every call): "
                "pass inputs on the program's device"
            )
        return list(ready.graph_inputs)

    def _keep(self, key: tuple, call: _Call, params: ExecutorParams, inputs) -> None:
        """Keep the record of a single-device call that took the full path
        and ran, under its signature `key`. (Not a call whose CPU inputs
        were copied to the GPU: the full path warns and copies.)"""
        if not all(a is b for a, b in zip(call.inputs, inputs)):
            return
        output_tvs = call.program.container.outputs

        def check_no_overlap(outs, ins):
            _check_no_overlap(self.fusion, outs, ins, output_tvs)

        self._prepared.put(key, prepared.prepare(self, call, params, check_no_overlap))

    # -- 1-3: normalize, check, program
    def _prepare(self, inputs, outputs, params: ExecutorParams, comm, dry_run: bool = True) -> _Call:
        params.validate()
        inputs, outputs = self._as_lists(inputs, outputs)
        if comm is not None:
            check_world(self.fusion, comm.world_size)
        device = self._device(inputs, params, comm)
        inputs = self._place(inputs, device)
        if comm is not None:
            # Never hand a strided view to a collective (gloo would read the
            # wrong memory): compact first, which also keeps contiguity out
            # of the program cache's key so that all ranks hit or miss it
            # together.
            inputs = [t.contiguous() if isinstance(t, torch.Tensor) else t for t in inputs]
        device = check_inputs(self.fusion, inputs, device, sharded=comm is not None)
        self._warn_requires_grad(inputs)
        program, lowered = self._program(inputs, device, params, comm)
        sizes = check_sizes(self.fusion, inputs, program.equal_axes)
        check_reductions(self.fusion, sizes)
        check_chunks(program.container, sizes)
        if outputs is not None:
            check_outputs(self.fusion, outputs, inputs, sizes, device, program.container.outputs)
        if dry_run:
            self._dry_run(program, inputs, params, comm.world_size if comm is not None else 1)
        return _Call(program, inputs, outputs, lowered)

    # -- the dry run
    def _dry_run(self, program: _Program, inputs, params: ExecutorParams, world_size: int):
        """Dry-run `program` once per exact input shape; raise its error."""
        from hostir.analysis.dry_run import DryRunReport, dry_run, run_rank

        key = (input_key(inputs), params.number_of_streams)
        report = program.reports.get(key)
        if report is not None:
            return report
        if world_size == 1 and not self._multi_device():
            # One device: no ranks to match, the program is lowered, and an
            # error is the one the real run would raise.
            only = run_rank(
                self.fusion,
                inputs,
                0,
                1,
                params.number_of_streams,
                multi=False,
                container=program.container,
                raw_errors=True,
            )
            report = DryRunReport(1, params.number_of_streams, [only])
        else:
            report = dry_run(
                self.fusion,
                inputs,
                world_size=world_size,
                number_of_streams=params.number_of_streams,
                backend=program.container.backend,
                schedule=program.container.schedule,
                resharding=params.resharding,
            )
        self.dry_runs += 1
        with self._lock:
            if len(program.reports) >= _MAX_REPORTS:
                program.reports.pop(next(iter(program.reports)))
            program.reports[key] = report
        return report

    def _execute_fake(self, inputs, outputs, params, kwargs) -> list[torch.Tensor | None]:
        """HOSTIR_FAKE=1: this rank's outputs as meta tensors, from a dry run
        of every rank; nothing runs and no process group is made. Without a
        launcher, this process plays rank 0 of as many ranks as the
        fusion's meshes name."""
        from hostir.analysis.dry_run import dry_run

        params = ExecutorParams.from_arguments(params, kwargs)
        params.validate()
        inputs, outputs = self._as_lists(inputs, outputs)
        rank, world = 0, 1
        if self._multi_device():
            launch = communicator.discover()
            rank, world = launch.rank, launch.world_size
            needed = ranks_needed(self.fusion)
            if world == 1 and needed > 1:
                world = needed
        key = (self.fusion.version, input_key(inputs), world, params.number_of_streams, params.resharding)
        with self._lock:
            report = self._fake_reports.get(key)
        if report is None:
            report = dry_run(
                self.fusion,
                inputs,
                world_size=world,
                number_of_streams=params.number_of_streams,
                resharding=params.resharding,
            )
            self.dry_runs += 1
            with self._lock:
                if len(self._fake_reports) >= _MAX_REPORTS:
                    self._fake_reports.pop(next(iter(self._fake_reports)))
                self._fake_reports[key] = report
        return [
            None if shape is None else torch.empty(shape, dtype=tv.dtype, device="meta")
            for tv, (_, shape, _) in zip(self.fusion.outputs, report[rank].outputs)
        ]

    def _device(self, inputs: list, params: ExecutorParams, comm) -> torch.device:
        if params.device is not None:
            device = torch.device(params.device)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            return device
        if comm is not None:
            return comm.device
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t.device.type == "cuda":
                return t.device
        return tensors[0].device if tensors else torch.device("cpu")

    def _place(self, inputs: list, device: torch.device) -> list:
        """Copy CPU inputs to `device` if the program runs elsewhere (one
        warning per fusion names them and the bytes copied)."""
        if device.type != "cuda":
            return inputs
        moved = [
            i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.device.type == "cpu"
        ]
        if not moved:
            return inputs
        if "copy" not in self._warned:
            self._warned.add("copy")
            names = ", ".join(f"{i} (T{self.fusion.inputs[i].name})" for i in moved if i < len(self.fusion.inputs))
            size = sum(inputs[i].numel() * inputs[i].element_size() for i in moved)
            warnings.warn(
                f"inputs {names} are on the CPU but the fusion runs on {device}: copied there "
                f"({size} bytes this call); pass them on {device} to avoid the copy",
                stacklevel=5,
            )
        return [t.to(device) if i in moved else t for i, t in enumerate(inputs)]

    def _warn_requires_grad(self, inputs: list) -> None:
        if "grad" in self._warned:
            return
        grads = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if grads:
            self._warned.add("grad")
            warnings.warn(
                f"inputs {grads} require grad, but fusions run without autograd: their outputs do not "
                f"require grad and nothing is recorded for backward",
                stacklevel=5,
            )

    def _multi_device(self) -> bool:
        """`is_multi_device(fusion)`, computed once per fusion version."""
        if self._multi_device_at != self.fusion.version:
            self._multi_device_at = self.fusion.version
            self._is_multi_device = is_multi_device(self.fusion)
        return self._is_multi_device

    def _as_lists(self, inputs, outputs) -> tuple[list, list | None]:
        inputs = _as_list(inputs, "inputs")
        if outputs is not None:
            outputs = _as_list(outputs, "outputs")
            if all(t is None for t in outputs) and len(outputs) == len(self.fusion.outputs):
                outputs = None
        return inputs, outputs

    def _program(self, inputs, device: torch.device, params: ExecutorParams, comm=None) -> tuple[_Program, bool]:
        static = tuple(
            (i, axis, inputs[i].shape[axis])
            for i, tv in enumerate(self.fusion.inputs)
            for axis in getattr(tv, "static_dims", ())
        )
        evaluator = params.evaluator_name()
        chosen = schedule.for_inputs(self.fusion, inputs, comm, params.schedule)
        key = (
            tuple(
                (t.dtype, t.dim(), t.is_contiguous()) if isinstance(t, torch.Tensor) else "scalar"
                for t in inputs
            ),
            device,
            evaluator,
            params.resharding,
            static,
            None if chosen is None else chosen.key(),
        )
        with self._lock:
            # A program holds the communicator it was lowered for: after a
            # shutdown and a new communicator, lower again.
            if self.fusion.version != self._version or comm is not self._comm:
                self._programs.clear()
                self._version = self.fusion.version
                self._comm = comm
            program = self._programs.get(key)
            debug = logger.isEnabledFor(logging.DEBUG)
            if program is not None:
                if debug:
                    logger.debug("program cache hit for %s on %s", _key_text(key), device)
                return program, False
            if debug:
                logger.debug("program cache miss for %s on %s: lowering", _key_text(key), device)
            strict = (params.evaluator or evaluator_choice()) == "cpp"
            program = self._programs[key] = self._lower(device, evaluator, comm, chosen, params.resharding, strict)
            program.static_sizes = static
            return program, True

    def _lower(
        self, device: torch.device, evaluator: str, comm=None, chosen=None, resharding: str = "auto", strict=False
    ) -> _Program:
        rank = comm.rank if comm is not None else 0
        dumper = Dumper(rank)
        dumper.emit("fusion_ir", "Fusion:", printer.print_fusion(self.fusion))
        if comm is None:
            container = lower(self.fusion, dumper, resharding=resharding)
        else:
            container = lower(
                self.fusion,
                dumper,
                rank=comm.rank,
                backend=_BACKEND_NAMES[comm.backend],
                schedule=chosen,
                resharding=resharding,
            )
        dumper.emit("host_ir", "Host program:", str(container))
        self.lowerings += 1
        streams = self._streams.get(device)
        if streams is None:
            streams = self._streams[device] = streams_for(device)
        if evaluator == "cpp" and not strict and flat.unsupported(container) is not None:
            # "auto": a program with ops the C++ executor lacks (a copy-engine
            # transport, chunked views) runs on the Python evaluator.
            evaluator = "python"
        make = cpp.CppEvaluator if evaluator == "cpp" else HostIrEvaluator
        run = make(container, streams=streams, device=device, communicator=comm, dumper=dumper)
        if logger.isEnabledFor(logging.INFO):
            exprs = list(container.walk())
            comms = sum(isinstance(e, ir.Communication) for e in exprs)
            logger.info(
                "lowered fusion %s to a host program of %d ops (%d communications), digest %s; "
                "evaluator %s on %s with %s",
                signature(self.fusion), len(exprs), comms, (getattr(container, "digest", None) or "")[:12],
                type(run).__name__, device, type(streams).__name__,
            )
        return _Program(container, run, equal_input_axes(self.fusion))

    # -- 4: agree and make groups
    def _communicator(self, params, kwargs):
        """The process-wide communicator, and the error of asking for it
        with parameters that differ from the live one's (shared with the
        other ranks like any local error); with no live communicator, its
        creation error is raised here (the launch is broken on this rank)."""
        backend = kwargs.get("backend", getattr(params, "backend", None))
        timeout = kwargs.get("timeout", getattr(params, "timeout", None))
        error = None
        try:
            comm = communicator.get(backend=backend, timeout=timeout)
        except HostIrError as err:
            comm = communicator.live()
            if comm is None:
                raise
            error = err
        if comm.failure is not None:
            raise communicator.CommunicatorError(
                f"an earlier collective failed on this rank, so the ranks' collectives are out of step: "
                f"{comm.failure.splitlines()[0]}\nend the job (or call hostir.communicator.shutdown() on "
                f"every rank and start again)"
            )
        return comm, error

    def _next_call(self, comm) -> tuple[int, int]:
        """This fusion's number on `comm` and the number of this call."""
        if self._sequence is None or self._sequence[0] is not comm:
            self._sequence = (comm, comm.next_fusion_number(), 0)
        _, fusion, calls = self._sequence
        self._sequence = (comm, fusion, calls + 1)
        return fusion, calls

    def _agree(self, comm, sequence, call: _Call | None, inputs, error, first_only: bool) -> None:
        if first_only and not call.lowered:
            # No agreement: each rank makes the groups it lacks (a
            # collective of its own, which checks the teams).
            if comm.missing_teams(call.program.container.all_teams):
                comm.ensure_groups(call.program.container.all_teams)
            return
        teams = call.program.container.all_teams if call is not None else []
        offer = Offer(
            fusion=sequence[0],
            call=sequence[1],
            digest=call.program.container.digest if call is not None else None,
            inputs=input_signature(call.inputs if call is not None else inputs),
            error=None if error is None else f"{type(error).__name__}: {error}",
            needs_groups=bool(comm.missing_teams(teams)),
            rank=comm.rank,
        )
        try:
            records = exchange(comm, offer)
        except (communicator.CommunicatorTimeout, communicator.PeerLostError) as err:
            comm.failure = f"{type(err).__name__}: {err}"
            raise type(err)(
                f"the ranks' check of the program and its inputs, before running it, failed: {err}"
            ) from err
        if check(records, cause=error):
            comm.ensure_groups(teams)

    # -- 5-7: bind, run, convert back
    def _run(self, call: _Call, params: ExecutorParams, comm) -> list[torch.Tensor | None]:
        container = call.program.container
        bindings = {
            tv: layout.to_runtime(tv, t) if isinstance(tv, ir.TensorView) else t
            for tv, t in zip(container.inputs, call.inputs)
        }
        if call.outputs is not None:
            for tv, t in zip(container.outputs, call.outputs):
                bindings[tv] = layout.to_runtime(tv, t)
        try:
            with torch.no_grad():
                if params.cuda_graph:
                    device = comm.device if comm is not None else _device_of(call.inputs)
                    backend = comm.backend if comm is not None else None
                    results = self._graphs.run(call.program, bindings, params.number_of_streams, device, backend)
                else:
                    results = call.program.evaluator.run(bindings, number_of_streams=params.number_of_streams)
        except (communicator.CommunicatorTimeout, communicator.PeerLostError) as err:
            if comm is not None:
                comm.failure = f"{type(err).__name__}: {err}"
            raise
        return [None if r is None else layout.to_logical(tv, r) for tv, r in zip(container.outputs, results)]


def input_key(inputs: list) -> tuple:
    """Exact shapes and dtypes of the inputs: the key of size-dependent
    artifacts such as a dry-run report."""
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else (type(t).__name__,) for t in inputs)


def ranks_needed(fusion: ir.Fusion) -> int:
    """How many ranks the meshes of `fusion` name (1 without a mesh)."""
    tvs = list(fusion.inputs) + [v for e in fusion.exprs for v in e.outputs()]
    return max((max(tv.mesh.devices) + 1 for tv in tvs if getattr(tv, "mesh", None) is not None), default=1)


def _device_of(inputs: list) -> torch.device:
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


def _agrees_first_only(params) -> bool:
    return isinstance(params, ExecutorParams) and params.check_ranks == "first"


@contextlib.contextmanager
def _exclusive(comm):
    """Hold `comm` for one multi-device call; a second thread is refused."""
    if comm is None:
        yield
        return
    if not comm.busy.acquire(blocking=False):
        raise communicator.CommunicatorError(
            f"another thread is running a multi-device execute on this process's communicator "
            f"(thread {threading.current_thread().name} was refused): two calls' collectives on the same "
            f"process groups would pair with the wrong calls of the other ranks; run multi-device "
            f"executes from one thread at a time"
        )
    try:
        yield
    finally:
        comm.busy.release()


def _key_text(key: tuple) -> str:
    inputs, _, evaluator, resharding, static, chosen = key
    parts = ", ".join(
        f"{str(dtype).removeprefix('torch.')}/{ndim}d{'' if contiguous else ' strided'}"
        for dtype, ndim, contiguous in inputs
    )
    text = f"inputs ({parts}), evaluator {evaluator}, resharding {resharding}"
    if static:
        text += ", static sizes " + ", ".join(f"input {i} axis {axis} = {size}" for i, axis, size in static)
    return text + ("" if chosen is None else f", schedule {chosen}")


def _as_list(values, what: str) -> list:
    if isinstance(values, torch.Tensor) or not isinstance(values, (list, tuple)):
        raise InputTypeError(f"{what} must be a list of torch.Tensors, got {type(values).__name__}")
    return list(values)


def signature(fusion: ir.Fusion) -> str:
    """`(T0: float32[?, 8], T1: ...)`: what `execute` expects."""
    parts = []
    for tv in fusion.inputs:
        if isinstance(tv, ir.InputScalar):
            parts.append(f"{tv.label}: {str(tv.dtype).removeprefix('torch.')} scalar")
            continue
        dims = ", ".join("?" if not d.extent.is_constant else str(d.extent.value) for d in tv.runtime_domain())
        parts.append(f"T{tv.name}: {str(tv.dtype).removeprefix('torch.')}[{dims}]")
    return "(" + ", ".join(parts) + ")"


def _check_tensor(what: str, tv: ir.TensorView, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != tv.dtype:
        raise InputTypeError(f"{what}: expected dtype {tv.dtype}, got {t.dtype}")


def check_inputs(fusion: ir.Fusion, inputs: list, device=None, sharded: bool = False) -> torch.device:
    """Raise unless `inputs` match the fusion's inputs in count, type, dtype,
    rank, fixed sizes and device; return the device to run on. Sizes are
    those of this rank's pieces: 1 on a mesh_x axis, extent / mesh size on
    a split axis sharded by the mesh."""
    if len(inputs) != len(fusion.inputs):
        raise InputError(
            f"Wrong number of inputs: the fusion takes {len(fusion.inputs)} {signature(fusion)}, "
            f"got {len(inputs)}"
        )
    for i, (tv, t) in enumerate(zip(fusion.inputs, inputs)):
        if isinstance(tv, ir.InputScalar):
            if not tv.accepts(t):
                raise InputTypeError(
                    f"input {i} (scalar {tv.label}) must be a Python {_PYTHON_TYPES[tv.dtype]}, "
                    f"got {type(t).__name__} {t!r}"
                )
            continue
        what = f"input {i} (T{tv.name})"
        _check_tensor(what, tv, t)
        if t.dim() != tv.logical_ndim:
            raise InputError(
                f"{what}: expected {tv.logical_ndim} dims, got {t.dim()} (shape {list(t.shape)}); "
                f"the fusion takes {signature(fusion)}"
            )
        for axis, (d, size) in enumerate(zip(tv.logical_runtime(), t.shape)):
            expected = layout.local_extent(d)
            if expected is not None and size != expected:
                ways = d.extent.value // expected if expected else 0
                whole = f" (extent {d.extent.value} sharded over {ways} ranks)" if expected != d.extent.value else ""
                raise InputError(f"{what}: axis {axis} must have size {expected}{whole}, got {size}")
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    expected = torch.device(device) if device is not None else (tensors[0].device if tensors else torch.device("cpu"))
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor) and t.device != expected:
            where = " (the device of input 0)" if device is None else (" (this rank's device)" if sharded else "")
            raise InputError(
                f"input {i} (T{fusion.inputs[i].name}) is on {t.device} but the fusion runs on {expected}{where}"
            )
    return expected


_PYTHON_TYPES = {torch.float64: "float (or int)", torch.int64: "int", torch.bool: "bool"}


def is_multi_device(fusion: ir.Fusion) -> bool:
    tvs = fusion.tensor_inputs() + list(fusion.outputs) + [v for e in fusion.exprs for v in e.outputs()]
    return any(tv.mesh is not None or tv.device_axes() for tv in tvs)


def check_world(fusion: ir.Fusion, world_size: int) -> None:
    """A mesh names ranks the world must have."""
    tvs = fusion.tensor_inputs() + [v for e in fusion.exprs for v in e.outputs()]
    needed = max((max(tv.mesh.devices) + 1 for tv in tvs if tv.mesh is not None), default=1)
    if needed > world_size:
        hint = ""
        if world_size == 1:
            hint = (
                " (no launcher variables were found: run every rank under mpirun or torchrun, which set "
                "OMPI_COMM_WORLD_RANK/SIZE or RANK/WORLD_SIZE)"
            )
        raise ExecuteArgumentError(f"the fusion requests {needed} devices to run, but there are only {world_size} ranks{hint}")


_BACKEND_NAMES = {"nccl": "NCCL", "gloo": "gloo"}


def equal_input_axes(fusion: ir.Fusion) -> list[list[tuple[int, int]]]:
    """Groups of (input index, axis) whose whole sizes the program makes
    equal: axes its ops iterate together, through any chain of ops (the
    extents' classes), whether the axes are split or sharded or not."""
    classes = ir.ExtentClasses(fusion.exprs)
    by_class: dict = {}
    for i, tv in enumerate(fusion.inputs):
        if not isinstance(tv, ir.TensorView):
            continue
        for axis, d in enumerate(tv.logical_runtime()):
            if d.is_broadcast:
                continue
            key = classes.key(d.extent)
            by_class.setdefault(id(key) if isinstance(key, ir.Scalar) else ("c", key), []).append((i, axis))
    return [sorted(found) for found in by_class.values() if len(found) > 1]


def _whole_size(tv: ir.TensorView, d: ir.IterDomain, size: int) -> int:
    """The size of logical axis `d` across all ranks, from this rank's."""
    for leaf in d.loop_leaves():
        if leaf.is_device_parallel:
            # A sharded piece's extent is the mesh's size along it (checked
            # when lowering); a symbolic one takes it from the mesh.
            if leaf.extent.is_constant:
                size *= leaf.extent.value
            elif tv.mesh is not None:
                size *= tv.mesh.size_along(leaf.parallel_type)
    return size


def check_sizes(fusion: ir.Fusion, inputs: list, equal_axes) -> dict[ir.Scalar, int]:
    """Raise if input axes that the program makes equal differ in whole
    size (this rank's size times the ranks sharing the axis); return the
    whole size of every symbolic extent."""
    for group in equal_axes:
        (i0, a0), *rest = group
        t0 = fusion.inputs[i0]
        s0 = _whole_size(t0, t0.logical_runtime()[a0], inputs[i0].shape[a0])
        for i, a in rest:
            t = fusion.inputs[i]
            size = _whole_size(t, t.logical_runtime()[a], inputs[i].shape[a])
            if size != s0:
                raise InputError(
                    f"input {i} (T{t.name}) axis {a} has size {size} but input {i0} "
                    f"(T{t0.name}) axis {a0} has size {s0} (whole sizes, across ranks); an op of "
                    f"the fusion needs them equal"
                )
    sizes = {}
    for tv, t in zip(fusion.inputs, inputs):
        if not isinstance(tv, ir.TensorView):
            continue
        for d, size in zip(tv.logical_runtime(), t.shape):
            if d.is_device_parallel:
                continue
            sizes.setdefault(d.extent, _whole_size(tv, d, size))
    return sizes


def check_reductions(fusion: ir.Fusion, sizes: dict) -> None:
    """A max or min over an empty axis has no value (torch raises): reject
    it before any work."""
    for e in fusion.exprs:
        if not isinstance(e, ir.ReductionOp) or e.kind == "sum":
            continue
        for axis, d in enumerate(e.out.domain):
            if not d.is_reduction:
                continue
            size = d.extent.value if d.extent.is_constant else sizes.get(d.extent)
            if size == 0:
                raise InputError(
                    f"{e.kind} of T{e.input.name} over axis {axis}, which has size 0 for these inputs: "
                    f"a {e.kind} over no values is undefined (torch.a{e.kind} raises too)"
                )


def check_chunks(container: HostIrContainer, sizes: dict) -> None:
    """Raise unless every axis a decomposition splits into chunks divides."""
    for extent, parts, where in container.chunked:
        size = sizes.get(extent)
        if size is not None and size % parts:
            raise schedule.ScheduleError(
                f"{where}: extent {size} does not split into {parts} chunks per peer; pick a chunk count "
                f"that divides it (schedule chunks=)"
            )


def check_outputs(fusion: ir.Fusion, outputs: list, inputs: list, sizes, device: torch.device, tvs=None) -> None:
    """Raise unless every output is preallocated with the right shape, dtype
    and device, contiguous, and sharing no memory with an input. `tvs` are
    the lowered program's outputs (which carry propagated shardings)."""
    unset = [i for i, t in enumerate(outputs) if t is None]
    if unset and len(unset) < len(outputs):
        raise InputError(f"outputs must be all or none preallocated: outputs {unset} are None")
    if len(outputs) != len(fusion.outputs):
        raise InputError(
            f"outputs must be all or none preallocated: the fusion has {len(fusion.outputs)} "
            f"outputs, got {len(outputs)} tensors"
        )
    for i, (tv, t) in enumerate(zip(tvs or fusion.outputs, outputs)):
        what = f"preallocated output {i} (T{tv.name})"
        _check_tensor(what, tv, t)
        if t.device != device:
            raise InputError(f"{what} is on {t.device} but the fusion runs on {device}")
        shape = [_local_output_size(d, sizes) for d in tv.logical_runtime()]
        if list(t.shape) != shape:
            raise InputError(f"{what}: expected shape {shape}, got {list(t.shape)}")
        if not t.is_contiguous():
            raise InputError(f"{what} must be contiguous (strides {list(t.stride())})")
    _check_no_overlap(fusion, outputs, inputs, tvs or fusion.outputs)


def _check_no_overlap(fusion: ir.Fusion, outputs: list, inputs: list, tvs) -> None:
    """A preallocated output may share no memory with another output or
    an input: the program would read what it already overwrote, or two ops
    would write one buffer."""
    named = [(f"input {i} (T{tv.name})", t) for i, (tv, t) in enumerate(zip(fusion.inputs, inputs))]
    spans = []
    for i, (tv, t) in enumerate(zip(tvs, outputs)):
        what = f"preallocated output {i} (T{tv.name})"
        for other, x in named + spans:
            if _overlaps(t, x):
                raise InputError(f"{what} shares memory with {other}; pass separate buffers")
        spans.append((what, t))


def _local_output_size(d: ir.IterDomain, sizes) -> int | None:
    fixed = layout.local_extent(d)
    if fixed is not None:
        return fixed
    size = sizes.get(d.extent)
    if size is None:
        return None
    for leaf in d.loop_leaves():
        if leaf.is_device_parallel:
            size //= tv.mesh.size_along(leaf.parallel_type)
    return size


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes `t` may touch: [first, last) over its strides."""
    start = t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if stride > 0)
    return start, start + (last + 1) * t.element_size()


def _overlaps(a: torch.Tensor, b) -> bool:
    """Whether `a` and `b` may touch a common byte (exactly, for the
    contiguous outputs; by span, for strided inputs)."""
    if not isinstance(b, torch.Tensor) or a.device != b.device or a.device.type == "meta":
        return False
    if not a.numel() or not b.numel():
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1
