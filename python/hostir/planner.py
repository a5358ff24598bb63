"""Plan once, then run: every decision about a call's program, made before
it is lowered.

`plan(fusion, inputs, device, comm, request)` returns a `Plan`: the
schedule of a device axis walked as a stream axis (sequential, or a ring of
1, 2 or 4 chunks per peer on a transport), how far communications and
transfers are hoisted, which streamed inputs stay in host memory, the
runner (the C++ executor or the Python evaluator) with every reason it is
not the C++ one, and the program cache key. It is made from two things
only: the declared table of what the C++ core runs
(`hostir.runtime.support`), read for the fusion's own ops and for each
candidate schedule, and the machine model's costs (`hostir.machine`) of
each candidate for the runner that will run it. The dump shows every
candidate with its predicted time (the schedule's and the hoisting's
notes). Nothing downstream chooses again: the lowering takes the plan's
schedule and hoisting, and the executor builds the plan's runner; the
lowered program's own reasons (`flat.unsupported_reasons`) only name the
first op of each reason the plan gave.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from typing import Callable

import torch

from hostir import axis_graph, backends, cpp, ir, layout, machine
from hostir.layout import LayoutError
from hostir.errors import HostIrError
from hostir.lower.decompose_device_axis import scattered_operand, walks_device_axis
from hostir.lower.hoist_transfers import Hoisting, forced
from hostir.lower.schedule import Schedule, parse
from hostir.options import evaluator_choice
from hostir.runtime import flat, profiling, support
from hostir.runtime.checks import ExecuteArgumentError
from hostir.runtime.transports import cuda

__all__ = ["FAKE", "Plan", "PlanError", "Request", "Runner", "asked_runner", "plan", "runner_of"]


class PlanError(HostIrError, RuntimeError):
    """The lowered program holds something the plan did not foresee for its
    runner (the support table and the planner disagree)."""


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


FAKE = Runner("fake", ("HOSTIR_FAKE=1: the call returns the dry run's meta tensors and runs nothing",))


@dataclasses.dataclass(frozen=True)
class Request:
    """What a call asks of the plan, from its parameters: the runner
    (`evaluator`: "python", "cpp", "auto" or None for HOSTIR_EVALUATOR), a
    forced schedule and hoisting (None and "auto": the model's), the
    positions of the inputs kept in host memory, the resharding mode, and
    whether the call is replayed from a CUDA graph, and the worker streams
    a stream-parallel loop cycles through (`number_of_streams`)."""

    evaluator: str | None = None
    schedule: object = None
    hoist: object = "auto"
    host: frozenset[int] = frozenset()
    resharding: str = "auto"
    cuda_graph: bool = False
    number_of_streams: int = 4


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every decision about one call's program. `strict`: the C++ executor
    was asked for by name (its program must run there). `predicted`: the
    runner is the Python evaluator because the support table has no path
    for something the program will hold (not because the call asked).
    `key`: the program cache's key (the number of streams and the replay
    are the call's: one program serves them all)."""

    schedule: Schedule | None
    hoisting: Hoisting | None
    host: frozenset[int]
    resharding: str
    runner: Runner
    strict: bool
    key: tuple
    number_of_streams: int = 4
    replay: bool = False
    predicted: bool = False

    @property
    def transport(self) -> str | None:
        """The ring's transport (None: the program's backend, or no ring)."""
        return None if self.schedule is None else self.schedule.transport

    @property
    def reasons(self) -> tuple[str, ...]:
        """The candidates with their predicted times, then why the runner."""
        notes = [x.note for x in (self.schedule, self.hoisting) if x is not None and x.note]
        return (*notes, *self.runner.reasons)

    def runner_for(self, container) -> Runner:
        """The plan's runner with each reason naming its first op in the
        lowered `container`; a `PlanError` where the container holds what
        the plan's runner cannot run."""
        if self.predicted:
            return Runner("python", tuple(flat.unsupported_reasons(container)) or self.runner.reasons)
        if self.runner.name != "cpp" or self.strict:
            return self.runner
        missed = flat.unsupported_reasons(container)
        if missed:
            raise PlanError(
                f"the plan runs this program on the C++ executor, but it holds what the C++ core "
                f"(hostir.runtime.support) has no path for: {'; '.join(missed)}"
            )
        return self.runner


def asked_runner(evaluator: str | None) -> tuple[str, tuple[str, ...]]:
    """The runner a call asks for, "python" or "cpp", and why the C++
    executor is not used (before the program is known)."""
    if evaluator is not None:
        choice, given = evaluator, f"evaluator={evaluator!r} was passed"
    else:
        choice = evaluator_choice()
        given = f"HOSTIR_EVALUATOR={choice}"
    if choice == "python":
        return "python", (given,)
    if choice == "auto" and profiling.watched():
        # The profiler's ranges come from the Python evaluator.
        return "python", ("the profiler is watching (its ranges come from the Python evaluator)",)
    if cpp.available():
        return "cpp", ()
    if choice == "cpp":
        raise ExecuteArgumentError(f"evaluator='cpp' was requested but the C++ executor is unavailable: {cpp.reason()}")
    cpp.warn_unavailable()
    return "python", (f"it is not built or does not load: {cpp.reason()}",)


def plan(fusion: ir.Fusion, inputs: list, device: torch.device, comm, request: Request) -> Plan:
    """The plan of `fusion`'s program for these (checked) inputs on
    `device`, with `comm` for a multi-device fusion (None: one device)."""
    asked, given = asked_runner(request.evaluator)
    strict = asked == "cpp" and (request.evaluator or evaluator_choice()) == "cpp"
    fixed = _fusion_reasons(fusion) if asked == "cpp" else []

    def runs_on(transport: str, chunks: int) -> str:
        if asked != "cpp" or fixed:
            return "python"
        return runner_of("cpp", transport, chunks)

    schedule = _schedule(fusion, inputs, comm, request.schedule, device, runs_on, request.cuda_graph)
    transport = _transport(schedule, comm)
    chunks = schedule.chunks if schedule is not None and schedule.decomposition == "ring" else 1
    hoisting = hoisting_for_inputs(
        fusion,
        inputs,
        device,
        comm,
        request.host,
        request.hoist,
        cpp_posts=runs_on(transport or "NCCL", chunks) == "cpp",
    )
    if asked != "cpp":
        runner = Runner("python", given)
    elif strict:
        runner = Runner("cpp")
    else:
        pieces = hoisting.chunks if hoisting is not None and hoisting.mode == "hoist" else 1
        reasons = fixed + support.schedule_reasons(transport, chunks, _weight_pieces(fusion, request.host, pieces))
        if schedule is not None and schedule.decomposition == "collective" and not support.FEATURES.runtime_roots:
            reasons.append("its root is chosen at run time")
        runner = Runner("python", tuple(reasons)) if reasons else Runner("cpp")
    static = tuple(
        (i, axis, inputs[i].shape[axis])
        for i, tv in enumerate(fusion.inputs)
        for axis in getattr(tv, "static_dims", ())
    )
    key = (
        tuple((t.dtype, t.dim(), t.is_contiguous()) if isinstance(t, torch.Tensor) else "scalar" for t in inputs),
        device,
        runner.name,
        request.resharding,
        static,
        None if schedule is None else schedule.key(),
        request.host,
        None if hoisting is None else hoisting.key(),
    )
    return Plan(
        schedule, hoisting, request.host, request.resharding, runner, strict, key, request.number_of_streams,
        request.cuda_graph, predicted=asked == "cpp" and runner.name == "python",
    )  # fmt: skip


def fake(request: Request) -> Plan:
    """The plan of a call with HOSTIR_FAKE=1: the fake runner, which runs
    nothing (its dry run lowers every rank's program itself)."""
    return Plan(None, None, request.host, request.resharding, FAKE, False, (), request.number_of_streams)


def key_text(key: tuple) -> str:
    """A program cache key in words (the DEBUG log's)."""
    inputs, _, runner, resharding, static, chosen, host, hoisting = key
    parts = ", ".join(
        f"{str(dtype).removeprefix('torch.')}/{ndim}d{'' if contiguous else ' strided'}"
        for dtype, ndim, contiguous in inputs
    )
    text = f"inputs ({parts}), runner {runner}, resharding {resharding}"
    if static:
        text += ", static sizes " + ", ".join(f"input {i} axis {axis} = {size}" for i, axis, size in static)
    if host:
        text += ", streamed inputs " + ", ".join(map(str, sorted(host)))
    text += "" if hoisting is None else f", hoisting {hoisting}"
    return text + ("" if chosen is None else f", schedule {chosen}")


# ---------------------------------------------------------------- the runner


def runner_of(evaluator: str, transport: str, chunks: int) -> str:
    """The runner a decomposition's program will have: the C++ executor
    where it is asked for ("cpp") and the support table has a path for the
    ring's transport and its chunks, else the Python evaluator."""
    if evaluator != "cpp" or support.schedule_reasons(transport, chunks):
        return "python"
    return "cpp"


def _fusion_reasons(fusion: ir.Fusion) -> list[str]:
    """`_fusion_facts(fusion)`, worked out once per fusion version (a call
    that takes the full path plans again: it must not walk the fusion)."""
    kept = _FACTS.get(fusion)
    if kept is None or kept[0] != fusion.version:
        kept = _FACTS[fusion] = (fusion.version, tuple(_fusion_facts(fusion)))
    return list(kept[1])


_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fusion_facts(fusion: ir.Fusion) -> list[str]:
    """What, in the fusion itself, the C++ core has no path for: its ops and
    scalar inputs (`support.fusion_reasons`), a tensor written to host
    memory, a communication over a 2-D mesh, a stream loop over chunks."""
    reasons = support.fusion_reasons(fusion)
    features = support.FEATURES
    if not features.host_allocations and any(
        ir.in_host_memory(e.out) and not ir.in_host_memory(e.input) for e in fusion.exprs if isinstance(e, ir.Set)
    ):
        reasons.append("it allocates host memory")
    tvs = [*fusion.tensor_inputs(), *(v for e in fusion.exprs for v in e.outputs() if isinstance(v, ir.TensorView))]
    if not features.meshes_2d and any(
        (tv.mesh is not None and tv.mesh.ndim > 1) or len(tv.device_axes()) > 1 for tv in tvs
    ):
        reasons.append("it communicates over a 2-D mesh")
    if not features.chunk_views and any(_walks_chunks(tv) for tv in tvs):
        reasons.append("it walks chunks of a split axis")
    return reasons


def _walks_chunks(tv: ir.TensorView) -> bool:
    for axis in tv.stream_axes():
        try:
            if layout.select_kind(tv, axis) == "chunk":
                return True
        except LayoutError:
            # An inner piece: the lowering refuses such a loop itself.
            continue
    return False


def _weight_pieces(fusion: ir.Fusion, host: frozenset, pieces: int) -> int:
    """`pieces` where a linear's weight in host memory moves in pieces
    (`lower_transfers`), else 1."""
    if pieces <= 1:
        return 1
    streamed = {fusion.inputs[i] for i in host if i < len(fusion.inputs)}
    for e in fusion.exprs:
        if not isinstance(e, ir.LinearOp) or e.partial is not None:
            continue
        w = e.weight
        if not (ir.in_host_memory(w) or w in streamed) or w.is_split or w.device_axes():
            continue
        n = w.logical_runtime()[0].extent
        if n.is_constant and n.value % pieces == 0:
            return pieces
    return 1


# ---------------------------------------------------------------- the schedule


def _transport(schedule: Schedule | None, comm) -> str | None:
    if schedule is None or comm is None:
        return None
    return schedule.transport or backends.of_process_group(comm.backend).name


def _schedule(fusion, inputs, comm, asked, device, runs_on: Callable[[str, int], str], replay: bool) -> Schedule | None:
    """The schedule of `fusion` on these inputs: `asked` (a Schedule or its
    text; else `HOSTIR_SCHEDULE`), or the model's choice for the runner
    each candidate will have. None where the fusion has nothing to
    decompose. Every rank gets the same answer for the same input shapes."""
    if comm is None:
        return None
    if asked is None:
        asked = os.environ.get("HOSTIR_SCHEDULE") or None
    if asked is not None:
        return _forced(asked, comm, device)
    if not decomposable(fusion):
        return None
    D = comm.world_size
    moved = _all_to_all_hint(fusion, inputs, D)
    if moved is not None:
        # A walked all-to-all (a MoE layer's dispatch): one piece per peer,
        # no chunks (`decompose_device_axis`).
        rows, k, n, itemsize = moved
        backend = backends.of_process_group(comm.backend).name
        return choose(
            model_for(comm), D, rows, k, n, itemsize, p2p_reason(comm, device), backend, runs_on, replay,
            "gather", chunk_options=(1,),
        )
    scattered = _reduce_hint(fusion, inputs, D)
    rows, k, n, itemsize = scattered or _gather_hint(fusion, inputs, D)
    summed = scattered is None and _sums_over_ranks(fusion)
    if summed:
        # Partial sums summed over the ranks (matmul+RS): a step moves
        # rows x N partials, where shape_hint's k is the rows' K piece.
        k, n = n, k
    backend = backends.of_process_group(comm.backend).name
    p2p = p2p_reason(comm, device)
    side = "reduce" if summed else "reduce_slots" if scattered is not None else "gather"
    return choose(model_for(comm), D, rows, k, n, itemsize, p2p, backend, runs_on, replay, side)


def _sums_over_ranks(fusion) -> bool:
    """Whether `fusion` reduces partial sums walked as a stream axis into a
    sharded result (matmul+RS: the reduce side a decomposition rings)."""
    return any(
        isinstance(e, ir.ReductionOp) and e.input.stream_axes() and e.out.device_axes() for e in fusion.exprs
    )


def _forced(asked, comm, device) -> Schedule:
    """A forced schedule, kept also where the fusion walks no device axis
    itself (a pass may still make a ring of a resharding, a backward's
    gather of its output gradient); a copy-engine transport that cannot
    run here falls back to the program's backend, and says why."""
    schedule = parse(asked) if isinstance(asked, str) else asked
    if schedule.transport is not None and backends.get(schedule.transport).p2p_memory == "symmetric":
        reason = p2p_reason(comm, device)
        if reason is not None:
            schedule = dataclasses.replace(schedule, transport=None, note=f"cuda transport unavailable: {reason}")
    return schedule


def choose(
    model: machine.MachineModel,
    D: int,
    rows: int,
    k: int,
    n: int,
    itemsize: int,
    p2p: str | None,
    backend: str,
    runs_on: Callable[[str, int], str] | None = None,
    replay: bool = False,
    side: str = "gather",
    chunk_options: tuple[int, ...] = (1, 2, 4),
) -> Schedule:
    """The schedule for a gather or reduce side of `rows` x `k` shards per
    rank (times an n-wide weight), on D ranks: the fastest predicted of the
    sequential program and rings of 1, 2 and 4 chunks per peer on the copy
    engine (where `p2p` is None, else why not) and on `backend`, each for
    the runner that will run it (`runs_on(transport, chunks)`; by default
    the C++ executor where the support table has a path), and whether the
    call is replayed from a CUDA graph; `side`: "gather", "reduce"
    (matmul+RS, whose ring sums its slots unless it adds the peer's partial
    in its GEMM: `machine.fuses_reduction`) or "reduce_slots" (a
    sequence-parallel product's reduce-scatter, whose slots hold the walked
    axis inside: summed at every chunking). Ties go to the simpler
    program."""
    if runs_on is None:
        runs_on = lambda transport, chunks: runner_of("cpp", transport, chunks)  # noqa: E731
    why = "" if p2p is None else f"no P2P: {p2p}"
    one_sided = [b.name for b in backends.BACKENDS.values() if b.bandwidth == "copy"]
    transports = (one_sided if p2p is None else []) + [backend]
    sequential = machine.predict_ms(
        model, D, rows, k, n, itemsize, "sequential", runner=runs_on(backend, 1), replay=replay
    )
    candidates = [(sequential, "sequential", 1, backend)]
    for transport in transports:
        for chunks in chunk_options:
            if rows % chunks:
                continue
            runner = runs_on(transport, chunks)
            t = machine.predict_ms(
                model, D, rows, k, n, itemsize, "ring", chunks, transport, runner, replay,
                reduce=side != "gather", fusable=side == "reduce",
            )
            candidates.append((t, "ring", chunks, transport))
    mode = "replayed" if replay else "eager"
    listed = ", ".join(
        f"{'sequential' if kind == 'sequential' else f'ring c={c} {tr}'} {t:.3f}" for t, kind, c, tr in candidates
    )
    best = min(candidates, key=lambda c: c[0])
    ring = min((c for c in candidates if c[1] == "ring"), key=lambda c: c[0])
    if best[1] == "sequential":
        note = f"a ring would take {ring[0]:.3f} ms against {sequential:.3f} ms sequentially ({mode}; ms: {listed})"
        return Schedule("sequential", note=note)
    _, _, chunks, transport = best
    note = f"model: ring {best[0]:.3f} ms, sequential {sequential:.3f} ms ({mode}; ms: {listed})" + (
        f", {why}" if why else ""
    )
    return Schedule("ring", chunks=chunks, transport=transport, note=note)


def decomposable(fusion) -> bool:
    """Whether `fusion` may hold a device axis walked as a stream axis."""
    # Other programs keep one lowering for every shape: their key holds no
    # schedule. Asked at every execute: the answer is kept per version.
    cached = _WALKS.get(fusion)
    if cached is None or cached[0] != fusion.version:
        cached = _WALKS[fusion] = (fusion.version, walks_device_axis(fusion.exprs))
    return cached[1]


_WALKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_for(comm) -> machine.MachineModel:
    """The machine model of `comm`'s device, read once per communicator.
    No collective: the choice is made while ranks may still be out of step
    (one failing its input checks); ranks of one node share the cached
    model, and ranks that choose differently fail the agreement on the
    program with a clear error."""
    model = getattr(comm, "_machine_model", None)
    if model is None:
        model = comm._machine_model = machine.machine_model(comm.device)
    return model


def p2p_reason(comm, device=None) -> str | None:
    """None when the cuda transport can run on every rank for a program on
    `device` (default: the communicator's), else why not. A gloo
    communicator's own device is the CPU, but its ranks may run programs on
    a GPU (ranks sharing one): the program's device decides."""
    device = comm.device if device is None else torch.device(device)
    if device.type != "cuda":
        return f"the ranks run on {device.type}"
    return cuda.probe(comm, device)


def shape_hint(fusion, inputs, D: int) -> tuple[int, int, int, int]:
    """(rows, k, n, itemsize) of one shard's GEMM, from the sharded input
    with the most elements (rows x k per peer) and the other inputs'
    last axis (n)."""
    return _reduce_hint(fusion, inputs, D) or _gather_hint(fusion, inputs, D)


def _reduce_hint(fusion, inputs, D: int) -> tuple[int, int, int, int] | None:
    """A row-parallel product walking its output's scattered axis (GEMM+RS):
    each step multiplies a D-th of the walked operand's rows by its K piece
    and moves the partial sums, rows x N: (rows, N, K, itemsize), the moved
    width where `shape_hint` puts k. None for a gather side."""
    graph = axis_graph.IdGraph(fusion.exprs, broadcast=True)
    position = {id(tv): i for i, tv in enumerate(fusion.inputs)}
    for e in fusion.exprs:
        v = scattered_operand(e, graph)
        if v is None or id(v) not in position:
            continue
        t = inputs[position[id(v)]]
        k = t.shape[-1] if t.dim() else 1
        rows = max(1, t.numel() // max(k, 1) // D)
        other = e.weight if isinstance(e, ir.LinearOp) else (e.b if v is e.a else e.a)
        w = inputs[position[id(other)]] if id(other) in position else None
        n = (w.shape[-2] if isinstance(e, ir.LinearOp) else w.shape[-1]) if w is not None and w.dim() >= 2 else k
        return rows, n, k, t.element_size()
    return None


def _all_to_all_hint(fusion, inputs, D: int) -> tuple[int, int, int, int] | None:
    """A `set` that moves a sharded axis walked as a stream axis (a MoE
    layer's dispatch, `hostir.moe`): each step moves one peer's piece of
    `rows` x H (its fixed extents: the slots by the features), and its
    result back where the program returns it (the combine: k = 2H moved
    per row), and runs the products of the walk on it, counted as one
    GEMM of rows x k x n with the products' flops (gate, up and down:
    rows x 3HF; a grouped GEMM's, which computes only the rows the
    routing fills, scaled by the share of the piece they fill on average:
    a rank's pairs over the D pieces of the routing's bound). None for any
    other fusion, or one whose walked tensor has a symbolic extent."""
    walks = [e for e in fusion.exprs if isinstance(e, ir.Set) and e.out.stream_axes() and e.out.device_axes()]
    if not walks:
        return None
    e = walks[0]
    extents = [d.extent for d in e.out.logical_runtime()]
    if not all(x.is_constant for x in extents):
        return None
    h = extents[-1].value
    rows = max(1, layout.numel(x.value for x in extents[:-1]) // D // D)
    moves = [x for x in fusion.exprs if isinstance(x, ir.Set) and x.out.device_axes()]
    k = h * (2 if len(moves) > 1 else 1)
    flops = 0.0
    fill = _grouped_fill(fusion, D)
    for p in fusion.exprs:
        if isinstance(p, (ir.MatmulOp, ir.GroupedMmOp)):
            first = p.a if isinstance(p, ir.MatmulOp) else p.input
            n_axis, k_axis = p.out.logical_runtime()[-1].extent, first.logical_runtime()[-1].extent
            if n_axis.is_constant and k_axis.is_constant:
                flops += n_axis.value * k_axis.value * (fill if isinstance(p, ir.GroupedMmOp) else 1.0)
    n = max(1, int(flops // k)) if flops else h
    itemsize = torch.empty(0, dtype=e.out.dtype).element_size()
    return rows, k, n, itemsize


def _grouped_fill(fusion, D: int) -> float:
    """The share of a walked piece the routing fills on average: a rank's
    pairs (T x k) over its D pieces of `capacity` rows (the packed route's
    bound), at most 1; 1 where the fusion has no packed route (a backward,
    whose routing was saved: its compute is then counted whole)."""
    for e in fusion.exprs:
        if isinstance(e, ir.RouteOp) and e.packed:
            extents = [d.extent for d in e.indices.logical_runtime()]
            if all(x.is_constant for x in extents[-2:]):
                pairs = extents[-2].value * extents[-1].value
                return min(1.0, pairs / (D * e.capacity))
    return 1.0


def _gather_hint(fusion, inputs, D: int) -> tuple[int, int, int, int]:
    # The input a `set` gathers walking a stream axis, where the fusion
    # writes one (a sequence-parallel activation, smaller than the weight).
    walked = {e.input for e in fusion.exprs if isinstance(e, ir.Set) and e.out.stream_axes()}
    sharded = [(t, tv) for tv, t in zip(fusion.inputs, inputs) if tv.device_axes()]
    sharded = [p for p in sharded if p[1] in walked] or sharded
    t, tv = max(sharded, key=lambda p: p[0].numel())
    k = t.shape[-1] if t.dim() else 1
    rows = max(1, t.numel() // max(k, 1))
    if tv not in walked and t.dim() > 2 and t.shape[0] == D and not tv.axis(0).is_device_parallel:
        rows //= D
    # A linear's weight is [N, K]: its N is the product's columns.
    weights = {e.weight for e in fusion.exprs if isinstance(e, ir.LinearOp)}
    others = [
        x.shape[-2] if v in weights else x.shape[-1]
        for x, v in zip(inputs, fusion.inputs)
        if v is not tv and x.dim() >= 2
    ]
    n = max(others) if others else k
    return rows, k, n, t.element_size()


# ---------------------------------------------------------------- hoisting

# The hoisting choices per fusion, by input signature: a call that repeats
# a signature gets the choice made for its first call (the free device
# memory read then included) without asking the model, or the device, again.
_HOISTINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_HOISTINGS = 64


def hoisting_for_inputs(
    fusion, inputs, device, comm, host: frozenset, option="auto", cpp_posts: bool = False
) -> Hoisting | None:
    """How `hoist_transfers` moves this fusion's posts for these inputs: the
    forced choice (`option`, else `HOSTIR_HOIST`), or the machine model's
    (`machine.choose_hoisting`, made once per input signature and kept);
    None where the fusion moves nothing between memories or ranks. Every
    rank gets the same answer for the same input shapes. `cpp_posts`: the
    C++ executor will run the program."""
    chosen = forced(option)
    if chosen is not None:
        return chosen
    has_host = bool(host) or any(ir.in_host_memory(tv) for tv in fusion.inputs)
    if not has_host and comm is None:
        return None
    key = (
        fusion.version,
        tuple((t.shape, t.dtype) if isinstance(t, torch.Tensor) else None for t in inputs),
        str(device),
        None if comm is None else (comm.world_size, comm.backend, str(comm.device)),
        host,
        cpp_posts,
    )
    kept = _HOISTINGS.get(fusion)
    if kept is None:
        kept = _HOISTINGS[fusion] = {}
    if key not in kept:
        if len(kept) >= _MAX_HOISTINGS:
            kept.pop(next(iter(kept)))
        kept[key] = _choose_hoisting_for(fusion, inputs, device, comm, host, has_host, cpp_posts)
    return kept[key]


def _choose_hoisting_for(
    fusion, inputs, device, comm, host: frozenset, has_host: bool, cpp_posts: bool
) -> Hoisting | None:
    model = model_for(comm) if comm is not None else machine.machine_model(device)
    world = None if comm is None else comm.world_size
    found = machine.posts_and_computes(fusion, inputs, host, model, world)
    if found is None:
        return Hoisting(note="no transfer to time") if has_host else None
    on_gpu = getattr(device, "type", "cpu") == "cuda"
    # Only a linear's weight in host memory moves in pieces.
    mode, chunks, note = machine.choose_hoisting(model, *found, pieces=on_gpu and has_host, cpp_posts=cpp_posts)
    free = torch.cuda.mem_get_info(device)[0] if on_gpu else None
    return Hoisting(mode=mode, chunks=chunks, note=note, free_bytes=free)
