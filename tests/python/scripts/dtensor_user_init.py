"""A program that initializes torch.distributed itself (gloo, its own TCP
rendezvous), builds a torch DeviceMesh and DTensors, and runs a hostir
fusion on them with a trace: hostir must reuse the default group.

    mpirun -np 2 python3 dtensor_user_init.py PORT TRACE_DIR
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import hostir
from hostir import FusionDefinition, ParallelType, communicator


def main() -> None:
    port, trace_dir = int(sys.argv[1]), sys.argv[2]
    rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    mesh = init_device_mesh("cpu", (size,))

    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[4, -1, 16])
        w = fd.define_tensor(shape=[16, 8])
        xg = fd.ops.set(x)
        y = fd.ops.matmul(xg, w)
        fd.add_output(y)
    for tv in (xg, y):
        tv.set_device_mesh(mesh)  # a torch DeviceMesh, where hostir takes a mesh
    xg.axis(0).parallelize(ParallelType.stream)
    y.axis(0).parallelize(ParallelType.stream)

    torch.manual_seed(0)
    x_full, w_full = torch.randn(4, 2 * size, 16), torch.randn(16, 8)
    x_dt = distribute_tensor(x_full, mesh, [Shard(1)])
    w_dt = distribute_tensor(w_full, mesh, [Replicate()])
    (out,) = fd.execute([x_dt, w_dt], number_of_streams=2, trace=trace_dir)

    comm = communicator.live()
    assert comm is not None and not comm._owns_default, "hostir must reuse the program's default group"
    assert (hostir.rank(), hostir.world_size()) == (rank, size)
    expected = x_dt.redistribute(mesh, [Replicate()]).to_local() @ w_dt.to_local()
    torch.testing.assert_close(out.to_local(), expected)
    torch.testing.assert_close(out.full_tensor(), x_full @ w_full)
    assert tuple(out.placements) == (Replicate(),)
    print(f"rank {rank}: DTensor result matches", flush=True)
    communicator.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
