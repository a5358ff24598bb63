"""Hand-built containers whose communications name tensors without
sharding annotations (nvFuser's SingleFusionSingleComm as written): an
Allgather and a ReduceScatter take their pieces along the outermost axis,
one per team rank, on both evaluators, against torch."""

from __future__ import annotations

import pytest
import torch

import hostir
from hostir import ir
from hostir.container import HostIrContainer
from hostir.runtime.streams import streams_for


def _tensor(c: HostIrContainer, shape) -> ir.TensorView:
    return ir.TensorView(c, [ir.IterDomain(c, ir.Scalar.constant(s)) for s in shape], torch.float32, ir.MemoryType.global_)


def _single_comm(kind: ir.CommunicationType, in_shape, out_shape, team, compute: bool):
    """x -> (x * 3, when `compute`) -> one communication -> out."""
    c = HostIrContainer()
    x = _tensor(c, in_shape)
    c.add_input(x)
    src = x
    if compute:
        src = _tensor(c, in_shape)
        c.push_back(ir.BinaryOp(src, "mul", x, ir.Scalar.constant(3.0)))
    out = _tensor(c, out_shape)
    red_op = "sum" if kind.reduces else None
    comm = ir.Communication(c.next_name("comm"), kind, out, src, tuple(team), red_op=red_op, backend="gloo")
    for e in (ir.Allocate(out), comm, ir.Wait(comm)):
        c.push_back(e)
    c.add_output(out)
    c.verify()
    return c, x


def _run(c, x, value, evaluator_class, device):
    comm = hostir.communicator.get()
    comm.ensure_groups(c.teams())
    ev = evaluator_class(c, streams=streams_for(device), device=device, communicator=comm)
    (out,) = ev.run({x: value})
    return out


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("compute", [False, True], ids=["comm_only", "compute_then_comm"])
def test_allgather_without_annotations(world, device, evaluator_class, rows, compute):
    D = world.size
    c, x = _single_comm(ir.CommunicationType.Allgather, [rows, 4], [D * rows, 4], range(D), compute)
    whole = torch.randn(D * rows, 4, device=device)
    mine = whole[world.rank * rows : (world.rank + 1) * rows].clone()
    out = _run(c, x, mine, evaluator_class, device)
    torch.testing.assert_close(out, whole * (3.0 if compute else 1.0))


@pytest.mark.parametrize("rows", [1, 2])
def test_reduce_scatter_without_annotations(world, device, evaluator_class, rows):
    D = world.size
    c, x = _single_comm(ir.CommunicationType.ReduceScatter, [D * rows, 4], [rows, 4], range(D), False)
    per_rank = [torch.randn(D * rows, 4) for _ in range(D)]
    out = _run(c, x, per_rank[world.rank].to(device), evaluator_class, device)
    total = torch.stack(per_rank).sum(0).to(device)
    torch.testing.assert_close(out, total[world.rank * rows : (world.rank + 1) * rows])


def test_allgather_over_a_reversed_team(world, device, evaluator_class):
    """Pieces follow the team's order, whatever the process group's."""
    D = world.size
    team = list(reversed(range(D)))
    c, x = _single_comm(ir.CommunicationType.Allgather, [1, 3], [D, 3], team, False)
    whole = torch.randn(D, 3, device=device)
    out = _run(c, x, whole[team.index(world.rank)].unsqueeze(0).clone(), evaluator_class, device)
    torch.testing.assert_close(out, whole)
