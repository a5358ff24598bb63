"""Communication overlapped with compute: programs whose output axis 0 is
`stream`-parallel, so each chunk's collective runs in a loop over the
chunks, on worker streams, next to the compute of the others.

Each pipeline runs on integer-valued random data for S (the number of
chunks, the extent of axis 0) in 1, 2 and 4 with two streams and is
compared exactly with eager torch; its dump must hold a `FOR StreamIdx`
loop whose body posts the communication.
"""

from __future__ import annotations

import re

import pytest
import torch

from hostir import DeviceMesh, FusionDefinition, ParallelType, shard_tensor

CHUNKS = [1, 2, 4]
STREAMS = 2


def rand_int(shape, device, dtype=torch.float32, low=-4, high=4) -> torch.Tensor:
    return torch.randint(low, high, tuple(shape)).to(dtype).to(device)


def exact(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def loop_bodies(dump: str) -> list[str]:
    """The text of every `FOR StreamIdx` loop's body (its indented lines)."""
    lines = dump.splitlines()
    bodies = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)FOR StreamIdx in ", line)
        if not m:
            continue
        pad = len(m.group(1))
        body = []
        for inner in lines[i + 1 :]:
            if len(inner) - len(inner.lstrip()) <= pad:
                break
            body.append(inner)
        bodies.append("\n".join(body))
    return bodies


def check_pipelined(fd: FusionDefinition, comm_type: str) -> str:
    dump = fd.host_ir()
    looped = [b for b in loop_bodies(dump) if re.search(rf"Communication \d+ \(type={comm_type},", b)]
    assert looped, f"no FOR StreamIdx loop posts a {comm_type}:\n{dump}"
    assert any(re.search(r"Wait Communication \d+", b) for b in looped), dump
    return dump


def mesh_of(world) -> DeviceMesh:
    return DeviceMesh(range(world.size))


# ------------------------------------------------------------ the programs


def allgather_program(world, S):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[S, D, -1], dtype=torch.float32)
        y = fd.ops.set(x)
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(mesh_of(world))
    x.axis(1).parallelize(ParallelType.mesh_x)
    y.axis(0).parallelize(ParallelType.stream)
    return fd, x


def ag_matmul_program(world, S, K, symbolic_s=False):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1 if symbolic_s else S, D, -1, K], dtype=torch.float32)
        w = fd.define_tensor(shape=[K, -1], dtype=torch.float32)
        xg = fd.ops.set(x)
        y = fd.ops.matmul(xg, w)
        fd.add_output(y)
    for tv in (x, w, xg, y):
        tv.set_device_mesh(mesh_of(world))
    x.axis(1).parallelize(ParallelType.mesh_x)
    xg.axis(0).parallelize(ParallelType.stream)
    y.axis(0).parallelize(ParallelType.stream)
    return fd, x, w


def matmul_rs_program(world, S, k):
    D = world.size
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[S, D, D, -1, k], dtype=torch.float32)
        b = fd.define_tensor(shape=[1, D, 1, k, -1], dtype=torch.float32)
        c = fd.ops.matmul(a, b)
        y = fd.ops.sum(c, [1])
        fd.add_output(y)
    for tv in (a, b, c, y):
        tv.set_device_mesh(mesh_of(world))
    a.axis(1).parallelize(ParallelType.mesh_x)
    b.axis(1).parallelize(ParallelType.mesh_x)
    c.axis(1).parallelize(ParallelType.mesh_x)
    y.axis(2).parallelize(ParallelType.mesh_x)
    c.axis(0).parallelize(ParallelType.stream)
    y.axis(0).parallelize(ParallelType.stream)
    return fd, a, b, y


def matmul_ar_program(world, S, k):
    D = world.size
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[S, D, -1, k], dtype=torch.float32)
        b = fd.define_tensor(shape=[1, D, k, -1], dtype=torch.float32)
        c = fd.ops.matmul(a, b)
        y = fd.ops.sum(c, [1])
        fd.add_output(y)
    for tv in (a, b, c, y):
        tv.set_device_mesh(mesh_of(world))
    a.axis(1).parallelize(ParallelType.mesh_x)
    b.axis(1).parallelize(ParallelType.mesh_x)
    c.axis(1).parallelize(ParallelType.mesh_x)
    c.axis(0).parallelize(ParallelType.stream)
    y.axis(0).parallelize(ParallelType.stream)
    return fd, a, b


# ------------------------------------------------------------ the tests


@pytest.mark.parametrize("S", CHUNKS)
def test_stream_parallel_allgather(world, device, S):
    fd, x = allgather_program(world, S)
    full = rand_int([S, world.size, 5], device)
    out, = fd.execute([shard_tensor(full, x)], number_of_streams=STREAMS)
    exact(out, full)
    check_pipelined(fd, "Allgather")


@pytest.mark.parametrize("S", CHUNKS)
@pytest.mark.parametrize("symbolic_s", [False, True], ids=["fixed_S", "symbolic_S"])
def test_allgather_matmul(world, device, S, symbolic_s):
    K, N, m = 4, 3, 2
    fd, x, w = ag_matmul_program(world, S, K, symbolic_s)
    x_full = rand_int([S, world.size, m, K], device)
    w_full = rand_int([K, N], device)
    out, = fd.execute([shard_tensor(x_full, x), w_full], number_of_streams=STREAMS)
    exact(out, x_full @ w_full)
    check_pipelined(fd, "Allgather")


@pytest.mark.parametrize("S", CHUNKS)
def test_matmul_reduce_scatter(world, device, S):
    D, m, k, N = world.size, 2, 3, 4
    fd, a, b, y = matmul_rs_program(world, S, k)
    a_full = rand_int([S, D, D, m, k], device)
    b_full = rand_int([1, D, 1, k, N], device)
    out, = fd.execute([shard_tensor(a_full, a), shard_tensor(b_full, b)], number_of_streams=STREAMS)
    ref = (a_full @ b_full).sum(1)
    exact(out, shard_tensor(ref, y))
    check_pipelined(fd, "ReduceScatter")


@pytest.mark.parametrize("S", CHUNKS)
def test_matmul_allreduce(world, device, S):
    D, m, k, N = world.size, 2, 3, 4
    fd, a, b = matmul_ar_program(world, S, k)
    a_full = rand_int([S, D, m, k], device)
    b_full = rand_int([1, D, k, N], device)
    out, = fd.execute([shard_tensor(a_full, a), shard_tensor(b_full, b)], number_of_streams=STREAMS)
    exact(out, (a_full @ b_full).sum(1))
    check_pipelined(fd, "Allreduce")


@pytest.mark.parametrize("S", [2])
def test_allgather_linear(world, device, S):
    D, K, N, m = world.size, 4, 3, 2
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[S, D, -1, K], dtype=torch.float32)
        w = fd.define_tensor(shape=[N, K], dtype=torch.float32)
        b = fd.define_tensor(shape=[N], dtype=torch.float32)
        xg = fd.ops.set(x)
        y = fd.ops.linear(xg, w, b)
        fd.add_output(y)
    for tv in (x, w, b, xg, y):
        tv.set_device_mesh(mesh_of(world))
    x.axis(1).parallelize(ParallelType.mesh_x)
    xg.axis(0).parallelize(ParallelType.stream)
    y.axis(0).parallelize(ParallelType.stream)
    x_full, w_full, b_full = rand_int([S, D, m, K], device), rand_int([N, K], device), rand_int([N], device)
    out, = fd.execute([shard_tensor(x_full, x), w_full, b_full], number_of_streams=STREAMS)
    exact(out, torch.nn.functional.linear(x_full, w_full, b_full))
    check_pipelined(fd, "Allgather")


def test_allgather_matmul_lowers_once_for_many_runs(world, device):
    S, K, N, m = 4, 4, 3, 2
    fd, x, w = ag_matmul_program(world, S, K)
    for i in range(20):
        x_full = rand_int([S, world.size, m, K], device)
        w_full = rand_int([K, N], device)
        out, = fd.execute([shard_tensor(x_full, x), w_full], number_of_streams=STREAMS)
        exact(out, x_full @ w_full)
        assert fd.executor.num_programs == 1, f"run {i}"
    assert fd.executor.lowerings == 1


def test_allgather_matmul_into_preallocated_output(world, device):
    S, K, N, m = 4, 4, 3, 2
    fd, x, w = ag_matmul_program(world, S, K)
    x_full = rand_int([S, world.size, m, K], device)
    w_full = rand_int([K, N], device)
    buffer = torch.full([S, world.size, m, N], float("nan"), device=device)
    out, = fd.execute([shard_tensor(x_full, x), w_full], outputs=[buffer], number_of_streams=STREAMS)
    assert out.data_ptr() == buffer.data_ptr()
    exact(buffer, x_full @ w_full)


@pytest.mark.parametrize("comm_type", ["Gather", "Reduce", "Scatter", "Broadcast", "SendRecv", "Allreduce"])
def test_stream_parallel_communication(world, device, comm_type):
    """x [S, D, m]; y = set or sum over axis 1, between meshes, pipelined over S."""
    D, S, m = world.size, 3, 4
    everyone, last = DeviceMesh(range(D)), DeviceMesh([D - 1])
    reversed_mesh = DeviceMesh(list(reversed(range(D))))
    kind, in_mesh, out_mesh, in_sharded, out_sharded = {
        "Gather": ("set", everyone, last, True, False),
        "Reduce": ("sum", everyone, last, True, False),
        "Scatter": ("set", last, everyone, False, True),
        "Broadcast": ("set", last, everyone, False, False),
        "SendRecv": ("set", everyone, reversed_mesh, True, True),
        "Allreduce": ("max", everyone, everyone, True, False),
    }[comm_type]
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[S, D, m], dtype=torch.float32)
        y = fd.ops.set(x) if kind == "set" else getattr(fd.ops, kind)(x, [1])
        fd.add_output(y)
    x.set_device_mesh(in_mesh)
    y.set_device_mesh(out_mesh)
    if in_sharded:
        x.axis(1).parallelize(ParallelType.mesh_x)
    if out_sharded:
        y.axis(1).parallelize(ParallelType.mesh_x)
    y.axis(0).parallelize(ParallelType.stream)

    full = rand_int([S, D, m], device)
    if world.rank in in_mesh:
        mine = shard_tensor(full, x)
    else:
        mine = torch.full_like(shard_tensor(full, x, rank=in_mesh.devices[0]), 99.0)
    if kind == "sum":
        expected = full.sum(1)
    elif kind == "max":
        expected = full.amax(1)
    elif out_sharded and world.rank in out_mesh:
        expected = shard_tensor(full, y)
    else:
        expected = full
    for _ in range(2):
        out, = fd.execute([mine], number_of_streams=STREAMS)
        if world.rank in out_mesh:
            exact(out, expected)
        else:
            assert out is None
    check_pipelined(fd, comm_type)
