"""CUDA streams, or null streams on the CPU, behind one interface.

A program names streams by key: an integer (`Stream(StreamIdx % n)`) or a
`Stream` value without index. `CudaStreams` maps each key to one CUDA stream
of its own, created on first use and kept for the life of the object, so the
set of streams stays small and fixed (the caching allocator keeps memory per
stream). `NullStreams` has the same methods and enqueues nothing.
"""

from __future__ import annotations

import torch

from hostir.errors import UsageError


class NullStreams:
    """Streams of a CPU run: every stream is `None` and waits are no-ops."""

    is_cuda = False

    def current(self):
        return None

    def set_current(self, stream) -> None:
        pass

    def get(self, key):
        return None

    def wait(self, waiter, target) -> None:
        pass


class CudaStreams:
    """One CUDA stream per key on one device."""

    is_cuda = True

    def __init__(self, device: torch.device):
        if not torch.cuda.is_available():
            raise UsageError("CUDA streams were requested but CUDA is unavailable")
        self.device = torch.device(device)
        self._pool: dict = {}

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def set_current(self, stream: torch.cuda.Stream) -> None:
        torch.cuda.set_stream(stream)

    def get(self, key) -> torch.cuda.Stream:
        stream = self._pool.get(key)
        if stream is None:
            stream = self._pool[key] = torch.cuda.Stream(self.device)
        return stream

    def wait(self, waiter: torch.cuda.Stream, target: torch.cuda.Stream) -> None:
        """`waiter` waits for the work enqueued so far on `target` (an event;
        the host does not block)."""
        if waiter != target:
            waiter.wait_stream(target)

    def __len__(self) -> int:
        return len(self._pool)


def streams_for(device: torch.device):
    return CudaStreams(device) if device.type == "cuda" else NullStreams()
