"""Post each communication and transfer as early as its operands and a
memory budget allow, so that it overlaps the compute before it.

Precondition: communications and transfers are lowered (each top-level
`Communication` or `Transfer` follows the `Allocate` of its output, if any,
and the views of a chunk it moves, and its `Wait` stays before the first
use of its output) and deallocations are inserted.
Postcondition: with `Hoisting.mode` "hoist", first each top-level `Wait`
of a communication (with the Deallocates of its buffers that follow it)
sits as late as it can: below the compute that neither reads nor writes
what the communication touches, below posts of other communication
types, and below a stream loop none of whose ops touches it or posts its
type (a re-gather posted above a GEMM+ReduceScatter ring runs under the
ring), but not below the next post of its own type, another barrier, or
the budget — so a weight gradient's ReduceScatter, posted as soon as the
gradient is computed, runs under the next layer's backward ("waited for N
compute ops later" in its dump line). Then each top-level post, with the
`Allocate` of its output, sits as early as it can: not above an op that
binds, writes or reads what it reads or writes, another post whose Wait
comes before its own (posts needed in order keep it; every rank moves
them alike, so the ranks' collectives still pair up), a stream switch or
a loop — so the re-gather of a weight the backward needs next is posted
above the ReduceScatter of the gradient before it; not above more
compute ops than `lookahead`; and not so far that the bytes of the program's
constant-size buffers live at once exceed the budget (by default twice the
sequential program's peak of them, double buffering, capped by the device
memory free when the program was lowered; a weight moved in pieces counts
whole from the post whose group allocates it, and the later pieces cannot
pass that post, so chunking never holds more). Its `Wait` stays where it was,
so the post runs on its own stream (a collective's, or the transfer's copy
stream) under the compute in between. The hoisted post's dump line says how
far it moved and why; with mode "sequential" nothing moves and each post
says why. Deallocations stay right: a buffer is still freed after its last
use, which a `Wait` counts as. Last, an H2D transfer with nothing but
allocations, deallocations and views between it and its `Wait` (each one
of the sequential program, and one the budget or an operand held in
place) runs on the current stream (`stream=current` in the dump) and
loses its `Wait`: nothing would overlap it, and a copy stream would only
add a cross-stream wait.

    T3 = ALLOCATE(W1 copy)                 T3 = ALLOCATE(W1 copy)
    Transfer 1 (W1 -> T3)                  Transfer 1 (W1 -> T3, hoisted above 2 compute ops)
    Wait Transfer 1                        T2 = linear( T0, W0 ); T4 = gelu( T2 )
    ...                              ->    Wait Transfer 1
"""

from __future__ import annotations

import dataclasses
import os

from hostir import ir, layout
from hostir.container import HostIrContainer
from hostir.errors import HostIrError

MODES = ("hoist", "sequential")
ENV = "HOSTIR_HOIST"


class HoistingError(HostIrError, ValueError):
    """A malformed hoisting option (`HOSTIR_HOIST` or `execute(hoist=)`)."""


@dataclasses.dataclass(frozen=True)
class Hoisting:
    """How far `hoist_transfers` moves posts. `mode`: "hoist" or
    "sequential". `budget_bytes`: the most bytes of constant-size buffers
    live at once (None: twice the sequential program's peak of them).
    `free_bytes`: device memory free beyond the program's own (caps the
    budget; None: no cap). `lookahead`: the most compute ops a post moves
    above (None: no limit). `chunks`: pieces `lower_transfers` cuts a
    linear's weight transfer into (1: whole). `note`: why this choice
    (printed)."""

    mode: str = "hoist"
    budget_bytes: int | None = None
    lookahead: int | None = None
    # Not compared: free memory moves from call to call, and calls that
    # differ in it alone run one program (and one prepared record).
    free_bytes: int | None = dataclasses.field(default=None, compare=False)
    note: str = ""
    chunks: int = 1

    def __post_init__(self):
        if self.mode not in MODES:
            raise HoistingError(f"hoisting mode must be one of {list(MODES)}, got {self.mode!r}")
        for name in ("budget_bytes", "lookahead", "free_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise HoistingError(f"hoisting {name} must be an integer >= 0, got {v!r}")
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            raise HoistingError(f"hoisting chunks must be an integer >= 1, got {self.chunks!r}")

    def key(self) -> tuple:
        # Not the free bytes: they move from call to call, and a program
        # lowered with some serves the calls after it.
        return (self.mode, self.budget_bytes, self.lookahead, self.note, self.chunks)


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9}


def _bytes(text: str, whole: str) -> int:
    t = text.strip().lower()
    number = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(number):]
    if unit not in _UNITS:
        raise HoistingError(f"hoisting {whole!r}: unknown unit {unit!r} in budget (B, KiB, MiB, GiB)")
    try:
        return int(float(number) * _UNITS[unit])
    except ValueError:
        raise HoistingError(f"hoisting {whole!r}: budget must be a number of bytes, got {text!r}") from None


def parse(text: str) -> Hoisting:
    """`hoist`, `hoist:budget=2GiB,lookahead=3,chunks=4` or `sequential`."""
    name, _, rest = text.strip().partition(":")
    fields: dict = {"mode": name.strip(), "note": "forced"}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in ("budget", "lookahead", "chunks"):
            raise HoistingError(
                f"hoisting {text!r}: expected budget=<bytes>, lookahead=<ops> or chunks=<pieces>, got {item!r}"
            )
        if key == "budget":
            fields["budget_bytes"] = _bytes(value, text)
        else:
            try:
                fields["lookahead" if key == "lookahead" else "chunks"] = int(value)
            except ValueError:
                raise HoistingError(f"hoisting {text!r}: {key} must be an integer, got {value!r}") from None
    return Hoisting(**fields)


def forced(option) -> Hoisting | None:
    """The hoisting an execute's `hoist` option (a `Hoisting` or its text)
    or else `HOSTIR_HOIST` forces; None when neither does (the machine
    model chooses)."""
    if option is None or option == "auto":
        option = os.environ.get(ENV, "").strip() or None
    if option is None or option == "auto":
        return None
    if isinstance(option, Hoisting):
        return option
    if not isinstance(option, str):
        raise HoistingError(f"hoist must be 'auto', a hoisting text or a Hoisting, got {option!r}")
    return parse(option)


_POSTS = (ir.Communication, ir.Transfer)
_BARRIERS = (
    ir.ForLoop, ir.GetCurrentStream, ir.SetCurrentStream, ir.Synchronize,
    ir.P2PCommunication, ir.StartCoalescing, ir.EndCoalescing,
) + _POSTS


def hoist_transfers(container: HostIrContainer, hoisting: Hoisting | None = None) -> HostIrContainer:
    hoisting = hoisting or Hoisting()
    exprs = list(container.exprs)
    if not any(isinstance(e, _POSTS) for e in exprs):
        return container
    resolve = container.aliases.resolve
    if hoisting.mode == "sequential":
        exprs = [_noted(e, f"sequential: {hoisting.note}" if hoisting.note else "sequential") for e in exprs]
    else:
        sequential_peak = _peak(exprs, resolve)
        budget = hoisting.budget_bytes if hoisting.budget_bytes is not None else 2 * sequential_peak
        if hoisting.free_bytes is not None:
            budget = min(budget, sequential_peak + hoisting.free_bytes)
        exprs, sunk = _sink_waits(exprs, budget, resolve)
        for post in [e for e in exprs if isinstance(e, _POSTS)]:
            exprs = _hoist(exprs, post, budget, hoisting, resolve)
        exprs = _note_sunk(exprs, sunk)
    result = container.derive()
    for e in _in_order(_rewait(exprs, container.exprs)):
        result.push_back(e)
    return result


# What may lie between a transfer and its Wait for it to run on the current
# stream: nothing that computes, waits or posts.
_QUIET = (ir.Allocate, ir.Deallocate, ir.HirAliasChunk, ir.HirAliasSelect)


def _in_order(exprs: list) -> list:
    """`exprs` with each H2D transfer that nothing would overlap — only
    allocations, deallocations and views lie between it and its Wait — on
    the current stream, its Wait dropped: a copy stream would only add a
    cross-stream wait (two events and a stream switch per transfer, on the
    host and on the GPU). So the sequential program is the hand-written
    one: copy, then the op, in order on one stream."""
    waits = {id(e.communication): i for i, e in enumerate(exprs) if isinstance(e, ir.Wait)}
    inline: dict[int, ir.Transfer] = {}
    for i, e in enumerate(exprs):
        if not isinstance(e, ir.Transfer) or not e.posted or e.direction != "H2D" or id(e) not in waits:
            continue
        if all(isinstance(between, _QUIET) for between in exprs[i + 1 : waits[id(e)]]):
            inline[id(e)] = e.replace(stream="current")
    if not inline:
        return exprs
    return [
        inline.get(id(e), e) for e in exprs
        if not (isinstance(e, ir.Wait) and id(e.communication) in inline)
    ]


# What a Wait may sink past: compute, allocations, deallocations and other
# Waits (and posts of other kinds of communication, `_sink_waits`).
_SINKS_PAST = ir.FUSION_OPS + (ir.Allocate, ir.Deallocate, ir.Wait)


def _sink_waits(exprs: list, budget: int, resolve) -> tuple[list, dict]:
    """Each top-level Wait of a communication, with the Deallocates of its
    buffers right after it, moved down past the compute that neither reads
    nor writes what the communication touches (and past posts of other
    communication types), up to the next post of its type, a barrier, or
    the budget (the buffers it holds stay live longer): a weight
    gradient's ReduceScatter, posted as soon as the gradient is computed,
    then runs under the next layer's backward. Returns the program and, per
    communication (by name), the compute ops its Wait now follows."""
    sunk: dict = {}
    for wait in [e for e in exprs if isinstance(e, ir.Wait) and isinstance(e.communication, ir.Communication)]:
        comm = wait.communication
        at = exprs.index(wait)
        touched = {resolve(comm.input), resolve(comm.out)}
        end = at + 1
        while end < len(exprs) and isinstance(exprs[end], ir.Deallocate) and resolve(exprs[end].buffer) in touched:
            end += 1
        group = exprs[at:end]
        rest = exprs[:at] + exprs[end:]
        to, passed, candidates = at, 0, []
        while to < len(rest):
            nxt = rest[to]
            # Past other communications' posts, but not the next of its kind:
            # one of each kind in flight.
            other_post = isinstance(nxt, ir.Communication) and nxt.type is not comm.type
            passes = isinstance(nxt, _SINKS_PAST) or other_post or _clear_region(nxt, comm, touched, resolve)
            if not passes or _conflicts(nxt, touched, resolve):
                break
            to += 1
            if isinstance(nxt, ir.FUSION_OPS):
                passed += 1
                candidates.append((to, passed))
        for to, passed in reversed(candidates):
            moved = rest[:to] + group + rest[to:]
            if _peak(moved, resolve) <= budget:
                exprs = moved
                sunk[(type(comm), comm.name)] = passed
                break
    return exprs, sunk


def _clear_region(e: ir.Expr, comm: ir.Communication, touched: set, resolve) -> bool:
    """Whether a Wait may sink past `e` as a whole: a view, the capture of
    the caller's stream before a stream loop, or a loop none of whose ops
    (nested bodies included) touches the communication's buffers or posts
    another communication of its type. A re-gather posted above the ring of
    a GEMM+ReduceScatter then runs under it and is waited for by the product
    that reads it after the ring; the loop's point-to-point sends follow
    the post on every rank alike."""
    if isinstance(e, (ir.HirAliasSelect, ir.GetCurrentStream)):
        return True
    if not isinstance(e, ir.ForLoop):
        return False
    todo = list(e.body)
    while todo:
        inner = todo.pop()
        if isinstance(inner, ir.ForLoop):
            todo.extend(inner.body)
        elif isinstance(inner, ir.IfThenElse):
            todo.extend(inner.then_body + inner.else_body)
        if isinstance(inner, ir.Communication) and inner.type is comm.type:
            return False
        if _conflicts(inner, touched, resolve):
            return False
    return True


def _note_sunk(exprs: list, sunk: dict) -> list:
    """Each communication whose Wait sank, with how far in its dump line."""
    if not sunk:
        return exprs
    found = []
    for e in exprs:
        n = sunk.get((type(e), getattr(e, "name", None))) if isinstance(e, ir.Communication) else None
        if n is not None:
            note = f"waited for {n} compute op{'s' if n != 1 else ''} later"
            e = e.replace(schedule=f"{e.schedule}; {note}" if e.schedule else note)
        found.append(e)
    return found


def _noted(e: ir.Expr, note: str) -> ir.Expr:
    if not isinstance(e, _POSTS) or e.schedule is not None:
        return e
    return e.replace(schedule=note)


def _rewait(exprs: list, original: list) -> list:
    """`exprs` with each Wait on a post that `_noted` replaced waiting on
    the replacement (a Wait names its post by identity)."""
    by_name = {(type(e), e.name): e for e in original if isinstance(e, _POSTS)}
    renamed = {}
    for new in exprs:
        old = by_name.get((type(new), getattr(new, "name", None)))
        if old is not None and old is not new:
            renamed[id(old)] = new
    return [ir.Wait(renamed[id(e.communication)]) if isinstance(e, ir.Wait) and id(e.communication) in renamed else e
            for e in exprs]


def _hoist(exprs: list, post: ir.Expr, budget: int, hoisting: Hoisting, resolve) -> list:
    at = exprs.index(post)
    start = at
    # The post moves with the views it reads and writes (a chunk of a
    # weight) and the Allocate of the buffer it writes, when they lead it.
    bound = {resolve(post.out), resolve(post.input)}
    while start > 0:
        before = exprs[start - 1]
        if isinstance(before, (ir.HirAliasChunk, ir.HirAliasSelect)) and resolve(before.out) in bound:
            bound.add(resolve(before.input))
            start -= 1
            continue
        if isinstance(before, ir.Allocate) and resolve(before.buffer) in bound:
            start -= 1
        break
    group = exprs[start : at + 1]
    touched = {resolve(v) for e in group for v in e.inputs() + e.outputs() + ir.defined_tvs(e) if isinstance(v, ir.TensorView)}
    rest = exprs[:start] + exprs[at + 1 :]
    waits = _wait_positions(rest)
    mine = waits.get((type(post), post.name), len(rest))
    peak_if_at = _peaks(rest, group, start, resolve)
    # Moving above ops that neither compute nor wait (a Deallocate) gains
    # nothing: the post lands just above the last such op it passes.
    to, passed, best = start, 0, start
    while to > 0:
        prev = rest[to - 1]
        if (isinstance(prev, _BARRIERS) and not _passes_post(prev, waits, mine)) or _conflicts(prev, touched, resolve):
            break
        compute = isinstance(prev, ir.FUSION_OPS)
        if compute and hoisting.lookahead is not None and passed + 1 > hoisting.lookahead:
            break
        if peak_if_at(to - 1) > budget:
            break
        to -= 1
        passed += compute
        if compute or isinstance(prev, ir.Wait):
            # Above a Wait too: one that blocks the host (gloo, D2H) would
            # otherwise hold the post back.
            best = to
    to = best
    if passed == 0:
        return exprs
    note = f"hoisted above {passed} compute op{'s' if passed != 1 else ''}"
    if hoisting.note:
        note += f"; {hoisting.note}"
    moved = [_noted(e, note) for e in group]
    return rest[:to] + moved + rest[to:]


def _wait_positions(exprs: list) -> dict:
    """Where each post's Wait is, by the post's (type, name)."""
    return {
        (type(e.communication), e.communication.name): i
        for i, e in enumerate(exprs)
        if isinstance(e, ir.Wait) and isinstance(e.communication, _POSTS)
    }


def _passes_post(prev: ir.Expr, waits: dict, mine: int) -> bool:
    """Whether a post may move above the post `prev`: only one whose Wait
    comes after its own (needed later: a weight gradient's ReduceScatter,
    waited for at the end, under the next weight's re-gather). Posts
    needed in order keep their order, and every rank reorders alike."""
    if not isinstance(prev, _POSTS):
        return False
    theirs = waits.get((type(prev), prev.name))
    return theirs is not None and theirs > mine


def _conflicts(e: ir.Expr, touched: set, resolve) -> bool:
    """Whether `e` binds, reads or writes a buffer the post touches (a Wait
    touches its communication's buffers)."""
    vals = list(e.inputs()) + list(e.outputs()) + ir.defined_tvs(e)
    if isinstance(e, ir.Wait):
        target = e.communication
        vals += list(target.inputs()) + list(target.outputs())
    return any(isinstance(v, ir.TensorView) and resolve(v) in touched for v in vals)


def _live_after(exprs: list, resolve) -> list[int]:
    """The bytes of constant-size device buffers (`Allocate`d) live after
    each op, in top-level program order."""
    live, sizes, found = 0, {}, []
    for e in exprs:
        if isinstance(e, ir.Allocate) and e.memory_type is not ir.MemoryType.host:
            n = layout.constant_bytes(e.buffer)
            if n is not None and resolve(e.buffer) not in sizes:
                sizes[resolve(e.buffer)] = n
                live += n
        elif isinstance(e, ir.Deallocate):
            live -= sizes.pop(resolve(e.buffer), 0)
        found.append(live)
    return found


def _peak(exprs: list, resolve) -> int:
    """The most bytes of constant-size device buffers live at once."""
    return max(_live_after(exprs, resolve), default=0)


def _peaks(rest: list, group: list, start: int, resolve):
    """`peak_if_at(p)`: the peak of `rest` with `group` inserted before
    rest[p], for p walking down from `start` one step at a time. The group's
    own buffer (if it allocates one of constant size) is live from there to
    its Deallocate in `rest`; nothing else changes, so each step costs O(1)."""
    live = _live_after(rest, resolve)
    held = _peak(group, resolve)
    made = {resolve(e.buffer) for e in group if isinstance(e, ir.Allocate)}
    end = next((i for i, e in enumerate(rest) if isinstance(e, ir.Deallocate) and resolve(e.buffer) in made), len(rest))
    before = [0] * (len(rest) + 1)  # before[p]: max of live[:p]
    for i, v in enumerate(live):
        before[i + 1] = max(before[i], v)
    after = max(live[end:], default=0)
    region = max(live[start:end], default=0)
    state = {"at": start, "region": region}

    def peak_if_at(p: int) -> int:
        while state["at"] > p:
            state["at"] -= 1
            state["region"] = max(state["region"], live[state["at"]])
        entering = (live[p - 1] if p > 0 else 0) + held
        return max(before[p], entering, state["region"] + held, after)

    return peak_if_at
