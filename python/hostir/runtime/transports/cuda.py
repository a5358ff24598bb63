"""The `cuda` transport: copy-engine pushes into peers' symmetric memory.

A buffer that peers write (`Allocate` with `mem_type=symmetric`) is a
*window*: an allocation of `torch.distributed._symmetric_memory` (or, where
ranks share a GPU, which symmetric memory refuses, a block shared through
CUDA IPC handles), rendezvoused once with the other ranks and cached by the transport under
(program, tensor, shape, dtype, call parity), so it stays at one address across runs
and CUDA-graph replays. Every rank runs the same programs with the same
agreed shapes in the same order, so every rank misses the cache on the same
call and the rendezvous pairs up; the rendezvous goes through the process
group's store, which times out rather than hangs.

A `send` names where its data lands (`into`: the same view of the window on
the sender as the receiver's `recv` buffer, so the byte offset is known on
both sides). It is a `copy_` into the peer's window on the transport's send
stream — the copy engine, no SM — after the current stream's work, followed
by a signal to the peer on channel `offset / piece size` (symm_mem's
`put_signal`, or a stream memory write into the peer's flag). A `recv` posts
nothing; its `Wait` enqueues the matching wait on the current stream, so the
consumer of the buffer waits on the GPU, never on the host. Windows are
double-buffered by call parity: call n+2 writes the window of call n only
after the peer has passed call n+1, which it entered after its reads of
call n were enqueued ahead of its own pushes.

The C++ executor runs the same protocol (csrc/host_ir/transports/cuda.cpp):
`provide_windows` makes the windows of its program's symmetric Allocates
here, both call parities at once, and hands their addresses over (each
rank's copy and flags); C++ then pushes and signals with stream memory
operations on the same flags (symm_mem's signal pads, or the IPC block's
head), and calls no Python.

Importing this module needs neither CUDA nor symmetric memory; `probe`
says whether the transport can run.
"""

from __future__ import annotations

import struct
import weakref

import torch

from hostir import backends, ir, layout
from hostir.runtime.transports import torch_dist
from hostir.runtime.transports.base import (
    NoWork,
    Posted,
    Transport,
    TransportError,
    TransportUnsupported,
    TransportUsageError,
)

_INSTANCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _symm_mem():
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def _run_device(comm, device) -> torch.device:
    """The device the program runs on: `device` where the call names one
    (ranks of a gloo communicator, whose own device is the CPU, running on
    a GPU), else the communicator's."""
    return comm.device if device is None else torch.device(device)


def local_reason(comm, device=None) -> str | None:
    """Why this rank cannot use the cuda transport for a program running on
    `device` (default: the communicator's), or None if it can."""
    device = _run_device(comm, device)
    if device.type != "cuda":
        return f"the ranks run on {device.type}, not on CUDA devices"
    if not torch.cuda.is_available():
        return "CUDA is unavailable"
    try:
        if window_kind(comm) == "symm_mem":
            _symm_mem()
        else:
            memops()
    except Exception as err:  # noqa: BLE001 - any failure here means "not available"
        return f"no way to map peer memory ({type(err).__name__}: {err})"
    launch = comm.launch
    if launch.local_size is not None and launch.local_size != comm.world_size:
        return f"the ranks span several nodes ({comm.world_size} ranks, {launch.local_size} on this one)"
    me = device.index if device.index is not None else torch.cuda.current_device()
    for other in range(torch.cuda.device_count()):
        if other != me and not torch.cuda.can_device_access_peer(me, other):
            return f"cuda:{me} has no peer access to cuda:{other}"
    return None


def probe(comm, device=None) -> str | None:
    """None when this rank can use the cuda transport on `device` (default:
    the communicator's), else why not; asked once per communicator and
    device. No collective (the schedule is chosen before the ranks agree):
    ranks that answer differently lower different programs and fail the
    agreement on the program with a clear error."""
    device = _run_device(comm, device)
    cache = comm.__dict__.setdefault("_cuda_transport_probe", {})
    if device not in cache:
        cache[device] = local_reason(comm, device)
    return cache[device]


def window_kind(comm) -> str:
    """`symm_mem` (torch's symmetric memory) where every rank has a GPU of
    its own (always under NCCL), else `ipc` (CUDA IPC handles and stream memory operations):
    symmetric memory refuses two ranks on one device.
    `HOSTIR_CUDA_WINDOWS=symm_mem|ipc` forces one."""
    import os

    forced = os.environ.get("HOSTIR_CUDA_WINDOWS")
    if forced:
        if forced not in ("symm_mem", "ipc"):
            raise TransportUsageError(f"HOSTIR_CUDA_WINDOWS={forced!r}: expected symm_mem or ipc")
        return forced
    if getattr(comm, "backend", None) == "nccl":
        # The communicator has checked that NCCL ranks drive distinct GPUs
        # (by UUID), also where each rank sees only its own.
        return "symm_mem"
    local = comm.launch.local_size or comm.world_size
    return "symm_mem" if torch.cuda.device_count() >= local else "ipc"


def for_communicator(comm, device=None) -> CudaTransport:
    """The transport of `comm`'s ranks on `device` (default: the
    communicator's; one per communicator and device: it holds the window
    cache and the send stream)."""
    device = _run_device(comm, device)
    per_device = _INSTANCES.get(comm)
    if per_device is None:
        per_device = _INSTANCES[comm] = {}
    t = per_device.get(device)
    if t is None:
        t = per_device[device] = CudaTransport(comm, device)
    return t


def for_frame(frame, backend: str) -> CudaTransport:
    """The transport of the frame's communicator on the frame's device, as
    `hostir.backends` names this module for `backend` (cuda)."""
    return for_communicator(frame.communicator, getattr(frame, "device", None))


class MemOps:
    """Stream memory operations through libcuda (torch exposes none to
    wait on a value): a 32-bit write or a wait for a value, enqueued on a
    stream, run by the GPU's front end with no SM and no host round trip,
    and capturable in CUDA graphs."""

    EQ = 1  # CU_STREAM_WAIT_VALUE_EQ

    def __init__(self):
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        self._wait = self._pick(lib, ctypes, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        self._write = self._pick(lib, ctypes, "cuStreamWriteValue32_v2", "cuStreamWriteValue32")

    @staticmethod
    def _pick(lib, ctypes, *names):
        for name in names:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint32]
                return fn
        raise TransportError("libcuda.so.1 exports none of " + ", ".join(names))

    def write(self, stream, addr: int, value: int) -> None:
        code = self._write(stream.cuda_stream, addr, value, 0)
        if code != 0:
            raise TransportError(f"cuStreamWriteValue32 failed with CUresult {code}")

    def wait(self, stream, addr: int, value: int) -> None:
        code = self._wait(stream.cuda_stream, addr, value, self.EQ)
        if code != 0:
            raise TransportError(f"cuStreamWaitValue32 failed with CUresult {code}")


_MEMOPS: list = []


def memops() -> MemOps:
    if not _MEMOPS:
        _MEMOPS.append(MemOps())
    return _MEMOPS[0]


class Window:
    """One allocation that every rank maps: `view(rank, ...)` is a tensor
    over rank `rank`'s copy; `signal`/`wait` order a piece's arrival."""

    nbytes: int
    base: int

    def addresses(self) -> tuple[list[int], list[int], int]:
        raise TransportUnsupported("a window without addresses")

    def view(self, rank: int, shape, dtype: torch.dtype, byte_off: int) -> torch.Tensor:
        raise TransportUnsupported("a window without views")

    def signal(self, peer: int, channel: int, timeout_ms: int) -> None:
        raise TransportUnsupported("a window without signals")

    def wait(self, src: int, channel: int, timeout_ms: int) -> None:
        raise TransportUnsupported("a window without signals")


class SymmetricWindow(Window):
    """torch's symmetric memory: one rendezvous; signals are symm_mem's
    put_signal / wait_signal (one-block kernels with a timeout)."""

    def __init__(self, nbytes: int, device: torch.device, group_name: str):
        symm_mem = _symm_mem()
        self.nbytes = nbytes
        self.buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buf, group_name)
        self.base = self.buf.data_ptr()

    def addresses(self) -> tuple[list[int], list[int], int]:
        """Per rank the first byte of its copy and of its signal pad, and
        the pad's bytes (flag [channel * world + src], as put_signal and
        wait_signal address it)."""
        world = self.handle.world_size
        bases = [self.handle.get_buffer(r, (1,), torch.uint8, 0).data_ptr() for r in range(world)]
        return bases, [int(p) for p in self.handle.signal_pad_ptrs], int(self.handle.signal_pad_size)

    def view(self, rank: int, shape, dtype: torch.dtype, byte_off: int) -> torch.Tensor:
        size = torch.empty((), dtype=dtype).element_size()
        if byte_off % size:
            raise TransportUsageError(f"offset {byte_off} is not a multiple of the {dtype} element size {size}")
        return self.handle.get_buffer(rank, tuple(shape), dtype, byte_off // size)

    def signal(self, peer: int, channel: int, timeout_ms: int) -> None:
        _signal(self.handle.put_signal, peer, channel, timeout_ms)

    def wait(self, src: int, channel: int, timeout_ms: int) -> None:
        _signal(self.handle.wait_signal, src, channel, timeout_ms)


# The CUDA IPC description of a block, as torch's storage sharing gives it:
# four integers, a flag and three byte strings (memory handle, the
# producer's reference-counter file, event handle), packed as raw bytes so
# ranks exchange them without pickling.
_IPC_RECORD_BYTES = 1024
_IPC_HEADER = struct.Struct("<qqqq?HHH")


def _pack_ipc_handle(buf: torch.Tensor) -> bytes:
    device, handle, size, offset, ref_handle, ref_offset, event_handle, sync = buf.untyped_storage()._share_cuda_()
    blobs = [bytes(handle), bytes(ref_handle), bytes(event_handle or b"")]
    header = _IPC_HEADER.pack(device, size, offset, ref_offset, bool(sync), *(len(b) for b in blobs))
    return header + b"".join(blobs)


def _open_ipc_handle(record: bytes, numel: int) -> torch.Tensor:
    device, size, offset, ref_offset, sync, *lengths = _IPC_HEADER.unpack_from(record)
    blobs, at = [], _IPC_HEADER.size
    for n in lengths:
        blobs.append(record[at : at + n])
        at += n
    handle, ref_handle, event_handle = blobs
    storage = torch.UntypedStorage._new_shared_cuda(
        device, handle, size, offset, ref_handle, ref_offset, event_handle, sync
    )
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage, 0, (numel,), (1,))


class IpcWindow(Window):
    """CUDA IPC handles of a caching-allocator block (torch's own
    `reduce_tensor`), exchanged once over the control group; signals are
    stream memory operations on flags at the window's start (no SM). Works
    where symmetric memory does not, such as ranks sharing one GPU."""

    FLAG_BYTES = 1 << 16

    def __init__(self, nbytes: int, device: torch.device, comm):
        self.rank, self.world = comm.rank, comm.world_size
        self.nbytes = nbytes
        self.buf = torch.zeros(self.FLAG_BYTES + nbytes, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
        shared = comm.all_gather_bytes(_pack_ipc_handle(self.buf), _IPC_RECORD_BYTES)
        self.peers = [
            self.buf if r == self.rank else _open_ipc_handle(h, self.buf.numel()) for r, h in enumerate(shared)
        ]
        self.base = self.buf.data_ptr() + self.FLAG_BYTES
        self.ops = memops()

    def addresses(self) -> tuple[list[int], list[int], int]:
        """Per rank the first byte of its copy and of its flags, and the
        flags' bytes."""
        flags = [p.data_ptr() for p in self.peers]
        return [f + self.FLAG_BYTES for f in flags], flags, self.FLAG_BYTES

    def view(self, rank: int, shape, dtype: torch.dtype, byte_off: int) -> torch.Tensor:
        size = torch.empty((), dtype=dtype).element_size()
        n = layout.numel(shape) * size
        start = self.FLAG_BYTES + byte_off
        return self.peers[rank][start : start + n].view(dtype).view(tuple(shape))

    def _flag(self, on_rank: int, channel: int, src: int) -> int:
        offset = 4 * (channel * self.world + src)
        if offset + 4 > self.FLAG_BYTES:
            raise TransportUsageError(
                f"signal channel {channel} is beyond the window's {self.FLAG_BYTES // 4 // self.world}"
            )
        return self.peers[on_rank].data_ptr() + offset

    def signal(self, peer: int, channel: int, timeout_ms: int) -> None:
        self.ops.write(torch.cuda.current_stream(), self._flag(peer, channel, self.rank), 1)

    def wait(self, src: int, channel: int, timeout_ms: int) -> None:
        stream = torch.cuda.current_stream()
        addr = self._flag(self.rank, channel, src)
        self.ops.wait(stream, addr, 1)
        self.ops.write(stream, addr, 0)


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
        self.window.wait(self.src, self.channel, self.timeout_ms)
        return True


def _signal(fn, peer: int, channel: int, timeout_ms: int) -> None:
    try:
        fn(peer, channel=channel, timeout_ms=timeout_ms)
    except TypeError:
        fn(peer, channel=channel)


class CudaTransport(Transport):
    name = "cuda"
    capabilities = backends.BACKENDS["cuda"].capabilities

    def __init__(self, comm, device=None):
        import torch.distributed as dist

        self.comm = comm
        self.device = _run_device(comm, device)
        self.group_name = dist.group.WORLD.group_name
        self.timeout_ms = int(comm.timeout * 1000)
        # Per program (held weakly: a program's windows go with it), then
        # per (tensor, shape, dtype, call parity). Never keyed by id(): a new
        # program at a dead one's address would find its windows on one rank
        # and rendezvous for new ones on another, and the ranks' pushes and
        # waits would no longer pair.
        self._windows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._send = torch.cuda.Stream(self.device, priority=-1)
        self.rendezvous_count = 0
        self.kind = window_kind(comm)
        # The live windows handed to C++, by this rank's flag address (`provide_windows`).
        self.cpp_flags: weakref.WeakValueDictionary[int, Window] = weakref.WeakValueDictionary()

    # -- buffers
    def allocate(self, frame, tv, shape):
        # Per program: two programs never share a window, so each one's
        # parity alone orders the writes into it.
        parity = frame.call_parity
        size = torch.empty((), dtype=tv.dtype).element_size()
        window = self.window(
            frame.evaluator.container, (tv.name, tuple(shape), tv.dtype, parity), max(size, size * layout.numel(shape))
        )
        return window.view(self.comm.rank, shape, tv.dtype, 0)

    def window(self, program, key: tuple, nbytes: int) -> Window:
        """`program`'s window under `key`, made (a rendezvous of every
        rank) on first use."""
        windows = self._windows.get(program)
        if windows is None:
            windows = self._windows[program] = {}
        window = windows.get(key)
        if window is None:
            if self.kind == "ipc":
                window = IpcWindow(nbytes, self.device, self.comm)
            else:
                window = SymmetricWindow(nbytes, self.device, self.group_name)
            windows[key] = window
            self.rendezvous_count += 1
        return window

    def _locate(self, t: torch.Tensor) -> tuple[Window, int]:
        ptr = t.data_ptr()
        for windows in list(self._windows.values()):
            for window in windows.values():
                if window.base <= ptr < window.base + window.nbytes:
                    return window, ptr - window.base
        raise TransportUsageError(
            "a cuda-transport buffer must be a view of a symmetric allocation (Allocate with mem_type=symmetric)"
        )

    @staticmethod
    def _channel(t: torch.Tensor, offset: int) -> int:
        piece = ir.nbytes(t)
        if piece == 0 or offset % piece:
            raise TransportUsageError(f"a piece of {piece} bytes at offset {offset} is not aligned to its size")
        return offset // piece

    # -- communications
    def post(self, frame, e, group, root):
        # Collectives the cuda transport does not move itself go to NCCL.
        return torch_dist.POST[e.type](torch_dist.DIST, frame, e, group, root)

    def post_p2p(self, frame, e, buf, peer: int, ops) -> Posted:
        if peer == self.comm.rank:
            raise TransportUsageError("a cuda-transport send or receive needs another rank as its peer")
        posted = self._recv(buf, peer) if e.type == "recv" else self._push(frame, e, buf, peer)
        if ops is None:
            return posted
        # In a coalescing group the group's Wait completes every member.
        ops.extend(posted.works)
        return Posted([])

    def _recv(self, buf, peer: int) -> Posted:
        window, offset = self._locate(buf)
        return Posted([_SignalWork(window, peer, self._channel(buf, offset), self.timeout_ms)])

    def _push(self, frame, e, buf, peer: int) -> Posted:
        if e.into is None:
            raise TransportUsageError("a cuda-transport send needs `into`, the place of its data in the peer's window")
        into = frame.get(e.into)
        window, offset = self._locate(into)
        if not into.is_contiguous() or into.numel() != buf.numel():
            raise TransportUsageError(
                f"send buffer {list(buf.shape)} does not fill its contiguous place {list(into.shape)} in the window"
            )
        remote = window.view(peer, into.shape, into.dtype, offset)
        channel = self._channel(into, offset)
        current = torch.cuda.current_stream(self.device)
        self._send.wait_stream(current)
        with torch.cuda.stream(self._send):
            remote.copy_(buf.view(into.shape), non_blocking=True)
            window.signal(peer, channel, self.timeout_ms)
            done = torch.cuda.Event()
            done.record(self._send)
        buf.record_stream(self._send)
        return Posted([_SendWork(done)])

    def end_coalescing(self, frame, ops: list) -> Posted:
        return Posted(list(ops) or [NoWork()])


def provide_windows(executor, program, comm, device, needed: str) -> None:
    """Make the windows the C++ executor asked for (`needed`: its
    "instr:nbytes" pairs, one per symmetric Allocate it lacks) for both
    call parities and hand over their addresses. Every rank runs the same
    program on the same agreed shapes, so every rank asks on the same call,
    for the same windows in the same order, and the rendezvous pair up."""
    if comm is None:
        raise TransportUsageError("the cuda transport's windows need a communicator")
    reason = probe(comm, device)
    if reason is not None:
        raise TransportUnsupported(f"the cuda transport cannot run here: {reason}")
    transport = for_communicator(comm, device)
    for pair in needed.split():
        instr, nbytes = (int(x) for x in pair.split(":"))
        for parity in (0, 1):
            window = transport.window(program, ("cpp", instr, nbytes, parity), nbytes)
            bases, flags, flag_bytes = window.addresses()
            # Stream memory writes cannot wait for a flag to be consumed (as
            # put_signal does), so two windows sharing flags could merge two
            # signals into one and hang: refuse that rather than risk it.
            other = transport.cpp_flags.get(flags[comm.rank])
            if other is not None and other is not window:
                raise TransportUsageError(
                    f"the window of instruction {instr} (call parity {parity}) shares its flags at "
                    f"{flags[comm.rank]:#x} with another window handed to the C++ executor"
                )
            transport.cpp_flags[flags[comm.rank]] = window
            executor.set_window(instr, parity, nbytes, bases, flags, flag_bytes, comm.rank)
