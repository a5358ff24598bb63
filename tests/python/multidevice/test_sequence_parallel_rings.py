"""Sequence-parallel linears through the ring decompositions: activations
[b, s, h] sharded on the sequence (axis 1, not outermost), weights sharded
on N (colwise) or K (rowwise), forward and backward against eager torch on
every decomposition."""

from __future__ import annotations

import pytest
import torch

from hostir import DeviceMesh, FusionDefinition, ParallelType

MESH_X, STREAM = ParallelType.mesh_x, ParallelType.stream


def colwise(D: int, out_sharded: bool = True) -> FusionDefinition:
    """y[b, s, N] = linear(gather_s(x[b, s/D, h]), w[N/D, h]): AG+GEMM
    walking the sequence."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        w = fd.define_tensor([-1, -1])
        xg = fd.ops.set(x)
        y = fd.ops.linear(xg, w)
        fd.add_output(y)
    mesh = DeviceMesh(range(D))
    for tv in (x, w, xg, y):
        tv.set_device_mesh(mesh)
    x.outer_split(1, D)
    x.axis(1).parallelize(MESH_X)
    w.outer_split(0, D)
    w.axis(0).parallelize(MESH_X)
    for tv in (xg, y):
        tv.outer_split(1, D)
        tv.axis(1).parallelize(STREAM)
    if out_sharded:
        y.outer_split(3, D)
        y.axis(3).parallelize(MESH_X)
    return fd


@pytest.mark.parametrize("schedule", ["ring", "ring:chunks=2,direction=-1", "collective", "sequential"])
@pytest.mark.parametrize("keep_gathered", [False, True], ids=["regather", "keep_gathered"])
def test_colwise_sequence_parallel_forward_and_backward(world, device, schedule, keep_gathered):
    """Forward and backward against eager torch; the backward's input
    gradient walks the output gradient (GEMM+RS) whether the weight
    gradient gathers the saved shard again or reads the gathered input the
    forward kept."""
    D = world.size
    B, S, H, N = 2, 4 * D, 6, 4 * D
    fd = colwise(D)
    fd.keep_gathered = keep_gathered
    X = torch.randn(B, S, H, device=device)
    W = torch.randn(N, H, device=device)
    x = X.chunk(D, 1)[world.rank].contiguous().requires_grad_()
    w = W.chunk(D, 0)[world.rank].contiguous().requires_grad_()
    (y,) = fd.execute([x, w], schedule=schedule, number_of_streams=2)
    ref_x, ref_w = X.clone().requires_grad_(), W.clone().requires_grad_()
    ref = torch.nn.functional.linear(ref_x, ref_w)
    torch.testing.assert_close(y, ref.chunk(D, 2)[world.rank])
    G = torch.randn_like(ref)
    y.backward(G.chunk(D, 2)[world.rank].contiguous())
    ref.backward(G)
    torch.testing.assert_close(x.grad, ref_x.grad.chunk(D, 1)[world.rank])
    torch.testing.assert_close(w.grad, ref_w.grad.chunk(D, 0)[world.rank])


def _programs(executor) -> str:
    return "\n".join(str(p.container) for p in executor._programs.values())


def _matches_the_unsharded_linear(
    world, lin, ref, X, in_dim: int, out_dim: int, schedule: str, backward_walks: bool = False
) -> None:
    """`lin` (parallelized) on this rank's piece of `X` (cut on `in_dim`)
    gives this rank's piece (cut on `out_dim`) of `ref` on the whole `X`,
    forward and backward (every gradient); its training forward (and, if
    `backward_walks`, its backward) runs in `schedule`'s decomposition,
    with P2P exactly where that is a ring."""
    D, rank = world.size, world.rank
    x = X.chunk(D, in_dim)[rank].contiguous().requires_grad_()
    y = lin(x)
    ref_x = X.clone().requires_grad_()
    expected = ref(ref_x)
    torch.testing.assert_close(y, expected.chunk(D, out_dim)[rank])
    G = torch.randn_like(expected)
    y.backward(G.chunk(D, out_dim)[rank].contiguous())
    expected.backward(G)
    torch.testing.assert_close(x.grad, ref_x.grad.chunk(D, in_dim)[rank])
    torch.testing.assert_close(lin.weight.grad.full_tensor(), ref.weight.grad)
    if ref.bias is not None:
        torch.testing.assert_close(lin.bias.grad.full_tensor(), ref.bias.grad)
    (fd,) = lin._hostir_linear.fusions.values()
    (training,) = fd._trainings.values()
    kind = schedule.split(":")[0]
    for program in [training.forward] + ([training.backward] if backward_walks else []):
        text = _programs(program)
        assert f"({kind}," in text or f"schedule=({kind}" in text
        assert ("P2PCommunication" in text) is (kind == "ring")


@pytest.mark.parametrize("schedule", ["ring", "ring:chunks=2", "collective", "sequential"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("ndim", [2, 3])
def test_hostir_parallel_colwise_under_sequence_parallelism(world, device, monkeypatch, schedule, bias, ndim):
    """`ColwiseParallel(input_layouts=Shard(seq))` through hostir.parallel,
    on a 2-D [s, h] and a 3-D [b, s, h] activation: the forward is the
    AG+GEMM walking the sequence in the forced schedule; in the backward
    the input gradient is the GEMM+RS walking it in the same schedule, and
    the weight gradient re-gathers the saved shard; outputs and gradients
    match the unsharded Linear."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    from hostir.parallel import parallelize_module

    monkeypatch.setenv("HOSTIR_SCHEDULE", schedule)
    D = world.size
    mesh = DeviceMesh(range(D)).to_torch(device.type)
    B, S, H, N = 2, 2 * D, 6, 4 * D
    lin = torch.nn.Linear(H, N, bias=bias).to(device)
    ref = torch.nn.Linear(H, N, bias=bias).to(device)
    ref.load_state_dict(lin.state_dict())
    seq = ndim - 2
    parallelize_module(lin, mesh, ColwiseParallel(input_layouts=Shard(seq)))
    X = torch.randn(*([B] if ndim == 3 else []), S, H, device=device)
    _matches_the_unsharded_linear(world, lin, ref, X, seq, -1, schedule, backward_walks=True)


@pytest.mark.parametrize("schedule", ["ring", "ring:chunks=2", "collective", "sequential"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("ndim", [2, 3])
def test_hostir_parallel_rowwise_under_sequence_parallelism(world, device, monkeypatch, schedule, bias, ndim):
    """`RowwiseParallel(output_layouts=Shard(seq))` through hostir.parallel:
    the forward is the GEMM+RS walking the sequence in the forced schedule
    (each step the partial product of a peer's rows, sent on while the next
    computes), and the backward the AG+GEMM walking it in the same schedule
    (the output gradient gathered as the input gradient's rows are
    computed), on a 2-D [s, h] and a 3-D [b, s, h] activation (the walked
    axis not outermost); outputs and gradients match the unsharded Linear."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    from hostir.parallel import parallelize_module

    monkeypatch.setenv("HOSTIR_SCHEDULE", schedule)
    D = world.size
    mesh = DeviceMesh(range(D)).to_torch(device.type)
    S, H, N = 4 * D, 3 * D, 5
    seq = ndim - 2
    lin = torch.nn.Linear(H, N, bias=bias).to(device)
    ref = torch.nn.Linear(H, N, bias=bias).to(device)
    ref.load_state_dict(lin.state_dict())
    parallelize_module(lin, mesh, RowwiseParallel(output_layouts=Shard(seq)))
    X = torch.randn(*([2] if ndim == 3 else []), S, H, device=device)
    _matches_the_unsharded_linear(world, lin, ref, X, -1, seq, schedule, backward_walks=True)
