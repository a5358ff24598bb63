"""The steps of a multi-device call through the shared-memory mailbox of
ranks on one host (`hostir/mailbox.py`), set up by the communicator.

Every rank of the job runs here on this one host, so every communicator
has a mailbox. Each test that needs other settings makes a communicator of
its own beside the process-wide one (on the same default group, with a
control group and a mailbox of its own) and shuts it down at the end.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from hostir import communicator, mailbox, overlap
from hostir.communicator import Communicator, CommunicatorTimeout
from hostir.runtime import agreement

ODD = 1

# The same answer on every rank of a job on one host.
pytestmark = pytest.mark.skipif(
    not mailbox._identity(), reason="no shared-memory mailbox here (not x86-64 Linux, or HOSTIR_MAILBOX=0)"
)


def split_into_nodes() -> bool:
    """Whether the launcher splits this job into nodes (a local size below
    the world size): its steps then stay on gloo, and the conftest keeps
    only the test below of this file."""
    launch = communicator.discover()
    return launch.local_size is not None and launch.local_size != launch.world_size

def _segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.endswith(".mailbox")}


@pytest.fixture
def comm(world):
    """The process-wide communicator (the executor's)."""
    return communicator.get()


def test_the_mailbox_follows_the_launchers_nodes(comm):
    # One node: the steps go through shared memory; nodes (even on one
    # machine, as the multi-node tests run them): over gloo.
    assert (comm.mailbox is None) == split_into_nodes()


def test_one_host_steps_go_through_shared_memory_and_leave_no_name(comm, world, device):
    assert comm.mailbox is not None
    assert comm.mailbox.path.startswith("/dev/shm/hostir")
    # Rank 0 removed the name once every rank had mapped the memory.
    assert not os.path.exists(comm.mailbox.path)
    fd = overlap.allgather_matmul(world.size)
    X = torch.randn(world.size, 3, 4, device=device)
    W = torch.randn(4, 5, device=device)
    inputs, expected = overlap.allgather_matmul_inputs(X, W, world.rank)
    for _ in range(3):
        (y,) = fd.execute(inputs)
        torch.testing.assert_close(y, expected)


def test_exchanges_pair_in_lockstep_with_skewed_ranks(comm, world):
    skew = random.Random(world.rank)
    for k in range(2000):
        if skew.random() < 0.02:
            time.sleep(skew.random() * 3e-3)
        mine = [k, world.rank, k * (world.rank + 3), -k, 2**40 + world.rank, world.rank ^ k]
        rows = comm.exchange_step(mine)
        assert rows == [[k, r, k * (r + 3), -k, 2**40 + r, r ^ k] for r in range(world.size)], k


def test_a_posted_step_is_collected_after_other_work(comm, world):
    """`post_step` writes this rank's words at once and waits for nothing
    (without a mailbox, across nodes, the all-gather runs at the post); its
    collect returns every rank's, whatever each did in between."""
    skew = random.Random(world.rank)
    for k in range(200):
        collect = comm.post_step([k, world.rank])
        if skew.random() < 0.1:
            time.sleep(skew.random() * 2e-3)  # work between the halves; the others' collects wait
        assert collect() == [[k, r] for r in range(world.size)], k


def test_steps_of_the_executor_read_every_rank(comm, world):
    steps = agreement.exchange_steps(comm, world.rank, 7, 11, 13, 12345)
    assert [s.rank for s in steps] == list(range(world.size))
    assert agreement.in_step(steps)


def test_two_communicators_do_not_collide(comm, world):
    other = Communicator(backend="gloo")
    try:
        assert other.mailbox is not None
        assert other.mailbox.path != comm.mailbox.path
        for k in range(200):
            a = comm.exchange_step([k, world.rank])
            b = other.exchange_step([-k, world.rank, 5])
            assert a == [[k, r] for r in range(world.size)]
            assert b == [[-k, r, 5] for r in range(world.size)]
    finally:
        other.shutdown()
    assert other.mailbox._closed


def test_a_rank_that_stops_exchanging_times_out_naming_it(comm, world, monkeypatch):
    monkeypatch.setenv("HOSTIR_TIMEOUT", "1.5")
    short = Communicator(backend="gloo")
    try:
        assert short.timeout == 1.5 and short.mailbox is not None
        assert short.exchange_step([1]) == [[1]] * world.size
        if world.rank != ODD:
            start = time.monotonic()
            with pytest.raises(CommunicatorTimeout, match=rf"timed out after 1.5 s: rank\(s\) {ODD} did not arrive"):
                short.exchange_step([2])
            assert time.monotonic() - start < 10
    finally:
        short.shutdown()


def test_a_rank_refusing_the_mailbox_keeps_every_rank_on_gloo(comm, world, monkeypatch):
    if world.rank == ODD:
        monkeypatch.setenv("HOSTIR_MAILBOX", "0")
    before = _segments()
    other = Communicator(backend="gloo")
    try:
        assert other.mailbox is None
        assert other.exchange_step([world.rank, 4]) == [[r, 4] for r in range(world.size)]
    finally:
        other.shutdown()
    assert _segments() <= before


def test_shutdown_leaves_nothing_in_dev_shm(comm, world):
    other = Communicator(backend="gloo")
    path = other.mailbox.path
    assert other.exchange_step([3]) == [[3]] * world.size
    other.shutdown()
    assert not os.path.exists(path)
    assert not [name for name in _segments() if name.split(".")[-3] == str(os.getpid())]
