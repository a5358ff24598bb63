"""The device axis as the stream axis, run: every decomposition of
AG+matmul and matmul+reduce-scatter (ring in both directions, collective,
sequential; 1 and 2 chunks per peer) on integer-valued random data,
compared exactly with eager torch on any number of ranks; chunk counts that
do not divide the rows rejected on every rank before any communication; the
machine model's choice shown in the dump. On CPU the ring runs over gloo;
on the GPU machines the same tests run with NCCL (and the copy-engine
transport by tools/check_cuda_transport.py)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from hostir import overlap
from hostir.errors import ScheduleError

# HOSTIR_TEST_TRANSPORT=cuda runs the rings over the copy-engine transport
# (tools/gpu_check.py --part suite does, on the GPU machines).
RING_TRANSPORT = f",transport={os.environ['HOSTIR_TEST_TRANSPORT']}" if os.environ.get("HOSTIR_TEST_TRANSPORT") else ""
SCHEDULES = [
    "ring:direction=1" + RING_TRANSPORT,
    "ring:direction=-1" + RING_TRANSPORT,
    "ring:chunks=2" + RING_TRANSPORT,
    "ring:chunks=2,direction=-1" + RING_TRANSPORT,
    "collective",
    "collective:chunks=2",
    "sequential",
]


def rand_int(shape, device) -> torch.Tensor:
    return torch.randint(-4, 4, tuple(shape)).to(torch.float32).to(device)


def exact(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def head_of(dump: str) -> str:
    """The decomposition named by the dump (the loop head or the collective)."""
    for line in dump.splitlines():
        if "(ring," in line or "(collective," in line or "schedule=(sequential" in line:
            return line.strip()
    raise AssertionError(f"no decomposition in the dump:\n{dump}")


@pytest.mark.parametrize("sched", SCHEDULES)
def test_allgather_matmul(world, device, sched):
    D, m, K, N = world.size, 4, 6, 5
    fd = overlap.allgather_matmul(D)
    inputs, expected = overlap.allgather_matmul_inputs(
        rand_int([D, m, K], device), rand_int([K, N], device), world.rank
    )
    (out,) = fd.execute(inputs, schedule=sched, number_of_streams=2)
    exact(out, expected)
    # Back to back: the second call reuses every buffer.
    (out,) = fd.execute(inputs, schedule=sched, number_of_streams=2)
    exact(out, expected)


@pytest.mark.parametrize("sched", SCHEDULES)
def test_gather_alone(world, device, sched):
    from hostir import DeviceMesh, FusionDefinition, ParallelType

    D = world.size
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[D, -1])
        y = fd.ops.set(x)
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(D)))
    x.axis(0).parallelize(ParallelType.mesh_x)
    y.axis(0).parallelize(ParallelType.stream)
    full = rand_int([D, 4], device)
    (out,) = fd.execute([full[world.rank : world.rank + 1]], schedule=sched)
    exact(out, full)


@pytest.mark.parametrize("sched", SCHEDULES)
def test_matmul_reduce_scatter(world, device, sched):
    D, m, k, N = world.size, 4, 3, 5
    fd = overlap.matmul_reduce_scatter(D)
    A, B = rand_int([D * m, D * k], device), rand_int([D * k, N], device)
    inputs, expected = overlap.matmul_reduce_scatter_inputs(A, B, D, world.rank)
    (out,) = fd.execute(inputs, schedule=sched, number_of_streams=2)
    exact(out.reshape(expected.shape), expected)


def test_preallocated_output_is_written_by_the_ring(world, device):
    D, m, K, N = world.size, 2, 3, 4
    fd = overlap.allgather_matmul(D)
    inputs, expected = overlap.allgather_matmul_inputs(
        rand_int([D, m, K], device), rand_int([K, N], device), world.rank
    )
    out = torch.full_like(expected, float("nan"))
    fd.execute(inputs, [out], schedule="ring:chunks=2")
    exact(out, expected)


def test_rows_that_do_not_split_into_the_chunks_are_rejected_on_every_rank(world, device):
    D, m, K, N = world.size, 3, 2, 2
    fd = overlap.allgather_matmul(D)
    inputs, _ = overlap.allgather_matmul_inputs(rand_int([D, m, K], device), rand_int([K, N], device), world.rank)
    # Every rank fails the same check: each raises the schedule's own error.
    with pytest.raises(ScheduleError, match=r"extent 3 does not split into 2 chunks per peer"):
        fd.execute(inputs, schedule="ring:chunks=2")
    # The ranks are still in step: the next call runs.
    inputs, expected = overlap.allgather_matmul_inputs(
        rand_int([D, 2, K], device), rand_int([K, N], device), world.rank
    )
    (out,) = fd.execute(inputs, schedule="ring:chunks=2")
    exact(out, expected)


def test_a_bad_schedule_is_rejected_on_every_rank(world, device):
    fd = overlap.allgather_matmul(world.size)
    inputs, _ = overlap.allgather_matmul_inputs(
        rand_int([world.size, 2, 2], device), rand_int([2, 2], device), world.rank
    )
    with pytest.raises(ScheduleError, match="unknown decomposition 'spiral'"):
        fd.execute(inputs, schedule="spiral")


def test_the_models_choice_runs_and_shows_in_the_dump(world, device, monkeypatch):
    monkeypatch.delenv("HOSTIR_SCHEDULE", raising=False)
    D, m, K, N = world.size, 2, 3, 4
    fd = overlap.allgather_matmul(D)
    inputs, expected = overlap.allgather_matmul_inputs(
        rand_int([D, m, K], device), rand_int([K, N], device), world.rank
    )
    (out,) = fd.execute(inputs)
    exact(out, expected)
    program = next(iter(fd.executor._programs.values())).container
    head = head_of(str(program))
    # Tiny shapes cannot pay for a ring, on CPUs or GPUs (the host's cost
    # per step alone is more than the whole call): the sequential program,
    # and why, with every candidate's predicted time.
    assert "schedule=(sequential, a ring would take" in head, head
    assert "ms: sequential " in head and "ring c=1 " in head, head


def test_forced_schedule_from_the_environment(world, device, monkeypatch):
    monkeypatch.setenv("HOSTIR_SCHEDULE", "ring:chunks=2,direction=-1" + RING_TRANSPORT)
    D, m, K, N = world.size, 2, 3, 4
    fd = overlap.allgather_matmul(D)
    inputs, expected = overlap.allgather_matmul_inputs(
        rand_int([D, m, K], device), rand_int([K, N], device), world.rank
    )
    (out,) = fd.execute(inputs)
    exact(out, expected)
    program = next(iter(fd.executor._programs.values())).container
    assert "(ring, chunks=2, direction=-1, transport=" in head_of(str(program))


def test_every_rank_plans_with_rank_0s_machine_model(world, monkeypatch):
    # Ranks that measured (or cached) different models would lower
    # different programs: the communicator's agreement gives each rank
    # rank 0's numbers.
    from hostir import communicator, machine, planner

    comm = communicator.live() or communicator.get()
    mine = machine.MachineModel(
        "gpu",
        gemm_tflops=100.0 + world.rank,
        copy_gbps=300.0,
        collective_gbps=150.0,
        step_us=10.0,
        host_ms=machine.HOST_MS,
    )
    measured = []
    monkeypatch.setattr(machine, "machine_model", lambda device: measured.append(device) or mine)
    monkeypatch.setattr(machine, "_placeholder", lambda device: dataclasses.replace(mine, gemm_tflops=-1.0))
    saved = getattr(comm, "_machine_model", None)
    try:
        agreed = machine.agree(comm)
        assert agreed.gemm_tflops == 100.0 and agreed.host_ms == machine.HOST_MS
        # Only rank 0 measures: ranks measuring at once would time each
        # other's traffic on the GPUs they share.
        assert len(measured) == (1 if world.rank == 0 else 0)
        assert planner.model_for(comm) is agreed
    finally:
        comm._machine_model = saved
