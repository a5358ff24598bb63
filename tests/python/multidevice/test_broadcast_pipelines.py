"""nvFuser's multi-device programs that use broadcast_in_dim, in hostir's
API, against eager torch: the allgather of an expanded broadcast, and the
matmul + ReduceScatter pipelines whose weight is broadcast to the partial
sums' layout, with the partials' device axis outer or inner (the pattern
is matched up to axis permutation), decomposed as a P2P ring and as one
Reduce per iteration (nvFuser's reduce-based pipeline).
"""

from __future__ import annotations

import pytest
import torch

from hostir import DeviceMesh, FusionDefinition, ParallelType, shard_tensor
from hostir.lower import lower
from hostir.lower.schedule import Schedule

MESH_X, STREAM = ParallelType.mesh_x, ParallelType.stream


def test_allgather_of_an_expanded_broadcast(world, device):
    d = world.size
    with FusionDefinition() as fd:
        inp = fd.define_tensor([d])
        expanded = fd.ops.broadcast_in_dim(inp, [d, 3], [0])
        out = fd.ops.set(expanded)
        fd.add_output(out)
    mesh = DeviceMesh(range(d))
    for tv in (inp, expanded, out):
        tv.set_device_mesh(mesh)
    inp.axis(0).parallelize(MESH_X)
    expanded.axis(0).parallelize(MESH_X)
    whole = torch.randn(d, device=device)
    (result,) = fd.execute([shard_tensor(whole, inp)])
    torch.testing.assert_close(result, whole.unsqueeze(-1).expand(-1, 3))
    assert "type=Allgather" in fd.host_ir()


def _matmul_reduce_scatter(D, m, k, n, partials_outer: bool, weight: str = "broadcast_in_dim"):
    """a: [D(K pieces), D(rows), m, k] (partials outer) or [D(rows), D(K
    pieces), m, k]; the weight [D, k, n] broadcast against the rows axis
    (by broadcast_in_dim, or given with its size-1 axis); the product walked
    on streams along the rows axis, summed over the K pieces into an output
    sharded on the rows."""
    p, r = (0, 1) if partials_outer else (1, 0)
    shape = [1] * 2 + [k, n]
    shape[p] = D
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1, -1, -1])
        if weight == "broadcast_in_dim":
            w = fd.define_tensor([-1, -1, -1])
            wb = fd.ops.broadcast_in_dim(w, shape, [p, 2, 3])
        else:
            w = wb = fd.define_tensor([-1 if s != 1 else 1 for s in shape])
        partials = fd.ops.matmul(a, wb)
        c = fd.ops.sum(partials, [p])
        fd.add_output(c)
    mesh = DeviceMesh(range(D))
    for tv in {a, w, wb, partials, c}:
        tv.set_device_mesh(mesh)
    a.axis(p).parallelize(MESH_X)
    if w is not wb:
        w.axis(0).parallelize(MESH_X)
    wb.axis(p).parallelize(MESH_X)
    partials.axis(p).parallelize(MESH_X)
    partials.axis(r).parallelize(STREAM)
    c.axis(r).parallelize(MESH_X)
    return fd, a, w


def _expected(a_t, w_t, partials_outer: bool):
    p = 0 if partials_outer else 1
    return torch.matmul(a_t, w_t.unsqueeze(1 - p)).sum(p)


@pytest.mark.parametrize("weight", ["broadcast_in_dim", "input"])
@pytest.mark.parametrize("partials_outer", [True, False], ids=["partials_outer", "partials_inner"])
@pytest.mark.parametrize("decomposition", ["ring", "collective"])
def test_matmul_reduce_scatter_pipeline(world, device, partials_outer, decomposition, weight):
    D, m, k, n = world.size, 3, 4, 5
    fd, a, w = _matmul_reduce_scatter(D, m, k, n, partials_outer, weight)
    program = str(lower(fd.fusion, rank=world.rank, backend="gloo", schedule=Schedule(decomposition)).program)
    loop = program[program.index(f"({decomposition}") :]
    if decomposition == "ring":
        assert "P2PCommunication" in loop, program
    else:
        assert "type=Reduce" in loop, program
    a_t, w_t = torch.randn(D, D, m, k, device=device), torch.randn(D, k, n, device=device)
    w_in = w_t if weight == "broadcast_in_dim" else w_t.unsqueeze(1 if partials_outer else 0)
    (out,) = fd.execute([shard_tensor(a_t, a), shard_tensor(w_in, w)], schedule=decomposition)
    expected = _expected(a_t, w_t, partials_outer)
    torch.testing.assert_close(out, expected.chunk(D, 0)[world.rank])


def test_matmul_reduce_scatter_through_broadcast_as_nvfuser_writes_it(world, device):
    """[S, D(K pieces), D(rows), M/(S*D), K/D] @ broadcast([D, K/D, N]):
    the stream walks S, a ReduceScatter of each chunk in the loop."""
    D, S, m, k, n = world.size, 2, 3, 4, 5
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1, -1, -1, -1])
        w = fd.define_tensor([-1, -1, -1])
        wb = fd.ops.broadcast_in_dim(w, [1, D, 1, k, n], [1, 3, 4])
        partials = fd.ops.matmul(a, wb)
        c = fd.ops.sum(partials, [1])
        fd.add_output(c)
    mesh = DeviceMesh(range(D))
    for tv in (a, w, wb, partials, c):
        tv.set_device_mesh(mesh)
    a.axis(1).parallelize(MESH_X)
    w.axis(0).parallelize(MESH_X)
    wb.axis(1).parallelize(MESH_X)
    partials.axis(0).parallelize(STREAM)
    partials.axis(1).parallelize(MESH_X)
    c.axis(0).parallelize(STREAM)
    c.axis(2).parallelize(MESH_X)
    text = fd.host_ir()
    loop = text[text.rindex("FOR StreamIdx") :]
    assert "matmul(" in loop and "type=ReduceScatter" in loop, text
    a_t, w_t = torch.randn(S, D, D, m, k, device=device), torch.randn(D, k, n, device=device)
    (out,) = fd.execute([shard_tensor(a_t, a), shard_tensor(w_t, w)])
    expected = torch.matmul(a_t, w_t.unsqueeze(1).unsqueeze(0)).sum(1)
    torch.testing.assert_close(out, expected.narrow(1, world.rank, 1))
