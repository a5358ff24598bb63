"""`HostIrContainer.verify` on communications without sharding
annotations: the inferable forms pass, every other is refused with the
reason before anything runs."""

from __future__ import annotations

import pytest
import torch

from hostir import DeviceMesh, ParallelType, ir
from hostir.container import HostIrContainer, VerifyError


def _tensor(c, shape, mesh=None) -> ir.TensorView:
    extents = [ir.Scalar.symbolic(c) if s == -1 else ir.Scalar.constant(s) for s in shape]
    return ir.TensorView(c, [ir.IterDomain(c, e) for e in extents], torch.float32, ir.MemoryType.global_, mesh=mesh)


def _container(kind, in_shape, out_shape, team=(0, 1), root=None, meshes=(None, None)):
    c = HostIrContainer()
    x, y = _tensor(c, in_shape, meshes[0]), _tensor(c, out_shape, meshes[1])
    c.add_input(x)
    comm = ir.Communication(c.next_name("comm"), kind, y, x, team, root=root, red_op="sum" if kind.reduces else None)
    for e in (ir.Allocate(y), comm, ir.Wait(comm)):
        c.push_back(e)
    c.add_output(y)
    return c


AG, RS = ir.CommunicationType.Allgather, ir.CommunicationType.ReduceScatter


@pytest.mark.parametrize(
    "kind, in_shape, out_shape",
    [(AG, [1, 4], [2, 4]), (AG, [3, 4], [6, 4]), (RS, [2, 4], [1, 4]), (RS, [6, 5], [3, 5]), (AG, [1, -1], [2, -1])],
)
def test_inferable_forms_pass(kind, in_shape, out_shape):
    _container(kind, in_shape, out_shape).verify()


@pytest.mark.parametrize(
    "kind, in_shape, out_shape, message",
    [
        (AG, [1, 4], [3, 4], "must be the team's size 2 times that of .* \\(1\\), got 3"),
        (RS, [2, 4], [2, 4], "must be the team's size 2 times"),
        (AG, [-1, 4], [-1, 4], "outermost extents must be constants"),
        (AG, [1, 4], [2, 5], "axis 1 differs: 4 and 5"),
        (AG, [1, 4], [2, 4, 1], "same number of axes"),
    ],
)
def test_uninferable_forms_are_refused(kind, in_shape, out_shape, message):
    with pytest.raises(VerifyError, match=message):
        _container(kind, in_shape, out_shape).verify()


def test_gather_needs_annotations():
    c = _container(ir.CommunicationType.Gather, [1, 4], [2, 4], root=0)
    with pytest.raises(VerifyError, match="input of this Gather has no mesh_x axis.*put both tensors on a mesh"):
        c.verify()


def test_half_annotated_allgather_is_refused():
    mesh = DeviceMesh([0, 1])
    c = _container(AG, [1, 4], [2, 4], meshes=(mesh, mesh))
    with pytest.raises(VerifyError, match="has no mesh_x axis.*or annotate both"):
        c.verify()


def test_annotated_allgather_passes():
    c = HostIrContainer()
    mesh = DeviceMesh([0, 1])
    x, y = _tensor(c, [2, 4], mesh), _tensor(c, [2, 4], mesh)
    x.domain[0].parallelize(ParallelType.mesh_x)
    c.add_input(x)
    comm = ir.Communication(c.next_name("comm"), AG, y, x, (0, 1))
    for e in (ir.Allocate(y), comm, ir.Wait(comm)):
        c.push_back(e)
    c.add_output(y)
    c.verify()
