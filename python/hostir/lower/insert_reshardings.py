"""Make every op of a multi-device program either compute or reshard,
inserting the resharding ops where one would do both (nvFuser's
`insert_resharding` and its decomposition of a sharded reduction).

Precondition: `propagate_shardings` has run.
Postcondition: every compute op (unary, binary, reduction that keeps its
sharded axes, matmul, linear) runs on each rank's local pieces without
communication; each `Set` and each reduction of a sharded axis moves data
and is lowered to communications by `lower_communications`. Operand axes
paired with output axes are split alike, except a replicated operand axis
that its output shards, which the op reads as this rank's slice.

Rewrites, with `mode` "auto" (the default), "before" or "after":

- A matmul or linear whose K is sharded (row parallel) computes this rank's
  partial sums into a new tensor with an outermost sharded axis
  (`partial`), and a `sum` over that axis completes the output: an
  Allreduce, or a ReduceScatter when the output is sharded (sequence
  parallel). A bias is added after the sum.
- Partial products whose one use is a sum of an axis the operands shard,
  annotated (as nvFuser writes its ReduceScatterP2p) sharded on the axis
  the sum scatters and streamed on the summed one, take the operands'
  layout (`_partials_as_their_operands`): the matmul is then local and the
  sum a reduce-scatter. A tensor the program returns keeps its layout.
- Any other compute op whose operands are sharded otherwise than its output
  gets a resharding `Set` before it (a copy of each such operand, sharded as
  the output needs) or after it (the op computes with its operands'
  sharding into a new tensor, which a `Set` reshards into the output).
  "before"/"after" force a side where it is possible; "auto" takes the side
  that moves fewer elements. A tensor's count is the product of its whole
  extents; comparing two, factors equal by construction cancel, then two
  constants compare, and a side left with a symbolic factor counts as the
  larger against one left with none (extents the program leaves symbolic
  are the big ones). After is chosen when all sizes are constant and the
  output is smaller than the operands to copy together, or when some
  operand to copy is alone larger than the output; otherwise (a tie, or
  sizes that cannot be compared) the `Set` goes before, nvFuser's default. So a sum over an unsharded axis of a sharded tensor
  reduces first and gathers the smaller result, and a matmul of a
  sequence-sharded input gathers the input (the output cannot be sharded
  on both M and N). A stream axis of the output stays on the matching axis
  of the resharded copy (or of the partial sums), so a stream loop
  reshards and computes chunk by chunk.

With mode "strict" such an op is an error instead, as before this pass
existed.

    T2 = linear(T0, T1)          T3 = linear(T0, T1, partial = ideviceIdx.x9{2})
    (K of T0, T1 mesh_x)    ->   T2 = reduction(T3, op = add, ...)   (an Allreduce)
"""

from __future__ import annotations

from collections import Counter

from hostir import axis_graph, ir, printer
from hostir.kinds import BinaryKind, ReductionKind
from hostir.container import HostIrContainer
from hostir.lower.propagate_shardings import (
    RESHARDING_OPS,
    ShardingError,
    _copy_sharding,
    all_tvs,
    device_types,
    is_resharding,
    slices_locally,
)

MODES = ("auto", "before", "after", "strict")


def insert_reshardings(container: HostIrContainer, mode: str = "auto") -> HostIrContainer:
    if mode not in MODES:
        raise ShardingError(f"resharding mode must be one of {list(MODES)}, got {mode!r}")
    if not any(tv.mesh is not None for tv in all_tvs(container)):
        return container
    if mode != "strict":
        _partials_as_their_operands(container)
    classes = axis_graph.ExtentClasses(container.exprs)
    result = container.derive()
    for e in container.exprs:
        for new in _decompose(result, e, mode, classes):
            result.push_back(new)
    classes = axis_graph.ExtentClasses(result.exprs)
    for e in result.exprs:
        check_op(e, classes)
    return result


def _partials_as_their_operands(container: HostIrContainer) -> None:
    """Partial products sharded where their one sum scatters them take the
    layout of the operands instead (nvFuser's `ReduceScatterP2p`).

    nvFuser writes the products P = matmul(A, B) of K pieces d (A and B
    sharded on d) as [Stream(d), DIDx(j), ...]: row block j on rank j, the
    pieces walked by the stream, so the matmul reshards (nvFuser inserts a
    resharding set after it, lowered to P2P sends and receives per stream
    index), and `C = sum(P, d)` is local. Where P is an intermediate whose
    only use is that sum, sharded on the one axis j and streamed on the
    summed axis d, while the operands are sharded on d (and not on j), the
    annotations swap: P = [DIDx(d), Stream(j) or serial, ...] as the
    operands hold it, the matmul is local, and the sum of the sharded axis
    d into C sharded on j is the reduce-scatter that
    `decompose_device_axis` pipelines (a ring of sends and receives, each
    rank sending its D-1 partial blocks as nvFuser's does). The values of
    every tensor the program returns are the same."""
    outputs = {id(t) for t in container.outputs}
    reads = Counter(id(v) for x in container.exprs for v in x.inputs() if isinstance(v, ir.TensorView))
    sums = {id(x.input): x for x in container.exprs if isinstance(x, ir.ReductionOp)}
    for e in container.exprs:
        if not isinstance(e, (ir.MatmulOp, ir.LinearOp)) or e.partial is not None:
            continue
        p = e.out
        r = sums.get(id(p))
        if r is None or r.kind is not ReductionKind.sum or id(p) in outputs or reads[id(p)] != 1:
            continue
        summed = [i for o, i in r.id_pairs() if o.is_reduction]
        sharded = [d for d in p.logical if d.is_device_parallel]
        if len(summed) != 1 or len(sharded) != 1:
            continue
        (d_axis,), (j_axis,) = summed, sharded
        if d_axis.parallel_type is not ir.ParallelType.stream or d_axis.leaves is not None or j_axis.leaves is not None:
            continue
        scattered = next((o for o, i in r.id_pairs() if i is j_axis), None)
        if scattered is None or scattered.parallel_type is not j_axis.parallel_type:
            continue  # the sum does not leave row block j on rank j
        on_d = [i for o, i in e.id_pairs() if o is d_axis and i.leaves is None]
        on_j = [i for o, i in e.id_pairs() if o is j_axis]
        if not on_d or any(i.parallel_type is not j_axis.parallel_type for i in on_d):
            continue  # the operands do not hold the pieces d one to a rank
        if any(device_types(i) for i in on_j):
            continue
        d_axis.parallel_type = j_axis.parallel_type
        streamed = any(i.parallel_type is ir.ParallelType.stream for i in on_j)
        j_axis.parallel_type = ir.ParallelType.stream if streamed else ir.ParallelType.serial


def _decompose(container: HostIrContainer, e: ir.Expr, mode: str, classes) -> list[ir.Expr]:
    if isinstance(e, ir.Set):
        return [e]
    if isinstance(e, (ir.MatmulOp, ir.LinearOp)) and e.partial is None and _sharded_k(e):
        if mode == "strict":
            _refuse(e)
        return _partial_sums(container, e)
    if isinstance(e, ir.ReductionOp) and _reduces_sharded_axis(e):
        return [e]
    if not is_resharding(e):
        return [e]
    if mode == "strict":
        _refuse(e)
    before = _reshard_before(container, e)
    after = _reshard_after(container, e)
    if before is None and after is None:
        _refuse(e, "neither resharding its operands before it nor its output after it makes it local")
    if before is None:
        return after
    if after is None:
        return before[0]
    if mode == "after" or (mode == "auto" and _after_is_cheaper(e, before[1], classes)):
        return after
    return before[0]


def _refuse(e: ir.Expr, why: str = "") -> None:
    raise ShardingError(
        f"this op both computes and moves data between ranks (its operands and output are "
        f"sharded differently):\n{printer.format_expr_head(e)}\n"
        + (f"{why}; " if why else "")
        + "reshard an operand first with fd.ops.set and shard the copy as the output"
    )


# ---------------------------------------------------------------- partial sums


def _k_axes(e) -> list[ir.IterDomain]:
    if isinstance(e, ir.MatmulOp):
        return [e.a.logical_runtime()[-1], e.b.logical_runtime()[-2]]
    return [e.input.logical_runtime()[-1], e.weight.logical_runtime()[-1]]


def _sharded_k(e) -> ir.IterDomain | None:
    for k in _k_axes(e):
        if device_types(k):
            return k
    return None


def _partial_sums(container: HostIrContainer, e) -> list[ir.Expr]:
    """`out = op(a, b)` with K sharded becomes `P = op(a, b, partial)`,
    `out = sum(P)` (and `out = S + bias` for a linear with a bias)."""
    k = _sharded_k(e)
    (pt,) = device_types(k)
    out = e.out
    mesh = out.mesh
    n = mesh.size_along(pt)
    kept = [d for d in out.logical if not d.is_reduction]
    partial = ir.IterDomain(container, ir.Scalar.constant(n), ir.IterType.iteration, pt)
    # The partial sums' reduction runs over this rank's piece of K.
    k_reduced = ir.IterDomain(container, k.extent, ir.IterType.reduction)
    pieces = [
        ir.IterDomain(container, leaf.extent, ir.IterType.reduction, leaf.parallel_type) for leaf in k.loop_leaves()
    ]
    # A stream axis of the output stays on the partial sums, so that the
    # stream loop computes and reduces chunk by chunk.
    logical = (
        [partial]
        + [ir.IterDomain(container, d.extent, d.iter_type, _stream_or_serial(d)) for d in kept]
        + [k_reduced]
    )
    p = ir.TensorView(container, logical, out.dtype, ir.MemoryType.global_, mesh=mesh)
    if k.leaves is None:
        k_reduced.parallel_type = k.parallel_type
    else:
        for piece in pieces:
            piece.parent = k_reduced
        k_reduced.leaves = pieces
        p.domain[-1:] = pieces
    compute = e.replace(out=p, partial=partial, **({"bias": None} if isinstance(e, ir.LinearOp) else {}))
    for ref in _operands(compute):
        for o, i in compute.id_pairs():
            if i in ref.logical and not o.is_reduction:
                _walk_scattered(p, o, i, out.logical[p.logical.index(o) - 1], pt)
                _copy_sharding(p, o, i)

    bias = getattr(e, "bias", None)
    summed_axis = ir.IterDomain(container, ir.Scalar.constant(n), ir.IterType.reduction, pt)
    if bias is None:
        _set_axes(out, [summed_axis] + kept)
        return [compute, ir.ReductionOp(out, ReductionKind.sum, p)]
    s = _clone(container, out, kept)
    s.logical.insert(0, summed_axis)
    s.domain.insert(0, summed_axis)
    _set_axes(out, kept)
    return [compute, ir.ReductionOp(s, ReductionKind.sum, p), ir.BinaryOp(out, BinaryKind.add, s, bias)]


def _walk_scattered(p: ir.TensorView, o: ir.IterDomain, i: ir.IterDomain, scattered: ir.IterDomain, pt) -> None:
    """The partial sums' axis `o` walked as a stream axis where the sum
    scatters the matching output axis over the ranks (its outer piece on
    `pt`) and the operand's axis `i` asks for it, split alike with its outer
    piece on the stream: the sum is then a reduce-scatter that
    `decompose_device_axis` overlaps with the partial products (GEMM+RS)."""
    if o.leaves is not None or i.leaves is None or scattered.leaves is None:
        return
    if len(i.leaves) != 2 or len(scattered.leaves) != 2:
        return
    if i.leaves[0].parallel_type is not ir.ParallelType.stream or scattered.leaves[0].parallel_type is not pt:
        return
    made = []
    for leaf, kind in zip(i.leaves, (ir.ParallelType.stream, ir.ParallelType.serial)):
        new = ir.IterDomain(p.owner, leaf.extent, o.iter_type, kind)
        new.parent = o
        made.append(new)
    o.leaves = made
    o.parallel_type = ir.ParallelType.serial
    at = p.domain.index(o)
    p.domain[at : at + 1] = made


def _keep_stream(new: ir.IterDomain, like: ir.IterDomain) -> None:
    """A stream axis of the op's output stays on the resharded copy's axis
    that pairs with it, so the stream loop reshards chunk by chunk (a
    collective-based pipeline) instead of before the loop."""
    if like.parallel_type is ir.ParallelType.stream and new.leaves is None and new.parallel_type is ir.ParallelType.serial:
        new.parallel_type = ir.ParallelType.stream


def _stream_or_serial(d: ir.IterDomain) -> ir.ParallelType:
    return ir.ParallelType.stream if d.parallel_type is ir.ParallelType.stream else ir.ParallelType.serial


def _set_axes(tv: ir.TensorView, logical: list[ir.IterDomain]) -> None:
    """Give `tv` these logical axes; its loop axes follow (split pieces kept)."""
    tv.logical = list(logical)
    tv.domain = [leaf for d in logical for leaf in d.loop_leaves()]


def _clone(container: HostIrContainer, like: ir.TensorView, axes: list[ir.IterDomain]) -> ir.TensorView:
    """A new tensor on `like`'s mesh whose axes copy `axes` with their splits
    and mesh dimensions."""
    logical = [ir.IterDomain(container, d.extent, d.iter_type) for d in axes]
    tv = ir.TensorView(container, logical, like.dtype, ir.MemoryType.global_, mesh=like.mesh)
    for new, d in zip(logical, axes):
        _copy_sharding(tv, new, d)
    return tv


def _operands(e: ir.Expr) -> list[ir.TensorView]:
    return [v for v in e.inputs() if isinstance(v, ir.TensorView)]


def _reduces_sharded_axis(e: ir.ReductionOp) -> bool:
    return any(o.is_reduction and device_types(i) for o, i in e.id_pairs())


# ---------------------------------------------------------------- before / after


def _reshard_before(container: HostIrContainer, e: ir.Expr) -> tuple[list[ir.Expr], list] | None:
    """Copies of the operands sharded as `e`'s output needs, then `e` on
    them; and the operands it copies."""
    out_of = {id(i): o for o, i in e.id_pairs()}
    copies, changes, moved = [], {}, []
    made: dict[int, ir.TensorView] = {}
    for field in e.INPUTS:
        v = getattr(e, field)
        if not isinstance(v, ir.TensorView):
            continue
        if id(v) in made:  # one copy of an operand used twice
            changes[field] = made[id(v)]
            continue
        pairs = [(out_of.get(id(i)), i) for i in v.logical_runtime()]
        if v.mesh == e.out.mesh and all(
            o is None or o.is_reduction or device_types(o) == device_types(i) or slices_locally(e, o, i)
            for o, i in pairs
        ):
            continue
        logical = [ir.IterDomain(container, i.extent, i.iter_type) for i in v.logical_runtime()]
        copy = ir.TensorView(container, logical, v.dtype, ir.MemoryType.global_, mesh=e.out.mesh)
        for new, (o, i) in zip(logical, pairs):
            if o is not None and not o.is_reduction:
                _copy_sharding(copy, new, o)
                _keep_stream(new, o)
        copies.append(ir.Set(copy, v))
        changes[field] = made[id(v)] = copy
        moved.append(v)
    if not copies:
        return None
    new = e.replace(**changes)
    if is_resharding(new):
        return None
    return copies + [new], moved


def _reshard_after(container: HostIrContainer, e: ir.Expr) -> list[ir.Expr] | None:
    """`e` computing with its operands' sharding into a new tensor, then a
    `Set` resharding it into the output."""
    out = e.out
    # Reduction axes (a matmul's K, a reduction's reduced axes) stay in the
    # new tensor; the Set pairs the kept axes.
    logical = [ir.IterDomain(container, d.extent, d.iter_type) for d in out.logical]
    for new, d in zip(logical, out.logical):
        _keep_stream(new, d)
    operands = _operands(e)
    if len({v.mesh for v in operands}) != 1:
        return None
    r = ir.TensorView(container, logical, out.dtype, ir.MemoryType.global_, mesh=operands[0].mesh)
    compute = e.replace(out=r)
    for ref in sorted(operands, key=lambda v: -len(v.device_axes())):
        for o, i in compute.id_pairs():
            if i in ref.logical:
                _copy_sharding(r, o, i)
    if is_resharding(compute):
        return None
    return [compute, ir.Set(out, r)]


def _factors(tv: ir.TensorView, classes) -> tuple[int, Counter]:
    """`tv`'s whole size as a constant times symbolic factors (one key per
    class of equal extents)."""
    const, syms = 1, Counter()
    for d in tv.logical_runtime():
        if d.is_broadcast:
            continue
        key = classes.key(d.extent)
        if isinstance(key, ir.Scalar):
            syms[id(key)] += 1
        else:
            const *= key
    return const, syms


def _compare(a: tuple[int, Counter], b: tuple[int, Counter]) -> str:
    """'<', '>' or '=' when the sizes compare whatever the symbols' values
    (a symbolic factor left on one side only counts as the larger), else '?'."""
    common = a[1] & b[1]
    sa, sb = a[1] - common, b[1] - common
    if not sa and not sb:
        return "<" if a[0] < b[0] else ">" if a[0] > b[0] else "="
    if sa and not sb:
        return ">"
    if sb and not sa:
        return "<"
    return "?"


def _after_is_cheaper(e: ir.Expr, moved_before: list[ir.TensorView], classes) -> bool:
    """Whether resharding the output moves fewer elements than resharding
    the operands in `moved_before`: with constant sizes, compare the sums;
    else the output is cheaper if some operand alone is larger."""
    after = _factors(e.out, classes)
    before = [_factors(v, classes) for v in moved_before]
    if not after[1] and all(not syms for _, syms in before):
        return after[0] < sum(const for const, _ in before)
    return any(_compare(b, after) == ">" for b in before)


# ---------------------------------------------------------------- checks


def check_op(e: ir.Expr, classes) -> None:
    """Raise unless `e` either only computes or is a resharding op, and
    its operand axes are split as its output's (up to local slices)."""
    resharding = is_resharding(e)
    if resharding and not isinstance(e, RESHARDING_OPS):
        _refuse(e)
    if resharding:
        return
    if isinstance(e, ir.INDEX_OPS + ir.GROUPED_OPS):
        _check_whole(e)
    for o, i in e.id_pairs():
        if o.is_reduction and isinstance(e, ir.ReductionOp):
            continue
        if i.is_broadcast or o.is_broadcast:
            continue
        if _split_alike(o, i, classes) or slices_locally(e, o, i) or _reads_walked_whole(o, i):
            continue
        raise ShardingError(
            f"axis {printer.format_id(o)} and its operand axis {printer.format_id(i)} are split "
            f"differently ({_leaves_text(o)} vs {_leaves_text(i)}); split both the same way:\n"
            f"{printer.format_expr_head(e)}"
        )


def _check_whole(e: ir.Expr) -> None:
    """An index op reads the axes it chooses or gathers along (a top-k's
    last axis, the rows of a take, a route's tokens and choices) whole on
    every rank, and writes the axes it makes (the k of a top-k, a route's
    slots) whole: only the axes it pairs may be sharded."""
    paired = {id(x) for pair in e.id_pairs() for x in pair}
    for v in e.inputs() + e.outputs():
        if not isinstance(v, ir.TensorView):
            continue
        for d in v.logical_runtime():
            if id(d) not in paired and device_types(d):
                raise ShardingError(
                    f"axis {printer.format_id(d)} of T{v.name} is sharded, but this op reads or writes it "
                    f"whole on every rank:\n{printer.format_expr_head(e)}\n"
                    "gather it first with fd.ops.set (a replicated copy), or shard a batch axis instead"
                )


def _reads_walked_whole(o: ir.IterDomain, i: ir.IterDomain) -> bool:
    """Whether the operand axis `i` is only cut for a stream loop (its outer
    piece a stream piece, the rest serial) and the output axis `o` is
    whole: the op runs after the loop that wrote the operand chunk by chunk
    and reads all of it (the weight gradient of a backward whose ring
    gathered the output gradient for the input gradient, walking it)."""
    if o.leaves is not None or o.parallel_type is not ir.ParallelType.serial or i.leaves is None:
        return False
    first, *rest = i.leaves
    return first.parallel_type is ir.ParallelType.stream and all(x.parallel_type is ir.ParallelType.serial for x in rest)


def _split_alike(o: ir.IterDomain, i: ir.IterDomain, classes) -> bool:
    lo, li = o.loop_leaves(), i.loop_leaves()
    return axis_graph.split_alike(o, i, classes.equal) and all(
        x.is_device_parallel == y.is_device_parallel for x, y in zip(lo, li)
    )


def _leaves_text(d: ir.IterDomain) -> str:
    return "[" + ", ".join(printer.format_id(x) for x in d.loop_leaves()) + "]"
