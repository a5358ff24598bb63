"""Transfers between host and device memory, posted like communications.

`post_transfer(frame, e)` starts an `ir.Transfer` and returns a `Posted`
whose work its `Wait` waits for; `copy_in_order(frame, e)` runs one whose
stream is the current one (no copy stream, no `Wait`). On a GPU, the copy runs on a copy stream
of its direction (one for H2D, one for D2H, so both copy engines work),
after the work already enqueued on the current stream; the `Wait` of an H2D
transfer makes the current stream wait for it (the host does not block),
that of a D2H transfer blocks the host until the bytes are in host memory.
On the CPU, and on meta tensors (a dry run), a transfer is a copy made at
its post.

The copy engine reads host memory at full speed only when it is pinned.
`HostStaging` keeps one pinned copy per host tensor of a program, made on
first use: an input that is pinned already (say, a module's weights after
`hostir.offload`) is read in place; a pageable one is copied into its
staging buffer only when it is another tensor or was written since (its
version counter moved), never on every call. A tensor that moves in
pieces (`HirAliasChunk` views of it) is staged whole, once, and each piece
is read from its view of that staging. The staging holds the last tensor
it copied, so that tensor's memory cannot be reused under it.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from hostir.runtime.transports.base import NoWork, Posted


class CopyWork:
    """An H2D or D2H copy in flight on a copy stream: `wait()` makes the
    current stream wait for it (H2D), or blocks the host until it is done
    (D2H)."""

    def __init__(self, event, device, host: bool):
        self.event = event
        self.device = device
        self.host = host

    def wait(self, *args) -> bool:
        if self.host:
            self.event.synchronize()
        else:
            torch.cuda.current_stream(self.device).wait_event(self.event)
        return True


@dataclasses.dataclass
class _Staged:
    buffer: torch.Tensor
    source: torch.Tensor
    stamp: tuple
    # The last copy that read `buffer`: refreshing it waits for that one.
    read: object = None


def _empty_pinned(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def _capturing() -> bool:
    # is_initialized, not is_available: the latter asks NVML through the
    # environment on every call (tens of µs before each transfer), and no
    # stream can be capturing before CUDA is initialized.
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class HostStaging:
    """Pinned host buffers of one program's host tensors (see the module).
    `sources` maps a piece (a view's TensorView) to the TensorView it is a
    view of; a piece is staged as a view of its whole tensor's staging."""

    def __init__(self, sources: dict | None = None):
        self._sources = dict(sources or {})
        self._entries: dict = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """The staging buffers made (one per host tensor staged)."""
        return len(self._entries)

    def whole(self, tv):
        """The TensorView `tv` is a piece of (itself when it is whole)."""
        while tv in self._sources:
            tv = self._sources[tv]
        return tv

    def pinned(self, tv, t: torch.Tensor, get=None) -> torch.Tensor:
        """`t` itself when pinned and contiguous, else its staging, refreshed
        if `t` is another tensor or was written since. With `get` (the
        tensor bound to a TensorView), a piece of a contiguous whole is
        read from its view of the whole's staging."""
        if t.is_contiguous() and (_capturing() or t.is_pinned()):
            # Under a CUDA graph's capture the inputs in host memory were
            # checked pinned before it began (asking the driver again is
            # no call to make while capturing).
            return t
        root = self.whole(tv)
        if get is not None and root is not tv:
            whole = get(root)
            if whole.is_contiguous() and whole.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                buffer = self._staged(root, whole)
                offset = t.storage_offset() - whole.storage_offset()
                return buffer.as_strided(t.shape, t.stride(), buffer.storage_offset() + offset)
        return self._staged(tv, t)

    def _staged(self, tv, t: torch.Tensor) -> torch.Tensor:
        stamp = (t.data_ptr(), t._version, tuple(t.shape), tuple(t.stride()), t.dtype)
        with self._lock:
            entry = self._entries.get(tv)
            if entry is not None and entry.stamp == stamp:
                return entry.buffer
            if entry is None or entry.buffer.shape != t.shape or entry.buffer.dtype != t.dtype:
                buffer = _empty_pinned(t.shape, t.dtype)
            else:
                buffer = entry.buffer
                if entry.read is not None:
                    entry.read.synchronize()
            buffer.copy_(t)
            self._entries[tv] = _Staged(buffer, t, stamp)
            return buffer

    def read_by(self, tv, event) -> None:
        """`event` completes the latest copy that read `tv`'s staging (or
        its whole tensor's): a refresh waits for it."""
        with self._lock:
            for key in (tv, self.whole(tv)):
                entry = self._entries.get(key)
                if entry is not None:
                    entry.read = event


def allocate_host(frame, make, shape, dtype) -> torch.Tensor:
    """A buffer in host memory: pinned when the program runs on a GPU, a
    meta tensor in a dry run."""
    if frame.device.type == "meta":
        return make(shape, dtype=dtype, device="meta")
    return make(shape, dtype=dtype, device="cpu", pin_memory=frame.device.type == "cuda")


def copy_in_order(frame, e) -> None:
    """Run a transfer on the current stream (`ir.Transfer.stream ==
    "current"`): no copy stream, no event, no cross-stream wait. An H2D
    copy is enqueued (the ops after it on the stream read it in order); a
    D2H one blocks the host until the bytes are in host memory."""
    src = frame.get(e.input)
    out = frame.get(e.out)
    if not getattr(frame.streams, "is_cuda", False) or frame.device.type != "cuda":
        out.copy_(src)
        return
    if e.direction != "H2D":
        out.copy_(src)
        return
    staging = frame.evaluator.staging
    pinned = staging.pinned(e.input, src, frame.get)
    out.copy_(pinned, non_blocking=True)
    if pinned is not src:
        # Read from a staging buffer: its next refresh waits for this copy.
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(frame.device))
        staging.read_by(e.input, event)


def post_transfer(frame, e) -> Posted:
    src = frame.get(e.input)
    out = frame.get(e.out)
    if not getattr(frame.streams, "is_cuda", False) or frame.device.type != "cuda":
        out.copy_(src)
        return Posted([NoWork()])
    h2d = e.direction == "H2D"
    if h2d:
        src = frame.evaluator.staging.pinned(e.input, src, frame.get)
    caller = frame.streams.current()
    stream = frame.streams.get(("copy", e.direction))
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        out.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    if h2d:
        frame.evaluator.staging.read_by(e.input, event)
    return Posted([CopyWork(event, frame.device, host=not h2d)])
