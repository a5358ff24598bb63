"""One rank of a multi-node job, for tests/python/test_multinode.py.

`python3 multinode_worker.py suite [pytest arguments]`: report where this rank
is, then run the multi-device suite (tests/python/multidevice) in this process.
`python3 multinode_worker.py loop SECONDS`: report, then run all-gathers until
the time is up, printing `ready <rank>` after the third; a node that dies
meanwhile must end the loop in an error, printed as `failed <rank> <json>`
with the error's class and message (and, where MULTINODE_FAILURES names a
directory, in the file failed-rank<rank>.json there).

The report is one all-gather through `fd.execute`, so it also proves that the
rendezvous and gloo's connections reach every node: each rank contributes
`[rank, world size, local rank, local size, a, b, c, d]`, where a.b.c.d is the
IPv4 address its gloo groups bind to, and prints the gathered table as a line
`table <rank> <json>` besides a line `where <rank> <json>` with its launcher,
its interface and why that interface was chosen.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import torch

import hostir
from hostir import DeviceMesh, FusionDefinition, ParallelType, shard_tensor
from hostir import communicator

MULTIDEVICE = pathlib.Path(__file__).resolve().parent / "multidevice"
_COLUMNS = 8


def say(line: str) -> None:
    """Print one line in one write: the ranks of a node share one output
    file, and print's separate write of the newline lets lines interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def gather_fusion(world: int) -> tuple[FusionDefinition, object]:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[world, _COLUMNS], dtype=torch.float64)
        y = fd.ops.set(x)  # sharded -> replicated: an Allgather
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(world)))
    x.axis(0).parallelize(ParallelType.mesh_x)
    return fd, x


def report() -> tuple[FusionDefinition, object, torch.Tensor]:
    world, rank = hostir.world_size(), hostir.rank()
    fd, x = gather_fusion(world)
    launch = communicator.discover()
    # The first execute makes the communicator; its interface is then known,
    # so the row carries a placeholder address in a first all-gather.
    row = torch.zeros(world, _COLUMNS, dtype=torch.float64)
    fd.execute([shard_tensor(row, x)])
    comm = communicator.live()
    address = comm.interface.address if comm.interface is not None else None
    octets = [float(part) for part in address.split(".")] if address else [-1.0] * 4
    local_size = -1 if launch.local_size is None else launch.local_size
    row[rank] = torch.tensor([rank, world, launch.local_rank, local_size, *octets], dtype=torch.float64)
    table, = fd.execute([shard_tensor(row, x)])
    where = {
        "source": launch.source,
        "interface": None if comm.interface is None else comm.interface.name,
        "address": address,
        "reason": None if comm.interface is None else comm.interface.reason,
        "master": f"{comm.master_addr}:{comm.master_port}",
    }
    say(f"where {rank} {json.dumps(where)}")
    say(f"table {rank} {json.dumps(table.to(torch.int64).tolist())}")
    return fd, x, table


def loop(seconds: float) -> None:
    fd, x, table = report()
    rank = hostir.rank()
    deadline = time.monotonic() + seconds
    calls = 0
    while time.monotonic() < deadline:
        out, = fd.execute([shard_tensor(table, x)])
        torch.testing.assert_close(out, table)
        calls += 1
        if calls == 3:
            say(f"ready {rank}")
        time.sleep(0.05)
    say(f"loop {rank} ended after {calls} calls")


def main(argv: list[str]) -> int:
    mode = argv[0] if argv else ""
    if mode == "suite":
        import pytest

        report()
        return int(pytest.main(["-q", "-p", "no:cacheprovider", "--color=no", str(MULTIDEVICE), *argv[1:]]))
    if mode == "loop":
        try:
            loop(float(argv[1]))
        except Exception as exc:
            failure = json.dumps({"error": type(exc).__name__, "message": str(exc)})
            # To a file first: a launcher that has already ended has closed
            # the output of the ranks it left behind.
            if os.environ.get("MULTINODE_FAILURES"):
                record = pathlib.Path(os.environ["MULTINODE_FAILURES"]) / f"failed-rank{hostir.rank()}.json"
                record.write_text(failure)
            say(f"failed {hostir.rank()} {failure}")
            return 1
        return 0
    print(f"usage: {sys.argv[0]} suite [pytest arguments] | loop SECONDS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
