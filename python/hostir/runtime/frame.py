"""The state of one run of a host program, and what every handler of the
evaluator shares: the table of handlers keyed by op class (`impl`), the
`Frame` each handler receives, the observers that may wrap each op, and
the errors a run raises.

A frame holds one run's values (so one evaluator may run in several
threads at once); handlers touch values only through its `get` and `bind`,
which resolve aliases — the one place that does. `run_scope` runs a list
of ops through the table and reports a failing op with its dump line and
the loop indices around it: hostir's errors become a `HostIrRuntimeError`
quoting them; torch's own errors keep their type and carry them as a note
(PEP 678); a timeout or a lost peer keeps its type.
The handlers are in `host_ops.py`, `fusion_ops.py` and `communications.py`
of this folder; `evaluator.py` runs a program through them.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from hostir import ir, layout, printer
from hostir.communicator import CommunicatorTimeout, PeerLostError
from hostir.errors import HostIrError

_HANDLERS: dict[type, Callable[[Frame, Any], None]] = {}


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
        "evaluator",
        "streams",
        "device",
        "communicator",
        "dumper",
        "values",
        "loops",
        "used_streams",
        "works",
        "coalescing",
        "call_parity",
        "observers",
        "shared",
    )

    def __init__(self, evaluator):
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
        # Work ops of this run share (the three route ops of one router's
        # choices sort them once): key -> results.
        self.shared: dict = {}

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
                _HANDLERS[ir.Wait](self, ir.Wait(target))
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
