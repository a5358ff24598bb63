"""The checks every call of a fusion passes before any work: its inputs'
count, types, dtypes, ranks, fixed sizes and device; the sizes the
program's ops make equal; reductions over empty axes; chunked axes that
must divide; preallocated outputs' shapes, dtypes, devices and overlaps.

The executor runs them on real tensors and the dry run on meta tensors, so
that both raise the same errors. Sizes are those of this rank's pieces: 1
on a mesh_x axis, extent / mesh size on a split axis sharded by the mesh.
"""

from __future__ import annotations

import torch

from hostir import axis_graph, ir, layout, mesh_extents
from hostir.errors import HostIrError, ScheduleError
from hostir.kinds import ReductionKind

__all__ = [
    "ExecuteArgumentError",
    "as_list",
    "InputError",
    "InputTypeError",
    "check_chunks",
    "check_inputs",
    "check_no_overlap",
    "check_outputs",
    "check_reductions",
    "check_sizes",
    "check_world",
    "equal_input_axes",
    "input_key",
    "is_multi_device",
    "ranks_needed",
    "signature",
]


class InputError(HostIrError, ValueError):
    """An input or preallocated output does not fit the fusion."""


class InputTypeError(HostIrError, TypeError):
    """An input, output or parameter of `execute` is of the wrong type or dtype."""


class ExecuteArgumentError(HostIrError, ValueError):
    """A bad execution parameter, or a fusion that needs more ranks than run."""


def input_key(inputs: list) -> tuple:
    """Exact shapes and dtypes of the inputs: the key of size-dependent
    artifacts such as a dry-run report."""
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else (type(t).__name__,) for t in inputs)


def ranks_needed(fusion: ir.Fusion) -> int:
    """How many ranks the meshes of `fusion` name (1 without a mesh)."""
    tvs = list(fusion.inputs) + [v for e in fusion.exprs for v in e.outputs()]
    return max((max(tv.mesh.devices) + 1 for tv in tvs if getattr(tv, "mesh", None) is not None), default=1)


def as_list(values, what: str) -> list:
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
        dims = ", ".join("?" if not d.extent.is_constant else str(d.extent.value) for d in tv.loop_axes())
        parts.append(f"T{tv.name}: {str(tv.dtype).removeprefix('torch.')}[{dims}]")
    return "(" + ", ".join(parts) + ")"


def _check_tensor(what: str, tv: ir.TensorView, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != tv.dtype:
        raise InputTypeError(f"{what}: expected dtype {tv.dtype}, got {t.dtype}")


def check_inputs(
    fusion: ir.Fusion, inputs: list, device=None, sharded: bool = False, host: frozenset = frozenset()
) -> torch.device:
    """Raise unless `inputs` match the fusion's inputs in count, type, dtype,
    rank, fixed sizes and device; return the device to run on. Sizes are
    those of this rank's pieces: 1 on a mesh_x axis, extent / mesh size on
    a split axis sharded by the mesh. An input in host memory (defined with
    `memory="host"`, or at a position in `host`) must be on the CPU."""
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
    in_host = host | {i for i, tv in enumerate(fusion.inputs) if ir.in_host_memory(tv)}
    tensors = [t for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and i not in in_host]
    expected = torch.device(device) if device is not None else (tensors[0].device if tensors else torch.device("cpu"))
    for i, t in enumerate(inputs):
        if i in in_host and isinstance(t, torch.Tensor):
            if t.device.type != "cpu" and not (t.device.type == "meta" and expected.type == "meta"):
                raise InputError(
                    f'input {i} (T{fusion.inputs[i].name}) is in host memory (memory="host") but is on '
                    f"{t.device}; pass a CPU tensor (pinned, to stream at full speed)"
                )
            continue
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


def equal_input_axes(fusion: ir.Fusion) -> list[list[tuple[int, int]]]:
    """Groups of (input index, axis) whose whole sizes the program makes
    equal: axes its ops iterate together, through any chain of ops (the
    extents' classes), whether the axes are split or sharded or not."""
    classes = axis_graph.ExtentClasses(fusion.exprs)
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


def check_sizes(fusion: ir.Fusion, inputs: list, equal_axes) -> dict[ir.Scalar, int]:
    """Raise if input axes that the program makes equal differ in whole
    size (this rank's size times the ranks sharing the axis); return the
    whole size of every symbolic extent."""
    for group in equal_axes:
        (i0, a0), *rest = group
        t0 = fusion.inputs[i0]
        s0 = layout.whole_size(t0, t0.logical_runtime()[a0], inputs[i0].shape[a0])
        for i, a in rest:
            t = fusion.inputs[i]
            size = layout.whole_size(t, t.logical_runtime()[a], inputs[i].shape[a])
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
            sizes.setdefault(d.extent, layout.whole_size(tv, d, size))
    mesh_extents.check(fusion, sizes)
    return sizes


def check_reductions(fusion: ir.Fusion, sizes: dict) -> None:
    """A max or min over an empty axis has no value (torch raises): reject
    it before any work."""
    for e in fusion.exprs:
        if not isinstance(e, ir.ReductionOp) or e.kind is ReductionKind.sum:
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


def check_chunks(chunking, sizes: dict) -> None:
    """Raise unless every axis a decomposition splits into chunks divides
    (`chunking`: `LoweredProgram.chunking`, (extent, parts, where) each)."""
    for extent, parts, where in chunking:
        size = sizes.get(extent)
        if size is not None and size % parts:
            raise ScheduleError(
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
        where = torch.device("cpu") if ir.in_host_memory(tv) and device.type != "meta" else device
        if t.device != where:
            if where != device:
                raise InputError(f"{what} is on {t.device} but is in host memory: pass a CPU tensor")
            raise InputError(f"{what} is on {t.device} but the fusion runs on {device}")
        shape = [layout.local_size(tv, d, sizes) for d in tv.logical_runtime()]
        if list(t.shape) != shape:
            raise InputError(f"{what}: expected shape {shape}, got {list(t.shape)}")
        if not t.is_contiguous():
            raise InputError(f"{what} must be contiguous (strides {list(t.stride())})")
    check_no_overlap(fusion, outputs, inputs, tvs or fusion.outputs)


def check_no_overlap(fusion: ir.Fusion, outputs: list, inputs: list, tvs) -> None:
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



def check_call(fusion: ir.Fusion, inputs: list, device, world_size: int | None, host: frozenset) -> torch.device:
    """Every check of a call's inputs that needs no program, before any
    work: the number of ranks (`world_size`; None for one device) and the
    inputs against the fusion (`check_inputs`); the device to run on."""
    if world_size is not None:
        check_world(fusion, world_size)
    return check_inputs(fusion, inputs, device, sharded=world_size is not None, host=host)


def check_against_program(
    fusion: ir.Fusion, inputs: list, outputs: list | None, device, equal_axes, chunking, output_tvs
) -> None:
    """Every check of a call that needs its program: the sizes of the axes
    ops iterate together (`equal_axes`), the reductions, the axes the
    program cut into chunks (`chunking`), and the preallocated outputs
    against the program's outputs (`output_tvs`)."""
    sizes = check_sizes(fusion, inputs, equal_axes)
    check_reductions(fusion, sizes)
    check_chunks(chunking, sizes)
    if outputs is not None:
        check_outputs(fusion, outputs, inputs, sizes, device, output_tvs)
