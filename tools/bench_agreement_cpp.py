"""Host cost of the multi-device steps before a run: agreement and checks.

Launch with mpirun (or torchrun) on the CPU (gloo) or GPUs (NCCL). Each rank
runs a small sequence-parallel program (an Allgather of its [1, rows, 64]
piece then a matmul) with `check_ranks="every"` (the ranks agree on the
call, the program and the inputs with the full record before every run),
`"always"` (the full record once per signature, then a six-word step per
call) and `"first"` (they agree only when a program is lowered), on each
evaluator, and rank 0 prints the median host time of one `execute` per
variant: the differences are what the agreement costs per call.

    mpirun -np 2 --oversubscribe python3 tools/bench_agreement_cpp.py
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import hostir
import hostir.cpp
from hostir import DeviceMesh, FusionDefinition, ParallelType, shard_tensor


def build(world: int) -> tuple[FusionDefinition, object]:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[world, -1, 64])
        w = fd.define_tensor(shape=[64, 32])
        xg = fd.ops.set(x)
        y = fd.ops.matmul(xg, w)
        fd.add_output(y)
    mesh = DeviceMesh(range(world))
    for tv in (x, w, xg, y):
        tv.set_device_mesh(mesh)
    x.axis(0).parallelize(ParallelType.mesh_x)
    return fd, x


def main(iters: int = 200) -> int:
    world, rank = hostir.world_size(), hostir.rank()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    full = torch.randn(world, 16, 64)
    w = torch.randn(64, 32)
    rows = []
    evaluators = ["python"] + (["cpp"] if hostir.cpp.available() else [])
    for evaluator in evaluators:
        for check in ("every", "always", "first"):
            fd, x = build(world)
            piece = shard_tensor(full, x).to(device)
            ww = w.to(device)
            run = lambda: fd.execute([piece, ww], evaluator=evaluator, check_ranks=check)  # noqa: E731
            for _ in range(20):
                run()
            samples = []
            for _ in range(iters):
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                run()
                samples.append(time.perf_counter() - start)
            rows.append((evaluator, check, statistics.median(samples) * 1e6))
    if rank == 0:
        print(f"world {world}, device {device}, torch {torch.__version__}, median of {iters} calls")
        print("| evaluator | check_ranks | µs per execute |")
        print("|---|---|---:|")
        for evaluator, check, us in rows:
            print(f"| {evaluator} | {check} | {us:.0f} |")
    hostir.communicator.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
