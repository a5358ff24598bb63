"""torch.compile over hostir.parallel Linears: graph breaks, dynamo's
warnings and the time to compile, on the CPU.

    python tools/bench_compile.py [--backend aot_eager|inductor]
    mpirun -np 2 python tools/bench_compile.py --backend inductor

A block of two Linears, colwise then rowwise (`nn.Linear(16, 32)`, relu,
`nn.Linear(32, 16)`), is parallelized with `hostir.parallel` over every rank
of the job (gloo) and compiled with `torch.compile` (with `--fullgraph`,
`fullgraph=True`). The first forward and backward on a [4, 16] input (the
compilation of both graphs and their first run) is timed; graph breaks are
`torch._dynamo.utils.counters["graph_break"]`, dynamo's warnings the
records its logger gave at WARNING and above. Outputs and the input's
gradient are checked against the same block in eager torch. Each rank
prints one line; run it with PYTHONPATH pointing at the tree to measure.
"""

from __future__ import annotations

import argparse
import copy
import logging
import time

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--fullgraph", action="store_true")
    args = parser.parse_args()

    from torch._dynamo.utils import counters
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import hostir
    from hostir import communicator
    from hostir.parallel import parallelize_module

    comm = communicator.get(backend="gloo")
    mesh = hostir.DeviceMesh(range(comm.world_size)).to_torch("cpu")
    torch.manual_seed(0)
    base = Block()
    model = copy.deepcopy(base)
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(4, 16)
    records = _Records()
    logging.getLogger("torch._dynamo").addHandler(records)
    compiled = torch.compile(model, backend=args.backend, fullgraph=args.fullgraph)
    start = time.perf_counter()
    xc = x.clone().requires_grad_()
    y = compiled(xc)
    y.sum().backward()
    seconds = time.perf_counter() - start
    xe = x.clone().requires_grad_()
    ye = base(xe)
    ye.sum().backward()
    torch.testing.assert_close(y, ye)
    torch.testing.assert_close(xc.grad, xe.grad)
    breaks = sum(counters["graph_break"].values())
    print(
        f"rank {comm.rank} of {comm.world_size}, backend {args.backend}: {breaks} graph breaks, "
        f"{records.count} dynamo warnings, first compiled step {seconds:.1f} s (matches eager torch)"
    )


if __name__ == "__main__":
    main()
