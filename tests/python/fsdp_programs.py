"""The FSDP-style program the hoisting tests share: a stack of linear
layers whose weights are sharded on `mesh_x` (rows) and all-gathered
before use, each followed by a GELU."""

from __future__ import annotations

import torch

from hostir import DeviceMesh, FusionDefinition, ParallelType

H = 24  # divisible by 2, 3 and 4 ranks


def fsdp_mlp(world_size: int, layers: int = 3, dtype=torch.float32) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, H], dtype)
        ws = [fd.define_tensor([H, H], dtype) for _ in range(layers)]
        tvs, y = [x], x
        for w in ws:
            gathered = fd.ops.set(w)
            z = fd.ops.linear(y, gathered)
            y = fd.ops.gelu(z)
            tvs += [w, gathered, z, y]
        fd.add_output(y)
    mesh = DeviceMesh(range(world_size))
    for tv in tvs:
        tv.set_device_mesh(mesh)
    for w in ws:
        w.outer_split(0, world_size)
        w.axis(0).parallelize(ParallelType.mesh_x)
    return fd


def reference(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    for w in ws:
        x = torch.nn.functional.gelu(x @ w.T)
    return x


BATCH = 12  # rows of the input: divisible by 2, 3 and 4 ranks


def fsdp_training_mlp(world_size: int, layers: int = 3, dtype=torch.float32) -> FusionDefinition:
    """The FSDP stack trained data-parallel: as `fsdp_mlp`, and the input
    and every activation sharded on `mesh_x` by rows (each rank its batch
    rows). Its backward re-gathers each layer's weight for the input
    gradient and reduce-scatters each weight gradient (partial sums over
    the ranks' rows) back into the weight's shards."""
    mesh = DeviceMesh(range(world_size))
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, H], dtype)
        ws = [fd.define_tensor([H, H], dtype) for _ in range(layers)]
        acts, y = [x], x
        for w in ws:
            gathered = fd.ops.set(w)
            gathered.set_device_mesh(mesh)
            z = fd.ops.linear(y, gathered)
            y = fd.ops.gelu(z)
            acts += [z, y]
        fd.add_output(y)
    for tv in acts + ws:
        tv.set_device_mesh(mesh)
        tv.outer_split(0, world_size)
        tv.axis(0).parallelize(ParallelType.mesh_x)
    return fd


def fsdp_backward(world_size: int, layers: int = 3):
    """The backward fusion of `fsdp_training_mlp` for every weight's
    gradient (and the input's)."""
    from hostir.autodiff import derive

    fd = fsdp_training_mlp(world_size, layers)
    return derive(fd.fusion, list(range(layers + 1))).backward
