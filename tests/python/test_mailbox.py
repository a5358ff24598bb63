"""The shared-memory mailbox of one host's ranks (`hostir/mailbox.py`),
within one test process: a forked peer maps the same memory as rank 1. (The communicator raises
the mailbox's timeouts as its CommunicatorTimeout and PeerLostError.)

The multi-process side (set-up through a communicator, ranks of an mpirun
job, cleanup of /dev/shm) is tests/python/multidevice/test_mailbox.py."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import random
import subprocess
import sys
import time

import pytest

from hostir import mailbox
from hostir.mailbox import MailboxPeerLost, MailboxTimeout

pytestmark = pytest.mark.skipif(
    not mailbox._identity() or sys.platform != "linux", reason="the mailbox needs x86-64 Linux with /dev/shm"
)


def _memory(world_size: int) -> mmap.mmap:
    """Anonymous shared memory: a forked child maps the same pages."""
    return mmap.mmap(-1, mailbox.LINE_WORDS * 8 * (1 + 2 * world_size))


def _words(k: int, rank: int) -> list[int]:
    return [k, rank, -k * 7919 + rank, (k << 33) | rank, 2**62 - k, rank - k]


def _peer(memory, rank: int, world_size: int, count: int, seed: int, failures) -> None:
    box = mailbox.Mailbox(memory, rank, world_size, [os.getppid(), os.getpid()], timeout=30)
    skew = random.Random(seed)
    try:
        for k in range(count):
            if skew.random() < 0.05:
                time.sleep(skew.random() * 2e-3)
            rows = box.exchange(_words(k, rank))
            if rows != [_words(k, r) for r in range(world_size)]:
                failures.put(f"exchange {k}: {rows}")
                return
    except Exception as exc:  # reported to the parent
        failures.put(repr(exc))


def test_exchanges_pair_in_lockstep_over_many_exchanges():
    memory = _memory(2)
    context = multiprocessing.get_context("fork")
    failures = context.Queue()
    child = context.Process(target=_peer, args=(memory, 1, 2, 3000, 1, failures))
    child.start()
    box = mailbox.Mailbox(memory, 0, 2, [os.getpid(), child.pid], timeout=30)
    skew = random.Random(0)
    for k in range(3000):
        if skew.random() < 0.05:
            time.sleep(skew.random() * 2e-3)
        assert box.exchange(_words(k, 0)) == [_words(k, r) for r in range(2)], k
    child.join(60)
    assert child.exitcode == 0
    assert failures.empty(), failures.get()


def test_a_rank_that_never_arrives_times_out_naming_it():
    box = mailbox.Mailbox(_memory(3), 0, 3, [os.getpid()] * 3, timeout=0.3)
    start = time.monotonic()
    with pytest.raises(MailboxTimeout, match=r"timed out after 0.3 s: rank\(s\) 1, 2 did not arrive") as info:
        box.exchange([1, 2, 3])
    assert info.value.missing == [1, 2]
    assert time.monotonic() - start < 5


def test_a_rank_whose_process_exited_is_a_lost_peer():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    box = mailbox.Mailbox(_memory(2), 0, 2, [os.getpid(), gone.pid], timeout=30)
    start = time.monotonic()
    with pytest.raises(MailboxPeerLost, match=r"the process of rank\(s\) 1 exited before it arrived") as info:
        box.exchange([5])
    assert info.value.lost == [1]
    assert time.monotonic() - start < 5


def test_an_exchange_is_collected_only_while_it_is_the_last_posted():
    # A rank posts at most one exchange ahead of its collects: collecting an
    # older one would read slots the next post of its parity rewrites.
    box = mailbox.Mailbox(_memory(1), 0, 1, [os.getpid()], timeout=1)
    first = box.post([1, 2])
    assert box.collect(first, 2) == [[1, 2]]
    second, third = box.post([3]), box.post([4])
    with pytest.raises(mailbox.MailboxError, match=f"exchange {second} is collected after exchange {third}"):
        box.collect(second, 1)
    assert box.collect(third, 1) == [[4]]


def test_a_slot_rewritten_while_read_is_refused_not_returned_torn():
    memory = _memory(2)
    box = mailbox.Mailbox(memory, 0, 2, [os.getpid()] * 2, timeout=1)
    cells = memoryview(memory).cast("q")
    peer = box._starts[1][1]  # rank 1's slot of exchange 1
    cells[peer + 1], cells[peer] = 9, 1  # rank 1 has sent exchange 1

    class Rewriting:
        """The memory, where rank 1 writes its slot again (exchange 3, out
        of lockstep) while rank 0 reads the words of exchange 1."""

        def __getitem__(self, index):
            value = cells[index]
            if isinstance(index, slice):
                cells[peer] = 3
            return value

        def __setitem__(self, index, value):
            cells[index] = value

    box._words = Rewriting()
    with pytest.raises(MailboxTimeout, match=r"rank\(s\) 1 changed its slot while it was read"):
        box.exchange([1])


class _OneRank:
    """The control group of a job of one rank, for `Mailbox.open`."""

    rank, world_size, timeout = 0, 1, 5.0

    def all_gather_bytes(self, data: bytes, capacity: int) -> list[bytes]:
        assert len(data) <= capacity
        return [data]

    def all_gather_words(self, words):
        return words.reshape(1, -1)


def test_two_jobs_of_one_namespace_get_segments_of_their_own_and_leave_none():
    before = set(os.listdir(mailbox.DIRECTORY))
    first = mailbox.Mailbox.open(_OneRank(), "hostir/prterun-host-1234@1")
    second = mailbox.Mailbox.open(_OneRank(), "hostir/prterun-host-1234@1")
    assert first is not None and second is not None
    assert first.path != second.path
    for box in (first, second):
        name = os.path.basename(box.path)
        assert name.startswith("hostir_prterun-host-1234_1.") and name.endswith(".mailbox"), name
        assert not os.path.exists(box.path)  # removed once every rank mapped it
    assert first.exchange([1, 2]) == [[1, 2]] and second.exchange([3]) == [[3]]
    first.close()
    second.close()
    assert not mailbox._created
    assert set(os.listdir(mailbox.DIRECTORY)) <= before


def test_a_rank_turned_off_gets_no_mailbox(monkeypatch):
    monkeypatch.setenv("HOSTIR_MAILBOX", "0")
    assert mailbox.Mailbox.open(_OneRank(), "hostir/job") is None
