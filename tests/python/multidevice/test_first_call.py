"""A multi-device program's first call under HOSTIR_FAKE=auto: each new
input shape is dry-run once, on every rank, before any data moves; and a
hand-built communication may name its backend in any case."""

from __future__ import annotations

import pytest
import torch

import hostir
from hostir import DeviceMesh, FusionDefinition, ParallelType, ir
from hostir.container import HostIrContainer
from hostir.runtime.evaluator import HostIrEvaluator
from hostir.runtime.streams import streams_for


def _allgather_matmul(d: int) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[d, -1, 16])
        w = fd.define_tensor(shape=[16, 8])
        xg = fd.ops.set(x)
        y = fd.ops.matmul(xg, w)
        fd.add_output(y)
    for tv in (x, w, xg, y):
        tv.set_device_mesh(DeviceMesh(range(d)))
    x.axis(0).parallelize(ParallelType.mesh_x)
    return fd


def test_auto_dry_runs_each_new_shape_once_on_every_rank(world, device, monkeypatch):
    monkeypatch.setenv("HOSTIR_FAKE", "auto")
    d, rank = world.size, world.rank
    fd = _allgather_matmul(d)
    w = torch.randn(16, 8, device=device)
    for rows, runs in ((4, 1), (4, 1), (6, 2), (4, 2)):
        x = torch.randn(d, rows, 16, device=device)
        (y,) = fd.execute([x[rank : rank + 1], w])
        torch.testing.assert_close(y, x @ w)
        assert fd.executor.dry_runs == runs


def test_auto_dry_run_error_comes_before_any_data_moves(world, device, monkeypatch):
    monkeypatch.setenv("HOSTIR_FAKE", "auto")
    d = world.size
    fd = _allgather_matmul(d)
    ran = []

    def planted(*args, **kwargs):
        raise hostir.DryRunError("rank 0: planted failure")

    monkeypatch.setattr("hostir.analysis.dry_run.run_rank", planted)
    monkeypatch.setattr("hostir.runtime.evaluator.HostIrEvaluator.run", lambda *a, **k: ran.append(1))
    with pytest.raises(hostir.HostIrError, match="planted failure"):
        fd.execute([torch.randn(1, 4, 16, device=device), torch.randn(16, 8, device=device)])
    assert ran == []


def test_a_hand_built_communication_names_its_backend_in_any_case(world, device):
    d = world.size
    backend = "NCCL" if device.type == "cuda" else "GLOO"
    c = HostIrContainer()
    x = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(4))], torch.float32, ir.MemoryType.global_)
    y = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(4))], torch.float32, ir.MemoryType.global_)
    c.add_input(x)
    comm = ir.Communication(c.next_name("comm"), ir.CommunicationType.Allreduce, y, x, tuple(range(d)), red_op="sum", backend=backend)
    for e in (ir.Allocate(y), comm, ir.Wait(comm)):
        c.push_back(e)
    c.add_output(y)
    assert f"backend={backend.lower() if backend == 'GLOO' else 'NCCL'})" in str(c)
    communicator = hostir.communicator.get()
    communicator.ensure_groups(c.teams())
    evaluator = HostIrEvaluator(c, streams=streams_for(device), device=device, communicator=communicator, rank=world.rank)
    full = torch.randn(d, 4, device=device)
    (got,) = evaluator.run({x: full[world.rank].clone()})
    torch.testing.assert_close(got, full.sum(0))
