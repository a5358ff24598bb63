"""Compile a lowered `HostIrContainer` into a flat program for the C++ executor.

The flat program is the container with every name resolved: each buffer
(an alias already replaced by its original) is a numbered tensor slot `%t<n>`,
each symbolic scalar an integer slot `$<n>`, each `Stream` value a stream slot
`%s<n>` or a key of the device's stream pool; `HirAliasSelect` knows the dim it
selects, matmul and linear the dims a select removed, a communication its
process group, its backend (which C++ transport posts it), its roots as group
ranks and its permutations in the group's order. Loops stay structured (an
instruction with the index of its body's end) and scalar expressions
(`( StreamIdx % numberOfStreams )`, extents, the rank) are small trees over
integer slots, so `hostir._C` runs the whole program without calling back
into Python. The Python evaluator stays the reference; both run from the
same container.

`HOSTIR_DUMP=flat_program` prints `FlatProgram.dump()` when the C++ executor
first runs a program.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from hostir import ir, layout, printer
from hostir.container import HostIrContainer
from hostir.runtime import flat_communications, flat_dump, support
from hostir.runtime.flat_communications import (
    local_shape,
    logical_groups,
)
from hostir.runtime.evaluator import BindingError, MissingHandlerError, _local_slices, local_views
from hostir.runtime.fusion_ops import summed_products, sums_that_view

# Opcodes shared with csrc/host_ir/program.h (enum class Opcode).
OPCODES = (
    "for",
    "get_stream",
    "set_stream",
    "synchronize",
    "select",
    "allocate",
    "deallocate",
    "set",
    "binary",
    "reduction",
    "matmul",
    "linear",
    "communication",
    "p2p",
    "start_coalescing",
    "end_coalescing",
    "wait",
    "if",
    "unary",
    "permute",
    "transfer",
    "chunk",
    "topk",
    "route",
    "take",
    "put_add",
    "grouped_mm",
    "grouped_outer",
    "slice",
    "cat",
    "insert",
)
_CODE = {name: i for i, name in enumerate(OPCODES)}
_DTYPES = flat_communications.DTYPES



@dataclasses.dataclass
class Instr:
    """One instruction: its opcode, its fields (slots, scalar nodes, flags)
    and the host op it came from (for dumps and error messages)."""

    op: str
    fields: dict[str, Any]
    expr: ir.Expr


@dataclasses.dataclass
class FlatProgram:
    """A compiled host program. `scalars` are the scalar-expression nodes:
    ("const", v), ("slot", n) or (op, lhs node, rhs node)."""

    instrs: list[Instr]
    scalars: list[tuple]
    num_tensors: int
    num_ints: int
    num_streams: int
    inputs: list[int]
    outputs: list[int]  # -1: this rank does not hold the output
    # Per bound tensor slot, how its sizes bind or check extents.
    extent_rules: dict[int, list[dict]]
    tensor_names: list[str]
    int_names: list[str]
    number_of_streams: int  # int slot of numberOfStreams, or -1
    groups: list  # ProcessGroup objects, indexed by the instructions
    world_group: int  # index in groups of the default group, or -1
    container: HostIrContainer

    def dump(self) -> str:
        return flat_dump.dump(self)


class _Compiler:
    def __init__(self, container: HostIrContainer, communicator, rank: int | None = None):
        self.container = container
        self.sums_that_view = sums_that_view(container)
        self.summed_products = summed_products(container)
        self.comm = communicator
        # The rank the program was pruned for (None: it holds every rank's part).
        self.rank = rank
        self.alias = container.aliases.resolved()
        self.tensors: dict[ir.TensorView, int] = {}
        self.tensor_names: list[str] = []
        self.ints: dict[ir.Scalar, int] = {}
        self.int_names: list[str] = []
        self.scalars: list[tuple] = []
        self.scalar_nodes: dict[tuple, int] = {}
        self.streams: dict[ir.Stream, int] = {}
        self.groups: list = []
        self.group_index: dict[tuple, int] = {}
        # Where a select removed a dim, as the evaluator's `slice_dim`: a
        # chunk of a split axis removes none, a chunk of a selected slice
        # lacks the same dim.
        self.slice_dim = {
            e.out: layout.position(e.input, e.axis)
            for e in container.walk()
            if isinstance(e, ir.HirAliasSelect) and layout.select_kind(e.input, e.axis) == "select"
        }
        for e in container.walk():
            if isinstance(e, ir.HirAliasChunk) and e.input in self.slice_dim:
                self.slice_dim[e.out] = self.slice_dim[e.input]
        # For each compute op of a multi-device program, the operand axes it
        # reads this rank's slice of (as the evaluator finds them).
        source = {e.out: e.input for e in container.walk() if isinstance(e, (ir.HirAliasSelect, ir.HirAliasChunk))}
        multi_device = bool(container.meshes())
        self.local_slices = {
            id(e): _local_slices(e, source) for e in container.walk() if multi_device and isinstance(e, ir.COMPUTE_OPS)
        }
        # Outputs of communications over a team of one bound to a view of
        # their input (their Allocate makes nothing), as the evaluator does;
        # a program output the caller gave a buffer for is copied into it.
        self.local_views = local_views(container, source, self.alias)
        self.instrs: list[Instr] = []
        # The StartCoalescing of the coalescing group being compiled, if any.
        self.coalescing: Instr | None = None

    # -- slots
    def tensor(self, tv: ir.TensorView) -> int:
        tv = self.alias.get(tv, tv)
        slot = self.tensors.get(tv)
        if slot is None:
            slot = self.tensors[tv] = len(self.tensor_names)
            self.tensor_names.append(printer.format_tv(tv))
        return slot

    def int_slot(self, s: ir.Scalar) -> int:
        slot = self.ints.get(s)
        if slot is None:
            slot = self.ints[s] = len(self.int_names)
            self.int_names.append(printer.format_scalar(s))
        return slot

    def scalar(self, s: ir.Scalar) -> int:
        """The node of scalar `s` (constants fold to a "const" node)."""
        if isinstance(s, ir.ScalarExpr):
            node = (s.op, self.scalar(s.lhs), self.scalar(s.rhs))
        elif s.is_constant:
            node = ("const", int(s.value))
        elif s.label == "rank" and self.comm is not None:
            node = ("const", int(self.comm.rank))
        else:
            node = ("slot", self.int_slot(s))
        index = self.scalar_nodes.get(node)
        if index is None:
            index = self.scalar_nodes[node] = len(self.scalars)
            self.scalars.append(node)
        return index

    def stream(self, s: ir.Stream) -> dict:
        if s.index is not None:
            return {"stream_index": self.scalar(s.index), "stream_slot": -1, "stream_key": 0}
        slot = self.streams.setdefault(s, len(self.streams))
        # The pool key of a `Stream` without index that no GetCurrentStream
        # captured: negative, so it never meets an indexed stream's key.
        return {"stream_index": -1, "stream_slot": slot, "stream_key": -1 - slot}

    def group(self, team) -> int:
        key = tuple(team)
        index = self.group_index.get(key)
        if index is None:
            index = self.group_index[key] = len(self.groups)
            self.groups.append(self.comm.group(key))
        return index

    def emit(self, op: str, expr: ir.Expr, **fields) -> Instr:
        instr = Instr(op, fields, expr)
        self.instrs.append(instr)
        return instr

    def unsqueeze_dim(self, tv: ir.TensorView) -> int:
        return self.slice_dim.get(tv, -1)

    # -- the program
    def compile(self) -> FlatProgram:
        c = self.container
        c.check_inputs_unaliased()
        reason = unsupported(c)
        if reason is not None:
            raise MissingHandlerError(f"the C++ executor cannot run this program: {reason}")
        needs = [
            e
            for e in c.walk()
            if isinstance(e, ir.COMMUNICATION_OPS)
            and not (isinstance(e, ir.Wait) and isinstance(e.communication, ir.Transfer))
        ]
        if needs and self.comm is None:
            raise BindingError(
                f"A communicator must be provided: the program has communications, such as\n"
                f"{printer.format_expr_head(needs[0])}"
            )
        # A scalar input is an integer slot, listed as -2 - slot.
        inputs = [self.tensor(v) if isinstance(v, ir.TensorView) else -2 - self.int_slot(v) for v in c.inputs]
        outputs = [self.tensor(tv) if tv.held_by(self.rank) else -1 for tv in c.outputs]
        named = c.named_scalars()
        nos = named.get("numberOfStreams")
        number_of_streams = self.int_slot(nos) if nos is not None else -1
        self.body_locals = self._find_body_locals()
        self.scope(c.exprs)
        rules = {}
        for tv in [t for t in c.inputs if isinstance(t, ir.TensorView)] + [
            t for t in c.outputs if t.held_by(self.rank)
        ]:
            rules[self.tensor(tv)] = self.extent_rules(tv)
        world = -1
        if self.comm is not None and any(isinstance(e, ir.P2PCommunication) for e in c.walk()):
            world = len(self.groups)
            # P2P communications use the default group, like dist.isend.
            self.groups.append(dist.group.WORLD)
        return FlatProgram(
            instrs=self.instrs,
            scalars=self.scalars,
            num_tensors=len(self.tensor_names),
            num_ints=len(self.int_names),
            num_streams=len(self.streams),
            inputs=inputs,
            outputs=outputs,
            extent_rules=rules,
            tensor_names=self.tensor_names,
            int_names=self.int_names,
            number_of_streams=number_of_streams,
            groups=self.groups,
            world_group=world,
            container=c,
        )

    def scope(self, exprs) -> None:
        for e in exprs:
            _COMPILERS[type(e)](self, e)

    def _find_body_locals(self) -> dict[int, list[int]]:
        """For each loop, the slots first defined in its body (unbound at
        every iteration); program inputs and outputs excepted."""
        c = self.container
        resolve = c.aliases.resolve
        keep = {resolve(t) for t in c.inputs + c.outputs}
        found = {}
        for e in c.walk():
            if isinstance(e, ir.ForLoop):
                local = {resolve(t) for inner in ir.walk(e.body) for t in ir.defined_tvs(inner)}
                # By name, so that slot numbers (and the dump) never depend
                # on the order of a set.
                ordered = sorted(local - keep, key=lambda t: t.name)
                found[id(e)] = sorted(self.tensor(t) for t in ordered)
        return found

    def extent_rules(self, tv: ir.TensorView) -> list[dict]:
        """How each runtime dim of a bound tensor binds or checks its extent
        (the C++ twin of `Frame.bind_extents`): a mesh_x dim holds size 1
        (an unsplit one binds its extent to the mesh's size), any other dim
        binds or checks the extent of its logical axis, scaled by the mesh
        pieces split off it."""
        rules = []
        for dim in layout.dims(tv):
            first = dim[0]
            rule = {
                "extent": -1,
                "text": "",
                "mesh_size": 0,
                "axis_text": printer.format_id(first),
                "bind_slot": -1,
                "factor": 1,
                "scale": 1,
                "error": "",
            }
            rules.append(rule)
            if first.is_device_parallel:
                rule["mesh_size"] = tv.mesh.size_along(first.parallel_type)
                if first.parent is not None:
                    continue
                target = first.extent
            else:
                axis = layout.logical_axis(first)
                target = axis.extent
                rule["scale"] = layout.global_extent(axis, 1)
            rule["extent"] = self.scalar(target)
            rule["text"] = printer.format_scalar(target)
            if isinstance(target, ir.ScalarExpr):
                if target.op == "/" and target.rhs.is_constant and not isinstance(target.lhs, ir.ScalarExpr):
                    rule["factor"] = int(target.rhs.value)
                    target = target.lhs
                else:
                    rule["error"] = f"cannot infer {printer.format_scalar(target)} from a size"
                    target = None
            if target is not None and not target.is_constant:
                rule["bind_slot"] = self.int_slot(target)
        return rules

    # -- layouts (the evaluator's `_operand` and `_store`)
    def view(self, e: ir.Expr, tv, full_rank: bool = False) -> dict:
        """How `e` reads operand `tv`: the runtime dims each logical axis
        merges, and the cuts to this rank's slice of a replicated axis
        where `e`'s output is sharded."""
        if not isinstance(tv, ir.TensorView):
            return {"logical": [], "cuts": []}
        cuts = self.local_slices.get(id(e), {}).get(id(tv), ())
        removed = self.slice_dim.get(tv)
        logical = []
        if removed is not None:
            if not full_rank:
                cuts = [(pos - (pos > removed), o, i) for pos, o, i in cuts if pos != removed]
        else:
            logical = logical_groups(tv)
        compiled = []
        for pos, o, i in cuts:
            mesh = e.out.mesh
            missing = layout.device_types(o) - layout.device_types(i)
            sizes, narrows = [], []
            for j, x in enumerate(o.loop_leaves()):
                if x.is_device_parallel:
                    sizes.append(mesh.size_along(x.parallel_type) if x.parallel_type in missing else 1)
                elif x.extent.is_constant:
                    sizes.append(int(x.extent.value))
                else:
                    sizes.append(-1)
                if x.parallel_type in missing:
                    narrows += [j, mesh.index_along(self.comm.rank, x.parallel_type)]
            compiled.append({"pos": pos, "sizes": sizes, "narrows": narrows})
        return {"logical": logical, "cuts": compiled}

    def layouts(self, e: ir.Expr, operands, full_rank: bool = False) -> dict:
        """The `views` and `store` fields of compute op `e` (none where every
        operand and the output are read and written as they are bound)."""
        fields = {}
        views = [self.view(e, v, full_rank) for v in operands]
        if any(v["logical"] or v["cuts"] for v in views):
            fields["views"] = views
        partial = getattr(e, "partial", None) is not None
        runtime, logical = _runtime_order(e.out), logical_groups(e.out)
        if partial or runtime or logical:
            fields["store"] = {
                "partial": partial,
                "slice": e.out in self.slice_dim,
                "runtime": runtime,
                "logical": logical,
            }
        return fields


def _runtime_order(tv: ir.TensorView) -> list[int]:
    """Each runtime dim of `tv` as the logical axis whose size it takes, -1
    for a mesh_x piece of size 1 (empty: the logical shape is the runtime
    one), as `layout.to_runtime`."""
    runtime = layout.dims(tv)
    logical = tv.logical_runtime()
    if len(runtime) == len(logical):
        return []
    order = []
    for k, axis in enumerate(logical):
        pieces = [dim for dim in runtime if layout.logical_axis(dim[0]) is axis]
        order += [-1 if dim[0].is_device_parallel else k for dim in pieces]
    return order


# ---------------------------------------------------------------- per op

_COMPILERS = {}


def _compiles(op_class):
    def wrap(fn):
        _COMPILERS[op_class] = fn
        return fn

    return wrap


@_compiles(ir.ForLoop)
def _for(cc: _Compiler, e: ir.ForLoop) -> None:
    instr = cc.emit(
        "for",
        e,
        index=cc.int_slot(e.index),
        start=cc.scalar(e.start),
        stop=cc.scalar(e.stop),
        locals=cc.body_locals[id(e)],
        end=-1,
    )
    cc.scope(e.body)
    instr.fields["end"] = len(cc.instrs)


@_compiles(ir.IfThenElse)
def _if(cc: _Compiler, e: ir.IfThenElse) -> None:
    # The then-branch is [here + 1, end), the else-branch [end, else_end).
    instr = cc.emit("if", e, cond=cc.scalar(e.predicate), end=-1, else_end=-1)
    cc.scope(e.then_body)
    instr.fields["end"] = len(cc.instrs)
    cc.scope(e.else_body)
    instr.fields["else_end"] = len(cc.instrs)


@_compiles(ir.GetCurrentStream)
def _get_stream(cc, e) -> None:
    cc.emit("get_stream", e, slot=cc.streams.setdefault(e.stream, len(cc.streams)))


@_compiles(ir.SetCurrentStream)
def _set_stream(cc, e) -> None:
    cc.emit("set_stream", e, **cc.stream(e.stream))


@_compiles(ir.Synchronize)
def _synchronize(cc, e) -> None:
    cc.emit("synchronize", e, **cc.stream(e.stream))


@_compiles(ir.HirAliasSelect)
def _select(cc, e) -> None:
    if layout.select_kind(e.input, e.axis) == "chunk":
        # The outer piece of a split axis: chunk `index` of `extent` chunks
        # of ceilDiv-sized rows (`layout.chunk_bounds`).
        cc.emit(
            "chunk",
            e,
            out=cc.tensor(e.out),
            input=cc.tensor(e.input),
            dim=layout.position(e.input, e.axis),
            index=cc.scalar(e.index),
            parts=cc.scalar(e.axis.extent),
            equal=False,
        )
        return
    cc.emit(
        "select",
        e,
        out=cc.tensor(e.out),
        input=cc.tensor(e.input),
        dim=cc.slice_dim[e.out],
        index=-1 if e.axis.is_broadcast else cc.scalar(e.index),
    )


@_compiles(ir.HirAliasChunk)
def _chunk(cc, e) -> None:
    cc.emit(
        "chunk",
        e,
        out=cc.tensor(e.out),
        input=cc.tensor(e.input),
        dim=layout.position(e.input, e.axis),
        index=cc.scalar(e.index),
        parts=cc.scalar(ir.Scalar.constant(e.parts)),
        equal=True,
    )


@_compiles(ir.Allocate)
def _allocate(cc, e) -> None:
    if e.buffer in cc.local_views:
        return
    # A symmetric buffer is a window of the copy-engine transport: the C++
    # executor views the window Python made for it (runtime/transports/cuda.py).
    fields = {"symmetric": True} if e.memory_type is ir.MemoryType.symmetric else {}
    cc.emit(
        "allocate",
        e,
        out=cc.tensor(e.buffer),
        shape=local_shape(cc, e.buffer),
        dtype=_DTYPES[e.buffer.dtype],
        zero_init=bool(e.zero_init),
        **fields,
    )


@_compiles(ir.Deallocate)
def _deallocate(cc, e) -> None:
    if id(e) in cc.summed_products.skipped:
        return  # a product its sum's matmul never makes
    cc.emit("deallocate", e, out=cc.tensor(e.buffer))


@_compiles(ir.Set)
def _set(cc, e) -> None:
    cc.emit("set", e, out=cc.tensor(e.out), input=cc.tensor(e.input))


def _operand(cc: _Compiler, v) -> dict:
    """A tensor slot, a constant number, or an integer scalar node."""
    if isinstance(v, ir.TensorView):
        return {"tensor": cc.tensor(v)}
    if v.is_constant:
        value = v.value
        kind = "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "float"
        return {"number": float(value), "kind": kind}
    return {"scalar": cc.scalar(v)}


@_compiles(ir.UnaryOp)
def _unary(cc, e) -> None:
    cc.emit(
        "unary",
        e,
        out=cc.tensor(e.out),
        input=cc.tensor(e.input),
        kind=e.kind,
        dtype=_DTYPES[e.out.dtype],
        **cc.layouts(e, [e.input]),
    )


@_compiles(ir.BinaryOp)
def _binary(cc, e) -> None:
    cc.emit(
        "binary",
        e,
        out=cc.tensor(e.out),
        kind=e.kind,
        lhs=_operand(cc, e.lhs),
        rhs=_operand(cc, e.rhs),
        **cc.layouts(e, [e.lhs, e.rhs]),
    )


@_compiles(ir.ReductionOp)
def _reduction(cc, e) -> None:
    if id(e) in cc.summed_products.skipped:
        return  # made by its matmul
    cc.emit(
        "reduction",
        e,
        out=cc.tensor(e.out),
        input=cc.tensor(e.input),
        kind=e.kind,
        # Over the logical axes, as the evaluator reduces.
        dims=[i for i, d in enumerate(e.out.logical) if d.is_reduction],
        dtype=_DTYPES[e.out.dtype],
        **({"view_sum": True} if id(e) in cc.sums_that_view else {}),
        **cc.layouts(e, [e.input]),
    )


@_compiles(ir.Transfer)
def _transfer(cc, e) -> None:
    # A posted one is host-to-device (`unsupported`): on the copy stream.
    fields = {"copy_stream": True} if e.posted else {}
    cc.emit("transfer", e, out=cc.tensor(e.out), input=cc.tensor(e.input), h2d=e.direction == "H2D", **fields)


@_compiles(ir.PermuteOp)
def _permute(cc, e) -> None:
    fields = {}
    if e.input.device_axes() or e.out.device_axes():
        # This rank's piece, permuted with its logical axes, bound fresh.
        fields["views"] = [{"logical": logical_groups(e.input), "cuts": []}]
        fields["store"] = {"partial": False, "slice": False, "runtime": _runtime_order(e.out), "logical": []}
    cc.emit(
        "permute",
        e,
        out=cc.tensor(e.out),
        out_dim=cc.unsqueeze_dim(e.out),
        input=cc.tensor(e.input),
        a_dim=cc.unsqueeze_dim(e.input),
        dims=list(e.dims),
        **fields,
    )


@_compiles(ir.MatmulOp)
def _matmul(cc, e) -> None:
    # A matmul and the sum over its batch axes that alone reads it run as
    # one: operands read as the matmul's, the result stored as the sum's.
    total = cc.summed_products.sums.get(id(e))
    out = e.out if total is None else total.out
    fields = dict(
        out=cc.tensor(out),
        out_dim=cc.unsqueeze_dim(out),
        a=cc.tensor(e.a),
        a_dim=cc.unsqueeze_dim(e.a),
        b=cc.tensor(e.b),
        b_dim=cc.unsqueeze_dim(e.b),
    )
    layouts = cc.layouts(e, [e.a, e.b], full_rank=True)
    if total is None:
        fields.update({"accumulate": True} if e.accumulate else {}, **layouts)
    else:
        fields.update(sum_dims=[i for i, d in enumerate(out.logical) if d.is_reduction], dtype=_DTYPES[out.dtype])
        fields.update({k: v for k, v in layouts.items() if k == "views"})
        fields.update({k: v for k, v in cc.layouts(total, [total.input]).items() if k == "store"})
    cc.emit("matmul", e, **fields)


@_compiles(ir.LinearOp)
def _linear(cc, e) -> None:
    cc.emit(
        "linear",
        e,
        out=cc.tensor(e.out),
        out_dim=cc.unsqueeze_dim(e.out),
        a=cc.tensor(e.input),
        a_dim=cc.unsqueeze_dim(e.input),
        b=cc.tensor(e.weight),
        b_dim=cc.unsqueeze_dim(e.weight),
        bias=-1 if e.bias is None else cc.tensor(e.bias),
        bias_dim=-1 if e.bias is None else cc.unsqueeze_dim(e.bias),
        **({"accumulate": True} if e.accumulate else {}),
        **cc.layouts(e, [e.input, e.weight] + ([] if e.bias is None else [e.bias]), full_rank=True),
    )


# The index ops, at full rank as the evaluator runs them: `input` (a_dim),
# the index `b` (b_dim) and put_add's `like` (like_dim), which gives only
# its sizes.


@_compiles(ir.TopKOp)
def _topk(cc, e) -> None:
    cc.emit(
        "topk",
        e,
        out=cc.tensor(e.out),
        out_dim=cc.unsqueeze_dim(e.out),
        input=cc.tensor(e.input),
        a_dim=cc.unsqueeze_dim(e.input),
        k=e.k,
        **cc.layouts(e, [e.input], full_rank=True),
    )


@_compiles(ir.RouteOp)
def _route(cc, e) -> None:
    cc.emit(
        "route",
        e,
        out=cc.tensor(e.out),
        out_dim=cc.unsqueeze_dim(e.out),
        input=cc.tensor(e.indices),
        a_dim=cc.unsqueeze_dim(e.indices),
        experts=e.experts,
        capacity=e.capacity,
        what=e.what,
        groups=e.groups,
        **({"packed": True} if e.packed else {}),
        **cc.layouts(e, [e.indices], full_rank=True),
    )


@_compiles(ir.TakeOp)
def _take(cc, e) -> None:
    cc.emit(
        "take",
        e,
        out=cc.tensor(e.out),
        out_dim=cc.unsqueeze_dim(e.out),
        input=cc.tensor(e.input),
        a_dim=cc.unsqueeze_dim(e.input),
        b=cc.tensor(e.index),
        b_dim=cc.unsqueeze_dim(e.index),
        batch=e.batch,
        features=e.features,
        **cc.layouts(e, [e.input, e.index], full_rank=True),
    )


@_compiles(ir.PutAddOp)
def _put_add(cc, e) -> None:
    cc.emit(
        "put_add",
        e,
        out=cc.tensor(e.out),
        out_dim=cc.unsqueeze_dim(e.out),
        input=cc.tensor(e.input),
        a_dim=cc.unsqueeze_dim(e.input),
        b=cc.tensor(e.index),
        b_dim=cc.unsqueeze_dim(e.index),
        like=cc.tensor(e.like),
        like_dim=cc.unsqueeze_dim(e.like),
        batch=e.batch,
        features=e.features,
        **({"distinct": True} if e.distinct else {}),
        **cc.layouts(e, [e.input, e.index, e.like], full_rank=True),
    )


# The grouped ops, at full rank as the evaluator runs them: the rows
# `input` (a_dim), the weight or the other rows `b` (b_dim) and the
# `counts` (counts_dim); grouped_outer's `wbatch`, the batch axes its
# output keeps.


@_compiles(ir.GroupedMmOp)
def _grouped_mm(cc, e) -> None:
    cc.emit(
        "grouped_mm",
        e,
        out=cc.tensor(e.out),
        out_dim=cc.unsqueeze_dim(e.out),
        input=cc.tensor(e.input),
        a_dim=cc.unsqueeze_dim(e.input),
        b=cc.tensor(e.weight),
        b_dim=cc.unsqueeze_dim(e.weight),
        counts=cc.tensor(e.counts),
        counts_dim=cc.unsqueeze_dim(e.counts),
        **cc.layouts(e, [e.input, e.weight, e.counts], full_rank=True),
    )


@_compiles(ir.GroupedOuterOp)
def _grouped_outer(cc, e) -> None:
    cc.emit(
        "grouped_outer",
        e,
        out=cc.tensor(e.out),
        out_dim=cc.unsqueeze_dim(e.out),
        input=cc.tensor(e.input),
        a_dim=cc.unsqueeze_dim(e.input),
        b=cc.tensor(e.other),
        b_dim=cc.unsqueeze_dim(e.other),
        counts=cc.tensor(e.counts),
        counts_dim=cc.unsqueeze_dim(e.counts),
        wbatch=e.out.logical_ndim - 3,
        **cc.layouts(e, [e.input, e.other, e.counts], full_rank=True),
    )


# The shape ops that cut and join, at full rank as the evaluator runs
# them: slice's operand `input` (a_dim) read as bound, its result a view;
# cat's `input` (a_dim) and `other` (`b`, b_dim); insert's `input` (a_dim)
# and `like` (like_dim), which gives only its sizes. `ranges`: a (start,
# stop, step) per axis, stop -1 to the end.


def _flat_ranges(ranges) -> list[int]:
    return [v for start, stop, step in ranges for v in (start, -1 if stop is None else stop, step)]


@_compiles(ir.SliceOp)
def _slice(cc, e) -> None:
    cc.emit(
        "slice",
        e,
        out=cc.tensor(e.out),
        out_dim=cc.unsqueeze_dim(e.out),
        input=cc.tensor(e.input),
        a_dim=cc.unsqueeze_dim(e.input),
        ranges=_flat_ranges(e.ranges),
    )


@_compiles(ir.CatOp)
def _cat(cc, e) -> None:
    cc.emit(
        "cat",
        e,
        out=cc.tensor(e.out),
        out_dim=cc.unsqueeze_dim(e.out),
        input=cc.tensor(e.input),
        a_dim=cc.unsqueeze_dim(e.input),
        b=cc.tensor(e.other),
        b_dim=cc.unsqueeze_dim(e.other),
        dim=e.dim,
        **cc.layouts(e, [e.input, e.other], full_rank=True),
    )


@_compiles(ir.InsertOp)
def _insert(cc, e) -> None:
    where = {"ranges": _flat_ranges(e.ranges)} if e.ranges is not None else {"dim": e.dim, "index": cc.scalar(e.index)}
    cc.emit(
        "insert",
        e,
        out=cc.tensor(e.out),
        out_dim=cc.unsqueeze_dim(e.out),
        input=cc.tensor(e.input),
        a_dim=cc.unsqueeze_dim(e.input),
        like=cc.tensor(e.like),
        like_dim=cc.unsqueeze_dim(e.like),
        dtype=_DTYPES[e.out.dtype],
        **where,
        **cc.layouts(e, [e.input, e.like], full_rank=True),
    )


_COMPILERS.update(
    {
        ir.Communication: flat_communications.communication,
        ir.P2PCommunication: flat_communications.p2p,
        ir.StartCoalescing: flat_communications.start_coalescing,
        ir.EndCoalescing: flat_communications.end_coalescing,
        ir.Wait: flat_communications.wait,
    }
)


def unsupported(container: HostIrContainer) -> str | None:
    """Why the C++ executor cannot run `container` (the first reason), or
    None if it can."""
    reasons = unsupported_reasons(container)
    return reasons[0] if reasons else None


def unsupported_reasons(container: HostIrContainer) -> list[str]:
    """Every reason the C++ executor cannot run `container`, each kind once
    (with its first op), as `hostir.runtime.support` declares what the core
    runs: an op it has no instruction for, a communication only Python
    posts (the copy-engine transport, a root chosen at run time, symmetric
    memory), a float scalar input (or a bool one an op computes with), or a
    loop that walks chunks of a split axis. Split axes, sharded operands
    and partial sums run in C++ with the evaluator's layouts
    (`_Compiler.view` and `layouts`)."""
    found = support.scalar_reasons(container.inputs, container.walk())
    for e in container.walk():
        chunk = isinstance(e, ir.HirAliasSelect) and layout.select_kind(e.input, e.axis) == "chunk"
        for kind, text in support.expr_reasons(e, chunk).items():
            found.setdefault(kind, text)
    return list(found.values())


def compile_program(container: HostIrContainer, communicator=None, rank: int | None = None) -> FlatProgram:
    """The flat program of `container` (for a multi-device program, of the
    communicator's rank, with its process groups, which must exist);
    `rank`: the rank the program was pruned for, if it was."""
    return _Compiler(container, communicator, rank).compile()
