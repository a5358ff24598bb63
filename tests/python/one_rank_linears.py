"""One-rank sharded linears for the tests: `y = x @ w.T` over the mesh of
rank 0, sharded so that the program's runtime axes differ from the
fusion's logical ones (every sharded tensor has a device piece of size 1)."""

from __future__ import annotations

import torch

import hostir
from hostir import FusionDefinition, ParallelType

MESH = hostir.DeviceMesh([0])


def one_rank_linear(sharded: str) -> FusionDefinition:
    """`sharded="K"` (rowwise): x and w sharded on K, a partial sum
    completed by an Allreduce over the team (0). `sharded="N"` (colwise): w
    and y sharded on N, the activation whole."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], torch.float32)
        w = fd.define_tensor([-1, -1], torch.float32)
        y = fd.ops.linear(x, w)
        fd.add_output(y)
    for tv in (x, w, y):
        tv.set_device_mesh(MESH)
    split = {"K": ((x, 1), (w, 1)), "N": ((w, 0), (y, 1))}[sharded]
    for tv, axis in split:
        tv.outer_split(axis, 1)
        tv.axis(axis).parallelize(ParallelType.mesh_x)
    return fd
