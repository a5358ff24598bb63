"""Local compute on sharded tensors, resharding sets inserted by lowering,
AllToAll, 2-D meshes and point-to-point completion, against eager torch.

Every rank builds the same whole tensors from the per-test seed, passes its
pieces, and compares its piece of the result. Programs that cannot run fail
on every rank before any collective (the agreement step shares the error).
"""

from __future__ import annotations

import pytest
import torch

import hostir
from hostir import DeviceMesh, FusionDefinition, ParallelType, shard_tensor
from hostir import ir
from hostir.container import HostIrContainer
from hostir.lower.record import LoweringError
from hostir.runtime.evaluator import HostIrEvaluator
from hostir.runtime.streams import streams_for


def rand_int(shape, dtype, device) -> torch.Tensor:
    return torch.randint(-4, 5, tuple(shape)).to(dtype).to(device)


def exact(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def shard(tv, axis: int, d: int, parallel_type=ParallelType.mesh_x) -> None:
    tv.outer_split(axis, d)
    tv.axis(axis).parallelize(parallel_type)


def chunk(t: torch.Tensor, dim: int, n: int, index: int) -> torch.Tensor:
    return t.chunk(n, dim)[index]


UNARY = {
    "relu": torch.relu,
    "gelu": torch.nn.functional.gelu,
    "silu": torch.nn.functional.silu,
    "neg": torch.neg,
    "exp": torch.exp,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "abs": torch.abs,
}


@pytest.mark.parametrize("kind", sorted(UNARY))
def test_unary_op_on_a_sharded_tensor_computes_locally(world, device, kind):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = getattr(fd.ops, kind)(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh(range(D)))
    shard(x, 0, D)
    full = torch.randn(2 * D, 5, device=device)
    (out,) = fd.execute([shard_tensor(full, x)])
    torch.testing.assert_close(out, chunk(UNARY[kind](full), 0, D, world.rank))
    assert "Communication" not in fd.host_ir()


def test_cast_of_a_sharded_tensor(world, device):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.cast(x, torch.bfloat16)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh(range(D)))
    shard(x, 1, D)
    full = torch.randn(3, 2 * D, device=device)
    (out,) = fd.execute([shard_tensor(full, x)])
    exact(out, chunk(full.to(torch.bfloat16), 1, D, world.rank))


@pytest.mark.parametrize("sharded_side", ["lhs", "rhs"])
def test_binary_op_reads_its_slice_of_a_replicated_operand(world, device, sharded_side):
    D = world.size
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1])
        b = fd.define_tensor(shape=[-1, -1])
        z = fd.ops.sub(a, b)
        fd.add_output(z)
    mesh = DeviceMesh(range(D))
    a.set_device_mesh(mesh)
    b.set_device_mesh(mesh)
    sharded = a if sharded_side == "lhs" else b
    shard(sharded, 1, D)
    a_full, b_full = rand_int([3, 2 * D], torch.float32, device), rand_int([3, 2 * D], torch.float32, device)
    inputs = [shard_tensor(a_full, a), shard_tensor(b_full, b)]
    (out,) = fd.execute(inputs)
    exact(out, chunk(a_full - b_full, 1, D, world.rank))
    assert "Communication" not in fd.host_ir()


@pytest.mark.parametrize("mode", ["auto", "before", "after"])
def test_sum_of_a_sharded_tensor_is_the_same_whichever_side_reshards(world, device, mode):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.sum(x, [1])
        fd.add_output(y)
    mesh = DeviceMesh(range(D))
    x.set_device_mesh(mesh)
    y.set_device_mesh(mesh)
    shard(x, 0, D)
    full = rand_int([2 * D, 5], torch.float32, device)
    (out,) = fd.execute([shard_tensor(full, x)], resharding=mode)
    exact(out, full.sum(1))


def test_strict_mode_fails_on_every_rank_before_any_collective(world, device):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.sum(x, [1])
        fd.add_output(y)
    mesh = DeviceMesh(range(D))
    x.set_device_mesh(mesh)
    y.set_device_mesh(mesh)
    shard(x, 0, D)
    full = rand_int([2 * D, 5], torch.float32, device)
    # Every rank fails the same check: each raises the lowering's own error.
    with pytest.raises(LoweringError, match="both computes and moves data"):
        fd.execute([shard_tensor(full, x)], resharding="strict")


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_all_to_all_moves_the_sharded_axis(world, device, dtype):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 3, -1], dtype=dtype)
        y = fd.ops.set(x)
        fd.add_output(y)
    mesh = DeviceMesh(range(D))
    x.set_device_mesh(mesh)
    y.set_device_mesh(mesh)
    shard(x, 0, D)
    shard(y, 2, D)
    full = rand_int([2 * D, 3, 3 * D], dtype, device)
    (out,) = fd.execute([shard_tensor(full, x)])
    exact(out, chunk(full, 2, D, world.rank))
    assert "type=AllToAll" in fd.host_ir()


# ------------------------------------------------------------ 2-D meshes


def mesh_2d(world) -> DeviceMesh:
    """[D/2, 2] on an even world, else [D, 1]: mesh_y has D/2 (or D) teams
    of ranks, mesh_x has the rest."""
    D = world.size
    shape = (D // 2, 2) if D % 2 == 0 else (D, 1)
    return DeviceMesh(torch.arange(D).reshape(shape))


def sharded_2d(tv, mesh, y_axis: int | None, x_axis: int | None):
    """Shard `tv` along mesh_y on y_axis and mesh_x on x_axis (logical
    axes; the y split comes first)."""
    ny, nx = mesh.shape
    if y_axis is not None:
        shard(tv, y_axis, ny, ParallelType.mesh_y)
    if x_axis is not None:
        # A split before it adds one loop axis.
        at = x_axis + (1 if y_axis is not None and y_axis < x_axis else 0)
        shard(tv, at, nx, ParallelType.mesh_x)


def piece_2d(full, mesh, rank, y_axis, x_axis):
    ny, nx = mesh.shape
    t = full
    if y_axis is not None:
        t = chunk(t, y_axis, ny, mesh.index_along(rank, ParallelType.mesh_y))
    if x_axis is not None:
        t = chunk(t, x_axis, nx, mesh.index_along(rank, ParallelType.mesh_x))
    return t


@pytest.mark.parametrize(
    "case",
    ["allgather_x", "allgather_y", "all_to_all_x", "all_to_all_y"],
)
def test_2d_mesh_set(world, device, case):
    """A set on a [y, x] mesh that changes one mesh dimension's sharding:
    the communication runs per team of that dimension."""
    mesh = mesh_2d(world)
    ny, nx = mesh.shape
    src = (0, 1)  # x's logical axes sharded on mesh_y, mesh_x
    dst = {
        "allgather_x": (0, None),
        "allgather_y": (None, 1),
        "all_to_all_x": (0, 2),
        "all_to_all_y": (2, 1),
    }[case]
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    x.set_device_mesh(mesh)
    y.set_device_mesh(mesh)
    sharded_2d(x, mesh, *src)
    sharded_2d(y, mesh, *dst)
    full = rand_int([2 * ny, 2 * nx, 2 * ny * nx], torch.float32, device)
    (out,) = fd.execute([piece_2d(full, mesh, world.rank, *src)])
    exact(out, piece_2d(full, mesh, world.rank, *dst))


@pytest.mark.parametrize("parallel_type", [ParallelType.mesh_x, ParallelType.mesh_y], ids=["x", "y"])
@pytest.mark.parametrize("output", ["allreduce", "reduce_scatter"])
def test_2d_mesh_sum_over_one_mesh_dimension(world, device, parallel_type, output):
    """x [n, A, B]: axis 0 on `parallel_type` (summed), B on the other mesh
    dimension (kept): an Allreduce, or a ReduceScatter onto A, per team."""
    mesh = mesh_2d(world)
    other = ParallelType.mesh_y if parallel_type is ParallelType.mesh_x else ParallelType.mesh_x
    n, m = mesh.size_along(parallel_type), mesh.size_along(other)
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[n, -1, -1])
        y = fd.ops.sum(x, [0])
        fd.add_output(y)
    x.set_device_mesh(mesh)
    y.set_device_mesh(mesh)
    x.axis(0).parallelize(parallel_type)
    shard(x, 2, m, other)
    if output == "reduce_scatter":
        shard(y, 1, n, parallel_type)
        shard(y, 3, m, other)
    else:
        shard(y, 2, m, other)
    full = rand_int([n, 2 * n, 2 * m], torch.float32, device)
    mine = chunk(chunk(full, 0, n, mesh.index_along(world.rank, parallel_type)), 2, m, mesh.index_along(world.rank, other))
    (out,) = fd.execute([mine])
    expected = chunk(full.sum(0), 1, m, mesh.index_along(world.rank, other))
    if output == "reduce_scatter":
        expected = chunk(expected, 0, n, mesh.index_along(world.rank, parallel_type))
    exact(out, expected)


# ------------------------------------------------------------ point to point


@pytest.mark.parametrize("receiver_first", [True, False], ids=["receiver_first", "sender_first"])
def test_send_recv_between_single_rank_meshes_whatever_the_team_order(world, device, receiver_first):
    """A hand-built SendRecv from each rank to each other (up to 3 ranks),
    its team listing the receiver first or last: the receiver gets the
    sender's data, and no other rank's."""
    ranks = range(min(world.size, 3))
    pairs = [(s, r) for s in ranks for r in ranks if s != r]
    c = HostIrContainer()
    inputs, outputs = [], []
    for s, r in pairs:
        x = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(4))], torch.float32, ir.MemoryType.global_,
                          mesh=DeviceMesh([s]))
        y = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(4))], torch.float32, ir.MemoryType.global_,
                          mesh=DeviceMesh([r]))
        c.add_input(x)
        team = (r, s) if receiver_first else (s, r)
        comm = ir.Communication(c.next_name("comm"), ir.CommunicationType.SendRecv, y, x, team, root=s)
        for e in (ir.Allocate(y), comm, ir.Wait(comm)):
            c.push_back(e)
        c.add_output(y)
        inputs.append(x)
        outputs.append((s, r, y))
    comm = hostir.communicator.get()
    comm.ensure_groups(c.teams())
    evaluator = HostIrEvaluator(c, streams=streams_for(device), device=device, communicator=comm, rank=world.rank)
    full = rand_int([world.size, 4], torch.float32, device)
    bindings = {x: full[s].clone() for x, (s, _, _) in zip(inputs, outputs) if s == world.rank}
    results = evaluator.run(bindings)
    for (s, r, _), got in zip(outputs, results):
        if r == world.rank:
            exact(got, full[s])
        else:
            assert got is None


def _ring_without_send_waits(world, m: int) -> tuple[HostIrContainer, ir.TensorView]:
    """Send the input to the next rank, receive the previous rank's; only
    the receive is waited on in the program."""
    c = HostIrContainer()
    x = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(m))], torch.float32, ir.MemoryType.global_)
    buf = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(m))], torch.float32, ir.MemoryType.global_)
    c.add_input(x)
    me, D = c.named_scalar("rank"), world.size
    send = ir.P2PCommunication(c.next_name("comm"), "send", x, (me + 1) % D)
    recv = ir.P2PCommunication(c.next_name("comm"), "recv", buf, (me + (D - 1)) % D)
    for e in (ir.Allocate(buf), send, recv, ir.Wait(recv)):
        c.push_back(e)
    c.add_output(buf)
    return c, x


def test_ring_exchange_completes_every_send_50_times(world, device):
    container, x = _ring_without_send_waits(world, 64)
    evaluator = HostIrEvaluator(
        container, streams=streams_for(device), device=device, communicator=hostir.communicator.get()
    )
    for i in range(50):
        full = torch.arange(world.size * 64, dtype=torch.float32, device=device).reshape(world.size, 64) + i
        (out,) = evaluator.run({x: full[world.rank].clone()})
        exact(out, full[(world.rank - 1) % world.size])


# ------------------------------------------------------------ propagated output sharding


@pytest.mark.parametrize("op", ["set", "sum", "add"])
def test_output_without_a_sharding_runs_with_the_propagated_one(world, device, op):
    """Only the input is placed and sharded; the output takes the sharding
    propagation gives it: the shard for a set or an add, the whole sum
    (an Allreduce) for a sum over the sharded axis."""
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1])
        y = fd.ops.set(x) if op == "set" else fd.ops.sum(x, [0]) if op == "sum" else fd.ops.add(x, x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh(range(D)))
    x.axis(0).parallelize(ParallelType.mesh_x)
    full = rand_int([D, 6], torch.float32, device)
    (out,) = fd.execute([shard_tensor(full, x)])
    if op == "sum":
        exact(out, full.sum(0))
    else:
        exact(out, (full if op == "set" else 2 * full)[world.rank : world.rank + 1])


@pytest.mark.parametrize("kind", ["column", "row"])
def test_2d_mesh_data_and_tensor_parallel_linear(world, device, kind):
    """The batch sharded on mesh_y (data parallel) and the weight on mesh_x
    (tensor parallel): a column-parallel linear computes locally, a
    row-parallel one all-reduces its partial sums along each mesh row."""
    mesh = mesh_2d(world)
    ny, nx = mesh.shape
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1, -1])
        w = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.linear(x, w)
        fd.add_output(y)
    for tv in (x, w, y):
        tv.set_device_mesh(mesh)
    shard(x, 0, ny, ParallelType.mesh_y)
    shard(y, 0, ny, ParallelType.mesh_y)
    if kind == "column":
        shard(w, 0, nx)
        shard(y, 3, nx)  # y's loop axes: [y, B/ny, M, N]
    else:
        shard(x, 3, nx)  # x's loop axes: [y, B/ny, M, K]
        shard(w, 1, nx)
    x_full = rand_int([2 * ny, 3, 4 * nx], torch.float32, device)
    w_full = rand_int([2 * nx, 4 * nx], torch.float32, device)
    (out,) = fd.execute([shard_tensor(x_full, x), shard_tensor(w_full, w)])
    expected = torch.nn.functional.linear(x_full, w_full)
    expected = chunk(expected, 0, ny, mesh.index_along(world.rank, ParallelType.mesh_y))
    if kind == "column":
        expected = chunk(expected, 2, nx, mesh.index_along(world.rank, ParallelType.mesh_x))
    exact(out, expected)
    dump = fd.host_ir()
    if kind == "row":
        assert "type=Allreduce" in dump and f"team=({' '.join(map(str, mesh.team_of(world.rank)))})" in dump, dump
    else:
        assert "Communication" not in dump, dump
