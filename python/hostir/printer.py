"""The text format of fusions and host programs.

It follows nvFuser's host-IR dump line for line, so a golden dump reads like
the reference pull request: `T1_g_float[iStreamIdx2{i0}, iS3{i2}]` for a
tensor, one op per line (two for ops with a result), loop bodies indented by
two spaces, and an `Aliases:{...}` block when the alias map is not empty.
"""

from __future__ import annotations

from hostir import ir, layout
from hostir.ir import format_id, format_scalar, format_stream, format_tv
from hostir.errors import DefinitionTypeError

INDENT = "  "


def format_val(v) -> str:
    if isinstance(v, ir.TensorView):
        return format_tv(v)
    if isinstance(v, ir.Scalar):
        return format_scalar(v)
    if isinstance(v, ir.Stream):
        return format_stream(v)
    if isinstance(v, ir.IterDomain):
        return format_id(v)
    raise DefinitionTypeError(f"cannot print {type(v).__name__}")


def _assign(pad: str, out: ir.TensorView, rhs: str) -> list[str]:
    return [f"{pad}{format_tv(out)}", f"{pad}   = {rhs}"]


def _lines(e: ir.Expr, pad: str) -> list[str]:
    """The dump lines of one expr (a loop prints its body too)."""
    fmt = _FORMATS.get(type(e))
    if fmt is None:
        raise DefinitionTypeError(f"no text format for {type(e).__name__}")
    return fmt(e, pad)


def _set(e: ir.Set, pad):
    rows = "" if e.rows is None else f", rows = {format_tv(e.rows)}, rows_in = {format_tv(e.rows_in)}"
    return _assign(pad, e.out, f"Set( {format_tv(e.input)}{rows}, cache_op=Streaming )")


def _binary(e: ir.BinaryOp, pad):
    if e.kind.symbol is None:  # a derivative, printed as a call
        return _assign(pad, e.out, f"{e.kind}( {format_val(e.lhs)}, {format_val(e.rhs)} )")
    return [
        f"{pad}{format_tv(e.out)}",
        f"{pad}   = {format_val(e.lhs)}",
        f"{pad}   {e.kind.symbol} {format_val(e.rhs)};",
    ]


def _unary(e: ir.UnaryOp, pad):
    return _assign(pad, e.out, f"{e.kind}( {format_tv(e.input)} )")


def _reduction(e: ir.ReductionOp, pad):
    init = f"{ir.dtype_name(e.out.dtype)}({e.kind.initial})"
    op = e.kind.dump_name
    return _assign(
        pad,
        e.out,
        f"reduction( {format_tv(e.input)}, op = {op}, initial value = {init}, allreduce = false )",
    )


def _partial(e) -> str:
    text = "" if e.partial is None else f", partial = {format_id(e.partial)}"
    return text + (", accumulate = true" if e.accumulate else "")


def _matmul(e: ir.MatmulOp, pad):
    return _assign(pad, e.out, f"matmul( {format_tv(e.a)}, {format_tv(e.b)}{_partial(e)} )")


def _linear(e: ir.LinearOp, pad):
    args = [e.input, e.weight] + ([e.bias] if e.bias is not None else [])
    return _assign(pad, e.out, f"linear( {', '.join(format_tv(a) for a in args)}{_partial(e)} )")


def _broadcast_in_dim(e: ir.BroadcastInDimOp, pad):
    dims = ", ".join(map(str, e.dims))
    return _assign(pad, e.out, f"broadcast_in_dim( {format_tv(e.input)}, dims = {{{dims}}} )")


def _permute(e: ir.PermuteOp, pad):
    dims = ", ".join(map(str, e.dims))
    return _assign(pad, e.out, f"permute( {format_tv(e.input)}, dims = {{{dims}}} )")


def _reshape(e: ir.ReshapeOp, pad):
    shape = ", ".join(map(str, e.shape))
    return _assign(pad, e.out, f"reshape( {format_tv(e.input)}, shape = {{{shape}}} )")


def _slice(e: ir.SliceOp, pad):
    ranges = ", ".join(
        f"{{{start} : {'end' if stop is None else stop} : {step}}}" for start, stop, step in e.ranges
    )
    return _assign(pad, e.out, f"slice( {format_tv(e.input)}, {ranges} )")


def _select_op(e: ir.SelectOp, pad):
    return _assign(pad, e.out, f"select( {format_tv(e.input)}, dim = {e.dim}, index = {format_scalar(e.index)} )")


def _cat(e: ir.CatOp, pad):
    return _assign(pad, e.out, f"cat( {format_tv(e.input)}, {format_tv(e.other)}, dim = {e.dim} )")


def _expand(e: ir.ExpandOp, pad):
    dims = ", ".join(map(str, e.dims))
    return _assign(pad, e.out, f"expand( {format_tv(e.input)}, like = {format_tv(e.like)}, new dims = {{{dims}}} )")


def _insert(e: ir.InsertOp, pad):
    if e.ranges is not None:
        where = ", ".join(
            f"{{{start} : {'end' if stop is None else stop} : {step}}}" for start, stop, step in e.ranges
        )
    else:
        where = f"dim = {e.dim}, index = {format_scalar(e.index)}"
    return _assign(pad, e.out, f"insert( {format_tv(e.input)}, into zeros like {format_tv(e.like)}, {where} )")


def _topk(e: ir.TopKOp, pad):
    return _assign(pad, e.out, f"topk( {format_tv(e.input)}, k = {e.k} )")


def _route(e: ir.RouteOp, pad):
    groups = f", groups = {e.groups}" if e.what != "slot" or e.packed else ""
    packed = ", packed" if e.packed else ""
    return _assign(
        pad,
        e.out,
        f"route_{e.what}( {format_tv(e.indices)}, experts = {e.experts}, capacity = {e.capacity}{groups}{packed} )",
    )


def _grouped_mm(e: ir.GroupedMmOp, pad):
    return _assign(
        pad, e.out, f"grouped_mm( {format_tv(e.input)}, {format_tv(e.weight)}, counts = {format_tv(e.counts)} )"
    )


def _grouped_outer(e: ir.GroupedOuterOp, pad):
    return _assign(
        pad, e.out, f"grouped_outer( {format_tv(e.input)}, {format_tv(e.other)}, counts = {format_tv(e.counts)} )"
    )


def _take(e: ir.TakeOp, pad):
    where = f"batch = {e.batch}, features = {e.features}"
    if e.inverse is not None:
        where = f"inverse = {format_tv(e.inverse)}, {where}"
    return _assign(pad, e.out, f"take( {format_tv(e.input)}, {format_tv(e.index)}, {where} )")


def _put_add(e: ir.PutAddOp, pad):
    where = f"batch = {e.batch}, features = {e.features}" + (", distinct" if e.distinct else "")
    return _assign(
        pad,
        e.out,
        f"put_add( {format_tv(e.input)}, {format_tv(e.index)}, into zeros like {format_tv(e.like)}, {where} )",
    )


def _get_stream(e: ir.GetCurrentStream, pad):
    return [f"{pad}GetCurrentStream into {format_stream(e.stream)}"]


def _set_stream(e: ir.SetCurrentStream, pad):
    return [f"{pad}SetCurrentStream to {format_stream(e.stream)}"]


def _synchronize(e: ir.Synchronize, pad):
    return [f"{pad}Synchronize {format_stream(e.stream)}"]


def _if(e: ir.IfThenElse, pad):
    lines = [f"{pad}IF {format_scalar(e.predicate)}:"]
    for inner in e.then_body:
        lines += _lines(inner, pad + INDENT)
    if e.else_body:
        lines.append(f"{pad}ELSE:")
        for inner in e.else_body:
            lines += _lines(inner, pad + INDENT)
    return lines


def _for(e: ir.ForLoop, pad):
    index = format_scalar(e.index)
    if e.iter_domain is not None:
        head = f"{pad}FOR {index} in {format_id(e.iter_domain)}:"
    else:
        head = f"{pad}FOR {index} from {format_scalar(e.start)} to {format_scalar(e.stop)}:"
    notes = [] if e.schedule is None else [e.schedule]
    if e.stream_parallel:
        caller = f" while the caller runs the {e.caller_ops} ops before it" if e.caller_ops else ""
        if e.caller_after:
            caller += f"{' and' if e.caller_ops else ' while the caller runs'} the {e.caller_after} ops after it"
        notes.append(f"on worker streams{caller}")
    if e.joins_workers:
        notes.append("each iteration after its worker's")
    if notes:
        head = f"{head[:-1]} ({'; '.join(notes)}):"
    lines = [head]
    for inner in e.body:
        lines += _lines(inner, pad + INDENT)
    return lines


def _select(e: ir.HirAliasSelect, pad):
    rhs = (
        f"HirAliasSelect( {format_tv(e.input)}, axis = {format_id(e.axis)}, "
        f"index = {format_scalar(e.index)} )"
    )
    return _assign(pad, e.out, rhs)


def _chunk(e: ir.HirAliasChunk, pad):
    rhs = (
        f"HirAliasChunk( {format_tv(e.input)}, axis = {format_id(e.axis)}, "
        f"index = {format_scalar(e.index)}, parts = {e.parts} )"
    )
    return _assign(pad, e.out, rhs)


def _allocate(e: ir.Allocate, pad):
    tv = format_tv(e.buffer)
    zero = "true" if e.zero_init else "false"
    return [
        f"{pad}{tv} = ALLOCATE(buffer={tv}, mem_type={e.memory_type.word}, "
        f"size={format_scalar(_allocation_size(e))}, zero_init={zero}, resets_to_zero=false)"
    ]


def _deallocate(e: ir.Deallocate, pad):
    return [f"{pad}Deallocate {{", f"{pad}{INDENT}{format_tv(e.buffer)}", f"{pad}}}"]


def _communication(e: ir.Communication, pad):
    fields = [f"type={e.type.value}", "team=(" + " ".join(map(str, e.team)) + ")"]
    if e.parallel_type is not ir.ParallelType.mesh_x:
        fields.append(f"along={e.parallel_type.name}")
    if e.root is not None:
        root = format_scalar(e.root) if isinstance(e.root, ir.Scalar) else e.root
        fields.append(f"root={root}")
    if e.red_op is not None:
        fields.append(f"red_op={e.red_op}")
    if e.local_reduce:
        fields.append("local_reduce=(" + " ".join(map(str, e.local_reduce)) + ")")
    fields += [f"input={format_tv(e.input)}", f"output={format_tv(e.out)}"]
    if e.rows is not None:
        fields += [f"rows={format_tv(e.rows)}", f"rows_in={format_tv(e.rows_in)}"]
    fields.append(f"backend={e.backend}")
    if e.schedule is not None:
        fields.append(f"schedule=({e.schedule})")
    return [f"{pad}Communication {e.name} ({', '.join(fields)})"]


def _p2p(e: ir.P2PCommunication, pad):
    into = "" if e.into is None else f", into={format_tv(e.into)}"
    return [
        f"{pad}P2PCommunication {e.name} (type={e.type}, buffer={format_tv(e.buffer)}, "
        f"peer={format_scalar(e.peer)}{into}, backend={e.backend})"
    ]


def _transfer(e: ir.Transfer, pad):
    fields = [f"type={e.direction}", f"input={format_tv(e.input)}", f"output={format_tv(e.out)}"]
    if not e.posted:
        fields.append(f"stream={e.stream}")
    if e.schedule is not None:
        fields.append(f"schedule=({e.schedule})")
    return [f"{pad}Transfer {e.name} ({', '.join(fields)})"]


def _start_coalescing(e: ir.StartCoalescing, pad):
    return [f"{pad}StartCoalescing"]


def _end_coalescing(e: ir.EndCoalescing, pad):
    return [f"{pad}EndCoalescing {e.name}"]


def _wait(e: ir.Wait, pad):
    what = "Transfer" if isinstance(e.communication, ir.Transfer) else "Communication"
    return [f"{pad}Wait {what} {e.communication.name}"]


_FORMATS = {
    ir.Set: _set,
    ir.UnaryOp: _unary,
    ir.BinaryOp: _binary,
    ir.ReductionOp: _reduction,
    ir.MatmulOp: _matmul,
    ir.LinearOp: _linear,
    ir.BroadcastInDimOp: _broadcast_in_dim,
    ir.PermuteOp: _permute,
    ir.ReshapeOp: _reshape,
    ir.SliceOp: _slice,
    ir.SelectOp: _select_op,
    ir.ExpandOp: _expand,
    ir.InsertOp: _insert,
    ir.CatOp: _cat,
    ir.TopKOp: _topk,
    ir.RouteOp: _route,
    ir.TakeOp: _take,
    ir.GroupedMmOp: _grouped_mm,
    ir.GroupedOuterOp: _grouped_outer,
    ir.PutAddOp: _put_add,
    ir.GetCurrentStream: _get_stream,
    ir.SetCurrentStream: _set_stream,
    ir.Synchronize: _synchronize,
    ir.ForLoop: _for,
    ir.IfThenElse: _if,
    ir.HirAliasSelect: _select,
    ir.HirAliasChunk: _chunk,
    ir.Allocate: _allocate,
    ir.Deallocate: _deallocate,
    ir.Communication: _communication,
    ir.P2PCommunication: _p2p,
    ir.StartCoalescing: _start_coalescing,
    ir.EndCoalescing: _end_coalescing,
    ir.Wait: _wait,
    ir.Transfer: _transfer,
}


def format_expr_head(e: ir.Expr) -> str:
    """One expr without a loop's body: what an error message quotes."""
    if isinstance(e, (ir.ForLoop, ir.IfThenElse)):
        return _lines(e, "")[0]
    return "\n".join(line.strip() for line in _lines(e, ""))


def _program(title: str, inputs, outputs, exprs) -> list[str]:
    ins = ", ".join(format_val(t) for t in inputs)
    outs = ", ".join(format_tv(t) for t in outputs)
    lines = [f"%{title} {{ ({ins}) -> ({outs}) :"]
    for e in exprs:
        lines += _lines(e, INDENT)
    lines.append(f"}} // %{title}")
    return lines


def print_fusion(fusion: ir.Fusion) -> str:
    return "\n".join(_program("Fusion", fusion.inputs, fusion.outputs, fusion.exprs)) + "\n"


def print_container(container) -> str:
    lines = _program("HostIrContainer", container.inputs, container.outputs, container.exprs)
    aliases = container.aliases.items()
    if aliases:
        lines.append("Aliases:{")
        lines += [f"{INDENT}{format_tv(a)} -> {format_tv(o)}" for a, o in aliases]
        lines.append("}")
    return "\n".join(lines) + "\n"


def _allocation_size(e: ir.Allocate) -> ir.Scalar:
    """The element count an Allocate prints (`layout.allocated_extents`)."""
    return layout.product(layout.allocated_extents(e.buffer))
