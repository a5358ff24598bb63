"""How long the dry run of the 8-rank AG+matmul program takes, against one
real run of it on CPU (gloo, 8 processes under mpirun).

    python tools/bench_dry_run.py [--world-size 8] [--repeat 5]

The dry run is timed in this process, lowering included (a fresh fusion
each time, as `python -m hostir.plan` does). Then the script launches itself
under `mpirun -np D` and times, on rank 0, the first `fd.execute` (lowering,
process groups, agreement) and the median of later ones, each after a
barrier. The sizes are those of examples/sequence_parallel_matmul.py.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

import torch  # noqa: E402

import hostir  # noqa: E402
from hostir import DeviceMesh, FusionDefinition, ParallelType  # noqa: E402

CHUNKS, ROWS, HIDDEN, COLUMNS = 4, 8, 64, 32


def build(d: int):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[CHUNKS, d, -1, HIDDEN])
        w = fd.define_tensor(shape=[HIDDEN, -1])
        xg = fd.ops.set(x)
        y = fd.ops.matmul(xg, w)
        fd.add_output(y)
    for tv in (x, w, xg, y):
        tv.set_device_mesh(DeviceMesh(range(d)))
    x.axis(1).parallelize(ParallelType.mesh_x)
    xg.axis(0).parallelize(ParallelType.stream)
    y.axis(0).parallelize(ParallelType.stream)
    return fd


def time_dry_run(d: int, repeat: int) -> list[float]:
    inputs = [(CHUNKS, 1, ROWS, HIDDEN), (HIDDEN, COLUMNS)]
    hostir.dry_run(build(d), inputs, world_size=d, number_of_streams=2)  # imports, first-use costs
    times = []
    for _ in range(repeat):
        fd = build(d)
        start = time.perf_counter()
        hostir.dry_run(fd, inputs, world_size=d, number_of_streams=2)
        times.append(time.perf_counter() - start)
    return times


def time_real_run(repeat: int) -> None:
    d, rank = hostir.world_size(), hostir.rank()
    fd = build(d)
    x = torch.randn(CHUNKS, 1, ROWS, HIDDEN)
    w = torch.randn(HIDDEN, COLUMNS)
    comm = hostir.communicator.get()
    comm.barrier()
    start = time.perf_counter()
    fd.execute([x, w], number_of_streams=2)
    first = time.perf_counter() - start
    later = []
    for _ in range(repeat):
        comm.barrier()
        start = time.perf_counter()
        fd.execute([x, w], number_of_streams=2)
        later.append(time.perf_counter() - start)
    if rank == 0:
        print(f"real run, {d} ranks (gloo, CPU): first execute {first * 1e3:.1f} ms "
              f"(lowering, dry run, groups, agreement); later executes median "
              f"{statistics.median(later) * 1e3:.1f} ms (min {min(later) * 1e3:.1f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--real", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.real:
        time_real_run(ns.repeat)
        return
    times = time_dry_run(ns.world_size, ns.repeat)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"dry run, {ns.world_size} ranks: median {statistics.median(times) * 1e3:.1f} ms "
          f"(min {min(times) * 1e3:.1f} ms) over {ns.repeat} runs, lowering included")
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        print("mpirun is not on PATH: no real run")
        return
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), CUDA_VISIBLE_DEVICES="",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = [mpirun, "-np", str(ns.world_size), "--oversubscribe", "-x", "HOSTIR_MASTER_PORT=29731",
               sys.executable, __file__, "--real", "--repeat", str(ns.repeat)]
    subprocess.run(command, env=env, check=True, timeout=600)


if __name__ == "__main__":
    main()
