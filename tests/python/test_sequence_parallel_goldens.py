"""Golden dumps of sequence-parallel Linears, as hostir.parallel defines
them. Colwise, for `ColwiseParallel(input_layouts=Shard(1))`: the
activation [b, s, h] sharded on the sequence (not its outermost axis), the
weight on N; the forward is the ring AG+GEMM walking the sequence; the
backward's input gradient is the ring GEMM+RS walking it, and the saved
shard is gathered again under that ring for the weight gradient. Rowwise,
for `RowwiseParallel(output_layouts=Shard(1))`: the activation and the
weight sharded on K, the output on the sequence; the forward is the ring
GEMM+RS walking the sequence, and the backward gathers the output gradient
in a ring that computes the input gradient as it goes (AG+GEMM). Each dump
is race-checked, and so is each of its mutants missing a Synchronize or
Wait."""

from __future__ import annotations

import pytest

from hostir import DeviceMesh, FusionDefinition, ParallelType


def colwise_sp(D: int) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        w = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1])
        xg = fd.ops.set(x)
        y = fd.ops.linear(xg, w, b)
        fd.add_output(y)
    mesh = DeviceMesh(range(D))
    for tv in (x, w, b, xg, y):
        tv.set_device_mesh(mesh)
    for tv, axis in ((x, 1), (w, 0), (b, 0), (y, 2)):
        tv.outer_split(axis, D)
        tv.axis(axis).parallelize(ParallelType.mesh_x)
    for tv in (xg, y):
        tv.outer_split(1, D)
        tv.axis(1).parallelize(ParallelType.stream)
    return fd


def rowwise_sp(D: int) -> FusionDefinition:
    """y[b, s, N] (sharded on s) = linear(x[b, s, h/D], w[N, h/D]) + b[N]:
    the K-sharded activation's sequence axis marked as the stream axis,
    as hostir.parallel marks it."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        w = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1])
        y = fd.ops.linear(x, w, b)
        fd.add_output(y)
    mesh = DeviceMesh(range(D))
    for tv in (x, w, b, y):
        tv.set_device_mesh(mesh)
    for tv, axis in ((x, 2), (w, 1), (y, 1)):
        tv.outer_split(axis, D)
        tv.axis(axis).parallelize(ParallelType.mesh_x)
    x.outer_split(1, D)
    x.axis(1).parallelize(ParallelType.stream)
    return fd


def _lowered(fusion, schedule: str):
    from hostir.lower import lower
    from hostir.lower.schedule import parse

    return lower(fusion, rank=0, backend="NCCL", schedule=parse(schedule))


@pytest.mark.parametrize("schedule", ["ring", "ring:chunks=2", "ring:transport=cuda"])
def test_golden_forward_of_a_sequence_parallel_colwise_linear(schedule):
    """Slots with the walked axis first receive each peer's rows (a slice
    of [b, s, h] along s is not contiguous); each shard is copied into the
    gathered tensor and multiplied while the next one moves."""
    from conftest import check_golden

    program = _lowered(colwise_sp(2).fusion, schedule)
    text = str(program.program)
    ring = text.split("(ring,")[1]
    assert "P2PCommunication" in ring and "linear(" in ring and "Set(" in ring
    name = "sp_colwise_forward" + ("_chunks2" if "chunks" in schedule else "") + ("_cuda" if "cuda" in schedule else "")
    check_golden(name, program)


def test_golden_backward_of_a_sequence_parallel_colwise_linear():
    """The input gradient is dy @ w summed over the ranks' N and scattered
    on the sequence: a GEMM+RS ring walking the sequence, each step the
    partial sums of one peer's rows, read from the output gradient split
    as the forward walked it. The weight gradient gathers the saved shard
    again (whole: its product sums over the sequence), posted before the
    ring and waited for by its product after it."""
    from conftest import check_golden
    from hostir import autodiff

    fd = colwise_sp(2)
    d = autodiff.derive(fd.fusion, [0, 1, 2])
    program = _lowered(d.backward, "ring")
    text = str(program.program)
    assert "type=ReduceScatter" not in text
    before, ring = text.split("(ring,")
    # The ring ends at the loop joining its workers (the local partial runs before it).
    ring, after = ring.split("\n  FOR StreamIdx", 1)
    assert "type=Allgather" in before and "Wait Communication" not in before
    assert "P2PCommunication" in ring and "partial = " in ring
    assert "Wait Communication" in after and "matmul(" in after.split("Wait Communication")[1]
    check_golden("sp_colwise_backward", program)


def test_the_forward_saves_the_shard_not_the_gathered_activation():
    """Nothing of the forward's is saved but its inputs (the activation's
    shard, the weight); the output gradient is read a second time, split
    as the forward walked its sequence."""
    from hostir import autodiff

    d = autodiff.derive(colwise_sp(2).fusion, [0, 1, 2])
    assert ("input", 0) in d.saved and ("cotangent", 0) in d.saved
    assert all(kind in ("input", "cotangent") for kind, _ in d.saved), d.saved
    walked = d.backward.inputs[len(d.cotangent_layouts) + d.saved.index(("cotangent", 0))]
    assert [a.parallel_type for a in walked.domain].count(ParallelType.stream) == 1


def test_the_machine_model_sizes_the_gemm_of_the_walked_activation():
    """The model's GEMM per step is the activation's rows times the
    weight's N, even where the weight has more elements than the
    activation (a Llama MLP's up projection)."""
    import torch

    from hostir import planner

    B, s, H, n = 2, 8, 16, 64  # per rank: x [B, s, H], w [n, H], bias [n]
    fd = colwise_sp(2)
    inputs = [torch.empty(B, s, H), torch.empty(n, H), torch.empty(n)]
    assert planner.shape_hint(fd.fusion, inputs, 2) == (B * s, H, n, 4)


def test_the_machine_model_sizes_the_gemm_rs_of_the_colwise_backward():
    """The backward's input gradient walks the output gradient's rows: per
    step a D-th of them times its N piece (the contraction) times H, and
    what moves is those rows' partial sums, H wide."""
    import torch

    from hostir import autodiff, planner

    B, S, H, n = 2, 8, 16, 64  # per rank: dy [B, S, n], w [n, H], x [B, S/2, H]
    d = autodiff.derive(colwise_sp(2).fusion, [0, 1, 2])
    assert d.saved == [("input", 1), ("cotangent", 0), ("input", 0)]
    dy = torch.empty(B, S, n)
    inputs = [dy, torch.empty(n, H), dy, torch.empty(B, S // 2, H)]
    assert planner.decomposable(d.backward)
    assert planner.shape_hint(d.backward, inputs, 2) == (B * S // 2, H, n, 4)


@pytest.mark.parametrize("schedule", ["ring", "ring:chunks=2"])
def test_golden_forward_of_a_sequence_parallel_rowwise_linear(schedule):
    """Each step computes the partial sums of a peer's rows and sends them
    while the next step computes; slots with the walked axis first receive
    them (a slice of [b, s, N] along s is not contiguous), the local partial
    lands in its own slot, and one sum over a view of the slots (the walked
    axis back in its place) writes this rank's rows; then the bias."""
    from conftest import check_golden

    program = _lowered(rowwise_sp(2).fusion, schedule)
    text = str(program.program)
    ring = text.split("(ring,")[1]
    assert "P2PCommunication" in ring and "linear(" in ring and "partial = " in ring
    assert "permute(" in text and "type=ReduceScatter" not in text
    name = "sp_rowwise_forward" + ("_chunks2" if "chunks" in schedule else "")
    check_golden(name, program)


def test_golden_backward_of_a_sequence_parallel_rowwise_linear():
    """One AG+GEMM (torchtitan's backward of a GEMM+RS layer): the output
    gradient, sharded on the sequence, is gathered in a ring walking the
    sequence as the forward walked it, and each peer's rows of the input
    gradient are computed as they arrive; the weight and bias gradients
    read the whole gathered gradient after the ring. The input gradient
    is whole on the sequence, as the input is."""
    from conftest import check_golden
    from hostir import autodiff

    d = autodiff.derive(rowwise_sp(2).fusion, [0, 1, 2])
    program = _lowered(d.backward, "ring")
    text = str(program.program)
    assert "type=Allgather" not in text
    before, ring = text.split("(ring,")
    ring, after = ring.split("Synchronize Stream ( StreamIdx % numberOfStreams )\n", 1)
    assert "P2PCommunication" in ring and "matmul(" in ring
    assert "permute(" in after and "matmul(" in after and "reduction(" in after
    check_golden("sp_rowwise_backward", program)


def test_the_machine_model_sizes_the_steps_of_a_gemm_rs():
    """Per step, the model's GEMM is a D-th of the activation's rows times
    its K piece times N, and what moves is those rows' partial sums (N
    wide); the model chooses a schedule for the rowwise linear."""
    import torch

    from hostir import planner

    B, S, h, N = 2, 8, 16, 64  # per rank: x [B, S, h] (K piece), w [N, h], bias [N]
    fd = rowwise_sp(2)
    inputs = [torch.empty(B, S, h), torch.empty(N, h), torch.empty(N)]
    assert planner.decomposable(fd.fusion)
    assert planner.shape_hint(fd.fusion, inputs, 2) == (B * S // 2, N, h, 4)


def test_the_machine_model_sizes_the_ag_gemm_of_the_rowwise_backward():
    """The backward gathers the output gradient walking the sequence: per
    step a peer's rows of it (N wide) times the weight's K piece."""
    import torch

    from hostir import autodiff, planner

    B, S, h, N = 2, 8, 16, 64  # per rank: dy [B, S/2, N], w [N, h], x [B, S, h]
    d = autodiff.derive(rowwise_sp(2).fusion, [0, 1, 2])
    assert d.saved == [("input", 1), ("input", 0)]
    inputs = [torch.empty(B, S // 2, N), torch.empty(N, h), torch.empty(B, S, h)]
    assert planner.decomposable(d.backward)
    assert planner.shape_hint(d.backward, inputs, 2) == (B * S // 2, N, h, 4)
