"""Replace every move between host and device memory by a `Transfer`.

Precondition: communications are lowered (`lower_communications`); a tensor
in host memory (`MemoryType.host`: an input defined with
`memory="host"` or streamed by the caller, or a `set` into host memory) is
read only by `Set`s and compute ops at the top level.
Postcondition: no compute op reads a tensor in host memory. A compute op
(or a loop holding one) that reads one reads a device copy instead, made
before it by `Allocate` + `Transfer` (H2D) + `Wait`, once per host tensor
(later readers share the copy). A `Set` from host to device memory, or from
device to host, becomes `Allocate` of its output (in its memory) +
`Transfer` + `Wait`; a `Set` from host to host stays a copy. On a CPU run a
transfer is a copy; on a GPU it runs on a copy stream of its direction, so
`hoist_transfers` can overlap it with the compute before it.

With `chunks` C > 1, a linear whose weight [N, K] is in host memory, read by
that linear alone, with N a constant that C divides, is split in C: its
weight moves as C transfers of N/C rows (views, `HirAliasChunk`, of the
host tensor and of its device copy), and C linears each wait for their
rows only and write their N/C columns of the output (allocated whole). So
the first rows compute while the rest move, and the next layer's weights
start moving as soon as the last rows are in.

    T2 = linear( T0, T1 )        T3_g = ALLOCATE(...)
    (T1 in host memory)     ->   Transfer 0 (type=H2D, input=T1_h..., output=T3_g...)
                                 Wait Transfer 0
                                 T2 = linear( T0, T3_g )
"""

from __future__ import annotations

from hostir import ir, printer
from hostir.container import HostIrContainer
from hostir.errors import HostIrError


class TransferLoweringError(HostIrError, ValueError):
    """A move between host and device memory this lowering cannot make."""


def lower_transfers(container: HostIrContainer, chunks: int = 1) -> HostIrContainer:
    if not any(ir.in_host_memory(v) for e in container.walk() for v in e.inputs() + e.outputs()):
        if not any(ir.in_host_memory(v) for v in container.inputs):
            return container
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise TransferLoweringError(f"chunks must be an integer >= 1, got {chunks!r}")
    readers: dict = {}
    for e in container.walk():
        for v in e.inputs():
            if ir.in_host_memory(v):
                readers.setdefault(v, []).append(e)
    result = container.derive()
    copies: dict[ir.TensorView, ir.TensorView] = {}
    for e in container.exprs:
        if chunks > 1 and _chunkable(e, readers, chunks):
            made = _chunked_linear(container, e, chunks, copies)
        else:
            made = _rewrite(container, e, copies)
        for new in made:
            result.push_back(new)
    return result


def _chunkable(e: ir.Expr, readers: dict, chunks: int) -> bool:
    if not isinstance(e, ir.LinearOp) or e.partial is not None or not ir.in_host_memory(e.weight):
        return False
    w = e.weight
    n = w.logical_runtime()[0].extent
    if readers.get(w) != [e] or not n.is_constant or n.value % chunks or w.is_split or w.device_axes():
        return False
    out = e.out
    return not out.is_split and not out.device_axes() and not out.stream_axes() and not ir.in_host_memory(e.input)


def _chunk_view(container, tv: ir.TensorView, axis: ir.IterDomain, index: int, parts: int, memory) -> tuple:
    domain = []
    for d in tv.domain:
        extent = d.extent
        if d is axis:
            extent = ir.Scalar.constant(d.extent.value // parts)
        domain.append(ir.IterDomain(container, extent, d.iter_type, d.parallel_type))
    piece = ir.TensorView(container, domain, tv.dtype, memory, mesh=tv.mesh)
    return piece, ir.HirAliasChunk(piece, tv, axis, ir.Scalar.constant(index), parts)


def _chunked_linear(container, e: ir.LinearOp, chunks: int, copies: dict) -> list[ir.Expr]:
    """`out = linear(x, W)` with W in host memory, as `chunks` transfers of
    row pieces of W and as many linears into column pieces of `out`."""
    made: list[ir.Expr] = []
    bias = e.bias
    if ir.in_host_memory(bias):
        if bias not in copies:
            copies[bias] = _device_copy(container, bias)
            made += _transfer(container, copies[bias], bias, "H2D", ir.MemoryType.global_)
        bias = copies[bias]
    w = e.weight
    device_w = copies[w] = _device_copy(container, w)
    made.append(ir.Allocate(device_w, ir.MemoryType.global_))
    moves = []
    for c in range(chunks):
        host_piece, bind_host = _chunk_view(container, w, w.domain[0], c, chunks, ir.MemoryType.host)
        dev_piece, bind_dev = _chunk_view(container, device_w, device_w.domain[0], c, chunks, ir.MemoryType.global_)
        t = ir.Transfer(container.next_name("transfer"), "H2D", dev_piece, host_piece)
        made += [bind_host, bind_dev, t]
        moves.append((t, dev_piece))
    out = e.out
    made.append(ir.Allocate(out, ir.MemoryType.global_))
    n_axis = out.loop_axes()[-1]
    for c, (t, dev_piece) in enumerate(moves):
        out_piece, bind_out = _chunk_view(container, out, n_axis, c, chunks, ir.MemoryType.global_)
        fields = {"weight": dev_piece, "out": out_piece}
        if bias is not None:
            bias_piece, bind_bias = _chunk_view(container, bias, bias.domain[0], c, chunks, ir.MemoryType.global_)
            made.append(bind_bias)
            fields["bias"] = bias_piece
        made += [ir.Wait(t), bind_out, e.replace(**fields)]
    return made


def _rewrite(container: HostIrContainer, e: ir.Expr, copies: dict) -> list[ir.Expr]:
    if isinstance(e, ir.Set) and (ir.in_host_memory(e.input) or ir.in_host_memory(e.out)):
        if ir.in_host_memory(e.input) and ir.in_host_memory(e.out):
            return [e]
        _check_local(e, e.input)
        direction = "H2D" if ir.in_host_memory(e.input) else "D2H"
        memory = ir.MemoryType.host if direction == "D2H" else ir.MemoryType.global_
        return _transfer(container, e.out, e.input, direction, memory)
    if isinstance(e, ir.ForLoop):
        _refuse_in_loop(e.body)
        read = [v for inner in ir.walk(e.body) for v in inner.inputs() if ir.in_host_memory(v)]
    else:
        read = [v for v in e.inputs() if ir.in_host_memory(v)]
    made: list[ir.Expr] = []
    for tv in dict.fromkeys(read):
        if tv not in copies:
            _check_local(e, tv)
            copies[tv] = _device_copy(container, tv)
            made += _transfer(container, copies[tv], tv, "H2D", ir.MemoryType.global_)
    if not read:
        return [e]
    return made + [_substitute(e, copies)]


def _transfer(container, out: ir.TensorView, src: ir.TensorView, direction: str, memory) -> list[ir.Expr]:
    t = ir.Transfer(container.next_name("transfer"), direction, out, src)
    return [ir.Allocate(out, memory), t, ir.Wait(t)]


def _device_copy(container: HostIrContainer, tv: ir.TensorView) -> ir.TensorView:
    domain = [ir.IterDomain(container, d.extent, d.iter_type, d.parallel_type) for d in tv.domain]
    return ir.TensorView(container, domain, tv.dtype, ir.MemoryType.global_, mesh=tv.mesh)


def _substitute(e: ir.Expr, copies: dict) -> ir.Expr:
    if isinstance(e, ir.ForLoop):
        return e.replace(body=[_substitute(inner, copies) for inner in e.body])
    changes = {f: copies[v] for f in e.INPUTS if (v := getattr(e, f)) in copies}
    return e.replace(**changes) if changes else e


def _check_local(e: ir.Expr, tv: ir.TensorView) -> None:
    if tv.is_split or tv.device_axes():
        raise TransferLoweringError(
            f"T{tv.name} is in host memory and split or sharded; a tensor in host memory moves whole "
            f"(shard or split its device copy instead):\n{printer.format_expr_head(e)}"
        )


def _refuse_in_loop(body) -> None:
    for inner in ir.walk(body):
        if isinstance(inner, ir.Set) and (ir.in_host_memory(inner.input) or ir.in_host_memory(inner.out)):
            raise TransferLoweringError(
                f"a set between host and device memory inside a stream loop; move it out of the loop "
                f"(set the whole tensor before the stream-parallel op):\n{printer.format_expr_head(inner)}"
            )
