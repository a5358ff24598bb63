"""A sequence-parallel layer, stream-parallel: all-gather the activations
that each rank holds a slice of the sequence of, and multiply them with
this rank's local weight, chunk by chunk, so that chunk i+1 is gathered
while chunk i is multiplied.

Run it on every rank, on CPU (gloo) or GPUs (NCCL), unchanged:

    mpirun -np 2 python3 examples/sequence_parallel_matmul.py
    torchrun --nproc-per-node 2 examples/sequence_parallel_matmul.py

Rank 0 prints the host program; every rank checks its result against eager
torch on the whole tensors.
"""

import torch

import hostir
from hostir import DeviceMesh, FusionDefinition, ParallelType

CHUNKS, ROWS_PER_CHUNK, HIDDEN, COLUMNS = 4, 8, 64, 32


def main() -> None:
    d, rank, local = hostir.world_size(), hostir.rank(), hostir.local_rank()
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")

    # Activations [chunks, ranks, rows, hidden]: rank r holds rows r of every
    # chunk (its slice of the sequence). The weight is this rank's own
    # column block [hidden, columns] (tensor parallel): every rank computes
    # the whole sequence times its columns.
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[CHUNKS, d, -1, HIDDEN])
        w = fd.define_tensor(shape=[HIDDEN, -1])
        x_gathered = fd.ops.set(x)
        y = fd.ops.matmul(x_gathered, w)
        fd.add_output(y)
    mesh = DeviceMesh(range(d))
    for tv in (x, w, x_gathered, y):
        tv.set_device_mesh(mesh)
    x.axis(1).parallelize(ParallelType.mesh_x)
    x_gathered.axis(0).parallelize(ParallelType.stream)
    y.axis(0).parallelize(ParallelType.stream)

    # Every rank draws the same whole tensors, then keeps its own pieces.
    torch.manual_seed(0)
    x_full = torch.randint(-3, 4, (CHUNKS, d, ROWS_PER_CHUNK, HIDDEN)).float()
    w_full = torch.randint(-3, 4, (HIDDEN, COLUMNS * d)).float()
    x_mine = hostir.shard_tensor(x_full, x).to(device)
    w_mine = w_full[:, rank * COLUMNS : (rank + 1) * COLUMNS].to(device)

    (y_mine,) = fd.execute([x_mine, w_mine], number_of_streams=2)

    if rank == 0:
        print(fd.host_ir())
    expected = x_full @ w_full[:, rank * COLUMNS : (rank + 1) * COLUMNS]
    torch.testing.assert_close(y_mine.cpu(), expected, rtol=0, atol=0)
    print(f"rank {rank} of {d}: result [{', '.join(map(str, y_mine.shape))}] matches eager torch")


if __name__ == "__main__":
    main()
