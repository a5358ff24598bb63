"""Calls whose program communicates on no rank wait for no rank, and are
still checked.

A fusion whose every tensor is sharded alike (an elementwise op on the
local pieces) posts no communication: once the ranks agreed on it, its
calls send no step and wait for no peer. Their steps are folded into a
chain that the next call that communicates exchanges, so a rank that
skipped or repeated such a call, or passed other shapes, is named on every
rank before that call moves any data. With check_ranks="every" each call
is checked in full, at once. One rank (rank 1) misbehaves; every rank must
raise the same error, and the ranks stay in step afterwards.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hostir import DeviceMesh, FusionDefinition, ParallelType, RankMismatchError, shard_tensor
from hostir.runtime import protocol

ODD = 1  # the rank that misbehaves


def doubled_fd(world):
    """x [D, n] sharded on axis 0 -> x + x, sharded alike: no communication."""
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1], dtype=torch.float32)
        y = fd.ops.add(x, x)
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(D)))
        tv.axis(0).parallelize(ParallelType.mesh_x)
    return fd, x


def allgather_fd(world):
    """x [D, n] sharded on axis 0 -> y replicated: an Allgather."""
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1], dtype=torch.float32)
        y = fd.ops.set(x)
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(D)))
    x.axis(0).parallelize(ParallelType.mesh_x)
    return fd, x


def doubled(world, device, fd, x, n=5, **kwargs):
    """One call of the quiet fusion on random data, checked against eager."""
    full = torch.randn(world.size, n, device=device)
    piece = shard_tensor(full, x)
    (y,) = fd.execute([piece], **kwargs)
    torch.testing.assert_close(y, piece + piece)


def gathered(world, device, fd, x, **kwargs):
    """One call of the Allgather on random data, checked against eager."""
    full = torch.randn(world.size, 3, device=device)
    (y,) = fd.execute([shard_tensor(full, x)], **kwargs)
    torch.testing.assert_close(y, full)


def both_raise(world, device, fd, x, match: str, **kwargs) -> str:
    full = torch.randn(world.size, 3, device=device)
    with pytest.raises(RankMismatchError, match=match) as info:
        fd.execute([shard_tensor(full, x)], **kwargs)
    return str(info.value)


def count_exchanges(monkeypatch) -> dict[str, int]:
    """How many full records and steps the ranks' protocol exchanges."""
    counts = {"full": 0, "steps": 0}
    full, steps = protocol.exchange, protocol.post_steps

    def counted_full(*args, **kwargs):
        counts["full"] += 1
        return full(*args, **kwargs)

    def counted_steps(*args, **kwargs):
        counts["steps"] += 1
        return steps(*args, **kwargs)

    monkeypatch.setattr(protocol, "exchange", counted_full)
    monkeypatch.setattr(protocol, "post_steps", counted_steps)
    return counts


def test_the_fusion_posts_no_communication(world):
    fd, _ = doubled_fd(world)
    assert protocol.quiet(fd.executor.host_program())


@pytest.mark.parametrize("path", ["prepared", "new_shape"])
def test_a_call_without_communication_does_not_wait_for_a_peer(world, device, monkeypatch, path):
    """Rank 1 makes its call only once rank 0's call returned (told through
    the rendezvous store, with a timeout): a call that waited for its peers
    would never return on rank 0, and rank 1 would time out waiting."""
    fd, x = doubled_fd(world)
    ag, ax = allgather_fd(world)
    doubled(world, device, fd, x)
    doubled(world, device, fd, x)
    gathered(world, device, ag, ax)
    counts = count_exchanges(monkeypatch)
    store = dist.distributed_c10d._get_default_store()
    key = f"quiet-call-returned/{path}"
    n = 5 if path == "prepared" else 7
    if world.rank == 0:
        doubled(world, device, fd, x, n=n)
        store.set(key, "1")
    else:
        store.wait([key], timedelta(seconds=20))
        doubled(world, device, fd, x, n=n)
    assert counts == {"full": 0, "steps": 0}
    # The next call that communicates checks the quiet call's step.
    gathered(world, device, ag, ax)
    assert counts == {"full": 0, "steps": 1}


def test_a_skipped_call_without_communication_raises_on_every_rank(world, device):
    fd, x = doubled_fd(world)
    ag, ax = allgather_fd(world)
    for _ in range(2):
        doubled(world, device, fd, x)
        gathered(world, device, ag, ax)
    doubled(world, device, fd, x)
    if world.rank != ODD:
        doubled(world, device, fd, x)
    message = both_raise(world, device, ag, ax, "out of step")
    assert "skipped or repeated" in message and f"rank {ODD} at its multi-device execute" in message, message
    # Rank 1 makes the call it skipped: its chain now holds a call the
    # others' no longer do, which the next step names; then all is even.
    if world.rank == ODD:
        doubled(world, device, fd, x)
    message = both_raise(world, device, ag, ax, "out of step")
    assert "other calls without communication" in message, message
    gathered(world, device, ag, ax)


def test_a_repeated_call_without_communication_raises_on_every_rank(world, device):
    fd, x = doubled_fd(world)
    ag, ax = allgather_fd(world)
    for _ in range(2):
        doubled(world, device, fd, x)
        gathered(world, device, ag, ax)
    doubled(world, device, fd, x)
    if world.rank == ODD:
        doubled(world, device, fd, x)
    message = both_raise(world, device, ag, ax, "out of step")
    assert "skipped or repeated" in message, message
    if world.rank != ODD:
        doubled(world, device, fd, x)
    both_raise(world, device, ag, ax, "other calls without communication")
    gathered(world, device, ag, ax)


def test_other_shapes_on_a_call_without_communication_raise_on_every_rank(world, device):
    """Rank 1 passes a shape the ranks never agreed on: its call runs on
    its own inputs (right for them), and the next call that communicates
    raises on every rank before it moves data."""
    fd, x = doubled_fd(world)
    ag, ax = allgather_fd(world)
    for _ in range(2):
        doubled(world, device, fd, x)
        gathered(world, device, ag, ax)
    # Both drawn on every rank, so that the random streams stay the same.
    theirs = torch.randn(world.size, 5, device=device)
    odd = shard_tensor(torch.randn(world.size, 9, device=device), x)
    piece = odd if world.rank == ODD else shard_tensor(theirs, x)
    (y,) = fd.execute([piece])
    torch.testing.assert_close(y, piece + piece)
    message = both_raise(world, device, ag, ax, "out of step")
    assert "other calls without communication" in message and f"ranks [{ODD}]" in message, message
    gathered(world, device, ag, ax)


def test_every_checks_a_call_without_communication_at_once(world, device, monkeypatch):
    """check_ranks="every" exchanges the full record on every call, quiet
    ones too: other shapes on one rank raise from that very call."""
    fd, x = doubled_fd(world)
    for _ in range(2):
        doubled(world, device, fd, x, check_ranks="every")
    counts = count_exchanges(monkeypatch)
    theirs = torch.randn(world.size, 5, device=device)
    odd = torch.randn(world.size, 9, device=device)
    full = odd if world.rank == ODD else theirs
    with pytest.raises(RankMismatchError, match="inputs differ across ranks") as info:
        fd.execute([shard_tensor(full, x)], check_ranks="every")
    assert f"rank {ODD} input 0 has shape [1, 9]" in str(info.value), str(info.value)
    assert counts == {"full": 1, "steps": 0}
    doubled(world, device, fd, x, check_ranks="every")
