"""Tensor-parallel linear and matmul with sharded weights, against eager torch.

Column parallel: the weight (and bias) sharded on N, each rank computes its
columns, no communication. Row parallel: input and weight sharded on K, each
rank computes partial sums that an Allreduce (replicated output) or a
ReduceScatter (output sharded on M: sequence parallel) completes. Sequence
parallel input: the input sharded on M is gathered before a column-parallel
linear. Every rank builds the same whole tensors from the per-test seed,
passes its pieces, and compares its piece of the result. The data are small
integers, so every dtype computes them exactly, whatever the order of the
partial sums; the MLP block (with gelu) compares with tolerances.
"""

from __future__ import annotations

import re

import pytest
import torch

from hostir import DeviceMesh, FusionDefinition, ParallelType, shard_tensor

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rand_int(shape, dtype, device) -> torch.Tensor:
    return torch.randint(-3, 4, tuple(shape)).to(dtype).to(device)


def exact(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def chunk(t: torch.Tensor, dim: int, world) -> torch.Tensor:
    """This rank's piece of `t`: the rank-th of world.size equal chunks."""
    return t.chunk(world.size, dim)[world.rank]


def shard(tv, axis: int, d: int) -> None:
    tv.outer_split(axis, d)
    tv.axis(axis).parallelize(ParallelType.mesh_x)


def place(mesh, *tvs):
    for tv in tvs:
        if tv is not None:
            tv.set_device_mesh(mesh)


def reference_linear(x, w, b):
    # Integer data: float64 computes them exactly, then the dtype holds them.
    out = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("batch", [False, True], ids=["2d", "batched"])
def test_column_parallel_linear(world, device, dtype, bias, batch):
    D = world.size
    lead = [3, 5] if batch else [5]
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1] * len(lead) + [-1], dtype=dtype)
        w = fd.define_tensor(shape=[-1, -1], dtype=dtype)
        b = fd.define_tensor(shape=[-1], dtype=dtype) if bias else None
        y = fd.ops.linear(x, w, b)
        fd.add_output(y)
    place(DeviceMesh(range(D)), x, w, b)
    shard(w, 0, D)
    if bias:
        shard(b, 0, D)

    x_full = rand_int(lead + [8], dtype, device)
    w_full = rand_int([4 * D, 8], dtype, device)
    b_full = rand_int([4 * D], dtype, device) if bias else None
    inputs = [x_full, shard_tensor(w_full, w)] + ([shard_tensor(b_full, b)] if bias else [])
    (out,) = fd.execute(inputs)
    exact(out, chunk(reference_linear(x_full, w_full, b_full), -1, world))
    assert "Communication" not in fd.host_ir()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("output", ["allreduce", "reduce_scatter"])
def test_row_parallel_linear(world, device, dtype, bias, output):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1, -1], dtype=dtype)
        w = fd.define_tensor(shape=[-1, -1], dtype=dtype)
        b = fd.define_tensor(shape=[-1], dtype=dtype) if bias else None
        y = fd.ops.linear(x, w, b)
        fd.add_output(y)
    place(DeviceMesh(range(D)), x, w, b, y)
    shard(x, 2, D)
    shard(w, 1, D)
    if output == "reduce_scatter":
        shard(y, 1, D)

    x_full = rand_int([2, 2 * D, 4 * D], dtype, device)
    w_full = rand_int([6, 4 * D], dtype, device)
    b_full = rand_int([6], dtype, device) if bias else None
    inputs = [shard_tensor(x_full, x), shard_tensor(w_full, w)] + ([b_full] if bias else [])
    (out,) = fd.execute(inputs)
    expected = reference_linear(x_full, w_full, b_full)
    if output == "reduce_scatter":
        expected = chunk(expected, 1, world)
    exact(out, expected)
    kind = "Allreduce" if output == "allreduce" else "ReduceScatter"
    assert f"type={kind}" in fd.host_ir()


@pytest.mark.parametrize("dtype", DTYPES)
def test_column_parallel_matmul(world, device, dtype):
    D = world.size
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1, -1], dtype=dtype)
        b = fd.define_tensor(shape=[-1, -1], dtype=dtype)
        y = fd.ops.matmul(a, b)
        fd.add_output(y)
    place(DeviceMesh(range(D)), a, b)
    shard(b, 1, D)

    a_full = rand_int([2, 3, 8], dtype, device)
    b_full = rand_int([8, 2 * D], dtype, device)
    (out,) = fd.execute([a_full, shard_tensor(b_full, b)])
    exact(out, chunk((a_full.double() @ b_full.double()).to(dtype), -1, world))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("output", ["allreduce", "reduce_scatter"])
def test_row_parallel_matmul(world, device, dtype, output):
    D = world.size
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1], dtype=dtype)
        b = fd.define_tensor(shape=[-1, -1], dtype=dtype)
        y = fd.ops.matmul(a, b)
        fd.add_output(y)
    place(DeviceMesh(range(D)), a, b, y)
    shard(a, 1, D)
    shard(b, 0, D)
    if output == "reduce_scatter":
        shard(y, 0, D)

    a_full = rand_int([2 * D, 3 * D], dtype, device)
    b_full = rand_int([3 * D, 5], dtype, device)
    (out,) = fd.execute([shard_tensor(a_full, a), shard_tensor(b_full, b)])
    expected = (a_full.double() @ b_full.double()).to(dtype)
    exact(out, chunk(expected, 0, world) if output == "reduce_scatter" else expected)


def test_row_parallel_matmul_with_only_the_input_sharded(world, device):
    # b is replicated: each rank multiplies its rows of b (its slice of K).
    D = world.size
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1])
        b = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.matmul(a, b)
        fd.add_output(y)
    place(DeviceMesh(range(D)), a, b, y)
    shard(a, 1, D)

    a_full = rand_int([4, 2 * D], torch.float32, device)
    b_full = rand_int([2 * D, 3], torch.float32, device)
    (out,) = fd.execute([shard_tensor(a_full, a), b_full])
    exact(out, a_full @ b_full)


def test_matmul_with_only_the_weight_annotated(world, device):
    # The input and the output take the weight's mesh; the output its sharding.
    D = world.size
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1])
        b = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.matmul(a, b)
        fd.add_output(y)
    b.set_device_mesh(DeviceMesh(range(D)))
    shard(b, 1, D)

    a_full = rand_int([4, 6], torch.float32, device)
    b_full = rand_int([6, 2 * D], torch.float32, device)
    (out,) = fd.execute([a_full, shard_tensor(b_full, b)])
    exact(out, chunk(a_full @ b_full, 1, world))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sequence_parallel_column_linear_gathers_the_sequence(world, device, dtype):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=dtype)
        w = fd.define_tensor(shape=[-1, -1], dtype=dtype)
        y = fd.ops.linear(x, w)
        fd.add_output(y)
    place(DeviceMesh(range(D)), x, w)
    shard(x, 0, D)
    shard(w, 0, D)

    x_full = rand_int([2 * D, 8], dtype, device)
    w_full = rand_int([3 * D, 8], dtype, device)
    (out,) = fd.execute([shard_tensor(x_full, x), shard_tensor(w_full, w)])
    exact(out, chunk(reference_linear(x_full, w_full, None), -1, world))
    assert "type=Allgather" in fd.host_ir()


def test_column_parallel_linear_with_symbolic_sizes_checks_them(world, device):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        w = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.linear(x, w)
        fd.add_output(y)
    place(DeviceMesh(range(D)), x, w)
    shard(w, 0, D)
    w_full = rand_int([2 * D, 8], torch.float32, device)
    with pytest.raises(ValueError, match="an op of the fusion needs them equal"):
        fd.execute([rand_int([3, 7], torch.float32, device), shard_tensor(w_full, w)])


@pytest.mark.parametrize("output", ["allreduce", "reduce_scatter"])
def test_row_parallel_linear_pipelined_over_streams(world, device, output):
    """A stream axis on the output of a row-parallel linear: each chunk's
    partial sums are computed and reduced in the same loop iteration, so
    chunk i+1's GEMM can overlap chunk i's collective (nvFuser's
    collective-based row-parallel pipeline)."""
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[4, -1, -1])
        w = fd.define_tensor(shape=[-1, -1])
        y = fd.ops.linear(x, w)
        fd.add_output(y)
    place(DeviceMesh(range(D)), x, w, y)
    shard(x, 2, D)
    shard(w, 1, D)
    if output == "reduce_scatter":
        shard(y, 1, D)
    y.axis(0).parallelize(ParallelType.stream)

    x_full = rand_int([4, 2 * D, 4 * D], torch.float32, device)
    w_full = rand_int([5, 4 * D], torch.float32, device)
    (out,) = fd.execute([shard_tensor(x_full, x), shard_tensor(w_full, w)], number_of_streams=2)
    expected = reference_linear(x_full, w_full, None)
    exact(out, chunk(expected, 1, world) if output == "reduce_scatter" else expected)
    loop = fd.host_ir().split("FOR StreamIdx")[-1]
    assert "linear(" in loop and ("type=Allreduce" if output == "allreduce" else "type=ReduceScatter") in loop


def test_inserted_allgather_pipelined_with_matmul(world, device):
    """x holds this rank's rows of every chunk; nothing asks for an
    Allgather, yet the matmul needs whole chunks: the inserted set takes the
    output's stream axis and gathers chunk by chunk."""
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[4, D, -1, 8])
        w = fd.define_tensor(shape=[8, -1])
        y = fd.ops.matmul(x, w)
        fd.add_output(y)
    place(DeviceMesh(range(D)), x, w, y)
    x.axis(1).parallelize(ParallelType.mesh_x)
    y.axis(0).parallelize(ParallelType.stream)
    x_full = rand_int([4, D, 3, 8], torch.float32, device)
    w_full = rand_int([8, 5], torch.float32, device)
    (out,) = fd.execute([shard_tensor(x_full, x), w_full], number_of_streams=2)
    exact(out, x_full @ w_full)
    assert "type=Allgather" in fd.host_ir().split("FOR StreamIdx")[-1]


def _megatron_example():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[3] / "examples" / "megatron_mlp.py"
    spec = importlib.util.spec_from_file_location("megatron_mlp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", DTYPES)
def test_megatron_mlp_block(world, device, dtype):
    """Sequence-parallel input -> Allgather -> column-parallel linear -> gelu
    -> row-parallel linear -> ReduceScatter, as examples/megatron_mlp.py."""
    example = _megatron_example()
    D, H = world.size, example.HIDDEN
    fd, tvs = example.define(D, dtype)
    whole = [
        torch.randn(3 * D, H),
        torch.randn(4 * H, H) / H**0.5,
        torch.randn(4 * H),
        torch.randn(H, 4 * H) / (4 * H) ** 0.5,
        torch.randn(H),
    ]
    mine = [shard_tensor(t.to(dtype), tv).to(device) for t, tv in zip(whole, tvs)]
    (out,) = fd.execute(mine)
    # The reference computes in float32 from the same dtype-rounded data.
    expected = example.reference(*[t.to(dtype).float().to(device) for t in whole])
    torch.testing.assert_close(out.float(), chunk(expected, 0, world), **_tolerance(dtype))
    dump = fd.host_ir()
    comms = re.findall(r"^\s*Communication \d+ \(type=(\w+),", dump, re.MULTILINE)
    assert comms == ["Allgather", "ReduceScatter"], dump


def _tolerance(dtype) -> dict:
    # Half types round every intermediate (h, the partial sums) to 8 or 11
    # bits of mantissa; float32 rounds the same sums in another order.
    return {
        torch.float32: {},
        torch.bfloat16: {"rtol": 2e-2, "atol": 5e-2},
        torch.float16: {"rtol": 5e-3, "atol": 1e-2},
    }[dtype]
