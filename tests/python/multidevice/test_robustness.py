"""Calls out of step, NaN in max/min reductions, a recreated communicator,
and a second thread: each ends in the right result or the same clear error
on every rank, never a hang or another call's data.
"""

from __future__ import annotations

import re
import threading

import pytest
import torch

import hostir
from hostir import DeviceMesh, FusionDefinition, ParallelType, RankMismatchError, shard_tensor
from hostir.runtime import protocol

ODD = 1  # the rank that behaves differently


def rand(shape, device) -> torch.Tensor:
    return torch.randn(tuple(shape)).to(device)


def allgather_fd(world):
    """x [D, m] sharded on axis 0 -> y = x * 2 replicated."""
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1])
        xg = fd.ops.set(x)
        y = fd.ops.mul(xg, 2.0)
        fd.add_output(y)
    for tv in (x, xg, y):
        tv.set_device_mesh(DeviceMesh(range(D)))
    x.axis(0).parallelize(ParallelType.mesh_x)
    return fd, x


def allreduce_fd(world):
    """x [D, n] sharded on axis 0 -> sum over it, replicated."""
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1])
        y = fd.ops.sum(x, [0])
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(D)))
    x.axis(0).parallelize(ParallelType.mesh_x)
    return fd, x


class Step:
    """One step of a training-like loop: fusion A (an Allgather), then
    fusion B (an Allreduce), each checked against eager torch."""

    def __init__(self, world, device):
        self.world, self.device = world, device
        self.a, self.xa = allgather_fd(world)
        self.b, self.xb = allreduce_fd(world)

    def run_a(self):
        full = rand([self.world.size, 3], self.device)
        out, = self.a.execute([shard_tensor(full, self.xa)])
        torch.testing.assert_close(out, full * 2)

    def run_b(self):
        full = rand([self.world.size, 4], self.device)
        out, = self.b.execute([shard_tensor(full, self.xb)])
        torch.testing.assert_close(out, full.sum(0))


def out_of_step(message: str, world) -> list[tuple[int, int, int]]:
    found = re.findall(r"rank (\d+) at call (\d+) of fusion (\d+)", message)
    assert len(found) == world.size, message
    assert "skipped or repeated an execute" in message, message
    return [tuple(map(int, f)) for f in found]


def still_in_step(world, device):
    """A new fusion runs correctly on every rank after the failure (the
    ranks drew different random numbers before it: seed them again)."""
    torch.manual_seed(7)
    Step(world, device).run_a()


def test_rank_that_skips_a_call_makes_every_rank_raise(world, device):
    step = Step(world, device)
    for _ in range(2):
        step.run_a()
        step.run_b()
    # Rank ODD skips fusion A in the third step (a branch, or an exception
    # it caught before calling execute): its B meets the others' A.
    with pytest.raises(RankMismatchError) as info:
        if world.rank == ODD:
            step.run_b()
        else:
            step.run_a()
    calls = out_of_step(str(info.value), world)
    a_number = calls[0][2]
    for rank, call, fusion in calls:
        assert call == 2, calls
        assert (fusion != a_number) == (rank == ODD), calls
    still_in_step(world, device)


def test_rank_that_repeats_a_call_makes_every_rank_raise(world, device):
    step = Step(world, device)
    step.run_a()
    step.run_b()
    step.run_a()
    # Rank ODD runs A again where the others run B.
    with pytest.raises(RankMismatchError) as info:
        if world.rank == ODD:
            step.run_a()
        else:
            step.run_b()
    calls = out_of_step(str(info.value), world)
    for rank, call, _ in calls:
        assert call == (2 if rank == ODD else 1), calls
    still_in_step(world, device)


# ------------------------------------------------------------ NaN and Inf


def _special(full: torch.Tensor) -> torch.Tensor:
    """`full` [D, D, 5] with NaN and ±Inf on one rank, on some, on all."""
    D = full.shape[0]
    full[0, 0, 0] = float("nan")  # first rank only
    full[D - 1, 1, 2] = float("nan")  # last rank only
    full[:, 1, 0] = float("nan")  # every rank
    full[:, 0, 1] = float("inf")
    full[:, 0, 3] = float("-inf")
    full[0, 1, 4], full[D - 1, 1, 4] = float("inf"), float("-inf")
    full[D - 1, 0, 4] = float("nan")  # with finite values elsewhere
    return full


def _mesh_fd(world, kind, out_sharded=False, root=None):
    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, D, -1])
        y = getattr(fd.ops, kind)(x, [0])
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh(range(D)))
    y.set_device_mesh(DeviceMesh(range(D) if root is None else [root]))
    x.axis(0).parallelize(ParallelType.mesh_x)
    if out_sharded:
        y.axis(1).parallelize(ParallelType.mesh_x)
    return fd, x, y


@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("comm", ["Allreduce", "ReduceScatter", "Reduce"])
def test_max_min_propagate_nan_and_inf_like_eager(world, device, kind, comm):
    D = world.size
    fd, x, y = _mesh_fd(world, kind, out_sharded=comm == "ReduceScatter", root=D - 1 if comm == "Reduce" else None)
    assert f"type={comm}," in fd.host_ir()
    full = _special(rand([D, D, 5], device))
    expected = full.amax(0) if kind == "max" else full.amin(0)
    assert expected.isnan().sum() == 4 and expected.isposinf().any() and expected.isneginf().any()
    out, = fd.execute([shard_tensor(full, x)])
    if comm == "Reduce" and world.rank != D - 1:
        assert out is None
        return
    if comm == "ReduceScatter":
        expected = shard_tensor(expected, y)
    torch.testing.assert_close(out, expected, equal_nan=True, rtol=0, atol=0)


# ------------------------------------------------------------ communicator


def test_fusion_keeps_working_after_the_communicator_is_recreated(world, device):
    fd, x = allgather_fd(world)
    full = rand([world.size, 3], device)
    out, = fd.execute([shard_tensor(full, x)])
    torch.testing.assert_close(out, full * 2)
    hostir.communicator.shutdown()
    full = rand([world.size, 3], device)
    out, = fd.execute([shard_tensor(full, x)])
    torch.testing.assert_close(out, full * 2)


def test_second_thread_on_the_communicator_is_refused(world, device):
    fd, x = allgather_fd(world)
    full = rand([world.size, 3], device)
    fd.execute([shard_tensor(full, x)])
    comm = hostir.communicator.get()
    errors = []
    # Another thread holds the communicator, as a concurrent execute would.
    held, release = threading.Event(), threading.Event()

    def hold():
        with protocol.of(comm).busy:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(30)
    try:
        fd.execute([shard_tensor(full, x)])
    except hostir.CommunicatorError as err:
        errors.append(str(err))
    finally:
        release.set()
        holder.join()
    assert errors and "another thread is running a multi-device execute" in errors[0], errors
    # Refused before it took a call number: the ranks are still in step.
    out, = fd.execute([shard_tensor(full, x)])
    torch.testing.assert_close(out, full * 2)
