"""Each rank of a job prints, per call of the AG+matmul layer, the stage
methods (`FusionExecutor.STAGES`) the call went through and whether its
result matches eager torch; `tests/python/test_runner.py` launches it."""

from __future__ import annotations

import json

import torch

import hostir
from hostir import overlap


def main() -> None:
    world, rank = hostir.world_size(), hostir.rank()
    torch.manual_seed(0)
    fd = overlap.allgather_matmul(world)
    executor = fd.executor
    called: list[str] = []
    for name in executor.STAGES:
        real = getattr(executor, name)

        def spy(*args, _name=name, _real=real, **kwargs):
            called.append(_name)
            return _real(*args, **kwargs)

        setattr(executor, name, spy)
    calls = []
    for m in (3, 3, 3, 5, 5):
        X, W = torch.randn(world, m, 4), torch.randn(4, 6)
        inputs, expected = overlap.allgather_matmul_inputs(X, W, rank)
        called.clear()
        (y,) = fd.execute(inputs, backend="gloo")
        calls.append({"m": m, "stages": list(called), "matches": bool(torch.allclose(y, expected))})
    print(f"STAGES {rank} {json.dumps({'calls': calls, 'prepared': len(executor._prepared)})}", flush=True)
    hostir.communicator.shutdown()


if __name__ == "__main__":
    main()
