"""Run a fusion: check the inputs, lower once per input signature, evaluate.

`FusionExecutor.execute` validates every input and preallocated output
against the fusion before any work starts, looks up the lowered program for
the inputs' signature (dtypes, ranks, device, contiguity — not sizes: extents
are symbolic, so one program serves every shape), lowers it on a miss, and
runs it with the chosen evaluator under `torch.no_grad()`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from hostir import communicator, ir, layout, printer
from hostir.container import HostIrContainer
from hostir.evaluator import HostIrEvaluator
from hostir.lower import lower
from hostir.options import Dumper
from hostir.streams import streams_for

EVALUATORS = ("python",)
CHECK_RANKS = ("always", "first")


class RankMismatchError(ValueError):
    """Ranks disagree on the program or its inputs, or one rank rejected its
    inputs; raised on every rank, before any collective of the program."""


@dataclasses.dataclass
class ExecutorParams:
    """How to run a program.

    number_of_streams: worker streams a stream-parallel loop cycles through
        (`numberOfStreams` in the dump); at least 1.
    evaluator: "python", the reference interpreter.
    device: where to run; by default the device of the inputs (for a
        multi-device program, the communicator's: cuda:local_rank or cpu).
    backend: "nccl" or "gloo" for a multi-device program; by default nccl
        where CUDA is available. Used when the communicator is created.
    timeout: seconds any collective may wait for a peer (default
        HOSTIR_TIMEOUT, else 300). Used when the communicator is created.
    check_ranks: "always" (default) makes the ranks agree on the program and
        their inputs' shapes and dtypes before every run of a multi-device
        program: one small collective on a control group. "first" agrees
        only when a rank lowers a program, which saves that collective but
        lets a rank that alone changes its input shapes meet the others'
        collectives with the wrong sizes.
    """

    number_of_streams: int = 4
    evaluator: str = "python"
    device: torch.device | str | None = None
    backend: str | None = None
    timeout: float | None = None
    check_ranks: str = "always"

    def validate(self) -> None:
        n = self.number_of_streams
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"number_of_streams must be an integer >= 1, got {n!r}")
        if self.evaluator not in EVALUATORS:
            raise ValueError(f"unknown evaluator {self.evaluator!r}; expected one of {list(EVALUATORS)}")
        if self.check_ranks not in CHECK_RANKS:
            raise ValueError(f"check_ranks must be one of {list(CHECK_RANKS)}, got {self.check_ranks!r}")


@dataclasses.dataclass
class _Program:
    container: HostIrContainer
    evaluator: HostIrEvaluator
    # Input axes that ops iterate together: their sizes must be equal.
    equal_axes: list[list[tuple[int, int]]]


class FusionExecutor:
    def __init__(self, fusion: ir.Fusion):
        self.fusion = fusion
        self._programs: dict[tuple, _Program] = {}
        self._version = fusion.version
        self._streams: dict[torch.device, object] = {}
        self.lowerings = 0
        self._multi_device_at: int | None = None
        self._is_multi_device = False

    @property
    def num_programs(self) -> int:
        return len(self._programs)

    def host_ir(self) -> str:
        """The dump of the program the fusion lowers to now (for a
        multi-device fusion, this rank's program)."""
        if is_multi_device(self.fusion):
            rank = communicator.rank()
            backend = _BACKEND_NAMES["nccl" if torch.cuda.is_available() else "gloo"]
            return str(lower(self.fusion, rank=rank, backend=backend))
        return str(lower(self.fusion))

    def execute(
        self,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor] | None = None,
        params: ExecutorParams | None = None,
    ) -> list[torch.Tensor]:
        params = params or ExecutorParams()
        if self._multi_device():
            return self._execute_multi_device(inputs, outputs, params)
        params.validate()
        inputs, outputs = self._as_lists(inputs, outputs)
        device = check_inputs(self.fusion, inputs, params.device)
        program = self._program(inputs, device, params)
        sizes = check_sizes(self.fusion, inputs, program.equal_axes)
        container = program.container
        if outputs is not None:
            check_outputs(self.fusion, outputs, inputs, sizes, device, container.outputs)
        bindings = _bindings(container, inputs, outputs)
        with torch.no_grad():
            results = program.evaluator.run(bindings, number_of_streams=params.number_of_streams)
        return [layout.to_logical(tv, r) for tv, r in zip(container.outputs, results)]

    def _execute_multi_device(self, inputs, outputs, params: ExecutorParams) -> list[torch.Tensor]:
        """Check locally, agree across ranks, then run. Every local failure
        is shared with the other ranks first, so that all raise together
        instead of one raising and the others waiting in a collective."""
        comm, error = _communicator_for(params)
        if comm.failure is not None:
            raise RuntimeError(
                f"an earlier collective failed on this rank, so the ranks' collectives are out of step: "
                f"{comm.failure.splitlines()[0]}\nend the job (or call hostir.communicator.shutdown() on "
                f"every rank and start again)"
            )
        program, new = None, False
        try:
            if error is not None:
                raise error
            params.validate()
            inputs, outputs = self._as_lists(inputs, outputs)
            # Never hand a strided view to a collective (gloo would read the
            # wrong memory): compact first, which also keeps contiguity out of
            # the program cache's key so that all ranks hit or miss it together.
            inputs = [t.contiguous() if isinstance(t, torch.Tensor) else t for t in inputs]
            check_world(self.fusion, comm.world_size)
            device = check_inputs(self.fusion, inputs, comm.device, sharded=True)
            before = self.lowerings
            program = self._program(inputs, device, params, comm)
            new = self.lowerings != before
            sizes = check_sizes(self.fusion, inputs, program.equal_axes)
            if outputs is not None:
                check_outputs(self.fusion, outputs, inputs, sizes, device, program.container.outputs)
        except Exception as err:
            # Any failure before the program's first collective is shared
            # with the other ranks, which would otherwise wait in it.
            if params.check_ranks == "first":
                raise
            error = err
        teams = program.container.all_teams if program is not None else []
        need_groups = bool(comm.missing_teams(teams))
        if params.check_ranks != "first" or new:
            digest = program.container.digest if program is not None else None
            try:
                need_groups = agree(comm, digest, input_signature(inputs), error, need_groups)
            except (communicator.CommunicatorTimeout, communicator.PeerLostError) as err:
                comm.failure = f"{type(err).__name__}: {err}"
                raise
        if need_groups:
            comm.ensure_groups(teams)
        container = program.container
        bindings = _bindings(container, inputs, outputs)
        try:
            with torch.no_grad():
                results = program.evaluator.run(bindings, number_of_streams=params.number_of_streams)
        except (communicator.CommunicatorTimeout, communicator.PeerLostError) as err:
            comm.failure = f"{type(err).__name__}: {err}"
            raise
        return [None if r is None else layout.to_logical(tv, r) for tv, r in zip(container.outputs, results)]

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

    def _program(self, inputs, device: torch.device, params: ExecutorParams, comm=None) -> _Program:
        if self.fusion.version != self._version:
            self._programs.clear()
            self._version = self.fusion.version
        key = (
            tuple(
                (t.dtype, t.dim(), t.is_contiguous()) if isinstance(t, torch.Tensor) else "scalar"
                for t in inputs
            ),
            device,
            params.evaluator,
        )
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self._lower(device, comm)
        return program

    def _lower(self, device: torch.device, comm=None) -> _Program:
        rank = comm.rank if comm is not None else 0
        dumper = Dumper(rank)
        dumper.emit("fusion_ir", "Fusion:", printer.print_fusion(self.fusion))
        if comm is None:
            container = lower(self.fusion, dumper)
        else:
            container = lower(self.fusion, dumper, rank=comm.rank, backend=_BACKEND_NAMES[comm.backend])
        dumper.emit("host_ir", "Host program:", str(container))
        self.lowerings += 1
        streams = self._streams.get(device)
        if streams is None:
            streams = self._streams[device] = streams_for(device)
        evaluator = HostIrEvaluator(container, streams=streams, device=device, communicator=comm, dumper=dumper)
        return _Program(container, evaluator, _equal_input_axes(self.fusion))


def _communicator_for(params: ExecutorParams):
    """The process-wide communicator, and the error of asking for it with
    parameters that differ from the live one's (shared with the other ranks
    like any local error); with no live communicator, its creation error is
    raised here (the launch is broken on this rank)."""
    try:
        return communicator.get(backend=params.backend, timeout=params.timeout), None
    except (RuntimeError, TypeError, ValueError) as err:
        live = communicator.live()
        if live is None:
            raise
        return live, err


def _as_list(values, what: str) -> list:
    if isinstance(values, torch.Tensor) or not isinstance(values, (list, tuple)):
        raise TypeError(f"{what} must be a list of torch.Tensors, got {type(values).__name__}")
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
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != tv.dtype:
        raise TypeError(f"{what}: expected dtype {tv.dtype}, got {t.dtype}")


def check_inputs(fusion: ir.Fusion, inputs: list, device=None, sharded: bool = False) -> torch.device:
    """Raise unless `inputs` match the fusion's inputs in count, type, dtype,
    rank, fixed sizes and device; return the device to run on. Sizes are
    those of this rank's pieces: 1 on a mesh_x axis, extent / mesh size on
    a split axis sharded by the mesh."""
    if len(inputs) != len(fusion.inputs):
        raise ValueError(
            f"Wrong number of inputs: the fusion takes {len(fusion.inputs)} {signature(fusion)}, "
            f"got {len(inputs)}"
        )
    for i, (tv, t) in enumerate(zip(fusion.inputs, inputs)):
        if isinstance(tv, ir.InputScalar):
            if not tv.accepts(t):
                raise TypeError(
                    f"input {i} (scalar {tv.label}) must be a Python {_PYTHON_TYPES[tv.dtype]}, "
                    f"got {type(t).__name__} {t!r}"
                )
            continue
        what = f"input {i} (T{tv.name})"
        _check_tensor(what, tv, t)
        if t.dim() != tv.logical_ndim:
            raise ValueError(
                f"{what}: expected {tv.logical_ndim} dims, got {t.dim()} (shape {list(t.shape)}); "
                f"the fusion takes {signature(fusion)}"
            )
        for axis, (d, size) in enumerate(zip(tv.logical_runtime(), t.shape)):
            expected = layout.local_extent(d)
            if expected is not None and size != expected:
                whole = f" (extent {d.extent.value} sharded over {tv.mesh.x_size} ranks)" if expected != d.extent.value else ""
                raise ValueError(f"{what}: axis {axis} must have size {expected}{whole}, got {size}")
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    expected = torch.device(device) if device is not None else (tensors[0].device if tensors else torch.device("cpu"))
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor) and t.device != expected:
            where = " (the device of the first tensor input)" if device is None else (" (this rank's device)" if sharded else "")
            raise ValueError(
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
        raise ValueError(f"the fusion requests {needed} devices to run, but there are only {world_size} ranks{hint}")


def input_signature(inputs: list) -> list[tuple]:
    """What ranks compare of their inputs: shapes and dtypes (local pieces
    have the same shape on every rank: shards are even)."""
    if not isinstance(inputs, (list, tuple)):
        return [(None, type(inputs).__name__)]
    return [
        (list(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else (None, type(t).__name__)
        for t in inputs
    ]


def agree(comm, digest: str | None, inputs_sig: list, error: Exception | None, need_groups: bool = False) -> bool:
    """Raise `RankMismatchError` on every rank if any rank failed its local
    checks, lowered another program, or has inputs of other shapes or
    dtypes; else return whether any rank still lacks a process group of the
    program (then all create them together). Runs on the communicator's
    control group, so a rank that skips it ends in a timeout there rather
    than in a data collective."""
    mine = {
        "digest": digest,
        "inputs": inputs_sig,
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "need_groups": need_groups,
    }
    try:
        everyone = comm.all_gather_object(mine)
    except (communicator.CommunicatorTimeout, communicator.PeerLostError) as err:
        raise type(err)(
            f"the ranks' check of the program and its inputs, before running it, failed: {err}"
        ) from err
    for r, theirs in enumerate(everyone):
        if theirs["error"] is not None:
            raise RankMismatchError(f"rank {r} failed before the program ran: {theirs['error']}") from error
    ref = everyone[0]
    for r, theirs in enumerate(everyone[1:], start=1):
        if theirs["digest"] != ref["digest"]:
            raise RankMismatchError(
                f"the host program differs across ranks: rank {r} lowered program {theirs['digest'][:12]} "
                f"but rank 0 lowered {ref['digest'][:12]}; every rank must define and schedule the same "
                f"fusion (print it with HOSTIR_DUMP=host_ir HOSTIR_DUMP_RANKS=all)"
            )
        for i, (a, b) in enumerate(zip(theirs["inputs"], ref["inputs"])):
            if a != b:
                raise RankMismatchError(
                    f"inputs differ across ranks: rank {r} input {i} has shape {a[0]} and dtype {a[1]}, "
                    f"but rank 0 input {i} has shape {b[0]} and dtype {b[1]}"
                )
    return any(theirs["need_groups"] for theirs in everyone)


def _bindings(container, inputs: list, outputs: list | None) -> dict:
    """The program's inputs (and preallocated outputs) bound to the given
    tensors, viewed with their runtime dims."""
    bindings = {
        tv: layout.to_runtime(tv, t) if isinstance(tv, ir.TensorView) else t
        for tv, t in zip(container.inputs, inputs)
    }
    if outputs is not None:
        for tv, t in zip(container.outputs, outputs):
            bindings[tv] = layout.to_runtime(tv, t)
    return bindings


_BACKEND_NAMES = {"nccl": "NCCL", "gloo": "gloo"}


def _equal_input_axes(fusion: ir.Fusion) -> list[list[tuple[int, int]]]:
    """Groups of (input index, axis) whose sizes ops require to be equal."""
    where = {}
    for i, tv in enumerate(fusion.inputs):
        if not isinstance(tv, ir.TensorView):
            continue
        for axis, d in enumerate(tv.logical_runtime()):
            if not d.is_device_parallel and d.leaves is None:
                where[d] = (i, axis)
    groups = []
    for members in ir.IdGraph(fusion.exprs, broadcast=False).groups():
        found = sorted(where[d] for d in members if d in where)
        if len(found) > 1:
            groups.append(found)
    return groups


def check_sizes(fusion: ir.Fusion, inputs: list, equal_axes) -> dict[ir.Scalar, int]:
    """Raise if input axes that ops iterate together differ in size; return
    the size of every symbolic extent."""
    for group in equal_axes:
        (i0, a0), *rest = group
        for i, a in rest:
            if inputs[i].shape[a] != inputs[i0].shape[a0]:
                t0, t = fusion.inputs[i0], fusion.inputs[i]
                raise ValueError(
                    f"input {i} (T{t.name}) axis {a} has size {inputs[i].shape[a]} but input {i0} "
                    f"(T{t0.name}) axis {a0} has size {inputs[i0].shape[a0]}; an op of the fusion "
                    f"needs them equal"
                )
    sizes = {}
    for tv, t in zip(fusion.inputs, inputs):
        if not isinstance(tv, ir.TensorView):
            continue
        for d, size in zip(tv.logical_runtime(), t.shape):
            if d.is_device_parallel:
                continue
            sizes.setdefault(d.extent, layout.global_extent(d, size))
    return sizes


def check_outputs(fusion: ir.Fusion, outputs: list, inputs: list, sizes, device: torch.device, tvs=None) -> None:
    """Raise unless every output is preallocated with the right shape, dtype
    and device, contiguous, and sharing no memory with an input. `tvs` are
    the lowered program's outputs (which carry propagated shardings)."""
    unset = [i for i, t in enumerate(outputs) if t is None]
    if unset and len(unset) < len(outputs):
        raise ValueError(f"outputs must be all or none preallocated: outputs {unset} are None")
    if len(outputs) != len(fusion.outputs):
        raise ValueError(
            f"outputs must be all or none preallocated: the fusion has {len(fusion.outputs)} "
            f"outputs, got {len(outputs)} tensors"
        )
    for i, (tv, t) in enumerate(zip(tvs or fusion.outputs, outputs)):
        what = f"preallocated output {i} (T{tv.name})"
        _check_tensor(what, tv, t)
        if t.device != device:
            raise ValueError(f"{what} is on {t.device} but the fusion runs on {device}")
        shape = [_local_output_size(d, sizes) for d in tv.logical_runtime()]
        if list(t.shape) != shape:
            raise ValueError(f"{what}: expected shape {shape}, got {list(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous (strides {list(t.stride())})")
        if t.numel() and any(isinstance(x, torch.Tensor) and _shares_memory(t, x) for x in inputs):
            raise ValueError(f"{what} shares memory with an input; pass a separate buffer")


def _local_output_size(d: ir.IterDomain, sizes) -> int | None:
    fixed = layout.local_extent(d)
    if fixed is not None:
        return fixed
    size = sizes.get(d.extent)
    if size is None:
        return None
    return size // (layout.global_extent(d, 1))


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.device.type == "meta" or not b.numel():
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
