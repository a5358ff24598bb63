"""Free each intermediate buffer right after its last use.

Precondition: a verified host program (communications lowered, stream
loops built).
Postcondition: every TensorView that a scope (the top level or a loop body)
first binds to a buffer of its own — by `Allocate` or as the fresh result
of an op — and that is neither a program input nor output (through the
alias map) is followed by one `Deallocate` in that scope, placed after the
last op of the scope that uses it. An op uses a buffer when it reads or
writes it, or a slice (`HirAliasSelect`, `HirAliasChunk`) of it; a loop uses whatever its
body uses; a `Wait` uses the buffers of the communication it completes (a
posted collective may still read or write them until then). The slices of
the buffer that the same scope binds are freed with it, just before it: a
slice still bound would hold the buffer's memory (a weight moved in
pieces, an output written in column pieces).

Streams: a buffer used inside a stream loop is freed after the whole loop
and after any stream joins that follow it (a loop of only `Synchronize`s),
on the caller's stream, which by then has waited for every worker stream,
so the buffer is never released while a worker may still use it (after a
loop whose iterations end without the caller waiting for their worker, a
reduce ring's, past the join loop further on, which may run the ring's
local GEMM after each wait). A buffer bound inside a
loop body is used on that iteration's stream only and is freed there.

    T1 = ALLOCATE(...)               T1 = ALLOCATE(...)
    FOR StreamIdx ...: T1 = ...  ->  FOR StreamIdx ...: T1 = ...
    T2 = Set( T1 )                   T2 = Set( T1 )
                                     Deallocate { T1 }
"""

from __future__ import annotations

from hostir import ir
from hostir.container import HostIrContainer


def insert_deallocations(container: HostIrContainer) -> HostIrContainer:
    resolve = container.aliases.resolve
    sources: dict[ir.TensorView, ir.TensorView] = {}
    for e in container.walk():
        if isinstance(e, (ir.HirAliasSelect, ir.HirAliasChunk)):
            sources[e.out] = e.input

    def owner(tv: ir.TensorView) -> ir.TensorView:
        tv = resolve(tv)
        while tv in sources:
            tv = resolve(sources[tv])
        return tv

    keep = {owner(t) for t in container.inputs + container.outputs}
    result = container.derive()
    for e in _rewrite(container.exprs, owner, keep, bound=set()):
        result.push_back(e)
    return result


def _uses(e: ir.Expr, owner) -> set[ir.TensorView]:
    if isinstance(e, ir.ForLoop):
        found: set[ir.TensorView] = set()
        for inner in e.body:
            found |= _uses(inner, owner)
        return found
    vals = list(e.inputs()) + list(e.outputs()) + ir.defined_tvs(e)
    if isinstance(e, ir.Wait):
        target = e.communication
        vals += list(target.inputs()) + list(target.outputs())
    return {owner(v) for v in vals if isinstance(v, ir.TensorView)}


def _fresh(e: ir.Expr) -> list[ir.TensorView]:
    """Buffers `e` binds of its own (not views of another's)."""
    if isinstance(e, (ir.HirAliasSelect, ir.HirAliasChunk, ir.ForLoop)):
        return []
    return ir.defined_tvs(e)


_STREAM_OPS = (ir.GetCurrentStream, ir.SetCurrentStream, ir.Synchronize)


def _is_join(e: ir.Expr) -> bool:
    """Stream switches and waits only (a loop of them joins worker streams)."""
    if isinstance(e, ir.ForLoop):
        return all(_is_join(b) for b in e.body)
    return isinstance(e, _STREAM_OPS)


def _leaves_workers(e: ir.Expr) -> bool:
    """A stream loop whose iterations end without the caller waiting for
    their worker (a reduce ring's: a join loop further on waits)."""
    return (
        isinstance(e, ir.ForLoop)
        and any(isinstance(b, ir.SetCurrentStream) for b in e.body)
        and not isinstance(e.body[-1], ir.Synchronize)
    )


def _joins_each(e: ir.Expr) -> bool:
    """A loop each of whose iterations first waits for a worker stream
    (the reduce ring's local GEMM that adds the peer's partial)."""
    return isinstance(e, ir.ForLoop) and bool(e.body) and isinstance(e.body[0], ir.Synchronize)


def _past_joins(body: list[ir.Expr], i: int) -> int:
    """The index after which to free a buffer last used at `i`: past the
    stream joins that follow, so the caller's stream has waited for the
    workers that used it (for a loop that leaves its workers running, past
    the join loop further on, which may do work after each wait)."""
    if _leaves_workers(body[i]):
        i = next(
            (
                j
                for j in range(i + 1, len(body))
                if isinstance(body[j], ir.ForLoop) and (_is_join(body[j]) or _joins_each(body[j]))
            ),
            i,
        )
    while i + 1 < len(body) and _is_join(body[i + 1]):
        i += 1
    return i


def _rewrite(exprs, owner, keep: set, bound: set) -> list[ir.Expr]:
    """`bound`: buffers bound by enclosing scopes (not this one's to free)."""
    mine: list[ir.TensorView] = []
    seen = set(bound)
    new_body: list[ir.Expr] = []
    slices: dict[ir.TensorView, dict[ir.TensorView, None]] = {}
    for e in exprs:
        if isinstance(e, ir.ForLoop):
            e = e.replace(body=_rewrite(e.body, owner, keep, seen))
        if isinstance(e, (ir.HirAliasSelect, ir.HirAliasChunk)):
            slices.setdefault(owner(e.out), {})[e.out] = None
        for tv in _fresh(e):
            buffer = owner(tv)
            if buffer not in seen and buffer not in keep:
                seen.add(buffer)
                mine.append(buffer)
        new_body.append(e)

    last: dict[ir.TensorView, int] = {}
    for i, e in enumerate(new_body):
        for buffer in _uses(e, owner):
            last[buffer] = i
    after: dict[int, list[ir.TensorView]] = {}
    for buffer in mine:
        after.setdefault(_past_joins(new_body, last[buffer]), []).append(buffer)

    result: list[ir.Expr] = []
    for i, e in enumerate(new_body):
        result.append(e)
        for b in after.get(i, []):
            result += [ir.Deallocate(v) for v in slices.get(b, ())]
            result.append(ir.Deallocate(b))
    return result
