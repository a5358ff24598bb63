"""A shared-memory mailbox for the small exchanges of ranks on one host.

A steady multi-device call checks a step of a few words with every other
rank (`runtime/agreement.py`). Over gloo that is one all-gather through the
loopback network, a few hundred microseconds on a busy host; ranks that
share a host can meet in memory instead. The mailbox is a small shared
segment: one header line, then per rank two cache-line slots (the
exchanges alternate between them), each holding a sequence number and up to
`SLOT_WORDS` int64 words:

    line 0              MAGIC, the set-up nonce, world size, slot words
    line 1 + 2*r + b    rank r's slot b: sequence, words..., padding

Exchange number k (1, 2, ...; each rank counts its own) writes the words
into slot k % 2, then k as the slot's sequence, and waits until every
rank's slot k % 2 shows sequence k. So each rank's k-th exchange pairs with
every other rank's k-th, in strict lockstep, as a collective would. Two
slots suffice: a rank writes slot k % 2 again only at exchange k + 2, which
it cannot start before every rank finished exchange k + 1, after its reads
of exchange k.

Memory order: the words are written before the sequence, and a reader
reads the sequence, then the words, then the sequence again. On x86-64 (a
total store order: stores become visible in program order, loads are not
reordered with loads) and with aligned 8-byte stores and loads through a
memoryview of int64 (each one machine store or load), that
means a reader that sees sequence k sees the words written before it. The
mailbox is used only there; elsewhere the exchange stays on gloo.

A rank waits by spinning for `SPIN_SECONDS`, then yielding the CPU
(`time.sleep(0)`), then sleeping in growing steps up to `MAX_NAP_SECONDS`,
so that a rank far ahead of the others does not hold a core. (`time.sleep(0)`
sleeps through the kernel's timer slack, 50-80 µs on Linux. `os.sched_yield`
returns at once but keeps the core busy: on 2 x H100 a steady call with
check_ranks="always" then took 269 µs instead of 186, the waiting rank
slowing the peer it waits for.) It gives up
after the communicator's timeout with `MailboxTimeout` naming the ranks
that did not arrive, or earlier with `MailboxPeerLost` once such a rank's
process has exited (the communicator raises them as its
`CommunicatorTimeout` and `PeerLostError`). Never a hang.

Set-up (`Mailbox.open`, collective on the control group, once per
communicator): the ranks gather their host's identity (host name, boot id,
PID namespace); if any differs, or the machine is not x86-64, or
HOSTIR_MAILBOX=0 on any rank, or the launcher says the job spans nodes
(a local size below the world size), there is no mailbox. Otherwise rank 0 creates
the segment under /dev/shm, named from the job's rendezvous namespace, its
process id and a random part (two jobs, or two communicators of one job,
never share one), writes a random nonce into it and sends the name and
nonce; the others open it and check the nonce; the ranks gather whether
each succeeded, and all use it or none does. Rank 0 then removes the name
at once, and a first exchange through the mailbox ends set-up: the mapped
memory lives on while a rank holds it, and nothing is left in /dev/shm,
even if a rank is killed later. (Until then the name is removed at
shutdown or exit.)
"""

from __future__ import annotations

import atexit
import mmap
import os
import platform
import re
import secrets
import socket
import time

import torch

from hostir.errors import HostIrError

MAGIC = 0x4849_524D_0000_0001  # "HIRM", layout 1
LINE_WORDS = 8  # 64 bytes: one cache line
SLOT_WORDS = LINE_WORDS - 1
DIRECTORY = "/dev/shm"
SPIN_SECONDS = 50e-6
YIELD_SECONDS = 2e-3
MAX_NAP_SECONDS = 1e-3
# How often a waiting rank checks whether the ranks it waits for still run.
LIVENESS_SECONDS = 0.5
_IDENTITY_BYTES = 256
_NAME_BYTES = 200

class MailboxError(HostIrError, RuntimeError):
    """An exchange through the mailbox failed (the communicator raises it
    as its own CommunicatorError, CommunicatorTimeout or PeerLostError)."""


class MailboxTimeout(MailboxError):
    """Ranks did not arrive at an exchange within the timeout (`missing`)."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


class MailboxPeerLost(MailboxTimeout):
    """Ranks that did not arrive have exited (`lost`)."""

    def __init__(self, message: str, missing: list[int], lost: list[int]):
        super().__init__(message, missing)
        self.lost = lost


# Names this process created and has not removed yet.
_created: set[str] = set()


def _remove_created() -> None:
    for path in list(_created):
        _unlink(path)


atexit.register(_remove_created)


def _unlink(path: str) -> None:
    _created.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _identity() -> bytes:
    """What ranks on one host (and one PID namespace) share: the host name,
    the kernel's boot id and the PID namespace; empty where the mailbox must
    not be used."""
    if os.environ.get("HOSTIR_MAILBOX", "1") == "0":
        return b""
    if platform.machine().lower() not in ("x86_64", "amd64") or not os.path.isdir(DIRECTORY):
        return b""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pid_namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return b""
    return f"{socket.gethostname()}\n{boot}\n{pid_namespace}".encode()[:_IDENTITY_BYTES]


def _segment_name(namespace: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", namespace)[:80]
    return f"{DIRECTORY}/{safe}.{os.getpid()}.{secrets.token_hex(6)}.mailbox"


class Mailbox:
    """The mailbox of one communicator's ranks (see the module's docstring).
    `exchange(words)` returns every rank's words in rank order."""

    def __init__(
        self, memory: mmap.mmap, rank: int, world_size: int, pids: list[int], timeout: float, path: str = ""
    ):
        # `memory`: LINE_WORDS * 8 * (1 + 2 * world_size) bytes shared by
        # the ranks; `pids`: each rank's process id; `path`: the segment's
        # name in /dev/shm while it had one.
        self.path = path
        self._memory = memory
        self._words = memoryview(memory).cast("q")
        # Where each rank's slot b starts, per b.
        self._starts = [[LINE_WORDS * (1 + 2 * r + b) for r in range(world_size)] for b in (0, 1)]
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._pids = pids
        self._count = 0
        self._closed = False

    @classmethod
    def open(cls, comm, namespace: str, one_node: bool = True) -> Mailbox | None:
        """The mailbox of `comm`'s ranks, or None where they do not all share
        this host (or cannot map the segment), or where the launcher says the
        job spans nodes (`one_node` false on any rank: it keeps its nodes
        apart even where they run on one machine). Collective on `comm`'s
        control group: every rank calls it at the same point of set-up."""
        identity = _identity() if one_node else b""
        identities = comm.all_gather_bytes(identity, _IDENTITY_BYTES)
        if not identity or any(other != identity for other in identities):
            return None
        size = LINE_WORDS * 8 * (1 + 2 * comm.world_size)
        memory = path = None
        nonce = secrets.randbits(62) + 1
        offer = b""
        if comm.rank == 0:
            path = _segment_name(namespace)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                _created.add(path)
                try:
                    os.ftruncate(fd, size)
                    memory = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
                with memoryview(memory).cast("q") as header:
                    header[1], header[2], header[3] = nonce, comm.world_size, SLOT_WORDS
                    header[0] = MAGIC
                offer = f"{path}\n{nonce}".encode()
            except OSError:
                if path is not None:
                    _unlink(path)
                memory = None
        try:
            offered = comm.all_gather_bytes(offer, _NAME_BYTES)[0]
            if comm.rank != 0 and offered:
                memory = _attach(offered, size, comm.world_size)
                path = offered.decode().split("\n")[0]
            ready = torch.tensor([int(memory is not None), os.getpid()], dtype=torch.int64)
            answers = comm.all_gather_words(ready).tolist()
        finally:
            if comm.rank == 0 and path is not None:
                _unlink(path)  # every rank that could map it has (or set-up failed)
        if not all(ok for ok, _ in answers):
            if memory is not None:
                memory.close()
            return None
        box = cls(memory, comm.rank, comm.world_size, [pid for _, pid in answers], comm.timeout, path or "")
        # The first exchange: every rank sees the others' words through the
        # memory, and none leaves set-up before rank 0 removed the name.
        box.exchange([MAGIC])
        return box

    def exchange(self, words) -> list[list[int]]:
        """Every rank's `words` (at most SLOT_WORDS int64 values, the same
        number on every rank), in rank order. Raises MailboxTimeout (or
        MailboxPeerLost), naming the ranks that did not arrive, instead of
        waiting past the timeout."""
        return self.collect(self.post(words), len(words))

    def post(self, words) -> int:
        """The first half of `exchange`: write this rank's `words` and
        return the exchange's number, for `collect`. Nothing waits."""
        if self._closed:
            raise MailboxError("the mailbox is closed")
        cells = self._words
        self._count += 1
        k = self._count
        starts = self._starts[k & 1]
        at = starts[self.rank] + 1
        for w in words:
            cells[at] = w
            at += 1
        cells[starts[self.rank]] = k  # after the words: a reader that sees k sees them
        return k

    def collect(self, k: int, n: int) -> list[list[int]]:
        """The second half of `exchange` number `k` (the last posted): every
        rank's `n` words, once each has posted them."""
        if self._closed:
            raise MailboxError("the mailbox is closed")
        if k != self._count:
            raise MailboxError(f"exchange {k} is collected after exchange {self._count} was posted")
        cells = self._words
        starts = self._starts[k & 1]
        for s in starts:
            if cells[s] != k:
                self._wait(starts, k)
                break
        rows = [cells[s + 1 : s + 1 + n].tolist() for s in starts]
        for s in starts:
            if cells[s] != k:
                # A rank wrote this slot again before the others read it:
                # only a rank exchanging out of lockstep can; say so rather
                # than return torn words.
                raise self._error(starts, k, "changed its slot while it was read")
        return rows

    def _arrived(self, starts: list[int], k: int) -> bool:
        words = self._words
        for s in starts:
            if words[s] != k:
                return False
        return True

    def _wait(self, starts: list[int], k: int) -> None:
        start = time.perf_counter()
        now = start
        while now - start < SPIN_SECONDS:
            if self._arrived(starts, k):
                return
            now = time.perf_counter()
        nap = 0.0
        checked = now
        while True:
            if self._arrived(starts, k):
                return
            waited = now - start
            if waited >= self.timeout:
                raise self._error(starts, k, None)
            if now - checked >= LIVENESS_SECONDS:
                checked = now
                gone = [r for r in self._missing(starts, k) if not _alive(self._pids[r])]
                if gone:
                    raise self._error(starts, k, gone)
            if waited < YIELD_SECONDS:
                time.sleep(0)
            else:
                nap = min(MAX_NAP_SECONDS, max(2 * nap, 20e-6))
                time.sleep(nap)
            now = time.perf_counter()

    def _missing(self, starts: list[int], k: int) -> list[int]:
        return [r for r, s in enumerate(starts) if self._words[s] != k]

    def _error(self, starts: list[int], k: int, gone) -> MailboxTimeout:
        missing = self._missing(starts, k)
        names = ", ".join(map(str, missing))
        what = f"the ranks' step exchange {k} (shared memory) on rank {self.rank}"
        if isinstance(gone, str):
            return MailboxTimeout(
                f"{what}: rank(s) {names} {gone}: they exchange out of lockstep with this rank", missing
            )
        if gone:
            return MailboxPeerLost(
                f"{what}: the process of rank(s) {', '.join(map(str, gone))} exited before it arrived; "
                f"check the other ranks' output (ranks not arrived: {names})",
                missing,
                gone,
            )
        return MailboxTimeout(
            f"{what} timed out after {self.timeout:g} s: rank(s) {names} did not arrive "
            f"(skipped the call, are stuck, or issue collectives in another order)",
            missing,
        )

    def close(self) -> None:
        """Unmap the segment (local; its name is already gone)."""
        if self._closed:
            return
        self._closed = True
        self._words.release()
        try:
            self._memory.close()
        except BufferError:
            pass  # a view is still held somewhere; the mapping goes with it


def _attach(offered: bytes, size: int, world_size: int) -> mmap.mmap | None:
    """Map rank 0's segment and check its header; None where it cannot be."""
    try:
        text = offered.decode()
        path, nonce = text.split("\n")
        if not path.startswith(DIRECTORY + "/") or "/" in path[len(DIRECTORY) + 1 :]:
            return None
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                return None
            memory = mmap.mmap(fd, size)
        finally:
            os.close(fd)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    with memoryview(memory).cast("q") as header:
        fits = header[0] == MAGIC and header[1] == int(nonce) and header[2] == world_size
    if not fits:
        memory.close()
        return None
    return memory


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
