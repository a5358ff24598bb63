"""Mutation analysis of the stream-race checker on a host program.

`check_sync_mutations(container, rank)` removes each `Synchronize` and each `Wait`
of a race-free program, one at a time, and requires the race checker to
report a race for the mutant, unless the removal is provably harmless: a
`Synchronize` that ends a loop body's join with the caller's stream, where
no op of the program touches memory after that loop, is covered by the
join of every used stream that ends each run; and a `Synchronize` in the
middle of a loop body, right before the body switches back to the stream
it waited for, orders the caller's own chunk after that iteration's
compute (a reduce ring's) and protects nothing the join loop after the
loop does not.
"""

from __future__ import annotations

from hostir import ir, printer
from hostir.container import HostIrContainer
from hostir.analysis.races import check_races

_MEMORY_OPS = ir.FUSION_OPS + (ir.Allocate, ir.Deallocate, ir.Communication, ir.P2PCommunication, ir.Transfer)


def sync_paths(exprs, prefix=()):
    """The position of every Synchronize and Wait, as a path of indices."""
    for i, e in enumerate(exprs):
        if isinstance(e, (ir.Synchronize, ir.Wait)):
            yield prefix + (i,)
        if isinstance(e, ir.ForLoop):
            yield from sync_paths(e.body, prefix + (i,))


def without(exprs, path):
    """`exprs` with the expr at `path` removed (loops on the way rebuilt)."""
    i = path[0]
    if len(path) == 1:
        return exprs[:i] + exprs[i + 1 :]
    loop = exprs[i]
    return exprs[:i] + [loop.replace(body=without(loop.body, path[1:]))] + exprs[i + 1 :]


def at(exprs, path):
    e = exprs[path[0]]
    return e if len(path) == 1 else at(e.body, path[1:])


def harmless(container: HostIrContainer, path) -> bool:
    """A final Synchronize of a loop body, after which nothing touches
    memory: the run's end joins the stream it waited for anyway."""
    removed = at(container.exprs, path)
    if not isinstance(removed, ir.Synchronize) or len(path) != 2:
        return False
    loop = container.exprs[path[0]]
    following = loop.body[path[1] + 1 : path[1] + 2]
    if following and isinstance(following[0], ir.SetCurrentStream) and following[0].stream == removed.stream:
        return True
    if removed is not loop.body[-1]:
        return False
    after = container.exprs[path[0] + 1 :]
    return not any(isinstance(e, _MEMORY_OPS) for e in ir.walk(after))


def mutant(container: HostIrContainer, path) -> HostIrContainer:
    m = container.derive()
    m.exprs = without(container.exprs, path)
    return m


def check_sync_mutations(container: HostIrContainer, rank: int | None = None) -> None:
    """`rank`: the rank the program was pruned for, if it was."""
    races = check_races(container, rank)
    assert not races, "races in the program:\n" + "\n".join(map(str, races))
    for path in sync_paths(container.exprs):
        line = printer.format_expr_head(at(container.exprs, path))
        found = check_races(mutant(container, path), rank)
        if harmless(container, path):
            assert not found, f"removing {line} is harmless, yet races were reported:\n" + "\n".join(map(str, found))
        else:
            assert found, f"removing `{line}` (at {path}) left no reported race"
