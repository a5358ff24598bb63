"""A call's arguments: `ExecutorParams`, checked before any work, and the
inputs and outputs as lists on the device the program runs on.

`FusionExecutor.execute` (stage 1, normalize) reads everything it needs
of its parameters here, once: the plan's request (`ExecutorParams.request`),
the number of streams, the device, and the inputs placed there.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings

import torch

from hostir import communicator, ir, planner
from hostir.lower.hoist_transfers import forced as forced_hoisting
from hostir.lower.insert_reshardings import MODES as RESHARDING_MODES
from hostir.lower.schedule import Schedule, ScheduleError
from hostir.lower.schedule import parse as parse_schedule
from hostir.options import EVALUATORS
from hostir.runtime.checks import ExecuteArgumentError, InputTypeError, as_list

CHECK_RANKS = ("always", "first", "every")
HOST_INPUTS = ("copy", "stream")

__all__ = [
    "CHECK_RANKS",
    "EVALUATORS",
    "HOST_INPUTS",
    "ExecutorParams",
    "as_lists",
    "check_mode",
    "device_for",
    "placed",
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
        """The evaluator this run asks for, "python" or "cpp", and why the
        C++ executor is not used (before the program is known; the plan
        then says what runs it: `hostir.planner`)."""
        return planner.asked_runner(self.evaluator)

    def request(self, host: frozenset[int]) -> planner.Request:
        """What a call with these parameters asks of the plan; `host`: the
        positions of the inputs kept in host memory."""
        return planner.Request(
            self.evaluator, self.schedule, self.hoist, host, self.resharding, self.cuda_graph, self.number_of_streams
        )

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


def check_mode(params, kwargs: dict) -> str:
    """The call's check_ranks where it is a valid one, else "always" (the
    full path then raises the parameter's error on every rank)."""
    mode = params.check_ranks if isinstance(params, ExecutorParams) else kwargs.get("check_ranks", "always")
    return mode if type(mode) is str and mode in CHECK_RANKS else "always"


def as_lists(fusion: ir.Fusion, inputs, outputs) -> tuple[list, list | None]:
    """The inputs and outputs as lists; outputs of all None are none."""
    inputs = as_list(inputs, "inputs")
    if outputs is not None:
        outputs = as_list(outputs, "outputs")
        if all(t is None for t in outputs) and len(outputs) == len(fusion.outputs):
            outputs = None
    return inputs, outputs


def device_for(inputs: list, asked, comm) -> torch.device:
    """Where a call runs: the device asked for (`ExecutorParams.device`),
    else the communicator's, else the first input's on a GPU, else input
    0's."""
    if asked is not None:
        device = torch.device(asked)
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


def placed(fusion: ir.Fusion, inputs: list, device: torch.device, host: frozenset, warned: set) -> list:
    """The inputs with CPU ones copied to `device` if the program runs
    elsewhere (one warning per fusion, `warned`, names them and the bytes
    copied), except those in host memory (`host`: their positions), which
    the program streams."""
    if device.type != "cuda":
        return inputs
    moved = [
        i for i, t in enumerate(inputs)
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and i not in host
    ]  # fmt: skip
    if not moved:
        return inputs
    if "copy" not in warned:
        warned.add("copy")
        names = ", ".join(f"{i} (T{fusion.inputs[i].name})" for i in moved if i < len(fusion.inputs))
        size = sum(ir.nbytes(inputs[i]) for i in moved)
        warnings.warn(
            f"inputs {names} are on the CPU but the fusion runs on {device}: copied there "
            f"({size} bytes this call); pass them on {device} to avoid the copy",
            stacklevel=6,
        )
    return [t.to(device) if i in moved else t for i, t in enumerate(inputs)]


def normalized(fusion: ir.Fusion, inputs, outputs, params: ExecutorParams, comm, fake: bool, warned: set):
    """Stage 1 of a call: `params` checked, the inputs and outputs as
    lists, the device to run on (None for the fake runner), the inputs
    placed there (`placed`; compacted for a multi-device program, `comm`),
    and the call's request to the planner (`ExecutorParams.request`, with
    the positions of the inputs kept in host memory)."""
    params.validate()
    inputs, outputs = as_lists(fusion, inputs, outputs)
    request = params.request(host_positions(fusion, inputs, params.host_inputs))
    if fake:
        return inputs, outputs, None, request
    device = device_for(inputs, params.device, comm)
    inputs = placed(fusion, inputs, device, request.host, warned)
    if comm is not None:
        # Never hand a strided view to a collective (gloo would read the
        # wrong memory): compact first, which also keeps contiguity out of
        # the program cache's key so that all ranks hit or miss it together.
        inputs = [t.contiguous() if isinstance(t, torch.Tensor) else t for t in inputs]
    return inputs, outputs, device, request


def host_positions(fusion: ir.Fusion, inputs: list, host_inputs: str = "copy") -> frozenset:
    """Positions of the inputs a call passes in host memory: those defined
    with `memory="host"`, and with `host_inputs="stream"` every CPU tensor
    input too. The program streams them; nothing copies them before it."""
    defined = {i for i, tv in enumerate(fusion.inputs) if ir.in_host_memory(tv)}
    if host_inputs != "stream":
        return frozenset(defined)
    return frozenset(defined) | frozenset(
        i
        for i, (tv, t) in enumerate(zip(fusion.inputs, inputs))
        if isinstance(tv, ir.TensorView) and isinstance(t, torch.Tensor) and t.device.type == "cpu"
    )
