"""Backend names are case-insensitive and printed one way; an axis takes
one parallel type."""

from __future__ import annotations

import pytest
import torch

import hostir
from hostir import FusionDefinition, ParallelType, ir
from hostir.container import HostIrContainer
from hostir.errors import DefinitionError


@pytest.mark.parametrize("written, printed", [("GLOO", "gloo"), ("Gloo", "gloo"), ("nccl", "NCCL"), ("Nccl", "NCCL"), ("CUDA", "cuda")])
def test_backend_names_are_case_insensitive_and_printed_one_way(written, printed):
    c = HostIrContainer()
    tv = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(4))], torch.float32, ir.MemoryType.global_)
    comm = ir.Communication(0, ir.CommunicationType.Allreduce, tv, tv, (0, 1), red_op="sum", backend=written)
    assert comm.backend == printed
    assert ir.backend_name(written) == printed
    p2p = ir.P2PCommunication(1, "send", tv, ir.Scalar.constant(1), backend=written)
    assert p2p.backend == printed


def test_an_unknown_backend_is_refused_where_it_is_written():
    c = HostIrContainer()
    tv = ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(4))], torch.float32, ir.MemoryType.global_)
    with pytest.raises(DefinitionError, match=r"unknown backend 'mpi'; expected one of NCCL, gloo, cuda \(in any case\)"):
        ir.Communication(0, ir.CommunicationType.Allreduce, tv, tv, (0, 1), red_op="sum", backend="mpi")


def test_lowering_and_schedules_take_any_case():
    from hostir.lower import lower
    from hostir.lower.schedule import parse

    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, 4])
        y = fd.ops.set(x)
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(hostir.DeviceMesh([0, 1]))
    x.axis(0).parallelize(ParallelType.mesh_x)
    lowered = lower(fd.fusion, backend="GLOO")
    assert lowered.backend == "gloo" and "backend=gloo)" in str(lowered.program)
    assert parse("ring:transport=nccl").transport == "NCCL"
    assert parse("ring:transport=Gloo").transport == "gloo"


@pytest.mark.parametrize("first, second", [(ParallelType.mesh_x, ParallelType.stream), (ParallelType.stream, ParallelType.mesh_x)])
def test_parallelizing_an_axis_twice_names_both_types(first, second):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 4])
        y = fd.ops.set(x)
        fd.add_output(y)
    y.axis(0).parallelize(first)
    with pytest.raises(DefinitionError, match=rf"already parallelized as {first.name}; it cannot also be {second.name}"):
        y.axis(0).parallelize(second)
    assert y.axis(0).parallel_type is first  # the first one stands
    y.axis(0).parallelize(first)  # the same type again is no change
    y.axis(0).parallelize(ParallelType.serial)
    y.axis(0).parallelize(second)  # back to serial first, then another
    assert y.axis(0).parallel_type is second
