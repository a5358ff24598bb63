"""Shapes across the mesh path: stream axes on split axes of tensors that a
collective moves (ragged last chunks included), logical-shaped inputs and
outputs, and intermediates freed after the collectives that use them."""

from __future__ import annotations

import pytest
import torch

from hostir import DeviceMesh, FusionDefinition, ParallelType, shard_tensor


def rand_int(shape, device) -> torch.Tensor:
    return torch.randint(-4, 4, tuple(shape)).to(torch.float32).to(device)


def exact(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("columns", [6, 7, 2])
def test_allgather_of_split_columns_in_chunks(world, device, columns):
    """y = set(x) gathers x's rows; y's columns are split into 3 chunks for
    streaming, so each chunk's Allgather moves ceilDiv(columns, 3) columns
    (the last fewer, or none)."""
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1])
        y = fd.ops.set(x)
        fd.add_output(fd.ops.mul(y, 2.0))
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(D)))
    x.axis(0).parallelize(ParallelType.mesh_x)
    y.outer_split(1, 3)
    y.axis(1).parallelize(ParallelType.stream)
    full = rand_int([D, columns], device)
    (out,) = fd.execute([shard_tensor(full, x)], number_of_streams=2)
    assert out.shape == (D, columns)
    exact(out, full * 2.0)
    dump = fd.host_ir()
    assert "FOR StreamIdx in iStreamIdx" in dump and "type=Allgather" in dump


def test_intermediate_freed_after_the_wait_of_its_collective(world, device):
    D = world.size
    M, K = 3 * D, 4
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, K])
        a = fd.ops.mul(x, 2.0)
        y = fd.ops.set(a)
        fd.add_output(fd.ops.add(y, 1.0))
    mesh = DeviceMesh(range(D))
    for tv in (x, a, y):
        tv.set_device_mesh(mesh)
    for tv in (x, a):
        tv.outer_split(0, D)
        tv.axis(0).parallelize(ParallelType.mesh_x)
    full = rand_int([M, K], device)
    for _ in range(3):
        (out,) = fd.execute([shard_tensor(full, x)])
        exact(out, full * 2.0 + 1.0)
    lines = [line.strip() for line in fd.host_ir().splitlines()]
    wait = next(i for i, line in enumerate(lines) if line.startswith("Wait Communication"))
    free = [i for i, line in enumerate(lines) if line.startswith("Deallocate")]
    assert free and min(free) > wait


@pytest.mark.parametrize("rows", [8, 5])
def test_stream_split_of_local_rows_after_allgather(world, device, rows):
    """A replicated matmul on gathered rows, streamed in 2 chunks of rows:
    the inputs and the output keep their logical shapes."""
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1, 3])
        w = fd.define_tensor(shape=[3, 4])
        xg = fd.ops.set(x)
        y = fd.ops.matmul(xg, w)
        fd.add_output(y)
    mesh = DeviceMesh(range(D))
    for tv in (x, w, xg, y):
        tv.set_device_mesh(mesh)
    x.axis(0).parallelize(ParallelType.mesh_x)
    y.outer_split(1, 2)
    y.axis(1).parallelize(ParallelType.stream)
    x_full, w_full = rand_int([D, rows, 3], device), rand_int([3, 4], device)
    (out,) = fd.execute([shard_tensor(x_full, x), w_full], number_of_streams=2)
    assert out.shape == (D, rows, 4)
    exact(out, x_full @ w_full)


def test_scalar_input_and_permute_around_an_allgather(world, device):
    """A scalar scales each rank's piece, the gathered tensor is permuted:
    scalar inputs join the ranks' agreement like tensors."""
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1, 3])
        a = fd.define_scalar(float)
        xs = fd.ops.mul(x, a)
        xg = fd.ops.set(xs)
        y = fd.ops.permute(xg, [2, 0, 1])
        fd.add_output(y)
    mesh = DeviceMesh(range(D))
    for tv in (x, xs, xg, y):
        tv.set_device_mesh(mesh)
    for tv in (x, xs):
        tv.axis(0).parallelize(ParallelType.mesh_x)
    full = rand_int([D, 4, 3], device)
    for scale in (0.5, 3):
        (out,) = fd.execute([shard_tensor(full, x), scale])
        exact(out, (full * scale).permute(2, 0, 1))
