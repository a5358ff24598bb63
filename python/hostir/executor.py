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

from hostir import ir, printer
from hostir.container import HostIrContainer
from hostir.evaluator import HostIrEvaluator
from hostir.lower import lower
from hostir.options import Dumper
from hostir.streams import streams_for

EVALUATORS = ("python",)


@dataclasses.dataclass
class ExecutorParams:
    """How to run a program.

    number_of_streams: worker streams a stream-parallel loop cycles through
        (`numberOfStreams` in the dump); at least 1.
    evaluator: "python", the reference interpreter.
    device: where to run; by default the device of the inputs.
    """

    number_of_streams: int = 4
    evaluator: str = "python"
    device: torch.device | str | None = None

    def validate(self) -> None:
        n = self.number_of_streams
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"number_of_streams must be an integer >= 1, got {n!r}")
        if self.evaluator not in EVALUATORS:
            raise ValueError(f"unknown evaluator {self.evaluator!r}; expected one of {list(EVALUATORS)}")


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

    @property
    def num_programs(self) -> int:
        return len(self._programs)

    def host_ir(self) -> str:
        """The dump of the program the fusion lowers to now."""
        return str(lower(self.fusion))

    def execute(
        self,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor] | None = None,
        params: ExecutorParams | None = None,
    ) -> list[torch.Tensor]:
        params = params or ExecutorParams()
        params.validate()
        inputs = _as_list(inputs, "inputs")
        device = check_inputs(self.fusion, inputs, params.device)
        program = self._program(inputs, device, params)
        sizes = check_sizes(self.fusion, inputs, program.equal_axes)
        bindings = dict(zip(program.container.inputs, inputs))
        if outputs is not None:
            outputs = _as_list(outputs, "outputs")
            if all(t is None for t in outputs) and len(outputs) == len(self.fusion.outputs):
                outputs = None
        if outputs is not None:
            check_outputs(self.fusion, outputs, inputs, sizes, device)
            bindings.update(zip(program.container.outputs, outputs))
        with torch.no_grad():
            return program.evaluator.run(bindings, number_of_streams=params.number_of_streams)

    def _program(self, inputs, device: torch.device, params: ExecutorParams) -> _Program:
        if self.fusion.version != self._version:
            self._programs.clear()
            self._version = self.fusion.version
        key = (
            tuple((t.dtype, t.dim(), t.is_contiguous()) for t in inputs),
            device,
            params.evaluator,
        )
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self._lower(device)
        return program

    def _lower(self, device: torch.device) -> _Program:
        dumper = Dumper()
        dumper.emit("fusion_ir", "Fusion:", printer.print_fusion(self.fusion))
        container = lower(self.fusion, dumper)
        dumper.emit("host_ir", "Host program:", str(container))
        self.lowerings += 1
        streams = self._streams.get(device)
        if streams is None:
            streams = self._streams[device] = streams_for(device)
        evaluator = HostIrEvaluator(container, streams=streams, device=device)
        return _Program(container, evaluator, _equal_input_axes(self.fusion))


def _as_list(values, what: str) -> list:
    if isinstance(values, torch.Tensor) or not isinstance(values, (list, tuple)):
        raise TypeError(f"{what} must be a list of torch.Tensors, got {type(values).__name__}")
    return list(values)


def signature(fusion: ir.Fusion) -> str:
    """`(T0: float32[?, 8], T1: ...)`: what `execute` expects."""
    parts = []
    for tv in fusion.inputs:
        dims = ", ".join("?" if not d.extent.is_constant else str(d.extent.value) for d in tv.runtime_domain())
        parts.append(f"T{tv.name}: {str(tv.dtype).removeprefix('torch.')}[{dims}]")
    return "(" + ", ".join(parts) + ")"


def _check_tensor(what: str, tv: ir.TensorView, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != tv.dtype:
        raise TypeError(f"{what}: expected dtype {tv.dtype}, got {t.dtype}")


def check_inputs(fusion: ir.Fusion, inputs: list, device=None) -> torch.device:
    """Raise unless `inputs` match the fusion's inputs in count, type, dtype,
    rank, fixed sizes and device; return the device to run on."""
    if len(inputs) != len(fusion.inputs):
        raise ValueError(
            f"Wrong number of inputs: the fusion takes {len(fusion.inputs)} {signature(fusion)}, "
            f"got {len(inputs)}"
        )
    for i, (tv, t) in enumerate(zip(fusion.inputs, inputs)):
        what = f"input {i} (T{tv.name})"
        _check_tensor(what, tv, t)
        if t.dim() != tv.ndim:
            raise ValueError(
                f"{what}: expected {tv.ndim} dims, got {t.dim()} (shape {list(t.shape)}); "
                f"the fusion takes {signature(fusion)}"
            )
        for axis, (d, size) in enumerate(zip(tv.runtime_domain(), t.shape)):
            if d.extent.is_constant and size != d.extent.value:
                raise ValueError(f"{what}: axis {axis} must have size {d.extent.value}, got {size}")
    expected = torch.device(device) if device is not None else (inputs[0].device if inputs else torch.device("cpu"))
    for i, t in enumerate(inputs):
        if t.device != expected:
            raise ValueError(
                f"input {i} (T{fusion.inputs[i].name}) is on {t.device} but the fusion runs on {expected}"
                + ("" if device is not None else " (the device of input 0)")
            )
    return expected


def _equal_input_axes(fusion: ir.Fusion) -> list[list[tuple[int, int]]]:
    """Groups of (input index, axis) whose sizes ops require to be equal."""
    where = {}
    for i, tv in enumerate(fusion.inputs):
        for axis, d in enumerate(tv.runtime_domain()):
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
        for d, size in zip(tv.runtime_domain(), t.shape):
            sizes.setdefault(d.extent, size)
    return sizes


def check_outputs(fusion: ir.Fusion, outputs: list, inputs: list, sizes, device: torch.device) -> None:
    """Raise unless every output is preallocated with the right shape, dtype
    and device, contiguous, and sharing no memory with an input."""
    unset = [i for i, t in enumerate(outputs) if t is None]
    if unset and len(unset) < len(outputs):
        raise ValueError(f"outputs must be all or none preallocated: outputs {unset} are None")
    if len(outputs) != len(fusion.outputs):
        raise ValueError(
            f"outputs must be all or none preallocated: the fusion has {len(fusion.outputs)} "
            f"outputs, got {len(outputs)} tensors"
        )
    for i, (tv, t) in enumerate(zip(fusion.outputs, outputs)):
        what = f"preallocated output {i} (T{tv.name})"
        _check_tensor(what, tv, t)
        if t.device != device:
            raise ValueError(f"{what} is on {t.device} but the fusion runs on {device}")
        shape = []
        for d in tv.runtime_domain():
            shape.append(d.extent.value if d.extent.is_constant else sizes.get(d.extent))
        if list(t.shape) != shape:
            raise ValueError(f"{what}: expected shape {shape}, got {list(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous (strides {list(t.stride())})")
        if t.numel() and any(_shares_memory(t, x) for x in inputs):
            raise ValueError(f"{what} shares memory with an input; pass a separate buffer")


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.device.type == "meta" or not b.numel():
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
