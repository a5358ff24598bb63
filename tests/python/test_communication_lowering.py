"""Golden dumps of multi-device lowering: shardings propagated, resharding
ops turned into communications (survey §3.2), pipelines with a
communication in each chunk, and each rank's pruned program. Lowering needs
no process group, so these run in one process for any mesh size."""

from __future__ import annotations

import pytest
import torch

from hostir import DeviceMesh, FusionDefinition, ParallelType
from hostir.lower import LoweringError, lower

from conftest import check_golden


def _lower(fd: FusionDefinition, rank: int | None = 0, backend: str = "NCCL") -> str:
    return str(_program(fd, rank, backend).program)


def _program(fd: FusionDefinition, rank: int | None = 0, backend: str = "NCCL"):
    return lower(fd.fusion, rank=rank, backend=backend)


def _place(mesh, *tvs):
    for tv in tvs:
        tv.set_device_mesh(mesh)


def _allgather(d=2):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[d, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    _place(DeviceMesh(range(d)), x, y)
    x.axis(0).parallelize(ParallelType.mesh_x)
    return fd


def test_allgather_is_allocate_communication_wait():
    check_golden("comm_allgather", _program(_allgather()))


def test_allreduce_from_sum_over_sharded_axis():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, -1, -1])
        y = fd.ops.sum(x, [0])
        fd.add_output(y)
    _place(DeviceMesh([0, 1]), x, y)
    x.axis(0).parallelize(ParallelType.mesh_x)
    check_golden("comm_allreduce", _program(fd))


def test_reduce_scatter_when_output_sharded():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, 2, -1])
        y = fd.ops.sum(x, [0])
        fd.add_output(y)
    _place(DeviceMesh([0, 1]), x, y)
    x.axis(0).parallelize(ParallelType.mesh_x)
    y.axis(1).parallelize(ParallelType.mesh_x)
    check_golden("comm_reduce_scatter", _program(fd))


def _broadcast():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh([0]))
    y.set_device_mesh(DeviceMesh([0, 1]))
    return fd


def test_broadcast_between_meshes():
    check_golden("comm_broadcast", _program(_broadcast()))


def test_gather_to_a_smaller_mesh():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh([0, 1]))
    y.set_device_mesh(DeviceMesh([0]))
    x.axis(0).parallelize(ParallelType.mesh_x)
    check_golden("comm_gather", _program(fd))


def test_scatter_from_replicated():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh([0]))
    y.set_device_mesh(DeviceMesh([0, 1]))
    y.axis(0).parallelize(ParallelType.mesh_x)
    check_golden("comm_scatter", _program(fd))


def test_reduce_to_a_smaller_mesh():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, -1])
        y = fd.ops.sum(x, [0])
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh([0, 1]))
    y.set_device_mesh(DeviceMesh([0]))
    x.axis(0).parallelize(ParallelType.mesh_x)
    check_golden("comm_reduce", _program(fd))


def test_send_recv_between_sharded_meshes():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh([0, 1]))
    y.set_device_mesh(DeviceMesh([1, 0]))
    x.axis(0).parallelize(ParallelType.mesh_x)
    y.axis(0).parallelize(ParallelType.mesh_x)
    check_golden("comm_send_recv", _program(fd))


def test_split_axis_sharded_then_gathered():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 8])
        y = fd.ops.set(x)
        fd.add_output(y)
    _place(DeviceMesh([0, 1]), x, y)
    x.outer_split(0, 2)
    x.axis(0).parallelize(ParallelType.mesh_x)
    check_golden("comm_split_allgather", _program(fd))


def test_unplaced_tensors_inherit_mesh_and_sharding():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 8])
        w = fd.define_tensor(shape=[8, 4])
        y = fd.ops.matmul(x, w)
        z = fd.ops.add(y, y)
        fd.add_output(z)
    x.set_device_mesh(DeviceMesh([0, 1]))
    x.outer_split(0, 2)
    x.axis(0).parallelize(ParallelType.mesh_x)
    program = _program(fd)
    check_golden("propagated_split_sharding", program)
    text = str(program.program)
    assert "Communication" not in text


def test_n_d_mesh_allgathers_per_row_and_prunes_other_rows():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    _place(DeviceMesh([[0, 1], [2, 3]]), x, y)
    x.axis(0).parallelize(ParallelType.mesh_x)
    unpruned = str(lower(fd.fusion).program)
    assert "team=(0 1)" in unpruned and "team=(2 3)" in unpruned
    on_rank_3 = _lower(fd, rank=3)
    assert "team=(2 3)" in on_rank_3 and "team=(0 1)" not in on_rank_3


def test_rank_outside_receiver_mesh_prunes_allocation_and_keeps_send():
    text = _lower(_broadcast(), rank=0)
    # Rank 0 is the root and in the receiver mesh: it allocates and sends.
    assert "ALLOCATE" in text and "type=Broadcast" in text


def test_digest_is_the_same_for_every_rank():
    fd = _allgather(4)
    digests = {lower(fd.fusion, rank=r).digest for r in range(4)}
    assert len(digests) == 1


def test_digest_changes_with_the_schedule():
    fd = _allgather()
    before = lower(fd.fusion, rank=0).digest
    fd.fusion.outputs[0].axis(1).parallelize(ParallelType.stream)
    assert lower(fd.fusion, rank=0).digest != before


# ---------------------------------------------------------------- pipelines


def test_stream_parallel_allgather_matches_reference_shape():
    """The reference's collective-based Allgather pipeline (survey §3.8),
    with 8 ranks: an initial-sync loop, then a loop whose body gathers one
    slice on its stream."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 8])
        y = fd.ops.set(x)
        fd.add_output(y)
    _place(DeviceMesh(range(8)), x, y)
    x.axis(1).parallelize(ParallelType.mesh_x)
    y.axis(0).parallelize(ParallelType.stream)
    check_golden("pipeline_allgather", _program(fd))


def _ag_matmul():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[4, 2, -1, -1], dtype=torch.bfloat16)
        w = fd.define_tensor(shape=[-1, -1], dtype=torch.bfloat16)
        xg = fd.ops.set(x)
        y = fd.ops.matmul(xg, w)
        fd.add_output(y)
    _place(DeviceMesh([0, 1]), x, w, xg, y)
    x.axis(1).parallelize(ParallelType.mesh_x)
    xg.axis(0).parallelize(ParallelType.stream)
    y.axis(0).parallelize(ParallelType.stream)
    return fd


def test_ag_matmul_pipeline():
    check_golden("pipeline_ag_matmul", _program(_ag_matmul()))


def test_matmul_reduce_scatter_pipeline():
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[4, 2, 2, -1, -1])
        b = fd.define_tensor(shape=[1, 2, 1, -1, -1])
        c = fd.ops.matmul(a, b)
        y = fd.ops.sum(c, [1])
        fd.add_output(y)
    _place(DeviceMesh([0, 1]), a, b, y)  # c inherits a's sharding
    a.axis(1).parallelize(ParallelType.mesh_x)
    b.axis(1).parallelize(ParallelType.mesh_x)
    y.axis(2).parallelize(ParallelType.mesh_x)
    c.axis(0).parallelize(ParallelType.stream)
    y.axis(0).parallelize(ParallelType.stream)
    check_golden("pipeline_matmul_reduce_scatter", _program(fd))


def test_matmul_allreduce_pipeline():
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[4, 2, -1, -1])
        b = fd.define_tensor(shape=[1, 2, -1, -1])
        c = fd.ops.matmul(a, b)
        y = fd.ops.sum(c, [1])
        fd.add_output(y)
    _place(DeviceMesh([0, 1]), a, b, y)  # c inherits a's sharding
    a.axis(1).parallelize(ParallelType.mesh_x)
    b.axis(1).parallelize(ParallelType.mesh_x)
    c.axis(0).parallelize(ParallelType.stream)
    y.axis(0).parallelize(ParallelType.stream)
    check_golden("pipeline_matmul_allreduce", _program(fd))


# ---------------------------------------------------------------- errors


def _expect(fd, match, **options):
    with pytest.raises(LoweringError, match=match):
        lower(fd.fusion, rank=0, **options)


def test_op_that_computes_and_reshards_is_rejected_in_strict_mode():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, -1])
        y = fd.ops.add(x, x)
        fd.add_output(y)
    _place(DeviceMesh([0, 1]), x, y)
    x.axis(0).parallelize(ParallelType.mesh_x)
    _expect(fd, "both computes and moves data between ranks", resharding="strict")


def test_stream_axis_on_the_gathered_sharded_axis_is_decomposed():
    # The device axis walked as the stream axis: a ring over the ranks
    # (decompose_device_axis), no longer an error.
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    _place(DeviceMesh([0, 1]), x, y)
    x.axis(0).parallelize(ParallelType.mesh_x)
    y.axis(0).parallelize(ParallelType.stream)
    assert "(ring, chunks=1, direction=+1, transport=NCCL):" in _lower(fd)


def test_mesh_x_extent_must_equal_mesh_size():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[3, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    _place(DeviceMesh([0, 1]), x, y)
    x.axis(0).parallelize(ParallelType.mesh_x)
    _expect(fd, "extent 3 but DeviceMesh\\{0 1\\} shards 2 ways")


def test_reduction_of_unsharded_axis_across_meshes_is_rejected_in_strict_mode():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, -1])
        y = fd.ops.sum(x, [1])
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh([0, 1]))
    y.set_device_mesh(DeviceMesh([0]))
    _expect(fd, "both computes and moves data", resharding="strict")


def test_reduction_of_unsharded_axis_across_meshes_reduces_then_moves():
    # The sum is smaller than its input, so the resharding set goes after it.
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, -1])
        y = fd.ops.sum(x, [1])
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh([0, 1]))
    y.set_device_mesh(DeviceMesh([0]))
    check_golden("reshard_after_reduction", _lower(fd, rank=None))


def test_unplaced_tensor_with_mesh_x_takes_its_producers_mesh():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, -1])
        y = fd.ops.set(x)
        z = fd.ops.set(y)
        fd.add_output(z)
    x.set_device_mesh(DeviceMesh([0, 1]))
    z.set_device_mesh(DeviceMesh([0, 1]))
    y.axis(0).parallelize(ParallelType.mesh_x)
    # y is placed by propagation; its mesh_x is the user's.
    text = _lower(fd)
    assert "type=Scatter" in text or "type=Allgather" in text


def test_k_split_on_one_operand_only_is_rejected():
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, 8])
        b = fd.define_tensor(shape=[8, -1])
        y = fd.ops.matmul(a, b)
        fd.add_output(y)
    _place(DeviceMesh([0, 1]), a, b, y)
    a.outer_split(1, 2)
    _expect(fd, "split differently")


def test_mesh_rejects_duplicates_and_negatives():
    with pytest.raises(ValueError, match="unique"):
        DeviceMesh([0, 0])
    with pytest.raises(ValueError, match=">= 0"):
        DeviceMesh([-1, 0])
    with pytest.raises(ValueError, match="at least one"):
        DeviceMesh([])


def test_split_by_non_divisor_of_constant_extent_is_rejected():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[6, 4])
        fd.add_output(fd.ops.set(x))
    with pytest.raises(ValueError, match="extent 6 not divisible by 4"):
        x.outer_split(0, 4)
