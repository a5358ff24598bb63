"""The transpose rule of each fusion op, keyed by op class (`RULES`,
filled by `@rule`): given the cotangent of an op's output, a rule builds
the cotangents of its inputs in the backward fusion, through the
`Deriver` of `derivation.py` (which places, saves and gathers what the
rule reads). `hostir.autodiff.derive` walks a fusion with this table.
"""

from __future__ import annotations

from hostir import builders, index_ops, ir, shape_ops
from hostir.derivation import Deriver, NoTransposeRuleError, no_rule, wants


RULES: dict = {}


def rule(op_class):
    def wrap(fn):
        RULES[op_class] = fn
        return fn

    return wrap


@rule(ir.Set)
def _set_rule(d: Deriver, e: ir.Set, needs) -> None:
    if not wants(d, e.input, needs):
        d.contribs.pop(e.out, None)
        return
    if e.rows is not None:
        # An exchange sized at run time goes back with its counts swapped:
        # each piece's real rows return to where they came from.
        g = d.cotangent(e.out)
        layout = d.layout(e.input).without_streams()
        gx = builders.set_(g, rows=d.save(e.rows_in), rows_in=d.save(e.rows))
        layout.apply(gx)
        d.known[gx] = layout
        d.contribute(e.input, gx)
        return
    if _walked_all_to_all(d, e):
        # The forward walked this all-to-all (a MoE layer's dispatch, or
        # the combine that returns its pieces): the cotangent is summed in
        # the output's layout (the dispatch's: piece by piece, as received)
        # and moved back by an explicit set into the input's (the
        # combine's: walked), so that the backward is a walk the planner
        # schedules and the lowering decomposes as the forward's: each
        # piece's gradient computed as it arrives and returned to the rank
        # it came from.
        g = d.cotangent(e.out)
        gx = builders.set_(g)
        layout = d.layout(e.input)
        layout.apply(gx)
        d.known[gx] = layout
        d.contribute(e.input, gx)
        return
    # The same values in the input's sharding: the lowering moves them.
    g = d.cotangent(e.out, d.layout(e.input))
    d.contribute(e.input, g)


def _walked_all_to_all(d: Deriver, e: ir.Set) -> bool:
    """Whether `e` is an all-to-all the forward walks: its output sharded
    on one axis its input holds whole and its input on one axis its output
    holds whole, with a stream piece on the output's axis that the input
    shards (the pieces received one by one) or on the input's axis that
    the output shards (the pieces returned one by one)."""
    lo, li = d.layout(e.out), d.layout(e.input)
    if lo.mesh is None or li.mesh is None or lo.mesh != li.mesh or len(lo.axes) != len(li.axes):
        return False
    sharded_out = [a for a in range(len(lo.axes)) if lo.device_types(a)]
    sharded_in = [a for a in range(len(li.axes)) if li.device_types(a)]
    if len(sharded_out) != 1 or len(sharded_in) != 1 or sharded_out == sharded_in:
        return False
    if li.device_types(sharded_out[0]) or lo.device_types(sharded_in[0]):
        return False
    return lo.streamed(sharded_in) or li.streamed(sharded_out)


@rule(ir.UnaryOp)
def _unary_rule(d: Deriver, e: ir.UnaryOp, needs) -> None:
    # Each unary kind declares its backward (`UnaryKind.grad`, kinds.py).
    g = d.cotangent(e.out)
    if not wants(d, e.input, needs):
        return
    grad = e.kind.grad
    if grad is None:
        raise NoTransposeRuleError(no_rule(e, f"hostir has no backward rule for unary {e.kind}"))
    if grad.reads is None:
        gx = builders.unary(grad.kind, g, e.input.dtype if grad.kind == "cast" else None)
    else:
        gx = builders.binary(grad.kind, g, d.save(getattr(e, grad.reads)))
    d.contribute(e.input, d.made(gx))


def _unbroadcast(d: Deriver, g: ir.TensorView, operand: ir.TensorView) -> ir.TensorView:
    """`g` (shaped as an op's output) summed over the axes where `operand`
    is broadcast, shaped as `operand`."""
    out_axes = g.logical_runtime()
    op_axes = operand.logical_runtime()
    offset = len(out_axes) - len(op_axes)
    dims = [k for k in range(offset)] + [
        offset + k for k, a in enumerate(op_axes) if a.is_broadcast and not out_axes[offset + k].is_broadcast
    ]
    if not dims:
        return g
    s = builders.reduction("sum", g, dims)
    if offset == 0:
        return _emit_expand(s, d.shaped_like(operand), dims)
    if dims == list(range(offset)):
        # Only the leading axes the operand lacks (a batched matmul's
        # weight broadcast over a batch axis): summed away.
        return s
    raise NoTransposeRuleError(f"an operand with fewer axes than its op's output: T{operand.name}")


def _emit_expand(x: ir.TensorView, like: ir.TensorView, dims) -> ir.TensorView:
    fusion = x.owner
    out = ir.TensorView(fusion, [a.clone(fusion) for a in like.logical_runtime()], x.dtype)
    fusion.add_expr(ir.ExpandOp(out, x, like, tuple(dims)))
    return out


@rule(ir.BinaryOp)
def _binary_rule(d: Deriver, e: ir.BinaryOp, needs) -> None:
    g = d.cotangent(e.out)
    lhs, rhs = e.lhs, e.rhs
    if e.kind not in ("add", "sub", "mul", "div"):
        raise NoTransposeRuleError(no_rule(e, f"hostir has no backward rule for {e.kind}"))
    if wants(d, lhs, needs):
        if e.kind in ("add", "sub"):
            gl = g
        elif e.kind == "mul":
            gl = builders.binary("mul", g, d.save(rhs))
        else:
            gl = builders.binary("div", g, d.save(rhs))
        d.contribute(lhs, d.made(_unbroadcast(d, gl, lhs)))
    if wants(d, rhs, needs):
        if e.kind == "add":
            gr = g
        elif e.kind == "sub":
            gr = builders.unary("neg", g)
        elif e.kind == "mul":
            gr = builders.binary("mul", g, d.save(lhs))
        else:
            # torch: -grad * self / (other * other)
            r = d.save(rhs)
            gr = builders.unary(
                "neg", builders.binary("div", builders.binary("mul", g, d.save(lhs)), builders.binary("mul", r, r))
            )
        d.contribute(rhs, d.made(_unbroadcast(d, gr, rhs)))


@rule(ir.ReductionOp)
def _reduction_rule(d: Deriver, e: ir.ReductionOp, needs) -> None:
    g = d.cotangent(e.out)
    if not wants(d, e.input, needs):
        return
    dims = [k for k, a in enumerate(e.out.logical) if a.is_reduction]
    if e.kind == "sum":
        d.contribute(e.input, d.made(_emit_expand(g, d.shaped_like(e.input), dims)))
        return
    x = d.save(e.input)
    # amax / amin: the gradient shared equally by the elements equal to the
    # result, as torch computes it.
    y = _emit_expand(d.save(e.out), x, dims)
    mask = builders.binary("eq", x, y)
    count = builders.reduction("sum", mask, dims)
    share = _emit_expand(builders.binary("div", g, count), x, dims)
    d.contribute(e.input, d.made(builders.binary("mul", share, mask)))


def _swap_last(n: int) -> list[int]:
    return list(range(n - 2)) + [n - 1, n - 2]


@rule(ir.MatmulOp)
def _matmul_rule(d: Deriver, e: ir.MatmulOp, needs) -> None:
    g = d.cotangent(e.out)
    a, b = e.a, e.b
    na, nb, ng = a.logical_ndim, b.logical_ndim, e.out.logical_ndim
    if wants(d, a, needs):
        bs = d.save(b)
        if nb == 2:
            gg, bs = d.contraction_ready(g, [ng - 1], bs, [1])
            ga = builders.linear(gg, bs)
        else:
            bt = d.permute(bs, _swap_last(nb))
            gg, bt = d.contraction_ready(g, [ng - 1], bt, [nb - 2])
            ga = builders.matmul(gg, bt)
        d.contribute(a, d.made(_unbroadcast(d, ga, a)))
    if wants(d, b, needs):
        # b the transpose of a weight w (x @ w^T, as layers keep [N, K]
        # weights): w's gradient is g^T a, made in w's own layout, rather
        # than (a^T g) transposed back by the permute's rule, a view whose
        # copy into w's layout would cost a pass over the weight.
        w = _transposed_from(d, b, needs)
        if w is not None:
            at = d.save(a, contracted=[na - 2])
            gt = d.permute(g, _swap_last(ng))
            gt, at = d.contraction_ready(gt, [ng - 1], at, [na - 2])
            target, gb = w, builders.matmul(gt, at)
        else:
            at = d.save_permuted(a, _swap_last(na))
            at, gg = d.contraction_ready(at, [na - 1], g, [ng - 2])
            target, gb = b, builders.matmul(at, gg)
        if nb == 2 and ng > 2:
            gb = builders.reduction("sum", gb, list(range(ng - 2)))
        else:
            gb = _unbroadcast(d, gb, target)
        d.contribute(target, d.made(gb))


def _transposed_from(d: Deriver, b: ir.TensorView, needs) -> ir.TensorView | None:
    """The tensor `b` transposes (a permute of its last two axes, whose
    input wants a gradient), else None. The matmul's share of the gradient
    then goes to that tensor directly; any other reader of `b` still
    contributes to `b`, which the permute's rule passes on."""
    e = d.producer.get(b)
    if not isinstance(e, ir.PermuteOp) or b.logical_ndim < 2 or list(e.dims) != _swap_last(b.logical_ndim):
        return None
    return e.input if wants(d, e.input, needs) else None


@rule(ir.LinearOp)
def _linear_rule(d: Deriver, e: ir.LinearOp, needs) -> None:
    g = d.cotangent(e.out)
    x, w, bias = e.input, e.weight, e.bias
    n = x.logical_ndim
    if n < 2:
        raise NoTransposeRuleError(no_rule(e, "the backward of a linear needs an input of at least 2 axes"))
    lead = list(range(n - 1))
    # A gradient sharded on the rows where the weight is sharded on K (the
    # backward of a GEMM+ReduceScatter layer) is gathered once, for both
    # products; walking the rows where the forward walked them.
    walked = None
    lg = d.known.get(g)
    if lg is not None:
        rows = set().union(*(lg.device_types(i) for i in lead))
        if rows & (d.layout(w).device_types(1) | d.layout(x).device_types(n - 1)):
            g, walked = d.gathered_walking(g, lead, x)
    xs = None
    if wants(d, x, needs):
        ws = d.save(w)
        gx = d.walking(g, e.out, x, [(k, k) for k in lead])
        if gx is not g and wants(d, w, needs):
            # The weight gradient's operand first: a re-gather is then
            # posted before the input gradient's ring and runs under it.
            xs = d.save(x, contracted=[n - 2])
        gg, ws = d.contraction_ready(gx, [n - 1], ws, [0])
        gx = d.made(builders.matmul(gg, ws))
        if walked is not None:
            gx = d.place(gx, walked)
        d.contribute(x, gx)
    if wants(d, w, needs):
        if xs is None:
            xs = d.save(x, contracted=[n - 2])
        gt = d.permute(g, list(range(1, n)) + [0]) if n == 2 else d.permute(g, _swap_last(n))
        if n == 2:
            gt, xs = d.contraction_ready(gt, [1], xs, [0])
            gw = builders.matmul(gt, xs)
        else:
            gt, xs = d.contraction_ready(gt, [n - 1], xs, [n - 2])
            gw = builders.reduction("sum", builders.matmul(gt, xs), list(range(n - 2)))
        d.contribute(w, d.made(gw))
    if bias is not None and wants(d, bias, needs):
        d.contribute(bias, d.made(builders.reduction("sum", g, lead)))


@rule(ir.BroadcastInDimOp)
def _broadcast_in_dim_rule(d: Deriver, e: ir.BroadcastInDimOp, needs) -> None:
    g = d.cotangent(e.out)
    if not wants(d, e.input, needs):
        return
    out_axes = e.out.logical_runtime()
    x_axes = e.input.logical_runtime()
    new = [k for k in range(len(out_axes)) if k not in e.dims]
    # Input axes of size 1 that the op grew: summed, and kept as size 1.
    grown = [i for i, a in enumerate(x_axes) if a.is_broadcast and not out_axes[e.dims[i]].is_broadcast]
    summed = sorted(new + [e.dims[i] for i in grown])
    gx = builders.reduction("sum", g, summed) if summed else builders.set_(g)
    if grown:
        gx = _emit_expand(gx, d.shaped_like(e.input), grown)
    d.contribute(e.input, d.made(gx))


@rule(ir.PermuteOp)
def _permute_rule(d: Deriver, e: ir.PermuteOp, needs) -> None:
    g = d.cotangent(e.out)
    if not wants(d, e.input, needs):
        return
    inverse = [0] * len(e.dims)
    for i, p in enumerate(e.dims):
        inverse[p] = i
    d.contribute(e.input, d.made(shape_ops.permute(g, inverse)))


@rule(ir.ReshapeOp)
def _reshape_rule(d: Deriver, e: ir.ReshapeOp, needs) -> None:
    g = d.cotangent(e.out)
    if not wants(d, e.input, needs):
        return
    extents = [a.extent for a in e.input.logical_runtime()]
    symbolic = [k for k, x in enumerate(extents) if not x.is_constant]
    if len(symbolic) > 1:
        raise NoTransposeRuleError(
            no_rule(e, f"T{e.input.name} has {len(symbolic)} symbolic sizes; reshaping back names all but one")
        )
    shape = [-1 if not x.is_constant else x.value for x in extents]
    d.contribute(e.input, d.made(shape_ops.reshape(g, shape)))


@rule(ir.SliceOp)
def _slice_rule(d: Deriver, e: ir.SliceOp, needs) -> None:
    g = d.cotangent(e.out)
    if not wants(d, e.input, needs):
        return
    tiles = _tiles(d, e.input)
    if tiles is not None:
        # One of slices that tile an axis (a fused weight cut into gate
        # and up, or q, k and v): the cotangents wait for each other, to be
        # joined by a cat when the input's cotangent is asked for.
        held = d.tiles.setdefault(e.input, {})
        held[e] = g
        d.pending[e.input] = lambda: _join_tiles(d, e.input, tiles)
        return
    _insert(d, e, g)


def _insert(d: Deriver, e: ir.SliceOp, g: ir.TensorView) -> None:
    like = d.shaped_like(e.input)
    out = ir.TensorView(d.bwd, [a.clone(d.bwd) for a in like.logical_runtime()], g.dtype)
    d.bwd.add_expr(ir.InsertOp(out, g, like, ranges=e.ranges))
    d.contribute(e.input, d.made(out))


def _tiles(d: Deriver, x: ir.TensorView) -> tuple[int, list] | None:
    """`(axis, slices)` where the forward's slices of `x` cut one axis into
    adjacent parts from its start to its end (steps 1, every other axis
    whole), in order along it; else None."""
    slices = [u for u in d.fwd.exprs if isinstance(u, ir.SliceOp) and u.input is x]
    if len(slices) < 2:
        return None
    whole = (0, None, 1)
    cut = {k for u in slices for k, r in enumerate(u.ranges) if r != whole}
    if len(cut) != 1:
        return None
    (axis,) = cut
    slices.sort(key=lambda u: u.ranges[axis][0])
    extent = x.logical_runtime()[axis].extent
    end = 0
    for u in slices:
        start, stop, step = u.ranges[axis]
        if step != 1 or start != end or end is None:
            return None
        end = stop
    if end is not None and not (extent.is_constant and end == extent.value):
        return None
    return axis, slices


def _join_tiles(d: Deriver, x: ir.TensorView, tiles) -> None:
    """The held cotangents of `x`'s tiling slices as one: their cat along
    the cut axis where every part has one, else each part inserted into
    zeros (as a lone slice's)."""
    axis, slices = tiles
    held = d.tiles.pop(x, {})
    parts = [held.get(u) for u in slices]
    if any(p is None for p in parts):
        for u in slices:
            if held.get(u) is not None:
                _insert(d, u, held[u])
        return
    parts = [p if p.dtype == x.dtype else d.made(builders.unary("cast", p, x.dtype)) for p in parts]
    d.contribute(x, d.made(shape_ops.cat(parts, axis)))


@rule(ir.CatOp)
def _cat_rule(d: Deriver, e: ir.CatOp, needs) -> None:
    g = d.cotangent(e.out)
    extent = e.input.logical_runtime()[e.dim].extent
    if not extent.is_constant:
        raise NoTransposeRuleError(no_rule(e, f"T{e.input.name}'s axis {e.dim} has a symbolic size"))
    n = g.logical_ndim
    for part, start, stop in ((e.input, 0, extent.value), (e.other, extent.value, None)):
        if wants(d, part, needs):
            starts = [start if k == e.dim else 0 for k in range(n)]
            stops = [stop if k == e.dim else None for k in range(n)]
            d.contribute(part, d.made(shape_ops.slice_(g, starts, stops)))


@rule(ir.SelectOp)
def _select_rule(d: Deriver, e: ir.SelectOp, needs) -> None:
    g = d.cotangent(e.out)
    if not wants(d, e.input, needs):
        return
    like = d.shaped_like(e.input)
    index = d.scalar(e.index)
    if not isinstance(index, ir.Scalar):
        index = ir.Scalar.constant(index)
    out = ir.TensorView(d.bwd, [a.clone(d.bwd) for a in like.logical_runtime()], g.dtype)
    d.bwd.add_expr(ir.InsertOp(out, g, like, dim=e.dim, index=index))
    d.contribute(e.input, d.made(out))


@rule(ir.TopKOp)
@rule(ir.RouteOp)
def _integer_rule(d: Deriver, e, needs) -> None:
    # Positions and slots: integers, through which no gradient flows.
    d.contribs.pop(e.out, None)


@rule(ir.GroupedMmOp)
def _grouped_mm_rule(d: Deriver, e: ir.GroupedMmOp, needs) -> None:
    # y = x w_g^T per group: dx = dy w_g (the weight's last two axes
    # swapped), dw_g = dy_g^T x_g (summed over the batch the weight lacks).
    g = d.cotangent(e.out)
    counts = d.save(e.counts)
    if wants(d, e.input, needs):
        nw = e.weight.logical_ndim
        wt = d.permute(d.save(e.weight), list(range(nw - 2)) + [nw - 1, nw - 2])
        d.contribute(e.input, d.made(index_ops.grouped_mm(g, wt, counts)))
    if wants(d, e.weight, needs):
        gw = index_ops.grouped_outer(g, d.save(e.input), counts, e.weight.logical_ndim - 3)
        d.contribute(e.weight, d.made(gw))


@rule(ir.GroupedOuterOp)
def _grouped_outer_rule(d: Deriver, e: ir.GroupedOuterOp, needs) -> None:
    # o_g = a_g^T b_g: da = b o_g^T, db = a o_g, as grouped GEMMs.
    g = d.cotangent(e.out)
    counts = d.save(e.counts)
    if wants(d, e.input, needs):
        d.contribute(e.input, d.made(index_ops.grouped_mm(d.save(e.other), g, counts)))
    if wants(d, e.other, needs):
        n = g.logical_ndim
        gt = d.permute(g, list(range(n - 2)) + [n - 1, n - 2])
        d.contribute(e.other, d.made(index_ops.grouped_mm(d.save(e.input), gt, counts)))


@rule(ir.TakeOp)
def _take_rule(d: Deriver, e: ir.TakeOp, needs) -> None:
    g = d.cotangent(e.out)
    if not wants(d, e.input, needs):
        return
    if e.inverse is not None:
        # Each row gathers the picks that read it, and sums them: no
        # colliding adds (and the sum accumulates in float32).
        picked = d.made(index_ops.take(g, d.save(e.inverse), e.batch, e.features))
        gx = builders.reduction("sum", picked, [e.inverse.logical_ndim - 1])
    else:
        # A route's slots name each row at most once: the rows are written.
        made = d.producer.get(e.index)
        distinct = isinstance(made, ir.RouteOp) and made.what == "slot" and e.index.logical_ndim == e.batch + 2
        gx = index_ops.put_add(g, d.save(e.index), d.shaped_like(e.input), e.batch, e.features, distinct)
    d.contribute(e.input, d.made(gx))


@rule(ir.PutAddOp)
def _put_add_rule(d: Deriver, e: ir.PutAddOp, needs) -> None:
    g = d.cotangent(e.out)
    if not wants(d, e.input, needs):
        return
    d.contribute(e.input, d.made(index_ops.take(g, d.save(e.index), e.batch, e.features)))
