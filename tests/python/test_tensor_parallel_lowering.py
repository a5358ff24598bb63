"""Golden dumps of tensor-parallel programs: sharded weights in linear and
matmul (column and row parallel, sequence parallel), resharding sets that
`insert_reshardings` adds on the cheaper side of an op, replicated operands
read as a local slice, AllToAll and 2-D meshes. Lowering needs no process
group, so these run in one process; tests/python/multidevice runs the same
programs on 2, 3 and 4 ranks against eager torch."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

from hostir import DeviceMesh, FusionDefinition, ParallelType
from hostir.lower import LoweringError, lower

from conftest import check_golden

REPO = pathlib.Path(__file__).resolve().parents[2]


def _dump(fd: FusionDefinition, **options) -> str:
    return str(lower(fd.fusion, **options).program)


def _comms(text: str) -> list[str]:
    return re.findall(r"^\s*Communication \d+ \(type=(\w+),", text, re.MULTILINE)


def _place(mesh, *tvs):
    for tv in tvs:
        if tv is not None:
            tv.set_device_mesh(mesh)


def _shard(tv, axis: int, d: int = 2, parallel_type=ParallelType.mesh_x):
    tv.outer_split(axis, d)
    tv.axis(axis).parallelize(parallel_type)


def _linear(bias: bool):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        w = fd.define_tensor(shape=[-1, -1])
        b = fd.define_tensor(shape=[-1]) if bias else None
        y = fd.ops.linear(x, w, b)
        fd.add_output(y)
    return fd, x, w, b, y


def test_column_parallel_linear_computes_locally():
    fd, x, w, b, y = _linear(bias=True)
    _place(DeviceMesh([0, 1]), x, w, b)
    _shard(w, 0)
    _shard(b, 0)
    text = _dump(fd)
    assert _comms(text) == []
    check_golden("tp_column_linear", text)


def test_row_parallel_linear_sums_partials_with_allreduce_then_adds_bias():
    fd, x, w, b, y = _linear(bias=True)
    _place(DeviceMesh([0, 1]), x, w, b, y)
    _shard(x, 1)
    _shard(w, 1)
    text = _dump(fd)
    assert _comms(text) == ["Allreduce"]
    check_golden("tp_row_linear_allreduce", text)


def test_row_parallel_linear_with_sequence_sharded_output_reduce_scatters():
    fd, x, w, b, y = _linear(bias=False)
    _place(DeviceMesh([0, 1]), x, w, y)
    _shard(x, 1)
    _shard(w, 1)
    _shard(y, 0)
    text = _dump(fd)
    assert _comms(text) == ["ReduceScatter"]
    check_golden("tp_row_linear_reduce_scatter", text)


def test_row_parallel_linear_with_stream_axis_pipelines_partial_sums_and_allreduce():
    fd, x, w, b, y = _linear(bias=False)
    _place(DeviceMesh([0, 1]), x, w, y)
    _shard(x, 1)
    _shard(w, 1)
    y.axis(0).parallelize(ParallelType.stream)
    text = _dump(fd)
    work_loop = text.split("FOR StreamIdx")[-1]
    assert "partial = " in work_loop and "type=Allreduce" in work_loop
    check_golden("tp_row_linear_stream_pipeline", text)


def test_inserted_allgather_joins_the_stream_loop_of_its_consumer():
    # No explicit set: the Allgather of x is inserted with the output's
    # stream axis, so each chunk is gathered then multiplied (AG+GEMM).
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[4, 2, -1, 16])
        w = fd.define_tensor(shape=[16, -1])
        y = fd.ops.matmul(x, w)
        fd.add_output(y)
    _place(DeviceMesh([0, 1]), x, w, y)
    x.axis(1).parallelize(ParallelType.mesh_x)
    y.axis(0).parallelize(ParallelType.stream)
    text = _dump(fd)
    work_loop = text.split("FOR StreamIdx")[-1]
    assert "type=Allgather" in work_loop and "matmul(" in work_loop
    check_golden("reshard_before_in_stream_loop", text)


def test_row_parallel_matmul_partial_sums():
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1, -1])
        b = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.matmul(a, b)
        fd.add_output(y)
    _place(DeviceMesh([0, 1]), a, b, y)
    _shard(a, 2)
    _shard(b, 0)
    check_golden("tp_row_matmul", _dump(fd))


def test_column_parallel_matmul_output_takes_the_weights_sharding():
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1])
        b = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.matmul(a, b)
        fd.add_output(y)
    b.set_device_mesh(DeviceMesh([0, 1]))
    _shard(b, 1)
    text = _dump(fd)
    assert _comms(text) == []
    check_golden("tp_column_matmul", text)


def test_sequence_parallel_input_is_gathered_before_column_parallel_linear():
    fd, x, w, b, y = _linear(bias=False)
    _place(DeviceMesh([0, 1]), x, w)
    _shard(x, 0)
    _shard(w, 0)
    text = _dump(fd)
    assert _comms(text) == ["Allgather"]
    check_golden("tp_sequence_parallel_linear", text)


def test_megatron_mlp_block():
    spec = importlib.util.spec_from_file_location("megatron_mlp", REPO / "examples" / "megatron_mlp.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    fd, _ = example.define(2)
    text = _dump(fd)
    assert _comms(text) == ["Allgather", "ReduceScatter"]
    check_golden("tp_megatron_mlp", text)


def test_sharded_k_is_refused_in_strict_mode():
    fd, x, w, b, y = _linear(bias=False)
    _place(DeviceMesh([0, 1]), x, w, y)
    _shard(x, 1)
    _shard(w, 1)
    with pytest.raises(LoweringError, match="both computes and moves data"):
        lower(fd.fusion, resharding="strict")


# ------------------------------------------------------------ resharding sets


def test_replicated_operand_of_binary_op_is_sliced_locally():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.define_tensor(shape=[-1, -1])
        z = fd.ops.add(x, y)
        fd.add_output(z)
    _place(DeviceMesh([0, 1]), x, y)
    _shard(x, 0)
    text = _dump(fd)
    assert _comms(text) == []
    check_golden("reshard_local_slice", text)


def _sharded_sum():
    # x sharded on axis 0, summed over axis 1, output replicated.
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.sum(x, [1])
        fd.add_output(y)
    _place(DeviceMesh([0, 1]), x, y)
    _shard(x, 0)
    return fd


def test_reduction_of_sharded_tensor_reduces_before_gathering():
    # Gathering the sum ([i0]) moves less than gathering x ([i0, i1]).
    text = _dump(_sharded_sum())
    assert _comms(text) == ["Allgather"]
    check_golden("reshard_after_sum", text)
    assert text.index("reduction(") < text.index("type=Allgather")


def test_resharding_side_can_be_forced():
    before = _dump(_sharded_sum(), resharding="before")
    assert before.index("type=Allgather") < before.index("reduction(")
    after = _dump(_sharded_sum(), resharding="after")
    assert after.index("reduction(") < after.index("type=Allgather")


def test_host_ir_shows_the_program_of_a_resharding_mode():
    fd = _sharded_sum()
    before, auto = fd.host_ir(resharding="before"), fd.host_ir()
    assert before.index("type=Allgather") < before.index("reduction(")
    assert auto.index("reduction(") < auto.index("type=Allgather")


def test_strict_mode_refuses_an_op_that_computes_and_reshards():
    with pytest.raises(LoweringError, match="both computes and moves data"):
        lower(_sharded_sum().fusion, resharding="strict")
    with pytest.raises(ValueError, match="resharding must be one of"):
        lower(_sharded_sum().fusion, resharding="sideways")


def test_elementwise_op_with_sharded_input_and_replicated_output_gathers_once():
    # Sizes tie (x and z are both [i0, i1]): the set goes before, once for
    # an operand used twice.
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        z = fd.ops.mul(x, x)
        fd.add_output(z)
    _place(DeviceMesh([0, 1]), x, z)
    _shard(x, 0)
    text = _dump(fd)
    assert _comms(text) == ["Allgather"]
    check_golden("reshard_before_mul", text)


def test_constant_sizes_pick_the_smaller_side():
    # exp(x) with x [4, 6] sharded and a [4, 6] replicated output: a tie, so
    # before; a [4, 6] -> [4] sum instead: after.
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[4, 6])
        y = fd.ops.exp(x)
        z = fd.ops.sum(y, [1])
        fd.add_output(z)
    _place(DeviceMesh([0, 1]), x, z)
    _shard(x, 0)
    text = _dump(fd)
    # y takes x's sharding; the sum then reduces locally and gathers [4].
    assert _comms(text) == ["Allgather"]
    gathered = re.search(r"type=Allgather, team=\(0 1\), input=(T\d+)", text).group(1)
    assert re.search(rf"^\s*{gathered}_g_float\[[^\n]*\n\s*= reduction\(", text, re.MULTILINE), text


# ------------------------------------------------------------ symbolic extents


def test_symbolic_extents_made_equal_by_an_op_are_equal():
    # Both inputs [-1, -1], split the same way: their pieces ( i0 / 2 ) and
    # ( i2 / 2 ) are equal because the add makes i0 and i2 equal.
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.define_tensor(shape=[-1, -1])
        z = fd.ops.add(x, y)
        fd.add_output(z)
    _place(DeviceMesh([0, 1]), x, y, z)
    for tv in (x, y, z):
        _shard(tv, 0)
    text = _dump(fd)
    assert _comms(text) == []


def test_replicated_add_of_two_unsized_inputs_on_a_mesh():
    # i0 and i2 are different symbols; the add makes them equal.
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.define_tensor(shape=[-1, -1])
        z = fd.ops.add(x, y)
        fd.add_output(z)
    _place(DeviceMesh([0, 1]), x, y, z)
    assert _comms(_dump(fd)) == []


def test_row_parallel_matmul_written_with_unsized_inputs_lowers_for_every_rank():
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1])
        b = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.matmul(a, b)
        fd.add_output(y)
    _place(DeviceMesh([0, 1]), a, b, y)
    _shard(a, 1)
    _shard(b, 0)
    _shard(y, 0)
    for rank in (0, 1):
        assert _comms(str(lower(fd.fusion, rank=rank).program)) == ["ReduceScatter"]


def test_no_extent_is_compared_as_text():
    # Equality of extents is structural: no module formats scalars to compare.
    sources = (REPO / "python" / "hostir").rglob("*.py")
    for path in sources:
        text = path.read_text()
        assert not re.search(r"format_scalar\([^)]*\)\s*[!=]=", text), path
        assert not re.search(r"[!=]=\s*(printer\.)?format_scalar\(", text), path


# ------------------------------------------------------------ AllToAll, 2-D meshes


def test_moving_the_sharded_axis_is_an_all_to_all():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    _place(DeviceMesh([0, 1]), x, y)
    _shard(x, 0)
    _shard(y, 1)
    text = _dump(fd)
    assert _comms(text) == ["AllToAll"]
    check_golden("comm_all_to_all", text)


def _mesh_2d():
    return DeviceMesh([[0, 1], [2, 3]])


@pytest.mark.parametrize("parallel_type", [ParallelType.mesh_x, ParallelType.mesh_y], ids=["x", "y"])
def test_2d_mesh_allgather_runs_per_team_of_its_dimension(parallel_type):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    _place(_mesh_2d(), x, y)
    _shard(x, 0, 2, ParallelType.mesh_y)
    _shard(x, 2, 2, ParallelType.mesh_x)
    _shard(y, 0, 2, ParallelType.mesh_y)
    _shard(y, 2, 2, ParallelType.mesh_x)
    gathered = y.axis(0) if parallel_type is ParallelType.mesh_y else y.axis(2)
    gathered.parallelize(ParallelType.serial)
    text = _dump(fd)
    teams = re.findall(r"type=Allgather, team=\(([\d ]+)\)", text)
    if parallel_type is ParallelType.mesh_x:
        assert teams == ["0 1", "2 3"], text
    else:
        assert teams == ["0 2", "1 3"], text
    check_golden(f"comm_2d_allgather_{parallel_type.name}", text)


def test_2d_mesh_sum_over_mesh_y_is_an_allreduce_per_column():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, -1, -1])
        y = fd.ops.sum(x, [0])
        fd.add_output(y)
    _place(_mesh_2d(), x, y)
    x.axis(0).parallelize(ParallelType.mesh_y)
    _shard(x, 1, 2, ParallelType.mesh_x)
    _shard(y, 1, 2, ParallelType.mesh_x)
    text = _dump(fd)
    assert re.findall(r"type=Allreduce, team=\(([\d ]+)\)", text) == ["0 2", "1 3"], text
    check_golden("comm_2d_allreduce_mesh_y", text)


def test_mesh_y_on_a_1d_mesh_is_rejected():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, -1])
        fd.add_output(fd.ops.set(x))
    x.set_device_mesh(DeviceMesh([0, 1]))
    x.axis(0).parallelize(ParallelType.mesh_y)
    with pytest.raises(LoweringError, match="mesh_y needs a mesh of at least 2 dimensions"):
        lower(fd.fusion)


def test_resharding_along_both_mesh_dimensions_at_once_is_rejected():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    _place(_mesh_2d(), x, y)
    _shard(x, 0, 2, ParallelType.mesh_y)
    _shard(x, 2, 2, ParallelType.mesh_x)
    with pytest.raises(LoweringError, match="reshards along mesh_x, mesh_y at once"):
        lower(fd.fusion)
