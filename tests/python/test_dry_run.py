"""The dry run: every rank's program on meta tensors, in one process.

Shapes, memory plans and traffic of lowered fusions; failures that name the
rank and the op; and cross-rank matching, which must catch each class of
mismatch (a missing Wait, a skipped collective, another type, root or size
on one rank, mismatched P2P peers, a send without its recv) in hand-built
or mutated programs. `tests/python/multidevice/test_dry_run_vs_gloo.py`
checks the same numbers against real gloo runs.
"""

from __future__ import annotations

import json

import pytest
import torch

import hostir
from hostir import DeviceMesh, FusionDefinition, ParallelType, ir
from hostir.container import HostIrContainer
from hostir.analysis.dry_run import CommunicationMismatchError, DryRunError, dry_run_programs
from hostir.lower import lower

F32 = 4


def _place(mesh, *tvs):
    for tv in tvs:
        tv.set_device_mesh(mesh)


def ag_matmul(d: int, chunks: int = 4, hidden: int = 64):
    """The sequence-parallel AG+matmul pipeline of the README's example."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[chunks, d, -1, hidden])
        w = fd.define_tensor(shape=[hidden, -1])
        xg = fd.ops.set(x)
        y = fd.ops.matmul(xg, w)
        fd.add_output(y)
    _place(DeviceMesh(range(d)), x, w, xg, y)
    x.axis(1).parallelize(ParallelType.mesh_x)
    xg.axis(0).parallelize(ParallelType.stream)
    y.axis(0).parallelize(ParallelType.stream)
    return fd


def allgather(d: int):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[d, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    _place(DeviceMesh(range(d)), x, y)
    x.axis(0).parallelize(ParallelType.mesh_x)
    return fd


def test_ag_matmul_for_8_ranks_shapes_memory_and_traffic():
    d, rows, cols = 8, 8, 32
    report = hostir.dry_run(ag_matmul(d), [(4, 1, rows, 64), (64, cols)], world_size=d, number_of_streams=2)
    assert report.world_size == d and len(report.ranks) == d
    gathered, out = 4 * d * rows * 64 * F32, 4 * d * rows * cols * F32
    for r in report.ranks:
        assert r.outputs == [("T3", [4, d, rows, cols], "float32")]
        assert sorted(b.bytes for b in r.buffers) == sorted([gathered, out])
        assert r.peak_bytes == gathered + out
        assert "ALLOCATE" in r.peak_at
        assert r.peak_by_stream == {"caller": gathered + out}
        assert len(r.communications) == 4
        piece = rows * 64 * F32
        for k, t in enumerate(r.communications):
            assert t.kind == "Allgather" and t.team == tuple(range(d))
            assert t.loops == [("StreamIdx", k)] and t.stream == f"stream {k % 2}"
            assert (t.input_bytes, t.output_bytes) == (piece, piece * d)
            assert t.sent == t.received == {p: piece for p in range(d) if p != r.rank}
        assert r.ops_executed["Communication"] == 4 and r.ops_executed["Wait"] == 4
        assert r.ops_executed["MatmulOp"] == 4 and r.ops_executed["ForLoop"] == 2


def test_fd_dry_run_and_inputs_as_tensors_shapes_or_meta_give_one_report():
    fd = ag_matmul(2)
    shapes = [(4, 1, 3, 64), (64, 5)]
    reports = [
        fd.dry_run(shapes, world_size=2),
        fd.dry_run([torch.randn(s) for s in shapes], world_size=2),
        fd.dry_run([torch.empty(s, device="meta") for s in shapes], world_size=2),
    ]
    assert reports[0].to_json() == reports[1].to_json() == reports[2].to_json()


def test_fake_tensor_inputs_are_accepted():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = [torch.empty(4, 1, 3, 64), torch.empty(64, 5)]
    report = hostir.dry_run(ag_matmul(2), fake, world_size=2)
    assert report[0].outputs[0][1] == [4, 2, 3, 5]


def test_report_prints_and_serializes():
    report = hostir.dry_run(ag_matmul(8), [(4, 1, 8, 64), (64, 32)], world_size=8, number_of_streams=2)
    text = str(report)
    assert "Dry run of 8 ranks, 2 streams" in text
    assert "ranks 0-7:" in text  # identical ranks print once
    assert "Allgather team=(0 1 2 3 4 5 6 7) [StreamIdx=0] on stream 0" in text
    assert "sends 2048 B to each of 7 peers; receives 2048 B from each of 7 peers" in text
    assert "memory: peak 98304 B after T3 = ALLOCATE(buffer=T3" in text
    data = json.loads(report.to_json())
    assert data["world_size"] == 8 and len(data["ranks"]) == 8
    r0 = data["ranks"][0]
    assert r0["outputs"] == [{"name": "T3", "shape": [4, 8, 8, 32], "dtype": "float32"}]
    assert r0["memory"]["peak_bytes"] == 98304
    assert r0["communications"][1]["loops"] == [{"index": "StreamIdx", "value": 1}]
    assert r0["communications"][0]["sent"] == {str(p): 2048 for p in range(1, 8)}


def test_single_device_memory_counts_fresh_results_per_iteration():
    """three_sets_split: three buffers of the whole size, all live at the
    peak."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        a = fd.ops.set(x)
        b = fd.ops.set(a)
        c = fd.ops.set(b)
        fd.add_output(c)
    a.axis(0).parallelize(ParallelType.stream)
    c.axis(0).parallelize(ParallelType.stream)
    report = fd.dry_run([(6, 5)])
    (r,) = report.ranks
    assert r.communications == [] and r.outputs == [("T3", [6, 5], "float32")]
    size = 6 * 5 * F32
    assert [(b.name, b.bytes) for b in r.buffers] == [("T1", size), ("T2", size), ("T3", size)]
    assert r.peak_bytes == 3 * size
    # Stream propagation puts the middle set in the loop too: 6 rows x 3 sets.
    assert r.ops_executed["Set"] == 6 * 3


def test_per_peer_bytes_of_each_collective():
    cases = {}
    with FusionDefinition() as fd:  # Allreduce
        x = fd.define_tensor(shape=[4, -1, -1])
        y = fd.ops.sum(x, [0])
        fd.add_output(y)
    _place(DeviceMesh(range(4)), x, y)
    x.axis(0).parallelize(ParallelType.mesh_x)
    cases["Allreduce"] = (fd, [(1, 3, 5)], lambda me: ({p: 60 for p in range(4) if p != me},) * 2)
    with FusionDefinition() as fd:  # ReduceScatter
        x = fd.define_tensor(shape=[4, 4, -1])
        y = fd.ops.sum(x, [0])
        fd.add_output(y)
    _place(DeviceMesh(range(4)), x, y)
    x.axis(0).parallelize(ParallelType.mesh_x)
    y.axis(1).parallelize(ParallelType.mesh_x)
    cases["ReduceScatter"] = (fd, [(1, 4, 5)], lambda me: ({p: 20 for p in range(4) if p != me},) * 2)
    with FusionDefinition() as fd:  # Broadcast from rank 0 to ranks 1-3
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh([0]))
    y.set_device_mesh(DeviceMesh([1, 2, 3]))
    cases["Broadcast"] = (
        fd,
        [(3, 5)],
        lambda me: ({1: 60, 2: 60, 3: 60}, {}) if me == 0 else ({}, {0: 60}),
    )
    with FusionDefinition() as fd:  # Gather onto rank 0
        x = fd.define_tensor(shape=[4, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh(range(4)))
    y.set_device_mesh(DeviceMesh([0]))
    x.axis(0).parallelize(ParallelType.mesh_x)
    cases["Gather"] = (
        fd,
        [(1, 5)],
        lambda me: ({}, {1: 20, 2: 20, 3: 20}) if me == 0 else ({0: 20}, {}),
    )
    with FusionDefinition() as fd:  # AllToAll: rows sharded in, columns out
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    _place(DeviceMesh(range(4)), x, y)
    for tv, axis in ((x, 0), (y, 1)):
        tv.outer_split(axis, 4)
        tv.axis(axis).parallelize(ParallelType.mesh_x)
    # 2 x 8 floats a rank (64 bytes): a quarter of them to each peer.
    cases["AllToAll"] = (fd, [(2, 8)], lambda me: ({p: 16 for p in range(4) if p != me},) * 2)
    for kind, (fd, inputs, expected) in cases.items():
        report = hostir.dry_run(fd, inputs, world_size=4)
        for r in report.ranks:
            (t,) = r.communications
            assert t.kind == kind
            assert (t.sent, t.received) == expected(r.rank), (kind, r.rank, t)


# ---------------------------------------------------------------- failures


def test_split_that_does_not_divide_runs_ragged():
    """A split of a symbolic extent is ceilDiv (as in nvFuser): 5 local rows
    split by 3 are a piece of 3 and a piece of 2, not an error."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 8])
        y = fd.ops.set(x)
        fd.add_output(y)
    _place(DeviceMesh(range(2)), x, y)
    x.outer_split(0, 2)
    x.axis(0).parallelize(ParallelType.mesh_x)
    x.split(1, 3)
    report = hostir.dry_run(fd, [(5, 8)], world_size=2)
    # y is replicated: it gathers both ranks' 5 rows.
    assert [r.outputs for r in report.ranks] == [[("T1", [10, 8], "float32")]] * 2


def test_bad_shape_names_the_rank():
    with pytest.raises(DryRunError, match=r"rank 0: InputError: input 1 \(T1\): axis 0 must have size 64"):
        hostir.dry_run(ag_matmul(2), [(4, 1, 3, 64), (63, 5)], world_size=2)


def test_too_few_ranks_names_the_rank():
    with pytest.raises(DryRunError, match=r"rank 0: .*requests 4 devices"):
        hostir.dry_run(allgather(4), [(1, 3)], world_size=2)


def _p2p_program(rank: int, peer: int, kind: str, n: int = 6, wait: bool = True) -> HostIrContainer:
    c = HostIrContainer()
    buf = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(n))], torch.float32, ir.MemoryType.global_)
    c.add_input(buf)
    e = ir.P2PCommunication(c.next_name("comm"), kind, buf, ir.Scalar.constant(peer))
    c.push_back(e)
    if wait:
        c.push_back(ir.Wait(e))
    return c


def test_missing_peer_names_the_rank_and_the_op():
    programs = {0: _p2p_program(0, 2, "send"), 1: _p2p_program(1, 0, "recv")}
    with pytest.raises(DryRunError, match=r"(?s)rank 0: .*invalid peer 2: the world has 2 ranks.*P2PCommunication"):
        dry_run_programs(programs, [[6]])


def test_matched_p2p_programs_pass_and_count_bytes():
    report = dry_run_programs({0: _p2p_program(0, 1, "send"), 1: _p2p_program(1, 0, "recv")}, [[6]])
    assert report[0].communications[0].sent == {1: 24}
    assert report[1].communications[0].received == {0: 24}


# ---------------------------------------------------------------- mismatches


def test_mismatched_p2p_peers_are_reported_with_both_lines():
    # Rank 0 sends to 1, but rank 1 receives from 2 (and 2 sends to 1).
    programs = {0: _p2p_program(0, 1, "send"), 1: _p2p_program(1, 2, "recv"), 2: _p2p_program(2, 1, "send")}
    with pytest.raises(CommunicationMismatchError) as info:
        dry_run_programs(programs, [[6]])
    msg = str(info.value)
    assert "rank 0 sends to rank 1, which receives nothing more from it" in msg
    assert "rank 0: P2PCommunication" in msg and "type=send" in msg
    assert "rank 1: P2PCommunication" in msg and "type=recv" in msg


def test_send_without_recv_is_reported():
    programs = {0: _p2p_program(0, 1, "send"), 1: HostIrContainer()}
    programs[1].add_input(ir.TensorView(programs[1], [ir.IterDomain(programs[1], ir.Scalar.constant(6))], torch.float32))
    with pytest.raises(CommunicationMismatchError, match="rank 0 sends to rank 1, which receives nothing more"):
        dry_run_programs(programs, [[6]])


def test_p2p_size_mismatch_is_reported():
    programs = {0: _p2p_program(0, 1, "send", n=6), 1: _p2p_program(1, 0, "recv", n=4)}
    with pytest.raises(CommunicationMismatchError, match="rank 0 sends 24 bytes to rank 1, which receives 16 bytes"):
        dry_run_programs(programs, {0: [[6]], 1: [[4]]})


def test_missing_wait_is_reported():
    programs = {0: _p2p_program(0, 1, "send", wait=False), 1: _p2p_program(1, 0, "recv")}
    with pytest.raises(CommunicationMismatchError, match=r"(?s)never waited for.*rank 0: P2PCommunication"):
        dry_run_programs(programs, [[6]])


def _rank_programs(fd, d: int) -> dict[int, HostIrContainer]:
    return {r: lower(fd.fusion, rank=r).program for r in range(d)}


def _without(container: HostIrContainer, drop) -> HostIrContainer:
    """A copy of `container` without the top-level or loop-body exprs
    that `drop(e)` selects."""

    def keep(exprs):
        out = []
        for e in exprs:
            if drop(e):
                continue
            out.append(e.replace(body=keep(e.body)) if isinstance(e, ir.ForLoop) else e)
        return out

    m = container.derive()
    m.exprs = keep(container.exprs)
    return m


def test_missing_wait_in_a_lowered_program_is_reported():
    programs = _rank_programs(allgather(2), 2)
    programs[1] = _without(programs[1], lambda e: isinstance(e, ir.Wait))
    with pytest.raises(CommunicationMismatchError, match=r"(?s)missing Wait.*rank 1: Communication \d+ \(type=Allgather"):
        dry_run_programs(programs, [[1, 3]])


def test_collective_skipped_on_one_rank_is_reported():
    programs = _rank_programs(ag_matmul(2), 2)

    # Rank 1's loop posts only 3 of the 4 chunks' collectives: its loop is
    # cut to 3 iterations.
    def shorten(exprs):
        out = []
        for e in exprs:
            if isinstance(e, ir.ForLoop) and any(isinstance(b, ir.Communication) for b in e.body):
                e = e.replace(stop=ir.Scalar.constant(3))
            out.append(e)
        return out

    m = programs[1].derive()
    m.exprs = shorten(programs[1].exprs)
    programs[1] = m
    with pytest.raises(CommunicationMismatchError) as info:
        dry_run_programs(programs, [[4, 1, 3, 64], [64, 5]])
    msg = str(info.value)
    assert "rank 1 posts no communication #3 on this team" in msg
    assert "rank 0: Communication" in msg and "(in loop StreamIdx = 3)" in msg


def _retyped(container, **changes):
    """`container` with its Communication's fields replaced (`changes`)
    and its Wait waiting for the new one."""
    m = container.derive()
    m.exprs = [e.replace(**changes) if isinstance(e, ir.Communication) else e for e in container.exprs]
    for e in container.exprs:
        if isinstance(e, ir.Wait):
            m.exprs[m.exprs.index(e)] = ir.Wait(next(x for x in m.exprs if isinstance(x, ir.Communication)))
    return m


def test_other_type_root_or_size_on_one_rank_is_reported():
    programs = _rank_programs(allgather(2), 2)

    with pytest.raises(CommunicationMismatchError, match=r"(?s)differs \(kind Allgather vs Broadcast\).*rank 0:.*rank 1:"):
        dry_run_programs({0: programs[0], 1: _retyped(programs[1], type=ir.CommunicationType.Broadcast, root=1)}, [[1, 3]])
    with pytest.raises(CommunicationMismatchError, match=r"(?s)differs \(sizes: 12 -> 24 bytes on rank 0, 16 -> 32"):
        dry_run_programs(programs, {0: [[1, 3]], 1: [[1, 4]]})

    bcast = {}
    for r in range(2):
        with FusionDefinition() as fd:
            x = fd.define_tensor(shape=[-1])
            y = fd.ops.set(x)
            fd.add_output(y)
        x.set_device_mesh(DeviceMesh([0]))
        y.set_device_mesh(DeviceMesh([0, 1]))
        bcast[r] = lower(fd.fusion, rank=r).program
    dry_run_programs(bcast, [[5]])  # as lowered, they match
    moved = _retyped(bcast[1], root=1)
    with pytest.raises(CommunicationMismatchError, match=r"(?s)differs \(root 0 vs 1\)"):
        dry_run_programs({0: bcast[0], 1: moved}, [[5]])


def test_a_posts_error_is_reported_after_the_ranks_match():
    """Both ranks turn the Allgather into a Broadcast from rank 1, so their
    communications match; rank 1's post then cannot put its [1, 3] piece
    into the [2, 3] output, as a real run's post could not."""
    programs = _rank_programs(allgather(2), 2)

    with pytest.raises(DryRunError, match=r"(?s)^rank 1: RuntimeError: shape '\[2, 3\]' is invalid.*While executing:\nCommunication .*type=Broadcast"):
        dry_run_programs({r: _retyped(p, type=ir.CommunicationType.Broadcast, root=1) for r, p in programs.items()}, [[1, 3]])


def _middle_axis_allgather(d: int):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[3, d, 2])
        y = fd.ops.set(x)
        fd.add_output(y)
    _place(DeviceMesh(range(d)), x, y)
    x.axis(1).parallelize(ParallelType.mesh_x)
    return fd


@pytest.mark.parametrize("backend, scratch", [("gloo", 3 * 2 * 2 * F32), ("NCCL", 0)])
def test_staging_of_a_collective_is_in_the_plan(backend, scratch):
    """An Allgather of an axis that is not outermost gathers into a staging
    buffer [2, 3, 1, 2] and moves the pieces into place at its Wait; gloo
    also gathers into a flat buffer of the output's size. Both are on the
    communication's line and in the peak, with the output [3, 2, 2]."""
    report = hostir.dry_run(_middle_axis_allgather(2), [[3, 1, 2]], world_size=2, backend=backend)
    (t,) = report[0].communications
    staging = 2 * 3 * 1 * 2 * F32
    assert t.staging_bytes == staging + scratch
    assert f"staging {staging + scratch} B" in str(report)
    output = 3 * 2 * 2 * F32
    # At the Wait the backend's scratch is gone and the pieces are stacked
    # (a copy of the staging buffer) before they are moved into the output.
    assert report[0].peak_bytes == output + staging + max(scratch, staging)
