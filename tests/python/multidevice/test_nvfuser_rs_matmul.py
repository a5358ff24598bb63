"""nvFuser's `RSMatmulTest.ReduceScatterP2p` and
`RSMatmulTest.ReduceScatterReduceBased`
(tests/cpp/test_multidevice_stream_parallel_type.cpp) written in hostir's
API as nvFuser writes them, `fd.ops.broadcast` included, run against eager
torch on integer-valued data (exact) on any number of ranks.

Both: A [DIDx(D) K pieces, Stream(D) row blocks, M/D, K/D] and B [DIDx(D),
K/D, N] (broadcast to [DIDx(D), 1, K/D, N]; ReduceScatterReduceBased takes
B with its size-1 axis as an input), the partials [DIDx(D), Stream(D), M/D,
N] summed over the devices into C [r(D), DIDx(D), M/D, N]: rank r gets row
block r. ReduceScatterReduceBased also puts the stream on C's reduced axis,
as nvFuser does. Each decomposes as hostir's own matmul + ReduceScatter
(`overlap.matmul_reduce_scatter`) does: the ring schedule a ring of sends
and receives (nvFuser's P2P pipeline), the collective schedule one Reduce
per iteration rooted at the row block's rank (nvFuser's reduce-based
pipeline), and the sequential schedule one ReduceScatter after the matmul.

nvFuser's ReduceScatterP2p marks the partials [Stream(D), DIDx(D), ...]
(the matmul reshards, and nvFuser inserts a resharding set after it);
hostir's lowering gives partials whose only use is that sum A's layout
(`insert_reshardings`) and reshards at the sum, which gives the same ring.
The tests run both spellings of the partials, and the reduce-based program
under the sequential schedule too (the machine model's choice for small
shapes).
"""

from __future__ import annotations

import re

import pytest
import torch

from hostir import DeviceMesh, FusionDefinition, ParallelType, shard_tensor
from hostir.lower.record import LoweringError
from multidevice.test_decompositions import SCHEDULES, exact, head_of, rand_int

MESH_X, STREAM = ParallelType.mesh_x, ParallelType.stream

# HOSTIR_TEST_TRANSPORT=cuda runs the rings over the copy-engine transport
# on the GPU machines, as in test_decompositions.
RING = [s for s in SCHEDULES if s.startswith("ring")]
COLLECTIVE = ["collective", "collective:chunks=2"]

M_D, K_D, N = 4, 3, 5  # M/D, K/D, N: M/D splits into 2 chunks per peer


def reduce_scatter_p2p(D: int, partials: str = "hostir", returned: bool = False):
    """RSMatmulTest.ReduceScatterP2p, the partials [DIDx(D), Stream(D), M/D,
    N] as A holds them (partials="hostir"), or [Stream(D), DIDx(D), M/D, N]
    as nvFuser writes them (partials="nvfuser": the matmul reshards);
    `returned`: the fusion returns the partials too."""
    with FusionDefinition() as fd:
        tv0 = fd.define_tensor([-1, -1, -1, -1])  # [DIDx(D), Stream(D), M/D, K/D]
        tv1 = fd.define_tensor([-1, -1, -1])  # [DIDx(D), K/D, N]
        tv1b = fd.ops.broadcast(tv1, [False, True, False, False])  # [DIDx(D), 1, K/D, N]
        tv2_unreduced = fd.ops.matmul(tv0, tv1b)  # [DIDx(D), Stream(D), M/D, N]
        tv2 = fd.ops.sum(tv2_unreduced, [0])  # [r(D), DIDx(D), M/D, N]
        fd.add_output(tv2)
        if returned:
            fd.add_output(tv2_unreduced)
    mesh = DeviceMesh(range(D))
    for tv in (tv0, tv1, tv1b, tv2_unreduced, tv2):
        tv.set_device_mesh(mesh)
    tv0.axis(0).parallelize(MESH_X)
    tv1.axis(0).parallelize(MESH_X)
    tv1b.axis(0).parallelize(MESH_X)
    tv0.axis(1).parallelize(STREAM)
    device_axis, stream_axis = (0, 1) if partials == "hostir" else (1, 0)
    tv2_unreduced.axis(device_axis).parallelize(MESH_X)
    tv2_unreduced.axis(stream_axis).parallelize(STREAM)
    tv2.axis(1).parallelize(MESH_X)
    return fd, tv0, tv1


def reduce_scatter_reduce_based(D: int, weight: str):
    """RSMatmulTest.ReduceScatterReduceBased: B given as [DIDx(D), 1, K/D,
    N] (weight="input", as nvFuser writes it) or broadcast from [DIDx(D),
    K/D, N] (weight="broadcast")."""
    with FusionDefinition() as fd:
        A = fd.define_tensor([-1, -1, -1, -1])  # [DIDx(D), Stream(D), M/D, K/D]
        if weight == "input":
            B = Bb = fd.define_tensor([-1, 1, -1, -1])  # [DIDx(D), 1, K/D, N]
        else:
            B = fd.define_tensor([-1, -1, -1])  # [DIDx(D), K/D, N]
            Bb = fd.ops.broadcast(B, [False, True, False, False])
        C_unreduced = fd.ops.matmul(A, Bb)  # [DIDx(D), Stream(D), M/D, N]
        C = fd.ops.sum(C_unreduced, [0])  # [Stream(r(D)), DIDx(D), M/D, N]
        fd.add_output(C)
    mesh = DeviceMesh(range(D))
    for tv in {A, B, Bb, C_unreduced, C}:
        tv.set_device_mesh(mesh)
    A.axis(0).parallelize(MESH_X)
    A.axis(1).parallelize(STREAM)
    B.axis(0).parallelize(MESH_X)
    Bb.axis(0).parallelize(MESH_X)
    C_unreduced.axis(1).parallelize(STREAM)
    C_unreduced.axis(0).parallelize(MESH_X)
    C.axis(1).parallelize(MESH_X)
    C.axis(0).parallelize(STREAM)
    return fd, A, B


def _data(D, device):
    """The unsharded A [D, D, M/D, K/D], B [D, K/D, N] and the expected
    output of this rank, row block `rank` of sum_d A[d] @ B[d]."""
    a = rand_int([D, D, M_D, K_D], device)
    b = rand_int([D, K_D, N], device)
    c = torch.matmul(a, b.unsqueeze(1)).sum(0)  # [D, M/D, N]
    return a, b, c


def collectives(dump: str) -> list[str]:
    """The types of the dump's collective Communications (not P2P)."""
    return re.findall(r"^\s*Communication \d+ \(type=(\w+)", dump, re.MULTILINE)


def _loop(dump: str) -> str:
    """The decomposed loop, from its head to the end of the dump."""
    head = head_of(dump)
    return dump[dump.index(head) :]


@pytest.mark.parametrize("sched", RING)
def test_reduce_scatter_p2p_is_a_ring(world, device, sched):
    D = world.size
    fd, a, b = reduce_scatter_p2p(D)
    a_t, b_t, c_t = _data(D, device)
    inputs = [shard_tensor(a_t, a), shard_tensor(b_t, b)]
    (out,) = fd.execute(inputs, schedule=sched, number_of_streams=2)
    exact(out, c_t[world.rank : world.rank + 1])
    # Back to back: the second call reuses every buffer.
    (out,) = fd.execute(inputs, schedule=sched, number_of_streams=2)
    exact(out, c_t[world.rank : world.rank + 1])
    # The program those calls ran.
    dump = fd.host_ir(inputs=inputs, schedule=sched, number_of_streams=2)
    loop = _loop(dump)
    assert "(ring, chunks=" in head_of(dump), dump
    assert "P2PCommunication" in loop and "type=send" in loop and "type=recv" in loop, dump
    assert "matmul(" in loop, dump
    assert collectives(dump) == [], dump  # the ring alone: no collective


@pytest.mark.parametrize("weight", ["input", "broadcast"])
@pytest.mark.parametrize("sched", COLLECTIVE)
def test_reduce_scatter_reduce_based_is_a_reduce_per_row_block(world, device, sched, weight):
    D = world.size
    fd, A, B = reduce_scatter_reduce_based(D, weight)
    a_t, b_t, c_t = _data(D, device)
    b_in = b_t.unsqueeze(1) if weight == "input" else b_t
    inputs = [shard_tensor(a_t, A), shard_tensor(b_in, B)]
    (out,) = fd.execute(inputs, schedule=sched, number_of_streams=2)
    exact(out, c_t[world.rank : world.rank + 1])
    dump = fd.host_ir(inputs=inputs, schedule=sched, number_of_streams=2)
    loop = _loop(dump)
    assert "(collective, chunks=" in head_of(dump), dump
    # nvFuser's reduce-based dump: one Reduce per iteration, rooted at the
    # rank whose row block the iteration sums (with 2 chunks per peer, two
    # iterations per row block), no P2P.
    root = "root=( StreamIdx / 2 )" if "chunks=2" in sched else "root=StreamIdx,"
    assert collectives(loop) == ["Reduce"] and root in loop and "matmul(" in loop, dump
    assert "P2PCommunication" not in dump, dump


@pytest.mark.parametrize("sched", RING[:2])
def test_reduce_scatter_reduce_based_also_runs_as_a_ring(world, device, sched):
    """The decomposition is the schedule's choice, not the spelling's: the
    reduce-based program runs as the P2P ring too."""
    D = world.size
    fd, A, B = reduce_scatter_reduce_based(D, "broadcast")
    a_t, b_t, c_t = _data(D, device)
    inputs = [shard_tensor(a_t, A), shard_tensor(b_t, B)]
    (out,) = fd.execute(inputs, schedule=sched)
    exact(out, c_t[world.rank : world.rank + 1])
    dump = fd.host_ir(inputs=inputs, schedule=sched)
    assert "P2PCommunication" in _loop(dump) and collectives(dump) == [], dump


@pytest.mark.parametrize("sched", COLLECTIVE)
def test_reduce_scatter_p2p_also_runs_reduce_based(world, device, sched):
    D = world.size
    fd, a, b = reduce_scatter_p2p(D)
    a_t, b_t, c_t = _data(D, device)
    inputs = [shard_tensor(a_t, a), shard_tensor(b_t, b)]
    (out,) = fd.execute(inputs, schedule=sched)
    exact(out, c_t[world.rank : world.rank + 1])
    dump = fd.host_ir(inputs=inputs, schedule=sched)
    assert collectives(_loop(dump)) == ["Reduce"] and "P2PCommunication" not in dump, dump


def test_reduce_scatter_p2p_sequential_is_one_reduce_scatter(world, device):
    """The sequential schedule: the whole matmul, then one ReduceScatter
    Communication (what the machine model picks for shapes too small to pay
    for a pipeline)."""
    D = world.size
    fd, a, b = reduce_scatter_p2p(D)
    a_t, b_t, c_t = _data(D, device)
    inputs = [shard_tensor(a_t, a), shard_tensor(b_t, b)]
    (out,) = fd.execute(inputs, schedule="sequential")
    exact(out, c_t[world.rank : world.rank + 1])
    dump = fd.host_ir(inputs=inputs, schedule="sequential")
    assert collectives(dump) == ["ReduceScatter"] and "schedule=(sequential" in head_of(dump), dump
    assert "P2PCommunication" not in dump and "FOR StreamIdx" not in dump, dump


@pytest.mark.parametrize("weight", ["input", "broadcast"])
def test_reduce_scatter_reduce_based_sequential_is_one_reduce_scatter(world, device, weight):
    """nvFuser's reduce-based program marks C's reduced axis as the stream
    axis; under the sequential schedule (the machine model's choice for
    small shapes) the ReduceScatter writes C without walking a stream."""
    D = world.size
    fd, A, B = reduce_scatter_reduce_based(D, weight)
    a_t, b_t, c_t = _data(D, device)
    b_in = b_t.unsqueeze(1) if weight == "input" else b_t
    inputs = [shard_tensor(a_t, A), shard_tensor(b_in, B)]
    for _ in range(2):  # back to back: the second call reuses every buffer
        (out,) = fd.execute(inputs, schedule="sequential")
        exact(out, c_t[world.rank : world.rank + 1])
    dump = fd.host_ir(inputs=inputs, schedule="sequential")
    assert collectives(dump) == ["ReduceScatter"] and "schedule=(sequential" in head_of(dump), dump
    assert "P2PCommunication" not in dump and "FOR StreamIdx" not in dump, dump


def test_reduce_scatter_reduce_based_runs_with_the_default_schedule(world, device):
    """As nvFuser's test calls it: no schedule named, the planner's choice."""
    D = world.size
    fd, A, B = reduce_scatter_reduce_based(D, "input")
    a_t, b_t, c_t = _data(D, device)
    inputs = [shard_tensor(a_t, A), shard_tensor(b_t.unsqueeze(1), B)]
    (out,) = fd.execute(inputs)
    exact(out, c_t[world.rank : world.rank + 1])


@pytest.mark.parametrize("sched", RING + COLLECTIVE)
def test_reduce_scatter_p2p_with_nvfusers_partials_layout(world, device, sched):
    """nvFuser's own partials [Stream(D), DIDx(D), M/D, N] (the matmul
    reshards): the partials, read only by the sum, take A's layout, and the
    program is the same ring (or reduce per row block) as hostir's."""
    D = world.size
    fd, tv0, tv1 = reduce_scatter_p2p(D, partials="nvfuser")
    a_t, b_t, c_t = _data(D, device)
    inputs = [shard_tensor(a_t, tv0), shard_tensor(b_t, tv1)]
    for _ in range(2):  # back to back: the second call reuses every buffer
        (out,) = fd.execute(inputs, schedule=sched, number_of_streams=2)
        exact(out, c_t[world.rank : world.rank + 1])
    dump = fd.host_ir(inputs=inputs, schedule=sched, number_of_streams=2)
    loop = _loop(dump)
    assert "matmul(" in loop, dump
    if sched.startswith("ring"):
        assert "P2PCommunication" in loop and collectives(dump) == [], dump
    else:
        assert collectives(loop) == ["Reduce"] and "P2PCommunication" not in dump, dump
    # The same program as the partials in A's layout.
    theirs, a, b = reduce_scatter_p2p(D)
    assert dump == theirs.host_ir(
        inputs=[shard_tensor(a_t, a), shard_tensor(b_t, b)], schedule=sched, number_of_streams=2
    )


@pytest.mark.parametrize("sched", ["ring", "sequential"])
def test_partials_returned_keep_nvfusers_layout(world, device, sched):
    """Partials the fusion also returns are not re-annotated: their layout is
    what the caller gets. The matmul reshards, and `insert_reshardings`
    moves its operands (the cheaper side here): A's row block j goes to
    rank j, an all-to-all walked along the stream axis (a ring of sends
    and receives per stream index, or one AllToAll sequentially), B is
    gathered, and each rank computes its row block's partials for every K
    piece; the sum is then local."""
    D = world.size
    fd, tv0, tv1 = reduce_scatter_p2p(D, partials="nvfuser", returned=True)
    a_t, b_t, c_t = _data(D, device)
    inputs = [shard_tensor(a_t, tv0), shard_tensor(b_t, tv1)]
    partials = torch.matmul(a_t, b_t.unsqueeze(1))  # [d, j, M/D, N]
    for _ in range(2):  # back to back: the second call reuses every buffer
        out, p = fd.execute(inputs, schedule=sched)
        exact(out, c_t[world.rank : world.rank + 1])
        exact(p, partials[:, world.rank : world.rank + 1])
    dump = fd.host_ir(inputs=inputs, schedule=sched)
    if sched == "ring":
        assert "P2PCommunication" in _loop(dump) and collectives(dump) == [], dump
    else:
        assert collectives(dump) == ["AllToAll", "Allgather"], dump


def test_returned_partials_refuse_collectives(world, device):
    """The all-to-all of returned partials has no collective form."""
    D = world.size
    fd, tv0, tv1 = reduce_scatter_p2p(D, partials="nvfuser", returned=True)
    a_t, b_t, _ = _data(D, device)
    inputs = [shard_tensor(a_t, tv0), shard_tensor(b_t, tv1)]
    with pytest.raises(LoweringError, match="a ring of one piece per peer or sequentially"):
        fd.execute(inputs, schedule="collective")
