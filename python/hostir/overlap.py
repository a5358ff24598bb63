"""The canonical overlapped programs: the device axis as the stream axis.

`allgather_matmul(D)` gathers x (sharded on axis 0 by mesh_x) and multiplies
every gathered shard by a replicated w, with axis 0 of the gathered tensor
and of the product on `ParallelType.stream`: each rank gets `[D, m, N]`.
`matmul_reduce_scatter(D)` multiplies a K-sharded a by a K-sharded b, sums
the partials over ranks and scatters them by rows: each rank gets its
`[1, m, N]`. `lower` decomposes both by the schedule (ring, collective,
sequential; chunks per peer; direction; transport). The `*_inputs` helpers
cut full tensors into one rank's inputs and give that rank's expected
output, for tests and benchmarks.
"""

from __future__ import annotations

import torch

from hostir.frontend import FusionDefinition
from hostir.ir import DeviceMesh, ParallelType


def allgather_matmul(D: int, dtype: torch.dtype = torch.float32, first: int = 0) -> FusionDefinition:
    """y[D, m, N] = gather(x[D, m, K]) @ w[K, N], with x sharded on axis 0."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1, -1], dtype=dtype)
        w = fd.define_tensor(shape=[-1, -1], dtype=dtype)
        xg = fd.ops.set(x)
        y = fd.ops.matmul(xg, w)
        fd.add_output(y)
    mesh = DeviceMesh(range(first, first + D))
    for tv in (x, w, xg, y):
        tv.set_device_mesh(mesh)
    x.axis(0).parallelize(ParallelType.mesh_x)
    xg.axis(0).parallelize(ParallelType.stream)
    y.axis(0).parallelize(ParallelType.stream)
    return fd


def matmul_reduce_scatter(D: int, dtype: torch.dtype = torch.float32, first: int = 0) -> FusionDefinition:
    """y = reduce_scatter(a @ b) by rows: a[D, D, m, Kl] sharded on axis 1
    (K), b[1, D, Kl, N] sharded on axis 1; rank r keeps rows block r."""
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[D, D, -1, -1], dtype=dtype)
        b = fd.define_tensor(shape=[1, D, -1, -1], dtype=dtype)
        c = fd.ops.matmul(a, b)
        y = fd.ops.sum(c, [1])
        fd.add_output(y)
    mesh = DeviceMesh(range(first, first + D))
    for tv in (a, b, y):
        tv.set_device_mesh(mesh)
    a.axis(1).parallelize(ParallelType.mesh_x)
    b.axis(1).parallelize(ParallelType.mesh_x)
    y.axis(0).parallelize(ParallelType.mesh_x)
    c.axis(0).parallelize(ParallelType.stream)
    return fd


def allgather_matmul_inputs(X: torch.Tensor, W: torch.Tensor, position: int):
    """From the full x [D, m, K] and w [K, N]: this rank's inputs and its
    expected output [D, m, N]."""
    return [X[position : position + 1].contiguous(), W], X @ W


def matmul_reduce_scatter_inputs(A: torch.Tensor, B: torch.Tensor, D: int, position: int):
    """From the full a [M, K] and b [K, N] (M and K divisible by D): this
    rank's inputs and expected output [1, M/D, N]."""
    M, K = A.shape
    m, k = M // D, K // D
    a = A.reshape(D, m, D, k).permute(0, 2, 1, 3)[:, position : position + 1].contiguous()
    b = B.reshape(D, k, -1)[position : position + 1].unsqueeze(0).contiguous()
    ref = (A @ B).reshape(D, m, -1)[position : position + 1]
    return [a, b], ref
