"""HostIrEvaluator: the reference interpreter of host programs.

It walks a `HostIrContainer` and runs each op with torch, on the CPU with
null streams or on CUDA with real ones. Handlers are found in a table keyed by
op class (`@impl`, `frame.py`); each receives the `Frame` of its run, which
holds that run's values (so one evaluator may run in several threads at
once), and touches values only through the frame's `get` and `bind`, which
resolve aliases — the one place that does. An op whose output buffer is
already bound (a caller's preallocated output, an allocation, a slice) writes
into it with torch's `out=` variants; otherwise its result is bound fresh.
A failing op is reported with its dump line and the loop indices around it:
hostir's errors become a `HostIrRuntimeError` quoting them; torch's own
errors keep their type and carry them as a note (PEP 678).
Communications are posted through `hostir.runtime.transports` (NCCL and gloo on
the process groups of a `Communicator`, or the copy-engine `cuda`
transport) and complete at their `Wait`; a timeout or a lost peer keeps its
type (`CommunicatorTimeout`, `PeerLostError`).

The handlers live beside it, one module per family of ops: `host_ops.py`,
`fusion_ops.py` and `communications.py`. This module imports them, so that
their handlers are in the table before a program is checked against it,
and re-exports the names callers import from here (the errors, `Frame`,
`OpCounter`, the table).
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping

import torch

from hostir import ir, layout, printer
from hostir.container import HostIrContainer, body_locals

# Importing a handlers' module registers its handlers (host_ops is read for
# nothing else).
from hostir.runtime import host_ops as host_ops
from hostir.runtime import profiling, transports
from hostir.runtime.communications import local_views as local_views
from hostir.runtime.fusion_ops import _local_slices as _local_slices
from hostir.runtime.fusion_ops import summed_products, sums_that_view
from hostir.runtime.frame import _HANDLERS as _HANDLERS
from hostir.runtime.frame import BindingError as BindingError
from hostir.runtime.frame import Frame as Frame
from hostir.runtime.frame import HostIrRuntimeError as HostIrRuntimeError
from hostir.runtime.frame import MissingHandlerError as MissingHandlerError
from hostir.runtime.frame import OpCounter as OpCounter
from hostir.runtime.frame import OpObserver as OpObserver
from hostir.runtime.frame import ProgramError as ProgramError
from hostir.runtime.frame import ShapeError as ShapeError
from hostir.runtime.frame import UnboundValueError as UnboundValueError
from hostir.runtime.frame import impl as impl
from hostir.runtime.streams import NullStreams

# The most shapes of bound tensors whose extents an evaluator keeps.
_MAX_BOUND_EXTENTS = 64


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
        self.sums_that_view = sums_that_view(container)
        self.summed_products = summed_products(container)
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
        source = {e.out: e.input for e in container.walk() if isinstance(e, (ir.HirAliasSelect, ir.HirAliasChunk))}
        self.local_slices = {
            id(e): _local_slices(e, source) for e in container.walk() if multi_device and isinstance(e, ir.COMPUTE_OPS)
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
