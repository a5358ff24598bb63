"""The state of one derivation (`hostir.autodiff`): `Deriver` walks a
fusion's ops from its outputs back and holds what the transpose rules
(`transpose_rules.py`) build on, the training forward and the backward
fusion, each tensor's cotangent contributions, the values saved between
the two programs, and where each tensor's pieces live (`Layout`) so that a
cotangent is placed as its primal; `Derivation` is what it returns.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Mapping

from hostir import builders, ir, printer, shape_ops
from hostir.errors import HostIrError


class NoTransposeRuleError(HostIrError, NotImplementedError):
    """An op of the fusion has no backward rule."""


# ---------------------------------------------------------------- layouts


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a tensor's pieces live: its mesh and, per logical axis (reduction
    axes left out), the loop pieces as (constant extent or None, parallel
    type). An unsplit axis is one piece with extent None."""

    mesh: ir.DeviceMesh | None
    axes: tuple

    @classmethod
    def of(cls, tv: ir.TensorView) -> Layout:
        axes = []
        for d in tv.logical_runtime():
            if d.leaves is None:
                axes.append(((None, d.parallel_type),))
            else:
                axes.append(
                    tuple((x.extent.value if x.extent.is_constant else None, x.parallel_type) for x in d.leaves)
                )
        return cls(tv.mesh, tuple(axes))

    def device_types(self, axis: int) -> set:
        return {pt for _, pt in self.axes[axis] if pt.is_device}

    def without_streams(self, axes=None) -> Layout:
        """The same with no stream piece (on logical axes `axes`, or on
        every axis); an axis left split into serial pieces only is whole."""
        new = []
        for i, a in enumerate(self.axes):
            if axes is None or i in axes:
                a = tuple((f, _no_stream(pt)) for f, pt in a)
                if len(a) > 1 and all(pt is ir.ParallelType.serial for _, pt in a):
                    a = ((None, ir.ParallelType.serial),)
            new.append(a)
        return Layout(self.mesh, tuple(new))

    def streamed(self, axes) -> bool:
        return any(pt is ir.ParallelType.stream for i in axes for _, pt in self.axes[i])

    def unsharded(self, axes) -> Layout:
        """The same, with logical axes `axes` whole on every rank (unsplit)."""
        new = list(self.axes)
        for a in axes:
            new[a] = ((None, ir.ParallelType.serial),)
        return Layout(self.mesh, tuple(new))

    def walking(self, axis: int, pieces: int) -> Layout:
        """The same with logical axis `axis` cut into `pieces` chunks for a
        stream loop (its outer piece a stream piece)."""
        axes = list(self.axes)
        axes[axis] = ((pieces, ir.ParallelType.stream), (None, ir.ParallelType.serial))
        return Layout(self.mesh, tuple(axes))

    def walked_pieces(self, axis: int) -> int | None:
        """The chunks a stream loop cuts logical axis `axis` into (its outer
        piece a stream piece of constant extent, the rest serial), else None."""
        a = self.axes[axis]
        if len(a) == 2 and a[0][1] is ir.ParallelType.stream and a[1][1] is ir.ParallelType.serial:
            return a[0][0]
        return None

    def permuted(self, dims) -> Layout:
        return Layout(self.mesh, tuple(self.axes[d] for d in dims))

    def apply(self, tv: ir.TensorView) -> None:
        """Give `tv` (unsplit, unparallelized) this layout."""
        if self.mesh is not None:
            tv.set_device_mesh(self.mesh)
        logical = tv.logical_runtime()
        for d in tv.logical:
            # A reduced axis cloned from a stream axis is no stream axis.
            if d.is_reduction and d.leaves is None and d.parallel_type is ir.ParallelType.stream:
                d.parallelize(ir.ParallelType.serial)
        to_parallelize = []
        for d, pieces in zip(logical, self.axes):
            # An axis cloned from a placed operand comes with its parallel type.
            if d.leaves is None and d.parallel_type is not ir.ParallelType.serial:
                d.parallelize(ir.ParallelType.serial)
            if len(pieces) == 1:
                (_, pt) = pieces[0]
                if pt is not ir.ParallelType.serial:
                    to_parallelize.append((d, pt))
                continue
            made = _split_like(tv, d, pieces)
            for leaf, (_, pt) in zip(made, pieces):
                if pt is not ir.ParallelType.serial:
                    to_parallelize.append((leaf, pt))
        for d, pt in to_parallelize:
            d.parallelize(pt)

    @property
    def trivial(self) -> bool:
        return self.mesh is None and all(len(a) == 1 and a[0][1] is ir.ParallelType.serial for a in self.axes)


def _no_stream(pt: ir.ParallelType) -> ir.ParallelType:
    return ir.ParallelType.serial if pt is ir.ParallelType.stream else pt


def _split_like(tv: ir.TensorView, d: ir.IterDomain, pieces) -> list[ir.IterDomain]:
    """Split logical axis `d` of `tv` into pieces of the given extents."""
    current = d
    for j in range(len(pieces) - 1):
        at = tv.domain.index(current)
        factor = pieces[j][0]
        if factor is not None:
            tv.outer_split(at, factor)
        else:
            inner = pieces[-1][0] if j == len(pieces) - 2 else None
            if inner is None:
                raise NoTransposeRuleError(f"cannot replay the split of T{tv.name}: pieces {pieces}")
            tv.split(at, inner)
        current = tv.domain[at + 1]
    return list(d.loop_leaves())


# ---------------------------------------------------------------- the derivation


@dataclasses.dataclass
class Derivation:
    """A fusion's training forward and its backward (see the module's doc)."""

    forward: ir.Fusion
    backward: ir.Fusion
    # Forward outputs that are the user's (the first ones).
    user_outputs: int
    # What the backward reads after the cotangents, in its inputs' order:
    # ("input", i) is forward input i (a tensor or a scalar), ("output", j)
    # forward output j, ("cotangent", j) the cotangent of user output j
    # again (an alias split for a product to walk, see `Deriver.walking`).
    saved: list[tuple[str, int]]
    # The forward inputs whose gradients the backward returns, in its
    # outputs' order.
    grad_inputs: list[int]
    # Per user output: the layout its cotangent (a backward input) has.
    cotangent_layouts: list[Layout]


def _propagated_layouts(fusion: ir.Fusion) -> tuple[dict[int, Layout], dict[int, Layout]]:
    """Each tensor's layout (by name) after stream and sharding propagation,
    as the forward's lowering places it, and the layouts of the inputs with
    their stream pieces (which the first leaves out)."""
    from hostir.lower.build_host_program import build_host_program
    from hostir.lower.propagate_shardings import all_tvs, propagate_shardings
    from hostir.lower.propagate_stream_axes import propagate_stream_axes

    container = propagate_shardings(propagate_stream_axes(build_host_program(fusion)))
    layouts = {tv.name: Layout.of(tv) for tv in all_tvs(container)}
    # A stream piece on an input only cuts the forward's loop over it (a
    # row-parallel product walking its output's scattered axis, GEMM+RS);
    # its gradient is whole along that axis, as any input's.
    walked = {}
    for tv in container.inputs:
        if isinstance(tv, ir.TensorView):
            walked[tv.name] = layouts[tv.name]
            layouts[tv.name] = layouts[tv.name].without_streams()
    return layouts, walked


class Deriver:
    def __init__(self, fusion: ir.Fusion, wrt: list[int], keep_gathered: bool):
        self.fwd = copy.deepcopy(fusion)
        self.wrt = wrt
        self.keep_gathered = keep_gathered
        self.layouts, self.input_walks = _propagated_layouts(self.fwd)
        if keep_gathered and self._explicit_gathers():
            self.layouts, self.input_walks = _propagated_layouts(self.fwd)
        self.multi = any(lay.mesh is not None for lay in self.layouts.values())
        self.bwd = ir.Fusion()
        self.producer = {e.out: e for e in self.fwd.exprs}
        # Cotangents held back until a value's cotangent is asked for (the
        # parts of a tiled slice, `transpose_rules._slice_rule`): `pending`
        # maps the value to what contributes them.
        self.tiles: dict = {}
        self.pending: dict = {}
        self.contribs: dict[ir.TensorView, list[ir.TensorView]] = {}
        self.known: dict[ir.TensorView, Layout] = {}  # backward tv -> its layout
        self.free: set[ir.TensorView] = set()  # made by a rule, not placed yet
        self.saved: dict[ir.TensorView, ir.TensorView] = {}
        self.gathered: dict[tuple, ir.TensorView] = {}
        self.scalars: dict[int, ir.Scalar] = {}
        self.saved_order: list[tuple[str, int]] = []
        self.cotangent_inputs: dict[ir.TensorView, int] = {}  # backward input -> forward output
        self.walked: dict[tuple, ir.TensorView] = {}

    def _explicit_gathers(self) -> bool:
        """Make each gather the lowering would insert before a matmul or
        linear (an operand's rows sharded where the product's are not) a
        `set` of the training forward, so that its result can be saved."""
        changed = False
        for e in list(self.fwd.exprs):
            if not isinstance(e, (ir.MatmulOp, ir.LinearOp)):
                continue
            field = "a" if isinstance(e, ir.MatmulOp) else "input"
            x = getattr(e, field)
            lx, lo = self.layouts.get(x.name), self.layouts.get(e.out.name)
            if lx is None or lo is None or lx.mesh is None:
                continue
            rows = [k for k in range(len(lx.axes) - 1) if lx.device_types(k) and not lo.device_types(k)]
            if not rows:
                continue
            xg = ir.TensorView(self.fwd, [a.clone(self.fwd) for a in x.logical_runtime()], x.dtype)
            lx.without_streams().unsharded(rows).apply(xg)
            self.fwd.exprs.insert(self.fwd.exprs.index(e), ir.Set(xg, x))
            setattr(e, field, xg)
            self.fwd.bump_version()
            changed = True
        return changed

    # -- layouts
    def layout(self, tv: ir.TensorView) -> Layout:
        lay = self.layouts.get(tv.name)
        return lay if lay is not None else Layout.of(tv)

    def new_input(self, like: ir.TensorView, layout: Layout, streams: bool = False) -> ir.TensorView:
        shape = [
            -1 if not d.extent.is_constant else (1 if d.is_broadcast else d.extent.value)
            for d in like.logical_runtime()
        ]
        shape = [s if s != 1 or d.is_broadcast else -1 for s, d in zip(shape, like.logical_runtime())]
        tv = self.bwd.new_tensor(shape, like.dtype)
        # Inputs take no stream axis (a stream loop cuts the ops that read
        # them), except an alias made for one product to walk (`walking`).
        if not streams:
            layout = layout.without_streams()
        layout.apply(tv)
        self.known[tv] = layout
        return tv

    def place(self, tv: ir.TensorView, layout: Layout) -> ir.TensorView:
        """`tv` in `layout`: placed if a rule just made it, else a copy."""
        if tv in self.free:
            self.free.discard(tv)
            layout.apply(tv)
            self.known[tv] = layout
            return tv
        have = self.known.get(tv)
        if have is not None and (have.without_streams() == layout.without_streams()):
            return tv
        if have is None and layout.trivial:
            return tv
        copy_ = builders.set_(tv)
        layout.apply(copy_)
        self.known[copy_] = layout
        return copy_

    def made(self, tv: ir.TensorView) -> ir.TensorView:
        if tv not in self.known and tv not in self.bwd.inputs:
            self.free.add(tv)
        return tv

    # -- values the backward reads
    def save(self, tv, contracted=()) -> ir.TensorView | ir.Scalar | float:
        """The forward value `tv` in the backward. `contracted`: logical
        axes a product sums over; a stream piece on one of them is dropped
        from a tensor gathered again (a ring cannot walk a summed axis: each
        step's product would be a partial of the whole)."""
        if not isinstance(tv, ir.TensorView):
            return self.scalar(tv)
        if contracted and self.regathered(tv) and self.layout(tv).streamed(contracted):
            layout = self.layout(tv).without_streams(contracted)
            key = ("unstreamed", tv)
            found = self.gathered.get(key)
            if found is None:
                found = builders.set_(self.save(self.producer[tv].input))
                layout.apply(found)
                self.known[found] = layout
                self.gathered[key] = found
            return found
        found = self.saved.get(tv)
        if found is not None:
            return found
        producer = self.producer.get(tv)
        if tv in self.fwd.inputs:
            self.saved_order.append(("input", self.fwd.inputs.index(tv)))
            found = self.new_input(tv, self.layout(tv))
        elif self._gathered_by(tv, producer):
            # Gathered in the forward: gather again from the saved shard.
            source = self.save(producer.input)
            found = builders.set_(source)
            self.layout(tv).apply(found)
            self.known[found] = self.layout(tv)
        elif self._viewed(tv):
            # A view (slices and permutes) of a value the backward holds
            # anyway (an input, or one saved already): taken again there,
            # where saving it would make the forward output it, a copy (a
            # fused weight's gate and up).
            source = self.save(producer.input)
            if isinstance(producer, ir.SliceOp):
                ranges = producer.ranges
                starts, stops, steps = ([r[k] for r in ranges] for k in range(3))
                found = shape_ops.slice_(source, starts, stops, steps)
            else:
                found = shape_ops.permute(source, list(producer.dims))
            layout = self.layout(tv).without_streams()
            layout.apply(found)
            self.known[found] = layout
        else:
            if tv not in self.fwd.outputs:
                self.fwd.add_output(tv)
            self.saved_order.append(("output", self.fwd.outputs.index(tv)))
            found = self.new_input(tv, self.layout(tv))
        self.saved[tv] = found
        return found

    def _viewed(self, tv: ir.TensorView) -> bool:
        """Whether the forward value `tv` is taken again in the backward,
        not saved: slices and permutes of a forward input or of a value
        already saved."""
        while True:
            producer = self.producer.get(tv)
            if not isinstance(producer, (ir.SliceOp, ir.PermuteOp)):
                return False
            tv = producer.input
            if tv in self.fwd.inputs or tv in self.saved:
                return True

    def _relayout(self, old: ir.TensorView, new: ir.TensorView) -> None:
        """Give `new`, made in `old`'s place, the layout `old` has."""
        lay = self.known.get(old)
        if lay is not None:
            lay.apply(new)
            self.known[new] = lay

    def regathered(self, tv: ir.TensorView) -> bool:
        """Whether `save(tv)` gathers a saved shard again."""
        return tv not in self.saved and self._gathered_by(tv, self.producer.get(tv))

    def _gathered_by(self, tv: ir.TensorView, producer) -> bool:
        """Whether `tv` is a `set` that gathers (its input sharded on a mesh
        dimension it is not): saving the shard and gathering it again in the
        backward keeps the smaller tensor. A `set` that only moves a
        sharded axis (an AllToAll) makes a tensor as large as its input's
        shard, so `tv` itself is saved and nothing is sent again."""
        if not isinstance(producer, ir.Set) or self.keep_gathered or not self.multi:
            return False
        out, src = self.layout(tv).without_streams(), self.layout(producer.input).without_streams()
        if out == src:
            return False
        dims = lambda lay: set().union(*(lay.device_types(k) for k in range(len(lay.axes))))  # noqa: E731
        return not dims(src) <= dims(out)

    def save_permuted(self, tv: ir.TensorView, dims) -> ir.TensorView:
        """The forward value `tv` with its axes permuted. A tensor gathered
        again is permuted as a shard and then gathered, so that the gather
        (a ring, when its stream axis asks for one) feeds the product that
        reads it chunk by chunk."""
        if not self.regathered(tv):
            return self.permute(self.save(tv), dims)
        shard = self.permute(self.save(self.producer[tv].input), dims)
        found = builders.set_(shard)
        layout = self.layout(tv).permuted(dims)
        layout.apply(found)
        self.known[found] = layout
        return found

    def read_anyway(self, t: ir.TensorView) -> bool:
        """Whether a rule saves `t` for its values (a product's operand, the
        input or output of a nonlinearity)."""
        if _grad_reads(self.producer.get(t), "out"):
            return True
        for c in self.fwd.exprs:
            if isinstance(c, ir.BinaryOp) and c.kind in ("mul", "div") and t in (c.lhs, c.rhs):
                return True
            if _grad_reads(c, "input") and c.input is t:
                return True
        return False

    def shaped_like(self, tv: ir.TensorView) -> ir.TensorView:
        """A saved value with `tv`'s shape and sharding, for an op that
        reads only sizes: one the backward reads anyway if the elementwise
        ops that made `tv` lead to one, else `tv` itself."""
        layout = self.layout(tv).without_streams()
        shape = [a.extent for a in tv.logical_runtime()]
        seen, todo = [], [tv]
        while todo:
            t = todo.pop()
            seen.append(t)
            if t in self.saved or t in self.fwd.inputs or self.read_anyway(t):
                return self.save(t)
            e = self.producer.get(t)
            if isinstance(e, (ir.UnaryOp, ir.BinaryOp, ir.Set)):
                for v in e.inputs():
                    if (
                        isinstance(v, ir.TensorView)
                        and v not in seen
                        and [a.extent for a in v.logical_runtime()] == shape
                        and not any(a.is_broadcast for a in v.logical_runtime())
                        and self.layout(v).without_streams() == layout
                    ):
                        todo.append(v)
        return self.save(tv)

    def scalar(self, s: ir.Scalar):
        if isinstance(s, ir.InputScalar):
            found = self.scalars.get(id(s))
            if found is None:
                self.saved_order.append(("input", next(i for i, v in enumerate(self.fwd.inputs) if v is s)))
                found = self.scalars[id(s)] = self.bwd.new_scalar(s.dtype)
            return found
        return s.value

    # -- cotangents
    def contribute(self, tv: ir.TensorView, g: ir.TensorView) -> None:
        if g.dtype != tv.dtype:
            g = self.made(builders.unary("cast", g, tv.dtype))
        self.contribs.setdefault(tv, []).append(g)

    def cotangent(self, tv: ir.TensorView, layout: Layout | None = None) -> ir.TensorView | None:
        flush = self.pending.pop(tv, None)
        if flush is not None:
            flush()
        parts = self.contribs.pop(tv, None)
        if not parts:
            return None
        total = parts[0]
        for p in parts[1:]:
            total = self.made(builders.binary("add", total, p))
        return self.place(total, layout if layout is not None else self.layout(tv))

    # -- a row-parallel product whose sum scatters a walked axis (GEMM+RS)
    def walking(self, g: ir.TensorView, out: ir.TensorView, x: ir.TensorView, lead) -> ir.TensorView:
        """`g`, the cotangent of forward output `out`, to be multiplied by a
        weight over its last axis into the gradient of `x`; `lead` pairs
        axes of `g` with axes of `x`. Where the product sums over ranks (that
        last axis is sharded) and scatters onto `x` an axis that the forward
        walked on `out` (its outer piece a stream piece, the same axis of `x`
        split on the mesh dimension that shards the sum), the product reads
        an alias of the cotangent split like the forward walked it: the
        backward input again, given once more, so that the lowering
        decomposes the sum into a GEMM+ReduceScatter ring walking that axis.
        Other products keep reading `g` whole. Else `g` itself."""
        j = self.cotangent_inputs.get(g)
        lg = self.known.get(g)
        if j is None or lg is None or lg.mesh is None:
            return g
        k_types = lg.device_types(len(lg.axes) - 1)
        if len(k_types) != 1:
            return g
        (k_type,) = k_types
        # The cotangent of a resharding `set`'s output read by this product
        # alone is made directly in the set input's sharding (`_set_rule`).
        while isinstance(self.producer.get(x), ir.Set) and self.uses(x) == 1:
            x = self.producer[x].input
        lo, lx = self.layout(out), self.layout(x)
        for a, b in lead:
            pieces = lo.walked_pieces(a)
            scattered = lx.axes[b]
            if (
                pieces is not None
                and len(scattered) == 2
                and scattered[0] == (pieces, k_type)
                and scattered[1][1] is ir.ParallelType.serial
            ):
                key = (j, a)
                found = self.walked.get(key)
                if found is None:
                    self.saved_order.append(("cotangent", j))
                    found = self.new_input(out, lg.walking(a, pieces), streams=True)
                    self.walked[key] = found
                return found
        return g

    def uses(self, tv: ir.TensorView) -> int:
        return sum(1 for e in self.fwd.exprs for v in e.inputs() if v is tv) + (tv in self.fwd.outputs)

    # -- gathers where a product would shard one mesh dimension twice
    def unsharded(self, tv: ir.TensorView, axes) -> ir.TensorView:
        lay = self.known.get(tv)
        if lay is None or not any(lay.device_types(a) for a in axes):
            return tv
        key = (id(tv), tuple(axes))
        found = self.gathered.get(key)
        if found is None:
            new_layout = lay.without_streams().unsharded(axes)
            found = builders.set_(tv)
            new_layout.apply(found)
            self.known[found] = new_layout
            self.gathered[key] = found
        return found

    def gathered_walking(self, g: ir.TensorView, lead, x: ir.TensorView) -> tuple[ir.TensorView, Layout | None]:
        """`g` (a linear's output cotangent, sharded on rows `lead`) gathered
        whole on them for both products. Where the forward walked one of
        those rows on the linear's input `x` (a row-parallel product walking
        its output's scattered axis, GEMM+RS), the gather walks it too, so
        that the lowering makes it a ring feeding the input gradient chunk
        by chunk (AG+GEMM); the weight gradient and the bias read the whole
        gathered gradient after the ring. Returns the gathered gradient and
        the layout the input gradient takes to walk with it (None where it
        does not walk)."""
        lay = self.known[g]
        walk = self.input_walks.get(x.name, self.layout(x))
        lx = self.layout(x)
        for a in lead:
            pieces = walk.walked_pieces(a)
            sharded = lay.axes[a]
            if (
                pieces is not None
                and len(sharded) == 2
                and sharded[0][1].is_device
                and sharded[0][0] == pieces
                and not lx.device_types(a)
            ):
                key = ("walked", id(g), a)
                found = self.gathered.get(key)
                if found is None:
                    layout = lay.without_streams().unsharded(lead).walking(a, pieces)
                    found = builders.set_(g)
                    layout.apply(found)
                    self.known[found] = layout
                    self.gathered[key] = found
                return found, lx.without_streams().walking(a, pieces)
        return self.unsharded(g, lead), None

    def contraction_ready(self, a, a_k: list[int], b, b_k: list[int]):
        """Gather the contracted axes of `a` or `b` where a mesh dimension
        shards a contracted axis and also an axis of the product."""
        la, lb = self.known.get(a), self.known.get(b)
        if la is None or lb is None:
            return a, b
        ka = set().union(*(la.device_types(i) for i in a_k)) if a_k else set()
        kb = set().union(*(lb.device_types(i) for i in b_k)) if b_k else set()
        other = set()
        for lay, ks, t in ((la, a_k, a), (lb, b_k, b)):
            for i in range(len(lay.axes)):
                if i not in ks:
                    other |= lay.device_types(i)
        if ka & other:
            a = self.unsharded(a, a_k)
        if kb & other:
            b = self.unsharded(b, b_k)
        return a, b

    def permute(self, tv: ir.TensorView, dims) -> ir.TensorView:
        """`tv` transposed for a product: a view, not a copy."""
        out = shape_ops.permute(tv, dims)
        lay = self.known.get(tv)
        if lay is not None:
            lay = lay.without_streams().permuted(dims)
            lay.apply(out)
            self.known[out] = lay
        return out

    # -- the walk
    def run(self, rules: Mapping[type, Callable]) -> Derivation:
        """Walk the ops from the outputs back, each through its rule in
        `rules` (op class -> rule)."""
        fwd = self.fwd
        needs = set()
        for i in self.wrt:
            needs.add(fwd.inputs[i])
        for e in fwd.exprs:
            if any(v in needs for v in e.inputs() if isinstance(v, ir.TensorView)):
                needs.add(e.out)
        user_outputs = len(fwd.outputs)
        cot_layouts = []
        for out in list(fwd.outputs):
            lay = self.layout(out)
            cot_layouts.append(lay)
            g = self.new_input(out, lay)
            self.cotangent_inputs[g] = len(cot_layouts) - 1
            if out in needs:
                self.contribs.setdefault(out, []).append(g)
        for e in reversed(list(fwd.exprs)):
            if e.out not in needs or (e.out not in self.contribs and e.out not in self.pending):
                continue
            if not any(wants(self, v, needs) for v in e.inputs()):
                self.contribs.pop(e.out, None)
                self.pending.pop(e.out, None)
                continue
            rule = rules.get(type(e))
            if rule is None:
                raise NoTransposeRuleError(no_rule(e, f"hostir has no backward rule for {type(e).__name__}"))
            rule(self, e, needs)
        grad_inputs = []
        for i in self.wrt:
            tv = fwd.inputs[i]
            g = self.cotangent(tv)
            if g is None:
                continue
            if g in self.bwd.inputs or g in self.bwd.outputs:
                g = builders.set_(g)
                self.layout(tv).apply(g)
            self.bwd.add_output(g)
            grad_inputs.append(i)
        _join_tiled_products(self.bwd, self._relayout)
        # A tensor a rule made and nothing placed takes what sharding
        # propagation gives it when the backward is lowered.
        return Derivation(
            forward=fwd,
            backward=self.bwd,
            user_outputs=user_outputs,
            saved=self.saved_order,
            grad_inputs=grad_inputs,
            cotangent_layouts=cot_layouts,
        )


def _join_tiled_products(bwd: ir.Fusion, relayout: Callable) -> None:
    """A weight cut into two tiles along the axis its products contract
    (a fused gate_up into gate and up) has, in the backward, two products
    of the tiles' output gradients by the tiles, summed into the input's
    gradient, and two products for the tiles' gradients, joined by a cat
    into the weight's gradient. Both pairs become one op of the output
    gradients joined (`cat([dg, du])`, [.., R, 2F]): one product by the
    whole weight, whose contraction adds the two (no sum pass; for grouped
    GEMMs one pass over the rows past the counts, not two), and one
    product that is the weight's gradient (no cat of the weights' size):
    for the grouped GEMMs a grouped outer product, for batched matmuls a
    matmul summed over the batch axes the weight lacks. `relayout(old,
    new)` gives a tensor made in an output's place that output's layout.
    Where the ops differ from these patterns in any way, nothing changes."""
    while _join_one_tiled_product(bwd) or _join_one_tiled_matmul(bwd, relayout):
        pass


def _uses(bwd: ir.Fusion) -> tuple[dict, dict]:
    """(readers, producer) of the tensors of `bwd`: an output counts a
    reader (None)."""
    readers: dict = {}
    for e in bwd.exprs:
        for v in e.inputs():
            if isinstance(v, ir.TensorView):
                readers.setdefault(v, []).append(e)
    for tv in bwd.outputs:
        readers.setdefault(tv, []).append(None)
    return readers, {e.out: e for e in bwd.exprs}


def _tiled_pair(tiles) -> tuple | None:
    """(W, [first, second]) for two products' `(W, (start, stop), ...)`
    tiles (None where a product's operand is no tile) of one `W` whose
    cuts of its axis -2 tile it from end to end, in the order along it;
    else None."""
    if None in tiles or tiles[0][0] is not tiles[1][0]:
        return None
    W = tiles[0][0]
    ordered = _tiles_of(W, [t[1] for t in tiles])
    return None if ordered is None else (W, list(ordered))


def _tiles_of(W, tiles) -> tuple[int, int] | None:
    """(first, second): the order of two (start, stop) cuts of `W`'s axis
    -2 that tile it from end to end, else None."""
    first, second = sorted(range(2), key=lambda k: tiles[k][0])
    extent = W.logical_runtime()[W.logical_ndim - 2].extent
    (a0, b0), (a1, b1) = tiles[first], tiles[second]
    if a0 != 0 or b0 is None or a1 != b0 or not (b1 is None or (extent.is_constant and b1 == extent.value)):
        return None
    return first, second


def _rebuilt(bwd: ir.Fusion, new: list, at: dict, gone: set, subst: dict | None = None) -> None:
    """`bwd`'s ops without those in `gone`, `new` (made in order, needing
    nothing made after the first op of `at`) before the first op of `at`,
    and each op of `at` (op -> its replacement, or None) in its place;
    `subst` (tensor -> tensor) renames what the ops after read; slices
    left unread dropped."""
    subst = subst or {}
    exprs = []
    for e in bwd.exprs:
        if id(e) in at:
            exprs += new
            new = []
            if at[id(e)] is not None:
                exprs.append(at[id(e)])
        if id(e) not in gone:
            changes = {f: subst[getattr(e, f)] for f in e.INPUTS if getattr(e, f, None) in subst}
            exprs.append(e.replace(**changes) if changes else e)
    bwd.exprs[:] = [e for e in exprs if not (isinstance(e, ir.SliceOp) and not _read_by(e.out, exprs, bwd))]
    bwd.bump_version()


def _join_one_tiled_matmul(bwd: ir.Fusion, relayout: Callable) -> bool:
    """One rewrite of `_join_tiled_products` for batched matmuls: dx =
    dg @ gate + du @ up (gate and up the tiles of W's axis -2, each the
    matmul's b, through permutes that leave that axis contracted), and the
    tiles' gradients sum(permute(dg) @ X) and sum(permute(du) @ X) joined
    by a cat along that axis."""
    readers, producer = _uses(bwd)

    def tile(b):
        """(W, (start, stop), the permutes' composition) of a matmul's b
        that is a permuted slice of W whose cut axis b contracts."""
        order = list(range(b.logical_ndim))
        t = b
        while isinstance(producer.get(t), ir.PermuteOp):
            perm = producer[t]
            if readers.get(t) is None or len(readers[t]) != 1:
                return None
            order = [perm.dims[k] for k in order]
            t = perm.input
        cut = producer.get(t)
        n = b.logical_ndim
        if not isinstance(cut, ir.SliceOp) or cut.input.logical_ndim != n or order[n - 2] != n - 2:
            return None
        whole = (0, None, 1)
        if any(r != whole for k, r in enumerate(cut.ranges) if k != n - 2) or cut.ranges[n - 2][2] != 1:
            return None
        return cut.input, cut.ranges[n - 2][:2], order

    for add in list(bwd.exprs):
        if not (isinstance(add, ir.BinaryOp) and add.kind == "add"):
            continue
        mms = [producer.get(v) for v in (add.lhs, add.rhs)]
        if not all(
            isinstance(m, ir.MatmulOp) and not m.accumulate and m.partial is None and readers.get(m.out) == [add]
            for m in mms
        ):
            continue
        tiles = [tile(m.b) for m in mms]
        pair = _tiled_pair(tiles)
        if pair is None or tiles[0][2] != tiles[1][2]:
            continue
        (W, ordered), order = pair, tiles[0][2]
        xs = [mms[k].a for k in ordered]
        if any(x.dtype != W.dtype or x.logical_ndim != xs[0].logical_ndim for x in xs):
            continue
        n = xs[0].logical_ndim
        swap = list(range(n - 2)) + [n - 1, n - 2]
        sums = []
        for x in xs:
            perms = [e for e in readers.get(x, []) if isinstance(e, ir.PermuteOp) and list(e.dims) == swap]
            found = None
            for perm in perms:
                uses = readers.get(perm.out, [])
                if len(uses) == 1 and isinstance(uses[0], ir.MatmulOp) and uses[0].a is perm.out:
                    mm = uses[0]
                    after = readers.get(mm.out, [])
                    if not mm.accumulate and mm.partial is None and len(after) == 1:
                        if isinstance(after[0], ir.ReductionOp) and after[0].kind == "sum":
                            found = (perm, mm, after[0])
            sums.append(found)
        if None in sums or sums[0][1].b is not sums[1][1].b:
            continue
        reduced = [[k for k, a in enumerate(r.out.logical) if a.is_reduction] for _, _, r in sums]
        if reduced[0] != reduced[1]:
            continue
        cats = {id(r): r for _, _, red in sums for r in readers.get(red.out, []) if isinstance(r, ir.CatOp)}
        if len(cats) != 1:
            continue
        (cat,) = cats.values()
        if [cat.input, cat.other] != [s[2].out for s in sums] or cat.dim != cat.out.logical_ndim - 2:
            continue
        if not all(readers.get(s[2].out) == [cat] for s in sums) or readers.get(cat.out) != [None]:
            continue
        X = sums[0][1].b
        if cat.out.dtype != W.dtype or (X in producer and bwd.exprs.index(producer[X]) > bwd.exprs.index(add)):
            continue
        before = len(bwd.exprs)
        joined = shape_ops.cat(xs, n - 1)
        whole = W if order == list(range(len(order))) else shape_ops.permute(W, order)
        # Read whole after the walk (it sums over the walked axis), as the
        # derivation's own permutes for a product are: no stream axis.
        flipped = shape_ops.permute(joined, swap)
        for a in flipped.domain:
            if a.parallel_type is ir.ParallelType.stream:
                a.parallelize(ir.ParallelType.serial)
        grad = builders.reduction("sum", builders.matmul(flipped, X), reduced[0])
        product = builders.matmul(joined, whole)
        new = bwd.exprs[before:]
        del bwd.exprs[before:]
        relayout(cat.out, grad)
        relayout(add.out, product)
        bwd.outputs[bwd.outputs.index(cat.out)] = grad
        gone = {id(e) for e in (add, *mms, cat, *(x for s in sums for x in s))}
        for m in mms:
            t = m.b
            while isinstance(producer.get(t), ir.PermuteOp):
                gone.add(id(producer[t]))
                t = producer[t].input
        if add.out in bwd.outputs:
            bwd.outputs[bwd.outputs.index(add.out)] = product
        _rebuilt(bwd, new, {id(add): None}, gone, {add.out: product})
        return True
    return False


def _join_one_tiled_product(bwd: ir.Fusion) -> bool:
    """One rewrite of `_join_tiled_products` for grouped GEMMs; whether
    there was one."""
    readers, producer = _uses(bwd)

    def tile(weight):
        """(W, the tile's (start, stop), permute dims) of a grouped GEMM's
        weight that is a permuted slice of W cutting the contracted axis."""
        perm = producer.get(weight)
        if not isinstance(perm, ir.PermuteOp) or len(readers.get(weight, [])) != 1:
            return None
        cut = producer.get(perm.input)
        n = weight.logical_ndim
        if not isinstance(cut, ir.SliceOp) or list(perm.dims) != list(range(n - 2)) + [n - 1, n - 2]:
            return None
        whole = (0, None, 1)
        if any(r != whole for k, r in enumerate(cut.ranges) if k != n - 2) or cut.ranges[n - 2][2] != 1:
            return None
        return cut.input, cut.ranges[n - 2][:2], perm.dims

    for add in list(bwd.exprs):
        if not (isinstance(add, ir.BinaryOp) and add.kind == "add"):
            continue
        mms = [producer.get(v) for v in (add.lhs, add.rhs)]
        if not all(isinstance(m, ir.GroupedMmOp) and readers.get(m.out) == [add] for m in mms):
            continue
        tiles = [tile(m.weight) for m in mms]
        pair = _tiled_pair(tiles)
        if pair is None or mms[0].counts is not mms[1].counts:
            continue
        (W, ordered), dims = pair, tiles[0][2]
        xs = [mms[k].input for k in ordered]
        outers = [
            e
            for x in xs
            for e in readers.get(x, [])
            if isinstance(e, ir.GroupedOuterOp) and e.input is x and e.counts is mms[0].counts
        ]
        cats = {id(r): r for o in outers for r in readers.get(o.out, []) if isinstance(r, ir.CatOp)}
        if len(outers) != 2 or len(cats) != 1 or outers[0].other is not outers[1].other:
            continue
        (cat,) = cats.values()
        if [cat.input, cat.other] != [outers[0].out, outers[1].out] or cat.dim != cat.out.logical_ndim - 2:
            continue
        if not all(readers.get(o.out) == [cat] for o in outers) or cat.out.dtype != W.dtype:
            continue
        if any(x.dtype != W.dtype for x in xs):
            continue
        before = len(bwd.exprs)
        joined = shape_ops.cat(xs, xs[0].logical_ndim - 1)
        whole = shape_ops.permute(W, list(dims))
        new = bwd.exprs[before:]
        del bwd.exprs[before:]
        at = {
            id(add): ir.GroupedMmOp(add.out, joined, whole, mms[0].counts),
            id(cat): ir.GroupedOuterOp(cat.out, joined, outers[0].other, mms[0].counts),
        }
        gone = {id(e) for e in (add, *mms, cat, *outers)} | {id(producer[m.weight]) for m in mms}
        _rebuilt(bwd, new, at, gone)
        return True
    return False


def _read_by(tv, exprs, fusion) -> bool:
    """Whether an op of `exprs` or the outputs of `fusion` read `tv`."""
    return tv in fusion.outputs or any(v is tv for e in exprs for v in e.inputs())


def _grad_reads(e: ir.Expr | None, field: str) -> bool:
    """Whether `e` is a unary op whose declared backward reads its `field`
    ("input" or "out")."""
    return isinstance(e, ir.UnaryOp) and e.kind.grad is not None and e.kind.grad.reads == field


def no_rule(e: ir.Expr, why: str) -> str:
    line = printer.format_expr_head(e) if hasattr(printer, "format_expr_head") else repr(e)
    return f"{why}; the backward of this op cannot be derived:\n{line}"


def _floating(tv) -> bool:
    return isinstance(tv, ir.TensorView) and (tv.dtype.is_floating_point or tv.dtype.is_complex)


def wants(d: Deriver, v, needs) -> bool:
    return isinstance(v, ir.TensorView) and v in needs and _floating(v)
