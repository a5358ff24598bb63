"""CUDA graphs of hostir calls: `cuda_graph=True`, and `capture` for a rank group.

Two ways to replay calls as CUDA graphs live here.

`CudaGraphs` serves `fd.execute(..., cuda_graph=True)`. A graph bakes in
every size, stride and address it saw, so one is captured per exact input
signature: the program, the shapes, strides and dtypes of the
inputs, whether outputs were preallocated, and the number of streams. The
capture runs the chosen evaluator once on a side stream to warm up (lazy
library handles are made outside the graph), then once under capture, on
buffers the graph owns: clones of the caller's inputs, and the caller's
preallocated outputs if any. A replay copies an input into the graph's
buffer only when the caller passes another tensor than that buffer, and
copies the outputs into the caller's preallocated ones only when those are
other tensors than the captured ones. Without preallocated outputs a replay
returns the graph's own output tensors, the same ones every time.
A single-device call that repeats a signature goes from `execute` to its
graph's `replay` through its prepared record (`hostir.runtime.prepared`), with no
other Python on the way.

Capture needs CUDA, and collectives that CUDA graphs can hold (NCCL): on the
CPU or with gloo it is an error, never a silent fallback to eager runs.

`capture(fd, inputs)` serves multi-device programs whose copy-engine
transport double-buffers across calls. It runs the fusion twice eagerly (lowering it, and
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

import dataclasses
import threading

import torch

from hostir import communicator
from hostir.errors import HostIrError, UsageError
from hostir.runtime import profiling


class CudaGraphError(HostIrError, ValueError):
    """cuda_graph=True where a run cannot be captured."""


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list  # the graph's input buffers, in container order
    outputs: list  # the tensors the graph writes its results into
    input_tvs: list
    # The addresses of the caller's preallocated outputs it writes, or None.
    output_ptrs: tuple | None = None

    def writes_into(self, given: list) -> bool:
        """Whether the preallocated outputs `given` are the ones captured."""
        return self.output_ptrs is not None and tuple(t.data_ptr() for t in given) == self.output_ptrs

    def replay(self, inputs: list, given: list | None, rank: int = 0) -> list:
        """Copy `inputs` into the graph's buffers where they are other
        tensors, replay, and return the outputs (`given`'s tensors where the
        caller preallocated other ones than the captured, copied into).
        With a trace active, the replay is one event of it."""
        for buf, t in zip(self.inputs, inputs):
            if t is not buf and t.data_ptr() != buf.data_ptr():
                buf.copy_(t)
        profiling.traced_replay(rank, self.graph.replay)
        if given is None:
            return list(self.outputs)
        results = []
        for out, t in zip(self.outputs, given):
            if out is not None and t is not None and t.data_ptr() != out.data_ptr():
                t.copy_(out)
                out = t
            results.append(out)
        return results


class CudaGraphs:
    """The captured graphs of one fusion's programs, by input signature."""

    def __init__(self):
        self._graphs: dict[tuple, _Captured] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, program, bindings: dict, number_of_streams: int, device, backend: str | None = None) -> list:
        """Replay the graph of this call's signature, captured first if new."""
        captured = self.captured(program, bindings, number_of_streams, device, backend)
        inputs = [bindings[tv] for tv in program.container.inputs]
        given = [bindings.get(tv) for tv in program.container.outputs]
        return captured.replay(inputs, given if any(t is not None for t in given) else None)

    def captured(self, program, bindings: dict, number_of_streams: int, device, backend: str | None = None) -> _Captured:
        """The graph of this call's signature, captured on first use."""
        device = torch.device(device)
        if device.type != "cuda":
            raise CudaGraphError(
                f"cuda_graph=True needs a CUDA device, but the fusion runs on {device}; "
                f"run without cuda_graph on the CPU"
            )
        if backend is not None and backend != "nccl":
            raise CudaGraphError(
                f"cuda_graph=True cannot capture {backend} collectives: CUDA graphs hold NCCL collectives only; "
                f"use backend='nccl' or run without cuda_graph"
            )
        container = program.container
        inputs = [bindings[tv] for tv in container.inputs]
        given = [bindings.get(tv) for tv in container.outputs]
        preallocated = any(t is not None for t in given)
        key = (
            id(program),
            tuple((tuple(t.shape), tuple(t.stride()), t.dtype) for t in inputs),
            tuple(t.data_ptr() for t in given) if preallocated else None,
            number_of_streams,
        )
        captured = self._graphs.get(key)
        if captured is None:
            with self._lock:
                captured = self._graphs.get(key)
                if captured is None:
                    captured = _capture(program, bindings, number_of_streams, device)
                    captured.output_ptrs = key[2]
                    self._graphs[key] = captured
        return captured


def _capture(program, bindings: dict, number_of_streams: int, device: torch.device) -> _Captured:
    container = program.container
    static = {tv: _graph_input(tv, bindings[tv], device) for tv in container.inputs}
    for tv in container.outputs:
        if bindings.get(tv) is not None:
            static[tv] = bindings[tv]
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        program.evaluator.run(dict(static), number_of_streams=number_of_streams)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = program.evaluator.run(dict(static), number_of_streams=number_of_streams)
    return _Captured(graph, [static[tv] for tv in container.inputs], list(outputs), list(container.inputs))

def _graph_input(tv, t, device: torch.device):
    """The graph's own buffer for input `t`: a clone, except a tensor in
    host memory, which the graph's transfers read in place (a pageable one
    would be read through a staging copy that a replay never refreshes)."""
    if t.device.type != "cpu":
        return t.clone()
    if not t.is_pinned():
        raise CudaGraphError(
            f"input T{tv.name} is in host memory but not pinned: a CUDA graph reads it in place, so pin it "
            f"(tensor.pin_memory()) or run without cuda_graph"
        )
    return t


class Replay:
    """Replays the captured graphs alternately; `()` returns the outputs the
    replay wrote (valid until the replay after next)."""

    def __init__(self, graphs: list, outputs: list[list[torch.Tensor]], rank: int = 0):
        self.graphs = graphs
        self.outputs = outputs
        self.rank = rank
        self._next = 0

    def __call__(self) -> list[torch.Tensor]:
        i = self._next
        profiling.traced_replay(self.rank, self.graphs[i].replay)
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
    comm = communicator.live()
    return Replay(graphs, outputs, comm.rank if comm is not None else 0)
