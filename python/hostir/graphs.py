"""Capture a fusion's calls in CUDA graphs and replay them.

`capture(fd, inputs)` runs the fusion twice eagerly (lowering it, and
letting the cuda transport allocate and exchange its windows for both call
parities), then captures one call per parity into its own graph, each
writing its own preallocated outputs. The returned `Replay` replays the two
alternately, so a buffer that peers write is double-buffered across replays
exactly as across eager calls; copy-engine pushes and their signals (symm_mem
signal kernels or stream memory operations) are nodes of the graphs. The
inputs are baked in: write new values into the same tensors before a replay.
Sizes are those of the capture. Every rank must capture together.
"""

from __future__ import annotations

import torch

from hostir.errors import UsageError


class Replay:
    """Replays the captured graphs alternately; `()` returns the outputs the
    replay wrote (valid until the replay after next)."""

    def __init__(self, graphs: list, outputs: list[list[torch.Tensor]]):
        self.graphs = graphs
        self.outputs = outputs
        self._next = 0

    def __call__(self) -> list[torch.Tensor]:
        i = self._next
        self.graphs[i].replay()
        self._next = (i + 1) % len(self.graphs)
        return self.outputs[i]


def capture(fd, inputs, **params) -> Replay:
    """Capture `fd`'s calls on `inputs` (keyword arguments as for
    `fd.execute`); needs CUDA."""
    if not torch.cuda.is_available():
        raise UsageError("CUDA graphs need CUDA, which is unavailable")
    # The ranks agreed on the program in the eager calls; a capture must not
    # wait for a control-group exchange of its own.
    params.setdefault("check_ranks", "first")
    first = fd.execute(inputs, **params)
    fd.execute(inputs, **params)
    torch.cuda.synchronize()
    outputs = [[torch.empty_like(t) for t in first] for _ in range(2)]
    graphs = []
    for parity in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fd.execute(inputs, outputs[parity], **params)
        graphs.append(graph)
    torch.cuda.synchronize()
    return Replay(graphs, outputs)
