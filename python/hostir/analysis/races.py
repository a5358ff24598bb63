"""The stream-race checker: a static analysis of one host program.

`check_races(container)` walks the program as a GPU would order it and
returns every pair of accesses to overlapping memory, made from different
streams, at least one of them a write, that nothing orders: the list of
`Race`s (empty when the program is race-free).

Accesses are resolved to buffers: a read or write of an alias is one of the
buffer at the end of its chain; a `HirAliasSelect` slice is the part of its
source at that index (slices at different indices do not overlap); an op
writing a bound `out` writes that buffer; a communication reads its input
and writes its output when it completes. `Allocate` and `Deallocate` count
as writes of the whole buffer on the current stream (allocation is
stream-ordered; memory freed while another stream uses it is reused).

Happens-before is tracked with vector clocks, one timeline per stream and
one per posted communication: program order on a stream; `Synchronize s`
orders everything enqueued on `s` so far before what follows on the current
stream; a communication or a transfer starts after the work already on the
current stream, and its `Wait` (or its coalescing group's) orders it before what follows on
the current stream (a transfer on the current stream, `stream=current`, is an
access of that stream like a compute op's, with no `Wait`). The caller's stream writes the inputs before the program
and, after the program joins every stream it used (as the evaluator does),
reads the outputs and may overwrite the inputs; a communication never waited
for is not joined. Loops are unrolled for three iterations (fewer if the
trip count is a smaller constant), with a stream of its own per iteration
(the most parallel choice of `numberOfStreams`); a race names the loop
indices of both accesses. A program that names `rank` in its indices and
was not pruned for one rank is checked as each rank of its meshes: the
rank's own slice and a peer's differ only once the rank is a number.
"""

from __future__ import annotations

import dataclasses
import itertools

from hostir import ir, layout, printer
from hostir.container import HostIrContainer, body_locals
from hostir.errors import HostIrError

UNROLL = 3


class MissingRuleError(HostIrError, NotImplementedError):
    """The program holds an op the race checker has no rule for."""


class RaceCheckTypeError(HostIrError, TypeError):
    """`check_races` was given something other than a host program."""
CALLER = "caller"


@dataclasses.dataclass(frozen=True)
class Access:
    kind: str  # "read" or "write"
    buffer: tuple  # (resolved TensorView, generation)
    where: frozenset  # {(root dim, index or ("chunk", parts, index))}: the part accessed
    timeline: object
    clock: dict
    line: str
    loops: tuple

    def describe(self) -> str:
        loops = "".join(f" (in loop {n} = {v})" for n, v in self.loops)
        return f"{self.kind}s on {_timeline_name(self.timeline)}: {self.line}{loops}"


@dataclasses.dataclass(frozen=True)
class Race:
    """Two unordered conflicting accesses to one buffer."""

    buffer: str
    first: Access
    second: Access

    def __str__(self) -> str:
        return (
            f"race on {self.buffer}: nothing orders\n"
            f"  {self.first.describe()}\n"
            f"  {self.second.describe()}"
        )


def _timeline_name(tl) -> str:
    if tl == CALLER:
        return "the caller's stream"
    kind, key = tl[0], tl[1]
    if kind == "stream":
        return f"stream {key}"
    return f"communication {key}"


@dataclasses.dataclass
class _Region:
    buffer: tuple
    where: frozenset
    dims: tuple  # root dims this view still has, in order


class _Checker:
    def __init__(self, container: HostIrContainer, rank: int | None = None):
        self.container = container
        # The rank the program was pruned for (None: every rank's part).
        self.rank = rank
        self.resolve = container.aliases.resolve
        self.env: dict = {}
        named = container.named_scalars()
        if "numberOfStreams" in named:
            # Every iteration on a stream of its own: the most parallel run.
            self.env[named["numberOfStreams"]] = 1 << 30
        if "rank" in named and rank is not None:
            self.env[named["rank"]] = rank
        self.bound: dict = {}
        self.generation = itertools.count(1)
        self.current = CALLER
        self.clocks: dict = {CALLER: {CALLER: 0}}
        self.stream_of: dict = {}
        self.used: list = []
        self.posted: dict = {}  # expr -> list of communication timelines
        self.coalescing: list | None = None
        self.accesses: list[Access] = []
        self.loops: list = []
        self.comm_ids = itertools.count()
        self._body_locals = self._find_body_locals()

    # -- values
    def value(self, s: ir.Scalar):
        if s in self.env:
            return self.env[s]
        if isinstance(s, ir.ScalarExpr):
            a, b = self.value(s.lhs), self.value(s.rhs)
            if a is None or b is None:
                return None
            return ir.ScalarExpr.OPS[s.op](a, b)
        return s.value

    def region(self, tv) -> _Region | None:
        return self.bound.get(self.resolve(tv))

    def fresh(self, tv) -> _Region:
        root = self.resolve(tv)
        r = _Region((root, next(self.generation)), frozenset(), tuple(range(root.ndim)))
        self.bound[root] = r
        return r

    # -- clocks
    def tick(self, tl) -> dict:
        clock = self.clocks.setdefault(tl, {})
        clock[tl] = clock.get(tl, 0) + 1
        return dict(clock)

    def join(self, into, other) -> None:
        a, b = self.clocks.setdefault(into, {}), self.clocks.get(other, {})
        for k, v in b.items():
            if a.get(k, 0) < v:
                a[k] = v

    def access(self, kind: str, r: _Region | None, tl, line: str) -> None:
        if r is None:
            return
        clock = self.tick(tl)
        self.accesses.append(Access(kind, r.buffer, r.where, tl, clock, line, tuple(self.loops)))

    def stream_key(self, s: ir.Stream):
        if s.index is not None:
            v = self.value(s.index)
            return ("stream", v if v is not None else printer.format_scalar(s.index))
        return self.stream_of.get(s, ("stream", f"Stream {s.name}"))

    # -- walking
    def run(self) -> list[Race]:
        line = "(before the program, the caller writes its inputs)"
        for tv in self.container.inputs:
            if isinstance(tv, ir.TensorView):  # a scalar input has no buffer
                self.access("write", self.fresh(tv), CALLER, line)
        self.scope(self.container.exprs)
        for tl in self.used:
            self.join(CALLER, tl)
        self.current = CALLER
        end = "(after the program returns, the caller reads its outputs and may overwrite its inputs)"
        for tv in self.container.outputs:
            if tv.held_by(self.rank):
                self.access("read", self.region(tv), CALLER, end)
        for tv in self.container.inputs:
            if isinstance(tv, ir.TensorView):
                self.access("write", self.region(tv), CALLER, end)
        return find_races(self.accesses)

    def scope(self, exprs) -> None:
        for e in exprs:
            handler = _HANDLERS.get(type(e))
            if handler is None:
                raise MissingRuleError(f"the race checker has no rule for {type(e).__name__}")
            handler(self, e)

    def _find_body_locals(self) -> dict:
        # The same buffers the evaluator unbinds at each iteration.
        return body_locals(self.container)


_HANDLERS: dict = {}


def _rule(*classes):
    def wrap(fn):
        for c in classes:
            _HANDLERS[c] = fn
        return fn

    return wrap


def _line(e) -> str:
    return printer.format_expr_head(e)


@_rule(ir.ForLoop)
def _for(ck: _Checker, e: ir.ForLoop) -> None:
    start = ck.value(e.start) or 0
    stop = ck.value(e.stop)
    stop = start + UNROLL if stop is None else min(stop, start + UNROLL)
    name = printer.format_scalar(e.index)
    for i in range(start, stop):
        for tv in ck._body_locals[id(e)]:
            ck.bound.pop(tv, None)
        ck.env[e.index] = i
        ck.loops.append((name, i))
        ck.scope(e.body)
        ck.loops.pop()
    ck.env.pop(e.index, None)


@_rule(ir.IfThenElse)
def _if(ck: _Checker, e: ir.IfThenElse) -> None:
    value = ck.value(e.predicate)
    if value is not None:
        ck.scope(e.then_body if value else e.else_body)
        return
    # Unknown until run time: each branch from the same state, one after
    # the other (what either may touch is checked against what follows).
    ck.scope(e.then_body)
    ck.scope(e.else_body)


@_rule(ir.GetCurrentStream)
def _get_stream(ck: _Checker, e) -> None:
    ck.stream_of[e.stream] = ck.current


@_rule(ir.SetCurrentStream)
def _set_stream(ck: _Checker, e) -> None:
    ck.current = ck.stream_key(e.stream)
    if ck.current != CALLER and ck.current not in ck.used:
        ck.used.append(ck.current)


@_rule(ir.Synchronize)
def _synchronize(ck: _Checker, e) -> None:
    ck.join(ck.current, ck.stream_key(e.stream))


@_rule(ir.HirAliasSelect)
def _select(ck: _Checker, e: ir.HirAliasSelect) -> None:
    src = ck.region(e.input)
    if src is None:
        return
    pos = layout.position(e.input, e.axis)
    index = 0 if e.axis.is_broadcast else ck.value(e.index)
    root_dim = src.dims[pos]
    where = src.where | {(root_dim, index)}
    ck.bound[ck.resolve(e.out)] = _Region(src.buffer, frozenset(where), src.dims[:pos] + src.dims[pos + 1 :])


@_rule(ir.HirAliasChunk)
def _chunk(ck: _Checker, e: ir.HirAliasChunk) -> None:
    src = ck.region(e.input)
    if src is None:
        return
    root_dim = src.dims[layout.position(e.input, e.axis)]
    where = src.where | {(root_dim, ("chunk", e.parts, ck.value(e.index)))}
    ck.bound[ck.resolve(e.out)] = _Region(src.buffer, frozenset(where), src.dims)


@_rule(ir.Allocate)
def _allocate(ck: _Checker, e: ir.Allocate) -> None:
    r = ck.region(e.buffer)
    if r is None:
        r = ck.fresh(e.buffer)
    ck.access("write", r, ck.current, _line(e))


@_rule(ir.Deallocate)
def _deallocate(ck: _Checker, e: ir.Deallocate) -> None:
    r = ck.region(e.buffer)
    ck.access("write", r, ck.current, _line(e))
    ck.bound.pop(ck.resolve(e.buffer), None)


@_rule(*ir.FUSION_OPS)
def _compute(ck: _Checker, e) -> None:
    line = _line(e)
    for v in e.inputs():
        if isinstance(v, ir.TensorView):
            ck.access("read", ck.region(v), ck.current, line)
    r = ck.region(e.out)
    if r is None:
        r = ck.fresh(e.out)
    ck.access("write", r, ck.current, line)


@_rule(ir.PermuteOp, ir.ReshapeOp, ir.SliceOp)
def _view(ck: _Checker, e) -> None:
    """A permute, reshape or slice into an unbound output binds a view of
    its operand (the evaluator's, as torch's): later accesses to the output
    are accesses to the operand's buffer. Into a bound output it copies."""
    line = _line(e)
    src = ck.region(e.input)
    ck.access("read", src, ck.current, line)
    r = ck.region(e.out)
    if r is not None or src is None:
        ck.access("write", r if r is not None else ck.fresh(e.out), ck.current, line)
        return
    if isinstance(e, ir.PermuteOp) and len(src.dims) == len(e.dims):
        dims = tuple(src.dims[d] for d in e.dims)
    elif isinstance(e, ir.SliceOp) and len(src.dims) == len(e.ranges):
        # An axis taken whole is the operand's; a cut one is new.
        dims = tuple(
            d if r == (0, None, 1) else ("view", id(e), k) for k, (d, r) in enumerate(zip(src.dims, e.ranges))
        )
    else:
        # A reshape's dims are new; selects on them are told apart only
        # from each other, so they overlap anything else on the buffer.
        dims = tuple(("view", id(e), i) for i in range(e.out.ndim))
    ck.bound[ck.resolve(e.out)] = _Region(src.buffer, src.where, dims)


def _participates(ck: _Checker, e: ir.Communication) -> bool:
    return ck.rank is None or ck.rank in e.team


def _post(ck: _Checker, e, reads, writes) -> tuple:
    tl = ("comm", f"{next(ck.comm_ids)} ({_line(e).split('(')[0].strip()})")
    ck.clocks[tl] = dict(ck.clocks.get(ck.current, {}))
    line = _line(e)
    for tv in reads:
        ck.access("read", ck.region(tv), tl, line)
    for tv in writes:
        r = ck.region(tv)
        if r is None and tv.held_by(ck.rank):
            r = ck.fresh(tv)
        ck.access("write", r, tl, line)
    return tl


@_rule(ir.Communication)
def _communication(ck: _Checker, e: ir.Communication) -> None:
    if not _participates(ck, e):
        return
    writes = [e.out]
    if e.type.receives == "root" and ck.rank is not None:
        # Only the root receives.
        root = ck.value(e.root) if isinstance(e.root, ir.Scalar) else e.root
        if root is not None and root != ck.rank:
            writes = []
    tl = _post(ck, e, [e.input], writes)
    ck.posted.setdefault(e, []).append(tl)


@_rule(ir.Transfer)
def _transfer(ck: _Checker, e: ir.Transfer) -> None:
    if not e.posted:
        # On the current stream, in order with the ops around it.
        line = _line(e)
        ck.access("read", ck.region(e.input), ck.current, line)
        r = ck.region(e.out)
        ck.access("write", r if r is not None else ck.fresh(e.out), ck.current, line)
        return
    # A copy stream of its own: it starts after the work on the current
    # stream and its Wait orders it before what follows.
    tl = _post(ck, e, [e.input], [e.out])
    ck.posted.setdefault(e, []).append(tl)


@_rule(ir.P2PCommunication)
def _p2p(ck: _Checker, e: ir.P2PCommunication) -> None:
    reads, writes = ([e.buffer], []) if e.type == "send" else ([], [e.buffer])
    tl = _post(ck, e, reads, writes)
    if ck.coalescing is not None:
        ck.coalescing.append(tl)
    else:
        ck.posted.setdefault(e, []).append(tl)


@_rule(ir.StartCoalescing)
def _start(ck: _Checker, e) -> None:
    ck.coalescing = []


@_rule(ir.EndCoalescing)
def _end(ck: _Checker, e) -> None:
    group, ck.coalescing = ck.coalescing or [], None
    ck.posted.setdefault(e, []).extend(group)


@_rule(ir.Wait)
def _wait(ck: _Checker, e: ir.Wait) -> None:
    for tl in ck.posted.pop(e.communication, []):
        ck.join(ck.current, tl)


def _overlap(a: Access, b: Access) -> bool:
    """Whether two accesses of one buffer may touch the same memory: not if
    on some dimension each selects one index, or one equal-parts chunk, and
    those differ (anything else is taken to overlap)."""
    if a.buffer != b.buffer:
        return False
    on_a, on_b = _by_dim(a.where), _by_dim(b.where)
    for dim in on_a.keys() & on_b.keys():
        (x,), (y,) = on_a[dim], on_b[dim]
        if x is None or y is None:
            continue
        chunks = isinstance(x, tuple), isinstance(y, tuple)
        if chunks == (False, False) and x != y:
            return False
        if chunks == (True, True) and x[1] == y[1] and None not in (x[2], y[2]) and x[2] != y[2]:
            return False
    return True


def _by_dim(where) -> dict:
    """Each dimension's constraint, where it has exactly one."""
    found: dict = {}
    for dim, key in where:
        found.setdefault(dim, []).append(key)
    return {d: keys for d, keys in found.items() if len(keys) == 1}


def _ordered(a: Access, b: Access) -> bool:
    return b.clock.get(a.timeline, 0) >= a.clock[a.timeline]


def find_races(accesses: list[Access]) -> list[Race]:
    by_buffer: dict = {}
    for a in accesses:
        by_buffer.setdefault(a.buffer, []).append(a)
    races, seen = [], set()
    for buffer, acc in by_buffer.items():
        for i, a in enumerate(acc):
            for b in acc[i + 1 :]:
                if a.timeline == b.timeline or "write" not in (a.kind, b.kind):
                    continue
                if not _overlap(a, b) or _ordered(a, b) or _ordered(b, a):
                    continue
                key = (a.line, a.kind, b.line, b.kind)
                if key in seen:
                    continue
                seen.add(key)
                races.append(Race(f"T{buffer[0].name}", a, b))
    return races


def check_races(container: HostIrContainer, rank: int | None = None) -> list[Race]:
    """Every unordered pair of conflicting accesses from different streams
    in `container` (see the module doc); empty when there is none. `rank`:
    the rank the program was pruned for (`LoweredProgram.rank`), if it was."""
    if not isinstance(container, HostIrContainer):
        raise RaceCheckTypeError(f"check_races takes a HostIrContainer, got {type(container).__name__}")
    if rank is not None or "rank" not in container.named_scalars():
        return _Checker(container, rank).run()
    # A program for every rank is race-free when it is for each: its slices
    # at `rank` and at a peer's index differ only once the rank is known.
    races: list[Race] = []
    seen: set = set()
    for r in sorted({d for mesh in container.meshes() for d in mesh.devices}):
        for race in _Checker(container, r).run():
            key = (race.buffer, race.first.line, race.first.kind, race.second.line, race.second.kind)
            if key not in seen:
                seen.add(key)
                races.append(race)
    return races
