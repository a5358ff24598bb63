"""Broadcasting matmuls and split-weight linears with sharded operands, as
nvFuser's multi-device tests write them, against eager torch.

Every rank builds the whole tensors from the per-test seed, passes its
pieces (`shard_tensor`) and compares its piece of the result.
"""

from __future__ import annotations

import pytest
import torch

import hostir
from hostir import DeviceMesh, FusionDefinition, ParallelType, shard_tensor

MESH_X, STREAM = ParallelType.mesh_x, ParallelType.stream


def place(mesh, *tvs):
    for tv in tvs:
        tv.set_device_mesh(mesh)


def piece(t: torch.Tensor, dim: int, world) -> torch.Tensor:
    return t.chunk(world.size, dim)[world.rank]


@pytest.mark.parametrize("out_sharded", [True, False], ids=["sharded_out", "replicated_out"])
def test_2d_input_at_weight_sharded_on_its_batch_axis(world, device, out_sharded):
    """[M, K] @ [D, K, N]: each rank multiplies by its own weight."""
    D = world.size
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1, -1, -1])
        c = fd.ops.matmul(a, b)
        fd.add_output(c)
    place(DeviceMesh(range(D)), a, b, c)
    b.axis(0).parallelize(MESH_X)
    if out_sharded:
        c.axis(0).parallelize(MESH_X)
    a_t, b_t = torch.randn(3, 4, device=device), torch.randn(D, 4, 5, device=device)
    (out,) = fd.execute([a_t, shard_tensor(b_t, b)])
    expected = torch.matmul(a_t, b_t)
    torch.testing.assert_close(out, piece(expected, 0, world) if out_sharded else expected)
    assert ("Allgather" in fd.host_ir()) is not out_sharded


@pytest.mark.parametrize("out", ["sharded", "replicated", "unscheduled"])
def test_broadcast_input_at_weight_sharded_on_a_broadcast_partner(world, device, out):
    """[1, b, s, e] @ [D, 1, e, e]: the input's size-1 axis broadcasts
    against the weight's sharded one; nothing slices the broadcast axis."""
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([1, -1, -1, -1])
        w = fd.define_tensor([-1, 1, -1, -1])
        y = fd.ops.matmul(x, w)
        fd.add_output(y)
    mesh = DeviceMesh(range(D))
    place(mesh, x, w)
    w.axis(0).parallelize(MESH_X)
    if out != "unscheduled":
        y.set_device_mesh(mesh)
    if out == "sharded":
        y.axis(0).parallelize(MESH_X)
    x_t, w_t = torch.randn(1, 2, 3, 4, device=device), torch.randn(D, 1, 4, 4, device=device)
    inputs = [x_t, shard_tensor(w_t, w)]
    report = fd.dry_run(inputs, world_size=D)
    assert report is not None
    (result,) = fd.execute(inputs)
    expected = torch.matmul(x_t, w_t)
    torch.testing.assert_close(result, expected if out == "replicated" else piece(expected, 0, world))


@pytest.mark.parametrize("number_of_streams", [1, 3])
def test_matmul_allreduce_stream_pipeline_as_nvfuser_writes_it(world, device, number_of_streams):
    """[S, D, M/S, K/D] @ [D, K/D, N], summed over D: the product's axis 0
    on streams, an Allreduce of each chunk in the loop."""
    D, S = world.size, 3
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1, -1, -1])
        b = fd.define_tensor([-1, -1, -1])
        c = fd.ops.matmul(a, b)
        d = fd.ops.sum(c, [1])
        fd.add_output(d)
    place(DeviceMesh(range(D)), a, b, c, d)
    a.axis(1).parallelize(MESH_X)
    b.axis(0).parallelize(MESH_X)
    c.axis(1).parallelize(MESH_X)
    c.axis(0).parallelize(STREAM)
    d.axis(0).parallelize(STREAM)
    text = fd.host_ir()
    loop = text[text.rindex("FOR StreamIdx") :]
    assert "matmul(" in loop and "type=Allreduce" in loop, text
    a_t, b_t = torch.randn(S, D, 2, 4, device=device), torch.randn(D, 4, 5, device=device)
    (out,) = fd.execute([shard_tensor(a_t, a), shard_tensor(b_t, b)], number_of_streams=number_of_streams)
    torch.testing.assert_close(out, torch.matmul(a_t, b_t).sum(1))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_linear_with_a_weight_split_on_its_first_axis(world, device, bias):
    """nvFuser's sharded linear: weight [d, e, e] and bias [d, e] sharded on
    d, out [b, s, d, e] sharded on d; no communication."""
    D, e = world.size, 4
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        w = fd.define_tensor([-1, -1, -1])
        b = fd.define_tensor([-1, -1]) if bias else None
        y = fd.ops.linear(x, w, b)
        fd.add_output(y)
    mesh = DeviceMesh(range(D))
    place(mesh, x, w, *([b] if bias else []))
    w.axis(0).parallelize(MESH_X)
    if bias:
        b.axis(0).parallelize(MESH_X)
    x_t, w_t = torch.randn(2, 3, e, device=device), torch.randn(D, e, e, device=device)
    b_t = torch.randn(D, e, device=device) if bias else None
    inputs = [x_t, shard_tensor(w_t, w)] + ([shard_tensor(b_t, b)] if bias else [])
    (out,) = fd.execute(inputs)
    flat_bias = None if b_t is None else b_t.reshape(-1)
    expected = torch.nn.functional.linear(x_t, w_t.reshape(-1, e), flat_bias).unflatten(-1, (D, e))
    torch.testing.assert_close(out, piece(expected, 2, world))
    assert "Communication" not in fd.host_ir()


def test_sharded_batch_sizes_that_differ_are_refused_before_communicating(world, device):
    D = world.size
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1, -1])
        b = fd.define_tensor([-1, -1, -1])
        c = fd.ops.matmul(a, b)
        fd.add_output(c)
    place(DeviceMesh(range(D)), a, b, c)
    b.axis(0).parallelize(MESH_X)
    a_t, b_t = torch.randn(D + 1, 3, 4, device=device), torch.randn(D, 4, 5, device=device)
    with pytest.raises(hostir.HostIrError, match="size"):
        fd.execute([a_t, shard_tensor(b_t, b)])


@pytest.mark.parametrize("schedule", ["ring", "collective", "sequential"])
@pytest.mark.parametrize("form", ["linear", "matmul"])
def test_column_parallel_with_the_stream_on_the_gathered_axis(world, device, form, schedule):
    """The weight sharded on its output-feature pieces [D, n, K] (or
    [D, K, n] for matmul), gathered with the stream on the gathered axis:
    each step multiplies the replicated input by one rank's piece (a ring
    of P2P steps, one broadcast per step, or a gather first)."""
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        w = fd.define_tensor([D, -1, -1])
        wg = fd.ops.set(w)
        y = fd.ops.linear(x, wg) if form == "linear" else fd.ops.matmul(x, wg)
        fd.add_output(y)
    place(DeviceMesh(range(D)), x, w, wg, y)
    w.axis(0).parallelize(MESH_X)
    wg.axis(0).parallelize(STREAM)
    y.axis(1 if form == "linear" else 0).parallelize(STREAM)
    x_t = torch.randn(4, 3, device=device)
    w_t = torch.randn(D, 5, 3, device=device) if form == "linear" else torch.randn(D, 3, 5, device=device)
    inputs = [x_t, shard_tensor(w_t, w)]
    fd.dry_run(inputs, world_size=D, schedule=schedule)
    (out,) = fd.execute(inputs, schedule=schedule, number_of_streams=2)
    if form == "linear":
        expected = torch.nn.functional.linear(x_t, w_t.reshape(-1, 3)).unflatten(-1, (D, 5))
    else:
        expected = torch.matmul(x_t, w_t)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("stream_axis", [1, 2], ids=["rows", "columns"])
def test_product_sharded_on_its_batch_axis_with_a_stream_on_another(world, device, stream_axis):
    """Replicated operands, the product [B, M, N] sharded on B and walked on
    streams along M or N: each loop step multiplies this rank's batch
    entries only, reading its slice of the replicated weight."""
    D = world.size
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1, -1, -1])
        c = fd.ops.matmul(a, b)
        fd.add_output(c)
    place(DeviceMesh(range(D)), a, b, c)
    c.axis(0).parallelize(MESH_X)
    c.axis(stream_axis).parallelize(STREAM)
    a_t, b_t = torch.randn(3, 4, device=device), torch.randn(D, 4, 5, device=device)
    (out,) = fd.execute([a_t, b_t], number_of_streams=2)
    torch.testing.assert_close(out, piece(torch.matmul(a_t, b_t), 0, world))


@pytest.mark.parametrize("schedule", ["ring", "collective", "sequential"])
@pytest.mark.parametrize("weight", ["split_weight", "split_axis"])
def test_column_parallel_linear_streamed_on_its_sharded_axis_without_a_set(world, device, weight, schedule):
    """The same with no gathering set written: the weight [D, n, K] (or
    [N, K] split on N) sharded, the product streamed on the sharded
    features; the lowering gathers the weight piece by piece."""
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        w = fd.define_tensor([D, -1, -1] if weight == "split_weight" else [-1, -1])
        y = fd.ops.linear(x, w)
        fd.add_output(y)
    place(DeviceMesh(range(D)), x, w, y)
    if weight == "split_weight":
        w.axis(0).parallelize(MESH_X)
        y.axis(1).parallelize(STREAM)
        w_t = torch.randn(D, 5, 3, device=device)
    else:
        w.outer_split(0, D)
        w.axis(0).parallelize(MESH_X)
        y.outer_split(1, D)
        y.axis(1).parallelize(STREAM)
        w_t = torch.randn(D * 5, 3, device=device)
    x_t = torch.randn(4, 3, device=device)
    (out,) = fd.execute([x_t, shard_tensor(w_t, w)], schedule=schedule, number_of_streams=2)
    expected = torch.nn.functional.linear(x_t, w_t.reshape(-1, 3))
    torch.testing.assert_close(out, expected.unflatten(-1, (D, 5)) if weight == "split_weight" else expected)
