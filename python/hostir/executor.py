"""Run a fusion: one path for one rank or many.

`FusionExecutor.execute` takes every call through the same stages
(`FusionExecutor.STAGES`, each a method; `docs/architecture.md`, "One
call"): 1. normalize (`arguments.normalized`: the parameters checked, the
inputs placed, the plan's request); 2. check (`runtime/checks.py`); 3.
program: the plan (`hostir.planner`), its lowered program for the inputs'
signature (lowered on a miss, kept per plan key) with the plan's runner,
the checks that need it, and, for a multi-device program with
`HOSTIR_FAKE=auto` (the default), a dry run of each new input shape on
every rank, so that a cross-rank error comes before any data moves; 4.
agree and make groups (for many ranks: one fixed-size record, or a
six-word step of a prepared call, `runtime/agreement.py`; every rank
raises together if they differ, so a failure in stages 1-3 on one rank
reaches all); 5. bind; 6. run with the plan's runner (the C++ executor,
the Python evaluator, or the replay of a captured CUDA graph); 7. convert
the results back to the fusion's logical axes.

A call whose exact signature already ran enters at bind with its record
(`hostir.runtime.prepared`), a memo of stages 1-4; on many ranks, once the
ranks agreed on the signature, with the step first (`_steady`,
`hostir.runtime.protocol`); a call of a fusion that communicates on no
rank waits for none: its step is checked by the next call that
communicates. With
`HOSTIR_FAKE=1` the runner is the fake one: stage 3 dry-runs every rank
and stage 6 returns this rank's outputs as meta tensors; nothing runs and
no process group is made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import warnings
from typing import Sequence

import torch

from hostir import backends, communicator, cpp, ir, planner, printer
from hostir.analysis import dry_run
from hostir.arguments import CHECK_RANKS, EVALUATORS, ExecutorParams, check_mode, normalized
from hostir.container import HostIrContainer
from hostir.errors import HostIrError, UsageError
from hostir.log import logger
from hostir.lower import LoweredProgram, LoweringOptions, lower
from hostir.options import Dumper, fake_mode
from hostir.planner import Runner
from hostir.runtime import checks, prepared, protocol
from hostir.runtime.agreement import RankMismatchError, input_signature, token
from hostir.runtime.bind import Binding
from hostir.runtime.checks import ExecuteArgumentError, InputError, InputTypeError
from hostir.runtime.evaluator import HostIrEvaluator
from hostir.runtime.graphs import CudaGraphs
from hostir.runtime.streams import streams_for
from hostir.runtime.transports import torch_dist

__all__ = [
    "CHECK_RANKS",
    "EVALUATORS",
    "ExecuteArgumentError",
    "ExecutorParams",
    "FusionExecutor",
    "InputError",
    "InputTypeError",
    "RankMismatchError",
    "Runner",
]


@dataclasses.dataclass
class _Program:
    container: HostIrContainer
    evaluator: HostIrEvaluator | cpp.CppEvaluator
    # Input axes that ops iterate together: their sizes must be equal.
    equal_axes: list[list[tuple[int, int]]]
    # The conversions between the call's tensors and the program's.
    binding: Binding
    # What runs it, and why.
    runner: Runner
    # Dry-run reports of this program, per exact input shapes (and number
    # of streams): a report holds every size, so it serves no other.
    reports: dict = dataclasses.field(default_factory=dict)
    # What `lower` returned: the container with its digest, teams, chunked
    # axes and options (None for the fake runner's program).
    lowered: LoweredProgram | None = None
    # Whether the runner binds and converts back itself (the C++ executor
    # on a program without scalar inputs, `CppEvaluator.run_logical`): a
    # call with no preallocated outputs and no CUDA graph then runs stages
    # 5-7 in one call.
    logical: bool = False


_MAX_REPORTS = 64

# What `_bind` returns where the runner binds and converts back itself.
_LOGICAL = object()


@dataclasses.dataclass
class _Call:
    """One call after the first four stages (or their memo): what bind,
    run and convert back need."""

    program: _Program
    inputs: list
    outputs: list | None
    lowered: bool
    number_of_streams: int
    comm: object = None
    # The CUDA graph to replay, and, on a call that captures or looks it up,
    # the device to capture it on.
    graph: object = None
    no_grad: bool = True
    capture: object = None
    # A prepared call's posted step, which the C++ executor collects right
    # before the run's first communication (`protocol.PostedStep`).
    gate: object = None


class FusionExecutor:
    """Runs one fusion: its lowered programs (one per input signature) and,
    for a multi-device fusion, its place in the ranks' call sequence. Safe to
    call from several threads at once; the runs of a multi-device fusion
    take the communicator one at a time (a second thread gets a clear error)."""

    # The stages of every call, in order, each a method: a prepared call
    # enters at `_bind`.
    STAGES = ("_normalize", "_check", "_program", "_agree", "_bind", "_run", "_convert")

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
        # This fusion's place in the ranks' protocol of the live communicator.
        self._seat: protocol.Seat | None = None
        # (fusion version, world size, the team of `_team`)
        self._team_at: tuple | None = None
        self._warned: set[str] = set()
        self.dry_runs = 0
        self._fake_reports: dict = {}
        self._graphs = CudaGraphs()
        self._prepared = prepared.PreparedCalls(self._lock)
        # What ran the latest call, and why (None before the first); the
        # schedule its program was lowered with (the one asked, or the
        # planner's choice with the model's figures in its note; None where
        # the planner had nothing to choose: the lowering's default).
        self.last_runner: Runner | None = None
        self.last_schedule = None
        # Names the program in dumps: "" for a fusion's own, " (backward)" ...
        self.label = ""

    @property
    def num_programs(self) -> int:
        """Programs cached for the fusion as it is now."""
        return len(self._programs) if self._version == self.fusion.version else 0

    def lowered_program(self, resharding: str = "auto", inputs: Sequence | None = None, **kwargs) -> LoweredProgram:
        """What the fusion lowers to (for a multi-device fusion, this rank's
        program), with `resharding` as ExecutorParams takes it.

        Without `inputs`: the program of no particular input signature,
        lowered with the default hoisting (every post as early as operands
        and the default budget allow), whatever the machine model would
        choose for a call. With `inputs` (and `execute`'s keyword
        arguments, say `hoist=` or `host_inputs=`): the very program a call
        with those inputs runs, with the machine model's per-signature
        choice (sequential, hoisted or in chunks) — the one `execute` then
        reuses. A multi-device fusion needs a live communicator for that
        (after a call, or under a launcher once one is made)."""
        if inputs is not None:
            lowered = self._program_for(inputs, resharding, kwargs).lowered
            assert lowered is not None
            return lowered
        if kwargs:
            raise UsageError(
                f"lowered_program: {', '.join(sorted(kwargs))} shape the program of a call: give the call's "
                f"inputs too (without them, the default program is lowered and these would be ignored)"
            )
        if self._multi_device():
            rank = communicator.rank()
            backend = backends.of_process_group("nccl" if torch.cuda.is_available() else "gloo").name
            return lower(self.fusion, rank=rank, backend=backend, resharding=resharding)
        return lower(self.fusion, resharding=resharding)

    def host_program(self, resharding: str = "auto", inputs: Sequence | None = None, **kwargs) -> HostIrContainer:
        """The host program of `lowered_program(resharding, inputs, **kwargs)`."""
        return self.lowered_program(resharding, inputs, **kwargs).program

    def host_ir(self, resharding: str = "auto", inputs: Sequence | None = None, **kwargs) -> str:
        """The dump of `host_program(resharding, inputs, **kwargs)`."""
        return str(self.host_program(resharding, inputs, **kwargs))

    def _program_for(self, inputs: Sequence, resharding: str, kwargs: dict) -> _Program:
        """The program `execute(inputs, resharding=resharding, **kwargs)`
        runs: lowered now for its signature (and kept), or the one kept."""
        comm = None
        if self._multi_device():
            comm = communicator.live()
            if comm is None:
                raise UsageError(
                    "the program of a multi-device fusion for given inputs needs a live communicator: "
                    "call execute first, or leave inputs out for the default program"
                )
        params = ExecutorParams.from_arguments(None, dict(kwargs, resharding=resharding))
        inputs, _, device, request = self._normalize(inputs, None, params, comm, "0")
        device = self._check(inputs, device, comm, "0", request.host)
        program, _ = self._lookup(self._plan(inputs, device, request, comm, "0"), device, comm)
        return program

    def execute(
        self,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor] | None = None,
        params: ExecutorParams | None = None,
        **kwargs,
    ) -> list[torch.Tensor | None]:
        """Run the fusion on `inputs` (see the module's docstring for the
        steps). `params`, or keyword arguments naming its fields.

        Every call goes through the stages of `STAGES`, in order; a prepared
        call (a memo of the first four for its exact signature) enters at
        bind, and `HOSTIR_FAKE=1` is a runner, chosen in the program stage."""
        checking = check_mode(params, kwargs)
        key = self._signature(inputs, outputs, params, kwargs, checking)
        if key is not None:
            ready = self._prepared.get(key, self.fusion.version)
            if ready is not None:
                results = self.run_prepared(ready, inputs, outputs)
                if results is not None:
                    return results
        mode = fake_mode()
        comm, error = (None, None)
        if mode != "1" and self._multi_device():
            if mode == "auto":
                # The dry run comes after the rendezvous: load its imports meanwhile.
                dry_run.warm_up()
            error = self._communicator(params, kwargs)
            comm = communicator.live()
            if key is None and error is None:
                # The first call of the process made the communicator.
                key = self._multi_device_signature(inputs, outputs, params, kwargs, checking)
        with _held(comm):
            sequence = self._next_call(comm) if comm is not None else None
            call = None
            try:
                if error is not None:
                    raise error
                params = ExecutorParams.from_arguments(params, kwargs)
                inputs, outputs, device, request = self._normalize(inputs, outputs, params, comm, mode)
                device = self._check(inputs, device, comm, mode, request.host)
                call = self._program(inputs, outputs, device, request, comm, mode)
            except Exception as err:
                if comm is None or checking == "first":
                    raise
                error = err
            self._agree(comm, sequence, call, inputs, error, checking)
            results = self._finish(call)
        if key is not None:
            self._keep(key, call, params.check_ranks, inputs, comm)
        return results

    def _signature(self, inputs, outputs, params, kwargs, checking: str) -> tuple | None:
        """The prepared-call signature of a call (None: the full path)."""
        if not self._multi_device():
            return prepared.signature(inputs, outputs, params, kwargs)
        return self._multi_device_signature(inputs, outputs, params, kwargs, checking)

    def recall(self, inputs, params: ExecutorParams) -> prepared.Prepared | None:
        """The record a call `execute(inputs, None, params)` would run from
        now, or None (it would take the full path). A caller that keeps it,
        to make many calls of one signature without working the signature
        out each time (`hostir.autograd`), runs them with `run_prepared`
        and checks before each that `prepared.environment()` and
        `communicator.live()` are still what they were when it recalled."""
        key = self._signature(inputs, None, params, {}, check_mode(params, {}))
        return None if key is None else self._prepared.get(key, self.fusion.version)

    def run_prepared(self, ready: prepared.Prepared, inputs, outputs=None) -> list[torch.Tensor | None] | None:
        """A prepared call from its record `ready`: bind, run and convert
        back (for many ranks, `_steady`'s checked step first); None where
        the full path must run (preallocated outputs not its graph's)."""
        if ready.comm is not None:
            return self._steady(ready, inputs, outputs)
        call = self._recall(ready, inputs, outputs)
        return None if call is None else self._finish(call)

    def _multi_device_signature(self, inputs, outputs, params, kwargs, checking: str) -> tuple | None:
        """The prepared-call signature of a multi-device fusion's call on the
        live communicator, or None (no communicator yet, or
        check_ranks="every"). Records are kept per communicator: a new one
        lowers, checks and agrees again. One rank has no peer to agree
        with; many ranks agree on a signature's first call and check a
        step on every later one (`_steady`)."""
        comm = communicator.live()
        if comm is None or (comm.world_size > 1 and checking == "every"):
            return None
        found = prepared.signature(inputs, outputs, params, kwargs)
        return None if found is None else (comm, found)

    def _steady(self, ready: prepared.Prepared, inputs, outputs) -> list[torch.Tensor | None]:
        """A prepared call of many ranks: with check_ranks="always" the
        ranks' protocol checks its step (`Protocol.step`: nothing to wait
        for where no rank's program communicates, else a few words through
        the shared-memory mailbox on one host, or one all-gather), and
        sends every rank to the full record where anything differs; then
        bind, run and convert back, as every route does. Where the C++
        executor binds and runs the call in one, the step is posted first
        and collected by the run right before its first communication
        (`Protocol.post`)."""
        seat = self._seat_on(ready.comm)
        ranks = seat.protocol
        ranks.enter()
        try:
            sequence = ranks.next_call(seat)
            call = error = None
            try:
                call = self._recall(ready, inputs, outputs)
            except Exception as err:
                if not ready.token:
                    raise
                error = err
            if ready.token and error is None and self._logical(call):
                # The C++ executor binds and runs the call in one: it
                # collects the step right before its first communication.
                call.gate = ranks.post(sequence, ready.token, ready.program.lowered, inputs)
            elif ready.token:
                ranks.step(sequence, ready.token, ready.program.lowered, inputs, error)
            return self._finish(call)
        finally:
            ranks.leave()

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
                "captured with hostir.runtime.graphs.capture(fd, inputs), whose inputs are the ones it was given"
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

    def _recall(self, ready: prepared.Prepared, inputs, outputs) -> _Call | None:
        """A prepared call: the first four stages' memo for its signature.
        The decisions that depend on more than the signature are made
        again: whether a preallocated output shares memory with an input,
        and whether preallocated outputs are the ones its CUDA graph was
        captured with (None where not: the full path captures another)."""
        program = ready.program
        if outputs is not None:
            checks.check_no_overlap(self.fusion, outputs, inputs, program.binding.output_tvs)
        if ready.comm is not None:
            # Many ranks: a CUDA graph is looked up per call (its key holds
            # the outputs), never skipped to, so that bind always binds.
            return _Call(
                program, inputs, outputs, False, ready.number_of_streams, ready.comm, None, ready.grad,
                capture=ready.capture,
            )  # fmt: skip
        graph = ready.graph
        if graph is not None and outputs is not None and not graph.writes_into(program.binding.outputs(outputs)):
            return None
        return _Call(program, inputs, outputs, False, ready.number_of_streams, None, graph, ready.grad)

    def _keep(self, key: tuple, call: _Call, check_ranks: str, inputs, comm=None) -> None:
        """Keep the record of a call that took the full path and ran, under
        its signature `key`. (Not a call whose CPU inputs were copied to
        the GPU: the full path warns and copies.) The record of a call of
        many ranks holds the communicator and, with check_ranks="always",
        the token of the signature the ranks just agreed on."""
        if not all(a is b for a, b in zip(call.inputs, inputs)):
            return
        program = call.program
        grad = any(t.requires_grad for t in call.inputs)
        ready = prepared.Prepared(self.fusion.version, program, call.number_of_streams, grad)
        if comm is not None and comm.world_size > 1:
            ready.comm, ready.capture = comm, call.capture
            if check_ranks == "always":
                ready.token = token(program.lowered.digest, input_signature(call.inputs))
        elif call.graph is not None:
            # The graph the full path just captured or replayed for this call.
            ready.graph = call.graph
            ready.graph_inputs = program.binding.logical_inputs(ready.graph.inputs)
        self._prepared.put(key, ready)

    # -- 1: normalize
    def _normalize(self, inputs, outputs, params: ExecutorParams, comm, mode: str):
        """The parameters checked, the inputs and outputs as lists, the
        device to run on (CPU inputs of a GPU program copied there; the
        fake runner copies nothing), and what the call asks of its plan
        (`arguments.normalized`)."""
        return normalized(self.fusion, inputs, outputs, params, comm, mode == "1", self._warned)

    # -- 2: check
    def _check(self, inputs, device, comm, mode: str, host: frozenset = frozenset()):
        """Every input against the fusion, before any work starts; the
        device the inputs are on. (The fake runner's dry run checks every
        rank's inputs with the same checks, in the program stage.)"""
        if mode == "1":
            return device
        device = checks.check_call(self.fusion, inputs, device, None if comm is None else comm.world_size, host)
        self._warn_requires_grad(inputs)
        return device

    # -- 3: program (plan, lower, build the runner; the dry run of a new shape)
    def _program(self, inputs, outputs, device, request: planner.Request, comm, mode: str) -> _Call:
        """The call with its program: the inputs' plan, its lowered program
        and runner, the checks of sizes and outputs that need it, and the
        dry run of a new input shape; with HOSTIR_FAKE=1, the fake runner's
        program, which returns the dry run's meta tensors."""
        plan = self._plan(inputs, device, request, comm, mode)
        if plan.runner is planner.FAKE:
            return _Call(self._fake_program(inputs, plan), inputs, outputs, False, plan.number_of_streams)
        program, lowered = self._lookup(plan, device, comm)
        checks.check_against_program(
            self.fusion, inputs, outputs, device, program.equal_axes, program.lowered.chunking,
            program.container.outputs,
        )  # fmt: skip
        if mode == "auto" and comm is not None:
            # Not for a single-device program: it has no cross-rank error
            # for a dry run to catch, and its real run raises every error
            # the dry run would.
            self._dry_run(program, inputs, plan.number_of_streams, comm.world_size)
        call = _Call(program, inputs, outputs, lowered, plan.number_of_streams, comm)
        if plan.replay:
            call.capture = comm.device if comm is not None else _device_of(inputs)
        return call

    def _plan(self, inputs, device, request: planner.Request, comm, mode: str) -> planner.Plan:
        """The call's plan, made once: every decision about its program."""
        if mode == "1":
            return planner.fake(request)
        return planner.plan(self.fusion, inputs, device, comm, request)

    def _fake_program(self, inputs, plan: planner.Plan) -> _Program:
        """HOSTIR_FAKE=1: a program whose runner returns this rank's outputs
        as meta tensors, from a dry run of every rank; nothing runs and no
        process group is made. Without a launcher, this process plays rank
        0 of as many ranks as the fusion's meshes name."""
        rank, world = 0, 1
        if self._multi_device():
            launch = communicator.discover()
            rank, world = launch.rank, launch.world_size
            needed = checks.ranks_needed(self.fusion)
            if world == 1 and needed > 1:
                world = needed
        nos, resharding = plan.number_of_streams, plan.resharding
        key = (self.fusion.version, checks.input_key(inputs), world, nos, resharding)
        with self._lock:
            report = self._fake_reports.get(key)
        if report is None:
            report = dry_run.dry_run(self.fusion, inputs, world_size=world, number_of_streams=nos, resharding=resharding)
            self.dry_runs += 1
            with self._lock:
                if len(self._fake_reports) >= _MAX_REPORTS:
                    self._fake_reports.pop(next(iter(self._fake_reports)))
                self._fake_reports[key] = report
        shapes = [shape for _, shape, _ in report[rank].outputs]
        return _Program(None, dry_run.FakeRun(self.fusion.outputs, shapes), [], Binding([], []), planner.FAKE)

    # -- the dry run
    def _dry_run(self, program: _Program, inputs, nos: int, world_size: int):
        """Dry-run `program` once per exact input shape (and number of
        streams `nos`), lowering the other ranks' programs with its
        options; raise its error."""
        key = (checks.input_key(inputs), nos)
        report = program.reports.get(key)
        if report is not None:
            return report
        report = dry_run.dry_run_program(self.fusion, program.lowered, inputs, nos, world_size, self._multi_device())
        self.dry_runs += 1
        with self._lock:
            if len(program.reports) >= _MAX_REPORTS:
                program.reports.pop(next(iter(program.reports)))
            program.reports[key] = report
        return report

    def _warn_requires_grad(self, inputs: list) -> None:
        # Under no_grad nothing is asked of autograd; with grad mode on, only
        # a traced call comes here with inputs requiring grad.
        if "grad" in self._warned or not torch.is_grad_enabled():
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
            self._is_multi_device = checks.is_multi_device(self.fusion)
        return self._is_multi_device

    def _lookup(self, plan: planner.Plan, device: torch.device, comm=None) -> tuple[_Program, bool]:
        """The cached program of `plan`, lowered on a miss, and whether it
        was lowered now."""
        with self._lock:
            # A program holds the communicator it was lowered for: after a
            # shutdown and a new communicator, lower again.
            if self.fusion.version != self._version or comm is not self._comm:
                self._programs.clear()
                self._version = self.fusion.version
                self._comm = comm
            program = self._programs.get(plan.key)
        debug = logger.isEnabledFor(logging.DEBUG)
        if program is not None:
            if debug:
                logger.debug("program cache hit for %s on %s", planner.key_text(plan.key), device)
            return program, False
        if debug:
            logger.debug("program cache miss for %s on %s: lowering", planner.key_text(plan.key), device)
        program = self._programs[plan.key] = self._lower(plan, device, comm)
        return program, True

    def _lower(self, plan: planner.Plan, device: torch.device, comm=None) -> _Program:
        """Lower the fusion as `plan` says and build the plan's runner."""
        rank = comm.rank if comm is not None else 0
        dumper = Dumper(rank)
        dumper.emit("fusion_ir", "Fusion:", printer.print_fusion(self.fusion))
        options = LoweringOptions(resharding=plan.resharding, host_inputs=plan.host, hoisting=plan.hoisting)
        if comm is not None:
            backend = backends.of_process_group(comm.backend).name
            options = dataclasses.replace(options, rank=comm.rank, backend=backend, schedule=plan.schedule)
        lowered = lower(self.fusion, options, dumper)
        container = lowered.program
        container.label = self.label.strip()
        self.lowerings += 1
        runner = plan.runner_for(container)
        if dumper.enabled("host_ir"):
            # The program's dump ends with a newline; the runner is its last line.
            dumper.emit("host_ir", f"Host program{self.label}:", f"{container}{runner}\n")
        logger.info("%s", runner)
        torch_dist.check_backends(container, device, comm.backend if comm is not None else None)
        streams = self._streams.get(device)
        if streams is None:
            streams = self._streams[device] = streams_for(device)
        make = cpp.CppEvaluator if runner.name == "cpp" else HostIrEvaluator
        run = make(container, streams=streams, device=device, communicator=comm, dumper=dumper, rank=lowered.rank)
        if logger.isEnabledFor(logging.INFO):
            exprs = list(container.walk())
            comms = sum(isinstance(e, ir.Communication) for e in exprs)
            logger.info(
                "lowered fusion %s%s to a host program of %d ops (%d communications), digest %s; "
                "evaluator %s on %s with %s",
                checks.signature(self.fusion), self.label, len(exprs), comms, (lowered.digest or "")[:12],
                type(run).__name__, device, type(streams).__name__,
            )  # fmt: skip
        binding = Binding.of(container)
        program = _Program(container, run, checks.equal_input_axes(self.fusion), binding, runner, lowered=lowered)
        if isinstance(run, cpp.CppEvaluator) and not any(not isinstance(v, ir.TensorView) for v in container.inputs):
            run.take_views(binding.views())
            program.logical = True
        return program

    # -- 4: agree and make groups
    def _communicator(self, params, kwargs) -> HostIrError | None:
        """Make the process-wide communicator (`communicator.live()` after
        this) with the call's backend and timeout where there is none; the
        error of asking for it with parameters that differ from the live
        one's (shared with the other ranks like any local error); with no
        live communicator, its creation error is raised here (the launch
        is broken on this rank)."""
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
        protocol.of(comm).refuse_after_failure()
        return error

    def _next_call(self, comm) -> tuple[int, int, int]:
        """This fusion's number on `comm`, the number of this call of it,
        and the number of this call among all multi-device executes on
        `comm` (the ranks' protocol counts them)."""
        seat = self._seat_on(comm)
        return seat.protocol.next_call(seat)

    def _seat_on(self, comm) -> protocol.Seat:
        """This fusion's seat in the protocol of its team on `comm`."""
        seat = self._seat
        team = self._team(comm)
        if seat is None or seat.comm is not comm or seat.protocol.team != team:
            seat = self._seat = protocol.of(comm, team).seat()
        return seat

    def _team(self, comm) -> tuple[int, ...] | None:
        """The ranks this fusion's meshes name, where they are a part of the
        world and this rank is one of them (they agree among themselves);
        this rank alone where it is none of them (it has no part in the
        call); None for the whole world."""
        found = self._team_at
        if found is not None and found[0] == self.fusion.version and found[1] == comm.world_size:
            return found[2]
        tvs = list(self.fusion.inputs) + [v for e in self.fusion.exprs for v in e.outputs()]
        ranks = sorted({int(r) for tv in tvs if getattr(tv, "mesh", None) is not None for r in tv.mesh.devices})
        team: tuple[int, ...] | None = tuple(ranks)
        if comm.rank not in ranks:
            team = (comm.rank,)
        elif len(ranks) == comm.world_size:
            team = None
        self._team_at = (self.fusion.version, comm.world_size, team)
        return team

    def _agree(self, comm, sequence, call: _Call | None, inputs, error, checking: str = "always") -> None:
        """The ranks agree on the call, its program and inputs, and any local
        error, and make the process groups the program needs
        (`Protocol.agree`); nothing to do without a communicator (the fake
        runner makes no group)."""
        if comm is None:
            return
        lowered = call.program.lowered if call is not None else None
        given = call.inputs if call is not None else inputs
        seat = self._seat_on(comm)
        seat.protocol.agree(seat, sequence, lowered, given, error, checking, call is not None and call.lowered)

    # -- 5-7: bind, run, convert back
    def _finish(self, call: _Call) -> list[torch.Tensor | None]:
        """Stages 5-7, the same for every route."""
        bound = self._bind(call)
        return self._convert(call, self._run(call, bound), bound is _LOGICAL)

    def _bind(self, call: _Call) -> tuple[list, list | None] | object:
        """The call's inputs and preallocated outputs with the program's
        runtime axes; `_LOGICAL` where the runner binds and converts back
        itself (`_Program.logical`)."""
        if self._logical(call):
            return _LOGICAL
        binding = call.program.binding
        given = None if call.outputs is None else binding.outputs(call.outputs)
        return binding.inputs(call.inputs), given

    @staticmethod
    def _logical(call: _Call) -> bool:
        """Whether the runner binds and converts back itself: the C++
        executor, with no preallocated outputs and no CUDA graph."""
        return call.program.logical and call.outputs is None and call.graph is None and call.capture is None

    def _run(self, call: _Call, bound: tuple[list, list | None]) -> list:
        """Run the program on the bound tensors with its runner (the C++
        executor, the Python evaluator or the fake runner), or replay its
        CUDA graph (captured here on the first call of a signature)."""
        program = call.program
        self.last_runner = program.runner
        self.last_schedule = None if program.lowered is None else program.lowered.options.schedule
        nos = call.number_of_streams
        if bound is _LOGICAL:
            try:
                return program.evaluator.run_logical(call.inputs, nos, call.gate)
            except (communicator.CommunicatorTimeout, communicator.PeerLostError) as err:
                if call.comm is not None:
                    protocol.of(call.comm).fail(err)
                raise
        inputs, given = bound
        try:
            if call.capture is not None:
                bindings = dict(zip(program.binding.input_tvs, inputs))
                if given is not None:
                    bindings.update(zip(program.binding.output_tvs, given))
                backend = call.comm.backend if call.comm is not None else None
                with torch.no_grad():
                    call.graph = self._graphs.captured(program, bindings, nos, call.capture, backend)
            if call.graph is not None:
                rank = call.comm.rank if call.comm is not None else 0
                if call.no_grad:
                    with torch.no_grad():
                        return call.graph.replay(inputs, given, rank)
                return call.graph.replay(inputs, given, rank)
            run_tensors = getattr(program.evaluator, "run_tensors", None)
            if run_tensors is not None:
                if call.no_grad:
                    with torch.no_grad():
                        return run_tensors(inputs, given or [], nos)
                return run_tensors(inputs, given or [], nos)
            bindings = dict(zip(program.binding.input_tvs, inputs))
            if given is not None:
                bindings.update(zip(program.binding.output_tvs, given))
            with torch.no_grad():
                return program.evaluator.run(bindings, number_of_streams=nos)
        except (communicator.CommunicatorTimeout, communicator.PeerLostError) as err:
            if call.comm is not None:
                protocol.of(call.comm).fail(err)
            raise

    def _convert(self, call: _Call, results, logical: bool = False) -> list[torch.Tensor | None]:
        """The results with the fusion's logical axes (`logical`: the runner
        gave them so)."""
        return results if logical else list(call.program.binding.unbind(results))


def _device_of(inputs: list) -> torch.device:
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


@contextlib.contextmanager
def _held(comm):
    """Hold `comm`'s protocol for one multi-device call (`Protocol.held`)."""
    if comm is None:
        yield
        return
    with protocol.of(comm).held():
        yield
