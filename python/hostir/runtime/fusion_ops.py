"""The evaluator's handlers of the fusion ops (`ir.FUSION_OPS`): a copy,
the elementwise, reduction and product ops, broadcasts, and the shape ops,
each run with torch on this rank's piece of its tensors.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hostir import ir, layout
from hostir.kinds import ReductionKind
from hostir.runtime.frame import BindingError, Frame, ShapeError, impl


# ---------------------------------------------------------------- local layouts
#
# A rank holds each tensor in its loop layout (a split axis as its pieces,
# a sharded piece with size 1). Compute ops run torch on the logical layout
# (one dim per logical axis, of this rank's size) and put the result back
# in the output's loop layout; both are views of the same memory. An
# operand axis replicated where the output is sharded is first cut to this
# rank's slice.


def _local_slices(e: ir.Expr, source: dict) -> dict[int, list]:
    """operand id -> [(position, output axis, operand axis)] to slice. In
    a loop body the op's slices are read as the whole tensors they come
    from (`source`: slice -> what it slices), so positions count the axis
    a select removed."""
    if isinstance(e, ir.Set):
        return {}
    back: dict[int, ir.TensorView] = {}
    fields = {}
    for f in e.INPUTS + e.OUTPUTS:
        v = getattr(e, f)
        if not isinstance(v, ir.TensorView):
            continue
        w = v
        while w in source:
            w = source[w]
        if w is not v:
            fields[f] = w
        back.setdefault(id(w), v)
    partial = getattr(e, "partial", None)
    if fields and (partial is not None or getattr(e, "accumulate", False)):
        # A chunk of partial sums, or a product a reduce ring adds into
        # this rank's piece of its result: the decomposition already cut
        # its operands.
        return {}
    whole = e.replace(**fields) if fields else e
    found: dict[int, list] = {}
    for o, i in whole.id_pairs():
        if o.is_reduction and partial is None:
            continue
        missing = layout.device_types(o) - layout.device_types(i)
        if not missing or i.is_broadcast:
            # A broadcast operand axis is the same size-1 dim on every rank.
            continue
        for v in whole.inputs():
            if isinstance(v, ir.TensorView) and i in v.logical:
                found.setdefault(id(back[id(v)]), []).append((v.logical_runtime().index(i), o, i))
    return found


def _operand(frame: Frame, e, tv, full_rank: bool = False):
    """Operand `tv` of `e` in logical layout, cut to this rank's slice
    where `e`'s output is sharded and `tv` is not."""
    t = frame.get(tv)
    if not isinstance(tv, ir.TensorView):
        return t
    cuts = frame.evaluator.local_slices.get(id(e), {}).get(id(tv), ())
    removed = frame.evaluator.slice_dim.get(tv)
    if removed is not None:
        # A slice a stream loop selected: at full rank its dims are the
        # whole tensor's; without, the selected one is gone.
        if full_rank:
            t = frame.full_rank(tv, t)
        else:
            cuts = [(pos - (pos > removed), o, i) for pos, o, i in cuts if pos != removed]
    else:
        t = frame.evaluator.layouts.to_logical(tv, t)
    for pos, o, i in cuts:
        mesh = e.out.mesh
        missing = layout.device_types(o) - layout.device_types(i)
        sizes = layout.leaf_sizes(o.loop_leaves(), t.shape[pos], mesh, missing)
        pieces = t.reshape(list(t.shape[:pos]) + sizes + list(t.shape[pos + 1 :]))
        for j, x in enumerate(o.loop_leaves()):
            if x.parallel_type in missing:
                pieces = pieces.narrow(pos + j, mesh.index_along(frame.communicator.rank, x.parallel_type), 1)
        t = pieces.reshape(list(t.shape[:pos]) + [-1] + list(t.shape[pos + 1 :]))
    return t


def _store(
    frame: Frame, e, fresh: Callable[[], torch.Tensor], into: Callable[[torch.Tensor], Any], full_rank=False
) -> None:
    """Bind `fresh()`'s result to `e.out` in its loop layout, or, if `e.out`
    is bound, run `into(view)` on its logical view."""
    tv = e.out
    partial = getattr(e, "partial", None)
    if tv in frame.evaluator.slice_dim:
        out, bind_fresh = _full_rank_out(frame, e) if full_rank else (frame.get(tv, None), lambda r: frame.bind(tv, r))
        if out is None:
            bind_fresh(fresh())
        elif partial is None:
            into(out)
        else:
            # A chunk of partial sums: the slice keeps the partial and the
            # sharded pieces as size-1 dims where the operands put them.
            _copy_same_sizes(out, fresh())
        return
    out = frame.get(tv, None)
    if out is None:
        result = fresh()
        if partial is not None:
            result = result.unsqueeze(0)
        frame.bind(tv, frame.evaluator.layouts.to_runtime(tv, result))
        return
    view = frame.evaluator.layouts.to_logical(tv, out)
    into(view.squeeze(0) if partial is not None else view)


def _copy_same_sizes(out: torch.Tensor, result: torch.Tensor) -> None:
    """Copy `result` into `out`, which holds the same sizes but for dims of
    size 1."""
    if [s for s in out.shape if s != 1] != [s for s in result.shape if s != 1]:
        raise BindingError(f"a result of shape {list(result.shape)} does not fit its buffer of shape {list(out.shape)}")
    out.copy_(result.reshape(out.shape))


@impl(ir.Set)
def _set(frame: Frame, e: ir.Set) -> None:
    src = frame.get(e.input)
    out = frame.get(e.out, None)
    if out is None:
        frame.bind(e.out, src.clone(memory_format=torch.contiguous_format))
    else:
        out.copy_(src)


@impl(ir.UnaryOp)
def _unary(frame: Frame, e: ir.UnaryOp) -> None:
    x = _operand(frame, e, e.input)
    fn = e.kind.torch_fn
    if fn is None:  # cast
        _store(frame, e, lambda: x.to(e.out.dtype), lambda out: out.copy_(x))
        return
    _store(frame, e, lambda: fn(x), lambda out: out.copy_(fn(x)))


@impl(ir.BinaryOp)
def _binary(frame: Frame, e: ir.BinaryOp) -> None:
    fn = e.kind.torch_fn
    lhs, rhs = _operand(frame, e, e.lhs), _operand(frame, e, e.rhs)
    if not isinstance(lhs, torch.Tensor):
        # torch takes a number only on the right; a 0-d tensor of the
        # number's default dtype promotes the same way. (A meta operand, in a
        # dry run, cannot mix with a CPU tensor.)
        lhs = torch.tensor(lhs, device="meta" if rhs.device.type == "meta" else None)
    _store(frame, e, lambda: fn(lhs, rhs), lambda out: fn(lhs, rhs, out=out))


def sums_that_view(container) -> frozenset[int]:
    """The ids of the sums in `container` that may bind their input's view
    when every axis they reduce has extent 1 at run time: the input is a
    product the program makes fresh (a matmul's or linear's output that no
    Allocate, alias or accumulating op holds), so that nothing else sees or
    writes its memory. The weight gradient of a linear on a [1, T, H]
    activation (a batch of one, sequence parallelism) is such a sum: a copy
    of the whole gradient, where its view costs nothing."""
    resolve = container.aliases.resolve
    held = {resolve(tv) for tv in container.inputs + container.outputs}
    made: dict = {}
    for e in container.walk():
        if isinstance(e, ir.Allocate):
            held.add(resolve(e.buffer))
        for tv in e.outputs():
            key = resolve(tv)
            made[key] = made.get(key, 0) + 1
            if not isinstance(e, (ir.MatmulOp, ir.LinearOp)) or e.accumulate or tv is not key:
                held.add(key)
    return frozenset(
        id(e)
        for e in container.walk()
        if isinstance(e, ir.ReductionOp)
        and e.kind is ReductionKind.sum
        and e.input is resolve(e.input)
        and made.get(e.input) == 1
        and e.input not in held
    )


@dataclass(frozen=True)
class SummedProducts:
    """Matmuls whose product only a sum over its batch axes reads: each runs
    as that sum, one batched GEMM per summed index accumulating into the
    sum's output (`sum_of_products`), so the product is never made whole
    and no pass over it sums it. `sums`: matmul id -> its sum; `skipped`:
    the ids of those sums and of the product's Deallocates, which have
    nothing left to do."""

    sums: dict[int, ir.ReductionOp]
    skipped: frozenset[int]


def summed_products(container) -> SummedProducts:
    """The matmul/sum pairs of `container` that run as one: a matmul (not
    accumulating, whole) whose output is made there, read by nothing but a
    sum of the same dtype over batch axes of the product that follows it in
    the same scope with only Deallocates between (so its output is written
    where it would have been). A weight's gradient of a batched product
    broadcast over a source axis, summed over the sources, is one."""
    resolve = container.aliases.resolve
    held = {resolve(tv) for tv in container.inputs + container.outputs}
    source = {e.out: e.input for e in container.walk() if isinstance(e, (ir.HirAliasSelect, ir.HirAliasChunk))}
    multi_device = bool(container.meshes())
    readers: dict = {}
    made: dict = {}
    freed: dict = {}
    for e in container.walk():
        if isinstance(e, ir.Allocate):
            held.add(resolve(e.buffer))
        for tv in e.outputs():
            made[resolve(tv)] = made.get(resolve(tv), 0) + 1
        if isinstance(e, ir.Deallocate):
            freed.setdefault(e.buffer, []).append(id(e))
            continue
        for v in e.inputs():
            if isinstance(v, ir.TensorView):
                readers.setdefault(resolve(v), []).append(e)
    sums: dict[int, ir.ReductionOp] = {}
    skipped: set[int] = set()
    scopes = [container.exprs] + [body for e in container.walk() for body in ir.bodies(e)]
    for scope in scopes:
        for i, m in enumerate(scope):
            if not isinstance(m, ir.MatmulOp) or m.accumulate or m.partial is not None:
                continue
            product = m.out
            if resolve(product) is not product or product in held or product in source or made.get(product) != 1:
                continue
            r = next((x for x in scope[i + 1 :] if not isinstance(x, ir.Deallocate)), None)
            if not (
                isinstance(r, ir.ReductionOp)
                and r.kind is ReductionKind.sum
                and r.input is product
                and [id(x) for x in readers.get(product, ())] == [id(r)]
                and r.out.dtype == product.dtype
                and getattr(r, "partial", None) is None
                and r.out not in source
                and not (multi_device and _local_slices(r, source))
            ):
                continue
            dims = [k for k, d in enumerate(r.out.logical) if d.is_reduction]
            batch = len(product.logical_runtime()) - 2
            if not dims or any(k >= batch for k in dims):
                continue
            sums[id(m)] = r
            skipped.add(id(r))
            skipped.update(freed.get(product, ()))
    return SummedProducts(sums, frozenset(skipped))


def _records_grad(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether autograd records an op on `a` and `b` (an out= op refuses
    them): torch's own op then, as a direct evaluator run with grad on."""
    return torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)


def sum_of_products(a: torch.Tensor, b: torch.Tensor, dims: list[int], dtype: torch.dtype) -> torch.Tensor:
    """`torch.matmul(a, b).sum(dims, dtype=dtype)` for `dims` among the
    product's batch dims, without the product: the summed batch indices
    walked in turn, each a batched GEMM into the result (beta = 1 after the
    first). Over summed dims of extent 1, the product's view. Operands that
    are not batched matrices, or a dtype that is not theirs, take torch's
    two steps. The C++ executor's `sumOfProducts` does the same."""
    if a.dim() < 2 or b.dim() < 2 or dtype != a.dtype or dtype != b.dtype or _records_grad(a, b):
        return torch.matmul(a, b).sum(dims, dtype=dtype)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    if not dims or any(d >= len(batch) for d in dims):
        return torch.matmul(a, b).sum(dims, dtype=dtype)
    if all(batch[d] == 1 for d in dims):
        return torch.matmul(a, b).squeeze(dims)
    keep = [d for d in range(len(batch)) if d not in dims]
    order = [*dims, *keep, len(batch), len(batch) + 1]
    summed = math.prod(batch[d] for d in dims)
    kept = math.prod(batch[d] for d in keep)
    a3 = a.expand(*batch, *a.shape[-2:]).permute(order).reshape(summed, kept, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).permute(order).reshape(summed, kept, *b.shape[-2:])
    out = a.new_empty(*[batch[d] for d in keep], a.shape[-2], b.shape[-1])
    rows = out.view(kept, a.shape[-2], b.shape[-1])
    torch.bmm(a3[0], b3[0], out=rows)
    for i in range(1, summed):
        rows.baddbmm_(a3[i], b3[i])
    return out


# The least elements of an operand shared across leading batch dims for
# `matmul_unexpanded` to walk them: below it, torch's one call and its copy
# of the operand cost less than a call per index. The C++ executor's
# kUnexpandedMin is the same.
UNEXPANDED_MIN = 1 << 18
# The most leading indices it walks (a call each).
UNEXPANDED_MAX_CALLS = 64


def matmul_unexpanded(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.matmul(a, b)` (into `out` if given), but where one operand is
    broadcast over leading batch dims that the other holds (the experts'
    weights beside tokens from every source rank), one matmul per leading
    index with the shared operand as it is: torch's matmul copies it once
    per index to make one batched GEMM (`expand(...).reshape(...)`), which
    for a layer's weights costs more than the GEMMs' extra launches. The
    C++ executor's `matmulUnexpanded` does the same."""
    if a.dim() < 3 or b.dim() < 3 or _records_grad(a, b):
        return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)
    batch = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    n = len(batch)
    a_batch = (1,) * (n + 2 - a.dim()) + tuple(a.shape[:-2])
    b_batch = (1,) * (n + 2 - b.dim()) + tuple(b.shape[:-2])
    lead, shared = 0, None
    while lead < n and a_batch[lead] != b_batch[lead]:
        side = b if b_batch[lead] == 1 else a
        if shared is not None and side is not shared:
            break
        shared, lead = side, lead + 1
    calls = math.prod(batch[:lead])
    shape = (*batch, a.shape[-2], b.shape[-1])
    if (
        shared is None
        or a_batch[lead:] != b_batch[lead:]
        or calls > UNEXPANDED_MAX_CALLS
        or shared.numel() < UNEXPANDED_MIN
        or (out is not None and tuple(out.shape) != shape)
    ):
        return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)
    # The shared operand without its leading dims (each of size 1).
    one = shared.reshape((a_batch if shared is a else b_batch) + tuple(shared.shape[-2:]))[(0,) * lead]
    if out is None:
        out = a.new_empty(shape, dtype=torch.promote_types(a.dtype, b.dtype))
    for index in itertools.product(*(range(size) for size in batch[:lead])):
        if shared is b:
            torch.matmul(a[index], one, out=out[index])
        else:
            torch.matmul(one, b[index], out=out[index])
    return out


@impl(ir.ReductionOp)
def _reduction(frame: Frame, e: ir.ReductionOp) -> None:
    if id(e) in frame.evaluator.summed_products.skipped:
        return  # made by its matmul
    src = _operand(frame, e, e.input)
    dims = [i for i, d in enumerate(e.out.logical) if d.is_reduction]

    fn, dtype = e.kind.torch_fn, e.out.dtype

    def run(**out):
        return fn(src, dims, dtype=dtype, **out)

    fresh = run
    if id(e) in frame.evaluator.sums_that_view and src.dtype == dtype and all(src.shape[d] == 1 for d in dims):
        # A sum over axes of extent 1 of a product made here: its view.
        def fresh():
            return src.squeeze(dims)

    _store(frame, e, fresh, lambda out: run(out=out))


def _full_rank_out(frame: Frame, e) -> tuple[torch.Tensor | None, Callable]:
    """The bound output at full rank (or None) and how to bind a fresh one."""
    out = frame.get(e.out, None)
    dim = frame.evaluator.slice_dim.get(e.out)

    def bind_fresh(result: torch.Tensor) -> None:
        frame.bind(e.out, result if dim is None else result.squeeze(dim))

    return (None if out is None else frame.full_rank(e.out, out)), bind_fresh


@impl(ir.MatmulOp)
def _matmul(frame: Frame, e: ir.MatmulOp) -> None:
    a = _operand(frame, e, e.a, full_rank=True)
    b = _operand(frame, e, e.b, full_rank=True)
    if e.accumulate:
        _accumulate(frame, e, a, b)
        return
    total = frame.evaluator.summed_products.sums.get(id(e))
    if total is not None:
        dims = [k for k, d in enumerate(total.out.logical) if d.is_reduction]
        fresh = lambda: sum_of_products(a, b, dims, total.out.dtype)  # noqa: E731
        _store(frame, total, fresh, lambda out: out.copy_(fresh()))
        return
    _store(frame, e, lambda: matmul_unexpanded(a, b), lambda out: matmul_unexpanded(a, b, out), full_rank=True)


def _accumulate(frame: Frame, e, a: torch.Tensor, b: torch.Tensor) -> None:
    """`out += a @ b` on the bound output, which holds the product's
    elements in its order (its runtime layout may add size-1 dims): with a
    2-D `b`, one GEMM with beta = 1 (`a`'s leading dims folded into its
    rows, as torch.matmul folds them), the sum rounded once. The C++
    executor's `matmulOrLinear` does the same."""
    out = frame.get(e.out, None)
    if out is None:
        raise BindingError(f"T{e.out.name} must be bound before an op adds its product to it")
    if b.dim() == 2:
        rows = a.reshape(-1, a.shape[-1])
        if out.numel() != rows.shape[0] * b.shape[1]:
            raise BindingError(
                f"a product of shape {[rows.shape[0], b.shape[1]]} does not fit T{e.out.name} of shape {list(out.shape)}"
            )
        out.view(rows.shape[0], b.shape[1]).addmm_(rows, b)
        return
    product = torch.matmul(a, b)
    if product.numel() != out.numel():
        raise BindingError(
            f"a product of shape {list(product.shape)} does not fit T{e.out.name} of shape {list(out.shape)}"
        )
    out.add_(product.view(out.shape))


@impl(ir.LinearOp)
def _linear(frame: Frame, e: ir.LinearOp) -> None:
    x = _operand(frame, e, e.input, full_rank=True)
    w = _operand(frame, e, e.weight, full_rank=True)
    bias = None if e.bias is None else _operand(frame, e, e.bias, full_rank=True)
    if e.accumulate:
        if bias is not None or w.dim() > 2:
            raise BindingError(f"a linear that accumulates into T{e.out.name} takes a 2-D weight and no bias")
        _accumulate(frame, e, x, w.t())
        return
    if w.dim() > 2:
        # A weight [*W, N, K]: torch's linear on [W*N, K], unflattened.
        fresh = lambda: linear_nd(x, w, bias)  # noqa: E731
        _store(frame, e, fresh, lambda out: out.copy_(fresh()), full_rank=True)
        return
    _store(
        frame,
        e,
        lambda: torch.nn.functional.linear(x, w, bias),
        lambda out: torch.ops.aten.linear.out(x, w, bias, out=out),
        full_rank=True,
    )


def linear_nd(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear` with a weight [*W, N, K]: out [..., *W, N]; the bias is
    [*W, N] or any trailing part of it."""
    lead = w.shape[:-1]
    if bias is not None:
        bias = bias.expand(lead).reshape(-1)
    return torch.nn.functional.linear(x, w.reshape(-1, w.shape[-1]), bias).unflatten(-1, lead)


def _copy_out(frame: Frame, e, result: torch.Tensor, source: torch.Tensor) -> None:
    """Write `result` (full rank) into the bound output, or bind a copy of
    it that shares no memory with `source`."""
    out, bind_fresh = _full_rank_out(frame, e)
    if out is not None:
        out.copy_(result)
        return
    if result.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        result = result.clone(memory_format=torch.contiguous_format)
    bind_fresh(result)


@impl(ir.BroadcastInDimOp)
def _broadcast_in_dim(frame: Frame, e: ir.BroadcastInDimOp) -> None:
    src = _operand(frame, e, e.input, full_rank=True)
    axes = e.out.logical_runtime()
    # In a stream loop `out` is a slice without the walked axis; `dims`
    # count it.
    sliced = e.out in frame.evaluator.slice_dim
    placed = [1] * (len(axes) + sliced)
    for i, d in enumerate(e.dims):
        placed[d] = src.shape[i]
    if not sliced:
        _check_kept_sizes(e, src)
    view = src.reshape(placed)
    out, bind_fresh = _full_rank_out(frame, e)
    if out is not None:
        # The bound output (a chunk in a stream loop) takes the broadcast.
        out.copy_(view)
        return
    sizes = []
    for j, (d, size) in enumerate(zip(axes, placed)):
        grows = size == 1 and not d.is_broadcast
        sizes.append(layout.local_extent(d) if grows else size)
        if sizes[-1] is None:
            raise ShapeError(f"axis {j} of T{e.out.name} has no fixed size to grow to")
    bind_fresh(view.expand(sizes).clone(memory_format=torch.contiguous_format))


def _check_kept_sizes(e: ir.BroadcastInDimOp, src: torch.Tensor) -> None:
    """A kept axis given a fixed size must have it (across ranks)."""
    out = e.out.logical_runtime()
    for i, (d, j) in enumerate(zip(e.input.logical_runtime(), e.dims)):
        o = out[j]
        if d.is_broadcast or o.is_broadcast or not o.extent.is_constant or src.shape[i] == 0:
            continue
        whole = src.shape[i] * layout.shard_count(e.input.mesh, d)
        if whole != o.extent.value:
            raise ShapeError(
                f"broadcast_in_dim: axis {i} of T{e.input.name} has size {whole}, but output axis {j} "
                f"is {o.extent.value}; only a size-1 axis grows"
            )


def _view_out(frame: Frame, e, result: torch.Tensor) -> None:
    """Write `result` into the bound output, or bind it as it is: a view
    of the operand where torch made one (permute always, reshape where the
    strides allow), as torch's own ops return."""
    out, bind_fresh = _full_rank_out(frame, e)
    if out is not None:
        out.copy_(result)
        return
    bind_fresh(result)


@impl(ir.PermuteOp)
def _permute(frame: Frame, e: ir.PermuteOp) -> None:
    if e.input.device_axes() or e.out.device_axes():
        # This rank's piece, permuted: its sharded axes move with it. A
        # view, as without device axes: its runtime dims only add size-1
        # dims (the rank's index of a sharded axis) and split a dim, which
        # any strides allow.
        layouts = frame.evaluator.layouts
        src = layouts.to_logical(e.input, frame.get(e.input))
        result = layouts.to_runtime(e.out, src.permute(e.dims))
        out = frame.get(e.out, None)
        if out is None:
            frame.bind(e.out, result)
        else:
            out.copy_(result)
        return
    src = frame.full_rank(e.input, frame.get(e.input))
    _view_out(frame, e, src.permute(e.dims))


@impl(ir.ExpandOp)
def _expand(frame: Frame, e: ir.ExpandOp) -> None:
    # At full rank: inside a stream loop the dims `dims` counts are those of
    # the whole tensors, a selected slice's dim put back as size 1.
    src = _operand(frame, e, e.input, full_rank=True)
    like = _operand(frame, e, e.like, full_rank=True)
    for d in sorted(e.dims):
        src = src.unsqueeze(d)

    def run():
        return src.expand(like.shape).contiguous()

    _store(frame, e, run, lambda out: out.copy_(src.expand(like.shape)), full_rank=True)


@impl(ir.InsertOp)
def _insert(frame: Frame, e: ir.InsertOp) -> None:
    src = _operand(frame, e, e.input, full_rank=True)
    like = _operand(frame, e, e.like, full_rank=True)

    def run():
        out = torch.zeros(like.shape, dtype=e.out.dtype, device=like.device)
        fill(out)
        return out

    def fill(out):
        if e.ranges is not None:
            out[tuple(slice(start, stop, step) for start, stop, step in e.ranges)] = src
        else:
            out.select(e.dim, int(frame.get(e.index))).copy_(src)

    def into(out):
        out.zero_()
        fill(out)

    _store(frame, e, run, into, full_rank=True)


@impl(ir.CatOp)
def _cat(frame: Frame, e: ir.CatOp) -> None:
    a = _operand(frame, e, e.input, full_rank=True)
    b = _operand(frame, e, e.other, full_rank=True)

    def into(out):
        out.narrow(e.dim, 0, a.shape[e.dim]).copy_(a)
        out.narrow(e.dim, a.shape[e.dim], b.shape[e.dim]).copy_(b)

    _store(frame, e, lambda: torch.cat([a, b], e.dim), into, full_rank=True)


@impl(ir.ReshapeOp)
def _reshape(frame: Frame, e: ir.ReshapeOp) -> None:
    src = frame.get(e.input)
    if src.numel() != layout.reshape_numel(e.shape, src.numel()):
        raise ShapeError(f"cannot reshape T{e.input.name} of shape {list(src.shape)} to {list(e.shape)}")
    _view_out(frame, e, src.reshape(e.shape))


@impl(ir.SliceOp)
def _slice(frame: Frame, e: ir.SliceOp) -> None:
    src = frame.full_rank(e.input, frame.get(e.input))
    index = []
    for k, ((start, stop, step), size) in enumerate(zip(e.ranges, src.shape)):
        if start > size or (stop is not None and stop > size):
            raise ShapeError(f"axis {k} of T{e.input.name} has size {size}; the slice [{start}:{stop}] is out of range")
        index.append(slice(start, stop, step))
    _view_out(frame, e, src[tuple(index)])


@impl(ir.SelectOp)
def _select_op(frame: Frame, e: ir.SelectOp) -> None:
    src = frame.full_rank(e.input, frame.get(e.input))
    index, size = int(frame.get(e.index)), src.shape[e.dim]
    if not -size <= index < size:
        raise ShapeError(f"index {index} is out of range for axis {e.dim} of T{e.input.name} (size {size})")
    _copy_out(frame, e, src.select(e.dim, index), src)


# ---------------------------------------------------------------- index ops
#
# The torch of the index ops (`ir.INDEX_OPS`), on this rank's pieces; the
# C++ executor's `compute.cpp` computes the same. Each is free of host
# synchronization, so a program of them can be captured in a CUDA graph.


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(x, k, dim=-1).indices


def route(
    indices: torch.Tensor, experts: int, capacity: int, what: str, groups: int, packed: bool = False
) -> torch.Tensor:
    """`ir.RouteOp`: each pair's slot, each slot's token, or each expert's
    kept pairs (`route_all`'s one for `what`)."""
    slot, source, counts = route_all(indices, experts, capacity, groups, packed)
    return {"slot": slot, "source": source, "counts": counts}[what]


def route_all(
    indices: torch.Tensor, experts: int, capacity: int, groups: int, packed: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three results of `ir.RouteOp` (slot, source, counts) from one
    sort. The pairs are ordered by expert, stably (argsort), and a pair's
    place within its expert (within its group when `packed`) is its
    position in that order less the expert's (the group's) first one."""
    *lead, tokens, k = indices.shape
    flat = indices.reshape(-1, tokens * k)
    n = flat.shape[1]
    order = torch.argsort(flat, dim=1, stable=True)
    counts = torch.zeros(flat.shape[0], experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(1, flat, torch.ones_like(flat))
    per = experts // groups
    if packed:
        # A group's pairs start after the earlier groups' pairs.
        group_counts = counts.view(-1, groups, per).sum(2)
        starts = (group_counts.cumsum(1) - group_counts).repeat_interleave(per, dim=1)
        key = flat // per
    else:
        starts, key = counts.cumsum(1) - counts, flat
    places = torch.arange(n, device=flat.device).expand_as(flat) - starts.gather(1, flat.gather(1, order))
    within = torch.empty_like(flat).scatter_(1, order, places)
    kept = within < capacity
    slot = torch.where(kept, key * capacity + within, -1)
    kept_counts = torch.zeros(flat.shape[0], experts, dtype=torch.int64, device=flat.device)
    kept_counts.scatter_add_(1, flat, kept.to(torch.int64))
    rows = (groups if packed else experts) * capacity
    source = torch.full((flat.shape[0], rows + 1), -1, dtype=torch.int64, device=flat.device)
    token = (torch.arange(n, device=flat.device) // k).expand_as(flat)
    # A dropped pair writes the extra last column, which is cut off.
    source.scatter_(1, torch.where(slot >= 0, slot, rows), token)
    source = source[:, :rows]
    return (
        slot.reshape(indices.shape),
        source.reshape(*lead, groups, capacity) if packed else source.reshape(*lead, groups, per, capacity),
        kept_counts.reshape(*lead, groups, per),
    )


def _rows_of(shape, batch: int, features: int) -> tuple[int, int, int]:
    """(batch elements, rows per batch element, features per row)."""
    nb = len(shape) - features
    return math.prod(shape[:batch]), math.prod(shape[batch:nb]), math.prod(shape[nb:])


def _flat_index(index: torch.Tensor, batch_count: int, rows: int, missing: int) -> torch.Tensor:
    """Each index as a row of the flattened [batch * rows] rows; a negative
    one as `missing`."""
    idx = index.reshape(batch_count, -1)
    offsets = torch.arange(batch_count, device=idx.device).unsqueeze(1) * rows
    return torch.where(idx >= 0, idx + offsets, missing).reshape(-1)


def as_words(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as 8-byte words where its rows allow it (the last axis
    contiguous, every stride, offset and row a whole number of words),
    else `t` itself. A select or fill whose mask is broadcast along the rows
    moves 2-byte elements at about 40% of a copy's bandwidth on a GPU (one
    H200: 0.26 against 0.10 ms for 192 MiB) and 8-byte words at about a
    copy's (0.11 ms); either moves the bits unchanged. The C++ executor's
    `asWords` is the same."""
    size = t.element_size()
    if size >= 8 or t.dim() == 0 or t.stride(-1) != 1 or t.shape[-1] * size % 8:
        return t
    if t.storage_offset() * size % 8 or any(s * size % 8 for s in t.stride()[:-1]):
        return t
    return t.view(torch.int64)


def as_words_together(*ts: torch.Tensor) -> list[torch.Tensor]:
    """Each of `ts` as 8-byte words (`as_words`) where every one of them
    can be, else all as they are: a pass between them moves one type."""
    words = [as_words(t) for t in ts]
    return words if len({w.dtype for w in words}) == 1 else list(ts)


def take_rows(x: torch.Tensor, index: torch.Tensor, batch: int, features: int) -> torch.Tensor:
    """`ir.TakeOp`. A negative index reads a zero row: one appended to the
    rows where they are fewer than the picks (a copy of the smaller
    tensor), else the picks it gave are zeroed after the gather."""
    nb, rows, f = _rows_of(x.shape, batch, features)
    shape = (*index.shape, *x.shape[x.dim() - features :])
    if nb * rows < index.numel():
        padded = torch.cat([x.reshape(nb * rows, f), x.new_zeros(1, f)])
        return padded.index_select(0, _flat_index(index, nb, rows, nb * rows)).reshape(shape)
    out = x.reshape(nb * rows, f).index_select(0, _flat_index(index, nb, rows, 0))
    as_words(out).masked_fill_((index < 0).reshape(-1, 1), 0)
    return out.reshape(shape)


def put_add_rows(
    x: torch.Tensor, index: torch.Tensor, like, batch: int, features: int, distinct: bool = False
) -> torch.Tensor:
    """`ir.PutAddOp`: rows added into zeros shaped `like`; a negative
    index adds into an extra last row, which is cut off. `distinct`: each
    row is named at most once, so the rows are copied in (as 8-byte words
    where the rows allow: `as_words_together`), with no atomic adds; the dropped
    picks all land in the extra row."""
    nb, rows, f = _rows_of(like, batch, features)
    flat = _flat_index(index, nb, rows, nb * rows)
    out = torch.zeros(nb * rows + 1, f, dtype=x.dtype, device=x.device)
    src = x.reshape(-1, f)
    if distinct:
        words, into = as_words_together(src, out)
        into.index_copy_(0, flat, words)
    else:
        out.index_add_(0, flat, src)
    return out[: nb * rows].view(like)


def _kernel_fits(x: torch.Tensor, *sizes: int) -> bool:
    """Whether torch's grouped GEMM kernel takes these operands: bfloat16
    on a device of compute capability 9.0 or more (its CUTLASS kernel),
    every row stride a multiple of 16 bytes. Elsewhere a matmul per group
    computes the same."""
    if x.device.type != "cuda" or x.dtype is not torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return all(n * x.element_size() % 16 == 0 for n in sizes)


def _group_rows(counts_row, rows: int) -> list[tuple[int, int]]:
    """(start, end) of each group's rows, from one batch element's counts
    (host values), which must be >= 0 and total at most `rows`."""
    if any(c < 0 for c in counts_row) or sum(counts_row) > rows:
        raise ShapeError(f"grouped rows: counts {counts_row} must be >= 0 and total at most the {rows} rows")
    ends = list(itertools.accumulate(counts_row))
    return list(zip([0] + ends[:-1], ends))


def grouped_mm(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`ir.GroupedMmOp`: `torch._grouped_mm` per batch element where its
    kernel takes the operands (no host synchronization), the rows past
    the groups' total zeroed (`_grouped_mm` leaves them unwritten); else
    one matmul per group, sized by the counts read on the host. `out`, a
    contiguous tensor of the result's shape and dtype sharing no memory
    with an operand, takes the result (else it is fresh)."""
    *xb, R, K = x.shape
    *wb, G, N, _ = weight.shape
    nb, nw = math.prod(xb), math.prod(wb)
    if x.device.type == "meta":
        return torch.empty(*xb, R, N, dtype=x.dtype, device=x.device)
    xs, ws = x.reshape(nb, R, K), weight.reshape(nw, G, N, K)
    into = None if out is None else out.view(nb, R, N)
    if not _kernel_fits(x, K, N):
        out = into.zero_() if into is not None else torch.zeros(nb, R, N, dtype=x.dtype, device=x.device)
        for i, row in enumerate(counts.reshape(nb, G).tolist()):
            for g, (a, b) in enumerate(_group_rows(row, R)):
                torch.matmul(xs[i, a:b], ws[i % nw, g].transpose(0, 1), out=out[i, a:b])
        return out.reshape(*xb, R, N)
    offs = counts.reshape(nb, G).cumsum(-1).to(torch.int32)
    real = (torch.arange(R, device=x.device).unsqueeze(0) < offs[:, -1:].to(torch.int64)).unsqueeze(-1)
    out = into if into is not None else torch.empty(nb, R, N, dtype=x.dtype, device=x.device)
    # One pass puts each element's product, or a zero past the rows, as
    # 8-byte words (`as_words`; a row's N elements are a multiple of 16
    # bytes where the kernel runs).
    for i in range(nb):
        product = torch._grouped_mm(xs[i], ws[i % nw].transpose(-2, -1), offs=offs[i])
        words, into = as_words_together(product, out[i])
        torch.where(real[i], words, words.new_zeros(()), out=into)
    return out.reshape(*xb, R, N)


def grouped_outer(x: torch.Tensor, other: torch.Tensor, counts: torch.Tensor, wbatch: int) -> torch.Tensor:
    """`ir.GroupedOuterOp`: `torch._grouped_mm(x^T, other, offs)` per batch
    element (a ragged reduction axis; a matmul per group where the kernel
    does not take the operands), summed, in float32 for a half type, over
    the leading batch axes the result lacks."""
    *xb, R, N = x.shape
    K, G = other.shape[-1], counts.shape[-1]
    wb = xb[len(xb) - wbatch :] if wbatch else []
    nb, nw = math.prod(xb), math.prod(wb)
    if x.device.type == "meta":
        return torch.empty(*wb, G, N, K, dtype=x.dtype, device=x.device)
    xs, os_ = x.reshape(nb, R, N), other.reshape(nb, R, K)
    wide = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    if nb and _kernel_fits(x, K, N, R):
        offs = counts.reshape(nb, G).cumsum(-1).to(torch.int32)

        def product(i: int) -> torch.Tensor:
            return torch._grouped_mm(xs[i].transpose(0, 1), os_[i], offs=offs[i])

        sums = []
        for w in range(nw):
            # Batch elements w, w + nw, ... share weight w. Two products
            # are added as torch adds a half type, in float32 rounded once
            # (what a float32 sum would give); more, in a float32 sum.
            terms = range(w, nb, nw)
            acc = product(w)
            if len(terms) == 2:
                acc = acc + product(w + nw)
            elif len(terms) > 2:
                acc = acc.to(wide)
                for i in terms[1:]:
                    acc += product(i)
                acc = acc.to(x.dtype)
            sums.append(acc)
        return (sums[0] if nw == 1 else torch.stack(sums)).reshape(*wb, G, N, K)
    out = torch.zeros(nw, G, N, K, dtype=wide, device=x.device)
    if nb:
        for i, row in enumerate(counts.reshape(nb, G).tolist()):
            for g, (a, b) in enumerate(_group_rows(row, R)):
                out[i % nw, g] += xs[i, a:b].transpose(0, 1).to(wide) @ os_[i, a:b].to(wide)
    return out.to(x.dtype).reshape(*wb, G, N, K)


@impl(ir.GroupedMmOp)
def _grouped_mm(frame: Frame, e: ir.GroupedMmOp) -> None:
    x = _operand(frame, e, e.input, full_rank=True)
    weight = _operand(frame, e, e.weight, full_rank=True)
    counts = _operand(frame, e, e.counts, full_rank=True)

    def run():
        return grouped_mm(x, weight, counts)

    def into(out: torch.Tensor) -> None:
        # Straight into a bound output of the result's shape and dtype (a
        # stream loop's piece) that shares no memory with an operand, else
        # a fresh result copied in (the C++ executor decides alike).
        shape = (*x.shape[:-1], weight.shape[-2])
        storage = out.untyped_storage().data_ptr()
        apart = all(storage != t.untyped_storage().data_ptr() for t in (x, weight, counts))
        if apart and out.is_contiguous() and tuple(out.shape) == shape and out.dtype == x.dtype:
            grouped_mm(x, weight, counts, out=out)
        else:
            out.copy_(run())

    _store(frame, e, run, into, full_rank=True)


@impl(ir.GroupedOuterOp)
def _grouped_outer(frame: Frame, e: ir.GroupedOuterOp) -> None:
    x = _operand(frame, e, e.input, full_rank=True)
    other = _operand(frame, e, e.other, full_rank=True)
    counts = _operand(frame, e, e.counts, full_rank=True)
    wbatch = e.out.logical_ndim - 3

    def run():
        return grouped_outer(x, other, counts, wbatch)

    _store(frame, e, run, lambda out: out.copy_(run()), full_rank=True)


@impl(ir.TopKOp)
def _topk(frame: Frame, e: ir.TopKOp) -> None:
    x = _operand(frame, e, e.input, full_rank=True)
    _store(frame, e, lambda: topk_indices(x, e.k), lambda out: out.copy_(topk_indices(x, e.k)), full_rank=True)


@impl(ir.RouteOp)
def _route(frame: Frame, e: ir.RouteOp) -> None:
    indices = _operand(frame, e, e.indices, full_rank=True)
    # The route ops of one router's choices (a MoE layer's slot, source and
    # counts) share one sort: the first computes all three for this run,
    # the others take theirs while the choices and the stream are the same.
    # (The C++ executor computes each op's own.)
    stream = torch.cuda.current_stream(indices.device) if indices.is_cuda else None
    key = ("route", indices.data_ptr(), tuple(indices.shape), indices._version, stream, e.experts, e.capacity)
    key += (e.groups, e.packed)
    which = ("slot", "source", "counts").index(e.what)

    def run():
        found = frame.shared.get(key)
        if found is None or found[which] is None:
            found = frame.shared[key] = list(route_all(indices, e.experts, e.capacity, e.groups, e.packed))
        # Each result is handed out once: a second op asking for it gets
        # a tensor of its own.
        result, found[which] = found[which], None
        return result

    _store(frame, e, run, lambda out: out.copy_(run()), full_rank=True)


@impl(ir.TakeOp)
def _take(frame: Frame, e: ir.TakeOp) -> None:
    x = _operand(frame, e, e.input, full_rank=True)
    index = _operand(frame, e, e.index, full_rank=True)

    def run():
        return take_rows(x, index, e.batch, e.features)

    _store(frame, e, run, lambda out: out.copy_(run()), full_rank=True)


@impl(ir.PutAddOp)
def _put_add(frame: Frame, e: ir.PutAddOp) -> None:
    x = _operand(frame, e, e.input, full_rank=True)
    index = _operand(frame, e, e.index, full_rank=True)
    like = _operand(frame, e, e.like, full_rank=True)

    def run():
        return put_add_rows(x, index, like.shape, e.batch, e.features, e.distinct)

    _store(frame, e, run, lambda out: out.copy_(run()), full_rank=True)
