"""Uses every name `hostir` exports, as a user would: `mypy --strict` on
this file (CI, through pyproject.toml's [tool.mypy]) fails if a public
function or class is untyped or typed wrong. Never run, only checked."""

from __future__ import annotations

import torch

import hostir
from hostir import (
    AliasError,
    DTensorPlacementError,
    CommunicatorTimeout,
    DeviceMesh,
    ExecutorParams,
    FusionDefinition,
    HostIrContainer,
    HostIrEvaluator,
    HostIrRuntimeError,
    IterType,
    LaunchError,
    LoweringError,
    MemoryType,
    OptionError,
    ParallelType,
    PeerLostError,
    RankMismatchError,
)


def build(d: int) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 64], dtype=torch.float32)
        w = fd.define_tensor(shape=[64, 32])
        xg = fd.ops.set(x)
        y = fd.ops.matmul(xg, w)
        z = fd.ops.linear(y, fd.define_tensor(shape=[8, 32]))
        s = fd.ops.sum(fd.ops.add(z, 1.0), [0])
        fd.add_output(fd.ops.div(fd.ops.mul(s, s), fd.ops.sub(s, 2.0)))
        fd.add_output(fd.ops.max(z, [1]))
        fd.add_output(fd.ops.min(z, [1]))
    mesh: DeviceMesh = DeviceMesh(range(d))
    for tv in (x, w, xg, y):
        tv.set_device_mesh(mesh)
    x.outer_split(0, d).axis(0).parallelize(ParallelType.mesh_x)
    y.axis(0).parallelize(ParallelType.stream)
    assert x.axis(1).iter_type is IterType.iteration and x.memory_type in tuple(MemoryType)
    return fd


def run() -> list[torch.Tensor | None]:
    d, rank, local = hostir.world_size(), hostir.rank(), hostir.local_rank()
    fd = build(d)
    x = build(d).fusion.inputs[0]
    piece: torch.Tensor = hostir.shard_tensor(torch.randn(8, 64), x, rank=rank)
    params = ExecutorParams(number_of_streams=2, check_ranks="first")
    outs = fd.execute([piece, torch.randn(64, 32), torch.randn(8, 32)], params=params)
    fd.execute([piece], number_of_streams=local + 1, trace="/tmp/trace", return_dtensors=False)
    text: str = fd.host_ir() + hostir.__version__
    mesh = DeviceMesh.from_torch(DeviceMesh([0]).to_torch("cpu"))
    del text, mesh
    return outs


def errors() -> tuple[type[Exception], ...]:
    return (
        AliasError,
        CommunicatorTimeout,
        DTensorPlacementError,
        HostIrRuntimeError,
        LaunchError,
        LoweringError,
        OptionError,
        PeerLostError,
        RankMismatchError,
    )


def programs(container: HostIrContainer) -> HostIrEvaluator:
    return HostIrEvaluator(container)


def offloaded() -> torch.Tensor:
    stack = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    module: torch.nn.Module = hostir.offload(stack, "cpu", hoist="hoist:chunks=2", cuda_graph=False)
    with FusionDefinition() as fd:
        w = fd.define_tensor([8, 8], torch.float32, memory="host")
        fd.add_output(fd.ops.set(fd.ops.set(w, memory="device"), memory="host"))
    fd.execute([torch.randn(8, 8)], host_inputs="stream", hoist="sequential")
    if isinstance(module, hostir.OffloadedStack):
        module.fusion(2).host_ir()
    out: torch.Tensor = module(torch.randn(2, 8))
    return out
