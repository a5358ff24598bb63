"""Each communication a resharding op lowers to, against eager torch.

Every rank builds the same full tensors (the seed is per test, the same on
every rank), passes its piece, and compares what it holds with the eager
result exactly: the data are small integers, so sums and products are exact
in every dtype. Each case runs twice: once letting the program allocate its
output, once writing into a preallocated output on the ranks that hold it
(the others pass None).
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import hostir
from hostir import DeviceMesh, FusionDefinition, ParallelType, shard_tensor
from hostir import ir
from hostir.container import HostIrContainer
from hostir.runtime.evaluator import HostIrEvaluator
from hostir.runtime.streams import streams_for

DTYPES = [torch.float32, torch.int64]


def rand_int(shape, dtype, device, low=-8, high=8) -> torch.Tensor:
    """Integer-valued random data: exact under any sum or product here."""
    return torch.randint(low, high, tuple(shape)).to(dtype).to(device)


def garbage_like(t: torch.Tensor) -> torch.Tensor:
    """What a rank outside an input's mesh passes: the right local shape,
    values that must not reach any result."""
    return torch.full_like(t, 99)


def exact(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def check_dump(fd: FusionDefinition, comm_type: str) -> str:
    dump = fd.host_ir()
    assert re.search(rf"^\s*Communication \d+ \(type={comm_type},", dump, re.MULTILINE), dump
    assert re.search(r"^\s*Wait Communication \d+$", dump, re.MULTILINE), dump
    return dump


def run_both_ways(fd, inputs, expected, holds: bool, device):
    """Run with fresh outputs, then with a preallocated one (where held)."""
    out, = fd.execute(inputs)
    if holds:
        exact(out, expected)
    else:
        assert out is None
    buffer = torch.full_like(expected, 77) if holds else None  # a value no result has
    again, = fd.execute(inputs, outputs=[buffer])
    if holds:
        assert again.data_ptr() == buffer.data_ptr(), "the preallocated output was not written in place"
        exact(buffer, expected)
        exact(again, expected)
    else:
        assert again is None
    assert fd.executor.num_programs == 1
    return out


def _sum_dtype(dtype):
    return dtype if dtype.is_floating_point else torch.int64


KINDS = ["sum", "max", "min"]


def eager_reduce(full: torch.Tensor, kind: str, dim: int) -> torch.Tensor:
    """torch's reduction as hostir defines it (integer sums to int64)."""
    if kind == "sum":
        return full.sum(dim, dtype=_sum_dtype(full.dtype))
    return full.amax(dim) if kind == "max" else full.amin(dim)


# ------------------------------------------------------------ collectives


@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather(world, device, dtype):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1], dtype=dtype)
        y = fd.ops.set(x)
        fd.add_output(y)
    mesh = DeviceMesh(range(D))
    for tv in (x, y):
        tv.set_device_mesh(mesh)
    x.axis(0).parallelize(ParallelType.mesh_x)

    full = rand_int([D, 5], dtype, device)
    check_dump(fd, "Allgather")
    run_both_ways(fd, [shard_tensor(full, x)], full, True, device)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce(world, device, dtype, kind):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1, -1], dtype=dtype)
        y = getattr(fd.ops, kind)(x, [0])
        fd.add_output(y)
    mesh = DeviceMesh(range(D))
    for tv in (x, y):
        tv.set_device_mesh(mesh)
    x.axis(0).parallelize(ParallelType.mesh_x)

    full = rand_int([D, 3, 4], dtype, device)
    assert f"red_op={kind}" in check_dump(fd, "Allreduce")
    run_both_ways(fd, [shard_tensor(full, x)], eager_reduce(full, kind, 0), True, device)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter(world, device, dtype, kind):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, D, -1], dtype=dtype)
        y = getattr(fd.ops, kind)(x, [0])
        fd.add_output(y)
    mesh = DeviceMesh(range(D))
    for tv in (x, y):
        tv.set_device_mesh(mesh)
    x.axis(0).parallelize(ParallelType.mesh_x)
    y.axis(1).parallelize(ParallelType.mesh_x)  # y's domain is [rD, D, m]

    full = rand_int([D, D, 3], dtype, device)
    assert f"red_op={kind}" in check_dump(fd, "ReduceScatter")
    expected = shard_tensor(eager_reduce(full, kind, 0), y)
    assert expected.shape == (1, 3)
    run_both_ways(fd, [shard_tensor(full, x)], expected, True, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("root", ["first", "last"])
def test_broadcast(world, device, dtype, root):
    D = world.size
    r = 0 if root == "first" else D - 1
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=dtype)
        y = fd.ops.set(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh([r]))
    y.set_device_mesh(DeviceMesh(range(D)))

    full = rand_int([4, 3], dtype, device)
    dump = check_dump(fd, "Broadcast")
    assert f"root={r}" in dump, dump
    mine = full if world.rank == r else garbage_like(full)
    run_both_ways(fd, [mine], full, True, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("root", ["first", "last"])
def test_gather(world, device, dtype, root):
    D = world.size
    r = 0 if root == "first" else D - 1
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1], dtype=dtype)
        y = fd.ops.set(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh(range(D)))
    y.set_device_mesh(DeviceMesh([r]))
    x.axis(0).parallelize(ParallelType.mesh_x)

    full = rand_int([D, 5], dtype, device)
    check_dump(fd, "Gather")
    run_both_ways(fd, [shard_tensor(full, x)], full, world.rank == r, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("root", ["first", "last"])
def test_scatter(world, device, dtype, root):
    D = world.size
    r = 0 if root == "first" else D - 1
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1], dtype=dtype)
        y = fd.ops.set(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh([r]))
    y.set_device_mesh(DeviceMesh(range(D)))
    y.axis(0).parallelize(ParallelType.mesh_x)

    full = rand_int([D, 5], dtype, device)
    check_dump(fd, "Scatter")
    mine = full if world.rank == r else garbage_like(full)
    run_both_ways(fd, [mine], shard_tensor(full, y), True, device)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("root", ["first", "last"])
def test_reduce(world, device, dtype, root, kind):
    D = world.size
    r = 0 if root == "first" else D - 1
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1], dtype=dtype)
        y = getattr(fd.ops, kind)(x, [0])
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh(range(D)))
    y.set_device_mesh(DeviceMesh([r]))
    x.axis(0).parallelize(ParallelType.mesh_x)

    full = rand_int([D, 5], dtype, device)
    assert f"red_op={kind}" in check_dump(fd, "Reduce")
    run_both_ways(fd, [shard_tensor(full, x)], eager_reduce(full, kind, 0), world.rank == r, device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_send_recv(world, device, dtype):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1], dtype=dtype)
        y = fd.ops.set(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh(range(D)))
    y.set_device_mesh(DeviceMesh(list(reversed(range(D)))))
    x.axis(0).parallelize(ParallelType.mesh_x)
    y.axis(0).parallelize(ParallelType.mesh_x)

    full = rand_int([D, 5], dtype, device)
    check_dump(fd, "SendRecv")
    expected = shard_tensor(full, y)
    exact(expected, full[D - 1 - world.rank : D - world.rank])
    run_both_ways(fd, [shard_tensor(full, x)], expected, True, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("symbolic", [False, True], ids=["fixed_M", "symbolic_M"])
def test_split_sharding_allgather(world, device, dtype, symbolic):
    D = world.size
    M, K = 3 * D, 4
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1 if symbolic else M, K], dtype=dtype)
        xg = fd.ops.set(x)
        fd.add_output(xg)
    mesh = DeviceMesh(range(D))
    for tv in (x, xg):
        tv.set_device_mesh(mesh)
    x.outer_split(0, D)
    x.axis(0).parallelize(ParallelType.mesh_x)

    full = rand_int([M, K], dtype, device)
    local = shard_tensor(full, x)
    assert local.shape == (M // D, K)
    exact(local, full[world.rank * (M // D) : (world.rank + 1) * (M // D)])
    check_dump(fd, "Allgather")
    run_both_ways(fd, [local], full, True, device)


def test_allreduce_of_split_sharded_axis(world, device):
    """x [M, K] split as [D (mesh_x), M/D]; y = sum(x, [0]) replicated: each
    rank sums its M/D rows, then an Allreduce sums the ranks'."""
    D = world.size
    M, K = 2 * D, 3
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[M, K], dtype=torch.float32)
        y = fd.ops.sum(x, [0])
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(D)))
    x.outer_split(0, D)
    x.axis(0).parallelize(ParallelType.mesh_x)
    full = rand_int([M, K], torch.float32, device)
    check_dump(fd, "Allreduce")
    run_both_ways(fd, [shard_tensor(full, x)], full.sum(0), True, device)


@pytest.mark.parametrize("comm_type", ["Allgather", "Allreduce", "ReduceScatter", "Gather", "Scatter", "SendRecv"])
def test_mesh_axis_not_outermost(world, device, comm_type):
    """The sharded axis in the middle of x [3, D, 2] (and y's scattered axis
    last in [3, 2, D]): collectives move the ranks' axis into place."""
    D = world.size
    everyone = DeviceMesh(range(D))
    reduces = comm_type in ("Allreduce", "ReduceScatter")
    shape = [3, D, 2, D] if comm_type == "ReduceScatter" else [3, D, 2]
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=shape, dtype=torch.float32)
        y = fd.ops.sum(x, [1]) if reduces else fd.ops.set(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh([0]) if comm_type == "Scatter" else everyone)
    y.set_device_mesh(
        {"Gather": DeviceMesh([0]), "SendRecv": DeviceMesh(list(reversed(range(D))))}.get(comm_type, everyone)
    )
    if comm_type != "Scatter":
        x.axis(1).parallelize(ParallelType.mesh_x)
    if comm_type in ("Scatter", "SendRecv"):
        y.axis(1).parallelize(ParallelType.mesh_x)
    if comm_type == "ReduceScatter":
        y.axis(3).parallelize(ParallelType.mesh_x)  # y's domain is [3, rD, 2, D]

    full = rand_int(shape, torch.float32, device)
    check_dump(fd, comm_type)
    if comm_type == "Scatter":
        mine = full if world.rank == 0 else garbage_like(full)
    else:
        mine = shard_tensor(full, x)
    holds = world.rank in y.mesh
    expected = full.sum(1) if reduces else full
    if y.device_axes():
        expected = shard_tensor(expected, y)
    run_both_ways(fd, [mine], expected, holds, device)


@pytest.mark.parametrize("case", ["compute_then_allgather", "allreduce_then_compute", "two_outputs"])
def test_compute_around_communication(world, device, case):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1], dtype=torch.float32)
        if case == "compute_then_allgather":
            outs = [fd.ops.set(fd.ops.mul(x, 2.0))]  # the product stays sharded (unplaced: inherits)
        elif case == "allreduce_then_compute":
            outs = [fd.ops.add(fd.ops.sum(x, [0]), 1.0)]
        else:
            outs = [fd.ops.set(x), fd.ops.sum(x, [0])]
        for out in outs:
            fd.add_output(out)
    mesh = DeviceMesh(range(D))
    for tv in [x, *outs]:
        tv.set_device_mesh(mesh)
    x.axis(0).parallelize(ParallelType.mesh_x)

    full = rand_int([D, 3], torch.float32, device)
    expected = {
        "compute_then_allgather": [full * 2],
        "allreduce_then_compute": [full.sum(0) + 1],
        "two_outputs": [full, full.sum(0)],
    }[case]
    check_dump(fd, "Allgather" if case != "allreduce_then_compute" else "Allreduce")
    results = fd.execute([shard_tensor(full, x)])
    assert len(results) == len(expected)
    for got, want in zip(results, expected):
        exact(got, want)
    buffers = [torch.full_like(t, 77) for t in expected]
    results = fd.execute([shard_tensor(full, x)], outputs=buffers)
    for got, buffer, want in zip(results, buffers, expected):
        assert got.data_ptr() == buffer.data_ptr()
        exact(buffer, want)


# ------------------------------------------------------------ roots outside the other mesh


def _one_mesh_short(world, kind: str, in_mesh, out_mesh, in_sharded: bool, out_sharded: bool):
    """x [D-1, m] between the mesh of ranks 0..D-2 and the last rank alone."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[world.size - 1, -1], dtype=torch.float32)
        y = fd.ops.set(x) if kind == "set" else getattr(fd.ops, kind)(x, [0])
        fd.add_output(y)
    x.set_device_mesh(in_mesh)
    y.set_device_mesh(out_mesh)
    if in_sharded:
        x.axis(0).parallelize(ParallelType.mesh_x)
    if out_sharded:
        y.axis(0).parallelize(ParallelType.mesh_x)
    return fd, x, y


def _mine(full, x, world):
    """This rank's piece of x, or a same-shaped stand-in off x's mesh."""
    if world.rank in x.mesh:
        return shard_tensor(full, x)
    return garbage_like(shard_tensor(full, x, rank=x.mesh.devices[0]))


@pytest.mark.parametrize(
    "comm_type",
    [
        "Gather",
        *(f"Reduce-{kind}" for kind in KINDS),
        "Scatter",
        "Broadcast",
    ],
)
def test_root_outside_the_other_mesh(world, device, comm_type):
    """The root (the last rank) holds no piece of the sharded side: it sends
    or receives a stand-in that must not reach any result."""
    rest, last = DeviceMesh(range(world.size - 1)), DeviceMesh([world.size - 1])
    comm_type, _, kind = comm_type.partition("-")
    spec = {
        "Gather": ("set", rest, last, True, False),
        "Reduce": (kind, rest, last, True, False),
        "Scatter": ("set", last, rest, False, True),
        "Broadcast": ("set", last, rest, False, False),
    }[comm_type]
    fd, x, y = _one_mesh_short(world, *spec)
    full = rand_int([world.size - 1, 4], torch.float32, device)
    check_dump(fd, comm_type)
    holds = world.rank in y.mesh
    if comm_type == "Reduce":
        expected = eager_reduce(full, kind, 0)
    elif comm_type == "Scatter":
        expected = shard_tensor(full, y, rank=world.rank if holds else 0)
    else:
        expected = full
    run_both_ways(fd, [_mine(full, x, world)], expected, holds, device)


# ------------------------------------------------------------ P2P host ops


def _evaluator_class():
    """The evaluator HOSTIR_EVALUATOR names (the suite runs once per evaluator)."""
    from hostir import cpp

    if os.environ.get("HOSTIR_EVALUATOR", "auto") != "python" and cpp.available():
        return cpp.CppEvaluator
    return HostIrEvaluator


def _ring_program(world, m: int, coalesced: bool, symbolic_peers: bool):
    """A hand-built program: send the input to the next rank of the ring and
    receive the previous rank's into a new buffer."""
    c = HostIrContainer()
    x = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(m))], torch.float32, ir.MemoryType.global_)
    c.add_input(x)
    buf = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(m))], torch.float32, ir.MemoryType.global_)
    c.push_back(ir.Allocate(buf))
    D = world.size
    if symbolic_peers:
        me = c.named_scalar("rank")
        to, frm = (me + 1) % D, (me + (D - 1)) % D
    else:
        to = ir.Scalar.constant((world.rank + 1) % D)
        frm = ir.Scalar.constant((world.rank - 1) % D)
    send = ir.P2PCommunication(c.next_name("comm"), "send", x, to)
    recv = ir.P2PCommunication(c.next_name("comm"), "recv", buf, frm)
    if coalesced:
        end = ir.EndCoalescing(c.next_name("comm"))
        for e in (ir.StartCoalescing(), send, recv, end, ir.Wait(end)):
            c.push_back(e)
    else:
        for e in (send, recv, ir.Wait(send), ir.Wait(recv)):
            c.push_back(e)
    c.add_output(buf)
    c.verify()
    return c, x


@pytest.mark.parametrize("coalesced", [True, False], ids=["coalesced", "separate"])
@pytest.mark.parametrize("symbolic_peers", [False, True], ids=["constant_peers", "rank_expr_peers"])
def test_p2p_ring_exchange(world, device, coalesced, symbolic_peers):
    m = 6
    container, x = _ring_program(world, m, coalesced, symbolic_peers)
    dump = str(container)
    assert "P2PCommunication" in dump and "type=send" in dump and "type=recv" in dump, dump
    if coalesced:
        assert "StartCoalescing" in dump and "EndCoalescing" in dump, dump
    full = rand_int([world.size, m], torch.float32, device)
    evaluator = _evaluator_class()(
        container, streams=streams_for(device), device=device, communicator=hostir.communicator.get()
    )
    for _ in range(2):  # the evaluator runs a program any number of times
        out, = evaluator.run({x: full[world.rank].clone()})
        exact(out, full[(world.rank - 1) % world.size])
