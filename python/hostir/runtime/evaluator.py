"""HostIrEvaluator: the reference interpreter of host programs.

It walks a `HostIrContainer` and runs each op with torch, on the CPU with
null streams or on CUDA with real ones. Handlers are found in a table keyed by
op class (`@impl`); each receives the `Frame` of its run, which holds that
run's values (so one evaluator may run in several threads at once), and
touches values only through the frame's `get` and `bind`, which resolve
aliases — the one place that does. An op whose output buffer is
already bound (a caller's preallocated output, an allocation, a slice) writes
into it with torch's `out=` variants; otherwise its result is bound fresh.
A failing op is reported with its dump line and the loop indices around it:
hostir's errors become a `HostIrRuntimeError` quoting them; torch's own
errors keep their type and carry them as a note (PEP 678).
Communications are posted through `hostir.runtime.transports` (NCCL and gloo on
the process groups of a `Communicator`, or the copy-engine `cuda`
transport) and complete at their `Wait`; a timeout or a lost peer keeps its
type (`CommunicatorTimeout`, `PeerLostError`).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Mapping, Protocol

import torch

from hostir import ir, layout, printer
from hostir.runtime import profiling, transports
from hostir.communicator import CommunicatorTimeout, PeerLostError, classify_error
from hostir.container import HostIrContainer, body_locals
from hostir.errors import HostIrError
from hostir.runtime.streams import NullStreams

_HANDLERS: dict[type, Callable[[Frame, Any], None]] = {}

# The most shapes of bound tensors whose extents an evaluator keeps.
_MAX_BOUND_EXTENTS = 64


def impl(op_class: type):
    """Register the evaluator's handler of `op_class`."""

    def wrap(fn):
        _HANDLERS[op_class] = fn
        return fn

    return wrap


class HostIrRuntimeError(HostIrError, RuntimeError):
    """An op failed while the program ran; the message quotes the op."""


class UnboundValueError(HostIrError, LookupError):
    """An op read a value that no input, allocation or earlier op bound."""


class BindingError(HostIrError, ValueError):
    """A value given to `run` does not fit the program (type, rank, size)."""


class ShapeError(HostIrError, ValueError):
    """A tensor's size does not fit an op at run time (a reshape to another
    number of elements, a slice or index out of range)."""


class ProgramError(HostIrError, RuntimeError):
    """The program's ops do not fit together at run time (a Wait with no
    posted communication, unbalanced coalescing)."""


_REQUIRED = object()


class HostIrEvaluator:
    """Runs one host program, any number of times, from any number of
    threads at once.

    `streams` is a `CudaStreams` for a CUDA device or `NullStreams` (the
    default) for the CPU; `device` is where `Allocate` puts new buffers. The
    evaluator holds only what it precomputes from the program; the values of
    a run live in that run's `Frame`. `observers` (none by default) wrap
    every op of every run: see `OpObserver`. The profiler's observer joins
    them for a run made while profiling or tracing is on. `rank` is the rank
    the program was pruned for (`LoweredProgram.rank`; None: the program
    holds every rank's part): an output on a mesh without it is None.
    """

    def __init__(
        self, container: HostIrContainer, streams=None, device="cpu", communicator=None, dumper=None, rank=None
    ):
        container.check_inputs_unaliased()
        missing = {type(e).__name__ for e in container.walk() if type(e) not in _HANDLERS}
        if missing:
            raise MissingHandlerError(f"the evaluator has no handler for {', '.join(sorted(missing))}")
        self.container = container
        self.rank = rank
        self.streams = streams if streams is not None else NullStreams()
        self.device = torch.device(device)
        self.communicator = communicator
        self.dumper = dumper
        needs = [e for e in container.walk() if ir.needs_communicator(e)]
        if needs and communicator is None:
            raise BindingError(
                f"A communicator must be provided: the program has communications, such as\n"
                f"{printer.format_expr_head(needs[0])}"
            )
        # The layout conversions of the program's tensors, planned once each.
        self.layouts = layout.Conversions()
        # How each bound tensor's sizes bind its extents, planned once each
        # (`Frame.bind_extents`).
        self.extent_plans: dict = {}
        # What the extents came to, per tuple of bound tensors and shapes
        # whose sizes passed their checks (`_bind_inputs`).
        self.bound_extents: dict[tuple, dict] = {}
        self.rank_scalar = container.named_scalars().get("rank")
        self.alias = container.aliases.resolved()
        self.number_of_streams = container.named_scalars().get("numberOfStreams")
        self.body_locals = self._find_body_locals(container)
        # For each slice bound by a HirAliasSelect: the dim of its source it
        # cuts and whether it selects one index or a chunk of rows.
        self.slices = {
            e.out: (layout.position(e.input, e.axis), layout.select_kind(e.input, e.axis))
            for e in container.walk()
            if isinstance(e, ir.HirAliasSelect)
        }
        # Where a select removed a dim: matmul and linear put it back as size 1.
        self.slice_dim = {out: dim for out, (dim, kind) in self.slices.items() if kind == "select"}
        # A chunk of such a slice lacks the same axis.
        for e in container.walk():
            if isinstance(e, ir.HirAliasChunk) and e.input in self.slice_dim:
                self.slice_dim[e.out] = self.slice_dim[e.input]
        # For each compute op, the operand axes it reads this rank's slice
        # of (replicated where its output is sharded), in a stream loop's
        # body too (a replicated operand beside an output sharded on
        # another axis than the one the loop walks).
        multi_device = bool(container.meshes())
        source = {
            e.out: e.input for e in container.walk() if isinstance(e, (ir.HirAliasSelect, ir.HirAliasChunk))
        }
        self.local_slices = {
            id(e): _local_slices(e, source)
            for e in container.walk()
            if multi_device and isinstance(e, ir.COMPUTE_OPS)
        }
        self.observers: list[OpObserver] = []
        # Whether runs report to the profiler and traces; a dry run's
        # rehearsal on meta tensors does not.
        self.profiled = True
        # Numbers the runs, for the call parity of each frame.
        self.calls = itertools.count()
        # Pinned host copies of the program's host tensors, made once (a
        # tensor moved in pieces is staged whole).
        self.staging = transports.HostStaging(source)
        # Outputs of communications over a team of one rank that are bound
        # to a view of their input instead of a buffer of their own (their
        # Allocate binds nothing; see `_keep_local`).
        self.local_views = local_views(container, source, self.alias)

    # -- the one entry point
    def run(self, bindings: Mapping[Any, Any], number_of_streams: int = 4) -> list:
        """Bind `bindings` (inputs, and outputs to write into) in a new
        frame, run the program, and return one value per container output.
        The caller's current stream is current again at the end and has
        waited for every stream the program used."""
        if isinstance(number_of_streams, bool) or not isinstance(number_of_streams, int) or number_of_streams < 1:
            raise BindingError(f"number_of_streams must be an integer >= 1, got {number_of_streams!r}")
        frame = Frame(self)
        if self.number_of_streams is not None:
            frame.bind(self.number_of_streams, number_of_streams)
        if self.rank_scalar is not None:
            frame.bind(self.rank_scalar, self.communicator.rank)
        self._bind_inputs(frame, bindings, number_of_streams)
        caller = self.streams.current()
        rank = self.communicator.rank if self.communicator is not None else 0
        profiler = profiling.observer_for(self.container, self.streams, rank) if self.profiled else None
        frame.observers = (*self.observers, profiler) if profiler is not None else tuple(self.observers)
        try:
            frame.run_scope(self.container.exprs)
            frame.complete_pending()
            return [frame.output(tv) for tv in self.container.outputs]
        finally:
            for stream in frame.used_streams:
                self.streams.wait(caller, stream)
            self.streams.set_current(caller)
            if profiler is not None:
                profiler.finish()

    def _bind_inputs(self, frame: Frame, bindings: Mapping[Any, Any], number_of_streams: int) -> None:
        """Bind `bindings` and the extents their sizes give, checking each
        size against the extents already bound (`Frame.bind_extents`).
        Where every binding is a tensor, what the extents came to depends
        only on the bound tensors and their shapes (and the number of
        streams, which an extent may be computed from): bindings whose
        shapes passed the checks once bind the same extents again at once.
        Shapes that failed were never kept, so they are checked, and
        fail, on every run."""
        if not all(type(val) is ir.TensorView and isinstance(value, torch.Tensor) for val, value in bindings.items()):
            for val, value in bindings.items():
                if isinstance(val, ir.TensorView):
                    frame.bind_extents(val, value)
                frame.bind(val, value)
            return
        key = (tuple(bindings), tuple([value.shape for value in bindings.values()]), number_of_streams)
        known = self.bound_extents.get(key)
        if known is not None:
            frame.values.update(known)
        else:
            for val, value in bindings.items():
                frame.bind_extents(val, value)
            if len(self.bound_extents) >= _MAX_BOUND_EXTENTS:
                self.bound_extents.clear()
            self.bound_extents[key] = dict(frame.values)
        for val, value in bindings.items():
            frame.bind(val, value)

    def _find_body_locals(self, container: HostIrContainer) -> dict[int, list]:
        return body_locals(container)


class MissingHandlerError(HostIrError, NotImplementedError):
    """The program holds an op that the evaluator cannot run."""


class OpObserver(Protocol):
    """What watches the ops of a run: `op(frame, e, run)` is called for
    every op `e` (a loop before its body's ops, and returning after them);
    it must call `run()` once, which runs the op, and may read the frame
    before and after. Observers nest in the order of the evaluator's list;
    an op that raises is not observed after `run()`."""

    def op(self, frame: Frame, e: Any, run: Callable[[], None]) -> None: ...


class OpCounter:
    """An observer that counts the ops a program's runs executed."""

    def __init__(self):
        self.count = 0

    def op(self, frame: Frame, e: Any, run: Callable[[], None]) -> None:
        run()
        self.count += 1


class Frame:
    """The state of one run: bound values, the loops being run, the streams
    used, communications posted and not yet waited for. Handlers receive the
    frame and touch values only through `get` and `bind`; everything fixed
    for the program is on `evaluator`."""

    __slots__ = (
        "evaluator", "streams", "device", "communicator", "dumper", "values", "loops", "used_streams", "works",
        "coalescing", "call_parity", "observers",
    )

    def __init__(self, evaluator: HostIrEvaluator):
        self.evaluator = evaluator
        self.streams = evaluator.streams
        self.device = evaluator.device
        self.communicator = evaluator.communicator
        self.dumper = evaluator.dumper
        self.values: dict = {}
        # [index scalar, value] of each loop around the op being run.
        self.loops: list[list] = []
        self.used_streams: list = []
        # Posted communications until their Wait: expr -> _Posted.
        self.works: dict = {}
        self.coalescing: tuple | None = None
        # Buffers that peers write alternate between two copies by the
        # parity of the run (the transports' double buffering).
        self.call_parity = next(evaluator.calls) % 2
        # The evaluator's observers, and the profiler's when it watches this
        # run (none, the usual case, runs every op bare).
        self.observers: tuple = ()

    # -- the two accessors
    def get(self, val, default=_REQUIRED):
        """The value bound to `val` (through the alias map); a constant or
        derived scalar is computed."""
        value = self.values.get(self.evaluator.alias.get(val, val))
        if value is not None:
            return value
        if isinstance(val, ir.ScalarExpr):
            try:
                return ir.ScalarExpr.OPS[val.op](self.get(val.lhs), self.get(val.rhs))
            except UnboundValueError:
                if default is not _REQUIRED:
                    return default
                raise
        if isinstance(val, ir.Scalar) and val.value is not None:
            return val.value
        if default is not _REQUIRED:
            return default
        raise UnboundValueError(f"value {printer.format_val(val)} is not bound")

    def bind(self, val, value) -> None:
        """Bind `val` (through the alias map); binding None unbinds it."""
        self.values[self.evaluator.alias.get(val, val)] = value

    # -- running
    def complete_pending(self) -> None:
        """Wait for every communication posted without a `Wait` (a send
        nobody waits on): a run never ends with a message in flight, which
        its peer would otherwise miss. Each wait has the communicator's
        timeout."""
        while self.works:
            target = next(iter(self.works))
            try:
                _wait(self, ir.Wait(target))
            except (CommunicatorTimeout, PeerLostError) as err:
                raise type(err)(
                    f"{err}\nWhile completing, at the end of the run:\n{printer.format_expr_head(target)}"
                ) from err

    def run_scope(self, exprs) -> None:
        observers = self.observers
        for e in exprs:
            try:
                if observers:
                    self._observed(observers, 0, e)
                else:
                    _HANDLERS[type(e)](self, e)
            except HostIrRuntimeError:
                raise
            except (CommunicatorTimeout, PeerLostError) as err:
                # A lost peer or a timeout keeps its type, so callers can
                # catch it; the message says where the program was.
                raise type(err)(f"{err}\nWhile executing:\n{self.where(e)}") from err
            except HostIrError as err:
                raise HostIrRuntimeError(f"{type(err).__name__}: {err}\nWhile executing:\n{self.where(e)}") from err
            except Exception as err:
                # An error of torch's own (out of memory, a bad shape) keeps
                # its type, so `except torch.OutOfMemoryError` works; a note
                # names the op (once: the loops around it pass it on).
                if not getattr(err, "_hostir_noted", False):
                    _note(err, f"While executing:\n{self.where(e)}")
                raise

    def _observed(self, observers: tuple, i: int, e) -> None:
        """Run `e` inside observers[i:], the first outermost."""
        if i == len(observers):
            _HANDLERS[type(e)](self, e)
        else:
            observers[i].op(self, e, lambda: self._observed(observers, i + 1, e))

    def where(self, e) -> str:
        """The dump line of `e` and the loop indices around it."""
        loops = "".join(f"\n  in loop {printer.format_scalar(i)} = {v}" for i, v in self.loops)
        return printer.format_expr_head(e) + loops

    def output(self, tv: ir.TensorView):
        if not tv.held_by(self.evaluator.rank):
            return None
        value = self.get(tv, None)
        if value is None:
            raise HostIrRuntimeError(f"output {printer.format_tv(tv)} is not bound at the end of the program")
        return value

    # -- helpers for handlers
    def stream(self, s: ir.Stream):
        if s.index is not None:
            return self.streams.get(int(self.get(s.index)))
        captured = self.get(s, None)
        return captured if captured is not None else self.streams.get(s)

    def full_rank(self, tv: ir.TensorView, value: torch.Tensor) -> torch.Tensor:
        """`value` with the axis a select removed put back as size 1."""
        dim = self.evaluator.slice_dim.get(tv)
        return value if dim is None else value.unsqueeze(dim)

    def full_sizes(self, tv: ir.TensorView) -> list[int]:
        """The runtime sizes of `tv` across all ranks (mesh_x axes whole):
        those of its bound tensor (a chunk may be shorter than its extent
        says), else from its extents."""
        value = self.get(tv, None)
        if isinstance(value, torch.Tensor):
            return layout.full_from_local(tv, list(value.shape), self.get)
        return layout.full_shape(tv, self.get)

    def local_sizes(self, tv: ir.TensorView) -> list[int]:
        """This rank's runtime sizes of `tv` (1 on a mesh_x axis)."""
        value = self.get(tv, None)
        if isinstance(value, torch.Tensor):
            return list(value.shape)
        return layout.local_shape(tv, self.get)

    def bind_extents(self, tv: ir.TensorView, value) -> None:
        """Bind the symbolic logical extents of `tv` from its runtime-shaped
        tensor, or check them against those already bound."""
        if not isinstance(value, torch.Tensor):
            raise BindingError(f"{printer.format_tv(tv)} must be bound to a torch.Tensor, got {type(value).__name__}")
        plans = self.evaluator.extent_plans
        plan = plans.get(tv)
        if plan is None:
            plan = plans[tv] = _extent_plan(tv)
        if value.dim() != len(plan):
            raise BindingError(
                f"{printer.format_tv(tv)} has {len(plan)} dims but its tensor has shape {list(value.shape)}"
            )
        for i, ((first, extent, whole), size) in enumerate(zip(plan, value.shape)):
            if first is not None:
                if size != 1:
                    raise BindingError(
                        f"axis {i} of {printer.format_tv(tv)} is sharded ({printer.format_id(first)}): "
                        f"each rank holds size 1 of it, got {size}"
                    )
                if extent is not None:
                    self._bind_size(tv, i, extent, whole)
                continue
            self._bind_size(tv, i, extent, whole(size))

    def _bind_size(self, tv: ir.TensorView, i: int, extent: ir.Scalar, size: int) -> None:
        known = self.get(extent, None)
        if known is None:
            if isinstance(extent, ir.ScalarExpr):
                raise BindingError(f"cannot infer {printer.format_scalar(extent)} from a size")
            self.bind(extent, size)
        elif known != size:
            raise BindingError(
                f"axis {i} of {printer.format_tv(tv)} is {size} but its extent "
                f"{printer.format_scalar(extent)} is {known}"
            )


def _extent_plan(tv: ir.TensorView) -> list[tuple]:
    """Per runtime dim of `tv`, how its size binds an extent: (the sharded
    piece, the extent it binds or None, the mesh's size along it) for a
    dim that holds a sharded piece; else (None, the logical axis's extent,
    the whole size as a function of the dim's)."""
    plan = []
    for dim in layout.dims(tv):
        first = dim[0]
        if first.is_device_parallel:
            extent = first.extent if first.parent is None else None
            plan.append((first, extent, tv.mesh.size_along(first.parallel_type) if extent is not None else None))
            continue
        axis = layout.logical_axis(first)
        plan.append((None, axis.extent, lambda size, axis=axis: layout.global_extent(axis, size)))
    return plan


def _note(err: BaseException, text: str) -> None:
    err.add_note(text)
    try:
        err._hostir_noted = True
    except AttributeError:
        pass


# ---------------------------------------------------------------- host ops


@impl(ir.ForLoop)
def _for(frame: Frame, e: ir.ForLoop) -> None:
    start, stop = int(frame.get(e.start)), int(frame.get(e.stop))
    local = frame.evaluator.body_locals[id(e)]
    position = [e.index, start]
    frame.loops.append(position)
    try:
        for i in range(start, stop):
            for tv in local:
                frame.bind(tv, None)
            position[1] = i
            frame.bind(e.index, i)
            frame.run_scope(e.body)
    finally:
        frame.loops.pop()
    # The last iteration's slices and buffers would otherwise keep their
    # sources alive past a Deallocate after the loop.
    for tv in local:
        frame.bind(tv, None)


@impl(ir.IfThenElse)
def _if(frame: Frame, e: ir.IfThenElse) -> None:
    value = frame.get(e.predicate)
    if isinstance(value, torch.Tensor) or not isinstance(value, (bool, int)):
        raise ProgramError(
            f"the predicate {printer.format_scalar(e.predicate)} is {value!r}; an IF takes a bool or an integer"
        )
    frame.run_scope(e.then_body if value else e.else_body)


@impl(ir.GetCurrentStream)
def _get_current_stream(frame: Frame, e: ir.GetCurrentStream) -> None:
    frame.bind(e.stream, frame.streams.current())


@impl(ir.SetCurrentStream)
def _set_current_stream(frame: Frame, e: ir.SetCurrentStream) -> None:
    stream = frame.stream(e.stream)
    frame.streams.set_current(stream)
    if stream is not None and stream not in frame.used_streams:
        frame.used_streams.append(stream)


@impl(ir.Synchronize)
def _synchronize(frame: Frame, e: ir.Synchronize) -> None:
    frame.streams.wait(frame.streams.current(), frame.stream(e.stream))


@impl(ir.HirAliasSelect)
def _select(frame: Frame, e: ir.HirAliasSelect) -> None:
    src = frame.get(e.input)
    dim, kind = frame.evaluator.slices[e.out]
    index = 0 if e.axis.is_broadcast else int(frame.get(e.index))
    if kind == "select":
        frame.bind(e.out, src.select(dim, index))
        return
    start, length = layout.chunk_bounds(src.shape[dim], int(frame.get(e.axis.extent)), index)
    frame.bind(e.out, src.narrow(dim, start, length))


@impl(ir.HirAliasChunk)
def _chunk(frame: Frame, e: ir.HirAliasChunk) -> None:
    src = frame.get(e.input)
    dim = layout.position(e.input, e.axis)
    size = src.shape[dim]
    if size % e.parts:
        raise BindingError(f"axis {dim} of size {size} does not split into {e.parts} equal pieces")
    piece = size // e.parts
    frame.bind(e.out, src.narrow(dim, int(frame.get(e.index)) * piece, piece))


@impl(ir.Allocate)
def _allocate(frame: Frame, e: ir.Allocate) -> None:
    if frame.get(e.buffer, None) is not None or e.buffer in frame.evaluator.local_views:
        return
    shape = frame.local_sizes(e.buffer)
    if e.memory_type is ir.MemoryType.symmetric:
        frame.bind(e.buffer, transports.allocate(frame, e.buffer, shape))
        return
    make = torch.zeros if e.zero_init else torch.empty
    if e.memory_type is ir.MemoryType.host:
        frame.bind(e.buffer, transports.allocate_host(frame, make, shape, e.buffer.dtype))
        return
    frame.bind(e.buffer, make(shape, dtype=e.buffer.dtype, device=frame.device))


@impl(ir.Deallocate)
def _deallocate(frame: Frame, e: ir.Deallocate) -> None:
    frame.get(e.buffer)
    frame.bind(e.buffer, None)


# ---------------------------------------------------------------- local layouts
#
# A rank holds each tensor in its loop layout (a split axis as its pieces,
# a sharded piece with size 1). Compute ops run torch on the logical layout
# (one dim per logical axis, of this rank's size) and put the result back
# in the output's loop layout; both are views of the same memory. An
# operand axis replicated where the output is sharded is first cut to this
# rank's slice.


def _local_slices(e: ir.Expr, source: dict) -> dict[int, list]:
    """operand id -> [(position, output axis, operand axis)] to slice. In
    a loop body the op's slices are read as the whole tensors they come
    from (`source`: slice -> what it slices), so positions count the axis
    a select removed."""
    if isinstance(e, ir.Set):
        return {}
    back: dict[int, ir.TensorView] = {}
    fields = {}
    for f in e.INPUTS + e.OUTPUTS:
        v = getattr(e, f)
        if not isinstance(v, ir.TensorView):
            continue
        w = v
        while w in source:
            w = source[w]
        if w is not v:
            fields[f] = w
        back.setdefault(id(w), v)
    partial = getattr(e, "partial", None)
    if fields and partial is not None:
        # A chunk of partial sums: the decomposition already cut its operands.
        return {}
    whole = e.replace(**fields) if fields else e
    found: dict[int, list] = {}
    for o, i in whole.id_pairs():
        if o.is_reduction and partial is None:
            continue
        missing = layout.device_types(o) - layout.device_types(i)
        if not missing or i.is_broadcast:
            # A broadcast operand axis is the same size-1 dim on every rank.
            continue
        for v in whole.inputs():
            if isinstance(v, ir.TensorView) and i in v.logical:
                found.setdefault(id(back[id(v)]), []).append((v.logical_runtime().index(i), o, i))
    return found


def _operand(frame: Frame, e, tv, full_rank: bool = False):
    """Operand `tv` of `e` in logical layout, cut to this rank's slice
    where `e`'s output is sharded and `tv` is not."""
    t = frame.get(tv)
    if not isinstance(tv, ir.TensorView):
        return t
    cuts = frame.evaluator.local_slices.get(id(e), {}).get(id(tv), ())
    removed = frame.evaluator.slice_dim.get(tv)
    if removed is not None:
        # A slice a stream loop selected: at full rank its dims are the
        # whole tensor's; without, the selected one is gone.
        if full_rank:
            t = frame.full_rank(tv, t)
        else:
            cuts = [(pos - (pos > removed), o, i) for pos, o, i in cuts if pos != removed]
    else:
        t = frame.evaluator.layouts.to_logical(tv, t)
    for pos, o, i in cuts:
        mesh = e.out.mesh
        missing = layout.device_types(o) - layout.device_types(i)
        sizes = layout.leaf_sizes(o.loop_leaves(), t.shape[pos], mesh, missing)
        pieces = t.reshape(list(t.shape[:pos]) + sizes + list(t.shape[pos + 1 :]))
        for j, x in enumerate(o.loop_leaves()):
            if x.parallel_type in missing:
                pieces = pieces.narrow(pos + j, mesh.index_along(frame.communicator.rank, x.parallel_type), 1)
        t = pieces.reshape(list(t.shape[:pos]) + [-1] + list(t.shape[pos + 1 :]))
    return t


def _store(
    frame: Frame, e, fresh: Callable[[], torch.Tensor], into: Callable[[torch.Tensor], Any], full_rank=False
) -> None:
    """Bind `fresh()`'s result to `e.out` in its loop layout, or, if `e.out`
    is bound, run `into(view)` on its logical view."""
    tv = e.out
    partial = getattr(e, "partial", None)
    if tv in frame.evaluator.slice_dim:
        out, bind_fresh = _full_rank_out(frame, e) if full_rank else (frame.get(tv, None), lambda r: frame.bind(tv, r))
        if out is None:
            bind_fresh(fresh())
        elif partial is None:
            into(out)
        else:
            # A chunk of partial sums: the slice keeps the partial and the
            # sharded pieces as size-1 dims where the operands put them.
            _copy_same_sizes(out, fresh())
        return
    out = frame.get(tv, None)
    if out is None:
        result = fresh()
        if partial is not None:
            result = result.unsqueeze(0)
        frame.bind(tv, frame.evaluator.layouts.to_runtime(tv, result))
        return
    view = frame.evaluator.layouts.to_logical(tv, out)
    into(view.squeeze(0) if partial is not None else view)


def _copy_same_sizes(out: torch.Tensor, result: torch.Tensor) -> None:
    """Copy `result` into `out`, which holds the same sizes but for dims of
    size 1."""
    if [s for s in out.shape if s != 1] != [s for s in result.shape if s != 1]:
        raise BindingError(f"a result of shape {list(result.shape)} does not fit its buffer of shape {list(out.shape)}")
    out.copy_(result.reshape(out.shape))


@impl(ir.Set)
def _set(frame: Frame, e: ir.Set) -> None:
    src = frame.get(e.input)
    out = frame.get(e.out, None)
    if out is None:
        frame.bind(e.out, src.clone(memory_format=torch.contiguous_format))
    else:
        out.copy_(src)


@impl(ir.UnaryOp)
def _unary(frame: Frame, e: ir.UnaryOp) -> None:
    x = _operand(frame, e, e.input)
    fn = e.kind.torch_fn
    if fn is None:  # cast
        _store(frame, e, lambda: x.to(e.out.dtype), lambda out: out.copy_(x))
        return
    _store(frame, e, lambda: fn(x), lambda out: out.copy_(fn(x)))


@impl(ir.BinaryOp)
def _binary(frame: Frame, e: ir.BinaryOp) -> None:
    fn = e.kind.torch_fn
    lhs, rhs = _operand(frame, e, e.lhs), _operand(frame, e, e.rhs)
    if not isinstance(lhs, torch.Tensor):
        # torch takes a number only on the right; a 0-d tensor of the
        # number's default dtype promotes the same way. (A meta operand, in a
        # dry run, cannot mix with a CPU tensor.)
        lhs = torch.tensor(lhs, device="meta" if rhs.device.type == "meta" else None)
    _store(frame, e, lambda: fn(lhs, rhs), lambda out: fn(lhs, rhs, out=out))


@impl(ir.ReductionOp)
def _reduction(frame: Frame, e: ir.ReductionOp) -> None:
    src = _operand(frame, e, e.input)
    dims = [i for i, d in enumerate(e.out.logical) if d.is_reduction]

    fn, dtype = e.kind.torch_fn, e.out.dtype

    def run(**out):
        return fn(src, dims, dtype=dtype, **out)

    _store(frame, e, run, lambda out: run(out=out))


def _full_rank_out(frame: Frame, e) -> tuple[torch.Tensor | None, Callable]:
    """The bound output at full rank (or None) and how to bind a fresh one."""
    out = frame.get(e.out, None)
    dim = frame.evaluator.slice_dim.get(e.out)

    def bind_fresh(result: torch.Tensor) -> None:
        frame.bind(e.out, result if dim is None else result.squeeze(dim))

    return (None if out is None else frame.full_rank(e.out, out)), bind_fresh


@impl(ir.MatmulOp)
def _matmul(frame: Frame, e: ir.MatmulOp) -> None:
    a = _operand(frame, e, e.a, full_rank=True)
    b = _operand(frame, e, e.b, full_rank=True)
    _store(frame, e, lambda: torch.matmul(a, b), lambda out: torch.matmul(a, b, out=out), full_rank=True)


@impl(ir.LinearOp)
def _linear(frame: Frame, e: ir.LinearOp) -> None:
    x = _operand(frame, e, e.input, full_rank=True)
    w = _operand(frame, e, e.weight, full_rank=True)
    bias = None if e.bias is None else _operand(frame, e, e.bias, full_rank=True)
    if w.dim() > 2:
        # A weight [*W, N, K]: torch's linear on [W*N, K], unflattened.
        fresh = lambda: linear_nd(x, w, bias)  # noqa: E731
        _store(frame, e, fresh, lambda out: out.copy_(fresh()), full_rank=True)
        return
    _store(
        frame,
        e,
        lambda: torch.nn.functional.linear(x, w, bias),
        lambda out: torch.ops.aten.linear.out(x, w, bias, out=out),
        full_rank=True,
    )


def linear_nd(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear` with a weight [*W, N, K]: out [..., *W, N]; the bias is
    [*W, N] or any trailing part of it."""
    lead = w.shape[:-1]
    if bias is not None:
        bias = bias.expand(lead).reshape(-1)
    return torch.nn.functional.linear(x, w.reshape(-1, w.shape[-1]), bias).unflatten(-1, lead)


def _copy_out(frame: Frame, e, result: torch.Tensor, source: torch.Tensor) -> None:
    """Write `result` (full rank) into the bound output, or bind a copy of
    it that shares no memory with `source`."""
    out, bind_fresh = _full_rank_out(frame, e)
    if out is not None:
        out.copy_(result)
        return
    if result.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        result = result.clone(memory_format=torch.contiguous_format)
    bind_fresh(result)


@impl(ir.BroadcastInDimOp)
def _broadcast_in_dim(frame: Frame, e: ir.BroadcastInDimOp) -> None:
    src = _operand(frame, e, e.input, full_rank=True)
    axes = e.out.logical_runtime()
    # In a stream loop `out` is a slice without the walked axis; `dims`
    # count it.
    sliced = e.out in frame.evaluator.slice_dim
    placed = [1] * (len(axes) + sliced)
    for i, d in enumerate(e.dims):
        placed[d] = src.shape[i]
    if not sliced:
        _check_kept_sizes(e, src)
    view = src.reshape(placed)
    out, bind_fresh = _full_rank_out(frame, e)
    if out is not None:
        # The bound output (a chunk in a stream loop) takes the broadcast.
        out.copy_(view)
        return
    sizes = []
    for j, (d, size) in enumerate(zip(axes, placed)):
        grows = size == 1 and not d.is_broadcast
        sizes.append(layout.local_extent(d) if grows else size)
        if sizes[-1] is None:
            raise ShapeError(f"axis {j} of T{e.out.name} has no fixed size to grow to")
    bind_fresh(view.expand(sizes).clone(memory_format=torch.contiguous_format))


def _check_kept_sizes(e: ir.BroadcastInDimOp, src: torch.Tensor) -> None:
    """A kept axis given a fixed size must have it (across ranks)."""
    out = e.out.logical_runtime()
    for i, (d, j) in enumerate(zip(e.input.logical_runtime(), e.dims)):
        o = out[j]
        if d.is_broadcast or o.is_broadcast or not o.extent.is_constant or src.shape[i] == 0:
            continue
        whole = src.shape[i] * layout.shard_count(e.input.mesh, d)
        if whole != o.extent.value:
            raise ShapeError(
                f"broadcast_in_dim: axis {i} of T{e.input.name} has size {whole}, but output axis {j} "
                f"is {o.extent.value}; only a size-1 axis grows"
            )


def _view_out(frame: Frame, e, result: torch.Tensor) -> None:
    """Write `result` into the bound output, or bind it as it is: a view
    of the operand where torch made one (permute always, reshape where the
    strides allow), as torch's own ops return."""
    out, bind_fresh = _full_rank_out(frame, e)
    if out is not None:
        out.copy_(result)
        return
    bind_fresh(result)


@impl(ir.PermuteOp)
def _permute(frame: Frame, e: ir.PermuteOp) -> None:
    if e.input.device_axes() or e.out.device_axes():
        # This rank's piece, permuted: its sharded axes move with it. A
        # view, as without device axes: its runtime dims only add size-1
        # dims (the rank's index of a sharded axis) and split a dim, which
        # any strides allow.
        layouts = frame.evaluator.layouts
        src = layouts.to_logical(e.input, frame.get(e.input))
        result = layouts.to_runtime(e.out, src.permute(e.dims))
        out = frame.get(e.out, None)
        if out is None:
            frame.bind(e.out, result)
        else:
            out.copy_(result)
        return
    src = frame.full_rank(e.input, frame.get(e.input))
    _view_out(frame, e, src.permute(e.dims))


@impl(ir.ExpandOp)
def _expand(frame: Frame, e: ir.ExpandOp) -> None:
    # At full rank: inside a stream loop the dims `dims` counts are those of
    # the whole tensors, a selected slice's dim put back as size 1.
    src = _operand(frame, e, e.input, full_rank=True)
    like = _operand(frame, e, e.like, full_rank=True)
    for d in sorted(e.dims):
        src = src.unsqueeze(d)

    def run():
        return src.expand(like.shape).contiguous()

    _store(frame, e, run, lambda out: out.copy_(src.expand(like.shape)), full_rank=True)


@impl(ir.InsertOp)
def _insert(frame: Frame, e: ir.InsertOp) -> None:
    src = _operand(frame, e, e.input, full_rank=True)
    like = _operand(frame, e, e.like, full_rank=True)

    def run():
        out = torch.zeros(like.shape, dtype=e.out.dtype, device=like.device)
        fill(out)
        return out

    def fill(out):
        if e.ranges is not None:
            out[tuple(slice(start, stop, step) for start, stop, step in e.ranges)] = src
        else:
            out.select(e.dim, int(frame.get(e.index))).copy_(src)

    def into(out):
        out.zero_()
        fill(out)

    _store(frame, e, run, into, full_rank=True)


@impl(ir.ReshapeOp)
def _reshape(frame: Frame, e: ir.ReshapeOp) -> None:
    src = frame.get(e.input)
    if src.numel() != layout.reshape_numel(e.shape, src.numel()):
        raise ShapeError(f"cannot reshape T{e.input.name} of shape {list(src.shape)} to {list(e.shape)}")
    _view_out(frame, e, src.reshape(e.shape))


@impl(ir.SliceOp)
def _slice(frame: Frame, e: ir.SliceOp) -> None:
    src = frame.full_rank(e.input, frame.get(e.input))
    index = []
    for k, ((start, stop, step), size) in enumerate(zip(e.ranges, src.shape)):
        if start > size or (stop is not None and stop > size):
            raise ShapeError(
                f"axis {k} of T{e.input.name} has size {size}; the slice [{start}:{stop}] is out of range"
            )
        index.append(slice(start, stop, step))
    _copy_out(frame, e, src[tuple(index)], src)


@impl(ir.SelectOp)
def _select_op(frame: Frame, e: ir.SelectOp) -> None:
    src = frame.full_rank(e.input, frame.get(e.input))
    index, size = int(frame.get(e.index)), src.shape[e.dim]
    if not -size <= index < size:
        raise ShapeError(f"index {index} is out of range for axis {e.dim} of T{e.input.name} (size {size})")
    _copy_out(frame, e, src.select(e.dim, index), src)


# ---------------------------------------------------------------- communications

def _log_posting(frame: Frame, e: ir.Communication) -> None:
    if frame.dumper is None or not frame.dumper.enabled("communication"):
        return
    tensors = [("input", frame.get(e.input, None)), ("output", frame.get(e.out, None))]
    sizes = ", ".join(f"{name} {list(t.shape)}" for name, t in tensors if t is not None)
    frame.dumper.emit("communication", f"Posting {printer.format_expr_head(e)}", f"  with {sizes}")


@impl(ir.Communication)
def _communication(frame: Frame, e: ir.Communication) -> None:
    comm = frame.communicator
    if comm.rank not in e.team:
        return
    if len(e.team) == 1:
        _keep_local(frame, e)
        return
    group = comm.group(e.team)
    _log_posting(frame, e)
    try:
        frame.works[e] = transports.post(frame, e, group)
    except Exception as err:
        classified = _classify(err, e, frame)
        if classified is err:
            raise
        raise classified from err


def _keep_local(frame: Frame, e: ir.Communication) -> None:
    """A communication over a team of one rank moves nothing: its output is
    its input (with the rows this rank holds of a reduced axis reduced, in
    the output's dtype), bound as a view of it where the program allocates
    the output for this communication alone (`local_views`), else copied
    into the output's buffer (a caller's preallocated output, a slice).
    Its `Wait` makes the stream current then wait for the one current now,
    as a collective's would."""
    src = frame.get(e.input)
    if e.local_reduce:
        src = e.red_op.torch_fn(src, list(e.local_reduce), keepdim=True)
    if src.dtype != e.out.dtype:
        src = src.to(e.out.dtype)
    out = frame.get(e.out, None)
    if out is None:
        frame.bind(e.out, src.reshape(frame.local_sizes(e.out)))
    else:
        out.copy_(src.reshape(out.shape))
    frame.works[e] = transports.Posted([_PostedOn(frame.streams, frame.streams.current())])


class _PostedOn:
    """The work of a communication that ran in place on `stream`: waiting
    for it makes the current stream wait for that one (nothing on the CPU,
    or when they are the same stream)."""

    __slots__ = ("streams", "stream")

    def __init__(self, streams, stream):
        self.streams, self.stream = streams, stream

    def wait(self) -> None:
        self.streams.wait(self.streams.current(), self.stream)


class _Holding:
    """A completed work that holds a tensor alive until its Wait."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    def wait(self) -> None:
        pass


def local_views(container: HostIrContainer, source: dict, alias: dict) -> frozenset:
    """The outputs of communications over a team of one that may be bound
    to a view of their input: each is allocated for that communication
    alone (one global `Allocate`, no other writer, no slice or alias of
    it, no P2P buffer), and its input is written by its own op alone (no
    slice, alias or P2P buffer), so the two never differ; and a program
    output never views a program input (as a `set` would not)."""
    writers: dict = {}
    for e in container.walk():
        for tv in e.outputs():
            writers[tv] = writers.get(tv, 0) + 1
    allocations: dict = {}
    for e in container.walk():
        if isinstance(e, ir.Allocate):
            allocations.setdefault(e.buffer, []).append(e)
    shared = set(source) | set(source.values()) | set(alias) | set(alias.values())
    # A P2P buffer is written by a receive (or read by a peer's push).
    shared |= {v for e in container.walk() if isinstance(e, ir.P2PCommunication) for v in (e.buffer, e.into) if v}
    inputs, outputs = set(container.inputs), set(container.outputs)
    found = set()
    for e in container.walk():
        if not isinstance(e, ir.Communication) or len(e.team) != 1:
            continue
        out, src = e.out, e.input
        made = allocations.get(out, [])
        if len(made) != 1 or made[0].memory_type is not ir.MemoryType.global_:
            continue
        if writers.get(out, 0) != 1 or writers.get(src, 0) > 1 or out in shared or src in shared:
            continue
        if src in inputs and out in outputs:
            continue
        found.add(out)
    return frozenset(found)


@impl(ir.Transfer)
def _transfer(frame: Frame, e: ir.Transfer) -> None:
    if e.posted:
        frame.works[e] = transports.post_transfer(frame, e)
    else:
        transports.copy_in_order(frame, e)


@impl(ir.P2PCommunication)
def _p2p(frame: Frame, e: ir.P2PCommunication) -> None:
    comm = frame.communicator
    peer = int(frame.get(e.peer))
    if not 0 <= peer < comm.world_size:
        raise BindingError(f"invalid peer {peer}: the world has {comm.world_size} ranks")
    buf = frame.get(e.buffer)
    compact = None
    if not buf.is_contiguous():
        if e.type == "recv":
            raise BindingError(f"the buffer of a P2P receive must be contiguous (strides {list(buf.stride())})")
        # A send of a view (a permute's): the transports move contiguous
        # memory, so the send goes from a compact copy, kept until its Wait.
        buf = compact = buf.contiguous()
    ops = None
    if frame.coalescing is not None:
        backend, ops = frame.coalescing
        if backend is None:
            frame.coalescing = (e.backend, ops)
        elif backend != e.backend:
            raise ProgramError(f"one coalescing group mixes backends {backend} and {e.backend}")
    try:
        posted = transports.post_p2p(frame, e, buf, peer, ops)
        if compact is not None:
            posted = transports.Posted([*posted.works, _Holding(compact)], posted.after)
        frame.works[e] = posted
    except Exception as err:
        classified = _classify(err, e, frame)
        if classified is err:
            raise
        raise classified from err


@impl(ir.StartCoalescing)
def _start_coalescing(frame: Frame, e: ir.StartCoalescing) -> None:
    if frame.coalescing is not None:
        raise ProgramError("StartCoalescing inside an open coalescing group")
    # (backend of the group's first member, the transport's pending ops)
    frame.coalescing = (None, [])


@impl(ir.EndCoalescing)
def _end_coalescing(frame: Frame, e: ir.EndCoalescing) -> None:
    if frame.coalescing is None:
        raise ProgramError("EndCoalescing without StartCoalescing")
    (backend, ops), frame.coalescing = frame.coalescing, None
    if backend is None:
        frame.works[e] = transports.Posted([])
        return
    try:
        frame.works[e] = transports.end_coalescing(frame, backend, ops)
    except Exception as err:
        classified = _classify(err, e, frame)
        if classified is err:
            raise
        raise classified from err


@impl(ir.Wait)
def _wait(frame: Frame, e: ir.Wait) -> None:
    target = e.communication
    if isinstance(target, ir.Communication) and frame.communicator.rank not in target.team:
        return
    posted = frame.works.pop(target, None)
    if posted is None:
        raise ProgramError(f"no posted communication to wait for: {printer.format_expr_head(target)}")
    try:
        for work in posted.works:
            work.wait()
    except Exception as err:
        if isinstance(target, ir.Transfer):
            raise
        classified = _classify(err, target, frame)
        if classified is err:
            raise
        raise classified from err
    if posted.after is not None:
        posted.after()


def _classify(err: Exception, e, frame: Frame) -> Exception:
    """The error of a failed collective, naming it and this rank."""
    comm = frame.communicator
    return classify_error(err, printer.format_expr_head(e), rank=comm.rank, timeout=comm.timeout)
