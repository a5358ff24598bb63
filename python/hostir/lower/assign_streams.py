"""Run the iterations of every stream loop on worker streams.

Precondition: the loop-building passes (`decompose_device_axis`,
`parallelize_streams`) have marked each loop whose iterations may run at
once (`ForLoop.stream_parallel`); a ring's loop counts the ops right before
or after it that compute the rank's own chunk (`ForLoop.caller_ops`,
`ForLoop.caller_after`).

Postcondition: no loop is marked. Iteration i of each marked loop runs on
the worker stream `Stream(i % numberOfStreams)` after the worker waits for
the caller's stream, and the caller's stream waits for every worker at the
end of its iteration, in one of two forms (`form`):

  pipelined      the caller's stream is captured once before the loop; a
                 first loop makes every worker wait for it; the rank's own
                 chunk then runs on the caller while the second loop runs
                 the iterations, so iteration i+1 need not wait for
                 iteration i's communication (nvFuser after #4402). A
                 loop's `caller_after` ops (a reduce ring's local partial)
                 run on the caller after each iteration's compute, while
                 the iterations' communications go on; the caller waits
                 for every worker after them; where the last of them is
                 a loop that `joins_workers` (the reduce ring that adds
                 the peer's partial in its local GEMM), each of its
                 iterations waits for that iteration's worker first, and
                 it is the join.
  per_iteration  each iteration captures the caller's stream and its worker
                 waits for it (the reference PR's form); the rank's own
                 chunk runs before the loop.

The default form is chosen here and nowhere else: pipelined for a
multi-device program, whose communications it overlaps, per iteration
otherwise (`default_form`).

    FOR StreamIdx in iS2{i0} (on worker streams):    FOR StreamIdx in iS2{i0}:
      T3 = HirAliasSelect(...); T3 = Set(T2)    ->     GetCurrentStream into Stream 0; SetCurrentStream to ...
                                                       Synchronize Stream 0; ...; SetCurrentStream to Stream 0; ...
"""

from __future__ import annotations

from hostir import ir, printer
from hostir.container import HostIrContainer
from hostir.errors import HostIrError

STREAM_FORMS = ("pipelined", "per_iteration")


class StreamAssignmentError(HostIrError, ValueError):
    """An unknown form, or a ring loop without its own chunk's ops."""


def default_form(container: HostIrContainer) -> str:
    """The form of a program's stream loops when none is asked for."""
    return "pipelined" if container.meshes() else "per_iteration"


def assign_streams(container: HostIrContainer, form: str | None = None) -> HostIrContainer:
    """`form`: "pipelined" or "per_iteration" (see the module's docstring);
    by default `default_form(container)`."""
    if form is not None and form not in STREAM_FORMS:
        raise StreamAssignmentError(f"unknown stream form {form!r}; expected one of {list(STREAM_FORMS)}")
    result = container.derive()
    for e in _assign(result, container.exprs, form or default_form(container)):
        result.push_back(e)
    return result


def _assign(container: HostIrContainer, exprs: list, form: str) -> list[ir.Expr]:
    new: list[ir.Expr] = []
    rest = list(exprs)
    while rest:
        e = rest.pop(0)
        if isinstance(e, ir.ForLoop) and e.stream_parallel:
            loop = e.replace(body=_assign(container, e.body, form), stream_parallel=False, caller_ops=0, caller_after=0)
            if form == "per_iteration":
                new.append(_per_iteration(container, loop))
                # Its iterations end with the caller waiting for their
                # worker: a loop after it that joins them waits for nothing.
                rest[: e.caller_after] = [
                    x.replace(joins_workers=False) if isinstance(x, ir.ForLoop) and x.joins_workers else x
                    for x in rest[: e.caller_after]
                ]
                continue
            if e.caller_ops > len(new) or e.caller_after > len(rest):
                raise StreamAssignmentError(
                    f"the stream loop `{printer.format_expr_head(e)}` counts {e.caller_ops} ops of the "
                    f"caller before it and {e.caller_after} after it, but its scope has {len(new)} "
                    f"before and {len(rest)} after"
                )
            own = new[len(new) - e.caller_ops :]
            del new[len(new) - e.caller_ops :]
            after = _assign(container, rest[: e.caller_after], form)
            del rest[: e.caller_after]
            new += _pipelined(container, loop, own, after)
        elif any(_marked(body) for body in ir.bodies(e)):
            if isinstance(e, ir.ForLoop):
                new.append(e.replace(body=_assign(container, e.body, form)))
            else:
                assert isinstance(e, ir.IfThenElse)
                new.append(
                    e.replace(
                        then_body=_assign(container, e.then_body, form),
                        else_body=_assign(container, e.else_body, form),
                    )
                )
        else:
            new.append(e)
    return new


def _marked(exprs: list) -> bool:
    return any(isinstance(e, ir.ForLoop) and e.stream_parallel for e in ir.walk(exprs))


def _worker(container: HostIrContainer, index: ir.Scalar) -> ir.Stream:
    return ir.Stream(container, index=index % container.named_scalar("numberOfStreams"))


def _pipelined(
    container: HostIrContainer, loop: ir.ForLoop, own: list[ir.Expr], after: list[ir.Expr] | None = None
) -> list[ir.Expr]:
    """GetCurrentStream; a loop making every worker wait for the caller;
    the rank's own chunk `own` on the caller; the work loop on the workers,
    with the caller waiting for each. With ops `after` the loop that need
    none of its communications (a reduce ring's local partial), the caller
    waits for each iteration's compute only, up to its first
    communication, then runs them while the communications go on, and
    waits for every worker after them (a join loop):

        FOR i (work):                        FOR i (join):
          SetCurrentStream worker(i)           Synchronize worker(i)
          compute...
          SetCurrentStream caller; Synchronize worker(i)
          SetCurrentStream worker(i)
          communications...
          SetCurrentStream caller
        after...
    """
    caller = ir.Stream(container)
    sync_index = ir.Scalar(label="StreamIdx")
    sync = loop.replace(
        index=sync_index,
        body=[ir.SetCurrentStream(_worker(container, sync_index)), ir.Synchronize(caller)],
        schedule=None,
    )
    worker = _worker(container, loop.index)
    if not after:
        work = loop.replace(
            body=[ir.SetCurrentStream(worker), *loop.body, ir.SetCurrentStream(caller), ir.Synchronize(worker)]
        )
        # The sync loop ends on the last worker: the own chunk goes back to
        # the caller, or the iteration on that worker (at two ranks and one
        # chunk, the ring's only push) would queue behind the own chunk's GEMM.
        back = [ir.SetCurrentStream(caller)] if own else []
        return [ir.GetCurrentStream(caller), sync, *back, *own, work]
    split = next((i for i, e in enumerate(loop.body) if _communicates(e)), len(loop.body))
    work = loop.replace(
        body=[
            ir.SetCurrentStream(worker),
            *loop.body[:split],
            ir.SetCurrentStream(caller),
            ir.Synchronize(worker),
            ir.SetCurrentStream(worker),
            *loop.body[split:],
            ir.SetCurrentStream(caller),
        ]
    )
    back = [ir.SetCurrentStream(caller)] if own else []
    tail = after[-1]
    if isinstance(tail, ir.ForLoop) and tail.joins_workers:
        # The last op after the loop walks its iterations, each after its
        # worker's (the reduce ring's local GEMM adding the peer's partial):
        # it is the join.
        walks = [printer.format_scalar(x) for x in (tail.start, tail.stop, loop.start, loop.stop)]
        if walks[:2] != walks[2:]:
            raise StreamAssignmentError(
                f"the loop `{printer.format_expr_head(tail)}` joins the workers of "
                f"`{printer.format_expr_head(loop)}` but walks other iterations"
            )
        join = tail.replace(body=[ir.Synchronize(_worker(container, tail.index)), *tail.body], joins_workers=False)
        return [ir.GetCurrentStream(caller), sync, *back, *own, work, *after[:-1], join]
    join_index = ir.Scalar(label="StreamIdx")
    join = loop.replace(index=join_index, body=[ir.Synchronize(_worker(container, join_index))], schedule=None)
    return [ir.GetCurrentStream(caller), sync, *back, *own, work, *after, join]


def _communicates(e: ir.Expr) -> bool:
    """Whether `e` posts or waits for a communication (or holds one)."""
    return any(isinstance(x, ir.COMMUNICATION_OPS) for x in ir.walk([e]))


def _per_iteration(container: HostIrContainer, loop: ir.ForLoop) -> ir.ForLoop:
    caller = ir.Stream(container)
    worker = _worker(container, loop.index)
    return loop.replace(
        body=[
            ir.GetCurrentStream(caller),
            ir.SetCurrentStream(worker),
            ir.Synchronize(caller),
            *loop.body,
            ir.SetCurrentStream(caller),
            ir.Synchronize(worker),
        ]
    )
