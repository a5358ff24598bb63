"""DTensor in and out of `fd.execute`, against the same computation done
with DTensor ops (`redistribute`, `full_tensor`).

The torch mesh comes from `hostir.DeviceMesh(...).to_torch()`, which
initializes torch.distributed through hostir's communicator when nothing
has yet (tests/python/test_dtensor_mpirun.py covers a program that
initializes it itself). Every error case here is raised from the DTensors'
global metadata, the same on every rank, before any collective.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import hostir
from hostir import DeviceMesh, FusionDefinition, ParallelType
from hostir.dtensor import DTensorPlacementError


@pytest.fixture
def torch_mesh(world, device):
    return DeviceMesh(range(world.size)).to_torch(device.type)


def _matmul_fusion():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        w = fd.define_tensor(shape=[-1, -1])
        xg = fd.ops.set(x)
        y = fd.ops.matmul(xg, w)
        fd.add_output(y)
    return fd, x, w, xg, y


def test_mesh_converts_both_ways(world, device, torch_mesh):
    mesh = DeviceMesh.from_torch(torch_mesh)
    assert mesh == DeviceMesh(range(world.size))
    back = mesh.to_torch(device.type)
    assert back.mesh.tolist() == list(range(world.size))
    assert DeviceMesh(torch_mesh) == mesh


def test_sharded_input_allgathered_matches_redistribute(world, device, torch_mesh):
    fd, x, w, xg, y = _matmul_fusion()
    mesh = DeviceMesh(range(world.size))
    # The intermediate and the output are placed replicated: the set from
    # the DTensor-sharded input is an Allgather.
    xg.set_device_mesh(torch_mesh)
    y.set_device_mesh(mesh)
    x_full = torch.randn(4 * world.size, 16, device=device)
    w_full = torch.randn(16, 8, device=device)
    x_dt = distribute_tensor(x_full, torch_mesh, [Shard(0)])
    w_dt = distribute_tensor(w_full, torch_mesh, [Replicate()])

    (out,) = fd.execute([x_dt, w_dt])

    assert isinstance(out, DTensor)
    assert tuple(out.placements) == (Replicate(),)
    expected = x_dt.redistribute(torch_mesh, [Replicate()]).to_local() @ w_dt.to_local()
    torch.testing.assert_close(out.to_local(), expected)
    torch.testing.assert_close(out.full_tensor(), x_full @ w_full)
    assert "Allgather" in fd.host_ir()
    # The input took the DTensor's sharding: axis 0 split by the mesh size.
    assert x.mesh == mesh and x.device_axes()


def test_sharded_output_is_a_sharded_dtensor(world, device, torch_mesh):
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[2 * world.size, 6])
        b = fd.define_tensor(shape=[2 * world.size, 6])
        fd.add_output(fd.ops.mul(fd.ops.add(a, b), b))
    a_dt = distribute_tensor(torch.randn(2 * world.size, 6, device=device), torch_mesh, [Shard(0)])
    b_dt = distribute_tensor(torch.randn(2 * world.size, 6, device=device), torch_mesh, [Shard(0)])

    (out,) = fd.execute([a_dt, b_dt])

    assert tuple(out.placements) == (Shard(0),)
    expected = (a_dt + b_dt) * b_dt
    torch.testing.assert_close(out.to_local(), expected.to_local())
    torch.testing.assert_close(out.full_tensor(), expected.full_tensor())


def test_mesh_sized_axis_is_sharded_in_place(world, device, torch_mesh):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[world.size, -1])
        fd.add_output(fd.ops.sum(x, [0]))
    x_full = torch.randn(world.size, 5, device=device)
    x_dt = distribute_tensor(x_full, torch_mesh, [Shard(0)])

    (out,) = fd.execute([x_dt])

    assert x.axis(0).is_device_parallel and len(x.domain) == 2
    assert "Allreduce" in fd.host_ir()
    assert tuple(out.placements) == (Replicate(),)
    torch.testing.assert_close(out.full_tensor(), x_dt.full_tensor().sum(0))


def test_placement_checked_against_the_users_sharding(world, device, torch_mesh):
    fd, x, w, xg, y = _matmul_fusion()
    mesh = DeviceMesh(range(world.size))
    for tv in (x, w, xg, y):
        tv.set_device_mesh(mesh)
    x.outer_split(0, world.size)
    x.axis(0).parallelize(ParallelType.mesh_x)
    # K divides over the ranks, so sharding axis 1 is even and only the
    # placement is wrong.
    k = 2 * world.size
    x_full, w_full = torch.randn(2 * world.size, k, device=device), torch.randn(k, 3, device=device)
    x_dt = distribute_tensor(x_full, torch_mesh, [Shard(0)])
    w_dt = distribute_tensor(w_full, torch_mesh, [Replicate()])

    (out,) = fd.execute([x_dt, w_dt])
    torch.testing.assert_close(out.full_tensor(), x_full @ w_full)

    wrong = distribute_tensor(x_full, torch_mesh, [Shard(1)])
    with pytest.raises(DTensorPlacementError, match=r"input 0 \(T0\).*Shard\(dim=1\).*shards axis 1, the input axis 0"):
        fd.execute([wrong, w_dt])
    replicated = distribute_tensor(x_full, torch_mesh, [Replicate()])
    with pytest.raises(DTensorPlacementError, match=r"input 0 \(T0\).*Replicate\(\).*sharded on axis 0"):
        fd.execute([replicated, w_dt])


def test_uneven_shards_are_rejected_with_sizes(world, device, torch_mesh):
    fd, x, w, xg, y = _matmul_fusion()
    size = 2 * world.size + 1
    x_dt = distribute_tensor(torch.randn(size, 4, device=device), torch_mesh, [Shard(0)])
    w_dt = distribute_tensor(torch.randn(4, 3, device=device), torch_mesh, [Replicate()])
    with pytest.raises(DTensorPlacementError, match=rf"axis 0 of size {size} unevenly over {world.size} ranks") as info:
        fd.execute([x_dt, w_dt])
    # The sizes named are the shards DTensor holds.
    sizes = [int(n) for n in re.search(r"shard sizes \[([\d, ]+)\]", str(info.value)).group(1).split(", ")]
    assert len(sizes) == world.size and sum(sizes) == size
    assert sizes[world.rank] == x_dt.to_local().shape[0]
    assert x.mesh is None, "a rejected input must leave the fusion unchanged"


def test_return_dtensors_from_local_inputs(world, device, torch_mesh):
    fd, x, w, xg, y = _matmul_fusion()
    mesh = DeviceMesh(range(world.size))
    for tv in (x, w, xg, y):
        tv.set_device_mesh(mesh)
    x.outer_split(0, world.size)
    x.axis(0).parallelize(ParallelType.mesh_x)
    x_full, w_full = torch.randn(2 * world.size, 4, device=device), torch.randn(4, 3, device=device)

    (plain,) = fd.execute([hostir.shard_tensor(x_full, x), w_full])
    (wrapped,) = fd.execute([hostir.shard_tensor(x_full, x), w_full], return_dtensors=True)

    assert not isinstance(plain, DTensor)
    assert isinstance(wrapped, DTensor) and tuple(wrapped.placements) == (Replicate(),)
    torch.testing.assert_close(wrapped.full_tensor(), x_full @ w_full)
    torch.testing.assert_close(plain, x_full @ w_full)
