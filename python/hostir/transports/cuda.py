"""The `cuda` transport: copy-engine pushes into peers' symmetric memory.

A buffer that peers write (`Allocate` with `mem_type=symmetric`) is a
*window*: an allocation of `torch.distributed._symmetric_memory`,
rendezvoused once with the other ranks and cached by the transport under
(tensor, shape, dtype, call parity), so it stays at one address across runs
and CUDA-graph replays. Every rank runs the same programs with the same
agreed shapes in the same order, so every rank misses the cache on the same
call and the rendezvous pairs up; the rendezvous goes through the process
group's store, which times out rather than hangs.

A `send` names where its data lands (`into`: the same view of the window on
the sender as the receiver's `recv` buffer, so the byte offset is known on
both sides). It is a `copy_` into the peer's window on the transport's send
stream — the copy engine, no SM — after the current stream's work, followed
by `put_signal` to the peer on channel `offset / piece size`. A `recv` posts
nothing; its `Wait` enqueues `wait_signal` on the current stream, so the
consumer of the buffer waits on the GPU, never on the host. Windows are
double-buffered by call parity: call n+2 writes the window of call n only
after the peer has passed call n+1, which it entered after its reads of
call n were enqueued ahead of its own pushes.

Importing this module needs neither CUDA nor symmetric memory; `probe`
says whether the transport can run.
"""

from __future__ import annotations

import weakref

import torch

from hostir.transports.base import NoWork, Posted, Transport

_INSTANCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _symm_mem():
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def local_reason(comm) -> str | None:
    """Why this rank cannot use the cuda transport, or None if it can."""
    if comm.device.type != "cuda":
        return f"the ranks run on {comm.device.type}, not on CUDA devices"
    if not torch.cuda.is_available():
        return "CUDA is unavailable"
    try:
        _symm_mem()
    except Exception as err:  # noqa: BLE001 - any import failure means "not available"
        return f"torch.distributed._symmetric_memory is unavailable ({type(err).__name__}: {err})"
    launch = comm.launch
    if launch.local_size is not None and launch.local_size != comm.world_size:
        return f"the ranks span several nodes ({comm.world_size} ranks, {launch.local_size} on this one)"
    me = comm.device.index if comm.device.index is not None else torch.cuda.current_device()
    for other in range(torch.cuda.device_count()):
        if other != me and not torch.cuda.can_device_access_peer(me, other):
            return f"cuda:{me} has no peer access to cuda:{other}"
    return None


def probe(comm) -> str | None:
    """None when every rank can use the cuda transport, else the first
    rank's reason; asked once per communicator, on every rank together."""
    cached = getattr(comm, "_cuda_transport_probe", False)
    if cached is not False:
        return cached
    reasons = comm.all_gather_object(local_reason(comm)) if comm.world_size > 1 else [local_reason(comm)]
    found = next((f"rank {r}: {why}" for r, why in enumerate(reasons) if why is not None), None)
    comm._cuda_transport_probe = found
    return found


def for_communicator(comm) -> CudaTransport:
    """The transport of `comm`'s ranks (one per communicator: it holds the
    window cache and the send stream)."""
    t = _INSTANCES.get(comm)
    if t is None:
        t = _INSTANCES[comm] = CudaTransport(comm)
    return t


class Window:
    """One symmetric allocation, rendezvoused once."""

    def __init__(self, nbytes: int, device: torch.device, group_name: str):
        symm_mem = _symm_mem()
        self.nbytes = nbytes
        self.buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buf, group_name)
        self.base = self.buf.data_ptr()

    def view(self, rank: int, shape, dtype: torch.dtype, byte_off: int) -> torch.Tensor:
        size = torch.empty((), dtype=dtype).element_size()
        if byte_off % size:
            raise ValueError(f"offset {byte_off} is not a multiple of the {dtype} element size {size}")
        return self.handle.get_buffer(rank, tuple(shape), dtype, byte_off // size)


class _SendWork:
    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def wait(self, *args) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        return True


class _SignalWork:
    def __init__(self, window: Window, src: int, channel: int, timeout_ms: int):
        self.window, self.src, self.channel, self.timeout_ms = window, src, channel, timeout_ms

    def wait(self, *args) -> bool:
        _signal(self.window.handle.wait_signal, self.src, self.channel, self.timeout_ms)
        return True


def _signal(fn, peer: int, channel: int, timeout_ms: int) -> None:
    try:
        fn(peer, channel=channel, timeout_ms=timeout_ms)
    except TypeError:
        fn(peer, channel=channel)


class CudaTransport(Transport):
    name = "cuda"

    def __init__(self, comm):
        import torch.distributed as dist

        self.comm = comm
        self.device = comm.device
        self.group_name = dist.group.WORLD.group_name
        self.timeout_ms = int(comm.timeout * 1000)
        self._windows: dict[tuple, Window] = {}
        self._send = torch.cuda.Stream(self.device, priority=-1)
        self.rendezvous_count = 0

    # -- buffers
    def allocate(self, ev, tv, shape):
        parity = ev.call_parity
        key = (tv.name, tuple(shape), tv.dtype, parity)
        window = self._windows.get(key)
        if window is None:
            size = torch.empty((), dtype=tv.dtype).element_size()
            nbytes = max(size, size * _numel(shape))
            window = self._windows[key] = Window(nbytes, self.device, self.group_name)
            self.rendezvous_count += 1
        return window.view(self.comm.rank, shape, tv.dtype, 0)

    def _locate(self, t: torch.Tensor) -> tuple[Window, int]:
        ptr = t.data_ptr()
        for window in self._windows.values():
            if window.base <= ptr < window.base + window.nbytes:
                return window, ptr - window.base
        raise ValueError(
            "a cuda-transport buffer must be a view of a symmetric allocation (Allocate with "
            "mem_type=symmetric)"
        )

    @staticmethod
    def _channel(t: torch.Tensor, offset: int) -> int:
        piece = t.numel() * t.element_size()
        if piece == 0 or offset % piece:
            raise ValueError(f"a piece of {piece} bytes at offset {offset} is not aligned to its size")
        return offset // piece

    # -- communications
    def post(self, ev, e, group, root):
        from hostir.transports import torch_dist

        # Collectives the cuda transport does not move itself go to NCCL.
        return torch_dist.POST[e.type](ev, e, group, root)

    def post_p2p(self, ev, e, buf, peer: int, ops) -> Posted:
        if peer == self.comm.rank:
            raise ValueError("a cuda-transport send or receive needs another rank as its peer")
        posted = self._recv(buf, peer) if e.type == "recv" else self._push(ev, e, buf, peer)
        if ops is None:
            return posted
        # In a coalescing group the group's Wait completes every member.
        ops.extend(posted.works)
        return Posted([])

    def _recv(self, buf, peer: int) -> Posted:
        window, offset = self._locate(buf)
        return Posted([_SignalWork(window, peer, self._channel(buf, offset), self.timeout_ms)])

    def _push(self, ev, e, buf, peer: int) -> Posted:
        if e.into is None:
            raise ValueError("a cuda-transport send needs `into`, the place of its data in the peer's window")
        into = ev.get(e.into)
        window, offset = self._locate(into)
        if not into.is_contiguous() or into.shape != buf.shape:
            raise ValueError(
                f"send buffer {list(buf.shape)} does not fill its contiguous place {list(into.shape)} in the window"
            )
        remote = window.view(peer, into.shape, into.dtype, offset)
        channel = self._channel(into, offset)
        current = torch.cuda.current_stream(self.device)
        self._send.wait_stream(current)
        with torch.cuda.stream(self._send):
            remote.copy_(buf, non_blocking=True)
            _signal(window.handle.put_signal, peer, channel, self.timeout_ms)
            done = torch.cuda.Event()
            done.record(self._send)
        buf.record_stream(self._send)
        return Posted([_SendWork(done)])

    def end_coalescing(self, ev, ops: list) -> Posted:
        return Posted(list(ops) or [NoWork()])


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
