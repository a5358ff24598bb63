"""The host ops a lowering emits around the fusion ops: stream switches
and synchronizations, loops and conditionals, aliases of slices and
chunks, allocations. Each says in its docstring what it does at run time.
Part of the IR; `hostir.ir` re-exports it.
"""

from __future__ import annotations

import dataclasses

from hostir.errors import DefinitionError
from hostir.exprs import Expr, _op

from hostir.values import IterDomain, MemoryType, Scalar, ScalarExpr, Stream, TensorView, _scalar


@_op
class GetCurrentStream(Expr):
    """Binds `stream` to the caller's current stream, on every run. Does not
    block and enqueues nothing."""

    EFFECT = "sync"

    stream: Stream


@_op
class SetCurrentStream(Expr):
    """Makes `stream` the current stream: the ops after it enqueue there."""

    EFFECT = "sync"

    stream: Stream
    INPUTS = ("stream",)


@_op
class Synchronize(Expr):
    """The current stream waits for all work enqueued so far on `stream`.
    The host does not block."""

    EFFECT = "sync"

    stream: Stream
    INPUTS = ("stream",)


@_op
class ForLoop(Expr):
    """Runs `body` once for each `index` in [start, stop), rebinding `index`.
    Values first defined in the body are unbound at each iteration, so each
    iteration writes fresh buffers or the slices its selects bind.
    `iter_domain` names the axis a stream loop walks (for the dump);
    `schedule` names the decomposition a loop over a device axis follows.
    `stream_parallel` marks a stream loop whose worker streams are not yet
    written: the loop-building passes set it, `assign_streams` writes the
    caller/worker pattern and clears it (it changes nothing at run time).
    `caller_ops`: how many ops right before such a loop compute the rank's
    own chunk on the caller's stream while the workers run the iterations
    (a ring's local shard), so the workers need not wait for them.
    `caller_after`: how many ops right after it compute the rank's own
    chunk from none of the loop's communications (a reduce ring's local
    partial): the caller runs them once each iteration's compute is
    queued, before the iterations' communications end. The last of them
    may be a loop over the same iterations that `joins_workers`: each of
    its iterations first waits for that iteration's worker (a reduce
    ring's local GEMM that adds the peer's partial as it lands), and it
    is the stream loop's join."""

    index: Scalar
    start: Scalar
    stop: Scalar
    body: list
    iter_domain: IterDomain | None = None
    schedule: str | None = None
    stream_parallel: bool = False
    caller_ops: int = 0
    caller_after: int = 0
    joins_workers: bool = False
    INPUTS = ("start", "stop")


@_op
class IfThenElse(Expr):
    """Runs `then_body` if `predicate` (a scalar: a bool, or an integer
    that is true when non-zero) holds when it is reached, else `else_body`.
    What a branch defines is visible only inside it."""

    predicate: Scalar
    then_body: list
    else_body: list = dataclasses.field(default_factory=list)
    INPUTS = ("predicate",)


def compare(op: str, lhs: Scalar | int | bool, rhs: Scalar | int | bool) -> ScalarExpr:
    """The predicate `( lhs <op> rhs )`, op one of ==, !=, <, <=, >, >=,
    && and ||, for an `IfThenElse`."""
    if op not in ScalarExpr.COMPARISONS:
        raise DefinitionError(f"compare: unknown op {op!r}; expected one of {list(ScalarExpr.COMPARISONS)}")
    return ScalarExpr(op, _scalar(lhs), _scalar(rhs))


def bodies(e: Expr) -> list[list]:
    """The nested scopes of a control-flow expr (a loop's body, a
    conditional's two branches), none for any other."""
    if isinstance(e, ForLoop):
        return [e.body]
    if isinstance(e, IfThenElse):
        return [e.then_body, e.else_body]
    return []


@_op
class HirAliasSelect(Expr):
    """Binds `out` to a view of `input` at `index` along `axis`: no copy, so
    an op writing `out` writes `input`'s buffer. When `axis` is a dim of its
    own this is `input.select(dim, index)` (index 0 on a broadcast axis);
    when it is the outer piece of a split axis it is the index-th chunk of
    ceilDiv(size, axis extent) rows of that dim (the last chunks may be
    shorter or empty). `out` is bound, not defined, so it is not an SSA
    output. Does not block and enqueues nothing."""

    BINDS = ("out",)

    out: TensorView
    input: TensorView
    axis: IterDomain
    index: Scalar
    INPUTS = ("input", "index")

    def __post_init__(self):
        if self.axis not in self.input.domain:
            raise DefinitionError(f"select axis {self.axis} is not an axis of {self.input}")


@_op
class HirAliasChunk(Expr):
    """Binds `out` to the view of piece `index` of `parts` equal pieces of
    `input` along `axis` (a narrow, no copy): an op writing `out` writes
    `input`'s buffer. The axis's extent must divide by `parts`."""

    BINDS = ("out",)

    out: TensorView
    input: TensorView
    axis: IterDomain
    index: Scalar
    parts: int
    INPUTS = ("input", "index")

    def __post_init__(self):
        if self.axis not in self.input.domain:
            raise DefinitionError(f"chunk axis {self.axis} is not an axis of {self.input}")


@_op
class Allocate(Expr):
    """Binds `buffer` to a new tensor of its runtime shape on the program's
    device, unless it is bound already (a caller's preallocated output).
    The allocation is stream-ordered on the current stream."""

    BINDS = ("buffer",)

    buffer: TensorView
    memory_type: MemoryType = MemoryType.global_
    zero_init: bool = False


@_op
class Deallocate(Expr):
    """Drops the program's reference to `buffer`'s tensor."""

    buffer: TensorView
    INPUTS = ("buffer",)
