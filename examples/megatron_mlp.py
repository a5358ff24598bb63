"""A Megatron-style tensor-parallel MLP block with sequence parallelism.

Each rank holds a slice of the sequence of the activations, a block of rows
of the first weight (column parallel) and a block of columns of the second
(row parallel). The program is written as plain math; hostir inserts the
communications:

    x (sequence sharded)  --Allgather-->  x whole
    h = gelu(x @ w1.T + b1)               each rank: its columns of h
    y = h @ w2.T + b2                     each rank: partial sums over its columns
                          --ReduceScatter-->  y (sequence sharded)

Run it on every rank, on CPU (gloo) or GPUs (NCCL), unchanged:

    mpirun -np 2 python3 examples/megatron_mlp.py
    torchrun --nproc-per-node 4 examples/megatron_mlp.py

Rank 0 prints the host program; every rank checks its slice of the result
against eager torch on the whole tensors.
"""

import torch

import hostir
from hostir import DeviceMesh, FusionDefinition, ParallelType

SEQUENCE_PER_RANK, HIDDEN = 4, 24  # 4 * HIDDEN splits over 2, 3 or 4 ranks


def define(d: int, dtype=torch.float32):
    """The block on `d` ranks: returns the definition and its four inputs' and
    output's tensors (x, w1, b1, w2, b2, y)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, HIDDEN], dtype=dtype)
        w1 = fd.define_tensor(shape=[4 * HIDDEN, HIDDEN], dtype=dtype)
        b1 = fd.define_tensor(shape=[4 * HIDDEN], dtype=dtype)
        w2 = fd.define_tensor(shape=[HIDDEN, 4 * HIDDEN], dtype=dtype)
        b2 = fd.define_tensor(shape=[HIDDEN], dtype=dtype)
        h = fd.ops.gelu(fd.ops.linear(x, w1, b1))
        y = fd.ops.linear(h, w2, b2)
        fd.add_output(y)
    mesh = DeviceMesh(range(d))
    for tv in (x, w1, b1, w2, b2, y):
        tv.set_device_mesh(mesh)
    # Sequence parallel: x and y sharded on the sequence.
    for tv in (x, y):
        tv.outer_split(0, d)
        tv.axis(0).parallelize(ParallelType.mesh_x)
    # Column parallel: w1 and b1 sharded on the 4*HIDDEN outputs.
    for tv in (w1, b1):
        tv.outer_split(0, d)
        tv.axis(0).parallelize(ParallelType.mesh_x)
    # Row parallel: w2 sharded on its 4*HIDDEN inputs.
    w2.outer_split(1, d)
    w2.axis(1).parallelize(ParallelType.mesh_x)
    return fd, (x, w1, b1, w2, b2, y)


def reference(x, w1, b1, w2, b2):
    h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1))
    return torch.nn.functional.linear(h, w2, b2)


def main() -> None:
    d, rank, local = hostir.world_size(), hostir.rank(), hostir.local_rank()
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    fd, (x, w1, b1, w2, b2, y) = define(d)

    # Every rank draws the same whole tensors, then keeps its own pieces.
    torch.manual_seed(0)
    whole = [
        torch.randn(SEQUENCE_PER_RANK * d, HIDDEN),
        torch.randn(4 * HIDDEN, HIDDEN) / HIDDEN**0.5,
        torch.randn(4 * HIDDEN),
        torch.randn(HIDDEN, 4 * HIDDEN) / (4 * HIDDEN) ** 0.5,
        torch.randn(HIDDEN),
    ]
    mine = [hostir.shard_tensor(t, tv).to(device) for t, tv in zip(whole, (x, w1, b1, w2, b2))]

    (y_mine,) = fd.execute(mine)

    if rank == 0:
        print(fd.host_ir())
    expected = reference(*whole).chunk(d, 0)[rank]
    torch.testing.assert_close(y_mine.cpu(), expected)
    print(f"rank {rank} of {d}: y [{', '.join(map(str, y_mine.shape))}] matches eager torch")


if __name__ == "__main__":
    main()
