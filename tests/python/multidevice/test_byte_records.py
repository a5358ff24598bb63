"""Ranks exchange raw byte records (GPU UUIDs, CUDA IPC handles) through the
control group's int64 all-gather: every rank sees every rank's bytes, of any
length up to the record's capacity, byte for byte, and never a pickle."""

from __future__ import annotations

import pytest

from hostir import communicator
from hostir.communicator import CommunicatorArgumentError


def _record(rank: int) -> bytes:
    # Lengths differ per rank, and the bytes include NULs and high values.
    return bytes((rank * 37 + i) % 256 for i in range(3 + 5 * rank)) + b"\0\xff"


def test_all_gather_bytes_returns_every_rank_record(world):
    comm = communicator.get()
    got = comm.all_gather_bytes(_record(world.rank), 64)
    assert got == [_record(r) for r in range(world.size)]


def test_all_gather_bytes_rejects_a_record_over_capacity(world):
    comm = communicator.get()
    # Rejected locally, before any collective, on every rank alike.
    with pytest.raises(CommunicatorArgumentError, match="do not fit the 4-byte record"):
        comm.all_gather_bytes(b"12345", 4)
