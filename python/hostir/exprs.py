"""The ops' base, `Expr`, with what every op declares (`INPUTS`,
`OUTPUTS`, `BINDS`, `EFFECT`, `id_pairs`), and the fusion ops a user
writes: `Set`, the elementwise, reduction and product ops, the shape ops,
broadcasts and the index ops of a mixture-of-experts layer. Their builders
(operand checks, the output inferred) are in `builders.py`, `shape_ops.py`,
`broadcast_ops.py` and `index_ops.py`. Part of the IR; `hostir.ir`
re-exports it.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from hostir.errors import DefinitionError
from hostir.kinds import BinaryKind, ReductionKind, UnaryKind
from hostir.values import IterDomain, Scalar, TensorView


# ---------------------------------------------------------------- exprs


# What an op does when it runs, as the profiler groups ops.
EFFECTS = ("compute", "communication", "copy", "sync", "host")


class Expr:
    """Base of all ops. Subclasses are dataclasses that declare their
    operand fields (`INPUTS`), their result fields (`OUTPUTS`), the fields
    whose tensors they bind when they run (`BINDS`; their outputs unless
    said otherwise) and their effect (`EFFECT`, one of `EFFECTS`)."""

    INPUTS: tuple[str, ...] = ()
    OUTPUTS: tuple[str, ...] = ()
    BINDS: tuple[str, ...] | None = None
    EFFECT: str = "host"

    def inputs(self) -> list:
        vals = []
        for f in self.INPUTS:
            v = getattr(self, f)
            if v is not None:
                vals.append(v)
        if getattr(self, "accumulate", False):
            # It adds its result to what its output holds: it reads it too.
            vals += self.outputs()
        return vals

    def outputs(self) -> list:
        return [getattr(self, f) for f in self.OUTPUTS]

    def replace(self, **changes) -> Expr:
        return dataclasses.replace(self, **changes)

    def id_pairs(self) -> Iterator[tuple[IterDomain, IterDomain]]:
        """(output axis, input axis) pairs that iterate together."""
        return iter(())

    def __repr__(self) -> str:
        # The dump line lives in printer.py, which depends on this module;
        # a repr names the op and its fields' values.
        parts = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            text = f"[{len(v)} exprs]" if f.name == "body" else repr(v)
            parts.append(f"{f.name}={text}")
        return f"{type(self).__name__}({', '.join(parts)})"


def _op(cls):
    return dataclasses.dataclass(eq=False, repr=False)(cls)


def as_kind(kinds: type, kind, what: str):
    """`kind` (a name or a member) as a member of the enum `kinds`."""
    try:
        return kinds(kind)
    except ValueError:
        raise DefinitionError(f"unknown {what} {kind!r}; expected one of {[k.value for k in kinds]}") from None


def _zip_axes(out: TensorView, inp: TensorView) -> Iterator[tuple[IterDomain, IterDomain]]:
    # An operand's reduction axes (left by the op that made it) take no part.
    yield from zip(out.logical_runtime(), inp.logical_runtime())


@_op
class Set(Expr):
    """`out = in` as a copy. Writes into `out` if its buffer is bound,
    otherwise binds a fresh copy. Runs on the current stream.

    `rows` and `rows_in` (int64, or None) size a resharding set at run
    time (an all-to-all of pieces whose real rows the program computed):
    `input` is [..., B, *features] with `B` a bound, `rows` [..., *groups]
    holds, for each piece this rank sends, how many of its leading B rows
    are real (summed over `groups`, the axes past the input's), and
    `rows_in` the same for each piece it receives. Only the real rows
    move; the rows past them in `out` are zeros."""

    EFFECT = "copy"

    out: TensorView
    input: TensorView
    rows: TensorView | None = None
    rows_in: TensorView | None = None
    INPUTS = ("input", "rows", "rows_in")
    OUTPUTS = ("out",)

    def id_pairs(self):
        return _zip_axes(self.out, self.input)


@_op
class BinaryOp(Expr):
    """Elementwise `out = lhs <kind> rhs` (add, sub, mul, div, with torch's
    broadcasting of size-1 broadcast axes and its type promotion). A Scalar
    operand is a constant. Writes into `out` if bound (the `out=` variant)."""

    EFFECT = "compute"

    out: TensorView
    kind: BinaryKind
    lhs: TensorView | Scalar
    rhs: TensorView | Scalar
    INPUTS = ("lhs", "rhs")
    OUTPUTS = ("out",)

    def __post_init__(self):
        self.kind = as_kind(BinaryKind, self.kind, "binary op")

    def id_pairs(self):
        # Aligned from the last axis, as torch broadcasts.
        out = self.out.logical_runtime()
        for operand in (self.lhs, self.rhs):
            if isinstance(operand, TensorView):
                yield from zip(reversed(out), reversed(operand.logical_runtime()))


@_op
class UnaryOp(Expr):
    """Elementwise `out = <kind>(input)`; `cast` converts to `out`'s dtype,
    `gelu` is the exact (erf) form. Writes into `out` if bound (the `out=`
    variant). Runs on the current stream."""

    EFFECT = "compute"

    out: TensorView
    kind: UnaryKind
    input: TensorView
    INPUTS = ("input",)
    OUTPUTS = ("out",)

    def __post_init__(self):
        self.kind = as_kind(UnaryKind, self.kind, "unary op")

    def id_pairs(self):
        return _zip_axes(self.out, self.input)


@_op
class ReductionOp(Expr):
    """`out = <kind>(input)` over the axes of `out` that are reductions
    (sum, max, min). Writes into `out` if bound."""

    EFFECT = "compute"

    out: TensorView
    kind: ReductionKind
    input: TensorView
    INPUTS = ("input",)
    OUTPUTS = ("out",)

    def __post_init__(self):
        self.kind = as_kind(ReductionKind, self.kind, "reduction")

    def id_pairs(self):
        return zip(self.out.logical, self.input.logical_runtime())


@_op
class MatmulOp(Expr):
    """`out = a @ b` with torch.matmul's semantics (batch axes broadcast,
    aligned from the right); `out`'s last axis is the reduction over K.
    Writes into `out` if bound."""

    EFFECT = "compute"

    out: TensorView
    a: TensorView
    b: TensorView
    # An outermost sharded axis of `out` (on K's mesh dimension) holding
    # each rank's partial sums over its piece of a sharded K: a `sum` over it
    # then reduces across ranks. None for a whole result.
    partial: IterDomain | None = None
    # Add the product to what the bound `out` holds (the GEMM's beta = 1)
    # instead of overwriting it: a decomposition's reduction of two
    # partials riding in the GEMM (`decompose_device_axis`); never a
    # user's op.
    accumulate: bool = False
    INPUTS = ("a", "b")
    OUTPUTS = ("out",)

    def id_pairs(self):
        a, b = self.a.logical_runtime(), self.b.logical_runtime()
        out = [d for d in self.out.logical if d is not self.partial]
        *batch_out, m, n, k = out
        yield m, a[-2]
        yield n, b[-1]
        yield k, a[-1]
        yield k, b[-2]
        for i, d in enumerate(reversed(batch_out)):
            for operand in (a, b):
                j = len(operand) - 3 - i
                if j >= 0:
                    yield d, operand[j]


@_op
class LinearOp(Expr):
    """`out = input @ weight.T + bias`; `out`'s last axis is the reduction
    over K. Writes into `out` if bound."""

    EFFECT = "compute"

    out: TensorView
    input: TensorView
    weight: TensorView
    bias: TensorView | None = None
    # As in MatmulOp: the axis of `out` holding partial sums, or None.
    # A partial result leaves the bias to the op that completes the sum.
    partial: IterDomain | None = None
    # As in MatmulOp: add the product to what the bound `out` holds.
    accumulate: bool = False
    INPUTS = ("input", "weight", "bias")
    OUTPUTS = ("out",)

    def id_pairs(self):
        x, w = self.input.logical_runtime(), self.weight.logical_runtime()
        out = [d for d in self.out.logical if d is not self.partial]
        k = out[-1]
        # A weight [*W, N, K] gives out [*lead, *W, N]: W and N pair with
        # the weight's (and the bias's) leading axes.
        lead, wn = out[: len(x) - 1], out[len(x) - 1 : -1]
        yield from zip(lead, x[:-1])
        yield from zip(wn, w[:-1])
        if self.bias is not None:
            yield from zip(reversed(wn), reversed(self.bias.logical_runtime()))
        yield k, x[-1]
        yield k, w[-1]


@_op
class PermuteOp(Expr):
    """`out = input.permute(dims)`: out axis i is input axis dims[i]. Binds
    a view of `input` (no copy, as torch's permute), or writes into `out`
    if it is bound. Runs on the current stream."""

    out: TensorView
    input: TensorView
    dims: tuple
    INPUTS = ("input",)
    OUTPUTS = ("out",)

    def id_pairs(self):
        ins = self.input.logical_runtime()
        for o, d in zip(self.out.logical_runtime(), self.dims):
            yield o, ins[d]


@_op
class ReshapeOp(Expr):
    """`out = input.reshape(shape)` (`shape` as given, -1 for the one
    inferred size): a view of `input` where torch's reshape makes one (its
    strides allow), else a copy; writes into `out` if it is bound. No axis
    of `out` iterates with one of `input`, so it cannot be stream-parallel."""

    out: TensorView
    input: TensorView
    shape: tuple
    INPUTS = ("input",)
    OUTPUTS = ("out",)


@_op
class SliceOp(Expr):
    """`out = input[start:stop:step, ...]`, one (start, stop, step) per
    axis (stop None: to the end): a view of `input`, as torch's slicing.
    An axis taken whole iterates with its input axis; a cut one does not.
    Writes into `out` if bound (a copy)."""

    out: TensorView
    input: TensorView
    ranges: tuple
    INPUTS = ("input",)
    OUTPUTS = ("out",)

    def id_pairs(self):
        for o, i, r in zip(self.out.logical_runtime(), self.input.logical_runtime(), self.ranges):
            if r == (0, None, 1):
                yield o, i


@_op
class SelectOp(Expr):
    """`out = input.select(dim, index)` as a copy: the axis `dim` goes
    away; `index` is a constant or a scalar input, negative counting from
    the end. Writes into `out` if bound."""

    out: TensorView
    input: TensorView
    dim: int
    index: Scalar
    INPUTS = ("input", "index")
    OUTPUTS = ("out",)

    def id_pairs(self):
        ins = [d for k, d in enumerate(self.input.logical_runtime()) if k != self.dim]
        return zip(self.out.logical_runtime(), ins)


@_op
class ExpandOp(Expr):
    """`out = input` broadcast to `like`'s shape, as a copy: the axes of
    `out` at `dims` are new (size-1 axes of `input` inserted there, then
    expanded), the others iterate with `input`'s. `like` gives the sizes
    only (the backward of a sum). Writes into `out` if bound."""

    EFFECT = "compute"

    out: TensorView
    input: TensorView
    like: TensorView
    dims: tuple
    INPUTS = ("input", "like")
    OUTPUTS = ("out",)

    def id_pairs(self):
        out = self.out.logical_runtime()
        kept = [d for k, d in enumerate(out) if k not in self.dims]
        yield from zip(kept, self.input.logical_runtime())
        yield from zip(out, self.like.logical_runtime())


@_op
class InsertOp(Expr):
    """`out = zeros like `like`, with `input` written where a slice
    (`ranges`, as SliceOp's) or a select (`dim`, `index`) of it reads`: the
    backward of slice and select. `like` gives the sizes only. Writes into
    `out` if bound."""

    EFFECT = "compute"

    out: TensorView
    input: TensorView
    like: TensorView
    ranges: tuple | None = None
    dim: int | None = None
    index: Scalar | None = None
    INPUTS = ("input", "like", "index")
    OUTPUTS = ("out",)

    def id_pairs(self):
        yield from zip(self.out.logical_runtime(), self.like.logical_runtime())


@_op
class CatOp(Expr):
    """`out = torch.cat([input, other], dim)`: the two operands' other axes
    equal, `out`'s axis `dim` as long as both of theirs. The backward of
    slices that tile an axis (`transpose_rules`), and `fd.ops.cat`. Writes
    into `out` if bound."""

    EFFECT = "compute"

    out: TensorView
    input: TensorView
    other: TensorView
    dim: int
    INPUTS = ("input", "other")
    OUTPUTS = ("out",)

    def id_pairs(self):
        for k, o in enumerate(self.out.logical_runtime()):
            if k != self.dim:
                yield o, self.input.logical_runtime()[k]
                yield o, self.other.logical_runtime()[k]


@_op
class BroadcastInDimOp(Expr):
    """`out` = `input` with input axis i as out axis `dims[i]`, out's other
    axes new, and size-1 input axes grown to out's sizes (nvFuser's
    broadcast_in_dim, torch's unsqueeze then expand), as a copy. Writes
    into `out` if bound. Runs on the current stream."""

    out: TensorView
    input: TensorView
    dims: tuple
    INPUTS = ("input",)
    OUTPUTS = ("out",)
    EFFECT = "compute"

    def id_pairs(self):
        out = self.out.logical_runtime()
        return zip([out[d] for d in self.dims], self.input.logical_runtime())


# ---------------------------------------------------------------- index ops
#
# The ops of a mixture-of-experts layer: the top-k of the router's scores,
# the routing of (token, choice) pairs to the slots of a capacity-padded
# buffer per expert, and the gather of rows by index and its transpose.
# An index below zero names no row: `take` gives zeros there and `put_add`
# drops it. Their builders are in `index_ops.py`.


@_op
class TopKOp(Expr):
    """`out` = the positions (int64) of the `k` largest elements of `input`
    along its last axis, largest first (`torch.topk(input, k).indices`;
    ties as torch breaks them). Its values are a `TakeOp` of `input` at
    `out`. Writes into `out` if bound."""

    EFFECT = "compute"

    out: TensorView
    input: TensorView
    k: int
    INPUTS = ("input",)
    OUTPUTS = ("out",)

    def id_pairs(self):
        return zip(self.out.logical_runtime()[:-1], self.input.logical_runtime()[:-1])


@_op
class RouteOp(Expr):
    """Where each (token, choice) of a router's choices `indices` [*lead,
    T, k] (expert ids in [0, experts)) goes in a buffer of `capacity` slots
    per expert: the stable permutation of the pairs by expert (token order
    kept within an expert), cut at `capacity`.

    `what="slot"`: `out` [*lead, T, k], each pair's slot `e * capacity + c`
    (c: how many pairs of earlier tokens chose expert e), -1 for a pair
    past its expert's capacity (dropped). `what="source"`: `out` [*lead,
    groups, experts / groups, capacity], the token each slot holds, -1 for
    an empty slot: the inverse permutation, grouped as the experts are
    placed (`groups` ranks holding `experts / groups` each).
    `what="counts"`: `out` [*lead, groups, experts / groups], the pairs
    each expert keeps.

    `packed`: the buffer has `capacity` rows per group (a rank's experts
    together), and a group's pairs fill them from the first row, expert
    after expert, with no gap: slot `g * capacity + p` (p: the pairs of
    the group's earlier experts and of earlier tokens of this one), -1
    past the group's capacity; `source` is [*lead, groups, capacity]. The
    counts then say where each expert's rows start and end (the exact
    form, whose exchange is sized by them at run time). Integer outputs:
    no gradient."""

    EFFECT = "compute"

    out: TensorView
    indices: TensorView
    experts: int
    capacity: int
    what: str
    groups: int = 1
    packed: bool = False
    INPUTS = ("indices",)
    OUTPUTS = ("out",)

    def id_pairs(self):
        return zip(self.out.logical_runtime()[:-2], self.indices.logical_runtime()[:-2])


@_op
class TakeOp(Expr):
    """Rows of `input` by index: `input` is [*batch, *rows, *features]
    (`batch` leading axes, `features` trailing ones, the rows between them
    counted as one flat axis), `index` [*batch, *picks] (int64), and
    `out[b, p, f] = input[b, index[b, p], f]`, zeros where the index is
    negative. Its transpose is `PutAddOp`, or, with `inverse`, a take of
    the picks summed: `inverse` [*batch, *rows, m] (int64) lists for each
    row of `input` the flat picks that read it, -1 padding the rest, so
    that `put_add(g, index)` is `take(g, inverse)` summed over its m axis
    (a gather and a sum instead of a scatter of colliding adds; a MoE
    layer's dispatch has it: each token's k slots). The take itself does
    not read it, and nothing checks it against `index`: the gradient
    trusts it. Writes into `out` if bound."""

    EFFECT = "compute"

    out: TensorView
    input: TensorView
    index: TensorView
    batch: int
    features: int
    inverse: TensorView | None = None
    INPUTS = ("input", "index", "inverse")
    OUTPUTS = ("out",)

    def id_pairs(self):
        out, x, index = self.out.logical_runtime(), self.input.logical_runtime(), self.index.logical_runtime()
        b, f = self.batch, self.features
        yield from zip(out[:b], x[:b])
        yield from zip(out[: len(index)], index)
        if f:
            yield from zip(out[-f:], x[-f:])
        if self.inverse is not None:
            yield from zip(out[:b], self.inverse.logical_runtime()[:b])


@_op
class PutAddOp(Expr):
    """The transpose of `TakeOp`: zeros shaped as `like` ([*batch, *rows,
    *features]), with each row `input[b, p]` ([*batch, *picks, *features])
    added at row `index[b, p]`; negative indices add nothing. `like` gives
    the sizes only. `distinct`: the index's non-negative entries are
    distinct within a batch element (a route's slots, which the transpose
    of a take of them knows), so each row is written, not added. Writes
    into `out` if bound."""

    EFFECT = "compute"

    out: TensorView
    input: TensorView
    index: TensorView
    like: TensorView
    batch: int
    features: int
    distinct: bool = False
    INPUTS = ("input", "index", "like")
    OUTPUTS = ("out",)

    def id_pairs(self):
        out, x, index = self.out.logical_runtime(), self.input.logical_runtime(), self.index.logical_runtime()
        b, f = self.batch, self.features
        yield from zip(out, self.like.logical_runtime())
        yield from zip(out[:b], x[:b])
        yield from zip(out[:b], index[:b])
        yield from zip(x[: len(index)], index)
        if f:
            yield from zip(out[-f:], x[-f:])


@_op
class GroupedMmOp(Expr):
    """The grouped GEMM: `input` [*batch, R, K] holds, per batch element,
    rows grouped by `counts` [*batch, G] (int64: group g's rows are the
    `counts[g]` after the earlier groups'), and `out` [*batch, R, N] is
    each row times its group's `weight` [*wbatch, G, N, K] transposed
    (`torch._grouped_mm(input, weight.mT, offs=cumsum(counts))`); rows
    past the groups' total are zeros. `wbatch` is a suffix of `batch`:
    the weight is shared by the leading batch axes it lacks. The counts
    must be >= 0 and total at most R: a matmul per group (which reads them
    on the host) refuses others; the kernel, which reads them on the
    device, cannot. Writes into `out` if bound."""

    EFFECT = "compute"

    out: TensorView
    input: TensorView
    weight: TensorView
    counts: TensorView
    INPUTS = ("input", "weight", "counts")
    OUTPUTS = ("out",)

    def id_pairs(self):
        out, x = self.out.logical_runtime(), self.input.logical_runtime()
        w, c = self.weight.logical_runtime(), self.counts.logical_runtime()
        yield from zip(out[:-1], x[:-1])
        yield from zip(c[:-1], x[:-2])
        yield from zip(reversed(w[:-3]), reversed(x[:-2]))
        yield out[-1], w[-2]


@_op
class GroupedOuterOp(Expr):
    """Per group, the sum of its rows' outer products: `input` [*batch, R,
    N] and `other` [*batch, R, K] with rows grouped by `counts` [*batch,
    G] as `GroupedMmOp` groups them, and `out` [*wbatch, G, N, K] with
    `out[g] = input_g^T other_g`, summed over the leading batch axes that
    `wbatch` (a suffix of `batch`) lacks: the weight's gradient of a
    `GroupedMmOp`. A group without rows gives zeros."""

    EFFECT = "compute"

    out: TensorView
    input: TensorView
    other: TensorView
    counts: TensorView
    INPUTS = ("input", "other", "counts")
    OUTPUTS = ("out",)

    def id_pairs(self):
        out, x = self.out.logical_runtime(), self.input.logical_runtime()
        o, c = self.other.logical_runtime(), self.counts.logical_runtime()
        yield from zip(x[:-1], o[:-1])
        yield from zip(c[:-1], x[:-2])
        yield from zip(reversed(out[:-3]), reversed(x[:-2]))
        yield out[-2], x[-1]
        yield out[-1], o[-1]


INDEX_OPS = (TopKOp, RouteOp, TakeOp, PutAddOp)
# The grouped GEMM and its weights' gradient (rows grouped by counts).
GROUPED_OPS = (GroupedMmOp, GroupedOuterOp)


SHAPE_OPS = (PermuteOp, ReshapeOp, SliceOp, SelectOp)
FUSION_OPS = (
    (Set, UnaryOp, BinaryOp, ReductionOp, MatmulOp, LinearOp, BroadcastInDimOp, ExpandOp, InsertOp, CatOp)
    + SHAPE_OPS
    + INDEX_OPS
    + GROUPED_OPS
)
COMPUTE_OPS = (
    (UnaryOp, BinaryOp, ReductionOp, MatmulOp, LinearOp, BroadcastInDimOp, ExpandOp, InsertOp, CatOp)
    + INDEX_OPS
    + GROUPED_OPS
)
