"""FusionDefinition: the Python API users write programs with.

    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=torch.float32)
        y = fd.ops.set(x)
        fd.add_output(y)
    y.axis(0).parallelize(ParallelType.stream)
    out, = fd.execute([torch.randn(8, 16)])

Tensors and ops are defined inside the `with` block; scheduling
(`parallelize`) may follow it. `execute` lowers the program on first use and
whenever the definition or the inputs' signature changes.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from hostir import autograd, broadcast_ops, builders, communicator, index_ops, ir, layout, printer, shape_ops
from hostir.analysis.dry_run import dry_run
from hostir.dtensor import Adapter, has_dtensors, is_dtensor
from hostir.errors import DefinitionError, DefinitionTypeError, UsageError
from hostir.executor import ExecutorParams, FusionExecutor
from hostir.kinds import UnaryKind
from hostir.runtime import profiling
from hostir.runtime.checks import InputError, InputTypeError


class Ops:
    """`fd.ops`: the ops a fusion can hold."""

    def __init__(self, fd: FusionDefinition):
        self._fd = fd

    def _check(self, *operands):
        self._fd._require_defining("an op")
        for v in operands:
            if isinstance(v, ir.TensorView) and v.owner is not self._fd.fusion:
                raise DefinitionError(f"T{v.name} belongs to another FusionDefinition")
            if isinstance(v, ir.InputScalar) and not any(v is s for s in self._fd.fusion.inputs):
                raise DefinitionError(f"scalar {v!r} belongs to another FusionDefinition")

    def set(self, x: ir.TensorView, memory: str | None = None, rows=None) -> ir.TensorView:
        """A copy of `x`; with `memory="host"` a copy in host memory (a
        transfer from the device), with `memory="device"` a copy in device
        memory (a transfer of a tensor in host memory).

        `rows=(sent, received)` sizes a resharding copy at run time: `x` is
        [sender piece, receiver piece, B, ...] with B a bound on the rows,
        and the int64 tensors `sent` and `received` [sender piece, receiver
        piece, ...], sharded as `x` and as the result, count each piece's
        real rows (summed over their axes past the two). Only those rows
        move (an AllToAll of sizes known at run time); the rest of the
        result is zeros. `received` is what the peers' `sent` say, so it is
        computed by the program: the set of `sent` resharded as the
        result."""
        self._check(x)
        sent = received = None
        if rows is not None:
            if not isinstance(rows, (tuple, list)) or len(rows) != 2:
                raise DefinitionTypeError(f"set: rows must be a pair (sent, received), got {rows!r}")
            sent, received = rows
            self._check(sent, received)
        if memory is None:
            return builders.set_(x, rows=sent, rows_in=received)
        return builders.set_(x, ir.MemoryType.from_word(memory), sent, received)

    def add(self, lhs, rhs) -> ir.TensorView:
        self._check(lhs, rhs)
        return builders.binary("add", lhs, rhs)

    def sub(self, lhs, rhs) -> ir.TensorView:
        self._check(lhs, rhs)
        return builders.binary("sub", lhs, rhs)

    def mul(self, lhs, rhs) -> ir.TensorView:
        self._check(lhs, rhs)
        return builders.binary("mul", lhs, rhs)

    def div(self, lhs, rhs) -> ir.TensorView:
        """True division, as torch.div."""
        self._check(lhs, rhs)
        return builders.binary("div", lhs, rhs)

    def _unary(self, kind: str, x: ir.TensorView) -> ir.TensorView:
        self._check(x)
        return builders.unary(kind, x)

    # The elementwise unary ops are methods made from their declarations
    # (`UnaryKind.in_ops`, below the class): relu, silu, neg, abs, exp,
    # tanh, sigmoid, and any kind declared since. gelu and cast take
    # parameters of their own and are written here.
    if TYPE_CHECKING:

        def __getattr__(self, name: str) -> Callable[[ir.TensorView], ir.TensorView]: ...

    def gelu(self, x: ir.TensorView, approximate: str = "none") -> ir.TensorView:
        """torch.nn.functional.gelu: the exact (erf) form, or with
        `approximate="tanh"` the tanh form."""
        if approximate not in ("none", "tanh"):
            raise DefinitionError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
        return self._unary("gelu" if approximate == "none" else "gelu_tanh", x)

    def cast(self, x: ir.TensorView, dtype: torch.dtype) -> ir.TensorView:
        """`x` converted to `dtype`, as Tensor.to(dtype)."""
        self._check(x)
        return builders.unary("cast", x, dtype)

    def sum(self, x: ir.TensorView, dims) -> ir.TensorView:
        """Sum over `dims`; integer inputs sum to int64, as in torch."""
        self._check(x)
        return builders.reduction("sum", x, dims)

    def max(self, x: ir.TensorView, dims) -> ir.TensorView:
        self._check(x)
        return builders.reduction("max", x, dims)

    def min(self, x: ir.TensorView, dims) -> ir.TensorView:
        self._check(x)
        return builders.reduction("min", x, dims)

    def matmul(self, a: ir.TensorView, b: ir.TensorView) -> ir.TensorView:
        """torch.matmul of [..., M, K] and [K, N] or [..., K, N]."""
        self._check(a, b)
        return builders.matmul(a, b)

    def linear(self, x: ir.TensorView, weight: ir.TensorView, bias: ir.TensorView | None = None) -> ir.TensorView:
        """x @ weight.T (+ bias), weight [N, K], bias [N]."""
        self._check(x, weight, bias)
        return builders.linear(x, weight, bias)

    def broadcast_in_dim(self, x: ir.TensorView, shape, broadcast_dims) -> ir.TensorView:
        """`x` with its axis i at output axis `broadcast_dims[i]`, new axes
        of size `shape[j]` elsewhere, and size-1 axes grown to `shape`
        (nvFuser's broadcast_in_dim), as a copy."""
        self._check(x)
        return broadcast_ops.broadcast_in_dim(x, shape, broadcast_dims)

    def broadcast(self, x: ir.TensorView, is_broadcast_dim) -> ir.TensorView:
        """nvFuser's `broadcast`: `is_broadcast_dim` has one bool per
        output axis, True where a new size-1 axis goes, False where the
        next axis of `x` goes (as many False as `x` has axes); as
        `x.unsqueeze` at each True position. A `broadcast_in_dim` that only
        adds size-1 axes, as a copy."""
        self._check(x)
        return broadcast_ops.broadcast(x, is_broadcast_dim)

    def expand(self, x: ir.TensorView, shape) -> ir.TensorView:
        """`x` with its size-1 axes grown to `shape` (-1 keeps an axis), as
        torch's expand, as a copy."""
        self._check(x)
        return broadcast_ops.expand(x, shape)

    def permute(self, x: ir.TensorView, dims) -> ir.TensorView:
        """`x` with its axes in the order `dims`: a view, as torch.permute."""
        self._check(x)
        return shape_ops.permute(x, dims)

    def reshape(self, x: ir.TensorView, shape) -> ir.TensorView:
        """`x` with shape `shape` (ints, one of them may be -1): a view where
        torch.reshape makes one, else a copy."""
        self._check(x)
        return shape_ops.reshape(x, shape)

    def slice(self, x: ir.TensorView, start_indices, end_indices, strides=None) -> ir.TensorView:
        """`x[start:end:stride, ...]`, one start, end (None: to the end)
        and stride per axis, as nvFuser's `fd.ops.slice`: a view, as
        torch's slicing."""
        self._check(x)
        return shape_ops.slice_(x, start_indices, end_indices, strides)

    def cat(self, tensors, dim: int) -> ir.TensorView:
        """`torch.cat(tensors, dim)`: the tensors (one dtype, equal sizes
        but along `dim`) joined along axis `dim`, as nvFuser's
        `fd.ops.cat`; more than two are joined pairwise, left to right."""
        self._check(*(tensors if isinstance(tensors, (list, tuple)) else ()))
        return shape_ops.cat(tensors, dim)

    def select(self, x: ir.TensorView, index, dim: int) -> ir.TensorView:
        """A copy of `x.select(dim, index)`; `index` is an int or an integer
        scalar input (`fd.define_scalar(dtype=torch.int64)`)."""
        self._check(x, index)
        return shape_ops.select(x, dim, index)

    def topk(self, x: ir.TensorView, k: int) -> tuple[ir.TensorView, ir.TensorView]:
        """The `k` largest elements of `x` along its last axis and their
        positions (int64), largest first: `torch.topk(x, k)`'s values and
        indices. The values are a `take` of `x` at the indices, so their
        gradient reaches `x` (a `put_add`)."""
        self._check(x)
        indices = index_ops.topk(x, k)
        return index_ops.take(x, indices, batch=x.logical_ndim - 1, features=0), indices

    def route(self, indices: ir.TensorView, experts: int, capacity: int, groups: int = 1, packed: bool = False):
        """Where a mixture-of-experts layer's choices go: `indices` [...,
        tokens, k] holds each token's k experts (ids in [0, experts));
        returns `(slot, source)`: `slot` [..., tokens, k], each choice's row
        `e * capacity + c` in a buffer of `capacity` rows per expert (c:
        how many earlier tokens chose e; -1 where c >= capacity: dropped),
        and `source` [..., groups, experts / groups, capacity], the token
        each row holds (-1: empty), grouped as `groups` ranks hold the
        experts. Tokens keep their order within an expert (a stable
        permutation); `take(x, source)` dispatches, `take(y, slot)`
        combines.

        `packed`: `capacity` rows per group (rank) instead, filled from the
        first, expert after expert (`source` [..., groups, capacity]): the
        exact form, whose per-expert row counts `route_counts` gives."""
        self._check(indices)
        return (
            index_ops.route(indices, experts, capacity, "slot", groups, packed),
            index_ops.route(indices, experts, capacity, "source", groups, packed),
        )

    def route_counts(
        self, indices: ir.TensorView, experts: int, capacity: int, groups: int = 1, packed: bool = False
    ) -> ir.TensorView:
        """The pairs each expert keeps under `route` with the same
        arguments, [..., groups, experts / groups] (int64): the sizes of
        the groups of a packed buffer's rows."""
        self._check(indices)
        return index_ops.route(indices, experts, capacity, "counts", groups, packed)

    def grouped_mm(self, x: ir.TensorView, weight: ir.TensorView, counts: ir.TensorView) -> ir.TensorView:
        """The grouped GEMM: `x` [*batch, R, K] holds rows grouped by
        `counts` [*batch, G] (group g: the `counts[g]` rows after the
        earlier groups'); each row times its group's `weight` [*wbatch, G,
        N, K] transposed gives [*batch, R, N], zeros past the groups' rows.
        `wbatch` is a suffix of `batch` (the weight shared by the leading
        axes). `torch._grouped_mm` where it takes the sizes."""
        self._check(x, weight, counts)
        return index_ops.grouped_mm(x, weight, counts)

    def take(
        self,
        x: ir.TensorView,
        index: ir.TensorView,
        batch: int = 0,
        features: int = 1,
        inverse: ir.TensorView | None = None,
    ) -> ir.TensorView:
        """Rows of `x` by index: `x` is [*batch, *rows, *features] (`batch`
        leading and `features` trailing axes; the axes between are the
        rows, counted as one flat axis), `index` [*batch, *picks] (int64);
        the result [*batch, *picks, *features] holds row `index[b, p]` of
        batch element b at p, zeros where the index is negative.
        `inverse` [*batch, *rows, m] (int64), optional: for each row of
        `x`, the flat picks that read it (-1 padding), which makes the
        gradient a gather and a sum over m instead of a scatter of adds
        (`route`'s slot is the inverse of its source). It is not checked
        against `index`: a wrong inverse gives a wrong gradient."""
        self._check(x, index, *([] if inverse is None else [inverse]))
        return index_ops.take(x, index, batch, features, inverse)

    def put_add(
        self, x: ir.TensorView, index: ir.TensorView, like: ir.TensorView, batch: int = 0, features: int = 1
    ) -> ir.TensorView:
        """`take`'s transpose: zeros shaped as `like` ([*batch, *rows,
        *features]) with each row of `x` ([*batch, *picks, *features])
        added at row `index[b, p]`; negative indices add nothing."""
        self._check(x, index, like)
        return index_ops.put_add(x, index, like, batch, features)


def _unary_method(kind: UnaryKind) -> Callable[[Ops, ir.TensorView], ir.TensorView]:
    def method(self: Ops, x: ir.TensorView) -> ir.TensorView:
        return self._unary(kind, x)

    method.__name__ = kind.value
    method.__qualname__ = f"Ops.{kind.value}"
    method.__doc__ = f"`{kind.value}` of each element of `x` (`hostir.kinds.UnaryKind.{kind.value}`)."
    return method


for _kind in UnaryKind:
    if _kind.in_ops and _kind.value not in vars(Ops):
        setattr(Ops, _kind.value, _unary_method(_kind))


class FusionDefinition:
    def __init__(self) -> None:
        self.fusion = ir.Fusion()
        self.ops = Ops(self)
        self.executor = FusionExecutor(self.fusion)
        self._adapter: Adapter | None = None
        self._state = "new"

    def __enter__(self) -> FusionDefinition:
        if self._state != "new":
            raise UsageError("a FusionDefinition is defined once; create a new one")
        self._state = "defining"
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._state = "defined"
        if exc_type is None and not self.fusion.outputs:
            raise DefinitionError("the fusion has no outputs; call fd.add_output inside the with block")

    def _require_defining(self, what: str) -> None:
        if self._state != "defining":
            raise UsageError(f"{what} must be defined inside `with FusionDefinition() as fd:`")

    def define_tensor(
        self, shape: Sequence[int], dtype: torch.dtype = torch.float32, memory: str = "device"
    ) -> ir.TensorView:
        """An input of the fusion. In `shape`, -1 is a symbolic extent (any
        size), 1 a broadcast axis, and any other size a fixed extent.
        `memory="host"` takes the input in host memory (a CPU tensor, also
        when the program runs on a GPU): the program moves it to the device
        where an op reads it, on a copy stream, as early as the memory
        budget allows (see docs/offload.md)."""
        self._require_defining("define_tensor")
        memory_type = ir.MemoryType.from_word(memory)
        if not isinstance(dtype, torch.dtype):
            raise DefinitionTypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        if isinstance(shape, (int, torch.Tensor)) or not isinstance(shape, Sequence):
            raise DefinitionTypeError(f"shape must be a list of ints, got {shape!r}")
        return self.fusion.new_tensor(list(shape), dtype, memory_type)

    def define_scalar(self, dtype: torch.dtype | type = torch.float64) -> ir.InputScalar:
        """A scalar input of the fusion: `execute` takes a Python number in
        its place. `dtype` is torch.float64 (or float), torch.int64 (or
        int) or torch.bool (or bool). Usable as an operand of add, sub, mul,
        div and as the index of select."""
        self._require_defining("define_scalar")
        dtype = {float: torch.float64, int: torch.int64, bool: torch.bool}.get(dtype, dtype)
        if not isinstance(dtype, torch.dtype):
            raise DefinitionTypeError(f"dtype must be a torch.dtype or float, int or bool, got {dtype!r}")
        return self.fusion.new_scalar(dtype)

    def add_output(self, tv: ir.TensorView) -> None:
        self._require_defining("add_output")
        self.fusion.add_output(tv)

    def execute(
        self,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor] | None = None,
        *,
        params: ExecutorParams | None = None,
        trace: str | os.PathLike[str] | None = None,
        return_dtensors: bool | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run the fusion on `inputs` and return its outputs. With
        `outputs`, write into those tensors (all or none) and return them.
        Keyword arguments are fields of ExecutorParams (number_of_streams,
        evaluator, device, ...). With grad mode on and an input that
        requires grad, the outputs carry one autograd node whose backward
        runs the fusion's backward program (`hostir.autograd`); set
        `fd.keep_gathered = True` to save gathered operands instead of
        gathering them again in the backward.

        Inputs may be DTensors: their placements shard the fusion's inputs
        (or are checked against the shardings set), and the outputs come
        back as DTensors; `return_dtensors=True` asks for DTensor outputs
        from plain local inputs too. `trace=DIR` writes this run's
        Chrome / Perfetto trace to DIR/hostir_trace_rank<R>.json."""
        if self._state != "defined":
            raise UsageError("execute the fusion after its `with FusionDefinition() as fd:` block")
        if torch.is_grad_enabled() and autograd.requires_grad(inputs) and trace is None:
            return autograd.execute(self, inputs, outputs, params, return_dtensors, kwargs)
        wrap = bool(return_dtensors)
        if has_dtensors(inputs) or has_dtensors(outputs):
            wrap = return_dtensors is not False
            inputs = self._dtensors().local_inputs(inputs)
            if outputs is not None:
                outputs = [o.to_local() if is_dtensor(o) else o for o in outputs]
        if wrap:
            self._dtensors().check_outputs()
        if trace is None:
            results = self.executor.execute(inputs, outputs, params, **kwargs)
        else:
            with profiling.tracing(trace, communicator.rank()):
                results = self.executor.execute(inputs, outputs, params, **kwargs)
        return self._dtensors().wrap_outputs(results) if wrap else results

    def _dtensors(self) -> Adapter:
        if self._adapter is None:
            self._adapter = Adapter(self.fusion)
        return self._adapter

    def host_ir(self, resharding: str = "auto", inputs=None, **kwargs) -> str:
        """The lowered host program, in the dump format; `resharding` as
        `execute` takes it ("auto", "before", "after", "strict").

        Without `inputs` it is the program of no particular input
        signature, lowered with the default hoisting (each communication
        and transfer posted as early as operands and the default budget
        allow), not the machine model's per-signature choice. With `inputs`
        (and `execute`'s keyword arguments, such as `hoist=`), it is the
        program a call with those inputs runs: sequential, hoisted or in
        chunks, as the machine model chose for their shapes."""
        return self.executor.host_ir(resharding, inputs, **kwargs)

    def host_program(self, resharding: str = "auto", inputs=None, **kwargs):
        """This rank's lowered `HostIrContainer` (for `hostir.check_races`);
        `resharding`, `inputs` and keyword arguments as `host_ir` takes
        them. What it was lowered with (the rank it was pruned for, its
        digest and teams) is `executor.lowered_program(...)`."""
        return self.executor.host_program(resharding, inputs, **kwargs)

    def graph_inputs(self, inputs, outputs=None, params=None, **kwargs) -> list[torch.Tensor]:
        """The input buffers of the CUDA graph that
        `execute(inputs, outputs, params, cuda_graph=True, ...)` replays
        (the call is run once first if its graph is new). Write new values
        into them and pass them to `execute` with the same arguments, and a
        replay copies no input: the rest is `graph.replay()`."""
        if self._state != "defined":
            raise UsageError("ask for graph inputs after the `with FusionDefinition() as fd:` block")
        return self.executor.graph_inputs(inputs, outputs, params, **kwargs)

    def dry_run(self, inputs, world_size: int | None = None, backward: bool = False, **kwargs):
        """`hostir.dry_run(self, inputs, world_size, ...)`: every rank's
        program on meta tensors, without running anything. With
        `backward=True`, the training step's: the training forward, the
        backward, and per rank their peaks and the bytes saved between them
        (`hostir.analysis.training`; `wrt=` picks the inputs to differentiate)."""
        if self._state != "defined":
            raise UsageError("dry-run the fusion after its `with FusionDefinition() as fd:` block")
        if backward:
            from hostir.analysis.training import dry_run_training

            return dry_run_training(self, inputs, world_size=world_size, **kwargs)
        return dry_run(self, inputs, world_size=world_size, **kwargs)

    @property
    def last_runner(self):
        """What ran the latest `execute` and why: a `hostir.executor.Runner`
        with `name` ("cpp", "python" or "fake") and `reason` (every reason
        the C++ executor is not used); None before the first call."""
        return self.executor.last_runner

    @property
    def last_schedule(self):
        """The schedule the latest `execute`'s program was lowered with (a
        `hostir.lower.schedule.Schedule`: the one asked for, or the
        planner's choice, whose `note` holds the model's figures); None
        before the first call or where the planner had nothing to choose
        (the lowering's default then)."""
        return self.executor.last_schedule

    @property
    def num_programs(self) -> int:
        """How many lowered programs are cached (one per input signature and
        per set of static sizes)."""
        return self.executor.num_programs

    def __repr__(self) -> str:
        return printer.print_fusion(self.fusion)


def shard_tensor(t: torch.Tensor, tv: ir.TensorView, rank: int | None = None) -> torch.Tensor:
    """This rank's piece of the whole tensor `t` for input `tv`: for a
    `mesh_x` axis, index `rank`'s position along it (the axis stays, with
    size 1); for an axis split with a `mesh_x` piece, the matching rows
    (extent / mesh size of them). `t` is returned as is if `tv` is not
    sharded. `rank` defaults to this process's rank."""
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"shard_tensor takes a torch.Tensor, got {type(t).__name__}")
    logical = tv.logical_runtime()
    if t.dim() != len(logical):
        raise InputError(f"T{tv.name} has {len(logical)} axes but the tensor has shape {list(t.shape)}")
    if not tv.device_axes():
        return t
    mesh = tv.mesh
    if mesh is None:
        raise InputError(f"T{tv.name} has a mesh_x axis but no mesh; call set_device_mesh")
    rank = communicator.rank() if rank is None else rank
    if rank not in mesh:
        raise InputError(f"rank {rank} is not in {mesh!r}, which T{tv.name} lives on")
    for axis, d in enumerate(logical):
        leaves = d.loop_leaves()
        if not any(x.is_device_parallel for x in leaves):
            continue
        size = t.shape[axis]
        if d.leaves is None:
            n = mesh.size_along(d.parallel_type)
            if size != n:
                raise InputError(f"axis {axis} of T{tv.name}: extent {size} differs from mesh size {n}")
            t = t.narrow(axis, mesh.index_along(rank, d.parallel_type), 1)
            continue
        n = layout.shard_count(mesh, d)
        if size % n:
            raise InputError(f"axis {axis} of T{tv.name}: extent {size} not divisible by mesh size {n}")
        pieces = layout.leaf_sizes(leaves, size, mesh)
        known = math.prod(p for p, x in zip(pieces, leaves) if x.is_device_parallel or x.extent.is_constant)
        if size % known:
            raise InputError(f"extent {size} not divisible by {known}")
        view = t.reshape(list(t.shape[:axis]) + pieces + list(t.shape[axis + 1 :]))
        for j, x in enumerate(leaves):
            if x.is_device_parallel:
                view = view.narrow(axis + j, mesh.index_along(rank, x.parallel_type), 1)
        t = view.reshape(list(t.shape[:axis]) + [size // n] + list(t.shape[axis + 1 :]))
    return t
