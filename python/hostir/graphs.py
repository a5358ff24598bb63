"""CUDA-graph mode: capture a program's run once, replay it after.

A graph bakes in every size, stride and address it saw, so one is captured
per exact input signature: the program, the shapes, strides and dtypes of the
inputs, whether outputs were preallocated, and the number of streams. The
capture runs the chosen evaluator once on a side stream to warm up (lazy
library handles are made outside the graph), then once under capture, on
buffers the graph owns: clones of the caller's inputs, and the caller's
preallocated outputs if any. A replay copies an input into the graph's
buffer only when the caller passes another tensor than that buffer, and
copies the outputs into the caller's preallocated ones only when those are
other tensors than the captured ones. Without preallocated outputs a replay
returns the graph's own output tensors, the same ones every time.

Capture needs CUDA, and collectives that CUDA graphs can hold (NCCL): on the
CPU or with gloo it is an error, never a silent fallback to eager runs.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from hostir.errors import HostIrError


class CudaGraphError(HostIrError, ValueError):
    """cuda_graph=True where a run cannot be captured."""


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list  # the graph's input buffers, in container order
    outputs: list  # the tensors the graph writes its results into
    input_tvs: list


class CudaGraphs:
    """The captured graphs of one fusion's programs, by input signature."""

    def __init__(self):
        self._graphs: dict[tuple, _Captured] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, program, bindings: dict, number_of_streams: int, device, backend: str | None = None) -> list:
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
                    captured = self._graphs[key] = _capture(program, bindings, number_of_streams, device)
        for buf, t in zip(captured.inputs, inputs):
            if t is not buf and t.data_ptr() != buf.data_ptr():
                buf.copy_(t)
        captured.graph.replay()
        results = []
        for out, t in zip(captured.outputs, given):
            if out is not None and t is not None and t.data_ptr() != out.data_ptr():
                t.copy_(out)
                out = t
            results.append(out)
        return results


def _capture(program, bindings: dict, number_of_streams: int, device: torch.device) -> _Captured:
    container = program.container
    static = {tv: bindings[tv].clone() for tv in container.inputs}
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
