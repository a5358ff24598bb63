"""FSDP-style programs lowered for one rank of 2, 3 and 4: each layer's
weight Allgather is posted before the previous layer computes, its Wait
stays before the linear that reads it, and the gathered weight is freed
right after that linear. Golden dumps (race-checked with every Wait and
Synchronize removed in turn); the same programs run under mpirun in
tests/python/multidevice/test_fsdp.py."""

from __future__ import annotations

import pytest

import hostir
from conftest import check_golden
from fsdp_programs import fsdp_backward, fsdp_mlp
from hostir import ir
from hostir.lower import lower
from hostir.lower.hoist_transfers import Hoisting


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_golden_dump_of_hoisted_allgathers(world_size):
    check_golden(f"fsdp_mlp_np{world_size}", lower(fsdp_mlp(world_size).fusion, rank=0, backend="gloo"))


def test_each_gathered_weight_is_freed_after_its_linear():
    program = lower(fsdp_mlp(2).fusion, rank=0, backend="gloo").program
    exprs = program.exprs
    for comm in [e for e in exprs if isinstance(e, ir.Communication)]:
        (linear,) = [e for e in exprs if isinstance(e, ir.LinearOp) and e.weight is comm.out]
        (free,) = [i for i, e in enumerate(exprs) if isinstance(e, ir.Deallocate) and e.buffer is comm.out]
        assert free > exprs.index(linear)
        assert not any(isinstance(e, ir.FUSION_OPS) for e in exprs[exprs.index(linear) + 1 : free])


def test_at_most_two_gathered_weights_are_live():
    lowered = lower(fsdp_mlp(4, layers=5).fusion, rank=1, backend="gloo")
    program = lowered.program
    live = peak = 0
    for e in program.exprs:
        if isinstance(e, ir.Allocate):
            live += 1
            peak = max(peak, live)
        elif isinstance(e, ir.Deallocate) and any(
            isinstance(c, ir.Communication) and c.out is e.buffer for c in program.exprs
        ):
            live -= 1
    assert peak == 2
    hoisted = [e for e in program.exprs if isinstance(e, ir.Communication) and e.schedule]
    assert len(hoisted) == 4 and all("hoisted above" in e.schedule for e in hoisted)
    assert hostir.check_races(program, lowered.rank) == []


def test_sequential_leaves_each_allgather_by_its_use():
    program = lower(fsdp_mlp(2).fusion, rank=0, backend="gloo", hoisting=Hoisting("sequential")).program
    exprs = program.exprs
    for i, e in enumerate(exprs):
        if isinstance(e, ir.Communication):
            assert isinstance(exprs[i + 1], ir.Wait) and exprs[i + 1].communication is e
            assert e.schedule == "sequential"


# ---------------------------------------------------------------- the backward


def _backward(world_size: int, layers: int = 3, rank: int = 0, hoisting=None):
    return lower(fsdp_backward(world_size, layers), rank=rank, backend="gloo", hoisting=hoisting)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_golden_dump_of_the_backward(world_size):
    # Race-checked with every Wait removed in turn (check_golden).
    check_golden(f"fsdp_mlp_backward_np{world_size}", _backward(world_size))


def _index(exprs, pred) -> int:
    (i,) = [i for i, e in enumerate(exprs) if pred(e)]
    return i


@pytest.mark.parametrize("world_size", [2, 4])
def test_weight_gradients_reduce_scatter_under_the_next_layers_backward(world_size):
    layers = 4
    lowered = _backward(world_size, layers, rank=world_size - 1)
    program = lowered.program
    exprs = program.exprs
    scatters = [e for e in exprs if isinstance(e, ir.Communication) and e.type.value == "ReduceScatter"]
    gathers = [e for e in exprs if isinstance(e, ir.Communication) and e.type.value == "Allgather"]
    assert len(scatters) == len(gathers) == layers  # the input gradient needs the first weight too
    for rs in scatters[:-1]:
        # Posted right after the matmul that makes its partial sums...
        post = exprs.index(rs)
        made = max(i for i, e in enumerate(exprs[:post]) if isinstance(e, ir.FUSION_OPS))
        assert any(v is rs.input for v in exprs[made].outputs())
        # ...and waited for only after compute of the next layer's backward.
        wait = _index(exprs, lambda e, rs=rs: isinstance(e, ir.Wait) and e.communication is rs)
        assert sum(isinstance(e, ir.FUSION_OPS) for e in exprs[post:wait]) >= 2
        assert "waited for" in rs.schedule
        # Its partial sums are freed right after its Wait.
        free = _index(exprs, lambda e, rs=rs: isinstance(e, ir.Deallocate) and e.buffer is rs.input)
        assert not any(isinstance(e, ir.FUSION_OPS) for e in exprs[wait:free])
    for ag in gathers[1:]:
        # Layer l-1's weight is re-gathered before layer l's gradients are computed.
        post = exprs.index(ag)
        use = _index(exprs, lambda e, ag=ag: isinstance(e, ir.FUSION_OPS) and any(v is ag.out for v in e.inputs()))
        assert sum(isinstance(e, ir.FUSION_OPS) for e in exprs[post:use]) >= 3
        assert "hoisted above" in ag.schedule
    assert hostir.check_races(program, lowered.rank) == []


def test_the_backward_holds_at_most_two_gathered_weights():
    program = _backward(4, layers=5, rank=2).program
    gathered = {e.out for e in program.exprs if isinstance(e, ir.Communication) and e.type.value == "Allgather"}
    live = peak = 0
    for e in program.exprs:
        if isinstance(e, ir.Allocate) and e.buffer in gathered:
            live += 1
            peak = max(peak, live)
        elif isinstance(e, ir.Deallocate) and e.buffer in gathered:
            live -= 1
    assert peak == 2


def test_the_sequential_backward_waits_for_each_communication_at_once():
    program = _backward(2, hoisting=Hoisting("sequential")).program
    exprs = program.exprs
    for i, e in enumerate(exprs):
        if isinstance(e, ir.Communication):
            assert isinstance(exprs[i + 1], ir.Wait) and exprs[i + 1].communication is e
