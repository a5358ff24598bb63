"""Run a fusion: one path for one rank or many.

`FusionExecutor.execute` takes every call through the same stages
(`FusionExecutor.STAGES`, each a method):

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
   differ; then they create the process groups the program needs (with
   check_ranks="always" a step of the full path comes first: it pairs with
   the steps of ranks whose call is prepared). Nothing to do for one rank;
5. bind the inputs and outputs (a rank's pieces viewed with loop axes);
6. run with the evaluator, in a frame of its own, without autograd: the
   Python reference (`HostIrEvaluator`) or the C++ executor (`hostir.cpp`),
   both built from the same lowered container; with `cuda_graph=True` the
   run is captured once per exact input signature and replayed
   (`hostir.runtime.graphs`);
7. convert the results back to the fusion's logical axes.

A call whose exact signature (every tensor's type, shape, strides, dtype,
device and requires_grad; the parameters; the variables that pick the
evaluator and the dry run) already ran enters at step 5 with its record
(`hostir.runtime.prepared`), a memo of steps 1-4: they decided nothing else
for it but whether a preallocated output shares memory with an input, which
is checked again on every call. For a multi-device fusion the record is per
communicator; on many ranks it is kept once the ranks agreed on the
signature (step 4's full record), and with check_ranks="always" a prepared
call first checks a seven-word step with the other ranks (`_steady`,
`hostir.runtime.protocol`; through the communicator's shared-memory
mailbox where every rank shares one host, `hostir.mailbox`): the same call
of the same fusion, the same agreed signature. A step that
differs on any rank sends every rank to the full record, which raises on
all of them what differs. A call of a fusion that communicates on no rank
waits for none: its step is checked by the next call that communicates.

A failure in steps 1-3 on one rank of a multi-device fusion is carried by
step 4 to every rank, so all raise the same error instead of one raising and
the others waiting in a collective.

With `HOSTIR_FAKE=1` the runner is the fake one: step 3 dry-runs every rank
(the dry run checks each rank's inputs, so steps 1-2 leave the checks to
it) and step 6 returns this rank's outputs as the dry run's meta tensors;
nothing runs and no process group is made. A dry-run report depends on
every size, so it is kept per exact input shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import warnings
from typing import Sequence

import torch

from hostir import backends, communicator, cpp, ir, machine, printer
from hostir.analysis import dry_run
from hostir.container import HostIrContainer
from hostir.errors import HostIrError, UsageError
from hostir.log import logger
from hostir.lower import LoweredProgram, LoweringOptions, lower
from hostir.lower.insert_reshardings import MODES as RESHARDING_MODES
from hostir.lower.hoist_transfers import forced as forced_hoisting
from hostir.lower.schedule import Schedule, ScheduleError
from hostir.lower.schedule import parse as parse_schedule
from hostir.options import EVALUATORS, Dumper, evaluator_choice, fake_mode
from hostir.runtime import flat, prepared, profiling, protocol
from hostir.runtime.agreement import RankMismatchError, input_signature, token
from hostir.runtime.bind import Binding
from hostir.runtime.checks import (
    ExecuteArgumentError,
    InputError,
    InputTypeError,
    as_list,
    check_chunks,
    check_inputs,
    check_no_overlap,
    check_outputs,
    check_reductions,
    check_sizes,
    check_world,
    equal_input_axes,
    host_positions,
    input_key,
    is_multi_device,
    ranks_needed,
    signature,
)
from hostir.runtime.evaluator import HostIrEvaluator
from hostir.runtime.graphs import CudaGraphs
from hostir.runtime.streams import streams_for
from hostir.runtime.transports import torch_dist

CHECK_RANKS = ("always", "first", "every")
HOST_INPUTS = ("copy", "stream")

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
    check_ranks: how the ranks of a multi-device program agree before it
        runs (every rank must pass the same value). "always" (default): the
        first call of each exact signature exchanges the full record on a
        control group (`runtime/agreement.py`): the call (a rank that
        skipped or repeated an execute makes every rank raise), the
        program, the inputs' shapes and dtypes, and any local error; later
        calls of that signature are prepared (they enter at bind) and send
        only a step of 7 words (the call numbers, the agreed signature's
        token and the chain of calls without communication), and any
        difference in it sends every rank to the full record, whose error
        names what differs: the same protections, one small exchange per
        call; a call of a fusion whose program communicates on no rank
        sends nothing and waits for no rank: its step joins the chain the
        next exchanged step carries, so its mistakes raise on every rank at
        the next call that communicates. "every": the full record and the full
        path on every call (no prepared multi-device call), the cost the
        step saves. "first": agreement only when a rank lowers a program,
        and prepared calls send nothing; it saves the step but turns these
        protections off: a rank that alone fails its checks, skips a call or
        changes its input shapes then meets the others' collectives out of
        step, and the job ends in a timeout or returns wrong data.
    resharding: where an op that would both compute and move data between
        ranks gets its resharding `set` (lower/insert_reshardings.py):
        "auto" (default) on the side that moves fewer elements, "before"
        or "after" the op where possible, or "strict", which refuses such
        an op and asks for an explicit `fd.ops.set`.
    schedule: how a device axis walked as a stream axis runs: a
        `hostir.lower.schedule.Schedule` or its text (`ring:chunks=2`,
        `collective`, `sequential`, ...); by default `HOSTIR_SCHEDULE`, else
        the machine model's choice for the inputs' shapes.
    host_inputs: "copy" (default) copies CPU inputs of a program that runs
        on a GPU there before it starts; "stream" keeps them in host memory
        and lets the program move each where an op reads it, on a copy
        stream, as early as the memory budget allows (as inputs defined with
        `memory="host"` always are).
    hoist: how far communications and transfers are posted ahead of their
        use (`lower/hoist_transfers.py`): "auto" (default: `HOSTIR_HOIST`,
        else the machine model's choice for the inputs' shapes), a
        `Hoisting` or its text (`hoist`, `hoist:budget=2GiB,lookahead=3,chunks=4`,
        `sequential`).
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
    host_inputs: str = "copy"
    hoist: object = "auto"

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
        if self.host_inputs not in HOST_INPUTS:
            raise ExecuteArgumentError(f"host_inputs must be one of {list(HOST_INPUTS)}, got {self.host_inputs!r}")
        forced_hoisting(self.hoist)
        # Checked on every call, also where nothing would read them (a
        # program with no device axis to walk, one rank): a typo is an
        # error where it is made, never silently ignored.
        if self.schedule is not None:
            _checked_schedule(self.schedule, "schedule")
        if os.environ.get("HOSTIR_SCHEDULE"):
            _checked_schedule(os.environ["HOSTIR_SCHEDULE"], "HOSTIR_SCHEDULE")
        if os.environ.get("HOSTIR_TIMEOUT") is not None:
            communicator.resolve_timeout(None)

    def evaluator_choice(self) -> tuple[str, tuple[str, ...]]:
        """The evaluator this run uses, "python" or "cpp", and why the C++
        executor is not used (before the program is known)."""
        if self.evaluator is not None:
            choice, given = self.evaluator, f"evaluator={self.evaluator!r} was passed"
        else:
            choice, given = evaluator_choice(), f"HOSTIR_EVALUATOR={evaluator_choice()}"
        if choice == "python":
            return "python", (given,)
        if choice == "auto" and profiling.watched():
            # The profiler's ranges come from the Python evaluator.
            return "python", ("the profiler is watching (its ranges come from the Python evaluator)",)
        if cpp.available():
            return "cpp", ()
        if choice == "cpp":
            raise ExecuteArgumentError(
                f"evaluator='cpp' was requested but the C++ executor is unavailable: {cpp.reason()}"
            )
        cpp.warn_unavailable()
        return "python", (f"it is not built or does not load: {cpp.reason()}",)

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


@dataclasses.dataclass(frozen=True)
class Runner:
    """What runs a call: "cpp" (the C++ executor), "python" (the reference
    evaluator) or "fake" (HOSTIR_FAKE=1: the dry run's meta tensors), and
    every reason the C++ executor is not used (empty for "cpp").
    `str(runner)` is the line the `host_ir` dump and the `hostir` log show."""

    name: str
    reasons: tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        """Why this runner: the reasons joined, or why the C++ executor runs."""
        if not self.reasons:
            return "the C++ executor is built and runs every op of the program"
        return "; ".join(self.reasons)

    def __str__(self) -> str:
        if not self.reasons:
            return f"runner: {self.name}"
        return f"runner: {self.name} (the C++ executor is not used: {self.reason})"


_FAKE = Runner("fake", ("HOSTIR_FAKE=1: the call returns the dry run's meta tensors and runs nothing",))


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
    # A prepared call: preallocated outputs other than its graph's make
    # bind return None.
    exact_outputs: bool = False
    capture: object = None


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
        # What ran the latest call, and why (None before the first).
        self.last_runner: Runner | None = None
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
        if is_multi_device(self.fusion):
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
        inputs, _, device = self._normalize(inputs, None, params, comm, "0")
        device = self._check(inputs, device, comm, "0", host_positions(self.fusion, inputs, params.host_inputs))
        program, _ = self._lookup(inputs, device, params, comm)
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
        key = self._signature(inputs, outputs, params, kwargs)
        if key is not None:
            ready = self._prepared.get(key, self.fusion.version)
            if ready is not None:
                results = self.run_prepared(ready, inputs, outputs)
                if results is not None:
                    return results
        checking = _check_mode(params, kwargs)
        mode = fake_mode()
        comm, error = (None, None)
        if mode != "1" and self._multi_device():
            if mode == "auto":
                # The dry run comes after the rendezvous: load its imports meanwhile.
                dry_run.warm_up()
            comm, error = self._communicator(params, kwargs)
            if key is None and error is None:
                # The first call of the process made the communicator.
                key = self._multi_device_signature(inputs, outputs, params, kwargs)
        with _held(comm):
            sequence = self._next_call(comm) if comm is not None else None
            call = None
            try:
                if error is not None:
                    raise error
                params = ExecutorParams.from_arguments(params, kwargs)
                inputs, outputs, device = self._normalize(inputs, outputs, params, comm, mode)
                device = self._check(inputs, device, comm, mode, host_positions(self.fusion, inputs, params.host_inputs))
                call = self._program(inputs, outputs, device, params, comm, mode)
            except Exception as err:
                if comm is None or checking == "first":
                    raise
                error = err
            self._agree(comm, sequence, call, inputs, error, checking)
            results = self._finish(call)
        if key is not None:
            self._keep(key, call, params, inputs, comm)
        return results

    def _signature(self, inputs, outputs, params, kwargs) -> tuple | None:
        """The prepared-call signature of a call (None: the full path)."""
        if not self._multi_device():
            return prepared.signature(inputs, outputs, params, kwargs)
        return self._multi_device_signature(inputs, outputs, params, kwargs)

    def recall(self, inputs, params: ExecutorParams) -> prepared.Prepared | None:
        """The record a call `execute(inputs, None, params)` would run from
        now, or None (it would take the full path). A caller that keeps it,
        to make many calls of one signature without working the signature
        out each time (`hostir.autograd`), runs them with `run_prepared`
        and checks before each that `prepared.environment()` and
        `communicator.live()` are still what they were when it recalled."""
        key = self._signature(inputs, None, params, {})
        return None if key is None else self._prepared.get(key, self.fusion.version)

    def run_prepared(self, ready: prepared.Prepared, inputs, outputs=None) -> list[torch.Tensor | None] | None:
        """A prepared call from its record `ready`: bind, run and convert
        back (for many ranks, `_steady`'s checked step first); None where
        the full path must run (preallocated outputs not its graph's)."""
        if ready.comm is not None:
            return self._steady(ready, inputs, outputs)
        return self._finish(self._recall(ready, inputs, outputs))

    def _multi_device_signature(self, inputs, outputs, params, kwargs) -> tuple | None:
        """The prepared-call signature of a multi-device fusion's call on the
        live communicator, or None (no communicator yet, or
        check_ranks="every"). Records are kept per communicator: a new one
        lowers, checks and agrees again. One rank has no peer to agree
        with; many ranks agree on a signature's first call and check a
        step on every later one (`_steady`)."""
        comm = communicator.live()
        if comm is None or (comm.world_size > 1 and _check_mode(params, kwargs) == "every"):
            return None
        found = prepared.signature(inputs, outputs, params, kwargs)
        return None if found is None else (comm, found)

    def _steady(self, ready: prepared.Prepared, inputs, outputs) -> list[torch.Tensor | None]:
        """A prepared call of many ranks: with check_ranks="always" the
        ranks' protocol checks its step (`Protocol.step`: nothing to wait
        for where no rank's program communicates, else a few words through
        the shared-memory mailbox on one host, or one all-gather), and
        sends every rank to the full record where anything differs; then
        bind, run and convert back, as every route does."""
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
            if ready.token:
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

    def _recall(self, ready: prepared.Prepared, inputs, outputs) -> _Call:
        """A prepared call: the first four stages' memo for its signature.
        The one decision that depends on more than the signature, whether a
        preallocated output shares memory with an input, is checked again."""
        program = ready.program
        if outputs is not None:
            check_no_overlap(self.fusion, outputs, inputs, program.binding.output_tvs)
        if ready.comm is not None:
            # Many ranks: a CUDA graph is looked up per call (its key holds
            # the outputs), never skipped to, so that bind always binds.
            return _Call(
                program, inputs, outputs, False, ready.number_of_streams, ready.comm, None, ready.grad, False,
                ready.capture,
            )  # fmt: skip
        return _Call(program, inputs, outputs, False, ready.number_of_streams, None, ready.graph, ready.grad, True)

    def _keep(self, key: tuple, call: _Call, params: ExecutorParams, inputs, comm=None) -> None:
        """Keep the record of a call that took the full path and ran, under
        its signature `key`. (Not a call whose CPU inputs were copied to
        the GPU: the full path warns and copies.) The record of a call of
        many ranks holds the communicator and, with check_ranks="always",
        the token of the signature the ranks just agreed on."""
        if not all(a is b for a, b in zip(call.inputs, inputs)):
            return
        program = call.program
        grad = any(t.requires_grad for t in call.inputs)
        ready = prepared.Prepared(self.fusion.version, program, params.number_of_streams, grad)
        if comm is not None and comm.world_size > 1:
            ready.comm, ready.capture = comm, call.capture
            if params.check_ranks == "always":
                ready.token = token(program.lowered.digest, input_signature(call.inputs))
        elif call.graph is not None:
            # The graph the full path just captured or replayed for this call.
            ready.graph = call.graph
            ready.graph_inputs = program.binding.logical_inputs(ready.graph.inputs)
        self._prepared.put(key, ready)

    # -- 1: normalize
    def _normalize(self, inputs, outputs, params: ExecutorParams, comm, mode: str):
        """The parameters checked, the inputs and outputs as lists, and the
        device to run on (CPU inputs of a GPU program copied there; the
        fake runner copies nothing)."""
        params.validate()
        inputs, outputs = self._as_lists(inputs, outputs)
        if mode == "1":
            return inputs, outputs, None
        device = self._device(inputs, params, comm)
        inputs = self._place(inputs, device, host_positions(self.fusion, inputs, params.host_inputs))
        if comm is not None:
            # Never hand a strided view to a collective (gloo would read the
            # wrong memory): compact first, which also keeps contiguity out
            # of the program cache's key so that all ranks hit or miss it
            # together.
            inputs = [t.contiguous() if isinstance(t, torch.Tensor) else t for t in inputs]
        return inputs, outputs, device

    # -- 2: check
    def _check(self, inputs, device, comm, mode: str, host: frozenset = frozenset()):
        """Every input against the fusion, before any work starts; the
        device the inputs are on. (The fake runner's dry run checks every
        rank's inputs with the same checks, in the program stage.)"""
        if mode == "1":
            return device
        if comm is not None:
            check_world(self.fusion, comm.world_size)
        device = check_inputs(self.fusion, inputs, device, sharded=comm is not None, host=host)
        self._warn_requires_grad(inputs)
        return device

    # -- 3: program (with the dry run of a new shape)
    def _program(self, inputs, outputs, device, params: ExecutorParams, comm, mode: str) -> _Call:
        """The call with its program: the lowered program for the inputs'
        signature, the checks of sizes and outputs that need it, and the dry
        run of a new input shape; with HOSTIR_FAKE=1, the fake runner's
        program, which returns the dry run's meta tensors."""
        nos = params.number_of_streams
        if mode == "1":
            return _Call(self._fake_program(inputs, params), inputs, outputs, False, nos)
        program, lowered = self._lookup(inputs, device, params, comm)
        sizes = check_sizes(self.fusion, inputs, program.equal_axes)
        check_reductions(self.fusion, sizes)
        check_chunks(program.lowered.chunking, sizes)
        if outputs is not None:
            check_outputs(self.fusion, outputs, inputs, sizes, device, program.container.outputs)
        if mode == "auto" and comm is not None:
            # Not for a single-device program: it has no cross-rank error
            # for a dry run to catch, and its real run raises every error
            # the dry run would.
            self._dry_run(program, inputs, params, comm.world_size)
        call = _Call(program, inputs, outputs, lowered, nos, comm)
        if params.cuda_graph:
            call.capture = comm.device if comm is not None else _device_of(inputs)
        return call

    def _fake_program(self, inputs, params: ExecutorParams) -> _Program:
        """HOSTIR_FAKE=1: a program whose runner returns this rank's outputs
        as meta tensors, from a dry run of every rank; nothing runs and no
        process group is made. Without a launcher, this process plays rank
        0 of as many ranks as the fusion's meshes name."""
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
            report = dry_run.dry_run(
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
        shapes = [shape for _, shape, _ in report[rank].outputs]
        return _Program(None, _FakeRun(self.fusion.outputs, shapes), [], Binding([], []), _FAKE)

    # -- the dry run
    def _dry_run(self, program: _Program, inputs, params: ExecutorParams, world_size: int):
        """Dry-run `program` once per exact input shape; raise its error."""
        key = (input_key(inputs), params.number_of_streams)
        report = program.reports.get(key)
        if report is not None:
            return report
        if world_size == 1 and not self._multi_device():
            # One device: no ranks to match, the program is lowered, and an
            # error is the one the real run would raise.
            only = dry_run.run_rank(
                self.fusion,
                inputs,
                0,
                1,
                params.number_of_streams,
                multi=False,
                program=program.lowered,
                raw_errors=True,
            )
            report = dry_run.DryRunReport(1, params.number_of_streams, [only])
        else:
            report = dry_run.dry_run(
                self.fusion,
                inputs,
                world_size=world_size,
                number_of_streams=params.number_of_streams,
                backend=program.lowered.backend,
                schedule=program.lowered.schedule,
                resharding=params.resharding,
                hoisting=program.lowered.hoisting,
            )
        self.dry_runs += 1
        with self._lock:
            if len(program.reports) >= _MAX_REPORTS:
                program.reports.pop(next(iter(program.reports)))
            program.reports[key] = report
        return report

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

    def _place(self, inputs: list, device: torch.device, host: frozenset = frozenset()) -> list:
        """Copy CPU inputs to `device` if the program runs elsewhere (one
        warning per fusion names them and the bytes copied), except those in
        host memory (`host`: their positions), which the program streams."""
        if device.type != "cuda":
            return inputs
        moved = [
            i for i, t in enumerate(inputs)
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and i not in host
        ]
        if not moved:
            return inputs
        if "copy" not in self._warned:
            self._warned.add("copy")
            names = ", ".join(f"{i} (T{self.fusion.inputs[i].name})" for i in moved if i < len(self.fusion.inputs))
            size = sum(ir.nbytes(inputs[i]) for i in moved)
            warnings.warn(
                f"inputs {names} are on the CPU but the fusion runs on {device}: copied there "
                f"({size} bytes this call); pass them on {device} to avoid the copy",
                stacklevel=5,
            )
        return [t.to(device) if i in moved else t for i, t in enumerate(inputs)]

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
            self._is_multi_device = is_multi_device(self.fusion)
        return self._is_multi_device

    def _as_lists(self, inputs, outputs) -> tuple[list, list | None]:
        inputs = as_list(inputs, "inputs")
        if outputs is not None:
            outputs = as_list(outputs, "outputs")
            if all(t is None for t in outputs) and len(outputs) == len(self.fusion.outputs):
                outputs = None
        return inputs, outputs

    def _lookup(self, inputs, device: torch.device, params: ExecutorParams, comm=None) -> tuple[_Program, bool]:
        """The cached program for the inputs' signature, lowered on a miss,
        and whether it was lowered now."""
        static = tuple(
            (i, axis, inputs[i].shape[axis])
            for i, tv in enumerate(self.fusion.inputs)
            for axis in getattr(tv, "static_dims", ())
        )
        evaluator, reasons = params.evaluator_choice()
        chosen = machine.for_inputs(
            self.fusion, inputs, comm, params.schedule, device, evaluator, bool(params.cuda_graph)
        )
        host = host_positions(self.fusion, inputs, params.host_inputs)
        hoisting = machine.hoisting_for_inputs(
            self.fusion, inputs, device, comm, host, params.hoist, cpp_posts=evaluator == "cpp"
        )
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
            host,
            None if hoisting is None else hoisting.key(),
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
            program = self._programs[key] = self._lower(
                device, evaluator, reasons, comm, chosen, params.resharding, strict, host, hoisting
            )
            return program, True

    def _lower(
        self,
        device: torch.device,
        evaluator: str,
        reasons: tuple[str, ...],
        comm=None,
        chosen=None,
        resharding: str = "auto",
        strict=False,
        host: frozenset = frozenset(),
        hoisting=None,
    ) -> _Program:
        rank = comm.rank if comm is not None else 0
        dumper = Dumper(rank)
        dumper.emit("fusion_ir", "Fusion:", printer.print_fusion(self.fusion))
        if comm is None:
            options = LoweringOptions(resharding=resharding, host_inputs=host, hoisting=hoisting)
        else:
            options = LoweringOptions(
                rank=comm.rank,
                backend=backends.of_process_group(comm.backend).name,
                schedule=chosen,
                resharding=resharding,
                host_inputs=host,
                hoisting=hoisting,
            )
        lowered = lower(self.fusion, options, dumper)
        container = lowered.program
        container.label = self.label.strip()
        self.lowerings += 1
        streams = self._streams.get(device)
        if streams is None:
            streams = self._streams[device] = streams_for(device)
        if evaluator == "cpp" and not strict:
            # "auto": a program with ops the C++ executor lacks (a copy-engine
            # transport, chunked views, transfers) runs on the Python evaluator.
            reasons = tuple(flat.unsupported_reasons(container))
            if reasons:
                evaluator = "python"
        runner = Runner(evaluator, reasons)
        if dumper.enabled("host_ir"):
            # The program's dump ends with a newline; the runner is its last line.
            dumper.emit("host_ir", f"Host program{self.label}:", f"{container}{runner}\n")
        logger.info("%s", runner)
        torch_dist.check_backends(container, device, comm.backend if comm is not None else None)
        make = cpp.CppEvaluator if evaluator == "cpp" else HostIrEvaluator
        run = make(container, streams=streams, device=device, communicator=comm, dumper=dumper, rank=lowered.rank)
        if logger.isEnabledFor(logging.INFO):
            exprs = list(container.walk())
            comms = sum(isinstance(e, ir.Communication) for e in exprs)
            logger.info(
                "lowered fusion %s%s to a host program of %d ops (%d communications), digest %s; "
                "evaluator %s on %s with %s",
                signature(self.fusion), self.label, len(exprs), comms, (lowered.digest or "")[:12],
                type(run).__name__, device, type(streams).__name__,
            )
        binding = Binding.of(container)
        program = _Program(container, run, equal_input_axes(self.fusion), binding, runner, lowered=lowered)
        if isinstance(run, cpp.CppEvaluator) and not any(not isinstance(v, ir.TensorView) for v in container.inputs):
            run.take_views(binding.views())
            program.logical = True
        return program

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
        protocol.of(comm).refuse_after_failure()
        return comm, error

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
    def _finish(self, call: _Call) -> list[torch.Tensor | None] | None:
        """Stages 5-7, the same for every route; None where a prepared
        call's preallocated outputs are not its graph's (the full path then
        captures another graph)."""
        bound = self._bind(call)
        if bound is None:
            return None
        return self._convert(call, self._run(call, bound), bound is _LOGICAL)

    def _bind(self, call: _Call) -> tuple[list, list | None] | object | None:
        """The call's inputs and preallocated outputs with the program's
        runtime axes; `_LOGICAL` where the runner binds and converts back
        itself (`_Program.logical`)."""
        if call.program.logical and call.outputs is None and call.graph is None and call.capture is None:
            return _LOGICAL
        binding = call.program.binding
        given = None if call.outputs is None else binding.outputs(call.outputs)
        if call.exact_outputs and call.graph is not None and given is not None and not call.graph.writes_into(given):
            return None
        return binding.inputs(call.inputs), given

    def _run(self, call: _Call, bound: tuple[list, list | None]) -> list:
        """Run the program on the bound tensors with its runner (the C++
        executor, the Python evaluator or the fake runner), or replay its
        CUDA graph (captured here on the first call of a signature)."""
        program = call.program
        self.last_runner = program.runner
        nos = call.number_of_streams
        if bound is _LOGICAL:
            try:
                return program.evaluator.run_logical(call.inputs, nos)
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


class _FakeRun:
    """The fake runner (HOSTIR_FAKE=1): the dry run's outputs of this rank
    as meta tensors."""

    def __init__(self, outputs, shapes):
        self._outputs = list(zip(outputs, shapes))

    def run(self, bindings, number_of_streams: int) -> list:
        return [
            None if shape is None else torch.empty(shape, dtype=tv.dtype, device="meta")
            for tv, shape in self._outputs
        ]


@functools.lru_cache(maxsize=64)
def _parsed_schedule(text: str) -> Schedule:
    return parse_schedule(text)


def _checked_schedule(value: object, where: str) -> None:
    """Raise the schedule's own error (naming `where`) unless `value` is a
    Schedule or its valid text."""
    if isinstance(value, Schedule):
        return
    if not isinstance(value, str):
        raise InputTypeError(f"{where} must be a Schedule or its text (ring:chunks=2, ...), got {type(value).__name__}")
    try:
        _parsed_schedule(value)
    except ScheduleError as err:
        raise ScheduleError(f"{where}={value!r}: {err}") from None


def _device_of(inputs: list) -> torch.device:
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


def _check_mode(params, kwargs: dict) -> str:
    """The call's check_ranks where it is a valid one, else "always" (the
    full path then raises the parameter's error on every rank)."""
    mode = params.check_ranks if isinstance(params, ExecutorParams) else kwargs.get("check_ranks", "always")
    return mode if type(mode) is str and mode in CHECK_RANKS else "always"


@contextlib.contextmanager
def _held(comm):
    """Hold `comm`'s protocol for one multi-device call (`Protocol.held`)."""
    if comm is None:
        yield
        return
    with protocol.of(comm).held():
        yield


def _key_text(key: tuple) -> str:
    inputs, _, evaluator, resharding, static, chosen, host, hoisting = key
    parts = ", ".join(
        f"{str(dtype).removeprefix('torch.')}/{ndim}d{'' if contiguous else ' strided'}"
        for dtype, ndim, contiguous in inputs
    )
    text = f"inputs ({parts}), evaluator {evaluator}, resharding {resharding}"
    if static:
        text += ", static sizes " + ", ".join(f"input {i} axis {axis} = {size}" for i, axis, size in static)
    if host:
        text += ", streamed inputs " + ", ".join(map(str, sorted(host)))
    text += "" if hoisting is None else f", hoisting {hoisting}"
    return text + ("" if chosen is None else f", schedule {chosen}")




